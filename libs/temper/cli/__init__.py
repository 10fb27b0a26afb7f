"""The ``temper`` command: the library's client commands, one module per area.

    temper submit|jobs|watch|transcript|pause|resume|cancel ...  jobs (:mod:`temper.cli.jobs`)
    temper admin create-tenant|plugins ...                        administration (jobs too)
    temper episodes|metrics|logs|export|checkpoints|compare ...   results (:mod:`temper.cli.results`)
    temper eval|evals ...                                         evaluations (:mod:`temper.cli.evaluations`)
    temper tasksets ... / temper rescore ...                      task sets and rewards (:mod:`temper.cli.tasksets`)
    temper images ...                                             task images (:mod:`temper.cli.images`)
    temper environments ...                                       tenant packages (:mod:`temper.cli.environments`)

The server and key come from ``--url``/``--key`` or ``TEMPER_URL``/``TEMPER_API_KEY``. The
installed ``temper`` command is ``services/cli.py``, which adds the commands that need the
services (``temper run``, ``temper serve``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from temper.cli import environments, evaluations, images, jobs, results, tasksets
from temper.cli.common import AddCommands
from temper.client import ApiError


def build_parser(*extensions: AddCommands) -> argparse.ArgumentParser:
    """The client commands; each of ``extensions`` adds more to the subcommand parsers
    (the services' CLI adds ``temper run``)."""
    parser = argparse.ArgumentParser(prog="temper", description="Temper: RL post-training for LLM agents")
    _global_flags(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_commands in (jobs.add_commands, results.add_commands, evaluations.add_commands,
                         tasksets.add_commands, images.add_commands, environments.add_commands,
                         *extensions):  # fmt: skip
        add_commands(sub)
    for command in _every_subcommand(parser):  # temper jobs --url U works as temper --url U jobs
        _global_flags(command, default=argparse.SUPPRESS)
    return parser


def _global_flags(parser: argparse.ArgumentParser, *, default: object) -> None:
    """``--url`` and ``--key``; a subcommand's copy leaves the value alone when not given
    (``SUPPRESS``), so the flag may come before or after the subcommand."""
    names = {a for action in parser._actions for a in action.option_strings}
    if "--url" not in names:
        parser.add_argument(
            "--url", default=default, help="dispatcher URL (env TEMPER_URL; default http://127.0.0.1:8000)"
        )
    if "--key" not in names:
        parser.add_argument("--key", default=default, help="API key (env TEMPER_API_KEY)")


def _every_subcommand(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *_every_subcommand(child)]
    return found


def main(argv: list[str] | None = None, *, parser: argparse.ArgumentParser | None = None) -> int:
    args = (parser or build_parser()).parse_args(argv)
    try:
        return int(args.func(args))
    except ApiError as exc:
        sys.stderr.write(
            f"error: {exc.detail}\n" if exc.status == 0 else f"error ({exc.status}): {exc.detail}\n"
        )
        for field, message in exc.errors:
            sys.stderr.write(f"  {field}: {message}\n")
        return 1
    except FileNotFoundError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except BrokenPipeError:
        # the reader went away (temper episodes J | head): stop quietly, as other tools do
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaces the closed pipe for the exit flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
