"""The one walk over a model: every submodule binding, and every tensor it keeps, anywhere.

Everything in graphsafe that looks for tensors in a model walks it here, so that all agree
on what "every tensor" means: parameters and buffers; plain attributes; and, through them,
anything else the model keeps: lists, tuples and dicts at any depth, plain objects and
dataclasses (`__dict__` and `__slots__`), `functools.partial`s, bound methods, closure
cells and default arguments of functions, and modules kept outside the module tree (a
draft model in a plain list). Engines keep derived state in exactly such places (a kernel
object on a layer's `quant_method`, an attention impl holding `sinks`, a closure over a
merged LoRA delta). Each tensor comes with its `Site`, so that a caller can read it again
through the same path, and `Reach.refs` holds every reference to an object on the way,
so that a rebuilt object (a new kernel object with new tensors) shows.

What the walk leaves out, and where it stops:
- Each object is entered once (cycles end); every further reference to it is recorded
  as a ref all the same, and every reference to a tensor is a site (tied weights).
- It reads `__dict__` entries and slots directly: it never calls a property.
- It enters the attributes of a parameter or a plain tensor (engines stash a packed copy
  or scales on the `nn.Parameter` itself, and attach loaders to it): `lin.weight.packed`.
  Tensor subclasses of other kinds (wrappers that keep their parts in attributes) are not
  entered: their parts are theirs.
- Atoms (numbers, strings, dtypes, devices, classes, Python modules, builtins), sets,
  NumPy arrays and other objects with nothing to enter hold no tensor it could find.
- It stops at what is not the model's own state: graphsafe's own objects (a runtime, an
  engine attachment), C++ objects (process groups, streams,
  `torch._C` types), process-group wrappers and communicators (vLLM's
  `GroupCoordinator`, `PyNcclCommunicator`), configs (pydantic models, Hugging Face
  `PretrainedConfig`, vLLM's `VllmConfig` and its parts), engine runners and workers,
  and any object that holds the root module itself: a back-reference into whatever owns
  the model (a runner with its KV caches and input buffers).
- Hook tables and other `nn.Module` internals are not entered.

Which device a graph reads is its guard's business, not the walk's: it yields tensors of
every device.
"""

from __future__ import annotations

import enum
import functools
import itertools
import operator
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from graphsafe import _native

__all__ = [
    "Attr",
    "Cell",
    "Field",
    "ModuleSite",
    "Reach",
    "Ref",
    "Site",
    "Slot",
    "module_prefixes",
    "modules_once",
    "ValueSite",
    "Wanted",
    "step",
    "storage_ids",
    "storage_key",
    "storage_keys",
    "storage_rows",
    "storage_paths",
    "walk",
    "walk_modules",
    "walk_tensors",
    "walk_values",
]

# The attributes every nn.Module has in its __dict__: registries and hook tables, never
# user tensors. `_parameters` and `_buffers` are walked on their own.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
# What a module outside the tree is entered through (its path leaves the names out).
_MODULE_TABLES = ("_parameters", "_buffers", "_modules")


class Attr(NamedTuple):
    """A step into an object's `__dict__` entry `name`."""

    name: str


class Slot(NamedTuple):
    """A step into an object's `__slots__` member `name` (the key of a snapshot site)."""

    name: str


class Field(NamedTuple):
    """A step into a read-only field of a builtin object: a partial's `func`, `args` and
    `keywords`, a bound method's `__self__` and `__func__`, a function's `__defaults__` and
    `__kwdefaults__`."""

    name: str


class Cell(NamedTuple):
    """A step into the closure cell `at` of a function (its free variable `name`)."""

    at: int
    name: str


def step(value: Any, key: Any) -> Any:
    """What `value` holds under one step of a chain: an `Attr`, `Slot`, `Field` or `Cell`,
    or else an item key (`value[key]`).

    Examples:
        >>> step({"a": 1}, "a"), step(functools.partial(max, 3), Field("args"))
        (1, (3,))
    """
    kind = type(key)
    if kind is Attr:
        return vars(value)[key.name]
    if kind is Slot or kind is Field:
        return getattr(value, key.name)
    if kind is Cell:
        return value.__closure__[key.at].cell_contents
    return value[key]


