"""torch.inference_mode: refused where it would blind the guard, harmless where not.

An inference tensor keeps no version counter, so an in-place write into it is invisible
to the guard: as a derivation input it is refused by name. Buffers materialized while
the caller runs under inference_mode are kept as ordinary tensors, so the guard still
sees in-place writes into them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsafe as gs


def _registry() -> gs.Registry:
    reg = gs.Registry()

    @reg.derive(nn.Linear, "w_t", inputs=["weight"])
    def _w_t(self: nn.Linear, weight: torch.Tensor, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        return weight.t().contiguous() if out is None else out.copy_(weight.t())

    return reg


def test_an_inference_tensor_input_is_refused_by_name() -> None:
    with torch.inference_mode():
        model = nn.Linear(4, 3)
    with pytest.raises(gs.RegistrationError, match=r"'weight' is an inference tensor") as info:
        gs.runtime(model, _registry()).refresh()
    assert "torch.no_grad()" in str(info.value)


def test_control_the_same_model_built_under_no_grad_is_accepted() -> None:
    with torch.no_grad():
        model = nn.Linear(4, 3)
    gs.runtime(model, _registry()).refresh()
    assert torch.equal(model.w_t, model.weight.t())


def test_an_input_rebound_to_an_inference_tensor_before_pin_is_refused() -> None:
    model = nn.Linear(4, 3)
    rt = gs.runtime(model, _registry())
    rt.refresh()
    with torch.inference_mode():
        fresh = torch.randn(3, 4)
    model.weight = nn.Parameter(fresh, requires_grad=False)
    with pytest.raises(gs.RegistrationError, match="inference tensor"):
        rt.refresh()


def test_buffers_materialized_under_inference_mode_stay_versioned() -> None:
    """The first refresh runs under inference_mode; an in-place write into the derived
    buffer afterwards is still refused by the guard."""
    model = nn.Linear(4, 3)
    rt = gs.runtime(model, _registry())
    with torch.inference_mode():
        rt.refresh()
    assert not model.w_t.is_inference()
    x = torch.randn(2, 4)
    graph = gs.Graph(backend="cpu", guard=model)
    with torch.no_grad(), graph.capture():
        out = x @ model.w_t
    with torch.inference_mode():
        graph.replay()  # a healthy replay under inference_mode
        assert torch.equal(out, x @ model.w_t)
        model.w_t.zero_()
    with pytest.raises(gs.StaleError, match="w_t"):
        graph.replay()
    graph.reset()
