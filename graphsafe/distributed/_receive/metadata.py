"""Before any data moves: the checkpoint names this rank expects, the sync's plan from
the sender's metadata, and every rank's verdict on the one against the other."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from graphsafe._errors import one_line
from graphsafe._runtime.runtime import runtime
from graphsafe.distributed._control.channel import _Channel, _recovery_of, _ToldError
from graphsafe.distributed._protocol.exchange import _verdicts
from graphsafe.distributed._protocol.layout import _PROTOCOL, _Plan
from graphsafe.distributed._reports import WeightSyncError


def _expected(model: nn.Module, expects: Collection[str] | None) -> frozenset[str]:
    """The checkpoint names `model` expects (see `receive_weights`)."""
    if expects is None:
        declared = getattr(model, "checkpoint_names", None)
        if callable(declared):
            expects = list(declared())
    if expects is not None:
        names = list(expects)
        if isinstance(expects, str) or not all(isinstance(n, str) for n in names):
            raise TypeError("expects must be a collection of checkpoint names (str), got "
                            f"{type(expects).__name__}")
        return frozenset(names)
    derived = {o for d in runtime(model).derivations for o in d.outputs}
    found = {n for n, _ in model.named_parameters()}
    for prefix, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, b in module._buffers.items():
            if b is not None and name not in skip:
                found.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(found - derived)


@dataclass(frozen=True)
class _Agreed:
    """What every rank agreed on before any data moved (`_agree` returns it)."""

    plan: _Plan
    """The sync's plan, from the sender's metadata."""
    started: float
    """When the metadata was read (`time.perf_counter()`): the report's clock starts."""
    expected: int
    """How many checkpoint names this rank expects."""


def _agree(
    model: nn.Module,
    expects: Collection[str] | None,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    channel: _Channel,
) -> _Agreed | WeightSyncError:
    """Before any data moves: the sync's plan, and every rank's verdict on it.

    Returns:
        What the ranks agreed on; or the error every rank raises in step (the sender's
        abort, or the refusal of the sync), which the caller raises without posting an
        abort.

    Raises:
        WeightSyncError: The sender speaks another protocol, the verdicts were not
            exchanged, or the store is gone.
        TypeError: `expects` is not a collection of names.
    """
    expected = _expected(model, expects)
    record = channel.meta()
    channel.count()
    started = time.perf_counter()
    if not isinstance(record, dict) or record.get("protocol") != _PROTOCOL:
        got = record.get("protocol") if isinstance(record, dict) else type(record).__name__
        raise WeightSyncError(
            "receive_weights: the sender speaks another sync protocol",
            expected=f"protocol {_PROTOCOL}",
            got=got,
            fix="run the same graphsafe version on the sender and the receivers",
            recovery="group",
        )
    if record["abort"] is not None:
        return WeightSyncError(
            f"receive_weights: the sender (rank {src}) aborted the sync before sending any "
            "weights",
            expected="the weights",
            got=f"the sender raised {record['abort']}",
            fix="fix the error on the sender, then sync again; nothing was written: the "
            "model keeps its previous weights",
        )
    plan = _Plan.from_record(record)
    refused = _verdict(plan, expected, group, device, channel)
    return refused if refused is not None else _Agreed(plan, started, len(expected))


def _verdict(
    plan: _Plan,
    expected: frozenset[str],
    group: dist.ProcessGroup | None,
    device: torch.device,
    channel: _Channel,
) -> WeightSyncError | None:
    """Check the plan against what this rank expects, with every other rank; return the
    refusal every rank raises, or None."""
    names = {e.name for e in plan.entries}
    claims = [e.name in expected for e in plan.entries]
    missing = [] if plan.partial else sorted(expected - names)
    try:
        return _verdicts((claims, missing), plan, group, device, channel)
    except _ToldError:
        raise
    except Exception as exc:
        raise WeightSyncError(
            f"rank {channel.rank}: the verdicts on the sync's metadata were not exchanged",
            expected="every rank of the group at the exchange, within the group's timeout",
            got=one_line(exc),
            fix="another rank died, timed out or called something else; see its log. "
            "Nothing was written",
            recovery=_recovery_of(exc),
        ) from exc
