"""Getting back to a working group after a failed sync: `recover`."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from graphsafe.distributed._control.channel import _forget_syncs, _synced_groups
from graphsafe.distributed._reports import WeightSyncError
from graphsafe.distributed._staging import _forget_group, _group_key

__all__ = ["recover"]


def recover(
    error: WeightSyncError,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
) -> dist.ProcessGroup | None:
    """The group for the next sync after `error`, made as `error.recovery` says.

    Call it on every rank that caught the failed sync's error, collectively (a rank that
    was restarted joins the new world with `dist.init_process_group` and
    `dist.new_group`, as at the start of the job):

    - `"resend"`: the group is in step; it is returned as it is.
    - `"group"`: a collective failed, every process lives: a new group of the same ranks
      (`dist.new_group`, called by every rank of the world); the failed one is dropped.
    - `"world"`: a rank died (rank 0 serves the store: with it the whole world is gone).
      The default group is destroyed and a new world is made with `init_method`,
      `rank` and `world_size` (the restarted rank serves its store when it is rank 0),
      and a group of all its ranks is returned.

    Args:
        error: What the failed `send_weights` or `receive_weights` raised.
        group: The group the failed sync ran on; None for the default group.
        timeout: The new group's (and world's) timeout: it bounds each transfer.
        init_method: The new world's rendezvous (`"tcp://host:port"`); needed for
            `"world"`.
        rank: This process's rank in the new world (default: its rank now).
        world_size: The new world's size (default: the size now).
        backend: The new world's backend (default: the backend now).

    Returns:
        The group to pass to the next sync (None: the default group, when `group` was).

    Raises:
        ValueError: `"world"` recovery without `init_method`.

    Examples:
        >>> # except gsd.WeightSyncError as err:
        >>> #     group = gsd.recover(err, group=group, timeout=timedelta(seconds=60),
        >>> #                         init_method=new_address, rank=rank, world_size=3)
    """
    if error.recovery == "resend":
        return group
    key = _group_key(group)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    _forget(key)
    if error.recovery == "group":
        if group is not None and group is not dist.group.WORLD:
            dist.destroy_process_group(group)
        made: dist.ProcessGroup = dist.new_group(ranks, timeout=timeout)
        return made
    if init_method is None:
        raise ValueError(
            "recover: the failed sync needs a new world (a rank died), and init_method "
            "names none; pass the new world's rendezvous, e.g. 'tcp://host:port'"
        )
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    backend = str(dist.get_backend()) if backend is None else backend
    for g in _synced_groups():
        _forget(g)
    dist.destroy_process_group()
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout)
    return None if group is None else dist.new_group(timeout=timeout)


def _forget(key: object) -> None:
    """Drop what this process keeps for a group that failed: its sync count and
    staging buffers."""
    _forget_syncs(key)
    _forget_group(key)
