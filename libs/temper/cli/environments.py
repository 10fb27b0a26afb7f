"""``temper environments push DIR | list | show NAME VERSION``: tenant environment packages."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from temper.cli.common import client, out
from temper.envpkg.archive import pack

SKIP = {"__pycache__", ".git", ".DS_Store"}


def pack_dir(root: Path) -> bytes:
    """The package directory as the tar.gz the API takes (text files; caches and .git left out)."""
    if not (root / "environment.yaml").is_file():
        raise FileNotFoundError(f"{root}/environment.yaml: a package directory holds its manifest at its top")
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not SKIP.intersection(rel.parts):
            try:
                files[rel.as_posix()] = path.read_text()
            except UnicodeDecodeError:
                raise FileNotFoundError(f"{path}: not UTF-8 text (packages hold text files only)") from None
    return pack(files)


def cmd_push(args: argparse.Namespace) -> int:
    with client(args) as api:
        meta = api.push_environment(pack_dir(Path(args.dir)))
    out(f"{meta['name']} {meta['version']}")
    sys.stderr.write(
        f"uploaded: tools {', '.join(meta['tools'])}; rubric {meta['rubric']}; "
        f"{len(meta['public_files'])} public and {meta['hidden_files']} hidden files\n"
    )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with client(args) as api:
        items: list[dict[str, Any]] = api.environments()
    for m in items:
        out(f"{m['name']}\t{m['version']}\t{m['uploaded_at'][:19].replace('T', ' ')}\t{m['description']}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with client(args) as api:
        out(json.dumps(api.environment(args.name, args.version), indent=2))
    return 0


def add_commands(sub: Any) -> None:
    env = sub.add_parser("environments", help="tenant environment packages (docs/environments.md)")
    env_sub = env.add_subparsers(dest="environments_command", required=True, metavar="COMMAND")
    p = env_sub.add_parser("push", help="upload the package in DIR (environment.yaml at its top)")
    p.add_argument("dir")
    p.set_defaults(func=cmd_push)
    p = env_sub.add_parser("list", help="your packages")
    p.set_defaults(func=cmd_list)
    p = env_sub.add_parser("show", help="one package: manifest and files")
    p.add_argument("name")
    p.add_argument("version")
    p.set_defaults(func=cmd_show)
