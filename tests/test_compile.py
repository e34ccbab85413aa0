"""graphsafe models under `torch.compile`, as serving engines run them.

Engines compile the model, then load weights again and again (RL refits), and often
capture the compiled forward as a graph. Checked here, with the default backend
(inductor) on the CPU:

- bucketed `gs.weight_update` refits reach the compiled model (weights and derived
  buffers), with zero recompilations after the first call, counted by dynamo's own
  counters (`frames.total`: frames dynamo had to convert; `stats.unique_graphs`: graphs
  it compiled);
- a `gs.Graph(backend="cpu", guard=model)` over the compiled model captures, and replays
  refits correctly;
- what a rebinding loader (`param.data = w`, a derived tensor bound afresh) does: dynamo
  does not guard on a tensor's identity or address, so it neither recompiles nor reads
  stale memory; a graph captured over the compiled model does read stale memory, and
  graphsafe's errors (the pinned runtime, the guard) come before any such replay.

Inductor compiles C++ kernels with the host compiler, seconds per graph on two cores:
the flagship runs with one layer and two Sinkhorn iterations (the same code paths as the
"tiny" preset, a fraction of its graph). The CUDA tests ("cuda" in their names; they skip
without a device) compile with `mode="reduce-overhead"`, torch's own CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import graphsafe as gs
from graphsafe.models.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4Model,
    NaiveDeepseekV4Model,
    random_checkpoint,
)

M, C = 6, 8  # rows and width of the small model's weight


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch (the on-disk kernel caches stay warm), so that no
    test runs on code another compiled, or past dynamo's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiles() -> tuple[int, int]:
    """(frames dynamo converted, graphs it compiled) so far in this process."""
    return counters["frames"]["total"], counters["stats"]["unique_graphs"]


def first_call(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Call `fn` once, checking that it compiled (so the counters watch real work)."""
    before = compiles()
    with torch.no_grad():
        out = fn()
    after = compiles()
    assert after[0] > before[0] and after[1] > before[1], "the first call did not compile"
    return out


# -----------------------------------------------------------------------------
# a small model, its pre-fix twin, and a rebinding loader


@gs.graphsafe
class Small(nn.Module):
    """`tanh(x @ (w * s)^T)`, with `w * s` a derived buffer of two parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(M, C), requires_grad=False)
        self.s = nn.Parameter(torch.ones(M), requires_grad=False)

    @gs.derive("ws", inputs=["w", "s"])
    def _ws(
        self, w: torch.Tensor, s: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.mul(w, s[:, None], out=out)  # [M, C]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.ws.t())  # [T, M]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            gs.load_into(params[name], w, name=name)


@gs.graphsafe
class RebindingSmall(Small):
    """The same model with the pre-fix loader idiom: every parameter bound afresh."""

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data = w.to(params[name].device).clone()


class NaiveSmall(nn.Module):
    """Not graphsafe: rebinding loader, and `ws` bound afresh after every load."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(M, C), requires_grad=False)
        self.s = nn.Parameter(torch.ones(M), requires_grad=False)
        self.ws: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.ws is not None
        return torch.tanh(x @ self.ws.t())  # [T, M]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data = w.to(params[name].device).clone()
        self.ws = self.w * self.s[:, None]  # the bug: a new tensor on every load