class Site(NamedTuple):
    """Where one tensor lives: `container[key]`, then each step of `chain`, is `tensor`.

    `module` is the module of the tree it hangs off; `container` is `module._parameters`,
    `module._buffers` or `module.__dict__`; `chain` (item keys, `Attr`, `Slot`, `Field`,
    `Cell`) is empty for a tensor held directly; `path` is dotted from the root
    (`layers.0.cache.1` for an item of a list attribute, `layers.0.quant_method.w_packed`
    for a kernel object's tensor). `via` is the index in `Reach.refs` of the object that
    holds it (-1: the module's own dicts).
    """

    path: str
    module: nn.Module
    container: Any
    key: Any
    chain: tuple[Any, ...]
    tensor: torch.Tensor
    via: int = -1


class Ref(NamedTuple):
    """One reference to an object on the way to tensors: `Site`'s fields, with `obj` (a
    container, plain object, function, partial or module outside the tree) for `tensor`.
    Only objects that hold a tensor somewhere below them are kept."""

    path: str
    module: nn.Module
    container: Any
    key: Any
    chain: tuple[Any, ...]
    obj: Any
    via: int = -1


class Reach(NamedTuple):
    """What `walk` found: every tensor site, and every reference to an object that holds
    tensors (parents before children); and, when it was asked for values, every place that
    holds one, as `walk_values` finds them (None: not asked)."""

    sites: list[Site]
    refs: list[Ref]
    values: list[ValueSite] | None = None
    modules: list[nn.Module] | None = None
    """Each module of the tree once, at its first binding, in `walk_modules`' order."""


class ValueSite(NamedTuple):
    """Where one value other than a tensor lives (a Python number, a kernel handle): as
    `Site`, with `value` for `tensor`."""

    path: str
    module: nn.Module
    container: Any
    key: Any
    chain: tuple[Any, ...]
    value: Any


class Wanted:
    """What a walk asks for by kind (`walk`'s `wanted`): every value of one of `types`,
    and every value whose id is a key of `ids`. Called as any `wanted` is; the compiled
    walk decides it without a Python call per value."""

    __slots__ = ("ids", "types")

    def __init__(self, types: frozenset[type], ids: dict[int, Any]) -> None:
        self.types = types
        self.ids = ids

    def __call__(self, value: object) -> bool:
        return type(value) in self.types or id(value) in self.ids


class ModuleSite(NamedTuple):
    """Where one module is bound: `parent._modules[key]` is `module`, at the dotted `path`
    (for the root: path and key `""`, parent None)."""

    path: str
    parent: nn.Module | None
    key: str
    module: nn.Module


def walk_modules(model: nn.Module) -> Iterator[ModuleSite]:
    """The root, then every submodule binding, depth first in registration order.

    A module shared by several parents is yielded at each binding, so that replacing it at
    any of them can be seen; its own submodules are walked once, under its first path.
    `None` entries are skipped.

    Examples:
        >>> shared = nn.Linear(2, 2)
        >>> [s.path for s in walk_modules(nn.Sequential(shared, nn.ReLU(), shared))]
        ['', '0', '1', '2']
    """
    return iter(_bindings(model))


def _bindings(model: nn.Module) -> list[ModuleSite]:
    """`walk_modules`' sites, in one pass with a stack (no generator per module: a
    flagship model has thousands, bound at its first load)."""
    new = tuple.__new__
    out = [new(ModuleSite, ("", None, "", model))]
    seen = {id(model)}
    stack = [(model, "", iter(tuple(model._modules.items())))]
    while stack:
        module, head, items = stack[-1]
        for key, child in items:
            if child is None:
                continue
            path = head + key
            out.append(new(ModuleSite, (path, module, key, child)))
            if id(child) not in seen:
                seen.add(id(child))
                stack.append((child, f"{path}.", iter(tuple(child._modules.items()))))
                break  # its submodules next, then the rest of this one's
        else:
            stack.pop()
    return out


