"""What both sides of a sync share: the collectives' device, the check of each rank's
role, the receivers' verdict on the metadata, and the end-of-sync handshake (which
carries the fingerprints of a verified sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from graphsafe._fingerprint.digest import Digest
from graphsafe.distributed._control.channel import _Channel
from graphsafe.distributed._protocol.layout import (
    _FINGERPRINT_WORDS,
    _fingerprints_read,
    _fingerprints_wire,
    _Plan,
)
from graphsafe.distributed._reports import WeightSyncError


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where collectives of `group` want their tensors: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check(src: int, group: dist.ProcessGroup | None, *, sending: bool) -> int:
    """This rank, after checking that it takes the role it was called for."""
    what = "send_weights" if sending else "receive_weights"
    if not dist.is_available() or not dist.is_initialized():
        raise WeightSyncError(
            f"{what} needs an initialized process group",
            expected="torch.distributed.init_process_group(...) called on every rank",
            got="no default process group",
            fix="call dist.init_process_group(backend, rank=..., world_size=...) first",
        )
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if rank not in ranks or src not in ranks:
        raise WeightSyncError(
            f"{what}: rank {rank} and source {src} must both belong to the group",
            expected=f"ranks among {ranks}",
            got=f"rank {rank}, src {src}",
            fix="pass the group that holds the trainer and the receivers, and src as a "
            "global rank",
        )
    if sending != (rank == src):
        raise WeightSyncError(
            f"{what} called on rank {rank} with src={src}",
            expected="send_weights on the rank src, receive_weights on every other rank",
            got=f"{what} on rank {rank}",
            fix="call send_weights on the trainer and receive_weights on the others",
        )
    return rank


_APPLIED, _FAILED = 0, 1
"""What a rank says at the handshake: its transfer went through (every entry loaded);
it did not. Whether the entries arrived as they were sent is read from the fingerprints
every rank says with it."""


class _Outcome(NamedTuple):
    """The handshake's answer: who did not apply the sync, and which entries arrived
    other than they were sent (their names, in the plan's order, wherever they did)."""

    failed: tuple[int, ...]
    mismatched: tuple[str, ...]
    sent: tuple[Digest, ...] = ()
    """The sender's fingerprints of the tensors it was given (a verified sync)."""
    mine: tuple[int, ...] = ()
    """The entries (plan indices) that arrived changed on this rank."""


def _handshake(
    status: int, group: dist.ProcessGroup | None, device: torch.device, channel: _Channel,
    *, src: int, plan: _Plan, fingerprints: Sequence[Digest] | None = None,
) -> _Outcome:
    """Every rank says whether its transfer went through (`status`) and, in a verified
    sync, the fingerprints it took of `plan`'s entries, in its order: the sender of the
    tensors it was given, each receiver of the bytes it received. One
    collective: every rank reads from the same table which receivers got an entry other
    than it was sent, and counts them failed."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    words = torch.tensor([status], dtype=torch.int64)
    if fingerprints is not None:
        words = torch.cat([words, _fingerprints_wire(fingerprints, words.device).view(-1)])
    mine = words.to(device)
    every = [torch.empty_like(mine) for _ in ranks]
    channel.wait(dist.all_gather(every, mine, group=group, async_op=True), "at the handshake")
    table = torch.stack(every).cpu()
    said = dict(zip(ranks, table[:, 0].tolist()))
    changed: dict[int, list[int]] = {}
    sent: tuple[Digest, ...] = ()
    names = [e.name for e in plan.entries]
    if fingerprints is not None and names:
        rows = table[:, 1:].view(len(ranks), len(names), _FINGERPRINT_WORDS)
        theirs = rows[ranks.index(src)]
        sent = tuple(_fingerprints_read(theirs))
        differ = (rows != theirs).any(dim=2)  # [ranks, entries]
        for r, row in zip(ranks, differ.tolist()):
            if r != src and any(row):
                changed[r] = [i for i, d in enumerate(row) if d]
    mismatched = sorted({i for found in changed.values() for i in found})
    return _Outcome(
        tuple(r for r, s in said.items() if s != _APPLIED or r in changed),
        tuple(names[i] for i in mismatched), sent, tuple(changed.get(channel.rank, ())))


_SHOWN = 8  # names an error lists before it counts the rest


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _verdicts(
    mine: tuple[list[bool], list[str]] | None,
    plan: _Plan,
    group: dist.ProcessGroup | None,
    device: torch.device,
    channel: _Channel,
) -> WeightSyncError | None:
    """Every rank's verdict on the metadata, before any data moves; the error every rank
    raises when some receiver refuses it (names it expects and the sync lacks) or when
    no receiver expects some entry; None when the sync may go on.

    Args:
        mine: This receiver's verdict: per entry of the plan whether it expects it, and
            the names it expects that the sync lacks (empty for a partial sync); None on
            the sender.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    n = len(plan.entries)
    flags = torch.zeros(n + 1, dtype=torch.uint8)
    if mine is not None:
        claims, missing = mine
        if missing:
            channel.put(f"refused/{channel.rank}", "\n".join(missing))
            flags[0] = 1
        flags[1:] = torch.tensor(claims, dtype=torch.bool).to(torch.uint8)
    flags = flags.to(device)
    every = [torch.empty_like(flags) for _ in ranks]
    channel.wait(dist.all_gather(every, flags, group=group, async_op=True),
                 "exchanging the verdicts on the metadata")
    table = torch.stack(every).cpu()
    claimed = table[:, 1:].amax(dim=0).tolist() if n else []
    extra = [e.name for e, c in zip(plan.entries, claimed) if not c]
    refusing = [r for r, row in zip(ranks, table[:, 0].tolist()) if row]
    if not extra and not refusing:
        return None
    lines = []
    for r in refusing:
        text = channel.get(f"refused/{r}")
        names = text.split("\n") if text else []
        lines.append(f"rank {r} expects {len(names)} entr{'y' if len(names) == 1 else 'ies'} "
                     f"the sync lacks: {_names(names)}")
    if extra:
        lines.append(f"no receiver expects {len(extra)} entr{'y' if len(extra) == 1 else 'ies'}"
                     f" of the sync: {_names(extra)}")
    who = "send_weights" if mine is None else f"rank {channel.rank}"
    return WeightSyncError(
        f"{who}: the sync was refused before any data moved: "
        f"{'missing' if refusing else ''}{' and ' if refusing and extra else ''}"
        f"{'unexpected' if extra else ''} entries",
        entry=extra[0] if extra else None,
        expected="every entry a receiver expects, each expected by some receiver "
        + ("(the sync is partial: only the second)" if plan.partial else
           "(or send_weights(..., partial=True) for a sync of some entries)"),
        got="\n    " + "\n    ".join(lines),
        fix="send every entry under its checkpoint name (a renamed, dropped or shifted "
        "entry is named above); a receiver with a loader that maps names declares what it "
        "loads (receive_weights(..., expects=...) or model.checkpoint_names()). Nothing "
        "was written: every receiver keeps its previous weights",
    )
