"""The binding of one model's derivations: which registries are consulted, which
derivations each class gets from them, the engine of the current binding, and binding
again when a submodule was swapped before pin.

The runtime holds one `Binder` and asks it for the engine under its lock; what the engine
needs from the model (its tensors) is passed down from here, and the runtime is told of
each new binding (`on_bind`: it hooks the model's `load_state_dict` to its loads).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import torch
from torch import nn

from graphsafe._declare.decorators import class_registries
from graphsafe._declare.registry import Registry, default_registry
from graphsafe._declare.spec import Derivation, Drift
from graphsafe._errors import GraphSafetyError, RegistrationError, StaleError, StorageMovedError
from graphsafe._lineage.resolve import Foreign, foreign_of
from graphsafe._memory.journal import Journal
from graphsafe._memory.walk import Reach, storage_paths, walk, walk_tensors
from graphsafe._runtime.bind.binding import Binding, bind
from graphsafe._runtime.bind.experts import ExpertLayouts
from graphsafe._runtime.bind.model_map import ModelMap, ModelStorages
from graphsafe._runtime.bind.ties import Ties
from graphsafe._runtime.refresh.engine import Engine

__all__ = ["Binder", "derivations_for", "swapped_modules", "tensor_at"]


class Binder:
    """The registries and the current engine of one model.

    Args:
        model: The root module (held weakly).
        registry: A registry to consult besides `gs.default_registry` and those the
            model's classes name.
        strict: Whether engines check purity on every refresh.
        journal: The journal engines record into.
        own: Called with every module of a tree that is bound.
        on_bind: Called with the model and the engine of each new binding.
    """

    __slots__ = ("_agreed", "_engine", "_journal", "_map", "_model_class",
                 "_model_ref", "_on_bind", "_own", "_strict", "_ties", "experts", "registries")

    def __init__(
        self,
        model: nn.Module,
        registry: Registry | None,
        *,
        strict: bool,
        journal: Journal,
        own: Callable[[nn.Module], None],
        on_bind: Callable[[nn.Module, Engine], None],
    ) -> None:
        self._model_ref: Final = weakref.ref(model)
        self._model_class: Final = type(model).__name__
        self.registries: Final[list[Registry]] = [default_registry]
        if registry is not None and registry is not default_registry:
            self.registries.append(registry)
        self._strict = strict
        self._journal: Final = journal
        self._own: Final = own
        self._on_bind: Final = on_bind
        self._engine: Engine | None = None
        self._map: ModelMap | None = None
        # Whether `_engine` and `_map` were seen together with no submodule swapped
        # (`bound`); whatever replaces either clears it.
        self._agreed = False
        self._ties: Ties | None = None
        self.experts: Final = ExpertLayouts()
        """The model's expert layouts, and the loads refused for writing them."""

    @property
    def alive(self) -> bool:
        """Whether the model still exists."""
        return self._model_ref() is not None

    @property
    def model(self) -> nn.Module:
        """The root module (raises if it was garbage-collected)."""
        model = self._model_ref()
        if model is None:
            raise GraphSafetyError(
                f"the model of this runtime (a {self._model_class}) no longer exists",
                module_class=self._model_class,
                expected="a model that is still referenced",
                got="the model was garbage-collected",
                fix="keep a reference to the model while using its runtime, e.g. "
                "`model = M(); gs.runtime(model)` rather than `gs.runtime(M())`",
            )
        return model

    @property
    def ties(self) -> Ties:
        """The model's ties, recorded when first asked for (before its first load)."""
        if self._ties is None:
            self._ties = Ties.record(self.model)
        return self._ties

    def tie_error(self) -> StaleError | None:
        """The refusal of the ties loads broke (None: none, or no load recorded them)."""
        return None if self._ties is None else self._ties.error(self._model_class)

    def expert_error(self) -> StaleError | None:
        """The refusal of the expert layouts loads wrote in checkpoint order (None: none)."""
        return self.experts.error(self._model_class)

    @property
    def strict(self) -> bool:
        """Whether every refresh checks purity, not only materialization."""
        return self._strict

    def set_strict(self, value: bool) -> None:
        """Check purity on every refresh from now on, or not (the engine bound now too)."""
        self._strict = value
        if self._engine is not None:
            self._engine.set_strict(value)

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
        self._map = None  # another tree: walked anew at the next load
        self._agreed = False
        binding = bind(model, self._derivations_for, self._own)
        self._engine = engine = Engine(
            binding, self.model_tensors, journal=self._journal, strict=self._strict
        )
        self._on_bind(model, engine)
        return engine

    def bound(self, pinned: bool) -> tuple[Engine, ModelMap]:
        """`engine(pinned)` and `model_map()` together, as each load begins: while the
        walk still holds, the binding's submodules are where they were when both were
        last seen to agree, and that is not checked again.

        The walk's flat check covers every `_modules` entry of every module it walked
        (the binding's submodules among them, by identity), so a walk that holds proves
        no submodule was swapped since the moment it agreed with the engine.
        """
        engine, found = self._engine, self._map
        if self._agreed and engine is not None and found is not None and found.holds():
            return engine, found
        engine = self.engine(pinned)
        walked = self.model_map()
        self._agreed = True
        return engine, walked

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
        self._agreed = False

    def model_tensors(self) -> ModelStorages:
        """`{storage key: path}` of every tensor of the model, walked when first looked
        up (a first materialization that reads only its inputs looks up none)."""
        model = self.model
        return ModelStorages(lambda: storage_paths(model))

    def walked(self, wanted: Callable[[Any], bool] | None = None) -> Reach:
        """A walk of the model now, kept as the next `model_map` (one walk for both); with
        `wanted`, the values it asks for too (`walk`). A load's end asks for it after its
        refresh, so that the walk sees the buffers the refresh registered."""
        reach = walk(self.model, wanted)
        self._map = ModelMap(self.model, reach)
        self._agreed = False
        return reach

    def model_map(self) -> ModelMap:
        """Where every storage of the model is, walked again only if the model changed
        since the last walk (see `ModelMap.holds`)."""
        found = self._map
        if found is None or not found.holds():
            found = self._map = ModelMap(self.model)
            self._agreed = False
        return found

    def foreign(self) -> Foreign:
        """The model's weights as a recording of another bound model reads them
        (`foreign_of`), kept with the walk while its modules' dicts and tables hold
        (`tables_hold`: what kernel objects and closures hold below them is not read, the
        weights do not depend on it): every recorded load of another model asks for them,
        and finding them anew costs a pass over every module."""
        found = self._map
        if found is None or not found.tables_hold():
            found = self.model_map()
        if found.foreign is None:
            found.foreign = foreign_of(self.model, found.table_keys)
        return found.foreign  # type: ignore[no-any-return]

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of the model."""
        return (site.tensor for site in walk_tensors(self.model))

    def modules(self) -> list[nn.Module]:
        """Every module of the model, in tree order."""
        return list(self.model.modules())

    def _derivations_for(self, cls: type) -> list[Derivation]:
        return derivations_for(self.registries, cls)


def swapped_modules(binding: Binding) -> list[str]:
    """Paths, in tree order, of submodules replaced (or removed) since `binding` was made."""
    mods = binding.modules
    if not mods:
        return []
    parents, keys, children, _ = zip(*mods)
    try:
        # One flat pass: every parent's `_modules` entry, compared by identity (a list
        # compares its items by identity first, and modules define no `__eq__`).
        now = list(map(dict.get, map(_MODULES, map(_CALL, parents)), keys))
    except AttributeError:  # a parent is gone: find which, one by one
        now = None
    if now is not None and now == list(map(_CALL, children)):
        return []
    return [
        path
        for parent, key, child, path in mods
        if _child(parent(), key) is not child()
    ]


_MODULES = operator.attrgetter("_modules")
_CALL = weakref.ref.__call__


def _child(parent: nn.Module | None, key: str) -> nn.Module | None:
    return parent._modules.get(key) if parent is not None else None


def derivations_for(consulted: Sequence[Registry], cls: type) -> list[Derivation]:
    """The derivations of `cls`, without repeats, from `consulted` (the runtime's registries)
    and the registries its classes name; `RegistrationError` if two declare one output."""
    registries = list(consulted)
    for reg in class_registries(cls):
        if reg not in registries:
            registries.append(reg)
    found: list[Derivation] = []
    taken: dict[str, Derivation] = {}
    for reg in registries:
        for d in reg.derivations_for(cls):
            for name in d.outputs:
                if name in taken and taken[name] is not d:
                    raise RegistrationError(
                        f"two registries declare output {name!r} on {cls.__name__}",
                        module_class=cls.__name__,
                        derivation=d.name,
                        expected=f"one derivation producing {name!r}",
                        got=f"{taken[name].name!r} and {d.name!r}",
                        fix="register the derivation in one registry only",
                    )
                taken[name] = d
            if d not in found:
                found.append(d)
    return found


def tensor_at(model: nn.Module, path: str) -> torch.Tensor:
    """The tensor (parameter, buffer or attribute) at the dotted `path` from `model`, e.g.
    `layers.0.weight`; `GraphSafetyError` if nothing, or no tensor, is there."""
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, torch.Tensor):
        raise GraphSafetyError(
            f"refresh(changed=...) names {path!r}, which is not a tensor of the model",
            module_class=type(model).__name__,
            path=path,
            expected="dotted paths from the model root, e.g. 'layers.0.weight'",
            got=repr(path),
            fix="use names from model.named_parameters() / named_buffers()",
        )
    return obj


def swapped_error(model: nn.Module, binding: Binding, swapped: list[str]) -> StorageMovedError:
    """The `StorageMovedError` for submodules replaced after pin, one `Drift(what="module")`
    per path of `swapped`."""
    drifts = []
    for parent, key, ref, path in binding.modules:
        if path in swapped:
            owner, child = parent(), ref()
            now = owner._modules.get(key) if owner is not None else None
            drifts.append(
                Drift(
                    path=path,
                    module_class=type(child).__name__,
                    what="module",
                    old="a module no longer alive"
                    if child is None
                    else f"{type(child).__name__} at 0x{id(child):x}",
                    new="removed" if now is None else f"{type(now).__name__} at 0x{id(now):x}",
                )
            )
    return StorageMovedError(
        f"{len(swapped)} submodule(s) were replaced after pin: " + ", ".join(swapped),
        drifts=drifts,
        module_class=type(model).__name__,
        path=swapped[0],
        expected=f"the module captured at {swapped[0]!r}",
        got=drifts[0].new,
        fix="load new weights into the existing modules instead of replacing them; to "
        "change the model, release the graphs (Graph.reset()), change it, and re-capture",
    )
