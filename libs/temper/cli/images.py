"""``temper images``: build or import a task image and publish it to the object store
named by the settings (``TEMPER_STORAGE__*``); prints the digest a task or job names."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from temper.sandbox.images import (
    ImageError,
    build_debian,
    build_dockerfile,
    check_published,
    digest_of,
    flatten_oci,
    publish,
)


def _store() -> Any:
    from temper.runtime import load_settings
    from temper.storage import S3Store, make_store

    settings = load_settings()
    store = make_store(settings)
    return store, settings.sandbox.image_prefix, isinstance(store, S3Store)


async def _publish(blob: bytes, source: dict[str, Any]) -> str:
    store, prefix, s3 = _store()
    if s3:
        await store.ensure_bucket()
    return await publish(store, blob, source=source, prefix=prefix)


def cmd_build_debian(args: argparse.Namespace) -> int:
    packages = [p for p in (args.packages or "").split(",") if p]
    install = [p for p in (args.install or "").split(",") if p]
    sys.stderr.write(f"building Debian {args.release} with {packages or 'python3 only'} (mmdebstrap)...\n")
    wheels = Path(args.wheels) if args.wheels else None
    blob = build_debian(args.release, packages, mirror=args.mirror, wheels=wheels, install=install)
    if args.output:  # a file, for `temper run`'s local.image: published into each run's own store
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_bytes(blob)
        sys.stderr.write(f"wrote {len(blob) / 1e6:.1f} MB to {args.output}\n")
        sys.stdout.write(digest_of(blob) + "\n")
        return 0
    source = {
        "debian": args.release,
        "packages": ["python3", *packages],
        **({"python": install} if install else {}),
    }
    digest = asyncio.run(_publish(blob, source))
    sys.stderr.write(f"published {len(blob) / 1e6:.1f} MB\n")
    sys.stdout.write(digest + "\n")
    return 0


def cmd_import_oci(args: argparse.Namespace) -> int:
    blob = flatten_oci(Path(args.archive).read_bytes())
    digest = asyncio.run(_publish(blob, {"oci": Path(args.archive).name}))
    sys.stdout.write(digest + "\n")
    return 0


def cmd_build_dockerfile(args: argparse.Namespace) -> int:
    file = Path(args.file) if args.file else None
    sys.stderr.write(f"building {args.context} with the local Docker engine...\n")
    blob = build_dockerfile(Path(args.context), dockerfile=file)
    digest = asyncio.run(_publish(blob, {"dockerfile": str(file or Path(args.context) / "Dockerfile")}))
    sys.stderr.write(f"published {len(blob) / 1e6:.1f} MB\n")
    sys.stdout.write(digest + "\n")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    async def check() -> dict[str, Any]:
        store, prefix, _ = _store()
        return await check_published(store, args.digest, prefix=prefix)

    sys.stdout.write(json.dumps(asyncio.run(check()), indent=2) + "\n")
    return 0


def _guard(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except ImageError as e:
            sys.stderr.write(f"error: {e}\n")
            return 1

    return run


def add_commands(sub: Any) -> None:
    """Register ``images`` on the ``temper`` parser's subparsers."""
    im = sub.add_parser("images", help="build, import and check sandbox task images (object storage)")
    im_sub = im.add_subparsers(dest="images_command", required=True, metavar="IMAGES_COMMAND")
    p = im_sub.add_parser("build-debian", help="a Debian release + packages (mmdebstrap), published")
    p.add_argument("release", help="e.g. bookworm")
    p.add_argument("--packages", help="comma-separated Debian packages (python3 is always added)")
    p.add_argument("--mirror", help="a Debian mirror URL (default: mmdebstrap's)")
    p.add_argument("--wheels", help="a directory of wheels built on this host, for --install")
    p.add_argument(
        "--install", help="comma-separated Python packages pip installs in the image from --wheels only"
    )
    p.add_argument("--output", help="write the image to this file instead of publishing it")
    p.set_defaults(func=_guard(cmd_build_debian))
    p = im_sub.add_parser(
        "import-oci", help="an OCI archive (docker save / OCI layout tar), flattened and published"
    )
    p.add_argument("archive")
    p.set_defaults(func=_guard(cmd_import_oci))
    p = im_sub.add_parser(
        "build-dockerfile", help="a Dockerfile built by the local Docker engine, flattened and published"
    )
    p.add_argument("context", help="the build context (a directory holding the Dockerfile)")
    p.add_argument("--file", "-f", help="the Dockerfile, if not CONTEXT/Dockerfile")
    p.set_defaults(func=_guard(cmd_build_dockerfile))
    p = im_sub.add_parser("check", help="is this image published? prints its manifest")
    p.add_argument("digest")
    p.set_defaults(func=_guard(cmd_check))
