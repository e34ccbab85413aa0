"""Checks of derivation results and storage, and the errors they raise.

Every check here refuses before anything is written where that is possible: a result
computed apart is validated before it is copied in, an impure write is refused before
it happens, and an `out=` buffer that torch resized is put back on its own storage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from graphsafe._declare.spec import Drift
from graphsafe._errors import (
    DerivationDriftError,
    ImpureDerivationError,
    RegistrationError,
    StorageMovedError,
)
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.bind.binding import BoundDerivation
from graphsafe._runtime.bind.inputs import Input, describe, join

__all__ = [
    "refuse_rebound_output",
    "adoptee",
    "as_results",
    "check_results",
    "geometry_held",
    "impurity_refusal",
    "rebound_error",
    "read_refusal",
    "refuse_resized",
]


def geometry_held(b: BoundDerivation) -> bool:
    """Whether every buffer of `b` still has its recorded pointer and shape."""
    return all(
        buf.data_ptr() == ptr and buf.shape == shape
        for buf, (ptr, shape, _) in zip(b.buffers or (), b.geometry)
    )


def check_results(b: BoundDerivation, ret: Any) -> list[torch.Tensor]:
    """`ret`, computed apart, as one tensor per output of `b`, each checked against its
    buffer before any write: `DerivationDriftError` if a shape, dtype, device or layout
    differs."""
    results = as_results(b, ret)
    for j, (r, buf) in enumerate(zip(results, b.buffers or ())):
        if (
            r.shape != buf.shape
            or r.dtype != buf.dtype
            or r.device != buf.device
            or r.layout != buf.layout
        ):
            raise b.error(
                DerivationDriftError,
                f"result of {b.spec.name} does not fit the buffer materialized for it",
                path=b.out_paths[j],
                expected=f"shape {tuple(buf.shape)}, dtype {buf.dtype}, device "
                f"{buf.device}, layout {buf.layout}",
                got=f"shape {tuple(r.shape)}, dtype {r.dtype}, device {r.device}, "
                f"layout {r.layout}",
                fix="a derived buffer keeps its shape, dtype and device for its whole "
                "life: check that the loader wrote inputs of the original shapes; if "
                "the model really changed, build a new model and re-capture",
            )
    return results


def refuse_resized(b: BoundDerivation, cause: BaseException | None) -> None:
    """Undo torch's resize of an `out=` buffer of the wrong shape, and refuse it.

    torch resizes an `out=` tensor whose shape does not fit the result (and raises on our
    non-resizable storage when it would grow). If a buffer of `b` changed geometry, it is
    put back on its own storage and `DerivationDriftError` raised from `cause` (what the
    call raised, if anything); the caller marks it stale, as the bytes may be partly written.
    """
    for j, buf in enumerate(b.buffers or ()):
        ptr, shape, stride = b.geometry[j]
        if buf.data_ptr() == ptr and buf.shape == shape and buf.stride() == stride:
            continue
        got = f"shape {tuple(buf.shape)}, stride {buf.stride()}, storage 0x{buf.data_ptr():x}"
        moved = buf.data_ptr() != ptr
        if not moved:
            buf.set_(buf.untyped_storage(), buf.storage_offset(), shape, stride)
        raise b.error(
            DerivationDriftError,
            f"{b.spec.name} computed a result of the wrong shape for its buffer "
            + ("(torch reallocated the buffer)" if moved else "(the write was refused)"),
            path=b.out_paths[j],
            expected=f"shape {tuple(shape)}, stride {stride}, storage 0x{ptr:x}",
            got=got + (f" ({type(cause).__name__}: {cause})" if cause is not None else ""),
            fix="make the derivation produce the buffer's shape; check that the loader "
            "wrote inputs of the original shapes",
        ) from cause


def impurity_refusal(b: BoundDerivation, watch: Mapping[int, str]) -> Callable[[int, str], None]:
    """The `on_write` hook of a `WriteTracker` that refuses, before it happens, a write by
    `b`'s function into a model tensor (`watch`: storage key -> path), with
    `ImpureDerivationError`."""

    def refuse(key: int, op: str) -> None:
        raise b.error(
            ImpureDerivationError,
            f"{b.spec.name} wrote into {watch[key]!r}, a tensor of the model",
            path=watch[key],
            expected="a pure function: read the inputs, write only the result (or `out`)",
            got=f"{op} writing {watch[key]}",
            fix="compute into a new tensor (e.g. `w * scale` instead of `w.mul_(scale)`); "
            "the write was refused, nothing was changed",
        )

    return refuse


def read_refusal(b: BoundDerivation, forbidden: Mapping[int, str]) -> Callable[[int, str], None]:
    """The `on_read` hook of a `ReadGuard` that refuses, with `RegistrationError` before the
    read happens, an undeclared read by `b`'s function (`forbidden`: storage key -> path)."""

    def refuse(key: int, op: str) -> None:
        raise b.error(
            RegistrationError,
            f"{b.spec.name} reads {forbidden[key]!r}, a tensor of the model it does not "
            "declare as an input",
            path=forbidden[key],
            expected=f"reads of its declared inputs only: {', '.join(b.inputs)}",
            got=f"{op} reading {forbidden[key]}",
            fix=f"add the path of {forbidden[key]!r} (relative to the module) to the "
            "derivation's `inputs` and take it as a parameter; an undeclared input is never "
            "refreshed when it changes",
        )

    return refuse


