"""State an engine derives from its weights without declaring it is found, and guarded.

`Engine` below is written the way serving engines are: its loader copies the weights,
then a post-load step computes kernel-layout copies and keeps them wherever it likes (an
attribute, a kernel object, a closure, a `functools.partial`, a handle made by a custom
op). Nothing is declared. A bare sync (the RL path: `load_weights(..., post=False)`)
writes the weights and skips the post-load step, so every copy goes stale; the guarded
replay must refuse it by name, and each control replays the same capture unguarded and
reads the stale copy.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe._lineage import record_lineage

C = 4
_PACKED: dict[int, torch.Tensor] = {}  # the custom ops' kernel state: handle -> packed


@torch.library.custom_op("gstest::make_handle", mutates_args=())
def make_handle(w: torch.Tensor) -> int:
    """A kernel library's handle: the packed weight lives behind an int."""
    key = len(_PACKED) + 1
    _PACKED[key] = w.t().contiguous()
    return key


@torch.library.custom_op("gstest::handle_mm", mutates_args=())
def handle_mm(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return x @ _PACKED[int(handle.item())]


@handle_mm.register_fake
def _(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


class Kernel:
    def __init__(self, w: torch.Tensor) -> None:
        self.packed = w.t().contiguous()  # [C, C]


class Handler:
    def __init__(self, w: torch.Tensor) -> None:
        self.handle = torch.tensor(make_handle(w), dtype=torch.int64)


def _post_attr(m: Engine) -> None:
    m.lin.packed = m.lin.weight.t().contiguous()


def _post_kernel(m: Engine) -> None:
    m.lin.kernel = Kernel(m.lin.weight)


def _post_closure(m: Engine) -> None:
    packed = m.lin.weight.t().contiguous()
    m.lin.kernel_fn = lambda x: x @ packed


def _post_partial(m: Engine) -> None:
    m.lin.kernel_fn = functools.partial(torch.matmul, other=m.lin.weight.t().contiguous())


def _post_handle(m: Engine) -> None:
    handler = Handler(m.lin.weight)
    m.lin.kernel_fn = lambda x: handle_mm(x, handler.handle)


def _post_int_handle(m: Engine) -> None:
    # The op's int kept as a Python int, never put in a tensor: the kernel's argument.
    m.lin.int_handle = make_handle(m.lin.weight)


def _run_int_handle(m: Engine, x: torch.Tensor) -> torch.Tensor:
    return x @ _PACKED[m.lin.int_handle]  # type: ignore[no-any-return]


def _post_on_parameter(m: Engine) -> None:
    # Kept on the nn.Parameter object itself, as engines keep quantization state.
    m.lin.weight.packed = m.lin.weight.t().contiguous()


def _post_buffer(m: Engine) -> None:
    # A buffer the checkpoint does not hold, made from the weight: no load refills it.
    m.lin.register_buffer("packed", m.lin.weight.t().contiguous(), persistent=False)


def _post_new_parameter(m: Engine) -> None:
    # A parameter of a name no checkpoint holds, made from the weight (vLLM's post-load
    # steps register such kernel-layout copies): no load writes it.
    m.lin.packed = nn.Parameter(m.lin.weight.t().contiguous(), requires_grad=False)


def _run_on_parameter(m: Engine, x: torch.Tensor) -> torch.Tensor:
    return x @ m.lin.weight.packed  # type: ignore[no-any-return]


def _run_attr(m: Engine, x: torch.Tensor) -> torch.Tensor:
    return x @ m.lin.packed  # type: ignore[no-any-return]


def _run_kernel(m: Engine, x: torch.Tensor) -> torch.Tensor:
    return x @ m.lin.kernel.packed  # type: ignore[no-any-return]


def _run_apply(m: Engine, x: torch.Tensor) -> torch.Tensor:
    return m.lin.kernel_fn(x)  # type: ignore[no-any-return]


Post = Callable[["Engine"], None]
Run = Callable[["Engine", torch.Tensor], torch.Tensor]
CASES: list[tuple[Post, Run, str]] = [
    (_post_attr, _run_attr, "lin.packed"),
    (_post_kernel, _run_kernel, "lin.kernel.packed"),
    (_post_closure, _run_apply, "lin.kernel_fn.<closure packed>"),
    (_post_partial, _run_apply, "lin.kernel_fn.keywords.other"),
    (_post_handle, _run_apply, "lin.kernel_fn.<closure handler>.handle"),
    (_post_on_parameter, _run_on_parameter, "lin.weight.packed"),
    (_post_buffer, _run_attr, "lin.packed"),
    (_post_new_parameter, _run_attr, "lin.packed"),
    (_post_int_handle, _run_int_handle, "lin.int_handle"),
]
IDS = ["attribute", "kernel-object", "closure", "partial", "handle", "on-the-parameter",
       "non-persistent-buffer", "new-parameter", "int-handle"]
RECOMPUTABLE = [c for c, i in zip(CASES, IDS, strict=True) if not i.endswith("handle")]


@gs.graphsafe
class Engine(nn.Module):
    """An engine-style model: a loader, and a post-load step nobody declared."""

    def __init__(self, post: Post, run: Run) -> None:
        super().__init__()
        self.lin: Any = nn.Linear(C, C, bias=False)
        self.post, self.run = post, run
        self.rope = torch.zeros(C)

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        if post:
            self.post(self)
            with torch.no_grad():  # from the config only: no weight feeds it
                self.rope.copy_(torch.arange(C, dtype=torch.float32).cos())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self, x) + self.rope


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {"lin.weight": torch.randn(C, C, generator=torch.Generator().manual_seed(seed))}


def _reference(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x @ weights["lin.weight"].t() + torch.arange(C, dtype=torch.float32).cos()


def _captured(case: tuple[Post, Run, str], *, guard: bool) -> tuple[Engine, gs.Graph,
                                                                      torch.Tensor]:
    m = Engine(case[0], case[1])
    m.load_weights(_weights(0))
    g = gs.Graph(backend="cpu", guard=m if guard else None)
    with torch.no_grad(), g.capture():
        y = m(torch.ones(2, C))
    return m, g, y


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_what_the_post_load_step_derived_is_discovered_with_its_source(
    case: tuple[Post, Run, str],
) -> None:
    m = Engine(case[0], case[1])
    m.load_weights(_weights(0))
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {case[2]}  # not the rope cache: no weight feeds it
    d = found[case[2]]
    assert d.sources == ("lin.weight",)
    assert d.chain.startswith("lin.weight -> ")
    assert d.opaque == (case[2].endswith("handle"))
    assert d.stale is None and d.exempt is None


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_bare_sync_leaves_it_stale_and_the_replay_is_refused_by_name(
    case: tuple[Post, Run, str],
) -> None:
    m, g, _ = _captured(case, guard=True)
    m.load_weights(_weights(1), post=False)  # the weights only: no post-load step
    with pytest.raises(gs.StaleError) as info:
        g.replay()
    assert info.value.paths == (case[2],)
    message = str(info.value)
    assert case[2] in message and "lin.weight" in message
    assert "written by Engine.load_weights" in message
    assert "post-load" in message and "exempt" in message


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_control_unguarded_the_replay_reads_the_stale_copy(
    case: tuple[Post, Run, str],
) -> None:
    m, g, y = _captured(case, guard=False)
    new = _weights(1)
    m.load_weights(new, post=False)
    g.replay()
    x = torch.ones(2, C)
    assert torch.allclose(y, _reference(_weights(0), x))  # the old weights' output
    assert not torch.allclose(y, _reference(new, x))


@pytest.mark.parametrize("case", RECOMPUTABLE, ids=[i for i in IDS if not i.endswith("handle")])
def test_the_full_load_with_its_post_load_step_replays_exactly(
    case: tuple[Post, Run, str],
) -> None:
    m = Engine(case[0], case[1])
    m.load_weights(_weights(0))
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = m(torch.ones(2, C))
    # Re-derived in place: the post-load step writes into what it made the first time.
    m.post = _rederive_in_place(case[2])
    new = _weights(1)
    m.load_weights(new)
    g.replay()
    assert torch.allclose(y, _reference(new, torch.ones(2, C)))
    assert all(d.stale is None for d in gs.runtime(m).discovered)


def _rederive_in_place(path: str) -> Post:
    def post(m: Engine) -> None:
        held = _held(m, path)
        with torch.no_grad():
            held.copy_(m.lin.weight.t())

    return post


def _held(m: Engine, path: str) -> torch.Tensor:
    from graphsafe._memory.walk import walk_tensors

    return next(s.tensor for s in walk_tensors(m) if s.path == path)


def test_rebuilt_on_every_load_without_a_graph_is_no_false_alarm() -> None:
    m = Engine(_post_kernel, _run_kernel)
    m.load_weights(_weights(0))
    old = m.lin.kernel.packed
    new = _weights(1)
    m.load_weights(new)  # a new kernel object, from the new weights
    assert m.lin.kernel.packed is not old
    gs.runtime(m).assert_fresh()
    assert [d.stale for d in gs.runtime(m).discovered] == [None]
    assert torch.allclose(m(torch.ones(2, C)), _reference(new, torch.ones(2, C)))


def test_rebuilt_after_capture_is_a_moved_storage() -> None:
    m, g, _ = _captured(CASES[1], guard=True)
    m.load_weights(_weights(1))  # the post-load step makes a new kernel object
    with pytest.raises(gs.StorageMovedError, match=re.escape("lin.kernel")):
        g.replay()


def test_a_stale_copy_the_graph_does_not_read_blocks_nothing() -> None:
    m = Engine(_post_kernel, lambda m, x: x @ m.lin.weight.t())  # reads the weight only
    m.load_weights(_weights(0))
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = m(torch.ones(2, C))
    new = _weights(1)
    m.load_weights(new, post=False)
    g.replay()  # the kernel's copy is stale, but no graph reads it
    assert torch.allclose(y, _reference(new, torch.ones(2, C)))
    (d,) = gs.runtime(m).discovered
    assert d.path == "lin.kernel.packed" and d.stale is not None
    with pytest.raises(gs.StaleError):  # a check of the whole model still sees it
        gs.runtime(m).assert_fresh()


def test_control_without_a_read_set_the_same_stale_copy_blocks() -> None:
    m = Engine(_post_kernel, lambda m, x: x @ m.lin.weight.t())
    m.load_weights(_weights(0))
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        m(torch.ones(2, C))
    assert g._guard is not None
    g._guard.reads = None  # as a graph whose reads are unknown (compiled code ran)
    m.load_weights(_weights(1), post=False)
    with pytest.raises(gs.StaleError, match=re.escape("lin.kernel.packed")):
        g.replay()


def test_a_deliberately_frozen_copy_once_exempted_replays() -> None:
    m, g, y = _captured(CASES[0], guard=True)
    rt = gs.runtime(m)
    with pytest.raises(gs.GraphSafetyError, match="reason"):
        rt.exempt("lin.packed", why=" ")
    with pytest.raises(gs.GraphSafetyError, match="discovered"):
        rt.exempt("lin.nothing", why="frozen")
    rt.exempt("lin.packed", why="a teacher copy, frozen on purpose")
    m.load_weights(_weights(1), post=False)
    g.replay()  # exempted: the frozen copy is what the graph is meant to read
    assert torch.allclose(y, _reference(_weights(0), torch.ones(2, C)))
    (d,) = rt.discovered
    assert d.exempt == "a teacher copy, frozen on purpose" and d.stale is not None


def test_an_in_place_write_through_the_weight_outside_any_load_is_seen() -> None:
    m, g, _ = _captured(CASES[0], guard=True)
    with torch.no_grad():
        m.lin.weight.mul_(2)  # its version counter moves
    with pytest.raises(gs.StaleError, match=re.escape("lin.packed")):
        g.replay()


def test_adopted_copies_are_refreshed_in_place_by_a_repairing_replay() -> None:
    m = Engine(_post_partial, _run_apply)
    m.load_weights(_weights(0))
    (d,) = gs.runtime(m).adopt()
    assert d.adopted and d.refused is None
    g = gs.Graph(backend="cpu", guard=m, on_stale="refresh")
    with torch.no_grad(), g.capture():
        y = m(torch.ones(2, C))
    new = _weights(1)
    m.load_weights(new, post=False)
    g.replay()
    assert torch.allclose(y, _reference(new, torch.ones(2, C)))
    assert gs.runtime(m).discovered[0].stale is None


def test_control_not_adopted_a_repairing_replay_still_refuses() -> None:
    m = Engine(_post_partial, _run_apply)
    m.load_weights(_weights(0))
    g = gs.Graph(backend="cpu", guard=m, on_stale="refresh")
    with torch.no_grad(), g.capture():
        m(torch.ones(2, C))
    m.load_weights(_weights(1), post=False)
    with pytest.raises(gs.StaleError, match=re.escape("lin.kernel_fn.keywords.other")):
        g.replay()


def test_a_handle_is_refused_for_adoption_and_says_why() -> None:
    m = Engine(_post_handle, _run_apply)
    m.load_weights(_weights(0))
    (d,) = gs.runtime(m).adopt()
    assert not d.adopted and d.refused is not None and "handle" in d.refused


def test_an_impure_chain_is_refused_for_adoption() -> None:
    def post(m: Engine) -> None:
        m.lin.packed = m.lin.weight.t() + torch.rand(C, C)  # not a function of the weight

    m = Engine(post, _run_attr)
    m.load_weights(_weights(0))
    (d,) = gs.runtime(m).adopt()
    assert not d.adopted and d.refused is not None and "bitwise" in d.refused


def test_the_first_load_of_an_engine_recorded_before_the_model_was_known() -> None:
    with record_lineage() as lineage:  # an engine builds and loads before graphsafe sees it
        m = Engine(_post_kernel, _run_kernel)
        with torch.no_grad():
            m.lin.weight.copy_(_weights(0)["lin.weight"])
        m.post(m)
    rt = gs.runtime(m)
    rt.adopt_lineage(lineage)
    assert [d.path for d in rt.discovered] == ["lin.kernel.packed"]
    m.load_weights(_weights(1), post=False)
    with pytest.raises(gs.StaleError, match=re.escape("lin.kernel.packed")):
        rt.assert_fresh()


def test_a_declared_derivation_is_not_discovered_again() -> None:
    reg = gs.Registry()

    @reg.derive(nn.Linear, "packed", inputs=["weight"])
    def packed(m: nn.Module, w: torch.Tensor, *, out: Any = None) -> torch.Tensor:
        return w.t().contiguous() if out is None else out.copy_(w.t())

    m = Engine(lambda m: None, _run_attr)
    gs.runtime(m, reg)
    m.load_weights(_weights(0))
    assert gs.runtime(m).discovered == ()
    assert gs.runtime(m).stale == ()


@gs.graphsafe
class Buffered(nn.Module):
    """Buffers registered up front (`persistent=False`: no checkpoint holds them), which
    the post-load step fills in place: one from the weight, one from the config only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.register_buffer("packed", torch.zeros(C, C), persistent=False)
        self.register_buffer("cos", torch.zeros(C), persistent=False)

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
            if post:
                self.packed.copy_(self.lin.weight.t())
                self.cos.copy_(torch.arange(C, dtype=torch.float32).cos())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.packed + self.cos


def _buffered(*, guard: bool) -> tuple[Buffered, gs.Graph, torch.Tensor]:
    m = Buffered()
    m.load_weights(_weights(0))
    g = gs.Graph(backend="cpu", guard=m if guard else None)
    with torch.no_grad(), g.capture():
        y = m(torch.ones(2, C))
    return m, g, y


def test_a_buffer_filled_in_place_from_the_weights_is_discovered_and_guarded() -> None:
    m, g, y = _buffered(guard=True)
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {"packed"}  # not `cos`: no weight feeds it
    assert found["packed"].sources == ("lin.weight",)
    m.load_weights(_weights(1), post=False)
    with pytest.raises(gs.StaleError, match=r"packed[\s\S]*lin\.weight"):
        g.replay()
    m.load_weights(_weights(2))  # the post-load step fills it again, in place
    g.replay()
    assert torch.allclose(y, _reference(_weights(2), torch.ones(2, C)))


def test_control_unguarded_the_buffer_filled_once_replays_stale() -> None:
    m, g, y = _buffered(guard=False)
    new = _weights(1)
    m.load_weights(new, post=False)
    g.replay()
    assert not torch.allclose(y, _reference(new, torch.ones(2, C)))


def test_a_declared_derived_buffer_is_not_discovered_as_a_buffer_made_by_the_load() -> None:
    reg = gs.Registry()

    @reg.derive(Buffered, "twice", inputs=["lin.weight"])
    def twice(m: nn.Module, w: torch.Tensor, *, out: Any = None) -> torch.Tensor:
        return 2 * w if out is None else out.copy_(2 * w)

    m = Buffered()
    gs.runtime(m, reg)
    m.load_weights(_weights(0))
    assert {d.path for d in gs.runtime(m).discovered} == {"packed"}


@gs.graphsafe
class LazyInit(nn.Module):
    """A loader that creates its parameters as it loads them (lazy initialisation), from
    the checkpoint's values only: weights, not derived state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, w in weights.items():
            self.lin.register_parameter(name.split(".")[-1], nn.Parameter(
                torch.empty_like(w), requires_grad=False))
            with torch.no_grad():
                self.get_parameter(name).copy_(w)
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)  # from no weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.lin.weight.t() * self.scale


def test_parameters_a_loader_creates_from_checkpoint_values_are_weights() -> None:
    m = LazyInit()
    m.load_weights(_weights(0))
    assert gs.runtime(m).discovered == ()
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = m(torch.ones(2, C))
    new = _weights(1)
    with torch.no_grad():
        m.lin.weight.copy_(new["lin.weight"])
    g.replay()
    assert torch.allclose(y, torch.ones(2, C) @ new["lin.weight"].t())


def _probe(handle: torch.Tensor | int, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The handle's kernel on a probe input, against the reference over its weight now
    (the handle in a tensor, or the int itself)."""
    x = torch.randn(3, C, generator=torch.Generator().manual_seed(5))
    if isinstance(handle, int):
        handle = torch.tensor(handle)
    return handle_mm(x, handle), x @ args[0].t()


def test_the_audit_finds_every_stale_copy_by_name_and_probes_handles() -> None:
    gs.register_probe("gstest.make_handle", _probe, atol=1e-6, rtol=1e-5)
    models = [Engine(post, run) for post, run, _ in CASES]
    for m in models:
        m.load_weights(_weights(0))
        report = gs.audit(m)
        assert report.discovered == tuple(d.path for d in gs.runtime(m).discovered)
        assert report.unchecked == ()
    for m, (_, _, path) in zip(models, CASES):
        m.load_weights(_weights(1), post=False)
        with pytest.raises(gs.StaleError) as info:
            gs.audit(m)
        assert info.value.paths == (path,)


def test_control_a_handle_without_a_probe_is_listed_unchecked() -> None:
    from graphsafe._lineage.probes import PROBES

    saved = PROBES.pop("gstest.make_handle", None)
    try:
        m = Engine(_post_handle, _run_apply)
        m.load_weights(_weights(0))
        with pytest.warns(gs.GraphSafetyWarning, match="checked nothing"):
            report = gs.audit(m)  # nothing can check it: said, not passed
        assert [u.path for u in report.unchecked] == ["lin.kernel_fn.<closure handler>.handle"]
        assert "probe" in report.unchecked[0].why
        m.load_weights(_weights(1), post=False)
        # Its source written since and the post-load step not re-run: the guard holds it
        # stale, and the audit says so rather than listing it unchecked.
        with pytest.raises(gs.StaleError, match=r"handle[\s\S]*held stale by the guard"):
            gs.audit(m)
    finally:
        if saved is not None:
            PROBES["gstest.make_handle"] = saved


def test_a_source_made_anew_without_a_graph_leaves_the_copy_stale() -> None:
    m = Engine(_post_kernel, _run_kernel)
    m.load_weights(_weights(0))
    m.lin.weight = nn.Parameter(_weights(1)["lin.weight"])  # a reload that rebinds
    with pytest.raises(gs.StaleError, match="rebound") as info:
        gs.runtime(m).assert_fresh()
    assert info.value.paths == ("lin.kernel.packed",)


def test_a_script_write_into_a_source_while_pinned_is_caught() -> None:
    from graphsafe._runtime.writes.observer import OBSERVER

    m, g, _ = _captured(CASES[1], guard=True)
    m.lin.weight.data.copy_(_weights(1)["lin.weight"])  # no load, no version counter
    if OBSERVER.running:  # the compiled build's observer journals it: the guard refuses
        with pytest.raises(gs.StaleError, match=re.escape("lin.kernel.packed")):
            g.replay()
    else:  # the Python path: invisible to the guard, visible to the audit
        g.replay()
    with pytest.raises(gs.StaleError) as info:
        gs.audit(m)
    assert info.value.paths == ("lin.kernel.packed",)


def test_only_the_first_load_is_recorded_unless_every_load_is_asked_for() -> None:
    """A later load is followed, not recorded: what it makes in a new place is found with
    its sources, not its ops (it cannot be adopted); every load recorded gives the ops;
    with provenance off, nothing is found."""
    from graphsafe._lineage.record.recorder import RECORDING

    def late(m: Engine) -> None:  # the post-load step runs from the second load on
        if getattr(m, "loads", 0) >= 1:
            m.lin.packed = m.lin.weight.t().contiguous()
        m.loads = getattr(m, "loads", 0) + 1

    def run(mode: str) -> gs.Runtime:
        saved, RECORDING[0] = RECORDING[0], mode
        try:
            m = Engine(late, _run_attr)
            m.load_weights(_weights(0))
            m.load_weights(_weights(0))
        finally:
            RECORDING[0] = saved
        rt = gs.runtime(m)
        rt.adopt()
        rt.model_kept = m  # type: ignore[attr-defined]  # the runtime holds it weakly
        return rt

    (followed,) = run("first").discovered
    assert (followed.path, followed.sources) == ("lin.packed", ("lin.weight",))
    assert followed.chain.startswith("lin.weight -> ...")
    assert "a later load that was not recorded" in (followed.refused or "")
    (recorded,) = run("all").discovered
    assert (recorded.path, recorded.chain) == ("lin.packed", "lin.weight -> aten.clone")
    assert recorded.adopted
    assert run("off").discovered == ()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_what_is_discovered_does_not_keep_the_model_alive(case: tuple[Post, Run, str]) -> None:
    import gc
    import weakref

    m = Engine(case[0], case[1])
    m.load_weights(_weights(0))
    assert gs.runtime(m).discovered
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


_LIB = torch.library.Library("gstest_implicit", "DEF")
_LIB.define("make_handle(Tensor w) -> int")


def _implicit_handle(w: torch.Tensor) -> int:
    """Python above the dispatcher: only the int it returns carries the weight."""
    key = len(_PACKED) + 1
    _PACKED[key] = w.t().contiguous()
    return key


_LIB.impl("make_handle", _implicit_handle, "CompositeImplicitAutograd")


def test_a_handle_from_an_op_no_dispatch_mode_sees_is_discovered() -> None:
    # Registered CompositeImplicitAutograd (as vLLM's create_onednn_mm_handler is): the
    # op decomposes above the dispatcher, and `torch.tensor(<int>)` dispatches nothing.
    def post(m: Engine) -> None:
        handle = torch.tensor(torch.ops.gstest_implicit.make_handle(m.lin.weight.t()),
                              dtype=torch.int64)
        m.lin.kernel_fn = lambda x: handle_mm(x, handle)

    m = Engine(post, _run_apply)
    m.load_weights(_weights(0))
    (d,) = gs.runtime(m).discovered
    assert d.path == "lin.kernel_fn.<closure handle>" and d.opaque
    assert d.sources == ("lin.weight",)
    m.load_weights(_weights(1), post=False)
    with pytest.raises(gs.StaleError, match=re.escape("lin.kernel_fn.<closure handle>")):
        gs.runtime(m).assert_fresh()


def test_an_item_read_during_the_load_is_no_handle() -> None:
    def post(m: Engine) -> None:
        n = int(m.lin.weight.abs().argmax().item()) % 3 + 1  # an int from a weight
        m.lin.packed = m.lin.weight.t().contiguous()
        m.lin.count = torch.tensor(n, dtype=torch.int64)  # a config-like int, not derived

    m = Engine(post, _run_attr)
    m.load_weights(_weights(0))
    assert [d.path for d in gs.runtime(m).discovered] == ["lin.packed"]


def test_a_model_with_declared_and_discovered_state_is_freed_whole() -> None:
    import gc
    import weakref

    import graphsafe.models.deepseek_v4 as dsv4

    config = dsv4.DeepseekV4Config.preset("tiny")
    m = dsv4.DeepseekV4Model(config)
    with gs.weight_update(m):
        m.load_weights(dsv4.random_checkpoint(config, seed=0))
        for module in m.modules():  # a post-load step: packed copies on every layer
            w = module._parameters.get("weight")
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                module.packed = w.detach().t().contiguous()
    assert gs.runtime(m).discovered and gs.runtime(m).derivations
    refs = [weakref.ref(m), *(weakref.ref(x) for x in m.modules())]
    del m, module, w
    gc.collect()
    assert all(r() is None for r in refs)  # no runtime keeps a submodule (or itself) alive


# -- checks no test held before (each planted bug survived the suite) -------------------


def test_state_derived_from_a_staging_copy_of_a_weight_is_discovered_from_that_weight(
) -> None:
    def post(m: Engine) -> None:  # the loader's own staging copy, packed after the copy in
        m.lin.packed = m._staged.t().contiguous()

    @gs.graphsafe
    class Staging(Engine):
        def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True
                         ) -> None:
            staged = weights["lin.weight"].to(torch.float32).clone()  # the staging copy
            with torch.no_grad():
                self.lin.weight.copy_(staged)
            self._staged = staged
            if post:
                self.post(self)
            del self._staged

    m = Staging(post, _run_attr)
    m.load_weights(_weights(0))
    found = {d.path: d.sources for d in gs.runtime(m).discovered}
    assert found == {"lin.packed": ("lin.weight",)}  # the staging copy stands for its weight


def test_the_audit_of_a_copy_re_derived_in_place_does_not_write_into_it() -> None:
    def post(m: Engine) -> None:
        if "packed" in vars(m.lin):
            m.lin.packed.copy_(m.lin.weight.t())  # re-derived in place, positionally
        else:
            m.lin.packed = m.lin.weight.t().contiguous()

    m = Engine(post, _run_attr)
    m.load_weights(_weights(0))
    m.load_weights(_weights(1))  # the second load re-derives in place
    m.load_weights(_weights(2), post=False)
    held = m.lin.packed.clone()
    with pytest.raises(gs.StaleError, match=r"lin\.packed"):
        gs.audit(m)  # a recompute that wrote into `packed` would pass
    assert torch.equal(m.lin.packed, held)


def test_the_observer_runs_when_only_discovered_state_is_pinned() -> None:
    from graphsafe import _native
    from graphsafe._runtime.writes.observer import OBSERVER

    m, g, _ = _captured(CASES[0], guard=True)  # nothing declared: only discovered state
    assert gs.runtime(m).derivations == ()
    assert OBSERVER.running == (_native.get() is not None)
    if not OBSERVER.running:
        return  # the Python path has no observer (the pin warned)
    m.lin.weight.data.copy_(_weights(1)["lin.weight"])  # a script write, no load
    with pytest.raises(gs.StaleError, match=r"lin\.packed"):
        g.replay()


def test_a_tensor_held_as_a_keyword_only_default_is_discovered() -> None:
    def post(m: Engine) -> None:
        made = m.lin.weight.t().contiguous()

        def kernel(x: torch.Tensor, *, packed: torch.Tensor = made) -> torch.Tensor:
            return x @ packed

        del made  # held by the default alone

        m.lin.kernel_fn = kernel

    m = Engine(post, _run_apply)
    m.load_weights(_weights(0))
    assert [d.path for d in gs.runtime(m).discovered] == ["lin.kernel_fn.__kwdefaults__.packed"]
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        m(torch.ones(2, C))
    m.load_weights(_weights(1), post=False)
    with pytest.raises(gs.StaleError, match=r"__kwdefaults__\.packed"):
        g.replay()


def test_runtime_stale_lists_stale_discovered_state_too() -> None:
    m, _graph, _ = _captured(CASES[0], guard=True)
    assert gs.runtime(m).stale == ()
    m.load_weights(_weights(1), post=False)
    assert gs.runtime(m).stale == ("lin.packed",)  # before: () while the replay refused
    gs.runtime(m).exempt("lin.packed", why="frozen on purpose")
    assert gs.runtime(m).stale == ()


def test_a_registry_added_after_capture_is_refused_as_such() -> None:
    m, graph, _ = _captured(CASES[0], guard=True)  # the graph holds the pin
    with pytest.raises(gs.RegistrationError, match=r"added after graph capture") as info:
        gs.runtime(m, gs.Registry())
    assert not isinstance(info.value, gs.StorageMovedError)  # nothing moved
    graph.reset()  # released: the registry can be added
    gs.runtime(m, gs.Registry())


def test_a_closure_cell_emptied_after_capture_is_refused_by_name() -> None:
    """`del` of a closure's variable leaves an empty cell, which raises ValueError when
    read: the guard reports the tensor as removed, never the raw error. Control: the same
    graph replays while the cell holds the tensor."""
    m, g, _ = _captured(CASES[2], guard=True)
    g.replay()  # the control: held, nothing refused
    del m.lin.kernel_fn.__closure__[0].cell_contents
    with pytest.raises(gs.StorageMovedError,
                       match=r"lin\.kernel_fn\.<closure packed> was removed after graph capture"):
        g.replay()
