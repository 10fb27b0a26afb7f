"""Read an uploaded package (a gzip'd tar) in memory: nothing is extracted to disk and
nothing in it runs here. Its files are text (programs and data), split into the public
ones, which start the agent's workspace, and the hidden ones, which only the grading
sandbox holds."""

from __future__ import annotations

import io
import posixpath
import tarfile
from dataclasses import dataclass

from temper.envpkg.models import Manifest, ManifestError, parse_manifest

MANIFEST = "environment.yaml"
MAX_ARCHIVE_BYTES = 8 << 20
MAX_FILES = 500
MAX_FILE_BYTES = 1 << 20
MAX_PUBLIC_BYTES = 256 << 10  # the public files are pinned into every job spec that uses the package


class PackageError(ValueError):
    """The archive itself is unusable (not a tar.gz, unsafe paths, too large, binary files)."""


@dataclass
class Package:
    manifest: Manifest
    public: dict[str, str]  # path -> text: the agent's starting workspace
    hidden: dict[str, str]  # path inside the hidden directory -> text


def read_files(data: bytes) -> dict[str, str]:
    """Every regular file of the archive as text; :class:`PackageError` for anything else."""
    if len(data) > MAX_ARCHIVE_BYTES:
        raise PackageError(f"the archive is larger than {MAX_ARCHIVE_BYTES >> 20} MiB")
    files: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                path = posixpath.normpath(member.name.removeprefix("./"))
                if member.isdir() or path == ".":
                    continue
                if path.startswith(("/", "..")) or "\\" in path:
                    raise PackageError(f"{member.name}: paths must stay inside the package")
                if not member.isreg():
                    raise PackageError(
                        f"{member.name}: only regular files and directories (no links or devices)"
                    )
                if member.size > MAX_FILE_BYTES:
                    raise PackageError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
                if len(files) >= MAX_FILES:
                    raise PackageError(f"more than {MAX_FILES} files")
                handle = tar.extractfile(member)
                raw = handle.read(member.size) if handle is not None else b""
                try:
                    files[path] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise PackageError(f"{path}: not UTF-8 text (packages hold text files only)") from None
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        if isinstance(exc, PackageError):
            raise
        raise PackageError(f"not a gzip'd tar archive: {exc}") from None
    return files


def read_package(data: bytes) -> Package:
    """The package in ``data``: its manifest (:class:`ManifestError` if it does not
    validate) and its files split into public and hidden."""
    files = read_files(data)
    text = files.pop(MANIFEST, None)
    if text is None:
        raise ManifestError([("(package)", None, f"no {MANIFEST} at the top of the archive")])
    manifest = parse_manifest(text)
    prefix = manifest.hidden + "/"
    hidden = {p.removeprefix(prefix): t for p, t in files.items() if p.startswith(prefix)}
    public = {p: t for p, t in files.items() if not p.startswith(prefix)}
    size = sum(len(t.encode()) for t in public.values())
    if size > MAX_PUBLIC_BYTES:
        raise PackageError(
            f"the public files take {size} bytes; at most {MAX_PUBLIC_BYTES} (put data the agent need not see in {prefix})"
        )
    return Package(manifest, public, hidden)


def pack(files: dict[str, str]) -> bytes:
    """A gzip'd tar of ``files`` (path -> text): what ``temper environments push`` uploads."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for path, text in sorted(files.items()):
            raw = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(raw), 0o644
            tar.addfile(info, io.BytesIO(raw))
    return out.getvalue()
