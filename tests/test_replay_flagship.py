"""Capture -> refit -> replay of the whole DeepSeek V4 model, on both graph backends.

The CPU variant never skips; the CUDA variant runs wherever a GPU is present.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe.models.deepseek_v4 import verify_target

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


def _equal(a: torch.Tensor, b: torch.Tensor, backend: str) -> bool:
    if backend == "cpu":
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _buckets(ck: list[tuple[str, torch.Tensor]], seed: int, critical_last: bool):
    rng = random.Random(seed)
    ck = list(ck)
    rng.shuffle(ck)
    last = [e for e in ck if critical_last and e[0].endswith("hc_attn_fn")]
    rest = [e for e in ck if e not in last] if last else ck
    cuts = sorted(rng.sample(range(1, len(rest)), 3))
    return [rest[a:b] for a, b in zip([0, *cuts], [*cuts, len(rest)])] + ([last] if last else [])


def _captured(backend: str, naive: bool, guard: bool):
    model = verify_target.build("tiny", naive, torch.device(backend))
    model.load_weights(verify_target.checkpoint(model, seed=0))
    (x,) = verify_target.example_input(model, seed=0)
    graph = gs.Graph(backend=backend, guard=model if guard else None)
    with torch.no_grad(), graph.capture(warmup=lambda: model(x)):
        out = model(x)
    return model, x, graph, out


def _refit(model: nn.Module, seed: int, critical_last: bool) -> None:
    with gs.weight_update(model):
        for bucket in _buckets(verify_target.checkpoint(model, seed), seed, critical_last):
            model.load_weights(bucket)


@pytest.mark.parametrize("backend", BACKENDS)
def test_managed_replay_equals_eager_after_every_refit(backend):
    model, x, graph, out = _captured(backend, naive=False, guard=True)
    buffer = model.layers["0"].hc_attn_fn_broadcast
    with torch.no_grad():
        previous = model(x).clone()
        for k, critical_last in enumerate([True, False, True]):
            _refit(model, seed=10 + k, critical_last=critical_last)
            graph.replay()
            eager = model(x)
            assert _equal(out, eager, backend), f"refit {k}: replay differs from eager"
            # The refit must change the output, or the comparison proves nothing.
            assert not _equal(eager, previous, backend)
            previous = eager.clone()
    assert model.layers["0"].hc_attn_fn_broadcast is buffer


@pytest.mark.parametrize("backend", BACKENDS)
def test_control_naive_model_replays_stale_weights(backend):
    model, x, graph, out = _captured(backend, naive=True, guard=False)
    _refit(model, seed=10, critical_last=True)
    with torch.no_grad():
        graph.replay()
        assert not _equal(out, model(x), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_control_naive_model_is_refused_by_the_guard(backend):
    model, _, graph, _ = _captured(backend, naive=True, guard=True)
    _refit(model, seed=10, critical_last=True)
    with pytest.raises(gs.StorageMovedError, match=r"layers\.0\.hc_attn_fn_broadcast"):
        graph.replay()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_checkpoint_entry_leaves_the_model_stale_until_a_good_load(backend):
    model, x, graph, out = _captured(backend, naive=False, guard=True)
    ck = verify_target.checkpoint(model, seed=20)
    bad = ("layers.0.hc_attn_fn", torch.zeros(3, 3, device=backend))
    # The first entry is written, then the bad one is refused: a half-loaded model.
    with pytest.raises(gs.WeightLoadError, match=r"layers\.0\.hc_attn_fn"):
        model.load_weights([ck[0], bad])
    with pytest.raises(gs.StaleError, match="last weight update failed"):
        graph.replay()
    model.load_weights(ck)
    with torch.no_grad():
        graph.replay()
        assert _equal(out, model(x), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_inside_a_weight_update_block_is_refused_once_anything_was_written(backend):
    model, x, graph, out = _captured(backend, naive=False, guard=True)
    ck = verify_target.checkpoint(model, seed=30)
    embed = [e for e in ck if e[0] == "embed.weight"]  # feeds no derivation
    with gs.weight_update(model):
        graph.replay()  # nothing written yet: allowed
        model.load_weights(embed)
        with pytest.raises(gs.StaleError, match="weight update is in progress"):
            graph.replay()
        model.load_weights(ck)
    with torch.no_grad():
        graph.replay()
        assert _equal(out, model(x), backend)
