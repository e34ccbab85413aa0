"""The recorder tells storages apart by identity (`_cdata`), so it must keep every identity
it noted from being reused while the recording lives, and let go of them once it ends:
a storage freed in a recording whose identity a new one took would give the new storage
the old one's writer (a wrong chain, or a tensor discovered as derived that is not)."""

from __future__ import annotations

import pytest
import torch

from graphsafe._lineage.record import recorder
from graphsafe._lineage.record.recorder import Lineage, record, sid_of


def _reused(sid: int, tries: int = 200) -> bool:
    """Whether one of `tries` storages made now (all alive at once, so that they take
    the freed memory in turn) takes identity `sid`: the allocator hands a freed
    `StorageImpl`'s memory to the next ones."""
    made = [torch.empty(4) for _ in range(tries)]
    return any(sid_of(t) == sid for t in made)


def _written_and_freed(lin: Lineage) -> int:
    """Records an op whose result is freed at once; returns the result's identity."""
    w = torch.ones(4)
    with record(lin):
        x = w * 2
        sid = sid_of(x)
        del x
    return sid


def test_a_written_storage_freed_in_the_recording_keeps_its_identity() -> None:
    lin = Lineage()
    sid = _written_and_freed(lin)
    assert sid in lin.writers and sid not in lin.alive()
    assert not _reused(sid)


def test_control_an_identity_not_held_is_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Lineage, "hold", lambda self, storage, sid: None)
    monkeypatch.setattr(Lineage, "alive", lambda self: set())
    lin = Lineage()
    assert _reused(_written_and_freed(lin))


def _read_and_freed(lin: Lineage) -> int:
    """Records an op reading a storage made before the recording, then frees that
    storage; returns its identity."""
    c = torch.ones(4)
    sid = sid_of(c)
    with record(lin):
        y = c + 1
        del c
    assert lin.writers[sid_of(y)][0].args[0].sid == sid
    return sid


def test_a_storage_read_before_it_was_written_keeps_its_identity() -> None:
    lin = Lineage()
    sid = _read_and_freed(lin)
    assert not _reused(sid)


def test_control_a_read_storage_not_kept_is_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Lineage, "kept", lambda self, storage, sid: None)
    assert _reused(_read_and_freed(Lineage()))


def test_a_released_recording_lets_its_identities_go() -> None:
    """The weak references are freed: a recording does not leak what it held."""
    lin = Lineage()
    written = _written_and_freed(lin)
    read = _read_and_freed(lin)
    lin.release()
    assert _reused(written) and _reused(read)


def test_control_weak_references_not_freed_keep_the_identities(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kept: list[int] = []
    monkeypatch.setattr(recorder._Held, "__del__",
                        lambda self, free=None: kept.extend(self.refs.values()))
    lin = Lineage()
    written = _written_and_freed(lin)
    lin.release()
    try:
        assert not _reused(written)
    finally:
        for ref in kept:
            torch.UntypedStorage._free_weak_ref(ref)  # type: ignore[attr-defined]


def test_a_copy_source_and_a_replaced_parameter_keep_their_identities() -> None:
    """`copy_`'s source into a weight (a staging copy) and a parameter bound over: both
    noted by identity (`copied`, `replaced`), both held."""
    model = torch.nn.Linear(2, 2, bias=False)
    lin = Lineage()
    weights = frozenset({model.weight.untyped_storage().data_ptr()})
    with recorder.Recorder(lin, weights), torch.no_grad():
        staged = torch.full((2, 2), 3.0)
        model.weight.copy_(staged)
        src = sid_of(staged)
        del staged
        old = model.weight
        model.weight = torch.nn.Parameter(old * 2, requires_grad=False)
        was = sid_of(old)
        del old
    assert src in lin.copied and was in lin.replaced.values()
    assert not _reused(src) and not _reused(was)
