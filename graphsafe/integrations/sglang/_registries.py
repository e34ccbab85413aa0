"""The registries the plugin uses: the environment variable that names them, and how each
name resolves (every SGLang process resolves them anew, so names, not objects, travel)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from graphsafe._declare.registry import Registry
from graphsafe._errors import RegistrationError

ENV = "GRAPHSAFE_SGLANG_REGISTRIES"
"""Environment variable naming the registries, comma-separated `module:attribute`."""

NO_REGISTRY = "graphsafe.integrations.sglang._registries:no_registry"
"""What `enable()` names when given no registry: the plugin is on, and graphsafe checks
what SGLang's own code derives from the weights (found by provenance) and nothing declared."""


def no_registry() -> Registry:
    """An empty registry (`NO_REGISTRY`)."""
    return Registry()


def registries_from(spec: str | Iterable[str | Registry]) -> list[Registry]:
    """The registries named by `spec` (the format of `GRAPHSAFE_SGLANG_REGISTRIES`).

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
                fix="make the module importable in every SGLang process (on its path) and "
                "name the registry object",
            )
        out.append(obj)
    return out
