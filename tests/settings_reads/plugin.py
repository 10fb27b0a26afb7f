"""A mypy plugin that records every attribute access mypy resolves to a field of a class:
``<module>.<Class>.<field>`` of the class that declares it, with where it happened and
whether it was an assignment, one tab-separated line each, into the file named by
``TEMPER_SETTINGS_READS_OUT``. An access is matched to a field by its type, not by its
name: ``other.host`` does not count for ``ApiSettings.host``. Used by
``tests/test_settings_are_read.py``; mypy loads it by path."""

from __future__ import annotations

import os
from collections.abc import Callable

from mypy.nodes import MemberExpr
from mypy.plugin import AttributeContext, Plugin
from mypy.types import Type


class SettingsReads(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        out = os.environ.get("TEMPER_SETTINGS_READS_OUT")
        if not out:
            return None

        def record(ctx: AttributeContext) -> Type:
            node = ctx.context
            if isinstance(node, MemberExpr):  # not a declaration in the class body
                path = getattr(ctx.api, "path", "")
                with open(out, "a") as f:
                    f.write(f"{fullname}\t{path}\t{node.line}:{node.column}\t{int(ctx.is_lvalue)}\n")
            return ctx.default_attr_type

        return record


def plugin(version: str) -> type[Plugin]:
    return SettingsReads
