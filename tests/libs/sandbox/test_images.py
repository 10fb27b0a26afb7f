"""Task images without a sandbox: OCI archives flattened layer by layer (whiteouts
honoured), publishing to and checking against a real object store, and the worker's
cache refusing corrupt or unsafe images."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from temper.sandbox.images import (
    ImageCache,
    ImageError,
    blob_key,
    check_published,
    digest_of,
    flatten_oci,
    manifest_key,
    publish,
)
from temper.storage.local import LocalStore

pytestmark = pytest.mark.timeout(60)


def tar_of(entries: list[tuple[str, str | bytes | None]], *, gz: bool = True) -> bytes:
    """A tar from (name, content): bytes/str a file, None a directory, 'link:X' a symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(content, str) and content.startswith("link:"):
                info.type, info.linkname = tarfile.SYMTYPE, content[5:]
                tar.addfile(info)
            else:
                data = content.encode() if isinstance(content, str) else content
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


BASE = [
    ("usr", None),
    ("usr/bin", None),
    ("usr/bin/python3", "link:python3.11"),
    ("usr/bin/python3.11", "#!elf"),
    ("etc", None),
    ("etc/keep", "k"),
    ("etc/gone", "g"),
    ("opt", None),
    ("opt/app", None),
    ("opt/app/old1", "1"),
    ("opt/app/sub", None),
    ("opt/app/sub/old2", "2"),
    ("var", None),
    ("var/dir", None),
    ("var/dir/inner", "i"),
]
TOP = [
    ("etc/.wh.gone", b""),  # deletes etc/gone below
    ("opt/app/.wh..wh..opq", b""),  # empties opt/app below ...
    ("opt/app/new", "n"),  # ... but this layer's own files stay
    ("var/.wh.dir", b""),  # a whole directory
    ("etc/keep", "k2"),  # replaced
]


def docker_save(layers: list[bytes]) -> bytes:
    files: list[tuple[str, str | bytes | None]] = []
    names = []
    for i, layer in enumerate(layers):
        names.append(f"l{i}/layer.tar")
        files += [(f"l{i}", None), (f"l{i}/layer.tar", layer)]
    files.append(("manifest.json", json.dumps([{"Config": "c.json", "Layers": names}])))
    return tar_of(files, gz=False)


def oci_layout(layers: list[bytes], *, corrupt: bool = False) -> bytes:
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> str:
        d = hashlib.sha256(data).hexdigest()
        blobs[d] = data
        return f"sha256:{d}"

    layer_digests = [add(layer) for layer in layers]
    manifest = add(json.dumps({"layers": [{"digest": d} for d in layer_digests]}).encode())
    if corrupt:
        blobs[layer_digests[0].split(":")[1]] = b"not the bytes it claims"
    files: list[tuple[str, str | bytes | None]] = [("blobs", None), ("blobs/sha256", None)]
    files += [(f"blobs/sha256/{d}", data) for d, data in blobs.items()]
    files.append(("index.json", json.dumps({"manifests": [{"digest": manifest}]})))
    files.append(("oci-layout", '{"imageLayoutVersion": "1.0.0"}'))
    return tar_of(files, gz=False)


