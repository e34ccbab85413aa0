"""Staging buffers, kept from one sync to the next.

Each receiving model keeps one per process group (held weakly with the model), and this
process keeps one per group for sending; a sync reuses the one it finds when its buckets
fit, else replaces it.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["release_staging", "staging_buffer"]


def _group_key(group: dist.ProcessGroup | None) -> object:
    return group if group is not None else dist.group.WORLD


_RECV_STAGING: weakref.WeakKeyDictionary[nn.Module, dict[object, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
_SEND_STAGING: dict[object, torch.Tensor] = {}
"""Both tables belong to this module: the sides of a sync take, drop and forget buffers
through `_staging`, `_drop_busy` and `_forget_group`, users through `release_staging`."""


def _table(model: nn.Module | None) -> dict[object, torch.Tensor]:
    """The buffers kept for `model` (None: this process's sending ones), by group."""
    return _SEND_STAGING if model is None else _RECV_STAGING.setdefault(model, {})


def _staging(
    model: nn.Module | None, group: dist.ProcessGroup | None, device: torch.device, need: int
) -> tuple[torch.Tensor, bool]:
    """The buffer kept for `model` (None: sending) on `group`, if it is on `device` and
    holds `need` bytes, else a new one kept in its place; and whether it was reused."""
    table, key = _table(model), _group_key(group)
    buf = table.get(key)
    if buf is not None and buf.device == device and buf.numel() >= need:
        return buf, True
    table.pop(key, None)  # free the old one before allocating the new one
    del buf
    buf = torch.empty(need, dtype=torch.uint8, device=device)
    table[key] = buf
    return buf, False


def _drop_busy(model: nn.Module | None, group: dist.ProcessGroup | None,
               buf: torch.Tensor) -> None:
    """Forget `buf` if it is the one kept: a broadcast may still use it, so no later
    sync may reuse it."""
    table, key = _table(model), _group_key(group)
    if table.get(key) is buf:
        del table[key]


def _forget_group(key: object) -> None:
    """Drop every buffer kept for the group `key` (it failed)."""
    _SEND_STAGING.pop(key, None)
    for table in list(_RECV_STAGING.values()):
        table.pop(key, None)


def staging_buffer(
    model: nn.Module | None = None, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """The staging buffer kept for `model` on `group`, or the sender's for `group`.

    Args:
        model: A model that received weights; None for this process's sending buffer.
        group: The process group of the syncs; the default group when None.

    Returns:
        The flat `uint8` buffer, or None if no sync allocated one.

    Examples:
        >>> staging_buffer(nn.Linear(2, 2)) is None
        True
    """
    if model is None:
        return _SEND_STAGING.get(_group_key(group))
    return _RECV_STAGING.get(model, {}).get(_group_key(group))


def release_staging(
    model: nn.Module | None = None, *, group: dist.ProcessGroup | None = None
) -> int:
    """Free the staging buffer kept for `model` (or the sender's) on `group`.

    The next sync allocates a new one.

    Args:
        model: A model that received weights; None for this process's sending buffer.
        group: The process group of the syncs; the default group when None.

    Returns:
        The bytes released (0 when there was none).

    Examples:
        >>> release_staging(nn.Linear(2, 2))
        0
    """
    table = _SEND_STAGING if model is None else _RECV_STAGING.get(model, {})
    buf = table.pop(_group_key(group), None)
    return 0 if buf is None else buf.numel()
