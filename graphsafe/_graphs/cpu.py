"""The CPU graph backend: a tape of aten ops, replayed the way a CUDA graph replays.

During capture the callable runs eagerly under a `TorchDispatchMode` that records every
aten op. Replay reruns the recorded ops, with a CUDA graph's semantics:

- A tensor that was not produced inside the capture (parameter, buffer, plain attribute,
  static input, `param.data` alias, constant) is bound to the *storage* it had at
  capture time, through an alias tensor the graph holds. Rebinding the original object
  afterwards (`param.data = new`, `t.set_(other)`, `m.x = new`, `register_buffer` again, a
  list item replaced) is not seen: replay reads the old memory, as a CUDA graph reads
  the old address. Writes into that memory (`copy_`, `mul_`, `x[...] = v`) are seen.
- A tensor produced inside the capture is recomputed into a slot on every replay. Those
  the caller still holds when capture ends (outputs) are static: each replay writes the
  new values into their memory, so they keep their identity and data pointer.
- Python control flow and Python scalars are frozen at capture. Reading a tensor's value
  into Python (`.item()`, `bool(t)`, `.tolist()`) raises `CaptureError`, as do ops whose
  output shape depends on tensor values (`nonzero`, boolean-mask indexing): a CUDA graph
  can capture neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from graphsafe._errors import CaptureError
from graphsafe._graphs.capture import CaptureState
from graphsafe._graphs.cpu_codegen import (
    CompiledGraph,
    EnvRef,
    Recorded,
    generate,
    out_indices,
    ref_indices,
    static_aliases,
    storage_alias,
)
from graphsafe._graphs.reads import CompiledFrames
from graphsafe._graphs.source import user_frame as _user_frame
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.writes.tracking import written_args

__all__ = ["CPUBackend", "CompiledGraph"]

aten = torch.ops.aten

# Ops that read a tensor's value into Python. `bool(t)`, `int(t)` and `float(t)` reach
# the dispatcher as `_local_scalar_dense` too.
_VALUE_READ_OPS: dict[Any, str] = {
    aten._local_scalar_dense.default: "`.item()`, `bool(t)`, `int(t)` or `float(t)`",
    aten.equal.default: "`torch.equal`",
    aten.is_nonzero.default: "`bool(t)`",
}

# Tensor methods that read values without going through the dispatcher.
_VALUE_READ_METHODS: dict[Any, str] = {
    torch.Tensor.tolist: "`.tolist()`",
    torch.Tensor.numpy: "`.numpy()`",
    torch.Tensor.__array__: "`numpy.asarray(t)`",
    torch.Tensor.item: "`.item()`",
    torch.Tensor.__bool__: "`bool(t)` (an `if` on a tensor)",
    torch.Tensor.__int__: "`int(t)`",
    torch.Tensor.__float__: "`float(t)`",
    torch.Tensor.__index__: "using a tensor as a Python index",
    torch.Tensor.__complex__: "`complex(t)`",
    # Printing reads values with dispatch modes disabled, so catch it here.
    torch.Tensor.__repr__: "printing a tensor (`repr(t)`, `str(t)`)",
    torch.Tensor.__format__: "formatting a tensor (`f\"{t}\"`)",
}

_VALUE_READ_FIX = (
    "keep values on the device: use tensor ops (`torch.where`, masking) instead of "
    "Python branches on tensor values, and read results after `replay()`"
)

_MASK_DTYPES = (torch.bool, torch.uint8)


class _Known(NamedTuple):
    """What the tape knows about a tensor object it has seen."""

    pos: int  # index into the env
    external: bool
    # For an external tensor, (data_ptr, shape, stride, dtype) when it was aliased: a
    # change means code outside the dispatcher rebound it (`x.data = y`) mid-capture.
    sig: tuple[int, torch.Size, tuple[int, ...], torch.dtype] | None


# aten ops that act without writing an argument: asserts, stream bookkeeping, printing.
_SIDE_EFFECT_MARKS = ("assert", "record", "print", "constrain", "profiler")


def _effectful(func: Any, written: tuple[tuple[int, str], ...]) -> bool:
    if written or torch.Tag.nondeterministic_seeded in func.tags:
        return True
    if getattr(func, "namespace", None) != "aten":
        return True
    name = func._schema.name
    return any(mark in name for mark in _SIDE_EFFECT_MARKS)


def _sig(t: torch.Tensor) -> tuple[int, torch.Size, tuple[int, ...], torch.dtype]:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def _layout(sig: tuple[int, torch.Size, tuple[int, ...], torch.dtype]) -> str:
    ptr, shape, stride, dtype = sig
    return f"data_ptr 0x{ptr:x}, shape {tuple(shape)}, stride {stride}, {dtype}"


def _dynamic_shape_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Why an op's output shape depends on tensor values, or "" when it does not."""
    if torch.Tag.dynamic_output_shape not in func.tags:
        return ""
    if func is aten.index.Tensor:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices):
            return "boolean-mask indexing (`x[mask]`)"
        return ""
    if func is aten.repeat_interleave.Tensor:
        return "" if kwargs.get("output_size") is not None else f"`{func}` without output_size"
    if func is aten.one_hot.default:
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return "" if classes != -1 else "`one_hot` without num_classes"
    return f"`{func}`"


