"""What a weight sync reports, and the error it raises.

`SendReport` and `ReceiveReport` are what `send_weights` and `receive_weights` return (a
failed call carries its report on `WeightSyncError.report`); `RejectedEntry` names one
entry a receiver's loader refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from graphsafe._declare.spec import RefreshReport
from graphsafe._errors import GraphSafetyError

__all__ = ["ReceiveReport", "RejectedEntry", "SendReport", "WeightSyncError"]


class RejectedEntry(BaseModel):
    """A checkpoint entry the receiver's loader refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """The entry's checkpoint name."""
    bucket: int
    """The bucket it arrived in (0-based)."""
    error: str
    """What the loader raised: class and message."""


class SendReport(BaseModel):
    """What one `send_weights` call did, on the sending rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    """The sending rank (global)."""
    sync: int
    """The id drawn for this sync; every receiver's report carries the same one."""
    receivers: int
    """How many other ranks of the group took part."""
    entries: int
    """Checkpoint entries sent."""
    bytes: int
    """Tensor bytes sent (without alignment padding and trailers)."""
    buckets: int
    """Broadcasts of data: one per bucket."""
    direct_buckets: int = 0
    """Of those, entries broadcast from the caller's tensor as it was, with no copy."""
    bucket_bytes: int
    """The bucket limit asked for; a tensor larger than it travelled alone."""
    largest_bucket: int
    """Data bytes of the largest bucket."""
    staging_bytes: int
    """Size of the sender's staging buffer: two bucket slots (trailers included) when
    `overlap` was on and the sync had several buckets, else one bucket."""
    overlap: bool
    """Whether packing overlapped the broadcasts (two staging slots in use)."""
    partial: bool = False
    """Whether the sync was sent as partial (receivers did not require every entry)."""
    verified: bool = False
    """Whether the sync was checked end to end: this rank took each entry's fingerprint
    (`gs.fingerprint`) from the tensor it was given, before packing it, and every
    receiver compared it with the fingerprint of the bytes it received."""
    fingerprinted: int = 0
    """Entries fingerprinted (every entry of a verified sync; 0 otherwise)."""
    fingerprint_seconds: float = 0.0
    """Time this rank spent taking fingerprints, overlapped with the broadcasts (for
    packed entries the packing's time too: on a CPU one pass reads, digests and packs)."""
    seconds: float
    """Wall time of the call, handshake included."""
    throughput: float
    """`bytes / seconds`, in bytes per second."""


class ReceiveReport(BaseModel):
    """What one `receive_weights` call did, on one receiving rank."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    rank: int
    """This rank (global)."""
    src: int
    """The sending rank."""
    sync: int
    """The id the sender drew for this sync."""
    entries: int
    """Checkpoint entries in the sync (all of them, held here or not)."""
    bytes: int
    """Tensor bytes received."""
    buckets: int
    """Buckets received."""
    direct_buckets: int = 0
    """Of those, entries the sender broadcast from its own tensor, with no copy."""
    seconds: float
    """Wall time from the metadata's arrival to the end of the refresh (time spent
    waiting for the sender to start is not counted)."""
    refresh_seconds: float
    """Wall time of the end of the `weight_update` block: the one refresh of the derived
    buffers, and the journal's bookkeeping."""
    throughput: float
    """`bytes / seconds`, in bytes per second."""
    staging_bytes: int
    """Size of the staging buffer: with `overlap`, what holds two of the largest buckets
    or one of the sender's buckets (`bucket_bytes`), whichever is more; else the largest
    bucket."""
    overlap: bool
    """Whether receiving overlapped loading (the next buckets posted while the loader
    ran)."""
    staging_reused: bool
    """Whether the staging buffer of an earlier sync was reused (no allocation)."""
    accepted: tuple[str, ...]
    """Names the loader reported loading (its own naming: what `load_weights` returned;
    the entries given, for a loader that returns None)."""
    rejected: tuple[RejectedEntry, ...]
    """Entries the loader refused; when not empty the call raised `WeightSyncError`."""
    refresh: RefreshReport | None
    """`gs.runtime(model).last_report` of the refresh this sync ran; None when the sync
    did not complete or ran no refresh."""
    failed_ranks: tuple[int, ...]
    """Receivers that did not apply this sync (from the handshake); empty on success
    (a sync that another receiver did not apply fails on every receiver)."""
    expected: int = 0
    """Checkpoint entries this rank expects (its model's, or `expects=`), every one of
    which the sync carried unless it was partial."""
    partial: bool = False
    """Whether the sender sent the sync as partial."""
    verified: bool = False
    """Whether the sync was checked end to end: this rank took the fingerprint of the
    bytes it received for each entry, before its loader ran, and compared it with the
    sender's, taken from the tensor the sender was given."""
    fingerprinted: int = 0
    """Entries whose fingerprint this rank compared (every entry of a verified sync,
    those its loader skips too; 0 otherwise)."""
    fingerprint_seconds: float = 0.0
    """Time this rank spent taking fingerprints, overlapped with the next buckets'
    broadcasts (on a GPU: the time to queue them, and to read them back at the end)."""
    waited_seconds: float = 0.0
    """Wall time spent waiting for the sender to begin the sync (not in `seconds`)."""


_RECOVERY = {
    "resend": "The group is in step: the next sync may run on it",
    "group": "Recreate the group before the next sync, collectively on every rank: "
    "group = gsd.recover(error, group=group, timeout=...)",
    "world": "A rank died: restart it and make a new world, collectively on every rank: "
    "group = gsd.recover(error, group=group, timeout=..., init_method=<the new world's "
    "address>, rank=..., world_size=...)",
}


class WeightSyncError(GraphSafetyError):
    """A weight sync did not complete: the sender failed or died, a collective failed,
    the receiver's loader refused entries, or entries arrived other than the sender was
    given them.

    On a receiver the model is left failed closed (guarded replays raise `StaleError`)
    until a later sync completes.

    Args:
        summary: One line saying what went wrong.
        bucket: The bucket (0-based) being sent or received, if any.
        entry: The checkpoint entry involved, if one is known.
        rejected: Entries the loader refused.
        mismatched: Entries whose fingerprint on some receiver differs from the
            sender's: their bytes changed on the way.
        failed_ranks: Ranks that did not apply the sync.
        report: The report of the call, where the sync reached its end.
        recovery: What the next sync needs: `"resend"` (the group is in step: sync
            again), `"group"` (a collective failed: recreate the group) or `"world"`
            (a rank died: a new world). `gsd.recover(error, ...)` does it.
        **kwargs: As for `gs.GraphSafetyError`.
    """

    def __init__(
        self,
        summary: str,
        *,
        bucket: int | None = None,
        entry: str | None = None,
        rejected: Sequence[RejectedEntry] = (),
        mismatched: Sequence[str] = (),
        failed_ranks: Sequence[int] = (),
        report: SendReport | ReceiveReport | None = None,
        recovery: str = "resend",
        **kwargs: Any,
    ) -> None:
        if recovery not in _RECOVERY:
            raise ValueError(f"recovery must be one of {sorted(_RECOVERY)}, got {recovery!r}")
        fix = kwargs.get("fix")
        kwargs["fix"] = f"{fix}. {_RECOVERY[recovery]}" if fix else _RECOVERY[recovery]
        self.recovery = recovery
        self.bucket = bucket
        self.entry = entry
        self.rejected = tuple(rejected)
        self.mismatched = tuple(mismatched)
        self.failed_ranks = tuple(failed_ranks)
        self.report = report
        super().__init__(summary, **kwargs)
