"""What a verify run measures: each phase's wall time, where tensors live, differences."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["Phases", "max_abs_diff", "pointers"]


class Phases:
    """Says each phase of the run as it starts and ends, with its wall time."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._say(f"[{t0 - self._start:7.2f}s] {name} ...")
        yield
        self._say(f"[{time.perf_counter() - self._start:7.2f}s] {name}: done in "
                  f"{time.perf_counter() - t0:.2f}s")


def pointers(model: nn.Module) -> list[int]:
    """The data pointers of every parameter and buffer: equal lists, no tensor moved."""
    return [t.data_ptr() for t in [*model.parameters(), *model.buffers()]]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|."""
    return float((a - b).abs().max().item())
