"""Lazy refresh (`rt.lazy_refresh`): loads only mark, the next replay refreshes once.

A loader that writes one parameter per call (as TRL syncs vLLM) makes each call a load of
its own. A derivation over several of them (a fused [q; k; v] weight) is then computed
after every call; with lazy refresh it is computed once, before the next replay, and the
replay reads the new weights. The control is the same sync with lazy refresh off, which
computes it once per call.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe._errors import StaleError
from graphsafe._graphs.graph import Graph


class Attn(nn.Module):
    """Three projections the forward reads fused (`qkv`, a derived buffer)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.q = nn.Parameter(torch.randn(4, 4, generator=gen))
        self.k = nn.Parameter(torch.randn(2, 4, generator=gen))
        self.v = nn.Parameter(torch.randn(2, 4, generator=gen))
        self.out = nn.Parameter(torch.randn(4, 4, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.qkv.t())[:, :4] @ self.out.t()  # type: ignore[operator]


def _registry(calls: list[int]) -> gs.Registry:
    reg = gs.Registry()

    @reg.derive(Attn, "qkv", inputs=["q", "k", "v"])
    def qkv(
        m: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        calls.append(1)
        return torch.cat([q, k, v]) if out is None else torch.cat([q, k, v], out=out)

    return reg


def _captured(lazy: bool) -> tuple[Attn, gs.Runtime, Graph, torch.Tensor, list[int]]:
    calls: list[int] = []
    model = Attn()
    rt = gs.runtime(model, _registry(calls))
    rt.refresh()
    rt.lazy_refresh = lazy
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    g = Graph(backend="cpu", guard=model)
    with torch.no_grad(), g.capture():
        out = model(x)
    return model, rt, g, out, calls


def _per_parameter_sync(model: Attn, scale: float) -> dict[str, torch.Tensor]:
    """One parameter per load, as TRL's colocated sync calls vLLM's `load_weights`."""
    new = {n: p.detach() * scale for n, p in model.named_parameters()}
    for name, value in new.items():
        with gs.weight_update(model):
            getattr(model, name).data.copy_(value)
    return new


def _expected(new: dict[str, torch.Tensor]) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    qkv = torch.cat([new["q"], new["k"], new["v"]])
    return (x @ qkv.t())[:, :4] @ new["out"].t()


def test_lazy_refresh_computes_once_per_sync_before_the_replay() -> None:
    model, rt, g, out, calls = _captured(lazy=True)
    calls.clear()
    new = _per_parameter_sync(model, 2.0)
    assert calls == []  # the four loads only marked
    assert rt.stale == ("qkv",)
    g.replay()
    assert len(calls) == 1
    assert torch.equal(model.qkv, torch.cat([new["q"], new["k"], new["v"]]))  # type: ignore[arg-type]
    torch.testing.assert_close(out, _expected(new), rtol=0, atol=0)
    assert not rt.stale
    g.replay()  # nothing new: nothing computed
    assert len(calls) == 1


def test_control_eager_refresh_computes_once_per_call() -> None:
    model, rt, g, out, calls = _captured(lazy=False)
    calls.clear()
    new = _per_parameter_sync(model, 2.0)
    assert len(calls) == 3  # after q, after k, after v
    assert not rt.stale
    g.replay()
    assert len(calls) == 3
    torch.testing.assert_close(out, _expected(new), rtol=0, atol=0)


def test_lazy_refresh_still_refuses_a_write_outside_any_load() -> None:
    model, rt, g, _, _ = _captured(lazy=True)
    with torch.no_grad():
        model.k.mul_(2)  # in place, outside any update: not a load's, not deferred
    with pytest.raises(StaleError, match="qkv"):
        g.replay()
    assert rt.stale == ("qkv",)


def test_lazy_refresh_leaves_a_failed_update_refused() -> None:
    model, _, g, _, _ = _captured(lazy=True)
    with pytest.raises(RuntimeError, match="boom"), gs.weight_update(model):
        model.q.data.mul_(3)
        raise RuntimeError("boom")
    with pytest.raises(StaleError, match="failed"):
        g.replay()


def test_turning_lazy_refresh_off_refreshes_what_is_deferred() -> None:
    model, rt, g, out, calls = _captured(lazy=True)
    calls.clear()
    new = _per_parameter_sync(model, 0.5)
    rt.lazy_refresh = False
    assert len(calls) == 1 and rt.stale == ()
    g.replay()
    torch.testing.assert_close(out, _expected(new), rtol=0, atol=0)
