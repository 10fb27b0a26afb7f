"""``temper tasksets ...`` and ``temper rescore``: the subcommands of the ``temper`` CLI
that deal with task sets and rewards (registered by :func:`add_commands`).

    temper tasksets upload FILE [--name N] [--no-validate] [--wait]
    temper tasksets import FORMAT PATH [--columns F=C,..] [--output FILE | --name N --wait]
                                       FORMAT: humaneval, mbpp, gsm8k, temper, harbor
    temper tasksets list
    temper tasksets show ID [--json]
    temper tasksets validate ID            queue validation, a progress bar, then the per-task table
    temper rescore TENANT JOB --weights tests_passed=1,coverage=0.2   (talks to DB + store)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from temper.cli.common import client


def progress_bar(current: int, total: int, *, width: int = 30, label: str = "") -> str:
    total = max(total, 1)
    filled = int(width * min(current, total) / total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {current}/{total} {label}".rstrip()


def wait_for_validation(
    api: Any, taskset_id: str, *, interval: float = 1.0, timeout: float = 3600, stream: TextIO | None = None
) -> dict[str, Any]:
    """Poll ``GET /v1/tasksets/{id}`` drawing a progress bar until every task has a status."""
    out = stream or sys.stderr
    deadline = time.monotonic() + timeout
    while True:
        view = api._call("GET", f"/v1/tasksets/{taskset_id}", params={"tasks": "false"})
        prog = view.get("progress", {})
        counts = view.get("counts", {})
        label = f"valid {counts.get('valid', 0)}  invalid {counts.get('invalid', 0)}"
        out.write("\r" + progress_bar(prog.get("current", 0), prog.get("total", 0), label=label))
        out.flush()
        if view.get("status") == "validated" or (
            prog.get("total") and prog.get("current") == prog.get("total")
        ):
            out.write("\n")
            return view  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            out.write("\n")
            raise TimeoutError(f"validation of {taskset_id} did not finish in {timeout:.0f}s")
        time.sleep(interval)


def cmd_upload(args: argparse.Namespace) -> int:
    path = Path(args.file)
    ctype = "application/yaml" if path.suffix in (".yaml", ".yml") else "application/x-ndjson"
    with client(args) as api:
        view = api._call(
            "POST", "/v1/tasksets", content=path.read_bytes(), headers={"content-type": ctype},
            params={"name": args.name or path.stem, "validate": str(not args.no_validate).lower(),
                    **held_out_params(args)},
        )  # fmt: skip
        sys.stdout.write(view["id"] + "\n")
        sys.stderr.write(
            f"uploaded {view['task_count']} tasks as {view['id']}{held_out_words(view)}; {validation_line(view)}\n"
        )
        if args.wait and view.get("validation", {}).get("queued"):
            wait_for_validation(api, view["id"])
    return 0


def held_out_params(args: argparse.Namespace) -> dict[str, Any]:
    """The upload's split (docs/tasks-and-rewards.md, "Held-out tasks") as query parameters."""
    out: dict[str, Any] = {}
    if args.held_out is not None:
        out.update(held_out_fraction=args.held_out, held_out_seed=args.held_out_seed)
    if args.held_out_field is not None:
        out.update(held_out_field=args.held_out_field, held_out_values=args.held_out_values or "")
    return out


def held_out_words(view: dict[str, Any]) -> str:
    split = view.get("held_out")
    return f" ({split['held_out']} held out)" if split else ""


def add_split_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--held-out", type=float, metavar="FRACTION",
        help="hold out this share of the tasks (chosen by --held-out-seed): never trained on, for evaluation",
    )  # fmt: skip
    p.add_argument("--held-out-seed", type=int, default=0, help="the seed of --held-out's choice")
    p.add_argument(
        "--held-out-field", metavar="FIELD",
        help="hold out the tasks whose metadata FIELD is one of --held-out-values",
    )  # fmt: skip
    p.add_argument("--held-out-values", metavar="V1,V2", help="comma-separated values of --held-out-field")


def validation_line(view: dict[str, Any]) -> str:
    """What happened to the upload's validation, in words."""
    validation = view.get("validation") or {}
    if validation.get("queued"):
        return "validation started (temper tasksets show ID shows its progress)"
    if "error" in validation:
        return f"validation could not start: {validation['error']}"
    return "not validated (--no-validate); temper tasksets validate ID starts it"


IMPORT_FORMATS = ("humaneval", "mbpp", "gsm8k", "temper", "harbor", "repo")


