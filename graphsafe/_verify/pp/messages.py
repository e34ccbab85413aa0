"""What the pipeline's processes send each other besides weights: streams and rows.

A stage hands its output streams to the next stage (the last one to the trainer) as a
header of `_HEADER` int64 (status, dtype code, ndim, dims...) and then the tensor; a
status of 1 says that the stage, or one before it, failed. After each sync every stage
sends the trainer its row with `gather_object`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_rows", "recv_stream", "send_stream"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HEADER = 12  # status, dtype code, ndim, dims...


def send_stream(t: torch.Tensor | None, dst: int) -> None:
    """Hand a stage's output on; None says that this stage (or one before it) failed."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    if t is None:
        header[0] = 1
        dist.send(header, dst)
        return
    header[1] = _DTYPES.index(t.dtype)
    header[2] = t.dim()
    header[3 : 3 + t.dim()] = torch.tensor(t.shape)
    dist.send(header, dst)
    dist.send(t.detach().cpu().contiguous(), dst)


def recv_stream(src: int) -> torch.Tensor | None:
    """What `send_stream` sent from `src`: the tensor, or None where a stage failed."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.recv(header, src)
    status, code, ndim, *dims = header.tolist()
    if status:
        return None
    t = torch.empty(dims[:ndim], dtype=_DTYPES[code])
    dist.recv(t, src)
    return t


def gather_rows(row: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every stage's row at the trainer (rank 0); the stages get an empty list."""
    rows: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows, dst=0)
    return [r for r in rows or () if r is not None]