def walk_tensors(model: nn.Module) -> Iterator[Site]:
    """Yield a `Site` for every place a tensor reachable from `model` is held.

    Per module, in `walk_modules` order: parameters, buffers, then plain attributes and
    everything reachable through them (see the module docstring). A shared module or
    object is walked once; a tensor held in several places (tied weights) is yielded at
    each.

    Examples:
        >>> m = nn.Linear(2, 2)
        >>> m.cache = [torch.zeros(1), None, {"k": torch.ones(1)}]
        >>> m.kernel = functools.partial(torch.add, torch.ones(2))
        >>> [s.path for s in walk_tensors(m)]
        ['weight', 'bias', 'cache.0', 'cache.2.k', 'kernel.args.0']
    """
    return iter(_Walker(model).sites_only())


def walk(model: nn.Module, wanted: Callable[[Any], bool] | None = None) -> Reach:
    """Every tensor site and every object reference reachable from `model` (one pass);
    with `wanted`, also every place that holds a value for which `wanted(value)` is true,
    as `walk_values(model, wanted)` finds them, in the same pass (`Reach.values`).

    Examples:
        >>> m = nn.Linear(2, 2)
        >>> m.scale = 0.5
        >>> reach = walk(m, lambda v: type(v) is float)
        >>> [s.path for s in reach.sites], [s.path for s in reach.values]
        (['weight', 'bias'], ['scale'])
    """
    return _Walker(model, wanted).run()


def walk_values(model: nn.Module, wanted: Callable[[Any], bool]) -> list[ValueSite]:
    """Every place reachable from `model` as `walk` reaches tensors (attributes, a
    parameter's own attributes, and what they hold at any depth) that holds a value for
    which `wanted(value)` is true: numbers and other atoms included, tensors and the
    tree's own modules not. A shared object is entered once.

    Examples:
        >>> m = nn.Linear(2, 2)
        >>> m.scale = 0.5
        >>> m.kernel = functools.partial(torch.mul, other=2.0)
        >>> [s.path for s in walk_values(m, lambda v: isinstance(v, float))]
        ['scale', 'kernel.keywords.other']
    """
    found: list[ValueSite] = []
    tree, each = _each_module(model)
    entered: set[int] = set()
    for head, module in each:
        attrs = module.__dict__
        tops = [(attrs, name, top) for name, top in tuple(attrs.items())
                if name not in _MODULE_INTERNALS]
        for table in (module._parameters, module._buffers):  # a parameter's own attributes
            tops += [(table, name, t) for name, t in tuple(table.items())
                     if isinstance(t, torch.Tensor) and t.__dict__]
        for container, name, top in tops:
            stack: list[tuple[Any, str, tuple[Any, ...]]] = [(top, head + name, ())]
            while stack:
                value, path, chain = stack.pop()
                if isinstance(value, torch.Tensor):
                    if value.__dict__ and _enterable(value) and id(value) not in entered:
                        entered.add(id(value))
                        for k, child in reversed(_attrs(value)):
                            stack.append((child, f"{path}.{k.name}", (*chain, k)))
                    continue
                if id(value) in tree:
                    continue
                if wanted(value):
                    found.append(ValueSite(path, module, container, name, chain, value))
                if type(value) in _ATOMS or id(value) in entered:
                    continue
                entered.add(id(value))
                children = _children(value)
                if children is None or any(c is model for _, c in children) or _stops(value):
                    continue
                for k, child in reversed(children):
                    stack.append((child, _join(path, value, k), (*chain, k)))
    return found