def import_tasks(fmt: str, path: str, columns: str = "", limit: int | None = None) -> list[Any]:
    """The tasks of a local file or directory in one of :data:`IMPORT_FORMATS`. Raises
    ``ValueError`` (a ``DatasetError``, ``HarborError`` or ``TaskFormatError``) naming
    the file, line and column of the first problem."""
    from temper.tasks import datasets, harbor
    from temper.tasks.models import TaskFormatError, parse_tasks

    if fmt == "harbor":
        tasks = harbor.import_task_dirs(path)
    elif fmt == "repo":  # a directory of repository tasks (temper.tasks.repositories)
        from temper.tasks.repositories import repository_tasks

        if not Path(path).is_dir():
            raise ValueError(f"{path}: not a directory of repository tasks")
        tasks = repository_tasks(Path(path))
        if not tasks:
            raise ValueError(f"{path}: no repository task (a directory with task.json) in it")
    elif fmt == "temper":
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"{path}: no such file")
        try:
            tasks = parse_tasks(file.read_text(encoding="utf-8"), filename=file.name)
        except TaskFormatError as exc:
            raise ValueError(f"{file.name}: {exc}") from None
    else:
        tasks = datasets.import_file(fmt, path, datasets.parse_columns(columns, fmt))
    return tasks[:limit] if limit is not None else tasks


def _limits(task: Any) -> dict[str, Any]:
    return task.limits.model_dump(exclude_unset=True) if task.limits is not None else {}


def cmd_import(args: argparse.Namespace) -> int:
    from temper.limits import SandboxLimits
    from temper.tasks.models import dump_jsonl

    if args.columns and args.format in ("temper", "harbor", "repo"):
        sys.stderr.write(
            f"temper tasksets import: --columns is for humaneval, mbpp and gsm8k, not {args.format}\n"
        )
        return 2
    try:
        tasks = import_tasks(args.format, args.path, args.columns or "", args.limit)
        if args.image:  # every task's sandboxes (episodes, grading, validation) on this image
            tasks = [
                t.model_copy(
                    update={"limits": SandboxLimits.model_validate({**_limits(t), "image": args.image})}
                )
                for t in tasks
            ]
    except ValueError as exc:
        sys.stderr.write(f"temper tasksets import: {exc}\n")
        return 2
    if args.output:
        Path(args.output).write_text(dump_jsonl(tasks), encoding="utf-8")
        sys.stderr.write(f"wrote {len(tasks)} {args.format} tasks to {args.output}\n")
        return 0
    name = args.name or Path(args.path.rstrip("/")).stem
    with client(args) as api:
        view = api._call(
            "POST", "/v1/tasksets", content=dump_jsonl(tasks).encode(),
            headers={"content-type": "application/x-ndjson"},
            params={"name": name, "validate": str(not args.no_validate).lower(), "source": f"import:{args.format}",
                    **held_out_params(args)},
        )  # fmt: skip
        sys.stdout.write(view["id"] + "\n")
        sys.stderr.write(
            f"imported {view['task_count']} {args.format} tasks as {view['id']}{held_out_words(view)}; "
            f"{validation_line(view)}\n"
        )
        if args.wait and view.get("validation", {}).get("queued"):
            view = wait_for_validation(api, view["id"])
            write_validation_table(api, view["id"], sys.stdout)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with client(args) as api:
        for ts in api._call("GET", "/v1/tasksets"):
            counts = " ".join(f"{k}={v}" for k, v in sorted(ts.get("counts", {}).items()))
            sys.stdout.write(
                f"{ts['id']}  {ts['name']:<24} {ts['status']:<10} {ts['task_count']:>6}  {counts}\n"
            )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with client(args) as api:
        view = api._call("GET", f"/v1/tasksets/{args.id}")
    if args.json:
        sys.stdout.write(json.dumps(view, indent=2) + "\n")
        return 0
    sys.stdout.write(f"{view['id']}  {view['name']}  {view['status']}  {view.get('counts')}\n")
    width = shutil.get_terminal_size((100, 20)).columns
    for t in view.get("tasks", []):
        reasons = "; ".join(t.get("reasons") or [])
        line = f"  {t['status']:<8} {t['key']:<24} {reasons}"
        sys.stdout.write(line[:width] + "\n")
    return 0


def _run(run: dict[str, Any] | None) -> str:
    if not run or run.get("reward") is None:
        return "-"
    return f"{run['reward']:g} {'pass' if run.get('passed') else 'fail'}"


def validation_table(tasks: list[dict[str, Any]], *, width: int = 120) -> str:
    """One line per task: status, the oracle's and the do-nothing agent's reward and
    verdict (from ``tasks.validation``), and why an invalid task is invalid."""
    lines = [f"{'task':<28} {'status':<8} {'oracle':<10} {'do-nothing':<10} reasons"]
    for t in tasks:
        runs = t.get("validation") or {}
        reasons = "; ".join(t.get("reasons") or [])
        line = f"{t['key']:<28} {t['status']:<8} {_run(runs.get('oracle')):<10} {_run(runs.get('null')):<10} {reasons}"
        lines.append(line[:width].rstrip())
    return "\n".join(lines) + "\n"


