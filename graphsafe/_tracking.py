"""Write tracking at the dispatcher.

`WriteTracker` is a `TorchDispatchMode` that sees every aten op and notes which watched
storages an op writes (its schema marks the argument `(a!)`: in-place ops, `out=` ops,
`copy_`, `set_`). It works whatever Python object the write goes through:
`param.data.copy_(w)` writes the parameter's storage although it does not bump the
parameter's version counter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["WriteTracker", "storage_key"]

# Per op overload: (positional index, name) of every argument the op writes.
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def storage_key(t: torch.Tensor) -> int:
    """The key graphsafe tracks writes by: the address of the tensor's storage.

    Args:
        t: Any tensor.

    Returns:
        The storage's data pointer (0 for an empty storage).

    Examples:
        >>> t = torch.zeros(4)
        >>> storage_key(t[1:]) == storage_key(t)
        True
    """
    return int(t.untyped_storage().data_ptr())


def _written_args(func: Any) -> tuple[tuple[int, str], ...]:
    found = _WRITES.get(func)
    if found is None:
        found = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITES[func] = found
    return found


class WriteTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes writes into watched storages; optionally refuses them.

    Args:
        watched: Storage keys (see `storage_key`) to watch, mapped to anything the
            caller wants back (e.g. a tensor path).
        on_write: Called as `on_write(key, op_name)` BEFORE a watched storage is written;
            raising there refuses the write, so nothing is changed.

    Examples:
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> with WriteTracker({storage_key(p): "p"}) as tracker:
        ...     _ = p.data.copy_(torch.ones(3))
        >>> list(tracker.written) == [storage_key(p)]
        True
    """

    def __init__(
        self,
        watched: Mapping[int, object],
        on_write: Callable[[int, str], None] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.watched = watched
        self.on_write = on_write
        self.written: set[int] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        writes = _written_args(func)
        if writes:
            nargs = len(args)
            for index, name in writes:
                arg = args[index] if index < nargs else kwargs.get(name)
                if isinstance(arg, torch.Tensor):
                    self._note(arg, func)
                elif isinstance(arg, (list, tuple)):
                    for item in arg:
                        if isinstance(item, torch.Tensor):
                            self._note(item, func)
        return func(*args, **kwargs)

    def _note(self, t: torch.Tensor, func: Any) -> None:
        key = int(t.untyped_storage().data_ptr())
        if key in self.watched:
            if self.on_write is not None:
                self.on_write(key, str(func))
            self.written.add(key)
