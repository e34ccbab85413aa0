"""What every recipe shares: its type, the name reports show, the check of `out=`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from graphsafe._errors import DerivationDriftError

__all__ = ["Recipe", "check_fits", "named"]

Recipe = Callable[..., Any]
"""A derivation function `fn(module, *inputs, out=None)`."""


def named(fn: Recipe, name: str) -> Recipe:
    """Give a recipe the name reports and errors show, e.g. `concat(dim=0)`."""
    fn.__name__ = name.partition("(")[0]
    fn.__qualname__ = name
    fn.__module__ = "graphsafe.recipes"  # where users find it
    return fn


def check_fits(recipe: str, module: object, what: str, out: Tensor, shape: Sequence[int],
               dtype: torch.dtype | None = None) -> None:
    """Refuse an `out` buffer that the result would not fit, before writing anything."""
    # `copy_` broadcasts and torch resizes `out=` tensors; either would hide a drift.
    want = tuple(shape)
    if tuple(out.shape) == want and (dtype is None or out.dtype == dtype):
        return
    expected = f"shape {want}" + (f", dtype {dtype}" if dtype is not None else "")
    raise DerivationDriftError(
        f"{recipe}: the out= buffer for {what} does not fit the result",
        module_class=type(module).__name__,
        derivation=recipe,
        expected=expected,
        got=f"shape {tuple(out.shape)}, dtype {out.dtype}",
        fix="check that the inputs kept the shapes they had when the buffers were "
        "materialized, or refresh without out= to make new buffers",
    )
