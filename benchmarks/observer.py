"""Figure 8: what the process-wide write observer costs eager code while a model is pinned.

While any model is pinned, the compiled observer's kernels at ADInplaceOrView run for
every dispatcher op that writes, in every thread (`graphsafe/_native/kernels.cpp`). Each
row times the same step with the observer on and off (`gs.observe_writes`), alternated in
one run: the median of the paired ratios (see harness.py) is its cost. On the CPU a
sample is the CPU time of the thread (other processes' load does not count); on
`--device cuda` it is the synchronized wall time, the models and their data on the GPU.

- 8a-8c: a training step (forward, backward, AdamW step) of an MLP of 3 layers of hidden
  size 64, 256 and 1024, batch 32. The MLP is the pinned model: a guarded graph captured
  its inference forward (a CUDA graph on `--device cuda`), which reads a derived
  transposed weight per layer, so every parameter the step writes is watched (the worst
  case: each optimizer write is noted).
- 8d: a vLLM-style step: an eager forward, without grad, of 16 decode tokens through a
  small Llama (4 layers, hidden 256), pinned by a guarded graph of the same forward.
- 8e: CUDA only: a guarded CUDA graph replay of 8c's pinned MLP's inference forward. A
  replay dispatches no op, so the observer never runs: the ratio should be 1.

Rows 8a-8d also time, alternated with the rest, the observer through its other door,
the global RecordFunction callback every op pays (`callback_ratio`: what a process pays
while a watched tensor was made in inference mode, or with `GRAPHSAFE_OBSERVER=callback`),
and a callback of that kind that does nothing but take every op's inputs
(`floor_ratio`: the floor of any observer built on RecordFunction).

Without the compiled build there is no observer: the figure is one SKIP row saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from figures import Ctx
from harness import Row, interleave, paired
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._runtime.writes.observer import OBSERVER
from graphsafe.models import llama

__all__ = ["fig8"]

_BATCH = 32
_LAYERS = 3


def _mlp_class(registry: gs.Registry) -> type[nn.Module]:
    """An MLP trained with its weights, whose inference forward reads `weight_t` per layer."""

    class Block(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
            self.bias = nn.Parameter(torch.zeros(hidden))

    @registry.derive(Block, "weight_t", inputs=["weight"])
    def _weight_t(m: Block, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return w.t().contiguous() if out is None else out.copy_(w.t())

    class MLP(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(hidden) for _ in range(_LAYERS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # training: reads the weights
            for b in self.blocks:
                x = torch.relu(torch.nn.functional.linear(x, b.weight, b.bias))  # [B, C]
            return x

        def infer(self, x: torch.Tensor) -> torch.Tensor:  # serving: the derived layout
            for b in self.blocks:
                x = torch.relu(x @ b.weight_t + b.bias)  # [B, C]
            return x

    return MLP


def _pinned(ctx: Ctx, model: nn.Module, forward: Callable[[], Any]) -> gs.Graph:
    """A guarded graph of `forward` (a CUDA graph on CUDA, captured after one warm-up on a
    side stream): the model is pinned while it lives."""
    cuda = ctx.device.type == "cuda"
    graph = gs.Graph(backend="cuda" if cuda else "cpu", guard=model)
    with torch.no_grad(), graph.capture(warmup=forward if cuda else None, warmup_iters=1):
        forward()
    return graph


def _sampler(ctx: Ctx) -> Callable[[Callable[[], Any], int], float]:
    """Seconds per call of a step: CPU time of this thread on the CPU, synchronized wall
    time on CUDA (the GPU's work is the step's too)."""
    return ctx.clock.time if ctx.device.type == "cuda" else _thread_seconds


def _per_sample(ctx: Ctx, step: Callable[[], Any], seconds: float) -> int:
    """Steps per sample, so that one sample takes about `seconds`."""
    step()
    sample = _sampler(ctx)
    one = max(min(sample(step, 1) for _ in range(3)), 1e-6)
    return max(1, round(seconds / one))


def _thread_seconds(step: Callable[[], Any], number: int) -> float:
    """CPU seconds of this thread per call of `step`: what the callback adds is CPU work
    here, and other processes' load, which inflates wall time, does not count."""
    start = time.thread_time()
    for _ in range(number):
        step()
    return (time.thread_time() - start) / number


def _on_off(
    ctx: Ctx, step: Callable[[], Any], seconds: float, floors: bool = True
) -> tuple[Any, Any, float, int, dict[str, float]]:
    """Stats of `step` with the observer on and off, alternated (twice the usual repeats:
    the effect is small next to the noise); their paired ratio; and with `floors`, the
    paired ratios of the observer through its callback and of a do-nothing callback (see
    the module's docstring)."""
    number = _per_sample(ctx, step, seconds)
    was = OBSERVER.enabled
    sample = _sampler(ctx)
    native = _native.get()
    assert native is not None

    def timed(enabled: bool, callback: bool = False, floor: bool = False
              ) -> Callable[[], float]:
        def case() -> float:
            OBSERVER.by_callback = callback  # outside the timed loop
            gs.observe_writes(enabled)
            assert OBSERVER.door == ("callback" if callback else "kernels" if enabled else None)
            native.observer_floor(floor, True)
            try:
                return sample(step, number)
            finally:
                native.observer_floor(False, False)
        return case

    cases = {"on": timed(True), "off": timed(False)}
    if floors:
        cases |= {"callback": timed(True, callback=True), "floor": timed(False, floor=True)}
    by_callback = OBSERVER.by_callback
    try:
        stats = interleave(cases, 2 * ctx.sizes.repeats)
    finally:
        OBSERVER.by_callback = by_callback
        gs.observe_writes(was)
    found = {}
    if floors:
        found = {
            "callback_ratio": round(paired(stats["callback"], stats["off"]), 3),
            "floor_ratio": round(paired(stats["floor"], stats["off"]), 3),
        }
    return stats["on"], stats["off"], paired(stats["on"], stats["off"]), number, found