def module_prefixes(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(prefix, module)` of every binding, as `named_modules(remove_duplicate=False)`
    gives them (a shared module, and what it holds, at each of its paths), each prefix
    ending in a dot (`""` for the root), without a generator per module.

    Examples:
        >>> shared = nn.Linear(2, 2)
        >>> [p for p, _ in module_prefixes(nn.Sequential(shared, nn.Sequential(shared)))]
        ['', '0.', '1.', '1.0.']
    """
    out: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module, int]] = [("", model, 0)]
    limit = sys.getrecursionlimit()
    while stack:  # depth first, in registration order
        head, module, depth = stack.pop()
        if depth > limit:  # a module inside itself: named_modules would recurse forever
            raise RecursionError(f"{type(model).__name__}'s modules nest deeper than "
                                 f"{limit} at {head[:200]}...: a module inside itself?")
        out.append((head, module))
        stack += reversed([(f"{head}{key}.", child, depth + 1)
                           for key, child in module._modules.items() if child is not None])
    return out


def modules_once(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Each module of the tree once, at its first binding, with its path prefix
    (`"layers.0."`, `""` for the root): `named_modules()`' modules, in its order.

    Examples:
        >>> shared = nn.Linear(2, 2)
        >>> [p for p, _ in modules_once(nn.Sequential(shared, nn.Sequential(shared)))]
        ['', '0.', '1.']
    """
    return _each_module(model)[1]


def _each_module(model: nn.Module) -> tuple[set[int], list[tuple[str, nn.Module]]]:
    """The ids of the tree's modules, and each module once (at its first binding) with
    its path prefix (`"layers.0."`, `""` for the root): `walk_modules`' order, without a
    generator per module (a flagship model has thousands)."""
    each = [("", model)]
    tree = {id(model)}
    stack = [("", iter(tuple(model._modules.items())))]
    while stack:
        head, items = stack[-1]
        for key, child in items:
            if child is None or id(child) in tree:
                continue  # a module shared: its own submodules under its first path
            tree.add(id(child))
            prefix = f"{head}{key}."
            each.append((prefix, child))
            stack.append((prefix, iter(tuple(child._modules.items()))))
            break
        else:
            stack.pop()
    return tree, each


# Types whose instances hold no tensor the walk could find: one set lookup per value.
_ATOMS = frozenset({
    str, bytes, bytearray, int, float, complex, bool, type(None), range, slice,
    torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format,
    types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
    types.MethodDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
    types.ModuleType, types.GeneratorType, types.CoroutineType, types.CodeType,
    types.FrameType, weakref.ref, set, frozenset, type, enum.EnumMeta,
})
# Classes (by name, anywhere in the MRO) that are not the model's state: configs,
# process groups and communicators, engine runners and workers.
_STOP_NAMES = frozenset({
    "BaseModel", "PretrainedConfig", "PreTrainedTokenizerBase", "VllmConfig", "ModelConfig",
    "CacheConfig", "ParallelConfig", "SchedulerConfig", "DeviceConfig", "LoadConfig",
    "CompilationConfig", "ServerArgs", "ProcessGroup", "GroupCoordinator",
    "PyNcclCommunicator", "DeviceCommunicatorBase", "GPUModelRunner", "CPUModelRunner",
    "ModelRunner", "ModelRunnerBase", "Worker", "WorkerBase", "TpModelWorker",
    "ForwardContext", "LLMEngine", "EngineCore", "Scheduler",
})


# Modules of the standard library whose objects are machinery, not state (a logger's
# manager reaches every logger of the process).
_STOP_MODULES = frozenset({
    "logging", "threading", "asyncio", "queue", "socket", "io", "_io", "subprocess",
    "multiprocessing", "concurrent.futures", "concurrent.futures.thread", "selectors",
})


_STOPS: dict[type, bool] = {}
"""Class -> whether the walk stops at its instances (decided once per class)."""


def _stops(value: object) -> bool:
    """Whether `value` is an object the walk does not enter (see the module docstring)."""
    cls = type(value)
    found = _STOPS.get(cls)
    if found is None:
        found = _STOPS[cls] = issubclass(cls, (type, enum.Enum)) or any(
            k.__name__ in _STOP_NAMES
            or k.__module__ in _STOP_MODULES
            or k.__module__.startswith(("torch._C", "graphsafe._", "graphsafe.integrations"))
            for k in cls.__mro__
        )
    return found


class _Walker:
    """One walk: the objects entered so far, and what was found."""

    __slots__ = ("entered", "model", "refs", "sites", "tree", "values", "wanted")

    def __init__(self, model: nn.Module, wanted: Callable[[Any], bool] | None = None) -> None:
        self.model = model
        self.sites: list[Site] = []
        self.refs: list[Ref] = []
        self.tree: set[int] = set()
        self.entered: set[int] = set()
        self.wanted = wanted
        self.values: list[ValueSite] = []

    def run(self) -> Reach:
        self.tree, each = _each_module(self.model)
        wanted = self.wanted
        if self._compiled(each, needed=True):
            return Reach(self.sites, self.refs, None if wanted is None else self.values,
                         [module for _, module in each])
        for head, module in each:
            for container in (module._parameters, module._buffers):
                for name, value in tuple(container.items()):
                    if not isinstance(value, torch.Tensor):
                        continue
                    if value.__dict__ and _enterable(value):  # most hold nothing at all
                        self._visit(module, container, name, head + name, value)
                    else:
                        self.sites.append(
                            _new(Site, (head + name, module, container, name, (), value, -1)))
            attrs = module.__dict__
            for name, value in tuple(attrs.items()):
                if name in _MODULE_INTERNALS:
                    continue
                if type(value) not in _ATOMS:
                    self._visit(module, attrs, name, head + name, value)
                elif wanted is not None and wanted(value):
                    self.values.append(ValueSite(head + name, module, attrs, name, (), value))
        return Reach(self.sites, self._needed(), None if wanted is None else self.values,
                     [module for _, module in each])

    def sites_only(self) -> list[Site]:
        """`run`'s sites, without sorting out its refs (what a caller of tensors alone
        does not read)."""
        self.tree, each = _each_module(self.model)
        if self._compiled(each, needed=False):
            return self.sites
        for head, module in each:
            for container in (module._parameters, module._buffers):
                for name, value in tuple(container.items()):
                    if not isinstance(value, torch.Tensor):
                        continue
                    if value.__dict__ and _enterable(value):
                        self._visit(module, container, name, head + name, value)
                    else:
                        self.sites.append(
                            _new(Site, (head + name, module, container, name, (), value, -1)))
            attrs = module.__dict__
            for name, value in tuple(attrs.items()):
                if name not in _MODULE_INTERNALS and type(value) not in _ATOMS:
                    self._visit(module, attrs, name, head + name, value)
        return self.sites

    def _compiled(self, each: list[tuple[str, nn.Module]], *, needed: bool) -> bool:
        """`run`'s pass over `each`, in one compiled call (`walk.cpp`: the same steps in
        the same order, asking `_stops`, `_children` and `wanted` as this walk does), and
        with `needed` the refs `_needed` keeps; False where the compiled checks are not
        built (the Python pass runs)."""
        native = _native.get()
        if native is None:
            return False
        self.sites, self.refs, self.values = native.walk_run(
            self.model, [module for _, module in each], each, self.wanted, _COMPILED, needed)
        return True

    def _visit(self, module: nn.Module, container: Any, key: Any, path: str, value: Any) -> None:
        """Everything reachable from `container[key]` (`value`), depth first, in order;
        with `wanted`, the values it asks for too, in `walk_values`' order (an atom at
        every reference, another object at each reference, before it is entered).

        Lists, tuples, dicts and functions (what engines keep their state in) are
        entered here, the rest through `_children`: the same steps in the same order."""
        wanted = self.wanted
        model, tree, entered = self.model, self.tree, self.entered
        sites, refs = self.sites, self.refs
        stack: list[tuple[Any, str, tuple[Any, ...], int]] = [(value, path, (), -1)]
        pop, push = stack.pop, stack.append
        while stack:
            value, path, chain, via = pop()
            kind = type(value)
            if kind in _ATOMS:
                if wanted is not None and wanted(value):
                    self.values.append(ValueSite(path, module, container, key, chain, value))
                continue
            if isinstance(value, torch.Tensor):
                sites.append(_new(Site, (path, module, container, key, chain, value, via)))
                if not value.__dict__ or not _enterable(value):
                    continue
                # A parameter's own attributes: entered once, every reference recorded.
                index = len(refs)
                refs.append(_new(Ref, (path, module, container, key, chain, value, via)))
                if id(value) in entered:
                    continue
                entered.add(id(value))
                children = _attrs(value)
            else:
                if id(value) in tree:
                    continue  # the tree's own modules are walked as the tree
                if wanted is not None and wanted(value):
                    self.values.append(ValueSite(path, module, container, key, chain, value))
                index = len(refs)
                refs.append(_new(Ref, (path, module, container, key, chain, value, via)))
                if id(value) in entered:
                    continue  # entered once; this reference is recorded all the same
                entered.add(id(value))
                if kind is list or kind is tuple:
                    for child in value:
                        if child is model:
                            break
                    else:
                        for i in range(len(value) - 1, -1, -1):
                            child = value[i]
                            if type(child) not in _ATOMS or _kept(wanted, child):
                                push((child, f"{path}.{i}", (*chain, i), index))
                    continue
                if kind is dict:
                    items = tuple(value.items())
                    for _, child in items:
                        if child is model:
                            break
                    else:
                        for k, child in reversed(items):
                            if type(child) not in _ATOMS or _kept(wanted, child):
                                push((child, _join(path, value, k), (*chain, k), index))
                    continue
                if kind is types.FunctionType:
                    children = _function_children(value)
                else:
                    if _stops(value):
                        continue
                    found = _children(value)
                    if found is None:
                        continue
                    children = found
                if _holds_model(children, model):
                    continue
            for k, child in reversed(children):
                if type(child) not in _ATOMS or _kept(wanted, child):
                    push((child, _join(path, value, k), (*chain, k), index))

    def _needed(self) -> list[Ref]:
        """The refs to objects that hold a tensor below them, renumbered (and the sites'
        `via` with them)."""
        full: set[int] = set()  # ids of objects with a tensor below
        refs = self.refs
        ids = [id(r.obj) for r in refs]
        vias = [r.via for r in refs]
        for site in self.sites:
            via = site.via
            while via >= 0 and ids[via] not in full:
                full.add(ids[via])
                via = vias[via]
        if len(ids) == len(full):
            return refs  # every object on the way holds a tensor (each is marked once)
        # An object entered once may sit below a ref recorded later (an object reached
        # by several refs): mark to a fixpoint.
        changed = len(set(ids)) != len(ids)
        while changed:
            changed = False
            for i, via in enumerate(vias):
                if via >= 0 and ids[i] in full and ids[via] not in full:
                    full.add(ids[via])
                    changed = True
        new_index: dict[int, int] = {}
        kept: list[Ref] = []
        for i, r in enumerate(refs):
            if id(r.obj) in full:
                new_index[i] = len(kept)
                via = new_index.get(r.via, -1)
                kept.append(r if via == r.via else r._replace(via=via))
        if len(kept) != len(refs):  # renumber (what keeps its index keeps its site)
            self.sites[:] = [
                s if s.via < 0 or new_index.get(s.via, -1) == s.via
                else s._replace(via=new_index.get(s.via, -1))
                for s in self.sites
            ]
        return kept


def _holds_model(children: list[tuple[Any, Any]], model: nn.Module) -> bool:
    """Whether `model` is among `children` (an object that holds the root: not entered)."""
    if len(children) < 8:  # most: a few cells and defaults
        return any(child is model for _, child in children)
    return any(map(operator.is_, map(_SECOND, children), itertools.repeat(model)))


_SECOND = operator.itemgetter(1)


def _children(value: Any) -> list[tuple[Any, Any]] | None:
    """`(step, child)` for everything `value` holds, or None when it is nothing to enter."""
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, functools.partial):
        out: list[tuple[Any, Any]] = [
            (Field("func"), value.func), (Field("args"), value.args),
            (Field("keywords"), value.keywords),
        ]
        return out + _attrs(value)
    if isinstance(value, types.MethodType):
        return [(Field("__self__"), value.__self__), (Field("__func__"), value.__func__)]
    if isinstance(value, types.FunctionType):
        return _function_children(value)
    if isinstance(value, nn.Module):  # outside the tree: its tables, then its attributes
        attrs = vars(value)
        return [(Attr(n), attrs[n]) for n in _MODULE_TABLES if n in attrs] + [
            (Attr(n), v) for n, v in attrs.items() if n not in _MODULE_INTERNALS
        ]
    found = _attrs(value) + _slots(value)
    return found or None


def _function_children(value: types.FunctionType) -> list[tuple[Any, Any]]:
    """A function's closure cells (empty ones left out), defaults, keyword defaults and
    attributes."""
    out: list[tuple[Any, Any]] = []
    cells = value.__closure__
    if cells:
        names = value.__code__.co_freevars
        for i, cell in enumerate(cells):
            try:
                out.append((Cell(i, names[i]), cell.cell_contents))
            except ValueError:  # an empty cell
                continue
    if value.__defaults__:
        out.append((_DEFAULTS, value.__defaults__))
    if value.__kwdefaults__:
        out.append((_KWDEFAULTS, value.__kwdefaults__))
    attrs = value.__dict__
    if attrs:
        out += [(Attr(n), v) for n, v in tuple(attrs.items())]
    return out


_DEFAULTS = Field("__defaults__")
_KWDEFAULTS = Field("__kwdefaults__")
_new = tuple.__new__
"""Builds a `Site` or `Ref` from all its fields, without the named tuple's own `__new__`
(a Python call per tensor and per object of a walk)."""


def _kept(wanted: Callable[[Any], bool] | None, atom: Any) -> bool:
    """Whether a walk asked for `wanted` values looks at `atom` (it holds no tensor)."""
    return wanted is not None and wanted(atom)


def _enterable(t: torch.Tensor) -> bool:
    """Whether the walk enters `t`'s own attributes: a parameter (of any class: vLLM's
    derive from `nn.Parameter`) or a plain tensor, not a wrapper subclass."""
    return isinstance(t, nn.Parameter) or type(t) is torch.Tensor


def _attrs(value: Any) -> list[tuple[Any, Any]]:
    d = getattr(value, "__dict__", None)
    if type(d) is not dict:
        return []
    return [(Attr(n), v) for n, v in tuple(d.items())]


def _slots(value: Any) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    for klass in type(value).__mro__:
        names = klass.__dict__.get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"  # a private slot's real name
            if not isinstance(klass.__dict__.get(name), types.MemberDescriptorType):
                continue  # not a slot of this class (or shadowed): never call a property
            try:
                out.append((Slot(name), klass.__dict__[name].__get__(value, klass)))
            except AttributeError:  # an unset slot
                continue
    return out


def _join(path: str, holder: Any, key: Any) -> str:
    """The dotted path of `holder`'s child under `key`."""
    kind = type(key)
    if kind is Attr:
        if key.name in _MODULE_TABLES and isinstance(holder, nn.Module):
            return path  # a module's tables: `drafts.0.weight`, not `drafts.0._parameters`
        return f"{path}.{key.name}"
    if kind is Slot or kind is Field:
        return f"{path}.{key.name}"
    if kind is Cell:
        return f"{path}.<closure {key.name}>"
    return f"{path}.{key}"


_COMPILED = (Site, Ref, ValueSite, Attr, Slot, Field, Cell, _ATOMS, _MODULE_INTERNALS,
             _MODULE_TABLES, torch.Tensor, nn.Parameter, nn.Module, _children, _stops,
             _DEFAULTS, _KWDEFAULTS, Wanted)
"""What the compiled walk (`walk.cpp`) is handed of this one: its records, steps, sets and
the functions it asks, in the order it reads them."""


def storage_rows(tensors: list[torch.Tensor]
                 ) -> list[tuple[int, int, int, tuple[int, ...]]] | None:
    """`(storage identity, storage_key, data_ptr(), stride())` of each tensor, in one
    compiled call (the storage identity is `untyped_storage()._cdata`); None where the
    compiled checks are not built, or where one of the tensors is not a plain strided
    tensor with a storage (the caller reads each apart, as it would without them)."""
    native = _native.get()
    return None if native is None else native.storage_rows(tensors)


def storage_ids(tensors: list[torch.Tensor]) -> list[int] | None:
    """The first of each of `storage_rows`' rows alone (None as it gives None)."""
    native = _native.get()
    return None if native is None else native.storage_ids(tensors)


def storage_keys(tensors: list[torch.Tensor]) -> list[int] | None:
    """The second of each of `storage_rows`' rows alone (None as it gives None)."""
    native = _native.get()
    return None if native is None else native.storage_keys(tensors)


def storage_key(t: torch.Tensor) -> int:
    """`t.untyped_storage().data_ptr()`, or 0 when there are no bytes to tell apart.

    Zero-byte, meta and storage-less tensors (sparse, wrapper subclasses) all share key 0,
    so 0 must never be used to tell tensors apart or to track them.

    Examples:
        >>> storage_key(torch.empty(0)), storage_key(torch.eye(2).to_sparse())
        (0, 0)
        >>> x = torch.zeros(4)
        >>> storage_key(x[2:]) == storage_key(x) != 0
        True
    """
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else 0
    except (RuntimeError, NotImplementedError):
        return 0


def storage_paths(model: nn.Module) -> dict[int, str]:
    """`{storage key: first path}` of every storage of `model` that has bytes."""
    found: dict[int, str] = {}
    for site in _Walker(model).sites_only():
        key = storage_key(site.tensor)
        if key:
            found.setdefault(key, site.path)
    return found
