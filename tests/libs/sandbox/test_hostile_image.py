"""The hostile suite again, every sandbox on the Debian task image instead of the host's
/usr: containment must hold the same, and the image must stay unwritten."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from temper.sandbox import SandboxManager
from tests.libs.sandbox.conftest import IMAGE_CACHE, make_settings
from tests.libs.sandbox.test_hostile import *  # noqa: F403 - the same attacks, collected here too
from tests.libs.sandbox.test_hostile import attack, py, sh

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]


def tree_digest(root: Path) -> str:
    """Names, modes, sizes and link targets of a tree: what a write would change."""
    h = hashlib.sha256()
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            target = os.readlink(p) if os.path.islink(p) else ""
            h.update(f"{p}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{target}\n".encode())
    return h.hexdigest()


@pytest.fixture
def hostile_settings(sandbox_root: Path, debian_image: str):  # noqa: F811 - replaces test_hostile's
    return make_settings(sandbox_root, image_cache=IMAGE_CACHE, default_image=debian_image)


@pytest.fixture
async def manager(image_manager: SandboxManager) -> AsyncIterator[SandboxManager]:
    rootfs = IMAGE_CACHE / ("sha256-" + (image_manager.settings.default_image or "").split(":")[1])
    before = tree_digest(rootfs)
    yield image_manager
    assert tree_digest(rootfs) == before, "a sandbox changed the image"


async def test_the_image_is_what_runs_and_is_read_only(manager: SandboxManager) -> None:
    r = await attack(
        manager, sh("git --version && python3 -c 'import sys; print(sys.version_info[:2])' && ls /")
    )
    assert r.ok and r.stdout.startswith("git version"), r
    assert {"etc", "usr", "var", "workspace", "tmp"} <= set(r.stdout.split())
    code = (
        "import os\n"
        "for p in ['/usr/bin/git', '/etc/passwd', '/var/lib/x', '/root/x', '/home/x', '/opt/x', '/x']:\n"
        "    try:\n"
        "        open(p, 'a').write('x'); print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p, type(e).__name__)\n"
        "for p in ['/usr/bin/git', '/etc']:\n"
        "    try:\n"
        "        os.chmod(p, 0o777); print('CHMOD', p)\n"
        "    except OSError:\n"
        "        print('denied chmod', p)\n"
        "os.system('mount -o remount,rw / 2>&1; mount -o remount,rw /usr 2>&1; echo tried')\n"
        "open('/workspace/ok', 'w').write('fine'); print(open('/workspace/ok').read())"
    )
    r = await attack(manager, py(code))
    assert "WROTE" not in r.stdout and "CHMOD" not in r.stdout, r.stdout
    assert r.stdout.count("denied") == 9 and "fine" in r.stdout