def write_validation_table(api: Any, taskset_id: str, out: TextIO) -> dict[str, Any]:
    view: dict[str, Any] = api._call("GET", f"/v1/tasksets/{taskset_id}")
    width = shutil.get_terminal_size((120, 20)).columns
    out.write(validation_table(view.get("tasks", []), width=max(width, 80)))
    counts = view.get("counts", {})
    out.write(f"{counts.get('valid', 0)} valid, {counts.get('invalid', 0)} invalid of {view['task_count']}\n")
    return view


def cmd_validate(args: argparse.Namespace) -> int:
    with client(args) as api:
        api._call("POST", f"/v1/tasksets/{args.id}/validate")
        wait_for_validation(api, args.id, interval=args.interval)
        view = write_validation_table(api, args.id, sys.stdout)
    return 0 if view.get("counts", {}).get("invalid", 0) == 0 else 3


def parse_weights(text: str) -> dict[str, float]:
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        weights[name.strip()] = float(value) if value else 1.0
    return weights


def cmd_rescore(args: argparse.Namespace) -> int:
    from temper.db import Database
    from temper.rewards import Scorer
    from temper.rewards.rescore import rescore_job
    from temper.rewards.runner import scoring_sandbox_settings
    from temper.sandbox import SandboxManager
    from temper.settings import get_settings
    from temper.storage import make_store
    from temper.tasks.service import load_task

    async def run() -> list[Any]:
        settings = get_settings()
        db = Database(settings.db)
        manager = SandboxManager(scoring_sandbox_settings(settings.sandbox), store=make_store(settings))
        await manager.start()

        async def load(task_id: str) -> Any:
            async with db.session() as s:
                return await load_task(s, task_id)

        try:
            return await rescore_job(store=make_store(settings), scorer=Scorer(manager), tenant=args.tenant,
                                     job_id=args.job, weights=parse_weights(args.weights), load_task=load)  # fmt: skip
        finally:
            await manager.close()
            await db.dispose()

    results = asyncio.run(run())
    for r in results:
        missing = f"  missing: {','.join(r.missing)}" if r.missing else ""
        sys.stdout.write(f"{r.episode_id}  {r.old_reward:.4f} -> {r.reward:.4f}  ({r.source}){missing}\n")
    if results:
        mean_old = sum(r.old_reward for r in results) / len(results)
        mean_new = sum(r.reward for r in results) / len(results)
        sys.stdout.write(f"{len(results)} episodes; mean reward {mean_old:.4f} -> {mean_new:.4f}\n")
    return 0


def add_commands(sub: Any) -> None:
    """Register ``tasksets`` and ``rescore`` on the ``temper`` parser's subparsers."""
    ts = sub.add_parser("tasksets", help="upload, list, show and validate task sets")
    ts_sub = ts.add_subparsers(dest="tasksets_command", required=True, metavar="TASKSETS_COMMAND")
    p = ts_sub.add_parser("upload", help="upload a task set (JSONL or YAML)")
    p.add_argument("file")
    p.add_argument("--name")
    p.add_argument("--no-validate", action="store_true")
    p.add_argument("--wait", action="store_true", help="show validation progress until it ends")
    add_split_arguments(p)
    p.set_defaults(func=cmd_upload)
    p = ts_sub.add_parser(
        "import", help="import HumanEval, MBPP, GSM8K, Temper or Harbor tasks from local files"
    )
    p.add_argument("format", choices=IMPORT_FORMATS)
    p.add_argument("path", help="a .jsonl/.parquet file (temper: .jsonl/.yaml), or a task directory (harbor)")
    p.add_argument(
        "--columns", help="FIELD=COLUMN,... where the file's column names differ from the dataset's"
    )
    p.add_argument("--limit", type=int, help="import only the first N tasks")
    p.add_argument("--image", help="run the tasks on this task image (a digest from `temper images`)")
    p.add_argument("--output", help="write the tasks as Temper JSONL to this file instead of uploading")
    p.add_argument("--name")
    p.add_argument("--no-validate", action="store_true")
    p.add_argument("--wait", action="store_true", help="wait for validation and print its table")
    add_split_arguments(p)
    p.set_defaults(func=cmd_import)
    p = ts_sub.add_parser("list", help="task sets of your tenant")
    p.set_defaults(func=cmd_list)
    p = ts_sub.add_parser("show", help="a task set with each task's status")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)
    p = ts_sub.add_parser("validate", help="(re)validate a task set, with a progress bar")
    p.add_argument("id")
    p.add_argument("--interval", type=float, default=1.0)
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("rescore", help="re-score a finished job's trajectories with new weights (DB + store)")
    p.add_argument("tenant")
    p.add_argument("job")
    p.add_argument("--weights", required=True, help="name=weight,... e.g. tests_passed=1,coverage=0.2")
    p.set_defaults(func=cmd_rescore)
