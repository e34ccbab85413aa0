"""What both sides of a sync share: the collectives' device, the check of each rank's
role, the end-of-sync handshake, and the one-line form of an exception that errors and
abort records quote.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def _handshake(
    ok: bool, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[int, ...]:
    """Every rank says whether it applied the sync; returns the ranks that did not."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    mine = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(every, mine, group=group)
    return tuple(r for r, flag in zip(ranks, torch.cat(every).tolist()) if flag)

