"""Binding: derivations attached to the module instances of one model.

`bind` resolves, once, everything a refresh needs: where each input lives (the dict and
key to read it from), which derivations depend on which, the topological order and
everything downstream of each derivation. The runtime's hot loop then does no attribute
walking, no signature inspection and no path resolution.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from graphsafe._declare.decorators import is_marked
from graphsafe._declare.registry import accepts_out, check_signature
from graphsafe._declare.spec import Derivation, DerivationInfo
from graphsafe._errors import GraphSafetyError, RegistrationError
from graphsafe._memory.walk import modules_once, walk_modules
from graphsafe._runtime.bind.inputs import Input, join

__all__ = ["Binding", "BoundDerivation", "bind"]


class BoundDerivation:
    """A derivation bound to one module instance, with everything a refresh needs.

    The module is held weakly: the runtime must not keep the model alive.
    """

    __slots__ = (
        "accepts_out",
        "buffers",
        "container",
        "deps",
        "downstream",
        "fast",
        "fn",
        "geometry",
        "in_refs",
        "index",
        "inputs",
        "leaf_inputs",
        "module_class",
        "module_path",
        "module_ref",
        "nbytes",
        "out_arg",
        "out_paths",
        "outputs",
        "shape0",
        "single_in",
        "spec",
        "transient_inputs",
    )

    def __init__(self, spec: Derivation, module: nn.Module, module_path: str) -> None:
        self.spec = spec
        self.module_ref = weakref.ref(module)
        self.module_path = module_path
        self.module_class = type(module).__name__
        self.fn = _resolve_fn(spec, module)
        self.accepts_out = accepts_out(self.fn)
        self.outputs = spec.outputs
        self.out_paths = tuple(join(module_path, o) for o in spec.outputs)
        self.inputs = tuple(join(module_path, i) for i in spec.inputs)
        self.container: dict[str, Any] = module._buffers
        self.in_refs: list[tuple[dict[str, Any], str]] = []
        self.leaf_inputs: list[Input] = []
        self.transient_inputs: list[Input] = []
        self.deps: set[int] = set()
        self.index = -1
        self.downstream: tuple[int, ...] = ()
        self.buffers: list[torch.Tensor] | None = None
        self.geometry: list[tuple[int, torch.Size, tuple[int, ...]]] = []
        self.nbytes = 0
        self.out_arg: Any = None
        self.fast = False
        self.shape0: torch.Size | None = None
        self.single_in: tuple[dict[str, Any], str] | None = None

    def set_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Record the buffers and precompute what the hot path needs."""
        self.buffers = buffers
        self.geometry = [(t.data_ptr(), t.shape, t.stride()) for t in buffers]
        self.nbytes = sum(t.nbytes for t in buffers)
        self.out_arg = buffers[0] if len(buffers) == 1 else tuple(buffers)
        self.fast = self.accepts_out and len(buffers) == 1
        self.shape0 = buffers[0].shape
        self.single_in = self.in_refs[0] if len(self.in_refs) == 1 else None

    def drop_buffers(self) -> None:
        """Forget the buffers (converted by `.to()` before pin): they are made anew."""
        self.buffers = None

    def use_slow_path(self) -> None:
        """The function returned another tensor than its `out=`: check and copy from now."""
        self.fast = False

    def rehome(self, old: dict[str, Any], new: dict[str, Any], key: str) -> None:
        """An input moved from one container of its module to another: read it there."""
        self.in_refs = [(new if c is old and k == key else c, k) for c, k in self.in_refs]
        if self.buffers is not None:
            self.single_in = self.in_refs[0] if len(self.in_refs) == 1 else None

    def info(self) -> DerivationInfo:
        """What `Runtime.derivations` reports of this derivation."""
        return DerivationInfo(
            derivation=self.spec.name,
            module=self.module_path,
            module_class=self.module_class,
            outputs=self.out_paths,
            inputs=self.inputs,
            shapes=tuple(tuple(t.shape) for t in self.buffers or ()),
            dtypes=tuple(str(t.dtype) for t in self.buffers or ()),
            nbytes=self.nbytes,
            fast_path=self.accepts_out,
        )

    @property
    def path(self) -> str:
        """Dotted path of the first output: the derivation's address in reports."""
        return self.out_paths[0]

    def error(self, cls: type[GraphSafetyError], summary: str, **kw: Any) -> GraphSafetyError:
        kw.setdefault("path", self.path)
        return cls(summary, module_class=self.module_class, derivation=self.spec.name, **kw)


