"""The report of `graphsafe verify`, its rows, and how a row and the run are judged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["TOLERANCE", "ControlRow", "RefitRow", "SyncRow", "VerifyReport", "passed",
           "verdict"]

TOLERANCE = 1e-5
"""Largest |replay - eager| counted as exact."""

Verdict = Literal["exact", "stale", "no-effect", "error"]


class RefitRow(BaseModel):
    """One refit of the managed model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    refit: int
    """1-based refit number."""
    buckets: int
    """How many `load_weights` calls the checkpoint was split into."""
    critical_last: bool
    """Whether the critical tensors (e.g. `hc_attn_fn`) came in the last bucket."""
    refreshed: tuple[str, ...]
    """Derived buffers refreshed in place by this refit."""
    storage_held: bool
    """Whether every tensor the graph reads kept its storage."""
    max_abs_diff: float
    """max |replay - eager| on the new weights, eager being the oracle's output (see
    `VerifyReport.oracle`)."""
    weights_effect: float
    """max |eager(new) - eager(old)|: how much the refit changed the oracle's output."""
    verdict: Verdict
    """`exact`: replay equals eager and nothing is stale; `stale`: the replay differs
    from eager, or `stale` names tensors; `no-effect`: the refit did not change the
    output, so the row proves nothing; `error`: the refit raised."""
    error: str | None = None
    """What went wrong, in one line: the error the refit or the replay raised, or what
    found tensors stale (the fresh model's comparison, the audit)."""
    stale: tuple[str, ...] = ()
    """Tensors the refit left stale, by path: each parameter or declared derived buffer
    that differs from the fresh model's of the same name, and each derived tensor the
    content audit found differing from its recomputation."""
    audited: int | None = None
    """Derived tensors the content audit (`graphsafe.audit`) recomputed and found equal;
    None when no audit ran or it found a mismatch."""
    unaudited: int = 0
    """Derived tensors the audit could not recompute (a transient input released between
    updates, an opaque handle), which only the fresh model vouches for."""


class ControlRow(BaseModel):
    """The naive variant (a fresh tensor bound on every load) under the same refit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unguarded_max_abs_diff: float
    """max |replay - eager| of an unguarded graph after the refit (must be > tolerance)."""
    stale_read: bool
    """Whether the unguarded replay read stale memory (the bug reproduced)."""
    guard_error: str | None
    """What the guarded replay raised (class and first line), or None if it replayed."""
    caught: bool
    """Whether the guard refused to replay stale memory."""


class SyncRow(BaseModel):
    """One pipeline stage's side of one weight sync (`graphsafe verify --pp N`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    refit: int
    """1-based refit number."""
    stage: int
    """Pipeline rank (`pp_rank`) of the stage; its process is rank `stage + 1`."""
    layers: str
    """The global layer indices the stage holds, `start-stop` inclusive."""
    accepted: int
    """Checkpoint entries its loader took (the others belong to other stages)."""
    bytes: int
    """Bytes of the whole sync it received."""
    buckets: int
    """Buckets of the sync."""
    seconds: float
    """Wall time of `receive_weights` on the stage, refresh included."""
    refresh_seconds: float
    """Of which the one refresh of the derived buffers at the end."""
    refreshed: tuple[str, ...]
    """Derived buffers refreshed in place."""
    storage_held: bool
    """Whether every tensor of the stage kept its storage."""
    error: str | None = None
    """What the stage raised, if it raised, or what its content audit found."""
    stale: tuple[str, ...] = ()
    """Derived tensors the stage's content audit found stale."""
    audited: int | None = None
    """Derived tensors the stage's content audit checked and found equal; None when no
    audit ran or it found a mismatch."""
    unaudited: int = 0
    """Derived tensors the stage's audit could not recompute."""
    audit_seconds: float = 0.0
    """Wall time of the stage's content audit."""


class VerifyReport(BaseModel):
    """The whole verify run; `ok` is the exit status."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str
    """The model family."""
    preset: str
    """Its size preset."""
    backend: str
    """Graph backend: `cuda` (real CUDA graphs) or `cpu` (the CPU graph)."""
    device: str
    """Device the model ran on."""
    torch_version: str
    """PyTorch version."""
    tolerance: float
    """Largest |replay - eager| counted as exact."""
    refits: tuple[RefitRow, ...]
    """One row per refit of the managed model."""
    control: ControlRow
    """The naive variant's row."""
    ok: bool
    """Every managed refit exact and the control detected."""
    pp: int | None = None
    """Pipeline stages of the distributed mode (`--pp N`: a trainer process and N stage
    processes over gloo); None for the single-process run."""
    syncs: tuple[SyncRow, ...] = ()
    """In the distributed mode, one row per refit and stage."""
    guard: str = ""
    """Which path the guard's checks took in this process: `native (...)` (compiled,
    `graphsafe native build`) or `python (...)`, with the reason."""
    oracle: Literal["fresh", "self"] = "fresh"
    """What each replay is compared with: `fresh`, the eager output of a model built anew
    from the checkpoint after every refit (its parameters and derived buffers compared
    too); `self`, the eager output of the model under test, which reads the same derived
    state as its replay (blind to writes graphsafe does not see)."""
    audit: bool = True
    """Whether the content audit (`graphsafe.audit`) ran after every refit."""
    oracle_seconds: float = 0.0
    """Wall time spent on the oracle over all refits: building, loading and running the
    fresh models and comparing their tensors (`fresh`), or the eager forwards (`self`)."""
    audit_seconds: float = 0.0
    """Wall time of the content audits over all refits."""


def verdict(diff: float, effect: float, stale: Sequence[str] = ()) -> Verdict:
    """A refit that raised nothing: `stale` beyond the tolerance or with tensors found
    stale, `no-effect` when the new weights did not change the output, else `exact`."""
    if diff > TOLERANCE or stale:
        return "stale"
    return "no-effect" if effect <= TOLERANCE else "exact"


def passed(rows: Sequence[RefitRow], control: ControlRow) -> bool:
    """The run's verdict: every refit exact with its storage held, the control detected."""
    ok = bool(rows) and all(r.verdict == "exact" and r.storage_held for r in rows)
    return ok and control.stale_read and control.caught
