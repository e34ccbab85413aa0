"""The CPU graph's compiled form: recorded aten ops turned into one Python function.

`generate` writes and compiles a function that reruns the recorded ops in order, with
every tensor from outside the capture bound to the storage it had at capture time; the
recorder (`graphsafe._graphs.cpu`) produces the ops and wraps it in a `CompiledGraph`.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import keyword
import linecache
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

__all__ = [
    "CompiledGraph",
    "Recorded",
    "EnvRef",
    "generate",
    "out_indices",
    "ref_indices",
    "static_aliases",
    "storage_alias",
]

_GRAPH_IDS = itertools.count()
_GRAD_ENABLED = torch.is_grad_enabled
_SET_GRAD = torch._C._set_grad_enabled
_KEEP_SOURCES = 256
_SOURCES: collections.deque[str] = collections.deque()


class EnvRef:
    """Placeholder in a recorded argument: the tensor at `env[index]`."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class Recorded(NamedTuple):
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: int | tuple[tuple[int, int], ...] | None
    # Kept even when its results are unused: it writes an argument, draws random
    # numbers, or is not a plain aten op (a custom op may act through other channels).
    effectful: bool


def storage_alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor bound to `t`'s storage, offset, shape and stride, not to `t`: rebinding
    `t` later leaves the alias on the old memory, which it keeps alive."""
    if t.layout is not torch.strided:
        # No storage to bind (sparse and the like): hold the object itself.
        return t
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    # The lazy negation and conjugation bits live on the tensor, not in its memory.
    if t.is_neg():
        alias = torch._neg_view(alias)
    if t.is_conj():
        alias = alias.conj()
    return alias


def ref_indices(template: Any) -> Iterator[int]:
    if isinstance(template, EnvRef):
        yield template.index
    elif isinstance(template, (list, tuple)):
        for item in template:
            yield from ref_indices(item)
    elif isinstance(template, dict):
        for item in template.values():
            yield from ref_indices(item)


def out_indices(outs: int | tuple[tuple[int, int], ...] | None) -> tuple[int, ...]:
    if outs is None:
        return ()
    if isinstance(outs, int):
        return (outs,)
    return tuple(k for _, k in outs)


def static_aliases(
    statics: list[tuple[int, torch.Tensor]],
) -> tuple[tuple[int, torch.Tensor], ...]:
    """Storage aliases to copy each replay's results into, one per static output.

    Aliases, not the caller's objects: like a CUDA graph, replay writes the memory the
    outputs had at capture, whatever the caller rebinds them to later. Where one static
    tensor covers its whole storage, views of it (a base kept alive by a view, `h` and
    `h.view(-1)`) need no copy of their own.
    """
    by_storage: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for k, t in statics:
        if t.layout is not torch.strided:
            by_storage.setdefault(-1 - k, []).append((k, t))
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -1 - k
        by_storage.setdefault(key, []).append((k, t))
    chosen: list[tuple[int, torch.Tensor]] = []
    for group in by_storage.values():
        cover = next((kt for kt in group if _covers_storage(kt[1])), None)
        for k, t in [cover] if cover is not None else group:
            chosen.append((k, storage_alias(t)))
    chosen.sort(key=lambda kt: kt[0])
    return tuple(chosen)


def _covers_storage(t: torch.Tensor) -> bool:
    return (
        t.layout is torch.strided
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
        and not t.is_neg()
        and not t.is_conj()
    )


class _Source:
    """Builds the replay function's source; values it cannot spell go in its namespace."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {}
        self.lines: list[str] = []

    def name(self, prefix: str, value: Any) -> str:
        name = f"{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def expr(self, template: Any) -> str:
        if isinstance(template, EnvRef):
            return f"v{template.index}"
        if template is None or type(template) in (bool, int):
            return repr(template)
        if isinstance(template, (list, tuple)) and any(True for _ in ref_indices(template)):
            items = ", ".join(self.expr(t) for t in template)
            if isinstance(template, list):
                return f"[{items}]"
            return f"({items},)" if len(template) == 1 else f"({items})"
        # Constants (floats, dtypes, lists without tensors) are passed as the same object
        # on every replay, as they were at capture.
        return self.name("c", template)

    def call(self, op: Recorded) -> str:
        fn = self.name("f", getattr(op.func, "_op", op.func))
        args = [self.expr(a) for a in op.args]
        for key, value in op.kwargs.items():
            if key.isidentifier() and not keyword.iskeyword(key):
                args.append(f"{key}={self.expr(value)}")
            else:
                args.append(f"**{{{key!r}: {self.expr(value)}}}")
        return f"{fn}({', '.join(args)})"


