"""What a model family provides to `graphsafe verify`, and how a run finds it."""

from __future__ import annotations

import os
import sys
from importlib import import_module
from importlib.metadata import entry_points
from typing import Protocol

import torch
from torch import nn

from graphsafe._errors import GraphSafetyError

__all__ = ["Checkpoint", "VerifyTarget", "load_target"]

Checkpoint = list[tuple[str, torch.Tensor]]


class VerifyTarget(Protocol):
    """What a model family provides to `graphsafe verify`."""

    name: str
    presets: tuple[str, ...]
    critical: tuple[str, ...]
    """Suffixes of checkpoint names put in the last bucket of one refit."""

    def build(self, preset: str, naive: bool, device: torch.device) -> nn.Module:
        """A model of the preset; `naive` gives the pre-fix rebinding variant."""
        ...

    def checkpoint(self, model: nn.Module, seed: int) -> Checkpoint:
        """A full checkpoint of random weights for `model`."""
        ...

    def example_input(self, model: nn.Module, seed: int) -> tuple[torch.Tensor, ...]:
        """Static inputs for the captured forward."""
        ...


def load_target(spec: str) -> VerifyTarget:
    """Find a verify target by entry-point name or `module:attribute`.

    Args:
        spec: e.g. `deepseek_v4` (entry point in group `graphsafe.targets`) or
            `my_pkg.models:target`.

    Returns:
        The target object.

    Raises:
        GraphSafetyError: If no such target exists.
    """
    if ":" in spec:
        return _import_target(spec)
    found = {ep.name: ep for ep in entry_points(group="graphsafe.targets")}
    if spec not in found:
        raise GraphSafetyError(
            f"unknown verify target {spec!r}",
            expected="an entry point of group 'graphsafe.targets' or 'module:attribute'",
            got=f"installed targets: {', '.join(sorted(found)) or 'none'}",
            fix="install graphsafe (pip install -e .) so its entry points are registered, or "
            "pass --target module:attribute",
        )
    return found[spec].load()  # type: ignore[no-any-return]


def _import_target(spec: str) -> VerifyTarget:
    module, _, attr = spec.partition(":")
    try:
        if os.getcwd() not in sys.path:
            # Like `python -m`: a target module in the working directory is found.
            sys.path.insert(0, os.getcwd())
        return getattr(import_module(module), attr)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as exc:
        raise GraphSafetyError(
            f"cannot load verify target {spec!r}",
            expected="module:attribute naming an importable object",
            got=f"{type(exc).__name__}: {exc}",
            fix="install the module or put its folder on PYTHONPATH, and check the "
            "attribute name",
        ) from exc
