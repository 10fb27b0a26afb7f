"""The ``temper`` command (``[project.scripts]``): the library's client commands
(:mod:`temper.cli`) plus those that compose services:

    temper run spec.yaml [--runs-dir D] [--run-id ID]   one job end to end in this process
    temper serve [--data-dir D] [--host H] [--port P]   API, console and every worker in this process
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from temper import cli as client_cli
from temper import eventloop
from temper.jobspec import SpecError
from temper.runtime import StartupError


def cmd_run(args: argparse.Namespace) -> int:
    from services.embedded import runner  # the five services in this process: import only when asked

    try:
        result = eventloop.run(runner.run(Path(args.spec), runs_dir=Path(args.runs_dir), run_id=args.run_id))
    except SpecError as exc:
        sys.stderr.write("error: the spec does not validate:\n")
        for field, message in exc.errors:
            sys.stderr.write(f"  {field}: {message}\n")
        return 2
    except (StartupError, eventloop.UnknownEventLoop) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    return 0 if result.state == "completed" else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from services.embedded import serve  # every service in this process: import only when asked

    try:
        eventloop.run(serve.serve(Path(args.data_dir), host=args.host, port=args.port, out=sys.stdout))
    except (StartupError, eventloop.UnknownEventLoop) as exc:
        sys.stderr.write(f"temper serve: {exc}\n")
        return 2
    except KeyboardInterrupt:
        pass
    from temper.runtime import exit_after_stop

    exit_after_stop(0)  # everything stopped in order; the interpreter's finalization can hang
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "run", help="run a job end to end in this process (embedded mode: SQLite, in-process bus)"
    )
    p.add_argument("spec", help="a job spec with a local: block naming its task-set file")
    p.add_argument("--runs-dir", default="runs", help="where runs/<run-id>/ is written")
    p.add_argument("--run-id", help="name of the run directory (default: a timestamp)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser(
        "serve",
        help="the REST API, console and every worker in this process (embedded mode: SQLite, "
        "in-process bus, no Redis); prints the console's URL and, on the first start, an admin key",
    )
    p.add_argument(
        "--data-dir", default=".temper", help="database, objects, logs and admin key (a runs/<id> dir works)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    return client_cli.build_parser(add_commands)


def main(argv: list[str] | None = None) -> int:
    return client_cli.main(argv, parser=build_parser())


if __name__ == "__main__":
    sys.exit(main())
