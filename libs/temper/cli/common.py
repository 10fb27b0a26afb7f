"""What every ``temper`` subcommand shares: the API client from ``--url``/``--key``, plain
output, and argparse number types."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

from temper.client import TemperClient

AddCommands = Callable[[Any], None]  # adds subcommands to the parser's subparsers


def out(text: str = "", stream: TextIO | None = None) -> None:
    (stream or sys.stdout).write(text + "\n")


def client(args: argparse.Namespace) -> TemperClient:
    return TemperClient(args.url, args.key)


def number(kind: type[float] | type[int], above: float | None = None) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` that is at least 0 (or more than ``above``)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if (above is not None and value <= above) or value < 0:
            bound = f"more than {above:g}" if above is not None else "at least 0"
            raise argparse.ArgumentTypeError(f"{text} must be {bound}")
        return value

    return parse