class _ValueReadGuard(TorchFunctionMode):
    """Refuses the Tensor methods that read values without reaching the dispatcher."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # A method a recording hooks (`.tolist()`, `.item()`) is looked up as itself.
        what = _VALUE_READ_METHODS.get(func) or _VALUE_READ_METHODS.get(
            getattr(func, "__wrapped__", None))
        if what is not None:
            raise CaptureError(
                f"{what} reads a tensor's value into Python during capture",
                source=_user_frame(),
                expected="tensor ops only; a graph replays device work, not Python",
                got=what,
                fix=_VALUE_READ_FIX,
            )
        return func(*args, **(kwargs or {}))


class _Tape(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch stubs
    """Runs every aten op eagerly and records it against env indices."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch stubs
        # Weak: a tensor the body dropped must not look like an output, and its id may
        # be reused by a new tensor.
        self.known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._known_get = cast(Callable[[torch.Tensor], "_Known | None"], self.known.get)
        self._known_items = cast(
            Callable[[], Iterator[tuple[torch.Tensor, _Known]]], self.known.items
        )
        self.env: list[torch.Tensor | None] = []
        self.ops: list[Recorded] = []
        self.externals: list[torch.Tensor] = []
        """Aliases of the tensors made outside the capture that the body read."""
        self.inference = torch.is_inference_mode_enabled()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self._refuse(func, args, kwargs)
        # Templates are taken before the op runs: an in-place op reads the tensors
        # its arguments were bound to beforehand.
        args_t = tuple(self._template(a) for a in args)
        kwargs_t = {k: self._template(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        written = written_args(func)
        if written:
            self._check_external_writes(func, written, args, kwargs)
        effectful = _effectful(func, written)
        self.ops.append(Recorded(func, args_t, kwargs_t, self._bind(out), effectful))
        return out

    def _refuse(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        what = _VALUE_READ_OPS.get(func)
        if what is not None:
            raise CaptureError(
                f"{what} reads a tensor's value into Python during capture",
                source=_user_frame(),
                expected="tensor ops only; a graph replays device work, not Python",
                got=f"{func}",
                fix=_VALUE_READ_FIX,
            )
        reason = _dynamic_shape_reason(func, args, kwargs)
        if reason:
            raise CaptureError(
                f"{reason} gives an output whose shape depends on tensor values",
                source=_user_frame(),
                expected="output shapes fixed at capture",
                got=reason,
                fix="use fixed-shape ops (`torch.where`, multiplying by the mask, "
                "`repeat_interleave(..., output_size=n)`) or move the op out of the graph",
            )

    def _ref(self, t: torch.Tensor) -> int:
        known = self._known_get(t)
        if known is not None and (not known.external or known.sig == _sig(t)):
            return known.pos
        # First sight, or an external tensor rebound mid-capture by code the dispatcher
        # does not see (`x.data = y`): from here on ops read its current memory, just as
        # kernels captured from here on would read the new address.
        index = len(self.env)
        self.env.append(storage_alias(t))
        self.known[t] = _Known(index, True, _sig(t))
        return index

    def _template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return EnvRef(self._ref(value))
        if isinstance(value, (list, tuple)):
            items = [self._template(v) for v in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value
            return items if isinstance(value, list) else tuple(items)
        return value

    def _bind_one(self, t: torch.Tensor) -> int | None:
        if t in self.known:
            return None  # an in-place or out= op returned a tensor already bound
        index = len(self.env)
        self.env.append(None)
        self.known[t] = _Known(index, False, None)
        return index

    def _bind(self, out: Any) -> int | tuple[tuple[int, int], ...] | None:
        if isinstance(out, torch.Tensor):
            return self._bind_one(out)
        if isinstance(out, (list, tuple)):
            pairs = []
            for j, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    k = self._bind_one(o)
                    if k is not None:
                        pairs.append((j, k))
            return tuple(pairs) or None
        return None

    def _check_external_writes(
        self,
        func: Any,
        written: tuple[tuple[int, str], ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Refuse ops that change an external tensor's storage or layout (`set_`,
        `resize_`, `t_`): replaying them on the alias would compound every replay."""
        for index, name in written:
            arg = args[index] if index < len(args) else kwargs.get(name)
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                if not isinstance(t, torch.Tensor):
                    continue
                known = self._known_get(t)
                if known is None or not known.external or known.sig is None:
                    continue
                now = _sig(t)
                if known.sig == now:
                    continue
                raise CaptureError(
                    f"`{func}` changes the storage or layout of a tensor created outside "
                    "the capture",
                    source=_user_frame(),
                    expected=_layout(known.sig),
                    got=_layout(now),
                    fix="resize or rebind it before capture; inside a graph only write "
                    "values into it (`copy_`)",
                )

    def compile(self) -> CompiledGraph:
        """Turn the recording into a replay program. Call after the capture body ended,
        while the caller still holds its outputs."""
        statics = [
            (k.pos, t) for t, k in list(self._known_items()) if not k.external
        ]
        aliases = static_aliases(statics)
        live = {k for k, _ in aliases}
        kept: list[Recorded] = []
        for op in reversed(self.ops):
            produced = out_indices(op.outs)
            if op.effectful or any(k in live for k in produced):
                kept.append(op)
                live.update(ref_indices((op.args, op.kwargs)))
        kept.reverse()

        # Free each slot after its last reader, as eager code drops intermediates;
        # static slots live to the end, where they are copied out.
        last_use: dict[int, int] = {}
        for n, op in enumerate(kept):
            for k in ref_indices((op.args, op.kwargs)):
                last_use[k] = n
            for k in out_indices(op.outs):
                last_use.setdefault(k, n)
        externals = {i for i, t in enumerate(self.env) if t is not None}
        keep = externals | {k for k, _ in aliases}
        frees: list[list[int]] = [[] for _ in kept]
        for k, n in last_use.items():
            if k not in keep:
                frees[n].append(k)

        externals_used = [(i, t) for i, t in enumerate(self.env) if t is not None and i in live]
        # What the body read, as a CUDA graph would (it replays every kernel captured),
        # not only what the replay still runs.
        self.externals = [t for t in self.env if t is not None]
        return CompiledGraph(
            generate(kept, frees, externals_used, aliases), len(kept), self.inference
        )


class CPUBackend:
    """Captures a callable by recording its aten ops and replays them with CUDA graph
    semantics (see the module docstring), for `Graph(backend="cpu")`.

    Examples:
        >>> import torch
        >>> w = torch.ones(2)
        >>> x = torch.ones(2)
        >>> g = CPUBackend()
        >>> with g.capture():
        ...     y = w * x
        >>> _ = x.copy_(torch.tensor([2.0, 3.0]))
        >>> g.replay()
        >>> y
        tensor([2., 3.])
    """

    __slots__ = ("_compiled", "_external", "_state", "_trusted")

    def __init__(self) -> None:
        self._compiled: CompiledGraph | None = None
        self._external: list[torch.Tensor] = []
        self._trusted = False
        self._state = CaptureState()

    def warmup(self, fn: Callable[[], object], iters: int) -> None:
        """Run `fn` eagerly `iters` times before capture."""
        for _ in range(iters):
            fn()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record every aten op the body runs, eagerly; the tensors it leaves bound are
        the graph's static outputs.

        Raises:
            CaptureError: The backend already captured, or the body read a tensor's
                value into Python or ran an op whose output shape depends on values.
        """
        with self._state.capturing():
            tape = _Tape()
            watch = CompiledFrames()
            with _ValueReadGuard(), tape, watch:
                yield
            self._compiled = tape.compile()
            self._external = tape.externals
            self._trusted = not watch.compiled

    @property
    def reads(self) -> frozenset[int] | None:
        """Storage keys of what the body read that was made outside the capture; None when
        compiled code ran in it (its kernels may read what no recorded op names)."""
        if not self._trusted:
            return None
        return frozenset(k for t in self._external if (k := storage_key(t)))

    def outside(self) -> list[torch.Tensor]:
        """The tensors (aliases of their storage) the body read that were made outside the
        capture."""
        return list(self._external)

    def replay(self) -> None:
        """Replay the captured ops (`CaptureError` if no capture succeeded)."""
        self._state.check_replay()
        assert self._compiled is not None
        self._compiled.replay()

    @property
    def compiled(self) -> CompiledGraph | None:
        """The compiled program; None before a successful capture."""
        return self._compiled
