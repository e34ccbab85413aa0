"""What a verify refit is held to: a model built fresh from the checkpoint, and the audit.

The model under test cannot be its own oracle: its eager forward reads the same derived
state as its replay, so a write graphsafe does not see (a NumPy view, a raw pointer)
leaves both equally stale, and the refit looks exact. After each refit, verify builds
the target's model anew, loads into it, in one call, the checkpoint the refit wrote, and
recomputes every declared derivation from scratch: its eager output is what the replay
must equal. Every parameter and declared derived buffer of the model under test is
compared with the fresh model's of the same name, so that a mismatch is named; and the
content audit (`graphsafe.audit`) recomputes every derived tensor of the model under
test from its own current inputs, declared or discovered.
"""

from __future__ import annotations

import time
from typing import Literal, NamedTuple

import torch
from torch import nn

from graphsafe._audit.audit import audit
from graphsafe._errors import GraphSafetyError, StaleError
from graphsafe._runtime.runtime import runtime
from graphsafe._verify.report.format import quote
from graphsafe._verify.report.rows import TOLERANCE
from graphsafe._verify.target import Checkpoint, VerifyTarget

__all__ = ["Audited", "Oracle", "audit_model", "differing", "fresh_model"]

Oracle = Literal["fresh", "self"]

_UNSEEN = "a NumPy view, a raw pointer, CUDA IPC"


class Audited(NamedTuple):
    """The content audit of one model after a refit."""

    checked: int | None
    """Derived tensors recomputed and found equal; None when the audit found a mismatch
    or failed."""
    stale: tuple[str, ...]
    """Paths the audit found differing from their recomputation."""
    problem: str | None
    """The audit's error, quoted in one line."""
    unchecked: int
    """Derived tensors the audit could not recompute (a transient input released
    between updates, an opaque handle): the audit does not vouch for them."""
    seconds: float


def fresh_model(
    target: VerifyTarget, preset: str, device: torch.device, ck: Checkpoint
) -> nn.Module:
    """The target's model built anew, `ck` loaded in one call, every declared derivation
    recomputed from what was loaded (whatever the loader's writes graphsafe saw).

    Args:
        target: The model family.
        preset: Its size preset.
        device: Where to build it.
        ck: The checkpoint the refit wrote.

    Returns:
        The fresh model, ready to run.
    """
    model = target.build(preset, False, device)
    model.load_weights(ck)  # type: ignore[operator]
    runtime(model).refresh()
    return model


def differing(model: nn.Module, fresh: nn.Module, target: str) -> StaleError | None:
    """Compare every parameter and declared derived buffer of `model` with `fresh`'s.

    Args:
        model: The model under test.
        fresh: `fresh_model`'s model, loaded with the same checkpoint.
        target: The target's name, for the message.

    Returns:
        None when each is within the run's tolerance of the fresh one; else a
        `StaleError` naming each that is not (`.paths`), its module class and difference.
    """
    derived = {p for d in runtime(model).derivations for p in d.outputs}
    theirs = {**dict(fresh.named_parameters()), **dict(fresh.named_buffers())}
    ours = [*model.named_parameters(),
            *((p, b) for p, b in model.named_buffers() if p in derived)]
    found = [(path, got) for path, t in ours if path in theirs
             and (got := _difference(t, theirs[path])) is not None]
    if not found:
        return None
    paths = [p for p, _ in found]
    first = paths[0]
    owner = model.get_submodule(first.rpartition(".")[0])
    listed = ", ".join(f"{p} ({type(model.get_submodule(p.rpartition('.')[0])).__name__}, "
                       f"{got})" for p, got in found[:8])
    return StaleError(
        f"{len(paths)} tensor(s) differ from a fresh {target} model built from the same "
        f"checkpoint: {listed}" + (" ..." if len(found) > 8 else ""),
        paths=paths,
        module_class=type(owner).__name__,
        path=first,
        expected=f"every parameter and declared derived buffer within {TOLERANCE:g} of the "
        "fresh model's",
        got="; ".join(f"{p}: {got}" for p, got in found),
        fix=f"the loader wrote where graphsafe does not see it ({_UNSEEN}): write with "
        "gs.load_into(param, w, name=...), or call gs.mark_written(tensor) after such a "
        "write, so that the derived buffers reading it are refreshed",
    )


def audit_model(model: nn.Module) -> Audited:
    """Run `graphsafe.audit(model)`, bitwise, and keep its outcome for a row.

    Args:
        model: The model under test, after a refit.

    Returns:
        How many derived tensors it checked and could not check, or the stale paths and
        its error.
    """
    t0 = time.perf_counter()
    try:
        report = audit(model)
    except StaleError as exc:
        return Audited(None, exc.paths, quote(exc), 0, time.perf_counter() - t0)
    except GraphSafetyError as exc:
        return Audited(None, (), quote(exc), 0, time.perf_counter() - t0)
    return Audited(len(report.checked), (), None, len(report.unchecked),
                   time.perf_counter() - t0)


def _difference(ours: torch.Tensor, theirs: torch.Tensor) -> str | None:
    """None when `ours` is within the tolerance of `theirs`; else how it differs. A
    tensor on the meta device on either side (a transient input released between
    updates) holds no values to compare."""
    if ours.is_meta or theirs.is_meta:
        return None
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return (f"shape {tuple(ours.shape)} {ours.dtype}, the fresh one "
                f"{tuple(theirs.shape)} {theirs.dtype}")
    if torch.equal(ours, theirs):
        return None
    a, b = ours.detach().to(torch.float64), theirs.detach().to(ours.device, torch.float64)
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    if diff <= TOLERANCE:
        return None
    return f"max|held-fresh| {diff:.3e}"
