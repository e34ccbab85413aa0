"""Write tracking at the dispatcher (`graphsafe._runtime.writes.tracking`).

Each test of what a tracker sees runs with both trackers: `WriteTracker` (a Python
dispatch mode) and `NativeWriteTracker` (a compiled RecordFunction callback, used by
loads when `graphsafe native build` has run).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from graphsafe import _native
from graphsafe._runtime.writes.tracking import NativeWriteTracker, WriteTracker, storage_key

Tracker = WriteTracker | NativeWriteTracker


@pytest.fixture(params=["python", "native"])
def tracker(request: pytest.FixtureRequest) -> Callable[[dict[int, str]], Tracker]:
    """Makes a tracker of either kind over the watched storage keys."""
    if request.param == "python":
        return WriteTracker
    native = _native_library()
    return lambda watched: NativeWriteTracker(watched, native)  # type: ignore[arg-type]


def _native_library() -> object:
    """The compiled library, built if need be (the test skips where no C++ compiler is)."""
    try:
        _native.build()
    except _native.NativeBuildError as exc:  # no C++ compiler on this machine
        pytest.skip(f"the compiled tracker cannot be built here: {exc}")
    native = _native.loader._load()
    assert native is not None
    return native


def _param() -> nn.Parameter:
    return nn.Parameter(torch.arange(6.0).reshape(2, 3))


def test_param_data_copy_is_seen_although_version_does_not_move(
    tracker: Callable[[dict[int, str]], Tracker],
) -> None:
    p = _param()
    version = p._version
    with tracker({storage_key(p): "p"}) as seen:
        p.data.copy_(torch.ones(2, 3))
    assert seen.written == {storage_key(p)}
    assert torch.equal(p, torch.ones(2, 3))
    # Why graphsafe cannot track by version counter: this real write left it unchanged.
    assert p._version == version


def test_control_version_counter_moves_only_for_writes_through_the_parameter() -> None:
    # The same write through the parameter itself does bump the version: a tracker based
    # on `_version` would see this loader and miss the `.data.copy_` one above.
    p = _param()
    version = p._version
    with torch.no_grad():
        p.copy_(torch.ones(2, 3))
    assert p._version > version


WRITES: dict[str, Callable[[torch.Tensor], object]] = {
    "data.copy_": lambda t: t.data.copy_(torch.ones_like(t)),
    "mul_": lambda t: t.data.mul_(2.0),
    "zero_": lambda t: t.data.zero_(),
    "out=": lambda t: torch.add(t.data, 1.0, out=t.data),
    "index_assign": lambda t: t.data.__setitem__((0, 1), 7.0),
    "view_copy_": lambda t: t.data.view(-1)[2:4].copy_(torch.zeros(2)),
    "foreach": lambda t: torch._foreach_add_([t.data], 1.0),
    "init.normal_": lambda t: nn.init.normal_(t.data),
    "set_": lambda t: t.data.set_(torch.zeros(2, 3)),
}


@pytest.mark.parametrize("op", sorted(WRITES))
def test_every_kind_of_write_is_seen(
    op: str, tracker: Callable[[dict[int, str]], Tracker]
) -> None:
    p = _param()
    key = storage_key(p)
    with tracker({key: "p"}) as seen:
        WRITES[op](p)
    assert seen.written == {key}


def test_reads_and_unwatched_writes_are_not_reported(
    tracker: Callable[[dict[int, str]], Tracker],
) -> None:
    p = _param()
    other = torch.zeros(2, 3)
    with tracker({storage_key(p): "p"}) as seen:
        _ = p.sum(), p + 1, p.clone(), p.t().contiguous()
        torch.add(p.detach(), 1.0, out=other)  # reads p, writes other
        other.mul_(3.0)
    assert seen.written == set()


def test_control_the_same_writes_into_a_watched_tensor_are_reported(
    tracker: Callable[[dict[int, str]], Tracker],
) -> None:
    # Pairs the test above: the tracker is not simply blind.
    p = _param()
    other = torch.zeros(2, 3)
    with tracker({storage_key(other): "other"}) as seen:
        torch.add(p.detach(), 1.0, out=other)
    assert seen.written == {storage_key(other)}


def test_writes_in_another_thread_are_not_this_trackers(
    tracker: Callable[[dict[int, str]], Tracker],
) -> None:
    """Both trackers are the thread's own (a load's worker threads join it with a
    tracker of their own); control: the same write in this thread is seen."""
    p = _param()
    key = storage_key(p)
    with tracker({key: "p"}) as seen:
        worker = threading.Thread(target=lambda: p.data.mul_(2.0))
        worker.start()
        worker.join()
        assert seen.written == set()
        p.data.mul_(2.0)
    assert seen.written == {key}


def test_an_overload_that_writes_is_told_from_one_that_does_not(
    tracker: Callable[[dict[int, str]], Tracker],
) -> None:
    """`aten::add.Tensor` writes nothing and `aten::add.out` writes its `out`: an op seen
    first must not decide for its other overloads. Control: the functional add alone
    is not reported."""
    p = _param()
    key = storage_key(p)
    with tracker({key: "p"}) as seen:
        _ = torch.add(p.data, 1.0)
    assert seen.written == set()
    with tracker({key: "p"}) as seen:
        _ = torch.add(p.data, 1.0)
        torch.add(p.data, 1.0, out=p.data)
    assert seen.written == {key}


def test_nested_trackers_both_see_a_write(
    tracker: Callable[[dict[int, str]], Tracker],
) -> None:
    p, q = _param(), _param()
    with tracker({storage_key(p): "p"}) as outer, tracker({storage_key(q): "q"}) as inner:
        p.data.zero_()
        q.data.zero_()
    assert outer.written == {storage_key(p)} and inner.written == {storage_key(q)}


def test_the_compiled_tracker_fails_closed_when_record_function_is_off() -> None:
    """With torch's RecordFunction off, the compiled tracker cannot see ops: it reports
    every watched storage as written, so a load refreshes everything rather than miss a
    write. Control: with it on, only what was written is reported."""
    native = _native_library()
    p, q = _param(), _param()
    watched = {storage_key(p): "p", storage_key(q): "q"}
    on = NativeWriteTracker(watched, native)  # type: ignore[arg-type]
    with on:
        p.data.zero_()
    assert on.written == {storage_key(p)}
    off = NativeWriteTracker(watched, native)  # type: ignore[arg-type]
    torch.autograd._enable_record_function(False)
    try:
        with off:
            p.data.zero_()
    finally:
        torch.autograd._enable_record_function(True)
    assert off.written == set(watched)


def test_on_write_runs_before_the_write_and_can_refuse_it() -> None:
    p = _param()
    before = p.detach().clone()
    seen: list[str] = []

    def refuse(key: int, op: str) -> None:
        seen.append(op)
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"), WriteTracker(
        {storage_key(p): "p"}, refuse
    ):
        p.data.mul_(10.0)
    assert torch.equal(p, before)
    assert seen and "mul_" in seen[0]


def test_control_without_on_write_the_write_happens() -> None:
    p = _param()
    with WriteTracker({storage_key(p): "p"}):
        p.data.mul_(10.0)
    assert torch.equal(p, torch.arange(6.0).reshape(2, 3) * 10.0)


def test_storage_key_is_shared_by_views_and_differs_between_storages() -> None:
    t = torch.zeros(4, 4)
    assert storage_key(t[1:, 2]) == storage_key(t) == storage_key(t.t())
    assert storage_key(t.clone()) != storage_key(t)
    assert storage_key(torch.empty(0)) == 0


def test_tracker_does_not_change_results() -> None:
    a = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with WriteTracker({storage_key(a): "a"}):
        inside = (a @ a.t()).softmax(-1)
    assert torch.equal(inside, (a @ a.t()).softmax(-1))


# -----------------------------------------------------------------------------
# c10d: through the dispatcher, and on a bare backend object


@pytest.fixture
def gloo_group() -> Iterator[dist.ProcessGroup]:
    """A one-process gloo group, destroyed after the test."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not built here")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["dist.broadcast", "ProcessGroup.broadcast", "bare backend"])
