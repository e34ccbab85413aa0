"""A derived tensor the class's own code binds is adopted, keeping its storage.

vLLM's DeepSeek V4 binds `hc_attn_fn_broadcast` in `finalize_mhc_broadcast_weights` on
the first load and copies into it afterwards (the fix); before the fix it bound a fresh
tensor on every load. These tests reproduce both with plain torch; the same checks run
against vLLM's own class in `tests/vllm/`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsafe as gs

HC, HIDDEN = 4, 8


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hc_mult, self.hidden_size = HC, HIDDEN
        self.hc_attn_fn = nn.Parameter(torch.empty(6, HC * HIDDEN))
        self.hc_attn_fn_broadcast: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.hc_attn_fn_broadcast is not None
        return x @ self.hc_attn_fn_broadcast.t()


class Model(nn.Module):
    """A vLLM-style model: its loader writes in place, then finalizes the broadcast."""

    def __init__(self, *, prefix_rebinds: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.prefix_rebinds = prefix_rebinds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)
        self.finalize()

    def finalize(self) -> None:
        layer = self.layers[0]
        broadcast = layer.hc_attn_fn.detach().view(-1, HC, HIDDEN).sum(dim=1)
        if layer.hc_attn_fn_broadcast is None or self.prefix_rebinds:
            layer.hc_attn_fn_broadcast = broadcast  # before the fix: a new tensor each load
        else:
            layer.hc_attn_fn_broadcast.copy_(broadcast)


def registry(shape: tuple[int, ...] | None = None) -> gs.Registry:
    reg = gs.Registry()

    @reg.derive(
        Layer, "hc_attn_fn_broadcast", inputs=["hc_attn_fn"], when=lambda m: m is FIRST[0]
    )
    def broadcast(m: Layer, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        r = torch.sum(w.view(-1, m.hc_mult, m.hidden_size), dim=1, out=out)
        return r if shape is None else r.reshape(shape)

    return reg


FIRST: list[nn.Module | None] = [None]


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layers.{i}.hc_attn_fn", torch.randn(6, HC * HIDDEN, generator=g)) for i in (0, 1)]


def loaded(**kw: bool) -> Model:
    model = Model(**kw)
    FIRST[0] = model.layers[0]
    model.load_weights(checkpoint(0))  # vLLM's own load, before graphsafe is attached
    return model


def expected(model: Model) -> torch.Tensor:
    return model.layers[0].hc_attn_fn.detach().view(-1, HC, HIDDEN).sum(1)


def test_the_bound_tensor_is_adopted_keeping_object_and_storage() -> None:
    model = loaded()
    own = model.layers[0].hc_attn_fn_broadcast
    assert own is not None
    ptr = own.data_ptr()
    gs.runtime(model, registry()).refresh()
    layer = model.layers[0]
    assert layer._buffers["hc_attn_fn_broadcast"] is own  # a buffer now, the same object
    assert "hc_attn_fn_broadcast" not in layer.__dict__
    assert own.data_ptr() == ptr
    assert torch.equal(own, expected(model))
    infos = gs.runtime(model).derivations
    assert [d.outputs for d in infos] == [("layers.0.hc_attn_fn_broadcast",)]


def test_fixed_finalize_replays_fresh_and_never_false_alarms() -> None:
    model = loaded()
    gs.runtime(model, registry()).refresh()
    x = torch.randn(3, HIDDEN)
    graph = gs.Graph(guard=model)
    with torch.no_grad(), graph.capture():
        out = model(x)
    for seed in (1, 2, 3):
        with gs.weight_update(model):
            model.load_weights(checkpoint(seed))  # finalize copies into the adopted buffer
        graph.replay()
        assert torch.equal(out, x @ expected(model).t())
    # A load outside any update: the guard's witnesses see the in-place writes.
    model.load_weights(checkpoint(4))
    with pytest.raises(gs.StaleError, match=r"layers\.0\.hc_attn_fn"):
        graph.replay()


def test_prefix_finalize_rebinding_is_caught_naming_the_buffer() -> None:
    model = loaded(prefix_rebinds=True)
    gs.runtime(model, registry()).refresh()
    x = torch.randn(3, HIDDEN)
    graph = gs.Graph(guard=model)
    with torch.no_grad(), graph.capture():
        model(x)
    # The update that rebinds raises at its end, and the graph refuses to replay.
    with (
        pytest.raises(gs.StorageMovedError, match=r"layers\.0\.hc_attn_fn_broadcast"),
        gs.weight_update(model),
    ):
        model.load_weights(checkpoint(1))
    with pytest.raises(gs.StorageMovedError, match=r"layers\.0\.hc_attn_fn_broadcast"):
        graph.replay()


def test_a_bound_tensor_that_does_not_fit_is_refused_untouched() -> None:
    model = loaded()
    layer = model.layers[0]
    wrong = torch.full((3, HIDDEN), 7.0)
    layer.hc_attn_fn_broadcast = wrong
    with pytest.raises(gs.RegistrationError) as e:
        gs.runtime(model, registry()).refresh()
    msg = str(e.value)
    assert "layers.0.hc_attn_fn_broadcast" in msg
    assert "shape (3, 8) (the derivation gives (6, 8))" in msg
    assert layer.__dict__["hc_attn_fn_broadcast"] is wrong
    assert torch.equal(wrong, torch.full((3, HIDDEN), 7.0))  # nothing written


@pytest.mark.parametrize("what", ["dtype", "view of a parameter", "overlapping"])
def test_other_misfits_are_refused(what: str) -> None:
    model = loaded()
    layer = model.layers[0]
    good = expected(model)
    bad = {
        "dtype": lambda: good.double(),
        "view of a parameter": lambda: layer.hc_attn_fn.detach()[:, :HIDDEN],
        "overlapping": lambda: torch.zeros(1, HIDDEN).expand(6, HIDDEN),
    }[what]()
    before = layer.hc_attn_fn.detach().clone()
    layer.hc_attn_fn_broadcast = bad
    with pytest.raises(gs.RegistrationError, match="cannot be adopted"):
        gs.runtime(model, registry()).refresh()
    assert torch.equal(layer.hc_attn_fn.detach(), before)


def test_a_parameter_of_the_same_name_is_still_a_collision() -> None:
    model = loaded()
    layer = model.layers[0]
    del layer.hc_attn_fn_broadcast
    layer.hc_attn_fn_broadcast = nn.Parameter(expected(model))
    with pytest.raises(gs.RegistrationError, match="collides with a parameter"):
        gs.runtime(model, registry()).refresh()
