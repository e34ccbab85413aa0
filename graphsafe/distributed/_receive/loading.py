"""The receiver's loader calls: the entries of arrived buckets, as views of staging, go to
`model.load_weights(pairs)`; each entry it refuses is returned and the others still load."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from graphsafe._errors import WeightLoadError, one_line
from graphsafe.distributed._protocol.layout import _Entry, _view
from graphsafe.distributed._reports import RejectedEntry


def _load_run(
    model: nn.Module,
    loader: Any,
    run: list[tuple[int, torch.Tensor]],
    by_bucket: list[list[_Entry]],
) -> tuple[list[str], list[RejectedEntry]]:
    """Give the entries of a run of arrived buckets to the model's loader, in one call.

    Returns:
        The names the loader reported loading, and the entries it refused.
    """
    pairs = [(e.name, _view(s, e)) for b, s in run for e in by_bucket[b]]
    where = {e.name: b for b, _ in run for e in by_bucket[b]}
    if not pairs:
        return [], []  # the trailer closing a run of direct buckets
    if loader is None or not callable(loader):
        return [], [
            RejectedEntry(name=n, bucket=where[n], error=f"{type(model).__name__} "
                          "has no load_weights(pairs) method") for n, _ in pairs
        ]
    return _load(loader, pairs, where)


def _load(
    loader: Any, pairs: list[tuple[str, torch.Tensor]], bucket: dict[str, int]
) -> tuple[list[str], list[RejectedEntry]]:
    """Load buckets' entries (`bucket`: each entry's bucket); a refused entry is recorded
    and the others are loaded anyway. Returns what `_load_run` does."""
    accepted: list[str] = []
    rejected: list[RejectedEntry] = []
    queue = [pairs]
    while queue:
        chunk = queue.pop()
        try:
            result = loader(chunk)
            if isinstance(result, types.GeneratorType):
                result = list(result)
        except WeightLoadError as exc:
            names = [n for n, _ in chunk]
            if exc.name not in names:
                rejected.extend(RejectedEntry(name=n, bucket=bucket[n], error=one_line(exc))
                                for n in names)
                continue
            i = names.index(exc.name)
            rejected.append(RejectedEntry(name=exc.name, bucket=bucket[exc.name],
                                          error=one_line(exc)))
            # The entries before it may or may not have been written: load them again.
            queue.extend(part for part in (chunk[i + 1 :], chunk[:i]) if part)
            continue
        except Exception as exc:
            rejected.extend(RejectedEntry(name=n, bucket=bucket[n], error=one_line(exc))
                            for n, _ in chunk)
            continue
        if isinstance(result, (set, frozenset, list, tuple)) and all(
            isinstance(n, str) for n in result
        ):
            accepted.extend(sorted(result) if isinstance(result, (set, frozenset)) else result)
        else:
            accepted.extend(n for n, _ in chunk)
    return accepted, rejected
