"""A post-load step run after the load returned is part of the bring-up.

vLLM's loader calls `process_weights_after_loading` after `model.load_weights`; a model
whose `load_weights` alone graphsafe wraps runs its post-load step outside the load. The
thread that ran the first load stays recorded until the model's first forward (the
bring-up's tail), so what that step derives from the weights is discovered and guarded
like what a load derives. Each case comes with its control: unguarded, the same capture
replays the stale value.

Only the compiled recorder records a tail (the Python path says so in its one warning).
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import graphsafe as gs
import graphsafe._lineage.window as window
from graphsafe import _native
from graphsafe._lineage.record.hooks import Hooks

C = 4

pytestmark = pytest.mark.skipif(
    _native.get() is None, reason="the compiled recorder records a bring-up's tail")


@gs.graphsafe
class Engine(nn.Module):
    """A loader that copies the checkpoint in; its post-load step runs apart."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.k_scale = nn.Parameter(torch.ones(()), requires_grad=False)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.packed()) * self.scale


def _pack(m: Engine) -> None:
    """The post-load step: a kernel-layout copy kept in a closure, a float scale."""
    packed = m.lin.weight.detach().t().contiguous()
    m.packed = lambda: packed
    m.scale = m.k_scale.item()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lin.weight": torch.randn(C, C, generator=g),
            "k_scale": torch.rand((), generator=g) + 0.5}


