"""A job's spec as tracking parameters: nested keys flattened with dots
(``algorithm.learning_rate``), lists and mappings kept whole as JSON, and the value of
every key that names a secret replaced, so no tracking server ever holds one."""

from __future__ import annotations

import json
import re
from typing import Any

REDACTED = "[redacted]"
# word parts of a key (split at . _ - and camelCase) that name a secret
_SECRET_WORDS = {
    "secret",
    "secrets",
    "token",
    "password",
    "passwd",
    "credential",
    "credentials",
    "auth",
    "apikey",
}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("signing", "key")}


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key)
    return [w for w in re.split(r"[\s._\-/]+", spaced.lower()) if w]


def is_secret(key: str) -> bool:
    """Whether ``key`` names a secret (``api_key``, ``hf_token``, ``dbPassword``; not ``max_tokens``)."""
    words = _words(key)
    if any(w in _SECRET_WORDS for w in words) or words == ["key"]:
        return True
    return any(pair in _SECRET_PAIRS for pair in zip(words, words[1:], strict=False))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _scrub(value: Any) -> Any:
    """``value`` with the value of every secret-named key inside it redacted."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret(str(k)) else _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


Scalar = str | int | float | bool | None


def flatten_values(spec: dict[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """:func:`flatten` with its scalars kept typed (W&B's config holds numbers as numbers):
    ``{"algorithm": {"learning_rate": 1e-5}}`` -> ``{"algorithm.learning_rate": 1e-05}``; a
    list (or an empty mapping) is one value, its JSON; secrets are redacted alike."""
    out: dict[str, Scalar] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if is_secret(str(key)):
            out[name] = REDACTED
        elif isinstance(value, dict) and value:
            out.update(flatten_values(value, f"{name}."))
        elif value is None or isinstance(value, str | int | float | bool):
            out[name] = value
        else:
            out[name] = _text(_scrub(value))
    return out


def flatten(spec: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"algorithm": {"learning_rate": 1e-5}}`` -> ``{"algorithm.learning_rate": "1e-05"}``;
    a list (or an empty mapping) is one parameter, its JSON; ``None`` is ``"None"``."""
    return {k: "None" if v is None else _text(v) for k, v in flatten_values(spec, prefix).items()}
