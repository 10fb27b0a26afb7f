"""Images from a Dockerfile: ``temper images build-dockerfile`` builds with the local Docker
engine, flattens the ``docker save`` archive and publishes it. The build test is marked
``docker``: scripts/run_tests.sh deselects it (never skips it) where ``docker info`` fails."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from temper.sandbox.images import ImageCache, ImageError, build_dockerfile
from temper.storage.local import LocalStore

BASE = "temper-base:bookworm"  # scripts/compose/base_image.sh makes it (no registry is reachable)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dockerfile_is_built_flattened_and_published(tmp_path: Path, monkeypatch, capsys) -> None:
    from temper.cli import main

    docker = shutil.which("docker")
    assert docker, "the docker marker needs the docker client (scripts/compose/engine.sh)"
    assert subprocess.run([docker, "image", "inspect", BASE], capture_output=True).returncode == 0, (
        f"{BASE} is missing: bash scripts/compose/base_image.sh"
    )
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "hello.txt").write_text("from the build context\n")
    # The minbase image has no python3 (publish needs one): a stand-in, enough to publish.
    (ctx / "python3").write_text("#!/bin/sh\nexit 0\n")
    (ctx / "Dockerfile").write_text(
        f"FROM {BASE}\nADD hello.txt /opt/task/hello.txt\nCOPY python3 /usr/bin/python3\n"
        "RUN rm /etc/issue\n"  # a deletion: a whiteout in docker's layer
    )
    monkeypatch.setenv("TEMPER_STORAGE__KIND", "local")
    monkeypatch.setenv("TEMPER_STORAGE__ROOT", str(tmp_path / "objects"))

    assert main(["images", "build-dockerfile", str(ctx)]) == 0, capsys.readouterr().err
    digest = capsys.readouterr().out.strip()
    assert digest.startswith("sha256:")
    assert main(["images", "check", digest]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == {"dockerfile": str(ctx / "Dockerfile")}

    cache = ImageCache(tmp_path / "cache", LocalStore(tmp_path / "objects"))
    root = asyncio.run(cache.ensure(digest)).rootfs
    assert (root / "opt/task/hello.txt").read_text() == "from the build context\n"
    assert (root / "etc/debian_version").is_file()  # the FROM image's files
    assert not (root / "etc/issue").exists()  # deleted by RUN, whited out
    tags = subprocess.run([docker, "images", "-q", "temper-image-build"], capture_output=True, text=True)
    assert tags.stdout.strip() == ""  # the temporary tag is gone


def test_no_reachable_engine_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(ImageError, match=r"no Docker engine is reachable|not found: a Dockerfile needs"):
        build_dockerfile(tmp_path)
    with pytest.raises(ImageError, match="not found: a Dockerfile needs a Docker engine"):
        build_dockerfile(tmp_path, docker="no-such-docker-client")
    with pytest.raises(ImageError, match="no Dockerfile in"):
        build_dockerfile(tmp_path / "empty")
