"""The flat rebinding check: have any inputs or derived buffers been rebound?

It runs on every load and refresh, so it is a few `map`s and `==`s over flat lists
rather than a walk: identity, pointer and (inputs only) stride of every resident input
and buffer, as recorded at the last refresh.
"""

from __future__ import annotations

from typing import Any

import torch

from graphsafe import _native
from graphsafe._memory.journal import Seen
from graphsafe._runtime.binding import Bound, Input

__all__ = ["Flat"]

_PLAIN = torch._C.DisableTorchFunctionSubclass
_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride


class Flat:
    """Identity, pointer and stride of every resident input and buffer, as flat lists:
    the every-load check that nothing was rebound is a few `map`s and `==`s. Shapes are
    compared only once something differs (a `.data =` view of the same storage changes
    its stride); transient inputs come and go by design and are checked one by one."""

    __slots__ = (
        "containers",
        "ids",
        "keys",
        "n_inputs",
        "native",
        "ptrs",
        "seen",
        "strides",
        "transient",
    )

    def __init__(self, inputs: list[Input], bound: list[Bound]) -> None:
        # What was recorded, not what is there now: a rebinding before this is built
        # must still show.
        rows: list[tuple[dict[str, Any], str, object, int, tuple[int, ...]]] = [
            (inp.container, inp.key, inp.tensor, inp.geometry[0], inp.geometry[2])
            for inp in inputs
            if not inp.transient
        ]
        rows += [
            (b.container, name, buf, ptr, tuple(stride))
            for b in bound
            for name, buf, (ptr, _, stride) in zip(b.outputs, b.buffers or (), b.geometry)
        ]
        self.containers = [r[0] for r in rows]
        self.keys = [r[1] for r in rows]
        self.ids = [id(r[2]) for r in rows]
        self.ptrs = [r[3] for r in rows]
        # Strides of the inputs only: derived buffers are graphsafe's own, locked against
        # resizing; a view bound to one changes its identity, which the ids see.
        self.n_inputs = sum(1 for inp in inputs if not inp.transient)
        self.strides = [r[4] for r in rows[: self.n_inputs]]
        self.transient = [inp for inp in inputs if inp.transient]
        self.seen: Seen | None = None
        """What the last passing check read; a full refresh's witnesses reuse it."""
        self.native = (
            _native.get() if all(type(c) is dict for c in self.containers) else None
        )

    def _now(self) -> list[Any]:
        return list(map(dict.get, self.containers, self.keys))

    def unchanged(self) -> bool:
        if self.native is not None:  # the same comparisons, compiled
            now = self.native.same_bindings(
                self.containers, self.keys, self.ids, self.ptrs, self.strides
            )
            if now is None:
                return False
            self.seen = Seen(self.containers, self.keys, now, self.ids, self.ptrs)
            return True
        tensors = self._now()
        if list(map(id, tensors)) != self.ids:
            return False
        try:
            with _PLAIN():  # metadata reads: no subclass __torch_function__ (vLLM's)
                ok = (
                    list(map(_DATA_PTR, tensors)) == self.ptrs
                    and list(map(_STRIDE, tensors[: self.n_inputs])) == self.strides
                )
        except (TypeError, AttributeError, RuntimeError):
            return False
        if ok:
            self.seen = Seen(self.containers, self.keys, tensors, self.ids, self.ptrs)
        return ok
