"""The write journal and the witnesses that read it (`graphsafe._memory`)."""

from __future__ import annotations

import gc
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._memory.journal import JOURNAL, Journal
from graphsafe._memory.snapshot import Identities, Witnesses
from graphsafe._memory.walk import Slot, storage_key


def test_witnesses_read_the_journal_they_are_given() -> None:
    w = torch.zeros(4)
    holder = {"w": w}
    own, other = Journal(), Journal()
    mine = Witnesses([(holder, "w")], own)
    theirs = Witnesses([(holder, "w")], other)
    own.advance([storage_key(w)], "a test write", lambda key: w.untyped_storage())
    assert mine.changed() == [(0, "written by a test write")]
    assert theirs.unchanged()  # control: another journal's write is not this one's
    mine.record([0])
    assert mine.unchanged()


def _poisoned() -> tuple[Journal, torch.Tensor, int]:
    """A journal that recorded a load into a tensor, then a failure's poison of it."""
    journal = Journal()
    w = torch.zeros(1024)
    key = storage_key(w)
    journal.advance([key], "a load", lambda k, t=w: t.untyped_storage())
    journal.poison([w], "a failed load")
    return journal, w, key


def test_the_journal_forgets_a_storage_when_it_dies() -> None:
    journal, w, key = _poisoned()
    assert len(journal) == 1 and journal.poisoned_among(frozenset([key]))
    del w
    gc.collect()
    assert len(journal) == 0
    assert journal.epochs_of([key]) == [0]  # a storage made there later starts clean
    assert not journal.poisoned_among(frozenset([key]))


def _dropped_together(journal: Journal) -> tuple[list[int], list[int], int, int, int]:
    """Forty of fifty storages a load wrote die at once (a dropped model's) and the
    journal is swept: (the epochs of the dead keys, of the live ones, the clock before and
    after the sweep, how many storages the journal holds then)."""
    tensors = [torch.zeros(256) for _ in range(50)]
    storages = {storage_key(t): t.untyped_storage() for t in tensors}
    keys = list(storages)
    journal.advance(set(keys), "load", storages.get)
    before = journal.clock
    for key in keys[:40]:
        del storages[key]
    del tensors[:40]
    gc.collect()
    journal.sweep()
    after, held = journal.clock, len(journal)
    return journal.epochs_of(keys[:40]), journal.epochs_of(keys[40:]), before, after, held


def test_storages_that_die_together_are_all_forgotten_in_one_sweep_and_the_rest_kept() -> None:
    journal = Journal()
    dead, live, before, after, held = _dropped_together(journal)
    assert dead == [0] * 40  # a storage made at one of their addresses starts clean
    assert live == [before] * 10
    assert after > before  # witnesses of the forgotten epochs look again
    assert held == 10


def test_control_a_sweep_that_forgets_one_of_them_leaves_stale_epochs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forget_all = Journal._forget_all
    monkeypatch.setattr(Journal, "_forget_all", lambda self, keys: forget_all(self, keys[:1]))
    dead, *_ = _dropped_together(Journal())
    assert dead.count(0) == 1  # the rest keep an epoch no live storage has


def test_poison_follows_a_storage_whose_bytes_move_and_frees_the_old_address() -> None:
    # `share_memory_()` moves a live storage's bytes: the old address is freed for any
    # new storage, while the poisoned storage is still the one a replay would read.
    journal, w, old = _poisoned()
    w.share_memory_()
    now = storage_key(w)
    assert now != old  # control: the bytes did move
    assert journal.poisoned_among(frozenset([now])) == {now: "a failed load"}
    assert not journal.poisoned_among(frozenset([old]))  # a new storage there is clean
    assert journal.poisoned_keys() == {now}
    journal.heal([now])
    assert not journal.poisoned_keys()
    del w
    gc.collect()
    assert len(journal) == 0


