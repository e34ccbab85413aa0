"""What the ledger records at snapshot time: one `Pin` per tensor, one `SubmodulePin` per binding.

A pin holds the site it was found at (and so the tensor object itself), the module
attribute its container is, and the tensor's storage key, offset, shape, stride, dtype and
device as they were; a binding holds `parent._modules[key]` and the module it held. Only
strided tensors with a storage are pinned (`has_storage`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from graphsafe._memory.walk import Site, storage_key

__all__ = ["CHECK_ERRORS", "RESOLVE_ERRORS", "SubmodulePin", "Pin", "has_storage", "pin"]

# Raised while re-resolving a path whose container entry is gone or is no tensor (a
# closure cell emptied by `del`: ValueError).
RESOLVE_ERRORS = (KeyError, IndexError, TypeError, AttributeError, ValueError)
# Also raised by the flat check, by `data_ptr()` of a tensor that has no storage.
CHECK_ERRORS = (*RESOLVE_ERRORS, RuntimeError)


class Pin(NamedTuple):
    """Where one tensor lives and what it looked like at snapshot time."""

    site: Site  # holds the pinned tensor object itself
    slot: str  # the module attribute `site.container` is: _parameters, _buffers, __dict__
    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class SubmodulePin(NamedTuple):
    """One submodule binding: `parent._modules[key]` was `module` at snapshot time."""

    path: str
    parent: nn.Module
    key: str
    module: nn.Module


def has_storage(t: torch.Tensor) -> bool:
    """Whether `t` has a storage to pin. Sparse and other storage-less tensors are not
    pinned: a graph reads their parts, which are tensors of their own."""
    if t.layout is not torch.strided:
        return False
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def pin(s: Site) -> Pin:
    """The pin of the tensor at `s`: its site, container slot and geometry as they are now."""
    t = s.tensor
    if s.container is s.module._parameters:
        slot = "_parameters"
    elif s.container is s.module._buffers:
        slot = "_buffers"
    else:
        slot = "__dict__"
    return Pin(
        site=s,
        slot=slot,
        storage=storage_key(t),
        offset=int(t.storage_offset()),
        shape=tuple(t.shape),
        stride=t.stride(),
        dtype=t.dtype,
        device=t.device,
    )
