"""The binding of one model's derivations: which registries are consulted, the engine of
the current binding, and binding again when the module tree changed before pin.

The runtime holds one `Binder` and asks it for the engine under its lock; what the engine
needs from the model (its tensors, the state-dict hooks' callables) is passed down here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from graphsafe._declare.decorators import class_registries
from graphsafe._declare.registry import Registry, default_registry
from graphsafe._declare.spec import Derivation
from graphsafe._errors import GraphSafetyError
from graphsafe._memory.journal import Journal
from graphsafe._memory.walk import storage_paths, walk_tensors
from graphsafe._runtime.binding import bind
from graphsafe._runtime.checks import swapped_error
from graphsafe._runtime.engine import Engine
from graphsafe._runtime.state_dict import hook_state_dict
from graphsafe._runtime.tree import derivations_for, swapped_modules

__all__ = ["Binder"]


class Binder:
    """The registries and the current engine of one model.

    Args:
        model: The root module (held weakly).
        registry: A registry to consult besides `gs.default_registry` and those the
            model's classes name.
        strict: Whether engines check purity on every refresh.
        journal: The journal engines record into.
        own: Called with every module of a tree that is bound.
        hooks: What `load_state_dict` calls before and after it copies (held weakly).
    """

    __slots__ = ("_engine", "_hooks", "_journal", "_model_ref", "_own", "_strict", "registries")

    def __init__(
        self,
        model: nn.Module,
        registry: Registry | None,
        *,
        strict: bool,
        journal: Journal,
        own: Callable[[nn.Module], None],
        hooks: tuple[weakref.WeakMethod[Any], weakref.WeakMethod[Any]],
    ) -> None:
        self._model_ref = weakref.ref(model)
        self.registries: list[Registry] = [default_registry]
        if registry is not None and registry is not default_registry:
            self.registries.append(registry)
        self._strict = strict
        self._journal = journal
        self._own = own
        self._hooks = hooks
        self._engine: Engine | None = None

    @property
    def model(self) -> nn.Module:
        """The root module (raises if it was garbage-collected)."""
        model = self._model_ref()
        if model is None:
            raise GraphSafetyError(
                "the model of this runtime no longer exists",
                expected="a model that is still referenced",
                got="the model was garbage-collected",
                fix="keep a reference to the model while using its runtime, e.g. "
                "`model = M(); gs.runtime(model)` rather than `gs.runtime(M())`",
            )
        return model

    @property
    def strict(self) -> bool:
        """Whether every refresh checks purity, not only materialization."""
        return self._strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._strict = value
        if self._engine is not None:
            self._engine.strict = value

    @property
    def current(self) -> Engine | None:
        """The engine of the last binding, if any (not checked against the tree)."""
        return self._engine

    def engine(self, pinned: bool) -> Engine:
        """The engine of the current binding, bound (again, if the module tree changed
        before pin) on first use; `StorageMovedError` if pinned and swapped."""
        engine = self._engine
        if engine is not None:
            swapped = swapped_modules(engine.binding)
            if not swapped:
                return engine
            if pinned:
                raise swapped_error(self.model, engine.binding, swapped)
        model = self.model
        binding = bind(model, self._derivations_for, self._own)
        self._engine = engine = Engine(
            binding, self.model_tensors, journal=self._journal, strict=self._strict
        )
        hook_state_dict(model, engine, *self._hooks)
        return engine

    def consults(self, registry: Registry) -> bool:
        """Whether `registry`'s derivations are bound already."""
        return registry in self.registries or any(
            registry in class_registries(type(m)) for m in self.model.modules()
        )

    def add(self, registry: Registry) -> None:
        """Consult `registry` from now on; the next engine binds its derivations (existing
        buffers keep their storage)."""
        self.registries.append(registry)
        self._engine = None

    def model_tensors(self) -> dict[int, str]:
        """`{storage key: path}` of every tensor of the model."""
        return storage_paths(self.model)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of the model."""
        return (site.tensor for site in walk_tensors(self.model))

    def _derivations_for(self, cls: type) -> list[Derivation]:
        return derivations_for(self.registries, cls)
