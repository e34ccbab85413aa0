"""The small owners a model's loads keep (`graphsafe._runtime.loads`): what failed loads
owe (`Owed`, `Debts`), what lazy refresh defers (`Deferred`) and a `load_state_dict`
outside a load (`StateDictCalls`), each driven the way the load driver drives it."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

import graphsafe as gs
from graphsafe._memory.journal import Journal
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.loads.debts import Debts, Owed
from graphsafe._runtime.loads.deferred import Deferred
from graphsafe._runtime.loads.load import Load
from graphsafe._runtime.loads.state_dict import StateDictCalls
from graphsafe._runtime.refresh.binder import Binder
from graphsafe._runtime.refresh.engine import Engine

_REG = gs.Registry()


@_REG.derive(nn.Linear, "weight_t", inputs=["weight"])
def _weight_t(m: nn.Linear, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    return w.t().contiguous() if out is None else out.copy_(w.t())


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)


def _binder(model: nn.Module, journal: Journal) -> Binder:
    return Binder(model, _REG, strict=False, journal=journal, own=lambda m: None,
                  on_bind=lambda m, e: None)


def _materialized(binder: Binder) -> Engine:
    engine = binder.engine(False)
    engine.refresh(False)
    return engine


# -- Owed ---------------------------------------------------------------------------------


def test_owed_is_paid_only_by_what_a_completed_load_wrote() -> None:
    owed = Owed()
    owed.owe(["a.weight", "a.bias", "b.weight"], "Model.load_weights raised KeyError: 'x'")
    keys = {"a.weight": 1, "a.bias": 2, "b.weight": 3}
    owed.pay(set(), set(), keys)  # a load that wrote nothing pays nothing
    assert list(owed.paths) == ["a.weight", "a.bias", "b.weight"] and len(owed) == 3
    owed.pay({1}, {"b.weight"}, keys)  # by storage, and by path (a transient input)
    assert list(owed.paths) == ["a.bias"] and owed.why.startswith("Model.load_weights")
    owed.pay({99}, set(), {})  # a path the model no longer has: nothing left to write
    assert not owed


# -- Debts --------------------------------------------------------------------------------


def test_a_failed_load_owes_every_weight_and_poisons_their_storages_but_not_derived_ones(
) -> None:
    model, journal = _Two(), Journal()
    binder = _binder(model, journal)
    engine = _materialized(binder)
    debts = Debts(journal)
    debts.fail(binder, set(), None, "Model.load_weights raised RuntimeError: torn")
    assert set(debts.owed.paths) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    derived = {storage_key(t) for b in engine.bound for t in b.buffers or ()}
    assert {storage_key(p) for p in model.parameters()} <= journal.poisoned.keys()
    assert derived.isdisjoint(journal.poisoned)  # a derived buffer is not a weight
    # Control: the paths of what completed loads write again are paid, the rest stay.
    debts.pay(binder, {storage_key(model.a.weight), storage_key(model.a.bias)}, set())
    assert set(debts.owed.paths) == {"b.weight", "b.bias"}


def test_a_failed_update_that_named_its_writes_owes_only_those() -> None:
    model, journal = _Two(), Journal()
    binder = _binder(model, journal)
    _materialized(binder)
    debts = Debts(journal)
    debts.fail(binder, set(), frozenset({"a.weight"}), "weight_update raised ValueError: x")
    assert list(debts.owed.paths) == ["a.weight"]
    assert journal.poisoned.keys() == {storage_key(model.a.weight)}


# -- Deferred -----------------------------------------------------------------------------


def _lazy_load(binder: Binder, journal: Journal, write: torch.Tensor) -> Load:
    """A load that writes `write` in place of a.weight and defers its refresh."""
    engine = binder.engine(False)
    load = Load.begin(engine, journal, pinned=False, everything=binder.model_map().key_set)
    with load.running():
        binder.model.a.weight.data.copy_(write)
    load.end("test load", None, pinned=False, model_tensors=binder.tensors, lazy=True)
    return load


def test_deferred_refreshes_what_lazy_loads_left_stale_once() -> None:
    model, journal = _Two(), Journal()
    binder = _binder(model, journal)
    engine = _materialized(binder)
    deferred = Deferred()
    deferred.set_lazy(True)
    assert deferred.lazy
    new = torch.randn(2, 3)
    load = _lazy_load(binder, journal, new)
    deferred.take(load)
    assert load.deferred and set(load.deferred) <= engine.stale  # left stale, no reason
    assert not torch.equal(model.a.weight_t, new.t())
    deferred.refresh(engine)
    assert torch.equal(model.a.weight_t, new.t()) and not engine.stale
    deferred.refresh(engine)  # once: nothing is left
    assert engine.last_report is not None


def test_deferred_leaves_a_failed_refresh_and_another_binding_to_the_freshness_check(
) -> None:
    model, journal = _Two(), Journal()
    binder = _binder(model, journal)
    engine = _materialized(binder)
    deferred = Deferred()
    deferred.take(_lazy_load(binder, journal, torch.randn(2, 3)))
    engine.mark_stale([0], "a failed load")  # a failure: the guard refuses, never repairs
    deferred.refresh(engine)
    assert 0 in engine.stale
    # Bound anew since: the new binding refreshes on its own; the old indices are dropped.
    deferred.take(_lazy_load(binder, journal, torch.randn(2, 3)))
    other = Engine(engine.binding, binder.model_tensors, journal=journal)
    deferred.refresh(other)
    assert engine.stale  # not refreshed through another engine
    deferred.refresh(engine)
    assert engine.stale  # and forgotten, not kept for later


# -- StateDictCalls -----------------------------------------------------------------------


def _untracked() -> tuple[dict[str, int], frozenset[tuple[str, ...]]]:
    return {}, frozenset()  # a call outside any load: no paths, no broken ties


def test_a_state_dict_call_outside_a_load_finds_what_torch_copied_by_versions() -> None:
    model, journal = _Two(), Journal()
    binder = _binder(model, journal)
    engine = _materialized(binder)
    calls = StateDictCalls()
    errors: list[str] = []
    calls.begin(engine, binder.tensors, {}, "", errors, _untracked)
    with torch.no_grad():
        model.b.bias.copy_(torch.ones(2))  # as torch's copy in load_state_dict moves versions
    begun, written, raised = calls.end(binder.tensors)
    assert begun is not None and raised is None
    assert written == {storage_key(model.b.bias)}
    # Inside a tracked load the tracker sees the copies: nothing is recorded here.
    calls.begin(engine, binder.tensors, {}, "", [], None)
    assert calls.end(binder.tensors) == (None, set(), None)


def test_a_strict_state_dict_failure_is_settled_once() -> None:
    model, journal = _Two(), Journal()
    binder = _binder(model, journal)
    engine = _materialized(binder)
    calls = StateDictCalls()
    errors: list[str] = []
    calls.begin(engine, binder.tensors, {}, "", errors, _untracked)
    begun, _, raised = calls.end(binder.tensors)
    assert raised is None and calls.settle() is None
    errors.append('Missing key(s) in state_dict: "a.weight".')  # torch adds it after the hooks
    calls.ended(begun, SimpleNamespace(missing_keys=["a.weight"], unexpected_keys=[]))
    why = calls.settle()
    assert why is not None and why.startswith("load_state_dict raised RuntimeError: Missing")
    assert calls.settle() is None  # settled once
    # Control: a call that ended with every key matched leaves nothing to settle.
    calls.begin(engine, binder.tensors, {}, "", [], _untracked)
    begun, _, _ = calls.end(binder.tensors)
    calls.ended(begun, SimpleNamespace(missing_keys=[], unexpected_keys=[]))
    assert calls.settle() is None
