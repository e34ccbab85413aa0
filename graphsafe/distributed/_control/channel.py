"""The side channel of a sync: the world's key-value store, next to the group's
collectives.

Collectives of a gloo group time out after the group's timeout and leave the group dead,
so nothing that may last longer than a transfer waits in one. Through the store:

- the sender posts each sync's metadata (`meta`), which the receivers wait for with a
  timeout of their own (a train step may take any time): waiting for a sync is not
  transferring one;
- a rank whose collective failed, or that saw a peer die, posts an abort record
  (`abort`), which every other rank polls for while it waits on a collective, so that
  every rank fails within a fraction of a second instead of at the timeout;
- the sender's error text after an in-band abort (`error`), and the names a refusing
  receiver refused (`refused/<rank>`).

Every key lives under `graphsafe.sync/<group name>/<n>/`, where `n` counts the syncs of
this group: each `send_weights` call posts one metadata record (a plan or an abort), and
each `receive_weights` call that read one counts it, so the ranks stay in step. The
sender drops a sync's keys once every receiver has read a later sync's metadata. The
store is served by rank 0 of the world: when it cannot be reached, rank 0 is gone and
only a new world heals (`recover`).
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from typing import Any, Final, Literal

import torch.distributed as dist

from graphsafe._errors import one_line
from graphsafe.distributed._reports import WeightSyncError

Recovery = Literal["resend", "group", "world"]

_POLL = 0.05  # seconds between looks at the store while a collective is waited for
_SLEEP_MIN, _SLEEP_MAX = 5e-5, 1e-3  # the collective's own polling: short, then longer

_TIDY_EVERY = 16
_TIDY: dict[object, int] = {}
"""Per group object: the first sync whose keys this process (the sender) kept."""
_SEQ: dict[object, int] = {}
"""Per group object: the syncs this process took part in (their metadata was read or
posted). Both tables belong to this module: `_Channel.count` and `_Channel.tidy` write
them, `_forget_syncs` drops a group's entries."""


class _ToldError(WeightSyncError):
    """A failure every rank learns through the store: raising it posts nothing."""


