"""Fixtures for the sandbox library's tests: a manager on the real bwrap backend with
small limits, checked for leftovers (processes, mounts, cgroups) when it closes."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from temper.sandbox import BackendKind, SandboxLimits, SandboxManager, SandboxSettings

SMALL = SandboxLimits(
    wall_s=3,
    cpu_s=2,
    memory_mb=96,
    pids=48,
    output_bytes=64 << 10,
    file_size_mb=4,
    open_files=64,
    workspace_mb=8,
)


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    # Under /tmp (mode 1777): pytest's own tmp_path is 0700 and the sandbox uid must reach it.
    root = Path("/tmp") / f"temper-sbx-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def make_settings(root: Path, **overrides: object) -> SandboxSettings:
    fields = {"backend": BackendKind.bwrap, "pool_size": 1, "default_limits": SMALL, "workspace_root": root}
    fields.update(overrides)
    return SandboxSettings(**fields)


def cgroup_members(tag: str) -> list[int]:
    """Pids whose cgroup path mentions ``tag``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cgroup") as f:
                if tag in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def sandbox_mounts(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if str(root) in line]


async def assert_clean_close(manager: SandboxManager) -> None:
    cgroups = manager.cgroups
    tag = f"temper-{os.getpid()}/"
    await manager.close()
    assert manager.leaked == 0
    assert sandbox_mounts(manager.root) == [], "workspace mounts left behind"
    if cgroups is not None:
        assert cgroups.leftovers() == [], "sandbox cgroups left behind"
        assert cgroup_members(tag) == [], "processes left in sandbox cgroups"
    assert not manager.root.exists() or not any(manager.root.iterdir())


@pytest.fixture
async def manager(sandbox_root: Path) -> AsyncIterator[SandboxManager]:
    m = SandboxManager(make_settings(sandbox_root))
    await m.start()
    yield m
    await assert_clean_close(m)


# --- task images --------------------------------------------------------------------------
# The Debian image (python3 + git) is built once by mmdebstrap (about a minute) and kept in
# ~/.cache/temper/images; its unpacked copy is kept, by digest, in an image cache under /tmp
# (the sandbox uid must reach it; /root is 0700). Both are content-addressed, so reuse is safe.
DEBIAN_RELEASE, DEBIAN_PACKAGES = "bookworm", ("git",)
IMAGE_BLOBS = Path.home() / ".cache" / "temper" / "images"
IMAGE_CACHE = Path("/tmp/temper-image-cache")


def debian_blob() -> bytes:
    from temper.sandbox.images import build_debian

    path = IMAGE_BLOBS / f"{DEBIAN_RELEASE}-{'-'.join(DEBIAN_PACKAGES)}.tar.gz"
    if not path.exists():
        if shutil.which("mmdebstrap") is None:
            pytest.skip("mmdebstrap is not installed (scripts/setup_system.sh test)")
        IMAGE_BLOBS.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_bytes(build_debian(DEBIAN_RELEASE, DEBIAN_PACKAGES))
        tmp.rename(path)
    return path.read_bytes()


@pytest.fixture(scope="session")
def image_store(tmp_path_factory: pytest.TempPathFactory):
    """An object store (a LocalStore directory) holding the published Debian image."""
    import asyncio

    from temper.sandbox.images import publish
    from temper.storage.local import LocalStore

    store = LocalStore(tmp_path_factory.mktemp("image-store"))
    blob = debian_blob()
    digest = asyncio.run(publish(store, blob, source={"debian": DEBIAN_RELEASE, "packages": DEBIAN_PACKAGES}))
    return store, digest


@pytest.fixture(scope="session")
def debian_image(image_store) -> str:
    """The digest of the Debian image, published and unpacked in IMAGE_CACHE."""
    from temper.sandbox.images import ImageCache

    store, digest = image_store
    cache = ImageCache(IMAGE_CACHE, store)
    if cache.cached(digest) is None:
        cache.install(digest, debian_blob())
    return digest


@pytest.fixture
async def image_manager(sandbox_root: Path, image_store, debian_image: str) -> AsyncIterator[SandboxManager]:
    """A manager whose sandboxes (the pool's too) run on the Debian image by default."""
    store, _ = image_store
    m = SandboxManager(
        make_settings(sandbox_root, image_cache=IMAGE_CACHE, default_image=debian_image), store=store
    )
    await m.start()
    yield m
    await assert_clean_close(m)
