"""`load_into`: the checked, in-place write of one checkpoint entry into a parameter."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from graphsafe._errors import WeightLoadError
from graphsafe._runtime.writes.tracking import WriteTracker

__all__ = ["load_into"]

_UNKNOWN = "<unknown>"


def load_into(
    param: torch.Tensor, tensor: object, *, name: str | None = None, cast: bool = False
) -> None:
    """Copy a checkpoint entry into `param`'s storage, refusing anything but an exact fit.

    The write is `param.data.copy_(tensor)`: `param` keeps its object, storage, shape and
    stride, so a graph captured before reads the new values. But `copy_` broadcasts (a
    `(1, D)` entry fills every row of a `[D, D]` weight) and casts dtypes silently, so a
    checkpoint that does not match the model would load wrong: this refuses, before writing
    anything, what `copy_` would stretch or convert. `tensor` may live on another device
    (host memory, usually). Call it from a loader graphsafe tracks (a method wrapped by
    `@gs.graphsafe`, or a `gs.weight_update(model)` block), so derived buffers follow.

    Args:
        param: The parameter (or buffer) to write.
        tensor: The checkpoint entry's value.
        name: The checkpoint entry's name, for the error.
        cast: Convert a tensor of another dtype while copying, instead of refusing it.

    Raises:
        WeightLoadError: `tensor` is not a dense tensor with data (a list, a sparse or
            nested tensor, a tensor on the meta device), its shape differs from
            `param`'s, or its dtype differs and `cast` is False (or it is complex and
            `param` is not); or `param` cannot hold it (elements sharing memory, or the
            meta device outside a tracked load that gives a transient input memory).
            `.name` is the entry; nothing is written.
        TypeError: `param` is not a tensor.

    Examples:
        >>> import torch
        >>> w = torch.zeros(2, 2)
        >>> load_into(w, torch.ones(2, 2), name="w")
        >>> w.sum().item()
        4.0
        >>> load_into(w, torch.ones(1, 2), name="w")  # `copy_` would broadcast it
        Traceback (most recent call last):
        ...
        graphsafe.WeightLoadError: checkpoint entry 'w' has the wrong shape
        ...
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"load_into writes into a tensor, got {type(param).__name__}")
    entry = name if name is not None else _UNKNOWN
    label = repr(name) if name is not None else "(name unknown)"
    want_shape, want_dtype = tuple(param.shape), param.dtype
    if not isinstance(tensor, torch.Tensor):
        raise WeightLoadError(
            f"checkpoint entry {label} is not a tensor",
            name=entry,
            expected=f"a torch.Tensor of shape {want_shape} and dtype {want_dtype}",
            got=type(tensor).__name__,
            fix="convert the entry to a tensor (`torch.as_tensor(value)`) before loading",
        )
    _check_entry(tensor, label, entry, want_shape, want_dtype)
    have_shape = tuple(tensor.shape)
    if have_shape != want_shape:
        raise WeightLoadError(
            f"checkpoint entry {label} has the wrong shape",
            name=entry,
            expected=f"shape {want_shape}",
            got=f"shape {have_shape}",
            fix=f"convert the entry to shape {want_shape} before loading, or check that "
            "the config matches the checkpoint",
        )
    if tensor.dtype.is_complex and not want_dtype.is_complex:
        raise WeightLoadError(
            f"checkpoint entry {label} is complex and its parameter is not",
            name=entry,
            expected=f"dtype {want_dtype}",
            got=f"dtype {tensor.dtype}",
            fix="converting it would drop the imaginary part (`copy_` does, silently): "
            "convert the entry to what the model expects (`entry.real`, `entry.abs()`) "
            "before loading",
        )
    if tensor.dtype != want_dtype and not cast:
        raise WeightLoadError(
            f"checkpoint entry {label} has the wrong dtype",
            name=entry,
            expected=f"dtype {want_dtype}",
            got=f"dtype {tensor.dtype}",
            fix=f"convert the entry to dtype {want_dtype} before loading, or check that "
            "the config matches the checkpoint (`load_into(..., cast=True)` converts it "
            "while copying)",
        )
    _check_param(param, label, entry)
    param.data.copy_(tensor)  # in place: captured graphs keep reading this storage


def _check_entry(
    tensor: torch.Tensor, label: str, entry: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Refuse an entry that is not a dense tensor with data, before reading its shape."""
    want = f"a dense tensor with data, of shape {shape} and dtype {dtype}"
    if tensor.is_nested or tensor.layout != torch.strided:
        kind = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
        raise WeightLoadError(
            f"checkpoint entry {label} is not a dense tensor",
            name=entry,
            expected=want,
            got=f"a {kind} tensor",
            fix="convert the entry to a dense tensor before loading (`entry.to_dense()` "
            "for a sparse one)",
        )
    if tensor.device.type == "meta":
        raise WeightLoadError(
            f"checkpoint entry {label} holds no data: it is on the meta device",
            name=entry,
            expected=want,
            got=f"a meta tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype}",
            fix="load the checkpoint onto a real device (`torch.load(path, "
            "map_location=\"cpu\")`, `safetensors.torch.load_file(path, device=\"cpu\")`), "
            "not with `device=\"meta\"`; materialize a lazy tensor before loading it",
        )


def _check_param(param: torch.Tensor, label: str, entry: str) -> None:
    """Refuse a parameter that cannot hold the entry, where `copy_` would raise torch's
    error or write nothing at all."""
    shape, stride = tuple(param.shape), param.stride()
    if any(st == 0 and n > 1 for st, n in zip(stride, shape, strict=True)):
        raise WeightLoadError(
            f"the parameter of checkpoint entry {label} has elements that share memory",
            name=entry,
            expected="a parameter whose elements each have their own memory",
            got=f"stride {stride} for shape {shape} (an expanded view)",
            fix="give the parameter its own memory once, when the model is built "
            "(`.clone()` the expanded tensor), or load into the tensor it expands",
        )
    if param.device.type == "meta" and not _given_memory(param):
        raise WeightLoadError(
            f"the parameter of checkpoint entry {label} holds no memory: it is on the meta "
            "device",
            name=entry,
            expected="a parameter with memory, or a transient input written by a load "
            "graphsafe tracks",
            got=f"a meta tensor of shape {shape} that no tracked load gives memory: the "
            "write would be lost",
            fix="materialize the model before loading (`model.to_empty(device=...)`, or "
            "build it on a real device); write a transient input from a loader graphsafe "
            "tracks (a method wrapped by `@gs.graphsafe`, or a `gs.weight_update(model)` "
            "block)",
        )


def _given_memory(t: torch.Tensor) -> bool:
    """Whether a write into `t`, on the meta device, goes to real memory: `t` is a view
    of a transient input that a tracked load's tracker holds as the write lands."""
    sid = id(t.untyped_storage())
    return any(
        isinstance(mode, WriteTracker)
        and mode.transients is not None
        and any(sid in tr.sids for tr in mode.transients)
        for mode in _get_current_dispatch_mode_stack()
    )
