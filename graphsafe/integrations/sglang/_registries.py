"""The registries the plugin uses: the environment variable that names them, and how each
name resolves (every SGLang process resolves them anew, so names, not objects, travel)."""

from __future__ import annotations

from collections.abc import Iterable

from graphsafe._declare.registry import Registry
from graphsafe.integrations._engine import no_registry, resolve_registries

ENV = "GRAPHSAFE_SGLANG_REGISTRIES"
"""Environment variable naming the registries, comma-separated `module:attribute`."""

NO_REGISTRY = "graphsafe.integrations.sglang._registries:no_registry"
"""What `enable()` names when given no registry: the plugin is on, and graphsafe checks
what SGLang's own code derives from the weights (found by provenance) and nothing declared."""


def registries_from(spec: str | Iterable[str | Registry]) -> list[Registry]:
    """The registries named by `spec` (the format of `GRAPHSAFE_SGLANG_REGISTRIES`,
    or registries and names).

    Raises:
        RegistrationError: A name does not resolve to a registry.
    """
    return resolve_registries(spec, env=ENV, engine="SGLang")


__all__ = ["ENV", "NO_REGISTRY", "no_registry", "registries_from"]
