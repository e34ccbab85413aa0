"""The report of a receive, composed from what its stages returned."""

from __future__ import annotations

import time

from graphsafe._declare.spec import RefreshReport
from graphsafe.distributed._receive.metadata import _Agreed
from graphsafe.distributed._receive.transfer import _Transfer
from graphsafe.distributed._reports import ReceiveReport


def _receive_report(
    rank: int,
    src: int,
    agreed: _Agreed,
    transfer: _Transfer,
    waited: float,
    *,
    end: float = 0.0,
    loaded: float = 0.0,
    refresh: RefreshReport | None = None,
) -> ReceiveReport:
    """The report of the sync: `end` is when it ended (0.0 for the report a rejection
    error carries), `loaded` when the loader's last call returned, `refresh` the report
    of the refresh it ran."""
    plan = agreed.plan
    seconds = (end if end else time.perf_counter()) - agreed.started
    total = sum(e.nbytes for e in plan.entries)
    return ReceiveReport(
        rank=rank, src=src, sync=plan.sync, entries=len(plan.entries), bytes=total,
        buckets=len(plan.sizes), direct_buckets=sum(plan.direct), seconds=seconds,
        refresh_seconds=max(0.0, end - loaded) if end else 0.0,
        throughput=total / seconds if seconds > 0 else 0.0,
        staging_bytes=transfer.staging_bytes, staging_reused=transfer.reused,
        overlap=transfer.overlap, accepted=transfer.accepted, rejected=transfer.rejected,
        refresh=refresh, failed_ranks=(), expected=agreed.expected, partial=plan.partial,
        verified=plan.verify, fingerprinted=transfer.fingerprinted,
        fingerprint_seconds=transfer.fingerprint_seconds, waited_seconds=waited,
    )