def _store() -> Any:
    """The default group's store (rank 0 serves it), or a `WeightSyncError`."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        if getter is None:
            raise RuntimeError("torch.distributed has no _get_default_store")
        return getter()
    except Exception as exc:
        raise WeightSyncError(
            "the sync cannot reach the default group's store",
            expected="a default process group initialized with a store (env://, tcp://, "
            "or a store= argument)",
            got=one_line(exc),
            fix="initialize the default group with dist.init_process_group(...) on every "
            "rank before the first sync",
        ) from exc


class _Channel:
    """The store keys of one sync of one group.

    Args:
        group: The sync's process group (None: the default group).
        rank: This rank (global).
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int) -> None:
        self.key: Final = group if group is not None else dist.group.WORLD
        self.rank: Final = rank
        self.store: Final = _store()
        name = getattr(self.key, "group_name", "") or "default"
        self.seq: Final = _SEQ.get(self.key, 0)
        self.base: Final = f"graphsafe.sync/{name}/"
        self.at: Final = f"{self.base}{self.seq}/"
        self._next_look = 0.0

    def count(self) -> None:
        """This sync's metadata was posted or read: the next call is the next sync."""
        _SEQ[self.key] = self.seq + 1

    # -- metadata -----------------------------------------------------------------

    def post_meta(self, record: dict[str, Any]) -> None:
        """Post this sync's metadata."""
        self.store.set(self.at + "meta", pickle.dumps(record))
        self.count()

    def tidy(self) -> None:
        """Drop the keys of the syncs before this one (call once every receiver read
        this sync's metadata: they are done with the earlier ones)."""
        start = _TIDY.get(self.key, 0)
        if self.seq - start < _TIDY_EVERY:
            return  # a few keys at a time: each deletion is a round trip to the store
        for seq in range(start, self.seq):
            for key in ("meta", "abort", "error"):
                try:
                    self.store.delete_key(f"{self.base}{seq}/{key}")
                except Exception:  # a store without delete_key keeps them
                    return
        _TIDY[self.key] = self.seq

    def posted(self, timeout: float | None) -> bool:
        """Whether the sender posted this sync's metadata, waiting up to `timeout`
        seconds (None: until it does); raises if the store is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        key = self.at + "meta"
        while True:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            try:
                if self.store.check([key]):
                    return True
                if left <= 0:
                    return False
                self.store.wait([key], datetime.timedelta(seconds=min(left, 1.0)))
                return True
            except Exception as exc:
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    continue
                raise self.gone(exc, "waiting for the metadata of the sync") from exc

    def meta(self) -> Any:
        """The posted metadata record (call once `posted`)."""
        try:
            return pickle.loads(self.store.get(self.at + "meta"))
        except Exception as exc:
            raise self.gone(exc, "reading the metadata of the sync") from exc

    # -- aborts -------------------------------------------------------------------

    def abort(self, recovery: Recovery, what: str) -> None:
        """Tell every rank this sync failed (best effort: the store may be gone); the
        first rank to tell it is the one named."""
        try:
            if self.store.check([self.at + "abort"]):
                return
            self.store.set(self.at + "abort", pickle.dumps((self.rank, recovery, what)))
        except Exception:
            return

    def aborted(self) -> tuple[int, Recovery, str] | None:
        """The abort record of this sync, if a rank posted one; raises if the store is
        gone."""
        try:
            if not self.store.check([self.at + "abort"]):
                return None
            rank, recovery, what = pickle.loads(self.store.get(self.at + "abort"))
        except Exception as exc:
            raise self.gone(exc, "looking for an abort of the sync") from exc
        return int(rank), recovery, str(what)

    def wait(self, work: Any, what: str) -> None:
        """Wait for the collective `work`, looking at the store for an abort meanwhile.

        Raises:
            WeightSyncError: Another rank aborted this sync, or the store is gone (rank 0
                died). The collective's own error (its timeout) is raised as it is.
        """
        done: threading.Event | None = threading.Event()
        try:  # woken at once when the collective ends; no polling of the collective
            work.get_future().add_done_callback(lambda _: done.set())  # type: ignore[union-attr]
        except Exception:  # a backend without futures: poll it
            done = None
        sleep = _SLEEP_MIN
        self._next_look = time.monotonic() + _POLL  # a short collective asks nothing
        while not work.is_completed():
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + _POLL
                record = self.aborted()
                if record is not None:
                    raise self.peer_aborted(record, what)
            if done is not None:
                done.wait(max(0.0, self._next_look - time.monotonic()))
            else:
                time.sleep(sleep)
                sleep = min(2 * sleep, _SLEEP_MAX)
        work.wait()

    def peer_aborted(self, record: tuple[int, Recovery, str], what: str) -> WeightSyncError:
        """The error of a rank that learned from the store that another one failed."""
        rank, recovery, text = record
        return _ToldError(
            f"rank {self.rank}: the sync was aborted by rank {rank} while this rank was "
            f"{what}",
            expected="every rank of the group taking part until the end of the sync",
            got=f"rank {rank}: {text}",
            fix="see that rank's error; a receiver's model refuses to replay until a "
            "complete sync",
            recovery=recovery,
        )

    def gone(self, exc: BaseException, what: str) -> WeightSyncError:
        """The error of a rank that cannot reach the store: rank 0 is gone."""
        return _ToldError(
            f"rank {self.rank}: the store of the default group is gone while {what}",
            expected="the store that rank 0 of the world serves",
            got=one_line(exc),
            fix="rank 0 (the trainer, which serves the store) died: restart it and "
            "join a new world; a receiver's model refuses to replay until a complete sync",
            recovery="world",
        )

    # -- texts --------------------------------------------------------------------

    def put(self, name: str, text: str) -> None:
        """Post a text under this sync's keys (best effort)."""
        try:
            self.store.set(self.at + name, text)
        except Exception:
            return

    def get(self, name: str, timeout: float = 5.0) -> str | None:
        """A text posted under this sync's keys, waiting up to `timeout` seconds."""
        try:
            self.store.wait([self.at + name], datetime.timedelta(seconds=timeout))
            value = self.store.get(self.at + name)
        except Exception:
            return None
        return bytes(value).decode(errors="replace")


def _synced_groups() -> list[object]:
    """The group objects this process took part in a sync of (its count of them kept)."""
    return list(_SEQ)


def _forget_syncs(key: object) -> None:
    """Drop this process's count of the syncs of the group `key` (it failed): the next
    sync on a group made in its place starts the count again."""
    _SEQ.pop(key, None)
    _TIDY.pop(key, None)


def _recovery_of(exc: BaseException) -> Recovery:
    """What a failed collective calls for: a new world when its error says that a peer's
    process is gone (its connection closed), else a new group (a timeout, a mismatch)."""
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return "group"
    if any(s in text for s in ("connection reset", "connection closed", "broken pipe",
                               "connection refused", "end of file", "eof")):
        return "world"
    return "group"