def test_a_broadcast_is_seen_through_the_dispatcher_and_not_on_a_bare_backend(
    path: str,
    tracker: Callable[[dict[int, str]], Tracker],
    gloo_group: dist.ProcessGroup,
) -> None:
    p = _param()
    backend = gloo_group._get_backend(torch.device("cpu"))
    broadcast: dict[str, Callable[[torch.Tensor], object]] = {
        "dist.broadcast": lambda t: dist.broadcast(t, src=0),
        "ProcessGroup.broadcast": lambda t: gloo_group.broadcast(t, 0).wait(),
        # The ProcessGroupGloo object itself: a C++ call, no op reaches the dispatcher.
        "bare backend": lambda t: backend.broadcast([t]).wait(),
    }
    with tracker({storage_key(p): "p"}) as seen:
        broadcast[path](p.data)
    assert seen.written == (set() if path == "bare backend" else {storage_key(p)})


def test_control_a_bare_backend_writes_and_no_tracker_sees_it(
    tracker: Callable[[dict[int, str]], Tracker], gloo_group: dist.ProcessGroup
) -> None:
    # One process cannot show a broadcast's bytes landing; a scatter from rank 0 to
    # itself can: the bare backend really writes, unseen, and `dist.scatter`'s same
    # write is seen.
    backend = gloo_group._get_backend(torch.device("cpu"))
    opts = dist.ScatterOptions()
    opts.rootRank = 0
    bare, through = torch.zeros(3), torch.zeros(3)
    src = torch.arange(1.0, 4.0)
    with tracker({storage_key(bare): "bare", storage_key(through): "through"}) as seen:
        backend.scatter([bare], [[src]], opts).wait()
        dist.scatter(through, [src], src=0)
    assert torch.equal(bare, src) and torch.equal(through, src)
    assert seen.written == {storage_key(through)}