def test_a_storage_poisoned_where_another_storages_bytes_were_dies_with_its_poison() -> None:
    # A storage tracked at an address its bytes moved away from no longer speaks for it:
    # the next storage poisoned there is tracked itself, and its death frees the address.
    journal = Journal()
    w = torch.zeros(1024)
    key = storage_key(w)
    alias = torch.from_numpy(w.numpy())  # another storage object of w's bytes
    journal.advance([key], "a load", lambda k, t=alias: t.untyped_storage())
    alias.share_memory_()  # its bytes move; it lives on, tracked at `key`
    assert storage_key(alias) != key and storage_key(w) == key
    journal.poison([w], "a failed load")
    assert journal.poisoned_among(frozenset([key]))
    del w
    gc.collect()
    assert not journal.poisoned_among(frozenset([key]))  # died with its storage
    assert journal.poisoned_keys() == frozenset()


def test_control_poison_through_another_storage_of_the_same_bytes_lives_with_them() -> None:
    # The other way round: while the storage tracked at the address still has its bytes
    # there, poison set through another object of them lives as long as they do.
    journal = Journal()
    w = torch.zeros(1024)
    key = storage_key(w)
    journal.advance([key], "a load", lambda k, t=w: t.untyped_storage())
    alias = torch.from_numpy(w.numpy())
    journal.poison([alias], "a failed load")
    del alias
    gc.collect()
    assert journal.poisoned_among(frozenset([key])) == {key: "a failed load"}
    del w
    gc.collect()
    assert not journal.poisoned_keys()


def test_control_a_write_recorded_without_its_storage_is_kept() -> None:
    # What pruning needs: the storage, asked for once. Without it the entry stays, which
    # is what every write recorded before pruning did (the journal only grew).
    journal = Journal()
    w = torch.zeros(1024)
    key = storage_key(w)
    journal.advance([key], "a load")
    del w
    gc.collect()
    assert len(journal) == 1 and journal.epochs_of([key]) == [journal.clock]


