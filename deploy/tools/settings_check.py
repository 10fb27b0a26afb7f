"""Every Temper process's environment in a deployment file loads as ``Settings``, offline.

    settings_check.py compose docker-compose.yml [OVERRIDE.yml ...]
    settings_check.py k8s RENDERED.yaml ...      (kustomize build output of an overlay)
    settings_check.py --dockerfile=PATH ...      (another image's Dockerfile; default ./Dockerfile)

A value that would kill a service at start (a bad URL list, a number that is not one, a
refused mode, a retired variable) fails here first, named by file, service and variable.
Every container starts from the image's own ``ENV`` (the Dockerfile's last stage), so those
variables are checked under each service too. Compose's ``${VAR}``
references take the values of deploy/compose.env.example; Kubernetes secrets and fields
the cluster fills in become placeholders, and ``$(VAR)`` references expand as kubelet does.
Run by scripts/check_deploy.sh with libs/ on the path.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ENV_EXAMPLE = ROOT / "deploy" / "compose.env.example"
DOCKERFILE = ROOT / "Dockerfile"


def is_temper(command: object) -> bool:
    """A Temper process: ``python -m services.…`` or ``python -m temper.…``."""
    return (
        isinstance(command, list)
        and command[:2] == ["python", "-m"]
        and len(command) > 2
        and str(command[2]).startswith(("services.", "temper."))
    )


def image_env(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """``ENV`` of the Dockerfile's last stage (``KEY=VALUE`` pairs, continued lines joined)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    env: dict[str, str] = {}
    for line in text.splitlines():
        word = line.strip().split(" ", 1)
        if word[0].upper() == "FROM":
            env = {}
        elif word[0].upper() == "ENV" and len(word) == 2:
            for pair in re.findall(r'(\w+)=("[^"]*"|\S+)', word[1]):
                env[pair[0]] = pair[1].strip('"')
    return env


def example_variables() -> dict[str, str]:
    lines = ENV_EXAMPLE.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def substitute(value: str, variables: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$``."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if variables.get(name):
            return variables[name]
        if op == ":?":
            raise ValueError(f"${{{name}}} is unset: {arg}")
        return arg

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value).replace("$$", "$")


def compose_envs(files: list[Path], variables: dict[str, str]) -> Iterator[tuple[str, dict[str, str]]]:
    """(service, environment) of each Temper service, the files merged as compose does
    (a later file's keys win, environments merge)."""
    services: dict[str, dict] = {}
    for path in files:
        for name, svc in (yaml.safe_load(path.read_text()).get("services") or {}).items():
            merged = services.setdefault(name, {})
            env = {**(merged.get("environment") or {}), **(svc.get("environment") or {})}
            merged.update(svc)
            merged["environment"] = env
    for name, svc in services.items():
        if is_temper(svc.get("command")) and not svc.get("entrypoint"):
            yield name, {k: substitute(str(v), variables) for k, v in svc["environment"].items()}


def k8s_envs(path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(workload/container, environment) of each Temper container in rendered manifests."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    maps = {d["metadata"]["name"]: d.get("data") or {} for d in docs if d.get("kind") == "ConfigMap"}
    for doc in docs:
        spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
        if doc.get("kind") == "CronJob":
            spec = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
            if not is_temper(c.get("command")):
                continue
            env: dict[str, str] = {}
            for source in c.get("envFrom") or []:
                ref = (source.get("configMapRef") or {}).get("name")
                if ref is not None:
                    if ref not in maps:
                        raise ValueError(f"{doc['metadata']['name']}: config map {ref} is not rendered")
                    env.update({str(k): str(v) for k, v in maps[ref].items()})
            for item in c.get("env") or []:
                value = item.get("value")
                if value is None:  # valueFrom: a secret or a field the cluster fills in
                    value = "placeholder-" + item["name"].lower().replace("_", "-")
                env[item["name"]] = re.sub(
                    r"\$\((\w+)\)", lambda m, env=env: env.get(m.group(1), m.group(0)), str(value)
                )
            yield f"{doc['metadata']['name']}/{c['name']}", env


def check(env: dict[str, str]) -> str | None:
    """None when ``env`` loads as the service would load it, else the error."""
    from temper.runtime import StartupError, load_settings

    saved = {k: v for k, v in os.environ.items() if k.startswith("TEMPER_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("TEMPER_")})
    try:
        load_settings()
        return None
    except StartupError as exc:
        return str(exc)
    finally:
        for key in [k for k in os.environ if k.startswith("TEMPER_")]:
            del os.environ[key]
        os.environ.update(saved)


def main(argv: list[str]) -> int:
    dockerfile = DOCKERFILE
    if argv and argv[0].startswith("--dockerfile="):
        dockerfile, argv = Path(argv[0].split("=", 1)[1]), argv[1:]
    if len(argv) < 2 or argv[0] not in ("compose", "k8s"):
        sys.stderr.write(__doc__ or "")
        return 2
    kind, files = argv[0], [Path(a) for a in argv[1:]]
    if kind == "compose":
        found = list(compose_envs(files, example_variables()))
        where = ", ".join(str(f) for f in files)
    else:
        found = [item for f in files for item in k8s_envs(f)]
        where = ", ".join(str(f) for f in files)
    image = image_env(dockerfile)
    errors = [f"{where}: {name}: {err}" for name, env in found if (err := check({**image, **env}))]
    if not found:
        errors.append(f"{where}: no Temper service found")
    for line in errors:
        sys.stdout.write(line + "\n")
    if not errors:
        sys.stdout.write(f"{where}: {len(found)} Temper environments load as Settings\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
