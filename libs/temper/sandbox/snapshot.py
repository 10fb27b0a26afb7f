"""Workspace snapshots: a gzip'd tar of the workspace, put to object storage and
unpacked into a new sandbox (on this worker or another one)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

SNAPSHOT_CONTENT_TYPE = "application/gzip"


class SnapshotError(ValueError):
    """A snapshot that cannot be restored (corrupt, too big, unsafe member)."""


def pack(workspace: Path) -> bytes:
    """Tar the workspace. Symlinks are stored as links (never followed), so a link the
    sandbox made to a host path cannot pull host files into the archive."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=3) as tar:
        for root, dirs, files in os.walk(workspace):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                full = Path(root) / name
                rel = full.relative_to(workspace).as_posix()
                info = tar.gettarinfo(str(full), arcname=rel)
                if not (info.isfile() or info.isdir() or info.issym()):
                    continue  # fifos, sockets, devices: not workspace content
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if info.isfile():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _member_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's ``data`` filter, except that a symlink may point anywhere: its target is
    resolved inside the sandbox, never followed here. The link itself must land inside
    the workspace, and ``data`` refuses any later member whose real path leaves it."""
    if member.issym():
        dest = os.path.realpath(dest)
        parent = os.path.realpath(os.path.join(dest, os.path.dirname(member.name)))
        if member.name.startswith("/") or not (parent == dest or parent.startswith(dest + os.sep)):
            raise tarfile.OutsideDestinationError(member, os.path.join(dest, member.name))
        return member.replace(uid=None, gid=None, uname=None, gname=None, deep=False)  # type: ignore[arg-type]  # None: keep the archive's
    return tarfile.data_filter(member, dest)


def unpack(data: bytes, workspace: Path, *, max_bytes: int, owner: tuple[int, int] | None) -> None:
    """Unpack a snapshot into an empty workspace. Members are checked by tarfile's
    ``data`` filter (no absolute paths, no writes through links, no devices, no setuid bits) and
    their total size is bounded by the workspace size."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            total = sum(m.size for m in members if m.isfile())
            if total > max_bytes:
                raise SnapshotError(f"snapshot holds {total} bytes, more than the workspace's {max_bytes}")
            tar.extractall(workspace, members=members, filter=_member_filter)
    except (tarfile.TarError, EOFError, OSError) as e:
        if isinstance(e, tarfile.FilterError):
            raise SnapshotError(f"unsafe snapshot member: {e}") from e
        raise SnapshotError(f"cannot unpack snapshot: {e}") from e
    if owner is not None:
        for root, dirs, files in os.walk(workspace):
            for name in dirs + files:
                os.lchown(os.path.join(root, name), *owner)
