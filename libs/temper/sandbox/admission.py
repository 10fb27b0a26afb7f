"""What an operator lets a task ask for: limits within ``max_limits``, the host's network
only when ``allow_host_network``. Checked at job submission (the dispatcher) and again by
the worker before it starts a sandbox, so a request above a maximum is refused, never
clamped."""

from __future__ import annotations

from temper.limits import NetworkPolicy, SandboxLimits
from temper.settings.sandbox import SandboxSettings

CAPPED = ("wall_s", "cpu_s", "memory_mb", "pids", "workspace_mb", "file_size_mb")


def limit_errors(limits: SandboxLimits, settings: SandboxSettings) -> list[tuple[str, str]]:
    """(field, message) for every way ``limits`` exceeds what this deployment allows."""
    errors = []
    maxima = settings.max_limits
    for name in CAPPED:
        asked, most = getattr(limits, name), getattr(maxima, name)
        if asked > most:
            errors.append(
                (name, f"{name}={asked:g} is above the operator's maximum {most:g} "
                       f"(TEMPER_SANDBOX__MAX_LIMITS__{name.upper()})")
            )  # fmt: skip
    if limits.network is NetworkPolicy.host and not settings.allow_host_network:
        errors.append(
            ("network", "network: host (the host's network) is refused on this deployment "
                        "(TEMPER_SANDBOX__ALLOW_HOST_NETWORK); use allowlist with host:port entries")
        )  # fmt: skip
    return errors


def timeout_error(timeout_s: float | None, settings: SandboxSettings) -> str | None:
    """An action's own ``timeout_s`` (which overrides ``wall_s``) above the maximum."""
    if timeout_s is not None and timeout_s > settings.max_limits.wall_s:
        return (
            f"timeout_s={timeout_s:g} is above the operator's maximum wall_s "
            f"{settings.max_limits.wall_s:g} (TEMPER_SANDBOX__MAX_LIMITS__WALL_S)"
        )
    return None