def _resolve_fn(spec: Derivation, module: nn.Module) -> Callable[..., Any]:
    """The function to call: a subclass's plain override of a declared method wins."""
    if spec.method is None:
        return spec.fn
    override = getattr(type(module), spec.method, None)
    if override is None or override is spec.fn or is_marked(override):
        return spec.fn
    check_signature(override, spec, type(module))
    return override  # type: ignore[no-any-return]




class Binding(NamedTuple):
    """The result of `bind`: the plan the engine executes."""

    bound: list[BoundDerivation]
    """BoundDerivation derivations in topological order (`bound[i].index == i`)."""
    inputs: list[Input]
    """Leaf tensors read by derivations."""
    by_path: dict[str, list[int]]
    """Indices of the derivations reading each input path."""
    modules: list[tuple[weakref.ref[nn.Module], str, weakref.ref[nn.Module], str]]
    """`(parent, key, module, path)` of every submodule, both modules held weakly (the
    runtime must not keep the model alive): module identity along every bound path,
    checked before each load and pin."""


def bind(
    model: nn.Module,
    derivations_for: Callable[[type], Sequence[Derivation]],
    on_module: Callable[[nn.Module], None],
) -> Binding:
    """Bind every derivation declared for the classes of `model`'s tree to its instance.

    Resolves input paths, checks output names, orders the derivations topologically and
    precomputes what each refresh needs.

    Args:
        model: The root module.
        derivations_for: The derivations of a module class.
        on_module: Called with every module of the tree.

    Returns:
        The bound derivations in dependency order, their leaf inputs, and the
        derivations reading each input path.

    Raises:
        RegistrationError: Unknown input path, colliding output name, or a cycle.
    """
    bound, produced, absent = _bind_modules(model, derivations_for, on_module)
    inputs: dict[tuple[int, str], Input] = {}
    for b in bound:
        _resolve_inputs(b, produced, absent, inputs)
    _check_transient(bound)
    ordered = _order(bound)
    by_path: dict[str, list[int]] = {}
    for b in ordered:
        for inp in b.leaf_inputs:
            inp.add_consumer(b.index)
        for p in b.inputs:
            by_path.setdefault(p, []).append(b.index)
    sites = [
        (weakref.ref(m.parent), m.key, weakref.ref(m.module), m.path)
        for m in walk_modules(model)
        if m.parent is not None
    ]
    return Binding(ordered, list(inputs.values()), by_path, sites)


_Produced = dict[tuple[int, str], BoundDerivation]
_Absent = dict[tuple[int, str], Derivation]


def _bind_modules(
    model: nn.Module,
    derivations_for: Callable[[type], Sequence[Derivation]],
    on_module: Callable[[nn.Module], None],
) -> tuple[list[BoundDerivation], _Produced, _Absent]:
    """One `BoundDerivation` per derivation whose `when` holds for its module; the
    outputs each produces, and those a false `when` leaves `None` (registered so)."""
    bound: list[BoundDerivation] = []
    produced: _Produced = {}
    absent: _Absent = {}
    of_class: dict[type, Sequence[Derivation]] = {}  # asked once per class, not module
    for prefix, module in modules_once(model):  # as `named_modules()`
        mpath = prefix[:-1]
        on_module(module)
        specs = of_class.get(type(module))
        if specs is None:
            specs = of_class[type(module)] = derivations_for(type(module))
        for spec in specs:
            if spec.when is not None and not spec.when(module):
                for name in spec.outputs:
                    absent[(id(module), name)] = spec
                    if name not in module._buffers and name not in module.__dict__:
                        _register_absent(module, name)
                continue
            b = BoundDerivation(spec, module, mpath)
            for name in spec.outputs:
                _check_output_free(b, module, name)
                produced[(id(module), name)] = b
            bound.append(b)
    return bound, produced, absent


def _register_absent(module: nn.Module, name: str) -> None:
    """`module.register_buffer(name, None, persistent=False)`: an output a false `when`
    leaves `None`. Where no parameter, submodule or class attribute has the name, the
    slot is taken first, so that torch's own check (`hasattr(module, name)`) finds it
    rather than raising, and catching, the error a derived buffer read before it is made
    raises (a formatted message, for every layer but the one that derives it)."""
    if name not in module._parameters and name not in module._modules and not hasattr(
            type(module), name):
        module._buffers[name] = None
        if (_BUFFER_HOOKS is not None and not _BUFFER_HOOKS and name and "." not in name
                and type(module).register_buffer is _REGISTER_BUFFER
                and not isinstance(module, torch.jit.ScriptModule)):
            # All that `register_buffer` does here: its checks pass (the slot is taken, the
            # name a plain one) and no registration hook is there to call.
            module._non_persistent_buffers_set.add(name)
            return
    module.register_buffer(name, None, persistent=False)  # torch's checks, hooks, table


