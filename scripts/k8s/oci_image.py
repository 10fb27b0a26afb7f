"""Write a single-layer OCI image archive from files on this machine, for `ctr images import`.

No registry is reachable here and the node's images must be built locally; a static binary
(pause, CoreDNS, the storage provisioner, busybox) needs nothing but itself in its image, so
the archive is written directly (OCI image layout: oci-layout, index.json, blobs/sha256/...)
without a container engine.

    python3 oci_image.py OUT.tar NAME:TAG --add SRC:DEST[:MODE] ... --entrypoint /bin/x [--cmd ...]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
import time


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def _layer(files: list[tuple[str, str, int]], links: list[tuple[str, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        dirs: set[str] = set()
        entries = [dest for _, dest, _ in files] + [dest for dest, _ in links]
        for dest in entries:
            parts = dest.strip("/").split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:i]))
        for d in sorted(dirs | {"tmp"}):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            layer.addfile(info)
        for src, dest, mode in files:
            with open(src, "rb") as fh:
                data = fh.read()
            info = tarfile.TarInfo(dest.strip("/"))
            info.size = len(data)
            info.mode = mode
            layer.addfile(info, io.BytesIO(data))
        for dest, target in links:
            info = tarfile.TarInfo(dest.strip("/"))
            info.type = tarfile.SYMTYPE
            info.linkname = target
            layer.addfile(info)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("name", help="full reference, e.g. registry.k8s.io/pause:3.10")
    parser.add_argument("--add", action="append", default=[], help="SRC:DEST[:MODE octal]")
    parser.add_argument("--link", action="append", default=[], help="DEST:TARGET (a symlink)")
    parser.add_argument("--entrypoint", nargs="+", default=[])
    parser.add_argument("--cmd", nargs="+", default=[])
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--user", default="")
    args = parser.parse_args()

    files = []
    for spec in args.add:
        src, dest, *mode = spec.split(":")
        files.append((src, dest, int(mode[0], 8) if mode else 0o755))
    links = [tuple(spec.split(":", 1)) for spec in args.link]
    layer = _layer(files, links)  # type: ignore[arg-type]
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": args.entrypoint or None,
            "Cmd": args.cmd or None,
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", *args.env],
            "User": args.user,
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "scripts/k8s/oci_image.py"}],
    }
    with tarfile.open(args.out, "w") as tar:
        layer_ref = _blob(tar, layer)
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_ref = _blob(tar, config_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_ref,
                "size": len(config_bytes),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_ref,
                    "size": len(layer),
                }
            ],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_ref = _blob(tar, manifest_bytes)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_ref,
                    "size": len(manifest_bytes),
                    "annotations": {
                        "io.containerd.image.name": args.name,
                        "org.opencontainers.image.ref.name": args.name.rsplit(":", 1)[-1],
                    },
                }
            ],
        }
        for name, data in (
            ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
            ("index.json", json.dumps(index).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()