def test_loads_of_models_that_die_leave_the_process_journal_as_it_was() -> None:
    reg = gs.Registry()

    @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
    def weight_t(m: nn.Linear, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        t = w.t().contiguous()
        return t if out is None else out.copy_(t)

    gc.collect()
    before = len(JOURNAL)
    for _ in range(20):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        gs.runtime(model, reg).refresh()
        with gs.weight_update(model):
            for p in model.parameters():
                p.data.copy_(torch.randn_like(p))
        assert len(JOURNAL) > before  # the live model's writes are recorded
        del model, p
    gc.collect()
    assert len(JOURNAL) <= before


def test_the_storages_of_a_first_load_are_found_in_the_tables_and_walked_for_only_off_them(
) -> None:
    from graphsafe._runtime.loads.load import _StorageFinder

    model = nn.Linear(4, 4)
    model.cache = {"k": torch.zeros(8)}  # held off the tables: only a walk reaches it
    walks: list[int] = []

    def walk() -> list[torch.Tensor]:
        walks.append(1)
        return [*model.parameters(), model.cache["k"]]

    storage_of = _StorageFinder(walk, lambda: [model])
    w = storage_of(storage_key(model.weight))
    assert w is not None and w.data_ptr() == storage_key(model.weight) and not walks
    k = storage_of(storage_key(model.cache["k"]))  # not a parameter: one walk finds it
    assert k is not None and k.data_ptr() == storage_key(model.cache["k"]) and walks == [1]
    assert storage_of(12345) is None and walks == [1]  # walked once at most
    # Control: without the tables, the first question walks the model.
    walks.clear()
    assert _StorageFinder(walk, None)(storage_key(model.weight)) is not None and walks == [1]


@pytest.mark.parametrize("native", [False, True] if _native.get() is not None else [False],
                         ids=lambda n: "compiled" if n else "python")
def test_the_journal_tracks_a_first_loads_storages_from_the_tables_in_one_pass(
        native: bool) -> None:
    from graphsafe._runtime.loads.load import _StorageFinder

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied: one storage, found once
    model.register_buffer("absent", None)
    model.cache = {"k": torch.zeros(8)}  # off the tables: looked up one by one (a walk)
    tensors = [*model.parameters(), model.cache["k"]]
    keys = {storage_key(t) for t in tensors}
    walks: list[int] = []

    def walk() -> list[torch.Tensor]:
        walks.append(1)
        return [*model.parameters(), *vars(model).get("cache", {}).values()]

    journal = Journal()
    with _native.using(native):
        journal.advance(keys, "a first load", _StorageFinder(walk, lambda: list(model.modules())))
    assert walks == [1]  # the cache alone was looked for
    for t in tensors:
        key = storage_key(t)
        assert journal.containing(key, key + t.nbytes) == {key}
    gone = storage_key(model.cache["k"])
    del model.cache, tensors, t
    gc.collect()
    assert journal.containing(gone, gone + 32) == set()  # forgotten as it died
    # Control: a finder that finds nothing tracks nothing.
    lost = Journal()
    lost.advance({storage_key(model[0].weight)}, "a load", _StorageFinder(lambda: [], lambda: []))
    assert lost.containing(storage_key(model[0].weight), storage_key(model[0].weight) + 1) == set()


def test_a_first_load_makes_the_journal_know_every_storage_it_wrote() -> None:
    model = nn.Linear(4, 4).requires_grad_(False)
    model.cache = {"k": torch.zeros(8)}  # written in place, held off the tables
    with gs.weight_update(model):
        model.weight.copy_(torch.ones(4, 4))
        model.cache["k"].add_(1)
    for t in (model.weight, model.cache["k"]):  # known: the journal forgets each as it dies
        key = storage_key(t)
        assert key in JOURNAL.containing(key, key + t.nbytes)
    del model, t
    gc.collect()
    len(JOURNAL)  # forgotten now, not in another test


def test_the_journal_heals_only_the_storages_it_is_given() -> None:
    # A completed load heals what it wrote; every other failure's poison stays.
    journal = Journal()
    a, b = torch.zeros(8), torch.zeros(8)
    journal.poison([a, b], "a failed load")
    journal.heal([storage_key(a)])
    assert journal.poisoned_among(frozenset([storage_key(a), storage_key(b)])) == {
        storage_key(b): "a failed load"
    }


def test_a_second_write_moves_the_storages_epoch_and_makes_its_readers_stale() -> None:
    journal = Journal()
    w = torch.zeros(4)
    holder = {"w": w}
    key = storage_key(w)
    witnesses = Witnesses([(holder, "w")], journal)
    journal.advance([key], "the first load", lambda k: w.untyped_storage())
    first = journal.epochs_of([key])[0]
    witnesses.record([0])
    assert witnesses.unchanged()
    journal.advance([key], "the second load", lambda k: w.untyped_storage())
    assert journal.epochs_of([key])[0] > first
    assert witnesses.changed() == [(0, "written by the second load")]


def _paths() -> list[bool]:
    # The compiled path where `graphsafe native build` made it (scripts/setup does).
    return [False, True] if _native.get() is not None or _built() else [False]


def _built() -> bool:
    try:
        with _native.using(True):
            return True
    except _native.NativeBuildError:
        return False


@pytest.mark.parametrize("native", _paths(), ids=lambda n: "compiled" if n else "python")
def test_witnesses_and_identities_read_cells_and_slots_as_they_read_dicts(native: bool) -> None:
    class Kernel:
        __slots__ = ("weight",)

    w = torch.zeros(3)
    kernel = Kernel()
    kernel.weight = w
    cell = types.CellType(w)
    obj = types.SimpleNamespace(w=w)
    journal = Journal()
    sites = [(cell, None), (kernel, Slot("weight")), (vars(obj), "w")]
    with _native.using(native):
        witnesses = Witnesses(sites, journal)
        identities = Identities([(h, k, w, w.data_ptr(), w.stride()) for h, k in sites], 3)
    assert (witnesses._native is not None) is native and (identities.native is not None) is native
    assert witnesses.unchanged() and identities.unchanged()
    seen = identities.take_read()
    assert seen is not None and seen.tensors == [w, w, w] and identities.take_read() is None
    w.add_(1)  # in place: the version moves
    assert [i for i, _ in witnesses.changed()] == [0, 1, 2]
    witnesses.record(range(3))
    kernel.weight = torch.zeros(3)  # rebound in the slot only
    assert witnesses.changed() == [(1, "rebound")]
    assert not identities.unchanged()
    cell.cell_contents = torch.zeros(3)
    assert [i for i, _ in witnesses.changed()] == [0, 1]


# -----------------------------------------------------------------------------
# gs.mark_written refuses what is not a tensor


@pytest.mark.parametrize(
    ("make", "kind", "fix"),
    [
        (lambda w: (t for t in [w]), "generator", r"`gs.mark_written\(\*the_generator\)`"),
        (lambda w: [w], "list", r"`gs.mark_written\(\*the_list\)`"),
        (lambda w: (w,), "tuple", r"`gs.mark_written\(\*the_tuple\)`"),
        (lambda w: w.numpy(), "numpy.ndarray", r"the torch tensor the array views"),
        (lambda w: nn.Linear(2, 2), "torch.nn.modules.linear.Linear",
         r"`gs.mark_written\(\*module.parameters\(\)\)`"),
        (lambda w: {"w": w}, "dict", r"`gs.mark_written\(\*the_dict.values\(\)\)`"),
        (lambda w: 3, "int", r"pass the tensors that were written"),
    ],
    ids=["generator", "list", "tuple", "ndarray", "module", "dict", "int"],
)
def test_mark_written_refuses_what_is_not_a_tensor_and_records_nothing(
    make: Callable[[torch.Tensor], object], kind: str, fix: str
) -> None:
    # Before: `AttributeError: '...' object has no attribute 'untyped_storage'`.
    w = torch.zeros(4)
    key = storage_key(w)
    before = (JOURNAL.clock, JOURNAL.epochs_of([key]))
    with pytest.raises(
        gs.GraphSafetyError,
        match=rf"gs.mark_written takes tensors; argument 2 of 2 is of type {kind}\n"
        rf" +expected: +torch.Tensor arguments: `gs.mark_written\(\*tensors\)`\n"
        rf" +got: +argument 2: {kind}\n +fix: +.*{fix}.*; nothing was recorded",
    ):
        gs.mark_written(w, make(w))  # type: ignore[arg-type]
    assert (JOURNAL.clock, JOURNAL.epochs_of([key])) == before  # the first one neither


def test_control_the_fix_it_gives_records_every_tensor() -> None:
    a, b = torch.zeros(4), torch.zeros(4)
    the_list = [a, b]
    gs.mark_written(*the_list)
    assert JOURNAL.epochs_of([storage_key(a), storage_key(b)]) == [JOURNAL.clock] * 2
    assert JOURNAL.how_written(storage_key(b)) == "a write declared with gs.mark_written"


class _Unsettled(Journal):
    """A broken journal for the controls below: the last write of a frozenset is dropped
    instead of recorded when another write comes (its storages keep their older epochs)."""

    __slots__ = ()

    def _settle(self) -> None:
        self._last = None


def _written_twice(journal: Journal) -> tuple[list[torch.Tensor], list[int],
                                              dict[int, torch.UntypedStorage]]:
    """Three storages written into `journal` as one frozenset twice (the second time: one
    step): (the tensors, their storage keys, key -> storage)."""
    tensors = [torch.zeros(256) for _ in range(3)]
    keys = [storage_key(t) for t in tensors]
    storages = {storage_key(t): t.untyped_storage() for t in tensors}
    written = frozenset(keys)
    journal.advance(written, "load 1", storages.get)
    journal.advance(written, "load 2", storages.get)
    return tensors, keys, storages


def _repeated_then_one(journal: Journal) -> tuple[list[int], list[int], list[str]]:
    """Three storages written as one frozenset twice (the second time: one step), then one
    of them alone: (their epochs, the clocks of the three writes, what wrote each)."""
    _, keys, storages = _written_twice(journal)
    second = journal.clock
    journal.advance([keys[0]], "load 3", storages.get)
    return (journal.epochs_of(keys), [second, journal.clock],
            [journal.how_written(k) for k in keys])


def test_the_same_frozenset_written_again_moves_every_epoch_and_a_later_write_keeps_them(
) -> None:
    epochs, (second, third), how = _repeated_then_one(Journal())
    assert epochs == [third, second, second]
    assert how == ["load 3", "load 2", "load 2"]


def test_control_a_journal_that_drops_the_repeated_write_is_caught() -> None:
    epochs, (second, third), _ = _repeated_then_one(_Unsettled())
    assert epochs != [third, second, second]  # the two storages lost the second write


def test_witnesses_see_a_frozenset_written_again_in_one_step() -> None:
    journal = Journal()
    tensors = {f"w{i}": torch.zeros(256) for i in range(3)}
    storages = {storage_key(t): t.untyped_storage() for t in tensors.values()}
    written = frozenset(storages)
    witnesses = Witnesses([(tensors, name) for name in tensors], journal)
    journal.advance(written, "load 1", storages.get)
    witnesses.record(range(3))
    assert witnesses.unchanged()
    before = journal.clock
    journal.advance(written, "load 2", storages.get)  # the same object: one step
    assert not witnesses.unchanged()
    assert witnesses.changed(by_journal=True) == [
        (i, "written by load 2") for i in range(3)]
    assert journal.written_since(before) == written
    assert journal.written_since(journal.clock) == set()
    witnesses.record(range(3))
    assert witnesses.unchanged()
    journal.advance(frozenset(written), "load 3", storages.get)  # equal, not the same
    assert [i for i, _ in witnesses.changed()] == [0, 1, 2]


def test_a_storage_of_a_write_in_one_step_that_dies_is_forgotten_and_the_rest_kept() -> None:
    journal = Journal()
    tensors, keys, storages = _written_twice(journal)
    written, second = frozenset(keys), journal.clock
    del tensors[0], storages[keys[0]]
    gc.collect()
    assert len(journal) == 2
    assert journal.epochs_of(keys) == [0, second, second]
    journal.advance(written, "load 3", storages.get)  # its key, dead, is recorded untracked
    assert journal.epochs_of(keys[1:]) == [journal.clock] * 2


def test_poison_moves_with_a_storage_written_in_one_step_and_keeps_its_epoch() -> None:
    journal = Journal()
    w, other = torch.zeros(1024), torch.zeros(1024)
    storages = {storage_key(t): t.untyped_storage() for t in (w, other)}
    written = frozenset(storages)
    journal.advance(written, "load 1", storages.get)
    journal.advance(written, "load 2", storages.get)
    second = journal.clock
    journal.poison([w], "a failed load")
    w.share_memory_()
    now = storage_key(w)
    assert journal.poisoned_keys() == {now}
    assert journal.epochs_of([now, storage_key(other)]) == [second, second]


def test_a_write_of_nothing_between_two_writes_of_one_frozenset_keeps_their_epochs() -> None:
    journal = Journal()
    tensors = [torch.zeros(256) for _ in range(2)]
    storages = {storage_key(t): t.untyped_storage() for t in tensors}
    written = frozenset(storages)
    journal.advance(written, "load 1", storages.get)
    first = journal.clock
    journal.advance(frozenset(), "an empty load", storages.get)
    assert journal.clock == first + 1  # the clock moves: witnesses look again
    assert journal.epochs_of(list(written)) == [first, first]
    journal.advance(written, "load 3", storages.get)
    assert journal.epochs_of(list(written)) == [journal.clock] * 2
    assert journal.written_since(first + 1) == written
    assert {journal.how_written(k) for k in written} == {"load 3"}