_BUFFER_HOOKS: Any = getattr(torch.nn.modules.module, "_global_buffer_registration_hooks",
                             None)
"""torch's buffer registration hooks (`register_module_buffer_registration_hook`): where
there are any, or torch keeps none there, `register_buffer` runs."""
_REGISTER_BUFFER = nn.Module.register_buffer


def _resolve_inputs(
    b: BoundDerivation,
    produced: _Produced,
    absent: _Absent,
    inputs: dict[tuple[int, str], Input],
) -> None:
    """Where each input of `b` is read: another derivation's output (a dependency) or a
    leaf tensor, shared by every derivation that reads the same holder and name."""
    module = b.module_ref()
    assert module is not None
    for rel, full in zip(b.spec.inputs, b.inputs):
        owner, name = _resolve_input(b, module, rel)
        producer = produced.get((id(owner), name))
        if producer is not None and rel in b.spec.transient:
            raise b.error(
                RegistrationError,
                f"transient input {rel!r} is a derived buffer",
                path=full,
                expected="a checkpoint-format parameter or buffer the loader writes",
                got=f"{full}, an output of {producer.spec.name}",
                fix=f"drop {rel!r} from `transient`: derived buffers are kept",
            )
        if producer is not None:
            b.deps.add(id(producer))
            b.in_refs.append((owner._buffers, name))
            continue
        if (id(owner), name) in absent:
            raise b.error(
                RegistrationError,
                f"input {rel!r} is a derived buffer this module does not own",
                path=full,
                expected=f"{full} materialized by {absent[(id(owner), name)].name}",
                got="its `when` is false for this module, so it stays None",
                fix="make the `when` conditions of the two derivations agree",
            )
        container = _container_of(b, owner, name, full)
        key = (id(container), name)
        inp = inputs.get(key)
        if inp is None:
            inp = inputs[key] = Input(full, owner, container, name)
        b.in_refs.append((container, name))
        b.leaf_inputs.append(inp)
        if rel in b.spec.transient:
            b.transient_inputs.append(inp)
            inp.make_transient()


def _order(bound: list[BoundDerivation]) -> list[BoundDerivation]:
    """`bound` in topological order, each with its index, its dependencies as indices
    and everything downstream of it (itself included)."""
    ordered = _toposort(bound)
    for i, b in enumerate(ordered):
        b.index = i
    by_id = {id(b): b for b in ordered}
    for b in ordered:
        b.deps = {by_id[d].index for d in b.deps}
    users: list[list[int]] = [[] for _ in ordered]
    for b in ordered:
        for d in b.deps:
            users[d].append(b.index)
    reach: list[set[int]] = [set() for _ in ordered]
    for b in reversed(ordered):  # users come later in topological order
        reach[b.index].add(b.index)
        for u in users[b.index]:
            reach[b.index] |= reach[u]
        b.downstream = tuple(sorted(reach[b.index]))
    return ordered


def _check_transient(bound: list[BoundDerivation]) -> None:
    """A transient input is released between updates: every reader must expect that, and
    it must own its storage (a view of another tensor cannot be released alone)."""
    transient = {id(inp): inp for b in bound for inp in b.transient_inputs}
    for b in bound:
        for inp in b.leaf_inputs:
            if id(inp) in transient and inp not in b.transient_inputs:
                raise b.error(
                    RegistrationError,
                    f"{inp.path!r} is transient for one derivation and resident for another",
                    path=inp.path,
                    expected=f"{b.spec.name} to declare {inp.path!r} transient too",
                    got="a resident reader of an input released between updates",
                    fix="declare the input transient in every derivation that reads it, or "
                    "in none",
                )
    for inp in transient.values():
        t = inp.tensor
        if t is not None and (
            t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes
        ):
            raise RegistrationError(
                f"transient input {inp.path!r} shares its storage with other tensors",
                path=inp.path,
                expected="a tensor that owns its storage (it is released on its own)",
                got=f"storage of {t.untyped_storage().nbytes()} bytes, tensor of {t.nbytes} "
                f"at offset {t.storage_offset()}",
                fix="give the transient input its own storage (e.g. `.clone()` it at "
                "construction), or keep it resident",
            )


