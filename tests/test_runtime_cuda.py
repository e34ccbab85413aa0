"""The core runtime on a CUDA device: storage locking, in-place refresh, write tracking.

Skipped where CUDA is absent; `scripts/gpu-check` runs them on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsafe as gs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gs.graphsafe
class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4 * 8), requires_grad=False)

    @gs.derive("w_sum", inputs=["w"])
    def _w_sum(self, w, *, out=None):
        return torch.sum(w.view(-1, 4, 8), dim=1, out=out)

    def load_weights(self, weights) -> None:
        for name, t in weights:
            self.get_parameter(name).data.copy_(t)


def test_cuda_refresh_writes_in_place_and_tracks_device_writes():
    layer = Layer().cuda()
    layer.load_weights([("w", torch.randn(6, 32, device="cuda"))])
    buf, ptr = layer.w_sum, layer.w_sum.data_ptr()
    assert buf.is_cuda and not buf.untyped_storage().resizable()  # locked against resize
    new = torch.randn(6, 32, device="cuda")
    layer.load_weights([("w", new)])
    report = gs.runtime(layer).last_report
    assert report is not None and report.refreshed == ("w_sum",)
    assert layer.w_sum is buf and buf.data_ptr() == ptr
    torch.testing.assert_close(buf, new.view(6, 4, 8).sum(1))


def test_cuda_control_a_load_that_writes_nothing_refreshes_nothing():
    layer = Layer().cuda()
    layer.load_weights([("w", torch.randn(6, 32, device="cuda"))])
    layer.load_weights([])
    report = gs.runtime(layer).last_report
    assert report is not None and report.refreshed == ()


def test_cuda_wrong_shape_out_keeps_the_buffer_and_raises_drift():
    layer = Layer().cuda()
    layer.load_weights([("w", torch.randn(6, 32, device="cuda"))])
    buf, ptr = layer.w_sum, layer.w_sum.data_ptr()
    layer.w.data = torch.randn(7, 32, device="cuda")  # a rebinding loader, wrong rows
    with pytest.raises(gs.DerivationDriftError, match="wrong shape"):
        gs.runtime(layer).refresh()
    assert layer.w_sum is buf and buf.data_ptr() == ptr and buf.shape == (6, 8)
    assert gs.runtime(layer).stale == ("w_sum",)


def test_cuda_moving_before_pin_keeps_refresh_working():
    layer = Layer()
    layer.load_weights([("w", torch.randn(6, 32))])
    layer.cuda()
    new = torch.randn(6, 32, device="cuda")
    layer.load_weights([("w", new)])
    assert layer.w_sum.is_cuda
    torch.testing.assert_close(layer.w_sum, new.view(6, 4, 8).sum(1))


def _captured(device: str, **graph_kwargs):
    layer = Layer().to(device)
    layer.load_weights([("w", torch.randn(6, 32, device=device))])
    x = torch.randn(3, 8, device=device)
    g = gs.Graph(guard=layer, **graph_kwargs)
    with torch.no_grad(), g.capture(warmup=lambda: x @ layer.w_sum.t()):
        out = x @ layer.w_sum.t()  # [3, 6]
    g.replay()
    return layer, x, g, out


def _eager(layer, x):
    return x @ layer.w.view(-1, 4, 8).sum(1).t()


def check_in_place_write_outside_a_loader(device: str) -> None:
    layer, x, g, out = _captured(device)
    assert g.backend == ("cuda" if device == "cuda" else "cpu")
    with torch.no_grad():
        layer.w.mul_(2.0)  # moves w's version: the witness sees it
    with pytest.raises(gs.StaleError, match=r"\bw\b.*version"):
        g.replay()
    layer, x, g, out = _captured(device, on_stale="refresh")
    with torch.no_grad():
        layer.w.mul_(2.0)
    g.replay()
    torch.testing.assert_close(out, _eager(layer, x))


def check_load_state_dict_and_mark_written(device: str) -> None:
    layer, x, g, out = _captured(device)
    layer.load_state_dict({"w": torch.randn(6, 32, device=device)})
    g.replay()
    torch.testing.assert_close(out, _eager(layer, x))
    new = torch.randn(6, 32, device=device)
    with gs.weight_update(layer):
        layer.w.untyped_storage().copy_(new.untyped_storage())  # a raw storage copy
        gs.mark_written(layer.w)
    g.replay()
    torch.testing.assert_close(out, _eager(layer, x))
    torch.testing.assert_close(layer.w, new)


def test_cuda_guard_sees_in_place_writes_outside_a_loader():
    check_in_place_write_outside_a_loader("cuda")


def test_cuda_load_state_dict_and_declared_writes_refresh_under_a_cuda_graph():
    check_load_state_dict_and_mark_written("cuda")
