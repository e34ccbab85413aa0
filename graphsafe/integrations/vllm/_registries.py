"""The registries the plugin uses: the environment variable that names them, and how each
name resolves (every vLLM process resolves them anew, so names, not objects, travel)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from graphsafe._declare.registry import Registry
from graphsafe._errors import RegistrationError

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


def no_registry() -> Registry:
    """An empty registry (`NO_REGISTRY`)."""
    return Registry()


def registries_from(spec: str | Iterable[str | Registry]) -> list[Registry]:
    """The registries named by `spec` (the format of `GRAPHSAFE_VLLM_REGISTRIES`).

    Args:
        spec: Comma-separated `module:attribute`, or an iterable of such names and
            registries.

    Returns:
        The registries.

    Raises:
        RegistrationError: A name does not resolve to a registry.
    """
    items = [s.strip() for s in spec.split(",") if s.strip()] if isinstance(spec, str) else spec
    out: list[Registry] = []
    for item in items:
        if isinstance(item, Registry):
            out.append(item)
            continue
        mod, _, attr = item.partition(":")
        try:
            obj: Any = getattr(importlib.import_module(mod), attr) if attr else None
        except (ImportError, AttributeError) as exc:
            obj = exc
        if callable(obj) and not isinstance(obj, Registry):
            obj = obj()
        if not isinstance(obj, Registry):
            raise RegistrationError(
                f"{ENV} names {item!r}, which is not a graphsafe registry",
                expected="'module:attribute' naming a gs.Registry or a function returning one",
                got=repr(obj) if not isinstance(obj, Exception) else f"{type(obj).__name__}: "
                f"{obj}",
                fix="make the module importable in every vLLM process (on its path) and "
                "name the registry object",
            )
        out.append(obj)
    return out
