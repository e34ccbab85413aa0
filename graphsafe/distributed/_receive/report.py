"""What a receive records as it goes, and the report built from that record."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from graphsafe._declare.spec import RefreshReport
from graphsafe.distributed._protocol.layout import _Plan
from graphsafe.distributed._reports import ReceiveReport, RejectedEntry


@dataclass
class _ReceiveProgress:
    """What one `receive_weights` call has done so far: each stage (the metadata check,
    the transfer, the handshake) fills in its own fields, and the report is built from
    them."""

    plan: _Plan | None = None
    started: float = 0.0
    completed: bool = False
    """Every bucket arrived and the sender reached the handshake."""
    loaded: float = 0.0
    staging_bytes: int = 0
    reused: bool = False
    overlap: bool = False
    accepted: list[str] | None = None
    rejected: list[RejectedEntry] | None = None
    expected: int = 0
    waited: float = 0.0
    sums: list[int] = field(default_factory=list)
    """Per bucket arrived: its checksum (when the sync is verified)."""
    mismatched: list[int] = field(default_factory=list)
    """Buckets whose checksum differs from the sender's."""
    told: bool = False
    """The error being raised is known to every rank (they raise in step): no abort is
    posted for it."""


def _receive_report(
    state: _ReceiveProgress,
    rank: int,
    src: int,
    last: RefreshReport | None,
    before: RefreshReport | None,
    end: float,
    failed: tuple[int, ...],
) -> ReceiveReport:
    """The report of the sync; `end` is 0.0 for the report a rejection error carries."""
    plan = state.plan
    assert plan is not None
    seconds = (end if end else time.perf_counter()) - state.started
    total = sum(e.nbytes for e in plan.entries)
    return ReceiveReport(
        rank=rank, src=src, sync=plan.sync, entries=len(plan.entries), bytes=total,
        buckets=len(plan.sizes), direct_buckets=sum(plan.direct), seconds=seconds,
        refresh_seconds=max(0.0, end - state.loaded) if end else 0.0,
        throughput=total / seconds if seconds > 0 else 0.0,
        staging_bytes=state.staging_bytes, staging_reused=state.reused, overlap=state.overlap,
        accepted=tuple(state.accepted or ()), rejected=tuple(state.rejected or ()),
        refresh=last if last is not before else None, failed_ranks=failed,
        expected=state.expected, partial=plan.partial, verified=plan.verify,
        waited_seconds=state.waited,
    )