def _seconds(ctx: Ctx) -> float:
    """What one sample takes: enough steps to rise above the clock's and the machine's
    noise."""
    return 0.005 if ctx.sizes.smoke else 0.1


def _mlp(ctx: Ctx, hidden: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The MLP of `hidden` on the device, its derivations fresh; an input and a target."""
    reg = gs.Registry()
    gen = torch.Generator().manual_seed(hidden)
    with torch.device(ctx.device):
        model = _mlp_class(reg)(hidden)
    rt = gs.runtime(model, reg)
    rt.refresh()
    x = torch.randn(_BATCH, hidden, generator=gen).to(ctx.device)
    y = torch.randn(_BATCH, hidden, generator=gen).to(ctx.device)
    return model, x, y


def _training_row(ctx: Ctx, fig: str, hidden: int, target: float | None) -> Row:
    model, x, y = _mlp(ctx, hidden)
    graph = _pinned(ctx, model, lambda: model.infer(x))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    on, off, ratio, number, floors = _on_off(ctx, step, _seconds(ctx))
    graph.reset()
    return Row(
        fig, f"training step, MLP {_LAYERS} x hidden {hidden}, observer on", on.median,
        off.median, baseline_name="observer off", ratio=ratio, ratio_def="on / off",
        op="<=" if target else "", target=target,
        details={"steps_per_sample": number, "added_per_step_s": on.median - off.median,
                 "clock": _clock_name(ctx), **floors,
                 "spread": [round(on.spread, 3), round(off.spread, 3)]},
    )


def _clock_name(ctx: Ctx) -> str:
    return "wall, synchronized" if ctx.device.type == "cuda" else "CPU time of the thread"


def _decode_row(ctx: Ctx, fig: str, quick: bool) -> Row:
    config = llama.LlamaConfig() if quick else llama.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32,
    )
    with torch.device(ctx.device):
        model = llama.LlamaForCausalLM(config)
    model.load_weights(llama.random_checkpoint(config, seed=0, device=ctx.device))
    tokens = torch.randint(0, config.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(ctx.device)
    graph = _pinned(ctx, model, lambda: model(tokens))

    def step() -> None:
        with torch.no_grad():
            model(tokens)

    on, off, ratio, number, floors = _on_off(ctx, step, _seconds(ctx))
    graph.reset()
    return Row(
        fig, f"vLLM-style step: eager forward of 16 tokens, Llama {config.num_hidden_layers} "
        f"x hidden {config.hidden_size}, observer on", on.median, off.median,
        baseline_name="observer off", ratio=ratio, ratio_def="on / off", op="<=", target=1.03,
        details={"steps_per_sample": number, "added_per_step_s": on.median - off.median,
                 "clock": _clock_name(ctx), **floors,
                 "spread": [round(on.spread, 3), round(off.spread, 3)]},
    )


def _replay_row(ctx: Ctx, fig: str, hidden: int) -> Row:
    """A guarded CUDA graph replay of the pinned MLP's inference forward, observer on vs
    off: a replay launches the captured kernels without dispatching any op."""
    name = f"guarded CUDA graph replay, MLP {_LAYERS} x hidden {hidden}, observer on"
    if ctx.device.type != "cuda":
        return Row(fig, name, skipped="CUDA only: a CUDA graph replay (this run is on the CPU)")
    model, x, _ = _mlp(ctx, hidden)
    graph = _pinned(ctx, model, lambda: model.infer(x))
    graph.replay()  # the first replay uploads the graph
    on, off, ratio, number, _ = _on_off(ctx, graph.replay, _seconds(ctx), floors=False)
    graph.reset()
    return Row(
        fig, name, on.median, off.median, baseline_name="observer off", ratio=ratio,
        ratio_def="on / off",
        details={"replays_per_sample": number, "added_per_replay_s": on.median - off.median,
                 "clock": _clock_name(ctx),
                 "spread": [round(on.spread, 3), round(off.spread, 3)]},
    )


def fig8(ctx: Ctx) -> list[Row]:
    """The observer's cost: training steps of three sizes (8a-8c), a decode step (8d), a
    guarded CUDA graph replay (8e)."""
    if _native.get() is None:  # nothing to measure: not a failure of the figure
        return [Row("8", "the process-wide write observer", skipped=(
            "it needs the compiled build (built on first use with a C++ compiler; "
            "not with GRAPHSAFE_NATIVE=0)"
        ))]
    quick = ctx.sizes.smoke
    hidden = (16, 32, 64) if quick else (64, 256, 1024)
    rows: list[Row] = []
    for fig, h, target in zip(("8a", "8b", "8c"), hidden, (1.10, None, 1.05)):
        name = f"training step, MLP {_LAYERS} x hidden {h}, observer on"
        rows += ctx.attempt(fig, name, lambda f=fig, h=h, t=target: _training_row(ctx, f, h, t))
    rows += ctx.attempt("8d", "vLLM-style step, observer on", lambda: _decode_row(ctx, "8d", quick))
    rows += ctx.attempt("8e", "guarded CUDA graph replay, observer on",
                        lambda: _replay_row(ctx, "8e", hidden[-1]))
    return rows