def _check_output_free(b: BoundDerivation, module: nn.Module, name: str) -> None:
    kind = None
    if name in module._parameters:
        kind = "a parameter"
    elif name in module._modules:
        kind = "a submodule"
    elif name in module._buffers and name not in module._non_persistent_buffers_set:
        kind = "a persistent buffer"
    elif module.__dict__.get(name) is not None and not _adoptable(module.__dict__[name]):
        kind = "an attribute"
    elif name not in module._buffers and hasattr(type(module), name):
        kind = "a class attribute"
    if kind is not None:
        raise b.error(
            RegistrationError,
            f"output {name!r} collides with {kind} of the same name",
            path=join(b.module_path, name),
            expected=f"a free name for the derived buffer {name!r}",
            got=f"{kind} {join(b.module_path, name)!r} already exists",
            fix="rename the output or the existing attribute",
        )


def _adoptable(value: object) -> bool:
    """A plain tensor the class's own code bound (vLLM binds some derived tensors on the
    first load): the engine adopts it as the buffer at materialization if it fits."""
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)


def _resolve_input(b: BoundDerivation, module: nn.Module, rel: str) -> tuple[nn.Module, str]:
    parts = rel.split(".")
    owner = module
    for depth, part in enumerate(parts[:-1]):
        child = owner._modules.get(part)
        if child is None:
            raise b.error(
                RegistrationError,
                f"unknown input path {rel!r}",
                path=join(b.module_path, rel),
                expected=f"a submodule {'.'.join(parts[: depth + 1])!r} of "
                f"{type(module).__name__}",
                got="submodules: " + (", ".join(owner._modules) or "none"),
                fix="inputs are dotted paths relative to the module that owns the derivation",
            )
        owner = child
    return owner, parts[-1]


def _container_of(b: BoundDerivation, owner: nn.Module, name: str, full: str) -> dict[str, Any]:
    for container in (owner._parameters, owner._buffers):
        if name in container:
            if container[name] is None:
                break
            return container
    else:
        if isinstance(owner.__dict__.get(name), torch.Tensor):
            return owner.__dict__
    known = [k for table in (owner._parameters, owner._buffers)
             for k, v in table.items() if v is not None] + [
        k for k, v in owner.__dict__.items() if isinstance(v, torch.Tensor)
    ]
    cls = type(owner).__name__
    if name in owner._parameters or name in owner._buffers:  # there, and None
        raise b.error(
            RegistrationError,
            f"input {full!r} is None on this {cls}",
            path=full,
            expected=f"a tensor at {name!r} of {cls}",
            got=f"{name!r} is None (removed after loading, as quantized kernels do)"
            + (f"; tensors there: {', '.join(known)}" if known else ""),
            fix="skip the modules that do not hold it: "
            f"`when=lambda m: m.{name} is not None` on the derivation",
        )
    raise b.error(
        RegistrationError,
        f"unknown input path {full!r}",
        path=full,
        expected=f"a parameter, buffer or tensor attribute {name!r} of {cls}",
        got=("tensors there: " + ", ".join(known)) if known else "no tensors there",
        fix="check the spelling of `inputs`, or create the tensor in __init__",
    )


def _toposort(bound: list[BoundDerivation]) -> list[BoundDerivation]:
    by_id = {id(b): b for b in bound}
    indeg = {id(b): len(b.deps) for b in bound}
    users: dict[int, list[BoundDerivation]] = {id(b): [] for b in bound}
    for b in bound:
        for d in b.deps:
            users[d].append(b)
    ready = [b for b in bound if indeg[id(b)] == 0]
    order: list[BoundDerivation] = []
    while ready:
        b = ready.pop(0)
        order.append(b)
        for u in users[id(b)]:
            indeg[id(u)] -= 1
            if indeg[id(u)] == 0:
                ready.append(u)
    if len(order) != len(bound):
        left = [b for b in bound if indeg[id(b)] > 0]
        names = " -> ".join(f"{x.spec.name} ({x.path})" for x in left)
        raise left[0].error(
            RegistrationError,
            "derivations depend on each other in a cycle",
            expected="an acyclic graph of derivations",
            got=names,
            fix="break the cycle: no derivation may read, directly or not, its own outputs",
        )
    del by_id
    return order