def generate(
    ops: list[Recorded],
    frees: list[list[int]],
    externals: list[tuple[int, torch.Tensor]],
    statics: tuple[tuple[int, torch.Tensor], ...],
) -> Callable[[], None]:
    """Compile the ops into one Python function, one line per op.

    Each env entry is a local variable `v<index>`, so replay pays only for the op calls:
    no per-op template patching or pytree work.
    """
    src = _Source()
    body = src.lines
    for i, alias in externals:
        body.append(f"v{i} = {src.name('x', alias)}  # bound at capture: {_describe(alias)}")
    for op, free in zip(ops, frees, strict=True):
        call = src.call(op)
        if op.outs is None:
            body.append(f"{call}  # {op.func}")
        elif isinstance(op.outs, int):
            body.append(f"v{op.outs} = {call}  # {op.func}")
        else:
            body.append(f"r = {call}  # {op.func}")
            body.extend(f"v{k} = r[{j}]" for j, k in op.outs)
            body.append("del r")
        if free:
            # Drop intermediates after their last use, as eager code does.
            body.append("del " + ", ".join(f"v{k}" for k in sorted(free)))
    for k, alias in statics:
        s = src.name("s", alias)
        # A static output that views external memory was written in place already.
        body.append(f"if v{k}.data_ptr() != {s}.data_ptr(): {s}.copy_(v{k})")
    text = "def replay():\n" + "".join(f"    {line}\n" for line in body or ["pass"])
    filename = f"<graphsafe cpu graph {next(_GRAPH_IDS)}>"
    # Registered so that tracebacks and `inspect` show the generated lines. The oldest
    # entries are dropped here, not from a GC finalizer: linecache.checkcache() iterates
    # the cache and fails if an entry vanishes under it.
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    _SOURCES.append(filename)
    while len(_SOURCES) > _KEEP_SOURCES:
        linecache.cache.pop(_SOURCES.popleft(), None)
    exec(compile(text, filename, "exec"), src.namespace)
    replay: Callable[[], None] = src.namespace["replay"]
    return replay


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


class CompiledGraph:
    """A recorded capture, ready to replay; built by `CPUBackend.capture`.

    Args:
        fn: The generated replay function (see `code`).
        num_ops: How many ops it runs.
        inference: Whether capture ran under `torch.inference_mode()`; replay then does
            too, since its aliases and outputs are inference tensors.

    Examples:
        >>> import torch
        >>> from graphsafe._graphs.cpu import CPUBackend
        >>> g = CPUBackend()
        >>> with g.capture():
        ...     y = torch.ones(2) * 3
        >>> g.compiled.num_ops, "# aten.mul.Tensor" in g.compiled.code  # ones, mul
        (2, True)
    """

    __slots__ = ("_fn", "_inference", "_num_ops")

    def __init__(self, fn: Callable[[], None], num_ops: int, inference: bool) -> None:
        self._fn = fn
        self._num_ops = num_ops
        self._inference = inference

    @property
    def num_ops(self) -> int:
        """Number of ops each replay runs, once ops whose results are unused are dropped."""
        return self._num_ops

    @property
    def code(self) -> str:
        """The replay function's source, one line per aten op; a failing replay's traceback
        points into it."""
        return inspect.getsource(self._fn)

    def replay(self) -> None:
        """Rerun the recorded ops and write the results into the static outputs."""
        if self._inference:
            with torch.inference_mode():
                self._fn()
            return
        # Grad mode switched directly: `torch.no_grad()` costs more than an empty replay.
        was = _GRAD_ENABLED()
        _SET_GRAD(False)
        try:
            self._fn()
        finally:
            _SET_GRAD(was)
