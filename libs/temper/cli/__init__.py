"""The ``temper`` command: the library's client commands, one module per area.

    temper submit|jobs|watch|transcript|pause|resume|cancel ...  jobs (:mod:`temper.cli.jobs`)
    temper admin create-tenant|plugins ...                        administration (jobs too)
    temper episodes|metrics|logs|export|checkpoints|compare ...   results (:mod:`temper.cli.results`)
    temper tasksets ... / temper rescore ...                      task sets and rewards (:mod:`temper.cli.tasksets`)
    temper images ...                                             task images (:mod:`temper.cli.images`)
    temper environments ...                                       tenant packages (:mod:`temper.cli.environments`)

The server and key come from ``--url``/``--key`` or ``TEMPER_URL``/``TEMPER_API_KEY``. The
installed ``temper`` command is ``services/cli.py``, which adds the commands that need the
services (``temper run``, ``temper serve``).
"""

from __future__ import annotations

import argparse
import sys

from temper.cli import environments, images, jobs, results, tasksets
from temper.cli.common import AddCommands
from temper.client import ApiError


def build_parser(*extensions: AddCommands) -> argparse.ArgumentParser:
    """The client commands; each of ``extensions`` adds more to the subcommand parsers
    (the services' CLI adds ``temper run``)."""
    parser = argparse.ArgumentParser(prog="temper", description="Temper: RL post-training for LLM agents")
    parser.add_argument(
        "--url", default=None, help="dispatcher URL (env TEMPER_URL; default http://127.0.0.1:8000)"
    )
    parser.add_argument("--key", default=None, help="API key (env TEMPER_API_KEY)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_commands in (jobs.add_commands, results.add_commands, tasksets.add_commands,
                         images.add_commands, environments.add_commands, *extensions):  # fmt: skip
        add_commands(sub)
    return parser


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


if __name__ == "__main__":
    sys.exit(main())
