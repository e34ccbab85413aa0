"""Probes: how the content audit checks a kernel handle it cannot recompute.

A handle (an int an op returned, kept in a tensor; or an object an op returned, such as
the `ScriptObject` of torch's prepacked quantized weights) stands for state behind it: a packed
weight inside a kernel library. Its recorded chain cannot be run again without making a
new handle, so the audit runs the handle instead: a probe registered for the op that made
it takes the handle and the op's arguments recomputed from the current sources, and
returns what the kernel computes with the handle on a probe input and what the reference
op computes over those arguments; the two must agree within the probe's tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["PROBES", "Probe", "register_probe"]

ProbeRun = Callable[[Any, Sequence[Any]], tuple[torch.Tensor, torch.Tensor]]


class Probe(NamedTuple):
    """`run(handle, args)` -> (the kernel's result with `handle`, the reference result over
    `args`), compared within `atol`/`rtol`."""

    run: ProbeRun
    atol: float
    rtol: float


PROBES: dict[str, Probe] = {}
"""The op that made a handle (`_C.create_onednn_mm_handler`) -> its probe."""


def register_probe(op: str, run: ProbeRun, *, atol: float, rtol: float) -> None:
    """Audit the handles `op` makes with `run` (see the module).

    Args:
        op: The op's name as recorded: `namespace.name` (`_C.create_onednn_mm_handler`).
        run: `run(handle, args)`: `handle` is what the model holds (the tensor holding an
            int handle, or the handle object itself, such as a `ScriptObject`), `args` the op's
            arguments with each tensor recomputed from the current sources; returns
            `(kernel result on a probe input, reference result)`.
        atol: Absolute tolerance (kernels reorder sums).
        rtol: Relative tolerance.

    Examples:
        >>> register_probe("mylib.pack", lambda h, args: (args[0], args[0]), atol=0, rtol=0)
        >>> "mylib.pack" in PROBES
        True
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"tolerances must be >= 0, got atol={atol}, rtol={rtol}")
    PROBES[op] = Probe(run, atol, rtol)
