"""`Graph(guard=model)`: refuse to replay stale memory (`graphsafe._graphs.graph`).

Each guarded test has an unguarded control: the same rebinding replays silently stale,
so it is the guard that catches it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from helpers import scaled_layer_class
from torch import nn

import graphsafe as gs
from graphsafe._errors import CaptureError, StaleError, StorageMovedError
from graphsafe._graphs.graph import Graph


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.full((4,), 0.5)  # plain tensor attribute
        self.cache = [torch.ones(4)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.cache[0]


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _capture(model: nn.Module, x: torch.Tensor, guard: bool) -> tuple[Graph, torch.Tensor]:
    g = Graph(backend="cpu", guard=model if guard else None)
    with torch.no_grad(), g.capture(warmup=lambda: model(x)):
        out = model(x)
    return g, out


def _rebind_param_data(m: Layer) -> None:
    m.lin.weight.data = torch.randn(4, 4)


def _rebind_attribute(m: Layer) -> None:
    m.scale = torch.full((4,), 2.0)


def _replace_list_item(m: Layer) -> None:
    m.cache[0] = torch.zeros(4)


REBINDINGS = [_rebind_param_data, _rebind_attribute, _replace_list_item]
PATHS = {
    _rebind_param_data: "lin.weight",
    _rebind_attribute: "scale",
    _replace_list_item: "cache.0",
}


@pytest.mark.parametrize("rebind", REBINDINGS, ids=[r.__name__ for r in REBINDINGS])
def test_a_rebinding_after_capture_raises_at_replay_instead_of_replaying(
    rebind: Callable[[Layer], None],
) -> None:
    model, x = Layer(), torch.randn(2, 4)
    g, out = _capture(model, x, guard=True)
    out.fill_(123.0)  # a replay would overwrite this
    rebind(model)
    path = PATHS[rebind]
    with pytest.raises(
        StorageMovedError,
        match=rf"(?s){path} was rebound after graph capture: its storage moved.*fix:.*copy_",
    ) as e:
        g.replay()
    assert [d.path for d in e.value.drifts] == [path]
    assert torch.equal(out, torch.full((2, 4), 123.0))  # nothing was replayed


@pytest.mark.parametrize("rebind", REBINDINGS, ids=[r.__name__ for r in REBINDINGS])
def test_control_without_a_guard_the_same_rebinding_replays_stale(
    rebind: Callable[[Layer], None],
) -> None:
    model, x = Layer(), torch.randn(2, 4)
    g, out = _capture(model, x, guard=False)
    old = out.clone()
    rebind(model)
    g.replay()  # no error...
    assert torch.equal(out, old)
    assert not torch.equal(out, _eager(model, x))  # ...and wrong


def test_a_model_updated_in_place_replays_fine_under_the_guard() -> None:
    model, x = Layer(), torch.randn(2, 4)
    g, out = _capture(model, x, guard=True)
    assert g.ledger is not None and len(g.ledger) == 4
    for step in range(3):
        with torch.no_grad():
            model.lin.weight.data.copy_(torch.randn(4, 4))
            model.scale.fill_(float(step))
            model.cache[0].add_(1.0)
        x.copy_(torch.randn(2, 4))
        g.replay()
        assert torch.equal(out, _eager(model, x))


def test_the_guard_pins_the_model_before_the_body_runs() -> None:
    model, x = Layer(), torch.randn(2, 4)
    g = Graph(backend="cpu", guard=model)
    seen: list[bool] = []
    with torch.no_grad(), g.capture():
        seen.append(gs.runtime(model).pinned)
        assert g.ledger is not None
        model(x)
    assert seen == [True]


def test_stale_derived_buffers_raise_at_replay() -> None:
    layer = scaled_layer_class()()
    layer.load_weights([])
    g = Graph(backend="cpu", guard=layer)
    with torch.no_grad(), g.capture():
        out = layer.w_scaled.sum(0) + layer.col_sum
    g.replay()
    with pytest.raises(KeyError):
        layer.load_weights([("w", torch.full((2, 3), 2.0)), ("nope", 1.0)])
    out.fill_(-1.0)
    with pytest.raises(StaleError, match="do not match their inputs"):
        g.replay()
    assert torch.equal(out, torch.full((3,), -1.0))  # nothing was replayed
    # A complete load makes it usable again.
    layer.load_weights([("w", torch.full((2, 3), 2.0)), ("bias", layer.bias.clone())])
    g.replay()
    with torch.no_grad():
        assert torch.equal(out, layer.w_scaled.sum(0) + layer.col_sum)


def _load_in_thread(layer: nn.Module, timeout: float) -> tuple[bool, threading.Thread]:
    """Whether a complete load of `layer` from another thread ends within `timeout`
    seconds (a load takes the model's lock, which a replay holds), and the thread."""
    done = threading.Event()

    def load() -> None:
        layer.load_weights([("w", torch.full((2, 3), 3.0)), ("bias", layer.bias.clone())])
        done.set()

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    return done.wait(timeout), thread


def _refused_stale_replay() -> tuple[nn.Module, Graph]:
    layer = scaled_layer_class()()
    layer.load_weights([])
    g = Graph(backend="cpu", guard=layer)
    with torch.no_grad(), g.capture():
        layer.w_scaled.sum(0) + layer.col_sum
    with pytest.raises(KeyError):
        layer.load_weights([("w", torch.full((2, 3), 2.0)), ("nope", 1.0)])
    with pytest.raises(StaleError):
        g.replay()
    return layer, g


def test_a_refused_replay_leaves_the_model_free_for_the_next_load() -> None:
    layer, g = _refused_stale_replay()
    ended, _ = _load_in_thread(layer, timeout=10.0)
    assert ended  # the refusal released the model's lock
    g.replay()  # and the load made it fresh


def test_control_a_replay_check_that_kept_the_lock_blocks_the_next_load() -> None:
    # What the test above would see if a refused replay kept the model's lock: the
    # load from another thread waits on it.
    layer, _ = _refused_stale_replay()
    lock = gs.runtime(layer)._lock
    lock.acquire()
    try:
        ended, thread = _load_in_thread(layer, timeout=0.5)
        assert not ended
    finally:
        lock.release()
    thread.join(10.0)  # once the lock is free, the load ends
    assert not thread.is_alive()


def test_a_capture_that_fails_leaves_a_graph_that_refuses_to_replay() -> None:
    model, x = Layer(), torch.randn(2, 4)
    g = Graph(backend="cpu", guard=model)
    with pytest.raises(CaptureError, match=r"`\.item\(\)`"), torch.no_grad(), g.capture():
        model(x).sum().item()
    assert not g.captured
    with pytest.raises(CaptureError, match=r"state failed"):
        g.replay()
    with pytest.raises(CaptureError, match="cannot capture again"), g.capture():
        pass


def test_backend_selection() -> None:
    assert Graph(backend="cpu").backend == "cpu"
    assert Graph(backend="auto", guard=Layer()).backend == "cpu"  # its tensors are on the CPU
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert Graph().backend == expected
    with pytest.raises(ValueError, match="backend must be"):
        Graph(backend="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the cpu backend has none"):
        Graph(backend="cpu", pool=(0, 1))  # type: ignore[arg-type]
    assert Graph(backend="cpu").pool() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_asking_for_the_gpu_backend_without_a_gpu_raises() -> None:
    with pytest.raises(CaptureError, match="the cuda backend needs a CUDA device"):
        Graph(backend="cuda")
