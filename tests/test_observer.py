"""The process-wide write observer (`graphsafe._runtime.writes.observer`).

Writes into a pinned model outside any tracked load that move no version counter:
`p.data.copy_(w)` in a script, a raw storage copy, fused optimizer steps, an `out=`
write, a write through a view, writes in a thread a loader starts or in any other
thread. Each is refused by name by a guarded
graph and repaired with `on_stale="refresh"`; its controls replay the same write
silently stale, under an unguarded graph (the write really bypasses the graph) and
under a guarded one with the observer off (what the guard did before it existed). A
healthy sequence of loads, refreshes and unwatched writes is never refused.

It sees writes through one of two doors: kernels at ADInplaceOrView (the default) and a
RecordFunction callback (where a watched tensor was made in inference mode, or with
`GRAPHSAFE_OBSERVER=callback`); the writes above are refused through either (`door`).

The observer exists only in the compiled build: without it (`GRAPHSAFE_NATIVE=0`) the
controls run, and so does the test of the warning that says there is none.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._memory.journal import JOURNAL
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.writes.observer import OBSERVER
from graphsafe._runtime.writes.tracking import WriteTracker

needs_native = pytest.mark.skipif(
    _native.get() is None,
    reason="the process-wide observer needs the compiled build (`graphsafe native build`)",
)

SEEN = r"outside any tracked load \(seen by the process-wide write observer\)"


@gs.graphsafe
class Layer(nn.Module):
    """`w` [4, 6] and its transpose, derived; `bias` is read by no derivation."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("bias", torch.zeros(4))

    @gs.derive("w_t", inputs=["w"])
    def _w_t(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.transpose(w, 0, 1).contiguous() if out is None else out.copy_(w.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_t + self.bias  # [T, 4]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]], *, worker: str = "") -> None:
        """Copy in place. `worker`: "direct", a thread it starts copies; "joins", that
        thread calls `load_weights` (it joins this load)."""
        if worker:
            target = self.load_weights if worker == "joins" else self._copy
            thread = threading.Thread(target=target, args=(weights,))
            thread.start()
            thread.join()
        else:
            self._copy(weights)

    def _copy(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, w in weights:
                getattr(self, name).data.copy_(w)


def _loaded() -> tuple[Layer, torch.Tensor]:
    layer = Layer()
    layer.load_weights([("w", torch.randn(4, 6))])
    return layer, torch.randn(2, 6)


def _captured(
    layer: Layer, x: torch.Tensor, guard: bool = True,
    on_stale: Literal["raise", "refresh"] = "raise",
) -> tuple[gs.Graph, torch.Tensor]:
    graph = gs.Graph(backend="cpu", guard=layer if guard else None, on_stale=on_stale)
    with torch.no_grad(), graph.capture():
        out = layer(x)
    return graph, out


def _expected(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    """What the graph computes from the current weights (not from `w_t`, which may lag),
    through a transposed copy laid out as `w_t` is: a matmul over a transposed view may
    round differently (other kernels), and the tests compare bit for bit."""
    return (x @ layer.w.detach().t().contiguous() + layer.bias).detach()


# Each write changes `w` outside any tracked load without moving its version counter.
def _script_copy(layer: Layer) -> None:
    layer.w.data.copy_(torch.randn(4, 6))


def _raw_storage_copy(layer: Layer) -> None:
    layer.w.untyped_storage().copy_(torch.randn(4, 6).untyped_storage())


def _fused_adamw(layer: Layer) -> None:
    layer.w.grad = torch.randn(4, 6)
    torch.optim.AdamW([layer.w], lr=0.1, fused=True).step()


def _fused_sgd(layer: Layer) -> None:
    layer.w.grad = torch.randn(4, 6)
    torch.optim.SGD([layer.w], lr=0.1, fused=True).step()


def _out_write(layer: Layer) -> None:
    torch.add(torch.randn(4, 6), torch.randn(4, 6), out=layer.w.data)


def _view_write(layer: Layer) -> None:
    layer.w.data.t()[2:].mul_(2.0)  # a strided view at an offset into w's storage


def _loader_thread(layer: Layer) -> None:
    layer.load_weights([("w", torch.randn(4, 6))], worker="direct")


def _plain_thread(layer: Layer) -> None:
    thread = threading.Thread(target=layer.w.data.copy_, args=(torch.randn(4, 6),))
    thread.start()
    thread.join()


WRITES: dict[str, tuple[Callable[[Layer], None], str]] = {
    "script_data_copy": (_script_copy, "aten::copy_"),
    "raw_storage_copy": (_raw_storage_copy, "aten::copy_"),
    "fused_adamw_step": (_fused_adamw, "aten::_fused_adamw_"),
    "fused_sgd_step": (_fused_sgd, "aten::_fused_sgd_"),
    "plain_thread": (_plain_thread, "aten::copy_"),
    "out_write": (_out_write, "aten::add"),
    "view_write": (_view_write, "aten::mul_"),
}


@pytest.fixture
def observer_off() -> Iterator[None]:
    was = gs.observe_writes(False)
    try:
        yield
    finally:
        gs.observe_writes(was)


@contextlib.contextmanager
def _through(door: str) -> Iterator[None]:
    """The observer sees writes through `door` ("kernels" or "callback") meanwhile."""
    was = OBSERVER.by_callback
    OBSERVER.by_callback = door == "callback"
    OBSERVER.set_enabled(OBSERVER.enabled)  # applies it to what is watched now
    try:
        yield
    finally:
        OBSERVER.by_callback = was
        OBSERVER.set_enabled(OBSERVER.enabled)


@pytest.fixture(params=["kernels", "callback"])
def door(request: pytest.FixtureRequest) -> Iterator[str]:
    with _through(request.param):
        yield request.param


@needs_native
@pytest.mark.parametrize("name", list(WRITES))
def test_a_write_outside_any_load_is_refused_by_name(name: str, door: str) -> None:
    write, op = WRITES[name]
    layer, x = _loaded()
    graph, out = _captured(layer, x)
    assert _native.get().observer_doors() == (door,)  # type: ignore[union-attr]
    graph.replay()
    out.fill_(123.0)  # a replay would overwrite this
    write(layer)
    with pytest.raises(gs.StaleError, match=rf"w_t: w written by {op}\S* {SEEN}"):
        graph.replay()
    assert torch.equal(out, torch.full((2, 4), 123.0))  # nothing was replayed
    gs.runtime(layer).refresh_stale()
    graph.replay()
    assert torch.equal(out, _expected(layer, x))


@needs_native
@pytest.mark.parametrize("name", list(WRITES))
def test_a_write_outside_any_load_is_repaired_with_refresh(name: str) -> None:
    write, _ = WRITES[name]
    layer, x = _loaded()
    graph, out = _captured(layer, x, on_stale="refresh")
    before = out.clone()
    write(layer)
    graph.replay()
    assert torch.equal(out, _expected(layer, x)) and not torch.equal(out, before)


@pytest.mark.parametrize("name", list(WRITES))
def test_control_an_unguarded_graph_replays_the_write_stale(name: str) -> None:
    write, _ = WRITES[name]
    layer, x = _loaded()
    graph, out = _captured(layer, x, guard=False)
    old, version = out.clone(), layer.w._version
    write(layer)
    graph.replay()  # no error...
    assert torch.equal(out, old)
    assert not torch.equal(out, _expected(layer, x))  # ...and wrong
    assert layer.w._version == version  # nothing the witnesses read moved


@pytest.mark.parametrize("name", list(WRITES))
def test_control_with_the_observer_off_a_guarded_graph_replays_the_write_stale(
    name: str, observer_off: None
) -> None:
    write, _ = WRITES[name]
    layer, x = _loaded()
    graph, out = _captured(layer, x)
    old = out.clone()
    write(layer)
    graph.replay()  # what the guard did before the observer: no error, stale
    assert torch.equal(out, old) and not torch.equal(out, _expected(layer, x))
    assert not OBSERVER.running


def test_a_thread_a_loader_starts_is_tracked_as_part_of_its_load() -> None:
    layer, x = _loaded()
    graph, out = _captured(layer, x)
    _loader_thread(layer)  # the thread's direct copy is the load's: refreshed at its end
    graph.replay()
    assert torch.equal(out, _expected(layer, x))
    # Control: the same copy from a thread no load started is a write outside any load.
    _plain_thread(layer)
    if OBSERVER.running:
        with pytest.raises(gs.StaleError, match=rf"w_t: w written by aten::copy_\S* {SEEN}"):
            graph.replay()
    else:  # without the compiled build there is no observer: the stale replay is the
        graph.replay()  # documented boundary
        assert not torch.equal(out, _expected(layer, x))


@needs_native
def test_a_healthy_sequence_is_never_refused() -> None:
    layer, x = _loaded()
    graph, out = _captured(layer, x)
    rt = gs.runtime(layer)
    for step in range(3):
        layer.load_weights([("w", torch.randn(4, 6))])  # tracked
        graph.replay()
        assert torch.equal(out, _expected(layer, x)), step
        layer.load_weights([("w", torch.randn(4, 6))], worker="joins")  # a worker joins
        graph.replay()
        assert torch.equal(out, _expected(layer, x)), step
        # A write seen before a refresh is one that refresh read: the replay is fresh.
        layer.w.data.copy_(torch.randn(4, 6))
        rt.refresh()
        graph.replay()
        assert torch.equal(out, _expected(layer, x)), step
        layer.w.data.mul_(2.0)
        rt.refresh_stale()
        graph.replay()
        assert torch.equal(out, _expected(layer, x)), step
        with gs.weight_update(layer):
            layer.w.data.copy_(torch.randn(4, 6))
        graph.replay()
        assert torch.equal(out, _expected(layer, x)), step
        layer.load_state_dict({"w": torch.randn(4, 6), "bias": torch.zeros(4)})
        graph.replay()
        assert torch.equal(out, _expected(layer, x)), step
        # Writes no derivation reads: into a buffer of the model, and a tensor apart.
        layer.bias.data.add_(1.0)
        x.data.add_(1.0)
        graph.replay()
        assert torch.equal(out, _expected(layer, x)), step
    assert rt.stale == ()
    # Control: the observer is on here, and sees the write no refresh followed.
    layer.w.data.copy_(torch.randn(4, 6))
    with pytest.raises(gs.StaleError, match=rf"w written by aten::copy_ {SEEN}"):
        graph.replay()


@needs_native
def test_a_refresh_writing_derived_buffers_is_not_an_observed_write() -> None:
    layer, x = _loaded()
    graph, out = _captured(layer, x)
    buffer = storage_key(layer.w_t)
    gs.runtime(layer).refresh()  # writes w_t, in a quiet scope
    JOURNAL.sync()
    assert "observer" not in JOURNAL.how_written(buffer)
    graph.replay()
    assert torch.equal(out, _expected(layer, x))
    # Control: the same write, by the user, is seen.
    layer.w_t.data.zero_()
    with pytest.raises(gs.StaleError, match=rf"derived buffer w_t written by aten::zero_ {SEEN}"):
        graph.replay()
    assert "observer" in JOURNAL.how_written(buffer)


@needs_native
def test_a_load_tracked_by_the_python_tracker_is_not_observed() -> None:
    """Loads with transient inputs (and `GRAPHSAFE_NATIVE=0`) track with the dispatch mode:
    it marks its thread as inside a tracked load too."""
    layer, x = _loaded()
    graph, _ = _captured(layer, x)  # pins it while `graph` lives
    native = _native.get()
    assert native is not None and OBSERVER.running
    JOURNAL.sync()
    with WriteTracker({storage_key(layer.w): "w"}) as tracker:
        layer.w.data.add_(1.0)
    assert tracker.written == {storage_key(layer.w)}
    assert not native.observer_pending()
    layer.w.data.add_(1.0)  # control: outside it, the same write is observed
    assert native.observer_pending()
    graph.reset()


@needs_native
def test_the_observer_stays_on_while_another_model_is_pinned() -> None:
    (a, x), (b, _) = _loaded(), _loaded()
    graph_a, _ = _captured(a, x)
    graph_b, out_b = _captured(b, x)
    graph_a.reset()
    assert OBSERVER.running
    b.w.data.copy_(torch.randn(4, 6))
    with pytest.raises(gs.StaleError, match=rf"w written by aten::copy_ {SEEN}"):
        graph_b.replay()
    a.w.data.copy_(torch.randn(4, 6))  # a is not pinned: no graph of it to refuse
    gs.runtime(b).refresh()
    graph_b.replay()
    assert torch.equal(out_b, _expected(b, x))


@needs_native
def test_ops_seen_to_write_nothing_hide_no_write(door: str) -> None:
    """The callback rejects an op it has seen write nothing before reading anything else,
    from a table every thread shares; the kernels never see such an op. Either way the
    overload of the same op that writes (`out=`), the same ops in another thread, and an
    op that writes registered after the table filled (the kernels: after they covered
    every op) are still seen. Control: the ops that write nothing are never noted."""
    layer, x = _loaded()
    graph, _ = _captured(layer, x)
    native = _native.get()
    assert native is not None and OBSERVER.running
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    JOURNAL.sync()
    for _ in range(3):  # aten::add.Tensor and aten::mul.Tensor: in the table now
        torch.mul(torch.add(a, b), b)
    assert not native.observer_pending()  # control: nothing they did is noted
    torch.add(a, b, out=layer.w.data)
    with pytest.raises(gs.StaleError, match=rf"w written by aten::add\.out {SEEN}"):
        graph.replay()
    gs.runtime(layer).refresh_stale()

    def in_a_thread() -> None:
        for _ in range(3):
            torch.mul(torch.add(a, b), b)
        torch.mul(a, b, out=layer.w.data)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    with pytest.raises(gs.StaleError, match=rf"w written by aten::mul\.out {SEEN}"):
        graph.replay()
    gs.runtime(layer).refresh_stale()

    # An op registered now (the table is emptied) that writes its argument.
    lib = torch.library.Library("graphsafe_test_observer", "FRAGMENT")
    lib.define("scale_(Tensor(a!) x, float s) -> ()")

    def scale_(t: torch.Tensor, s: float) -> None:
        t.mul_(s)

    lib.impl("scale_", scale_, "CompositeExplicitAutograd")
    try:
        torch.mul(a, b)
        torch.ops.graphsafe_test_observer.scale_(layer.w.data, 3.0)
        with pytest.raises(gs.StaleError, match=rf"w written by graphsafe_test_observer::"
                           rf"scale_ {SEEN}"):
            graph.replay()
    finally:
        lib._destroy()


@needs_native
def test_each_of_many_watched_storages_is_seen_and_no_other(door: str) -> None:
    """The watched storages are a flat hash set, probed once per written storage: with
    many of them watched, a write into any one is seen. Control: writes into the storages
    beside them, which no derivation reads, are not."""
    layers = [_loaded()[0] for _ in range(48)]
    x = torch.randn(2, 6)
    graphs = [_captured(layer, x)[0] for layer in layers]  # each pins its layer
    watched = [storage_key(layer.w) for layer in layers]
    apart = [storage_key(layer.bias) for layer in layers]
    JOURNAL.sync()
    before = JOURNAL.epochs_of(watched + apart)
    for layer in layers:
        layer.w.data.add_(1.0)
        layer.bias.data.add_(1.0)
    JOURNAL.sync()
    after = JOURNAL.epochs_of(watched + apart)
    seen = [b != a for a, b in zip(before, after)]
    assert seen == [True] * len(watched) + [False] * len(apart)
    for graph in graphs:
        graph.reset()


@needs_native
def test_the_benchmarks_floor_callback_notes_nothing_and_leaves_the_observer_be() -> None:
    """`observer_floor` (figure 8's do-nothing callback, with inputs or without) sees no
    write, and the observer beside it still does. Control: the same write with the
    observer on instead is noted."""
    layer, x = _loaded()
    graph, _ = _captured(layer, x)
    native = _native.get()
    assert native is not None
    JOURNAL.sync()
    was = gs.observe_writes(False)
    try:
        for inputs in (True, False):
            native.observer_floor(True, inputs)
            layer.w.data.add_(1.0)
            assert not native.observer_pending()  # the floor noted nothing
            native.observer_floor(False, False)
        gs.observe_writes(True)
        native.observer_floor(True, True)
        layer.w.data.add_(1.0)  # control: the observer, beside the floor, notes it
        assert native.observer_pending()
    finally:
        native.observer_floor(False, False)
        gs.observe_writes(was)
    with pytest.raises(gs.StaleError, match=rf"w written by aten::add_\S* {SEEN}"):
        graph.replay()


@needs_native
def test_with_record_function_off_the_kernels_see_writes_and_the_callback_fails_closed(
    door: str,
) -> None:
    """The kernels do not depend on RecordFunction: a write with it off is named. The
    callback sees no op then, and says it may have missed writes rather than name one
    (the control: that door is blind, the kernels are not)."""
    layer, x = _loaded()
    graph, out = _captured(layer, x)
    torch.autograd._enable_record_function(False)
    try:
        layer.w.data.copy_(torch.randn(4, 6))
        seen = rf"w written by aten::copy_ {SEEN}" if door == "kernels" else (
            "RecordFunction was turned off")
        with pytest.raises(gs.StaleError, match=seen):
            graph.replay()
    finally:
        torch.autograd._enable_record_function(True)
    gs.runtime(layer).refresh()
    graph.replay()
    assert torch.equal(out, _expected(layer, x))


_REFUSED = textwrap.dedent(
    """
    import os
    import warnings
    import torch
    import graphsafe as gs
    from graphsafe import _native
    from graphsafe._runtime.writes.observer import OBSERVER
    from test_observer import Layer

    native = _native.get()
    start = native.observer_start

    def refused(callback=False, alone=False):
        if not callback and os.environ["KERNELS"] == "refuse":
            raise RuntimeError("the dispatcher refused a kernel")
        return start(callback, alone)

    native.observer_start = refused
    layer = Layer()
    layer.load_weights([("w", torch.randn(4, 6))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = gs.Graph(backend="cpu", guard=layer)
        with torch.no_grad(), graph.capture():
            layer(torch.randn(2, 6))
    print(OBSERVER.door, *native.observer_doors())
    print(sum("could not place its kernels" in str(w.message) for w in caught))
    layer.w.data.copy_(torch.randn(4, 6))
    try:
        graph.replay()
        print("replayed")
    except gs.StaleError:
        print("refused")
    """
)


@needs_native
@pytest.mark.parametrize("refuse", [True, False])
def test_kernels_the_dispatcher_refuses_leave_the_callback_observing(refuse: bool) -> None:
    """A kernel the dispatcher refuses does not fail the capture: the callback observes,
    and a warning says what that costs. Control: kernels placed, no warning."""
    door, warned, replay = _run({"KERNELS": "refuse" if refuse else "place"}, _REFUSED)
    assert door == ("callback callback" if refuse else "kernels kernels")
    assert warned == ("1" if refuse else "0")
    assert replay == "refused"  # seen either way


_RACE = textwrap.dedent(
    """
    import threading
    import torch
    from graphsafe import _native
    from test_observer import _captured, _loaded

    native = _native.get()
    stop, errors = False, []

    def work():
        a, b = torch.zeros(64), torch.ones(64)
        try:
            while not stop:  # ops with torch's kernel at ADInplaceOrView, and one without
                a.add_(b)
                torch.mul(a, 0.5, out=a)
                torch._foreach_add_([a], 1.0)
        except Exception as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(2)]
    for w in workers:
        w.start()
    layer, x = _loaded()
    for _ in range(150):  # the first pin places the kernels, each last unpin stops them
        graph, _ = _captured(layer, x)
        graph.reset()
    kept = native.observer_kernels()
    stop = True
    for w in workers:
        w.join()
    graph, _ = _captured(layer, x)
    graph.reset()  # alone now
    print(len(errors), kept > 1000, native.observer_kernels())
    """
)


@needs_native
def test_kernels_stay_idle_while_other_threads_run_ops_and_go_when_alone() -> None:
    """Taking a kernel back while another thread dispatches its op makes that thread run
    a fallthrough kernel (an internal assert of torch's, seen in 150 unpins with two
    threads running `_foreach_add_`) or a kernel being freed: the last unpin takes them
    back only where no other thread runs. Control: alone, it takes them back."""
    errors, kept, after = _run({}, _RACE)[-1].split()
    assert errors == "0" and kept == "True"  # idle, not taken back, under the threads
    assert after == "0"  # alone: torch's own kernels are back


@gs.graphsafe
class Packed(nn.Module):
    """Nothing declared: its load packs `w` (found by the recorded bring-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6), requires_grad=False)

    def load_weights(self, w: torch.Tensor) -> None:
        self.w.copy_(w)
        if "packed" in vars(self):
            self.packed.copy_(self.w.t())  # in place: a graph may read it
        else:
            self.packed = self.w.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.packed


@needs_native
def test_a_watched_tensor_made_in_inference_mode_is_observed_through_the_callback() -> None:
    """Tensors made in inference mode skip ADInplaceOrView, so the kernels cannot see them
    written (in inference mode): while one is watched, the callback observes instead. It
    is the first use of graphsafe in a fresh process (`test_native`), in inference mode."""
    code = textwrap.dedent(
        """
        import torch
        import graphsafe as gs
        from graphsafe import _native
        from graphsafe._memory.journal import JOURNAL
        from test_observer import Packed

        with torch.inference_mode():
            m = Packed()
            m.load_weights(torch.randn(4, 6))
            native = _native.get()
            print(native is not None, m.w.is_inference())
            graph = gs.Graph(backend="cpu", guard=m)
            x = torch.randn(2, 6)
            with graph.capture():
                out = m(x)
            print(*native.observer_doors())
            m.w.copy_(torch.randn(4, 6))
            try:
                graph.replay()
                print("replayed")
            except gs.StaleError as e:
                print("refused", "aten::copy_ outside any tracked load" in str(e))
            m.load_weights(torch.randn(4, 6))
            graph.replay()
            print(torch.equal(out, x @ m.w.t().contiguous()))
            JOURNAL.sync()
            print(native.observer_start(False))  # control: the kernels alone
            m.w.copy_(torch.randn(4, 6))
            print(native.observer_pending())
        """
    )
    loaded, door, refused, fresh, kernels, pending = _run({}, code)
    assert loaded == "True True" and door == "callback"
    assert refused == "refused True" and fresh == "True"
    assert kernels == "kernels" and pending == "False"  # the kernels do not see it


@torch.library.custom_op("graphsafe_test_kernels::twice_", mutates_args=["t"])
def _twice_(t: torch.Tensor) -> None:
    t.mul_(2.0)


def _writes_and_versions() -> tuple[list[float], int, list[float], int]:
    """In-place, `out=`, foreach and custom-op writes of one tensor, and a fused AdamW
    step: the values written and the versions they moved."""
    t = torch.ones(4)
    before = t._version
    t.add_(1.0)
    torch.mul(t, 2.0, out=t)
    torch._foreach_add_([t], 1.0)
    _twice_(t)
    p = torch.ones(4)
    version = p._version
    torch._fused_adamw_([p], [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)], [],
                        [torch.tensor(1.0)], lr=0.1, beta1=0.9, beta2=0.999,
                        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    return t.tolist(), t._version - before, p.tolist(), p._version - version


@needs_native
def test_the_kernels_call_the_kernels_they_replaced_and_go_away() -> None:
    """Each op that writes gets a kernel at ADInplaceOrView, which notes what it writes and
    calls the kernel the op had there, or goes below where it had none: every write
    moves the versions torch's own kernels move (autograd still refuses an in-place
    write of a tensor saved for backward), a custom op's own kernel there included.
    Unpinned, torch's own kernels are back. Control: torch's counts, taken first; a
    kernel that bumped a version twice, or not at all, would differ."""
    native = _native.get()
    assert native is not None
    pinned_before = OBSERVER.running
    torchs = _writes_and_versions() if not pinned_before else None
    layer, x = _loaded()
    graph, _ = _captured(layer, x)
    try:
        assert native.observer_doors() == ("kernels",)
        ours = _writes_and_versions()
        assert torchs is None or ours == torchs
        assert ours[1] >= 4 and ours[3] == 0  # `_fused_adamw_` moves none
        y = torch.ones(3, requires_grad=True) * 2
        z = y.exp()  # saves its result for backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.add_(1.0)
            z.sum().backward()
        JOURNAL.sync()
        layer.w.data.add_(1.0)
        assert native.observer_pending()  # what they note
    finally:
        graph.reset()
    if not pinned_before:  # no other test's model is pinned: torch's own kernels, or
        assert native.observer_doors() == ()  # ours idle (another thread runs)
        assert _writes_and_versions() == torchs


@needs_native
def test_an_op_defined_again_while_observed_is_covered_again() -> None:
    """An op registered while the kernels observe is seen by the callback (the bridge)
    until the next call from Python covers it; one deregistered loses its kernel, and
    defined again (another schema, the same name) gets a new one: no kernel of the old
    op is called."""
    native = _native.get()
    assert native is not None
    layer, x = _loaded()
    graph, _ = _captured(layer, x)
    JOURNAL.sync()
    for schema, at in (("put_(Tensor(a!) x, float s) -> ()", 0),
                       ("put_(float s, Tensor(a!) x) -> ()", 1)):
        lib = torch.library.Library("graphsafe_test_again", "FRAGMENT")
        lib.define(schema)

        def put_(*args: object, _at: int = at) -> None:
            t = args[_at]
            assert isinstance(t, torch.Tensor)
            t.fill_(7.0)

        lib.impl("put_", put_, "CompositeExplicitAutograd")
        try:
            assert native.observer_doors() == ("kernels", "bridge")
            args: list[object] = [3.0, 3.0]
            args[at] = layer.w.data
            torch.ops.graphsafe_test_again.put_(*args)
            assert torch.equal(layer.w, torch.full((4, 6), 7.0))
            with pytest.raises(gs.StaleError, match=rf"graphsafe_test_again::put_ {SEEN}"):
                graph.replay()  # its drain covered it
            assert native.observer_doors() == ("kernels",)
            torch.ops.graphsafe_test_again.put_(*args)  # through its kernel now
            assert native.observer_pending()
            gs.runtime(layer).refresh()
        finally:
            lib._destroy()
    graph.reset()


_SCRIPT = textwrap.dedent(
    """
    import warnings
    import torch
    import graphsafe as gs
    from test_observer import Layer

    warnings.simplefilter("always")
    layer = Layer()
    layer.load_weights([("w", torch.randn(4, 6))])
    x = torch.randn(2, 6)
    with warnings.catch_warnings(record=True) as caught:
        graphs = [gs.Graph(backend="cpu", guard=layer) for _ in range(2)]
        for graph in graphs:
            with torch.no_grad(), graph.capture():
                out = layer(x)
    print(sum(issubclass(w.category, gs.GraphSafetyWarning) for w in caught))
    print(*{str(w.message) for w in caught})
    layer.w.data.copy_(torch.randn(4, 6))
    try:
        graphs[1].replay()
        print("replayed", torch.equal(out, (x @ layer.w.t().contiguous() + layer.bias).detach()))
    except gs.StaleError:
        print("refused")
    """
)


def _run(env: dict[str, str], script: str = _SCRIPT) -> list[str]:
    """`script`'s lines of output, run in a fresh process with `env` added."""
    here = Path(__file__).resolve().parent
    path = os.pathsep.join(
        p for p in (str(here), str(here.parent), os.environ.get("PYTHONPATH", "")) if p
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
        check=False, env={**os.environ, "PYTHONPATH": path, **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_without_the_compiled_build_the_first_pin_warns_once() -> None:
    count, message, replay = _run({"GRAPHSAFE_NATIVE": "0"})
    assert count == "1"
    assert "process-wide write observer needs the compiled build" in message
    assert "graphsafe native build" in message
    assert "threads a recorded bring-up does not follow" in message  # said once, with it
    assert replay == "replayed False"  # the write went unseen, as the warning says


def test_control_with_the_observer_switched_off_nothing_warns() -> None:
    lines = _run({"GRAPHSAFE_NATIVE": "0", "GRAPHSAFE_OBSERVER": "0"})
    assert lines[0] == "0"


@needs_native
def test_the_environment_switch_turns_it_off() -> None:
    assert _run({"GRAPHSAFE_OBSERVER": "0"})[-1] == "replayed False"  # today's behaviour
    assert _run({})[-1] == "refused"  # control: on by default


_UNPIN = textwrap.dedent(
    """
    import gc
    import torch
    import graphsafe as gs
    from graphsafe import _native
    from graphsafe._memory.journal import JOURNAL
    from graphsafe._memory.walk import storage_key
    from graphsafe._runtime.writes.observer import OBSERVER
    from test_observer import Layer

    native = _native.get()
    layer = Layer()
    layer.load_weights([("w", torch.randn(4, 6))])
    key = storage_key(layer.w)
    print(OBSERVER.running, native.observer_running())
    graph = gs.Graph(backend="cpu", guard=layer)
    with torch.no_grad(), graph.capture():
        layer(torch.randn(2, 6))
    print(OBSERVER.running, native.observer_running())
    layer.w.data.add_(1.0)
    JOURNAL.sync()
    epoch = JOURNAL.epochs_of([key])
    print("observer" in JOURNAL.how_written(key))
    graph.reset()  # the last pin of the process
    print(OBSERVER.running, native.observer_running())
    layer.w.data.add_(1.0)
    JOURNAL.sync()
    print(JOURNAL.epochs_of([key]) == epoch)
    graph = gs.Graph(backend="cpu", guard=layer)
    with torch.no_grad(), graph.capture():
        layer(torch.randn(2, 6))
    JOURNAL.sync()
    epoch = JOURNAL.epochs_of([key])
    layer.w.data.add_(1.0)  # seen, not yet recorded, when the graph is dropped
    del graph
    gc.collect()  # its finalizer releases the pin: the callback stops, the write is kept
    running = OBSERVER.running
    JOURNAL.sync()
    print(running, JOURNAL.epochs_of([key]) != epoch)
    """
)


@needs_native
def test_unpinning_stops_the_callback() -> None:
    """In a process of its own, so that no other test's pinned model keeps it on."""
    before, pinned, seen, after, unchanged, dropped = _run({}, _UNPIN)
    assert before == "False False" and pinned == "True True"
    assert seen == "True"  # control: a write is recorded while pinned...
    assert after == "False False" and unchanged == "True"  # ...and not after the last unpin
    # A dropped graph releases its pin in a finalizer: the callback stops there too, and
    # what it saw before is still recorded.
    assert dropped == "False True"