def _expected(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return (torch.ones(2, C) @ weights["lin.weight"].t()) * weights["k_scale"]


def _capture(m: nn.Module, *, guard: bool, thread: bool = False
             ) -> tuple[gs.Graph, torch.Tensor]:
    g = gs.Graph(backend="cpu", guard=m if guard else None)
    out: list[torch.Tensor] = []

    def capture() -> None:
        with torch.no_grad(), g.capture():
            out.append(m(torch.ones(2, C)))

    if thread:
        worker = threading.Thread(target=capture)
        worker.start()
        worker.join()
    else:
        capture()
    return g, out[0]


def _brought_up(post: Callable[[Engine], None] = _pack) -> Engine:
    m = Engine()
    m.load_weights(_weights(0))
    post(m)  # after the load returned
    return m


@pytest.mark.parametrize("thread", [False, True], ids=["same-thread", "forward-in-a-thread"])
def test_what_the_post_load_step_derives_after_the_load_is_discovered_and_guarded(
    thread: bool,
) -> None:
    m = _brought_up()
    g, _ = _capture(m, guard=True, thread=thread)
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {"packed.<closure packed>", "scale"}
    assert found["packed.<closure packed>"].sources == ("lin.weight",)
    assert found["scale"].sources == ("k_scale",)
    m.load_weights(_weights(1))  # a bare sync: the post-load step does not run again
    with pytest.raises(gs.StaleError, match=r"packed\.<closure packed>[\s\S]*scale"):
        g.replay()


def test_control_unguarded_the_post_load_steps_state_replays_stale() -> None:
    m = _brought_up()
    g, y = _capture(m, guard=False)
    m.load_weights(_weights(1))
    g.replay()
    assert torch.allclose(y, _expected(_weights(0)))
    assert not torch.allclose(y, _expected(_weights(1)))


def test_discovered_read_before_the_first_forward_holds_what_the_step_made_so_far() -> None:
    m = Engine()
    m.load_weights(_weights(0))
    assert [d.path for d in gs.runtime(m).discovered] == []
    _pack(m)
    assert {d.path for d in gs.runtime(m).discovered} == {"packed.<closure packed>", "scale"}
    m.extra = m.lin.weight.detach() * 2  # still recorded: the first forward has not run
    assert "extra" in {d.path for d in gs.runtime(m).discovered}


class Repacked(Engine):
    """A post-load step that re-derives in place, run after every load."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = torch.empty(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.kernel) * self.k_scale


def _repack(m: Engine) -> None:
    with torch.no_grad():
        m.kernel.copy_(m.lin.weight.t())


def _repacked(seed: int) -> Repacked:
    m = Repacked()
    m.load_weights(_weights(seed))
    _repack(m)
    return m


def test_state_the_step_re_derives_in_place_after_every_load_is_no_false_alarm() -> None:
    m = _repacked(0)
    g, y = _capture(m, guard=True)
    assert [d.path for d in gs.runtime(m).discovered] == ["kernel"]
    for seed in (1, 2, 3):
        m.load_weights(_weights(seed))
        _repack(m)  # outside any load: no load saw it re-derived
        g.replay()
        assert torch.allclose(y, _expected(_weights(seed)))


def test_state_re_derived_in_place_is_refused_where_the_step_did_not_run_again() -> None:
    m = _repacked(0)
    g, _ = _capture(m, guard=True)
    m.load_weights(_weights(1))
    with pytest.raises(gs.StaleError, match=r"kernel"):
        g.replay()
    _repack(m)  # run now: what the graph reads is what the weights give
    g.replay()


def test_control_unguarded_state_not_re_derived_in_place_replays_stale() -> None:
    m = _repacked(0)
    g, y = _capture(m, guard=False)
    m.load_weights(_weights(1))
    g.replay()
    assert not torch.allclose(y, _expected(_weights(1)))


def test_state_no_weight_feeds_made_after_the_load_is_no_false_alarm() -> None:
    def rotary(m: Engine) -> None:  # from the config alone
        table = torch.arange(C * C, dtype=torch.float32).view(C, C) / 10
        m.packed = lambda: table
        m.scale = 1.0

    m = _brought_up(rotary)
    g, _ = _capture(m, guard=True)
    assert [d.path for d in gs.runtime(m).discovered] == []
    m.load_weights(_weights(1))
    g.replay()


def _fold(m: Engine) -> None:
    with torch.no_grad():
        m.lin.weight.mul_(m.k_scale)  # folded in place, after the load


def test_a_weight_the_step_rewrites_after_every_load_is_no_false_alarm() -> None:
    """Weights rewritten in place after the load returned are not judged: the step runs
    again after each load, where no load sees it (a load that wrote them raw would be
    refused before the step could run)."""
    m = Engine()
    m.load_weights(_weights(0))
    _fold(m)
    _pack(m)
    g, _ = _capture(m, guard=True)
    for seed in (1, 2):
        w = _weights(seed)
        m.load_weights(w)
        _fold(m)
        _pack(m)
        assert "rewritten" not in {d.kind for d in gs.runtime(m).discovered}
    # The packed copy and the scale were made anew, at new places: the graph holds the
    # old ones, and says so.
    with pytest.raises(gs.StorageMovedError):
        g.replay()


def test_the_tail_ends_with_the_first_forward() -> None:
    m = _brought_up()
    assert Hooks.recording()  # the post-load step is still recorded
    with torch.no_grad():
        m(torch.ones(2, C))
    assert not Hooks.recording()
    m.late = m.lin.weight.detach() * 3  # after the first forward: no bring-up records it
    assert "late" not in {d.path for d in gs.runtime(m).discovered}


def test_a_model_dropped_before_its_first_forward_stops_the_recording() -> None:
    m = _brought_up()
    assert Hooks.recording()
    del m
    gc.collect()  # its tail records nothing more; the next load leaves it
    other = _brought_up()
    with torch.no_grad():
        other(torch.ones(2, C))
    assert not Hooks.recording()
    assert not Hooks.installed()


def test_control_while_the_tail_records_the_hooks_are_installed() -> None:
    m = _brought_up()
    assert Hooks.installed()
    with torch.no_grad():
        m(torch.ones(2, C))  # also ends the window's recording of this forward
    gs.runtime(m).pin()
    assert not Hooks.installed()


def test_a_later_models_first_load_ends_the_tail_of_the_one_before() -> None:
    """One tail per thread: a model loaded and never run must not leave its thread
    recording."""
    a = _brought_up()
    b = Engine()
    b.load_weights(_weights(1))  # ends a's tail: what it recorded is taken now
    assert {d.path for d in gs.runtime(a).discovered} == {"packed.<closure packed>", "scale"}
    a.extra = a.lin.weight.detach() * 2  # after a's tail: not recorded
    _pack(b)  # b's tail records it
    b.extra = b.lin.weight.detach() * 2
    assert "extra" not in {d.path for d in gs.runtime(a).discovered}
    assert {d.path for d in gs.runtime(b).discovered} == {
        "packed.<closure packed>", "scale", "extra"}
    ga, _ = _capture(a, guard=True)
    gb, _ = _capture(b, guard=True)
    b.load_weights(_weights(2))
    with pytest.raises(gs.StaleError, match=r"packed\.<closure packed>"):
        gb.replay()
    ga.replay()  # a's weights were not written
    assert not Hooks.recording()


def test_a_tail_past_its_limit_stops_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(window, "TAIL_RECORDS", 20)
    m = Engine()
    m.load_weights(_weights(0))
    for _ in range(30):  # unrelated work between the load and the first forward
        torch.ones(3).add_(1)
    _pack(m)
    with pytest.warns(gs.GraphSafetyWarning, match=r"stopped recording[\s\S]*20 ops"):
        _capture(m, guard=True)
    assert {d.path for d in gs.runtime(m).discovered} == set()  # as the warning said


def test_control_a_tail_within_its_limit_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(window, "TAIL_RECORDS", 200)
    m = Engine()
    m.load_weights(_weights(0))
    for _ in range(30):
        torch.ones(3).add_(1)
    _pack(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.GraphSafetyWarning)
        _capture(m, guard=True)
    assert {d.path for d in gs.runtime(m).discovered} == {"packed.<closure packed>", "scale"}


@pytest.mark.parametrize("read", [lambda t: t.tolist(), lambda t: t.numpy()],
                         ids=["tolist", "numpy"])
def test_a_value_read_during_a_capture_while_a_tail_records_is_still_refused(
    read: Callable[[torch.Tensor], object],
) -> None:
    """The recording's hooks replace `.tolist()` and `.numpy()` while it records: the
    CPU graph's capture still knows them."""
    m = _brought_up()
    assert Hooks.installed()
    g = gs.Graph(backend="cpu")
    with pytest.raises(gs.CaptureError, match=r"reads a tensor's value"), g.capture():
        read(torch.ones(2) * 2)
    del m


def _pack_in_a_thread(m: Engine) -> None:
    """The post-load step's packing done by a worker thread it starts and joins."""
    out: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: out.append(m.lin.weight.detach().t() * 1.0))
    worker.start()
    worker.join()
    packed = out[0]
    m.packed = lambda: packed
    m.scale = 1.0


def test_what_a_thread_the_step_starts_packs_is_said_and_guarded() -> None:
    """The tail follows no thread (one started then may live on): such a thread is watched
    as any thread not followed is, and what it leaves where the model holds it is found
    by its taint."""
    m = Engine()
    m.load_weights(_weights(0))
    _pack_in_a_thread(m)
    with pytest.warns(gs.GraphSafetyWarning, match=r"lin\.weight"):
        g, _ = _capture(m, guard=True)
    assert "packed.<closure packed>" in {d.path for d in gs.runtime(m).discovered}
    m.load_weights(_weights(1))
    with pytest.raises(gs.StaleError, match=r"packed\.<closure packed>"):
        g.replay()


def test_a_thread_started_in_the_tail_that_lives_on_leaves_no_recording_behind() -> None:
    stop = threading.Event()
    m = Engine()
    m.load_weights(_weights(0))
    _pack(m)
    worker = threading.Thread(target=stop.wait)  # an engine's own, living on
    worker.start()
    try:
        _capture(m, guard=True)
        assert not Hooks.installed()
    finally:
        stop.set()
        worker.join()
