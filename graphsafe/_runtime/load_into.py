"""`load_into`: the checked, in-place write of one checkpoint entry into a parameter."""

from __future__ import annotations

import torch

from graphsafe._errors import WeightLoadError

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
        WeightLoadError: `tensor` is not a tensor, its shape differs from `param`'s, or
            its dtype differs and `cast` is False. `.name` is the entry; nothing is
            written.
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
    param.data.copy_(tensor)  # in place: captured graphs keep reading this storage