def checkpoint(seed: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ck = [("w", torch.randn(M, C, generator=g)), ("s", 0.5 + torch.rand(M, generator=g))]
    return [(name, t.to(device)) for name, t in ck]


def expected(ck: list[tuple[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The forward computed from the checkpoint alone."""
    w, s = dict(ck)["w"], dict(ck)["s"]
    return torch.tanh(x @ (w * s[:, None]).t())


def refit(model: nn.Module, ck: list[tuple[str, torch.Tensor]]) -> None:
    """A bucketed weight sync: one entry per bucket, one refresh at the end."""
    with gs.weight_update(model):
        for entry in ck:
            model.load_weights([entry])


def small(cls: type[nn.Module], device: str = "cpu") -> nn.Module:
    with torch.device(device):
        model = cls()
    model.load_weights(checkpoint(0, device))
    return model


# -----------------------------------------------------------------------------
# refits under compile


def test_compiled_model_follows_bucketed_refits_without_recompiling() -> None:
    model = small(Small)
    compiled = torch.compile(model)
    x = torch.randn(3, C)
    previous = first_call(lambda: compiled(x))
    assert torch.allclose(previous, expected(checkpoint(0), x), atol=1e-6)
    after_first = compiles()
    for seed in (1, 2, 3):
        refit(model, checkpoint(seed))
        with torch.no_grad():
            out = compiled(x)
        assert torch.allclose(out, expected(checkpoint(seed), x), atol=1e-6)
        assert not torch.allclose(out, previous, atol=1e-3)  # the refit changed the output
        previous = out
    assert compiles() == after_first


def test_control_a_write_nothing_tracks_leaves_the_compiled_model_stale() -> None:
    """The check above can fail: weights written where graphsafe cannot see them
    (`.data.copy_` outside any load) leave the derived buffer, and the output, old."""
    model = small(Small)
    compiled = torch.compile(model)
    x = torch.randn(3, C)
    old = first_call(lambda: compiled(x))
    with torch.no_grad():
        for name, w in checkpoint(1):
            getattr(model, name).data.copy_(w)
        out = compiled(x)
    assert torch.equal(out, old)
    assert not torch.allclose(out, expected(checkpoint(1), x), atol=1e-3)


def test_control_the_counters_see_a_recompile() -> None:
    """The zero-recompile check can fail: a rebinding loader handed a float64 checkpoint
    changes the dtype dynamo guards on, and the counters grow (`gs.load_into` would
    have refused the entry)."""
    model = small(NaiveSmall)
    compiled = torch.compile(model)
    x = torch.randn(3, C)
    first_call(lambda: compiled(x))
    after_first = compiles()
    model.load_weights([(name, w.double()) for name, w in checkpoint(1)])
    with torch.no_grad():
        out = compiled(x.double())
    assert torch.allclose(out, expected(checkpoint(1), x).double(), atol=1e-6)
    assert compiles()[0] > after_first[0]
    with pytest.raises(gs.WeightLoadError, match=r"'w' has the wrong dtype"):
        small(Small).load_weights([("w", checkpoint(1)[0][1].double())])


# -----------------------------------------------------------------------------
# a graph captured over the compiled model


def capture(
    model: nn.Module, fn: Callable[[], torch.Tensor], guard: bool
) -> tuple[gs.Graph, torch.Tensor]:
    g = gs.Graph(backend="cpu", guard=model if guard else None)
    with torch.no_grad(), g.capture(warmup=fn):
        out = fn()
    return g, out


def test_graph_over_a_compiled_model_replays_refits() -> None:
    model = small(Small)
    compiled = torch.compile(model)
    x = torch.randn(3, C)
    first_call(lambda: compiled(x))
    after_first = compiles()
    g, out = capture(model, lambda: compiled(x), guard=True)
    for seed in (1, 2):
        refit(model, checkpoint(seed))
        g.replay()
        assert torch.allclose(out, expected(checkpoint(seed), x), atol=1e-6)
    x.copy_(torch.randn(3, C))
    g.replay()
    assert torch.allclose(out, expected(checkpoint(2), x), atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(compiled(x), out, atol=1e-6)
    assert compiles() == after_first


# -----------------------------------------------------------------------------
# rebinding under compile


@pytest.mark.parametrize("cls", [RebindingSmall, NaiveSmall], ids=["graphsafe", "naive"])
def test_rebinding_before_capture_neither_recompiles_nor_reads_stale(
    cls: type[nn.Module],
) -> None:
    """Dynamo guards a module's tensors on dtype, shape and stride, not on identity or
    address: tensors bound afresh are read at the next call, with no recompile, in the
    graphsafe model (which recomputes `ws` in place) and in the naive one alike."""
    x = torch.randn(3, C)
    model = small(cls)
    compiled = torch.compile(model)
    first_call(lambda: compiled(x))
    after_first = compiles()
    w, ws = model.w, model.ws
    w_ptr = w.data_ptr()
    if cls is RebindingSmall:
        refit(model, checkpoint(1))
    else:
        model.load_weights(checkpoint(1))
    with torch.no_grad():
        assert torch.allclose(compiled(x), expected(checkpoint(1), x), atol=1e-6)
    assert compiles() == after_first
    assert model.w is w and model.w.data_ptr() != w_ptr  # the parameter was rebound
    assert (model.ws is ws) == (cls is RebindingSmall)  # graphsafe refreshed it in place


def test_rebinding_after_capture_raises_before_a_stale_replay() -> None:
    model = small(RebindingSmall)
    compiled = torch.compile(model)
    x = torch.randn(3, C)
    first_call(lambda: compiled(x))
    after_first = compiles()
    g, out = capture(model, lambda: compiled(x), guard=True)
    old = out.clone()
    with pytest.raises(
        gs.StorageMovedError, match=r"pinned tensor\(s\) were rebound(.|\n)*tensor: +w"
    ):
        refit(model, checkpoint(1))  # the pinned runtime refuses at the end of the load
    # The graph reads the derived buffer, not `w` itself: the buffer is what is refused.
    with pytest.raises(gs.StaleError, match=r"ws: 2 pinned tensor\(s\) were rebound(.|\n)*w, s"):
        g.replay()
    assert torch.equal(out, old)  # nothing replayed
    assert compiles() == after_first


def test_rebinding_a_derived_buffer_after_capture_raises_at_replay() -> None:
    model = small(Small)
    compiled = torch.compile(model)
    x = torch.randn(3, C)
    first_call(lambda: compiled(x))
    g, _ = capture(model, lambda: compiled(x), guard=True)
    model.ws = model.ws.clone()
    with pytest.raises(gs.StorageMovedError, match=r"ws was rebound after graph capture"):
        g.replay()


@pytest.mark.parametrize("guard", [False, True], ids=["unguarded", "guarded"])
def test_control_the_naive_model_replays_stale_and_the_guard_catches_it(guard: bool) -> None:
    """The pre-fix model under compile: called directly it is right (dynamo reads the
    new tensors), but a graph captured over it replays the old memory. A guard over the
    same model refuses."""
    x = torch.randn(3, C)
    model = small(NaiveSmall)
    compiled = torch.compile(model)
    first_call(lambda: compiled(x))
    after_first = compiles()
    g, out = capture(model, lambda: compiled(x), guard=guard)
    model.load_weights(checkpoint(1))
    with torch.no_grad():
        assert torch.allclose(compiled(x), expected(checkpoint(1), x), atol=1e-6)
    if guard:
        with pytest.raises(
            gs.StorageMovedError,
            match=r"ws was rebound after graph capture(.|\n)*module: +NaiveSmall",
        ):
            g.replay()
    else:
        g.replay()  # silently stale: the old weights' output
        assert torch.allclose(out, expected(checkpoint(0), x), atol=1e-6)
        assert not torch.allclose(out, expected(checkpoint(1), x), atol=1e-3)
    assert compiles() == after_first


# -----------------------------------------------------------------------------
# the flagship

FLAGSHIP = DeepseekV4Config.preset("tiny", num_layers=1, sinkhorn_iters=2)


def flagship_refit(model: nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A bucketed sync of the flagship, `hc_attn_fn` in the last bucket."""
    ck = random_checkpoint(FLAGSHIP, seed)
    last = [e for e in ck if e[0].endswith("hc_attn_fn")]
    rest = [e for e in ck if not e[0].endswith("hc_attn_fn")]
    with gs.weight_update(model):
        for bucket in (rest[::2], rest[1::2], last):
            model.load_weights(bucket)
    return ck


def flagship_eager(ck: list[tuple[str, torch.Tensor]], ids: torch.Tensor) -> torch.Tensor:
    """The forward of a freshly built, freshly loaded model: no state carried over."""
    fresh = DeepseekV4Model(FLAGSHIP)
    fresh.load_weights(ck)
    with torch.no_grad():
        return fresh(ids)


def test_compiled_flagship_refits_and_replays_without_recompiling() -> None:
    model = DeepseekV4Model(FLAGSHIP)
    model.load_weights(random_checkpoint(FLAGSHIP, seed=0))
    compiled = torch.compile(model)
    ids = torch.randint(FLAGSHIP.vocab_size, (8,), generator=torch.Generator().manual_seed(0))
    first_call(lambda: compiled(ids))
    after_first = compiles()
    for seed in (1, 2):
        ck = flagship_refit(model, seed)
        with torch.no_grad():
            out = compiled(ids)
        assert torch.allclose(out, flagship_eager(ck, ids), atol=1e-4)
    g, replayed = capture(model, lambda: compiled(ids), guard=True)
    ck = flagship_refit(model, 3)
    g.replay()
    assert torch.allclose(replayed, flagship_eager(ck, ids), atol=1e-4)
    assert compiles() == after_first
    layer = model.layers["0"]
    with pytest.raises(gs.StorageMovedError, match=r"hc_attn_fn"), gs.weight_update(model):
        layer.hc_attn_fn.data = layer.hc_attn_fn.data.clone()  # a rebinding loader
    # The graph reads the first layer's broadcast, not hc_attn_fn: that buffer is refused.
    with pytest.raises(gs.StaleError, match=r"hc_attn_fn_broadcast(.|\n)*rebound"):
        g.replay()


def test_control_compiled_naive_flagship_replays_stale() -> None:
    model = NaiveDeepseekV4Model(FLAGSHIP)
    model.load_weights(random_checkpoint(FLAGSHIP, seed=0))
    compiled = torch.compile(model)
    ids = torch.randint(FLAGSHIP.vocab_size, (8,), generator=torch.Generator().manual_seed(0))
    first_call(lambda: compiled(ids))
    after_first = compiles()
    g, replayed = capture(model, lambda: compiled(ids), guard=False)
    ck = random_checkpoint(FLAGSHIP, seed=1)
    model.load_weights(ck)
    with torch.no_grad():
        assert torch.allclose(compiled(ids), flagship_eager(ck, ids), atol=1e-4)
    g.replay()  # the old broadcast weight, silently
    assert not torch.allclose(replayed, flagship_eager(ck, ids), atol=1e-2)
    assert compiles() == after_first


# -----------------------------------------------------------------------------
# CUDA: mode="reduce-overhead" (torch's CUDA graphs), and a gs.Graph over compiled code

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cudagraph_skips() -> int:
    return counters["inductor"]["cudagraph_skips"]


@cuda
def test_reduce_overhead_cuda_small_model_follows_refits_without_recompiling() -> None:
    model = small(Small, "cuda")
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(3, C, device="cuda")
    skips = cudagraph_skips()
    first_call(lambda: compiled(x).clone())
    after_first = compiles()
    with torch.no_grad():
        for _ in range(2):  # warm-up run, then the recording
            compiled(x).clone()
    for seed in (1, 2, 3):
        refit(model, checkpoint(seed, "cuda"))
        with torch.no_grad():
            out = compiled(x).clone()
        assert torch.allclose(out, expected(checkpoint(seed, "cuda"), x), atol=1e-5)
    assert compiles() == after_first
    assert cudagraph_skips() == skips  # it really ran as CUDA graphs


@cuda
def test_reduce_overhead_cuda_flagship_follows_refits_without_recompiling() -> None:
    with torch.device("cuda"):
        model = DeepseekV4Model(FLAGSHIP)
    model.load_weights(random_checkpoint(FLAGSHIP, seed=0, device="cuda"))
    compiled = torch.compile(model, mode="reduce-overhead")
    ids = torch.arange(8, device="cuda")
    skips = cudagraph_skips()
    first_call(lambda: compiled(ids).clone())
    after_first = compiles()
    with torch.no_grad():
        for _ in range(2):
            compiled(ids).clone()
    for seed in (1, 2):
        ck = flagship_refit(model, seed)  # CPU entries into CUDA parameters
        with torch.no_grad():
            out = compiled(ids).clone()
        assert torch.allclose(out.cpu(), flagship_eager(ck, ids.cpu()), atol=1e-3)
    assert compiles() == after_first
    assert cudagraph_skips() == skips


@cuda
def test_reduce_overhead_cuda_rebinding_rerecords_instead_of_reading_stale() -> None:
    """torch's CUDA graph trees check the addresses of parameters before each replay
    and record again when one moved; rebound plain tensors are copied in. So the naive
    model stays right under reduce-overhead, without a dynamo recompile."""
    model = small(NaiveSmall, "cuda")
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(3, C, device="cuda")
    first_call(lambda: compiled(x).clone())
    after_first = compiles()
    with torch.no_grad():
        for _ in range(2):
            compiled(x).clone()
    for seed in (1, 2):
        model.load_weights(checkpoint(seed, "cuda"))
        with torch.no_grad():
            out = compiled(x).clone()
        assert torch.allclose(out, expected(checkpoint(seed, "cuda"), x), atol=1e-5)
    assert compiles() == after_first


@cuda
def test_graph_cuda_over_a_compiled_model_replays_refits_and_guards_rebinding() -> None:
    model = small(Small, "cuda")
    compiled = torch.compile(model)
    x = torch.randn(3, C, device="cuda")
    first_call(lambda: compiled(x))
    after_first = compiles()
    g = gs.Graph(backend="cuda", guard=model)
    with torch.no_grad(), g.capture(warmup=lambda: compiled(x)):
        out = compiled(x)
    for seed in (1, 2):
        refit(model, checkpoint(seed, "cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out, expected(checkpoint(seed, "cuda"), x), atol=1e-5)
    assert compiles() == after_first
    model.ws = model.ws.clone()
    with pytest.raises(gs.StorageMovedError, match=r"ws was rebound after graph capture"):
        g.replay()


@cuda
def test_control_graph_cuda_over_the_compiled_naive_model_replays_stale() -> None:
    model = small(NaiveSmall, "cuda")
    compiled = torch.compile(model)
    x = torch.randn(3, C, device="cuda")
    first_call(lambda: compiled(x))
    g = gs.Graph(backend="cuda")
    with torch.no_grad(), g.capture(warmup=lambda: compiled(x)):
        out = compiled(x)
    old_ws = model.ws  # keeps the captured memory alive, so the stale read is defined
    model.load_weights(checkpoint(1, "cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert old_ws is not model.ws
    assert torch.allclose(out, expected(checkpoint(0, "cuda"), x), atol=1e-5)
    assert not torch.allclose(out, expected(checkpoint(1, "cuda"), x), atol=1e-3)


# -----------------------------------------------------------------------------
# inductor's freezing: the weights folded into the compiled code as constants


def frozen_compile(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`model` compiled with freezing on, called once (inference: freezing needs no grad)."""
    compiled = torch.compile(model)
    with torch._inductor.config.patch(freezing=True):
        first_call(lambda: compiled(x))
    return lambda: compiled(x)


def test_control_frozen_compiled_code_keeps_the_old_weights_after_a_refit() -> None:
    model, x = small(Small), torch.randn(3, C)
    run = frozen_compile(model, x)
    refit(model, checkpoint(1))  # weights and the derived buffer refreshed in place
    with torch.no_grad():
        assert torch.allclose(model(x), expected(checkpoint(1), x), atol=1e-6)  # eager
        assert torch.allclose(run(), expected(checkpoint(0), x), atol=1e-6)  # frozen
        assert not torch.allclose(run(), expected(checkpoint(1), x), atol=1e-6)
    gs.runtime(model).assert_fresh()  # nothing graphsafe watches is stale


def test_frozen_compiled_code_is_refused_at_the_pin_naming_the_weights() -> None:
    model, x = small(Small), torch.randn(3, C)
    run = frozen_compile(model, x)
    with pytest.raises(gs.FrozenWeightsError, match=r"freezing = False") as info:
        capture(model, run, guard=True)
    assert info.value.paths == ("ws",)  # what the forward reads: the derived buffer
    message = str(info.value)
    assert "expected:" in message and "got:" in message and "`_is_frozen_param`" in message
    assert not gs.runtime(model).pinned  # the failed capture released its pin
    with pytest.raises(gs.FrozenWeightsError, match=r"ws"):
        gs.runtime(model).pin()  # an engine's pin, once its own graphs are captured
    assert not gs.runtime(model).pinned


def test_compiled_code_that_reads_the_weights_as_inputs_is_no_false_alarm() -> None:
    model, x = small(Small), torch.randn(3, C)
    compiled = torch.compile(model)
    with torch._inductor.config.patch(freezing=False):
        first_call(lambda: compiled(x))
        g, out = capture(model, lambda: compiled(x), guard=True)
    refit(model, checkpoint(1))
    g.replay()
    assert torch.allclose(out, expected(checkpoint(1), x), atol=1e-6)