def adoptee(
    b: BoundDerivation, module: nn.Module, name: str, t: torch.Tensor, watch: Mapping[int, str]
) -> torch.Tensor | None:
    """The tensor the class's own code already bound as output `name`, if any.

    vLLM's DeepSeek V4 binds `hc_attn_fn_broadcast` on its first load and writes into it
    afterwards; a captured graph may already hold its address. The buffer keeps that
    storage: the caller copies the derivation's first result `t` into it and registers it.
    `RegistrationError` (nothing written) if it does not fit `t` or shares memory with a
    model tensor (`watch`: storage key -> path).
    """
    have = module.__dict__.get(name)
    if not isinstance(have, torch.Tensor):
        return None
    path = join(b.module_path, name)
    problems = [
        f"{what} {h} (the derivation gives {w})"
        for what, h, w in (
            ("shape", tuple(have.shape), tuple(t.shape)),
            ("dtype", have.dtype, t.dtype),
            ("device", have.device, t.device),
            ("layout", have.layout, t.layout),
        )
        if h != w
    ]
    owner = watch.get(storage_key(have)) if have.device.type != "meta" else None
    if owner is not None and owner != path:
        problems.append(f"it shares memory with {owner}")
    elif have.layout == torch.strided and not _dense(have):
        problems.append("its elements overlap in memory")
    if not problems:
        return have
    raise b.error(
        RegistrationError,
        f"the tensor already bound as {path!r} cannot be adopted as the derived buffer",
        path=path,
        expected=f"a tensor of shape {tuple(t.shape)}, {t.dtype} on {t.device}, "
        "with memory of its own",
        got="; ".join(problems),
        fix=f"bind {name!r} to a tensor that fits, leave it unset (or None) for graphsafe "
        "to allocate, or rename the output",
    )


def _dense(t: torch.Tensor) -> bool:
    """Whether no two elements of `t` share an address (writes through it are whole)."""
    if t.numel() <= 1:
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    span = 1
    for st, sz in dims:
        if st < span:
            return False
        span = st * sz
    return True


def as_results(b: BoundDerivation, ret: Any) -> list[torch.Tensor]:
    """`ret` as one tensor per output of `b`, in order (else `DerivationDriftError`)."""
    results = list(ret) if isinstance(ret, (tuple, list)) else [ret]
    if len(results) != len(b.outputs) or not all(
        isinstance(r, torch.Tensor) for r in results
    ):
        raise b.error(
            DerivationDriftError,
            f"{b.spec.name} returned something other than one tensor per output",
            expected=f"{len(b.outputs)} tensor(s) for {b.outputs}",
            got=f"{type(ret).__name__}"
            + (f" of {len(results)}" if isinstance(ret, (tuple, list)) else ""),
            fix="return a tensor, or a tuple of tensors in the order of `outputs`",
        )
    return results


