"""Running one derivation: the checked refresh, the first materialization, and the
repair of a function that returned a tensor other than its `out=`.

The engine's hot loop calls the derivation straight into its buffer itself; every other
case comes here. Each function checks before it writes: a refused result or write leaves
the buffers as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from graphsafe._memory.walk import storage_key
from graphsafe._runtime.bind.binding import BoundDerivation
from graphsafe._runtime.bind.inputs import join, pin_storage
from graphsafe._runtime.bind.model_map import ModelStorages
from graphsafe._runtime.refresh.checks import (
    adoptee,
    as_results,
    check_results,
    impurity_refusal,
    read_refusal,
    refuse_rebound_output,
    refuse_resized,
)
from graphsafe._runtime.writes.tracking import ReadGuard, WriteTracker

__all__ = ["FAST", "SLOW", "copy_apart", "materialize", "refresh_checked"]

FAST, SLOW = 0, 1
"""How a refresh wrote its buffers: straight through `out=`, or computed then copied."""


def copy_apart(b: BoundDerivation, ret: Any) -> int:
    """A function that accepts `out=` returned another tensor: validate, copy in."""
    assert b.buffers is not None
    b.buffers[0].copy_(check_results(b, ret)[0])
    b.use_slow_path()  # from now on through refresh_checked
    refuse_rebound_output(b)
    return SLOW


def refresh_checked(b: BoundDerivation, purity: Mapping[int, str] | None) -> int:
    """Every other case: several outputs, no `out=`, strict purity."""
    module = b.module_ref()
    buffers = b.buffers
    assert module is not None and buffers is not None
    args = [c[k] for c, k in b.in_refs]
    guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if purity is not None:
        own = {storage_key(t) for t in buffers}
        guard = WriteTracker(
            {k: p for k, p in purity.items() if k not in own}, impurity_refusal(b, purity)
        )
    if b.accepts_out:
        out = b.out_arg
        try:
            with guard:
                ret = b.fn(module, *args, out=out)
        except Exception as exc:
            refuse_resized(b, exc)
            raise
        refuse_resized(b, None)
        if ret is out or (
            isinstance(ret, (tuple, list))
            and len(ret) == len(buffers)
            and all(r is o for r, o in zip(ret, buffers))
        ):
            return FAST
    else:
        with guard:
            ret = b.fn(module, *args)
    results = check_results(b, ret)
    if len(results) == 1:
        buffers[0].copy_(results[0])
    else:
        torch._foreach_copy_(buffers, results)
    refuse_rebound_output(b)
    return SLOW


def materialize(b: BoundDerivation, watch: ModelStorages | dict[int, str]
                ) -> list[torch.Tensor]:
    """First call: refuse impure writes and undeclared reads, then allocate the buffers
    (or adopt the class's own tensors) and return them. `watch` (the model's storages)
    is looked up only for what the function did not make itself (`ReadGuard.fresh`)."""
    module = b.module_ref()
    assert module is not None
    args = [c[k] for c, k in b.in_refs]
    declared = {storage_key(t) for t in args}
    guard = ReadGuard(watch, impurity_refusal(b, watch), declared, read_refusal(b, watch))
    with guard:
        ret = b.fn(module, *args)
    results = as_results(b, ret)
    fresh: list[torch.Tensor] = []
    for r in results:
        t = r.detach()
        key = storage_key(t)
        if t.untyped_storage().nbytes() != t.nbytes or (
                key and key not in guard.fresh and key in watch):
            # Shares memory with a model tensor (a view of an input): own a copy.
            t = t.clone(memory_format=torch.contiguous_format)
        if t.is_inference():  # computed under inference_mode: keep a versioned copy
            with torch.inference_mode(False):
                t = t.clone()
        fresh.append(t)
    # Every output is checked before any is written: a refusal leaves the module as is.
    adopted = [adoptee(b, module, n, t, watch) for n, t in zip(b.outputs, fresh)]
    buffers: list[torch.Tensor] = []
    for name, t, have in zip(b.outputs, fresh, adopted):
        existing = module._buffers.get(name)
        if have is not None:
            have.copy_(t)  # the class's own tensor: a graph may hold its address
            del module.__dict__[name]
            module.register_buffer(name, have, persistent=False)
            t = have
        elif (
            isinstance(existing, torch.Tensor)
            and existing.shape == t.shape
            and existing.dtype == t.dtype
            and existing.device == t.device
            and existing.is_contiguous() == t.is_contiguous()
        ):
            existing.copy_(t)  # an earlier binding's buffer: keep its storage
            t = existing
        else:
            t = pin_storage(t)
            if name in module.__dict__ and module.__dict__[name] is None:
                del module.__dict__[name]  # a `self.x = None` placeholder from __init__
            module.register_buffer(name, t, persistent=False)
        buffers.append(t)
        watch.setdefault(storage_key(t), join(b.module_path, name))
    return buffers