def _derive(w: torch.Tensor, other: torch.Tensor) -> dict[str, torch.Tensor | float]:
    """Values computed from `w` through each way an op reaches the dispatcher (a method,
    a boxed `torch.ops` call, a composite op, a number taken out), among ops over `other`
    only; and what those ops return."""
    with torch.no_grad():
        out: dict[str, torch.Tensor | float] = {"plain": other * 2}
        out["method"] = w * 2  # an unboxed call
        out["after"] = other + 1  # an op over nothing derived, after one that is
        out["boxed"] = torch.ops.aten.mul.Tensor(w, 3)
        out["composite"] = w.t().contiguous()
        out["number"] = w[0, 1].item()
        out["last"] = other.neg()
    return out


def test_results_computed_from_the_weights_are_tainted_whatever_call_made_them(
    tracker: Callable[[dict[int, str]], Tracker]
) -> None:
    """Only the ops whose inputs reach the weights hand their results to the compiled
    tracker (it asks for them op by op): each such result is tainted, through a method,
    a boxed call and a composite op, and a number taken from them is noted; the results
    of the ops around them, over nothing derived, are not."""
    w, other = torch.randn(3, 4), torch.randn(3, 4)
    seen = tracker({})
    seen.taint(frozenset((storage_key(w),)))
    with seen:
        out = _derive(w, other)
    tainted = seen.tainted()
    derived = {name for name, t in out.items()
               if isinstance(t, torch.Tensor) and storage_key(t) in tainted}
    assert derived == {"method", "boxed", "composite"}
    assert {tainted[storage_key(out[n])][0] for n in derived} == {(storage_key(w),)}  # type: ignore[arg-type]
    assert [t.value for t in seen.taken()] == [out["number"]]


def test_control_results_computed_from_no_weight_are_not_tainted(
    tracker: Callable[[dict[int, str]], Tracker]
) -> None:
    """The same ops, the tracker following another tensor's derivations: nothing they
    return is tainted, and no number is noted."""
    w, other, weight = torch.randn(3, 4), torch.randn(3, 4), torch.randn(2)
    seen = tracker({})
    seen.taint(frozenset((storage_key(weight),)))
    with seen:
        _derive(w, other)
    assert seen.tainted() == {} and seen.taken() == []


def test_trackers_of_one_watched_set_report_each_its_own_writes(
    tracker: Callable[[frozenset[int]], Tracker],
) -> None:
    # Load after load over one watched set, as a model's loads are: the compiled tracker
    # hands back the set it gave last time when the same storages were written; each of
    # these must still be told exactly, whatever the load before it wrote.
    model = nn.Module()
    model.a, model.b = _param(), _param()
    model.register_buffer("running", torch.zeros(4))  # a buffer, not a parameter
    a, b, running = (storage_key(t) for t in (model.a, model.b, model.running))
    watched = frozenset((a, b, running))
    loads: list[tuple[str, Callable[[], object], set[int]]] = [
        ("every input", lambda: [t.data.fill_(1.0) for t in (model.a, model.b, model.running)],
         {a, b, running}),
        ("every input again", lambda: [t.data.fill_(2.0) for t in (model.a, model.b,
                                                                   model.running)],
         {a, b, running}),
        ("none", lambda: model.a.sum(), set()),
        ("one", lambda: model.a.data.copy_(torch.ones(2, 3)), {a}),
        ("another one", lambda: model.b.data.copy_(torch.ones(2, 3)), {b}),
        ("one written twice", lambda: (model.b.data.zero_(), model.b.data.add_(1.0)), {b}),
        ("through a view", lambda: model.a.data.view(-1)[2:].fill_(3.0), {a}),
        ("a buffer", lambda: model.running.add_(1.0), {running}),
        ("two of three", lambda: (model.a.data.zero_(), model.running.zero_()), {a, running}),
        ("another two of three", lambda: (model.b.data.zero_(), model.running.zero_()),
         {b, running}),
        ("every input at the end", lambda: [t.data.fill_(1.0) for t in (model.a, model.b,
                                                                       model.running)],
         {a, b, running}),
    ]
    with torch.no_grad():
        for name, load, expected in loads:
            with tracker(watched) as seen:
                load()
            assert seen.written == expected, name


def test_the_compiled_tracker_gives_the_same_set_back_only_for_the_same_writes() -> None:
    native = _native_library()
    a, b = _param(), _param()
    watched = frozenset((storage_key(a), storage_key(b)))
    sets = []
    for t in (a, a, None, a, b, a):
        with NativeWriteTracker(watched, native) as seen:  # type: ignore[arg-type]
            if t is not None:
                t.data.fill_(1.0)
        sets.append(seen.written)
    ka, kb = storage_key(a), storage_key(b)
    assert sets == [{ka}, {ka}, set(), {ka}, {kb}, {ka}]
    assert sets[1] is sets[0]  # the same writes: the set of the tracker before
    assert sets[3] is sets[0]  # a load that wrote nothing in between leaves it
    assert sets[4] is not sets[3] and sets[5] is not sets[3]  # control: other writes