def members(blob: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def read(blob: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        f = tar.extractfile(name)
        assert f is not None
        return f.read()


@pytest.mark.parametrize("archive", [docker_save, oci_layout])
def test_flatten_applies_layers_and_whiteouts(archive) -> None:
    flat = flatten_oci(archive([tar_of(BASE), tar_of(TOP, gz=False)]))
    names = set(members(flat))
    assert {"usr/bin/python3", "etc/keep", "opt/app", "opt/app/new", "var"} <= names
    assert "etc/gone" not in names  # whiteout
    assert not {"opt/app/old1", "opt/app/sub", "opt/app/sub/old2"} & names  # opaque directory
    assert not {"var/dir", "var/dir/inner"} & names  # a whited-out directory goes with its contents
    assert not any(".wh." in n for n in names)
    assert read(flat, "etc/keep") == b"k2"
    assert members(flat)["usr/bin/python3"].linkname == "python3.11"


def test_flatten_refuses_what_is_not_an_image() -> None:
    with pytest.raises(ImageError, match="neither manifest.json"):
        flatten_oci(tar_of([("hello", "x")], gz=False))
    with pytest.raises(ImageError, match="does not match its digest"):
        flatten_oci(oci_layout([tar_of(BASE)], corrupt=True))
    with pytest.raises(ImageError, match="not a tar"):
        flatten_oci(b"garbage")


async def test_publish_check_and_pull(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    blob = flatten_oci(docker_save([tar_of(BASE)]))
    digest = await publish(store, blob, source={"kind": "oci", "name": "test"})
    assert digest == digest_of(blob)
    manifest = await check_published(store, digest)
    assert manifest["size"] == len(blob) and manifest["source"]["name"] == "test"

    cache = ImageCache(tmp_path / "cache", store)
    image = await cache.ensure(digest)
    assert (image.rootfs / "etc/keep").read_text() == "k" and image.python_name() == "python3.11"
    assert digest in cache.pulls
    assert (await cache.ensure(digest)).rootfs == image.rootfs  # cached: no second pull
    mode = (image.rootfs / "etc/keep").stat().st_mode
    assert not mode & (stat.S_IWGRP | stat.S_IWOTH)

    missing = "sha256:" + "0" * 64
    with pytest.raises(ImageError, match=f"image {missing} is not in object storage"):
        await check_published(store, missing)
    with pytest.raises(ImageError, match="invalid image digest"):
        await check_published(store, "latest")
    await store.delete(blob_key(digest))
    with pytest.raises(ImageError, match="blob is missing"):
        await check_published(store, digest)
    await store.put(manifest_key(digest), b"{not json")
    with pytest.raises(ImageError, match="unreadable manifest"):
        await check_published(store, digest)


async def test_publish_refuses_an_image_without_python(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ImageError, match="no /usr/bin/python3"):
        await publish(store, tar_of([("etc", None), ("etc/x", "1")]), source={})
    with pytest.raises(ImageError, match="not a gzip'd tar"):
        await publish(store, b"plain bytes", source={})


async def test_cache_refuses_corrupt_and_unsafe_images(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    blob = tar_of(BASE)
    digest = await publish(store, blob, source={})
    await store.put(blob_key(digest), blob[:-10] + b"0123456789")  # bit rot in the store
    cache = ImageCache(tmp_path / "cache", store)
    with pytest.raises(ImageError, match="is corrupt"):
        await cache.ensure(digest)
    assert not cache.root.exists() or not any(cache.root.iterdir()), "nothing half-unpacked is left"

    escape = tmp_path / "escaped"
    for hostile in (
        [("usr/bin/python3", "x"), ("../escaped", "x")],
        [("usr/bin/python3", "x"), ("lnk", f"link:{tmp_path}"), ("lnk/escaped", "x")],
    ):
        evil = tar_of(hostile)
        with pytest.raises(ImageError, match="cannot be unpacked"):
            cache.install(digest_of(evil), evil)
        assert not escape.exists()

    # Hard links out of the image, device nodes and setuid bits.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        py = tarfile.TarInfo("usr/bin/python3")
        py.size, py.mode = 1, 0o4755
        py.uid, py.gid, py.uname, py.gname = 65534, 65534, "nobody", "nogroup"  # the sandbox uid
        tar.addfile(py, io.BytesIO(b"x"))
        dev = tarfile.TarInfo("dev/sda")
        dev.type, dev.devmajor, dev.devminor = tarfile.BLKTYPE, 8, 0
        tar.addfile(dev)
        hard = tarfile.TarInfo("shadow")
        hard.type, hard.linkname = tarfile.LNKTYPE, "../../../../etc/shadow"
        tar.addfile(hard)
    evil = buf.getvalue()
    with pytest.raises(ImageError, match="cannot be unpacked"):
        cache.install(digest_of(evil), evil)
    buf2 = io.BytesIO(gzip.decompress(evil))
    with tarfile.open(fileobj=buf2) as t:  # the same without the hard link unpacks, tamed
        kept = [m for m in t.getmembers() if not m.islnk()]
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w:gz") as t2:
            for m in kept:
                t2.addfile(m, t.extractfile(m) if m.isfile() else None)
    tame = out.getvalue()
    root = cache.install(digest_of(tame), tame)
    assert not (root / "dev/sda").exists()
    st = os.stat(root / "usr/bin/python3")
    assert not st.st_mode & stat.S_ISUID
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (0, 0), "an image file owned by the sandbox uid"


def test_cli_imports_checks_and_refuses(tmp_path: Path, monkeypatch, capsys) -> None:
    from temper.cli import main

    monkeypatch.setenv("TEMPER_STORAGE__KIND", "local")
    monkeypatch.setenv("TEMPER_STORAGE__ROOT", str(tmp_path / "objects"))
    archive = tmp_path / "image.tar"
    archive.write_bytes(docker_save([tar_of(BASE), tar_of(TOP)]))
    assert main(["images", "import-oci", str(archive)]) == 0
    digest = capsys.readouterr().out.strip()
    assert digest.startswith("sha256:")
    assert main(["images", "check", digest]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == {"oci": "image.tar"}
    assert main(["images", "check", "sha256:" + "1" * 64]) == 1
    assert "is not in object storage" in capsys.readouterr().err
    archive.write_bytes(tar_of([("etc", None)], gz=False))
    assert main(["images", "import-oci", str(archive)]) == 1
    assert "not an OCI image archive" in capsys.readouterr().err


@pytest.mark.s3
async def test_publish_check_and_pull_on_the_real_s3_server(tmp_path: Path, s3_settings, unique) -> None:
    from temper.storage import S3Store

    s3 = S3Store(s3_settings)
    await s3.ensure_bucket()
    prefix = f"test-{unique}/sandbox-images"
    try:
        blob = flatten_oci(oci_layout([tar_of(BASE), tar_of(TOP)]))
        digest = await publish(s3, blob, source={"oci": "test"}, prefix=prefix)
        assert (await check_published(s3, digest, prefix=prefix))["size"] == len(blob)
        image = await ImageCache(tmp_path / "cache", s3, prefix=prefix).ensure(digest)
        assert (image.rootfs / "opt/app/new").read_text() == "n"
        with pytest.raises(ImageError, match="not in object storage"):
            await check_published(s3, "sha256:" + "2" * 64, prefix=prefix)
    finally:
        for key in await s3.list(f"test-{unique}/"):
            await s3.delete(key)


async def test_a_manager_preloads_its_images_at_start(tmp_path: Path) -> None:
    import shutil
    import uuid

    from temper.sandbox import SandboxManager, SandboxSettings

    store = LocalStore(tmp_path / "store")
    digest = await publish(store, tar_of(BASE), source={})
    root = Path("/tmp") / f"temper-pre-{uuid.uuid4().hex[:8]}"  # the sandbox uid must reach the cache
    settings = SandboxSettings(
        pool_size=0, workspace_root=root / "ws", image_cache=root / "cache", preload_images=[digest]
    )
    manager = SandboxManager(settings, store=store)
    await manager.start()
    try:
        assert manager.images.cached(digest) is not None and digest in manager.images.pulls
    finally:
        await manager.close()
    missing = SandboxManager(
        settings.model_copy(update={"preload_images": ["sha256:" + "3" * 64]}), store=store
    )
    try:
        with pytest.raises(ImageError, match="not in object storage"):
            await missing.start()
    finally:
        await missing.close()
        shutil.rmtree(root, ignore_errors=True)