def rebound_error(
    inputs: Sequence[Input],
    buffers: Sequence[tuple[BoundDerivation, int]],
    bound: Sequence[BoundDerivation],
) -> StorageMovedError:
    """The `StorageMovedError` for pinned `inputs` and `buffers` (derivation, output index)
    that were rebound: every one named, the first detailed (its consumer from `bound`)."""
    drifts: list[Drift] = []
    for inp in inputs:
        now = inp.container.get(inp.key)
        owner = inp.owner()
        cls = type(owner).__name__ if owner is not None else "?"
        old = f"0x{inp.geometry[0]:x}, shape {inp.geometry[1]}, stride {inp.geometry[2]}"
        if isinstance(now, torch.Tensor):
            new = f"0x{now.data_ptr():x}, shape {tuple(now.shape)}, stride {now.stride()}"
            drifts.append(Drift(path=inp.path, module_class=cls, what="storage", old=old, new=new))
        else:
            new = "None" if now is None else "missing"
            drifts.append(Drift(path=inp.path, module_class=cls, what="removed", old=old, new=new))
    for b, j in buffers:
        ptr, shape, _ = b.geometry[j]
        now = b.container.get(b.outputs[j])
        old = f"0x{ptr:x}, shape {tuple(shape)}"
        new = (
            f"0x{now.data_ptr():x}, shape {tuple(now.shape)}"
            if isinstance(now, torch.Tensor)
            else repr(now)
        )
        what = "storage" if isinstance(now, torch.Tensor) else "removed"
        drifts.append(
            Drift(path=b.out_paths[j], module_class=b.module_class, what=what, old=old, new=new)
        )
    paths = [d.path for d in drifts]
    if inputs:
        inp = inputs[0]
        b = bound[inp.consumers[0]]
        path, now, expected = inp.path, inp.container.get(inp.key), f"storage 0x{inp.geometry[0]:x}"
    else:
        b, j = buffers[0]
        path, now = b.out_paths[j], b.container.get(b.outputs[j])
        expected = f"storage 0x{b.geometry[j][0]:x}, shape {tuple(b.geometry[j][1])}"
    return StorageMovedError(
        f"{len(paths)} pinned tensor(s) were rebound to new storage: " + ", ".join(paths),
        drifts=tuple(drifts),
        module_class=b.module_class,
        path=path,
        derivation=b.spec.name,
        expected=expected + " (pinned)",
        got=describe(now) if isinstance(now, torch.Tensor) else repr(now),
        fix="write new weights into the existing tensors (`param.data.copy_(w)`) instead "
        "of rebinding them (`param.data = w`, attribute assignment, `set_`); never assign "
        "derived buffers; or release the graphs' pins (Graph.reset()), refresh() and "
        "re-capture",
    )


def refuse_rebound_output(b: BoundDerivation) -> None:
    """Refuse a derivation that assigned its own output (`self.wqk = torch.cat(...)`
    inside it): the module would hold a new tensor, not the buffer graphs captured. The
    buffer (refreshed already) is put back where the module holds it, then the refresh
    fails, naming the derivation."""
    buffers = b.buffers
    assert buffers is not None
    moved = [name for name, buf in zip(b.outputs, buffers) if b.container.get(name) is not buf]
    if not moved:
        return
    for name, buf in zip(b.outputs, buffers):
        b.container[name] = buf
    raise b.error(
        ImpureDerivationError,
        f"derivation {b.spec.name} assigned its own output {moved[0]!r} instead of returning "
        "it: the module would hold a new tensor, not the buffer captured graphs read",
        expected=f"{b.spec.name} returns its result (or writes into `out=`); graphsafe "
        "writes it into the buffer",
        got=f"`{moved[0]}` rebound to a new tensor inside the derivation (`self.{moved[0]} "
        "= ...`); the buffer was put back, with the result written into it",
        fix=f"drop the assignment in {b.spec.name} and return the result",
    )
