"""What a model family provides to `graphsafe verify`, and how a run finds it."""

from __future__ import annotations

import os
import sys
from importlib import import_module
from importlib.metadata import entry_points
from typing import Protocol, cast

import torch
from torch import nn

from graphsafe._errors import GraphSafetyError

__all__ = ["BUILTIN_TARGETS", "Checkpoint", "VerifyTarget", "load_target"]

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


_BUILTIN = {
    "deepseek_v4": "graphsafe.models.deepseek_v4:verify_target",
    "llama": "graphsafe.models.llama:verify_target",
}
"""graphsafe's own targets, as pyproject.toml registers them: found by name also where the
package runs from its source tree without installed metadata (scripts/gpu-check)."""

BUILTIN_TARGETS = tuple(_BUILTIN)
"""The names of graphsafe's own targets, the default first."""


def load_target(spec: str) -> VerifyTarget:
    """Find a verify target by entry-point name or `module:attribute`.

    Args:
        spec: e.g. `deepseek_v4` (entry point in group `graphsafe.targets`; graphsafe's own
            `deepseek_v4` and `llama` are found without one) or `my_pkg.models:target`
            (the attribute may be dotted: `my_pkg.models:Family.target`).

    Returns:
        The target object.

    Raises:
        GraphSafetyError: `spec` is malformed (empty, or an empty or invalid module or
            attribute name), names no installed entry point or importable object, or
            names an object that is not a target (a class, or one without the members of
            `VerifyTarget`).
    """
    found = {ep.name: ep for ep in entry_points(group="graphsafe.targets")}
    installed = ", ".join(sorted(found.keys() | _BUILTIN.keys()))
    target: object
    if ":" in spec:
        target = _import_target(spec, installed)
    elif spec in found:
        target = found[spec].load()
    elif spec in _BUILTIN:
        target = _import_target(_BUILTIN[spec], installed)
    else:
        raise _not_a_target(
            installed, f"unknown verify target {spec!r}" if spec else "no verify target given",
            got=f"installed targets: {installed}",
            fix="install graphsafe (pip install -e .) so its entry points are registered, or "
            "pass module:attribute",
        )
    _check_members(spec, installed, target)
    return cast("VerifyTarget", target)  # it has every member


_MEMBERS = ("name", "presets", "critical")
_METHODS = ("build", "checkpoint", "example_input")
_EXAMPLE = "e.g. `deepseek_v4`, or `my_pkg.verify_target:target` (see docs/verify.md)"


def _not_a_target(installed: str, summary: str, *, got: str, fix: str) -> GraphSafetyError:
    """The refusal of a target spec: what a target is, what was found, and an example."""
    return GraphSafetyError(
        summary,
        expected=f"an entry point of group 'graphsafe.targets' ({installed}), or "
        "module:attribute naming an object with name, presets, critical, build, checkpoint "
        "and example_input",
        got=got,
        fix=f"{fix}; {_EXAMPLE}",
    )


def _import_target(spec: str, installed: str) -> object:
    """The object `module:attribute` names, the syntax checked before importing."""
    module, _, attr = spec.partition(":")
    for part, what in ((module, "module"), (attr, "attribute")):
        if not all(name.isidentifier() for name in part.split(".")):
            problem = "empty" if not part else f"not a dotted name: {part!r}"
            raise _not_a_target(
                installed, f"cannot read verify target {spec!r}: its {what} name is "
                f"{problem}", got=f"module {module!r}, attribute {attr!r}",
                fix="pass module:attribute, both dotted Python names",
            )
    try:
        if os.getcwd() not in sys.path:
            # Like `python -m`: a target module in the working directory is found.
            sys.path.insert(0, os.getcwd())
        obj: object = import_module(module)
        for name in attr.split("."):
            obj = getattr(obj, name)
    except (ImportError, AttributeError) as exc:
        raise _not_a_target(
            installed, f"cannot load verify target {spec!r}",
            got=f"{type(exc).__name__}: {exc}",
            fix="install the module or put its folder on PYTHONPATH, and check the "
            "attribute name",
        ) from exc
    return obj


def _check_members(spec: str, installed: str, obj: object) -> None:
    """Refuse what is not a target before a run reads a member it lacks."""
    if isinstance(obj, type):
        raise _not_a_target(
            installed, f"{spec!r} is the class {obj.__qualname__}, not a verify target",
            got=f"the class {obj.__module__}.{obj.__qualname__}",
            fix="name an instance of it (`target = " + obj.__name__ + "()` in its module)",
        )
    absent = [m for m in (*_MEMBERS, *_METHODS) if not hasattr(obj, m)]
    uncallable = [m for m in _METHODS if hasattr(obj, m) and not callable(getattr(obj, m))]
    if absent or uncallable:
        kind = type(obj)
        what = kind.__qualname__ if kind.__module__ == "builtins" else (
            f"{kind.__module__}.{kind.__qualname__}"
        )
        lacks = ([f"no {', '.join(absent)}"] if absent else []) + (
            [f"{', '.join(uncallable)} not callable"] if uncallable else []
        )
        raise _not_a_target(
            installed, f"{spec!r} is not a verify target",
            got=f"a {what} with {'; '.join(lacks)}",
            fix="name an object that has every member of VerifyTarget",
        )
