"""The registries the plugin uses: the environment variable that names them, and how each
name resolves (every vLLM process resolves them anew, so names, not objects, travel)."""

from __future__ import annotations

from collections.abc import Iterable

from graphsafe._declare.registry import Registry
from graphsafe.integrations._engine import no_registry, resolve_registries

ENV = "GRAPHSAFE_VLLM_REGISTRIES"
"""Environment variable naming the registries, comma-separated `module:attribute`."""

CPU_KEEP_WEIGHTS = "GRAPHSAFE_VLLM_CPU_KEEP_WEIGHTS"
"""Environment variable: on vLLM's CPU build, keep every linear layer's weight and the
input embedding's (no packed copy), so that a bare `model.load_weights` (TRL's sync) can
write them and the forward reads what it wrote. `1` turns it on."""

CPU_KEEP_LM_HEAD = "GRAPHSAFE_VLLM_CPU_KEEP_LM_HEAD"
"""Environment variable: on vLLM's CPU build, the LM head reads its weight (`F.linear`)
instead of a packed copy made at startup, which a bare `load_weights` leaves stale. `1`
turns it on."""

LAZY_REFRESH = "GRAPHSAFE_VLLM_LAZY_REFRESH"
"""Environment variable: loads only mark derived buffers stale, and the check before the
next step refreshes them once (`gs.Runtime.lazy_refresh`). `1` turns it on."""

NO_REGISTRY = "graphsafe.integrations.vllm._registries:no_registry"
"""What `enable()` names when given no registry: the plugin is on, and graphsafe checks
what vLLM's own code derives from the weights (found by provenance) and nothing declared."""


def registries_from(spec: str | Iterable[str | Registry]) -> list[Registry]:
    """The registries named by `spec` (the format of `GRAPHSAFE_VLLM_REGISTRIES`,
    or registries and names).

    Raises:
        RegistrationError: A name does not resolve to a registry.
    """
    return resolve_registries(spec, env=ENV, engine="vLLM")


__all__ = [
    "CPU_KEEP_LM_HEAD",
    "CPU_KEEP_WEIGHTS",
    "ENV",
    "LAZY_REFRESH",
    "NO_REGISTRY",
    "no_registry",
    "registries_from",
]
