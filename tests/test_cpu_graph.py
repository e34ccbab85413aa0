"""The CPU graph backend replays with a CUDA graph's semantics (`graphsafe._graphs.cpu`).

Every case is checked against eager: writes into captured memory are seen, rebinding
is reproduced as the stale read a CUDA graph would give, outputs keep their memory.
Each "it works" test also shows that eager output changed, so a replay that ignored
the write (or followed the rebinding) would fail it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from graphsafe._errors import CaptureError
from graphsafe._graphs.cpu import CPUBackend
from graphsafe._graphs.graph import Graph


class Tiny(nn.Module):
    """A parameter, a buffer, a plain attribute, and tensors in a list and a dict."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=gen))
        self.register_buffer("b", torch.randn(4, generator=gen))
        self.scale = torch.rand(4, generator=gen) + 0.5
        self.cache = [torch.randn(4, generator=gen), torch.randn(4, generator=gen)]
        self.tables = {"k": torch.randn(4, generator=gen)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w.t() + self.b  # [N, 4]
        return h * self.scale + self.cache[1] - self.tables["k"]


def _captured(model: nn.Module, x: torch.Tensor) -> tuple[Graph, torch.Tensor]:
    g = Graph(backend="cpu")
    with torch.no_grad(), g.capture():
        out = model(x)
    return g, out


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _x() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def test_replay_equals_eager_when_nothing_changed() -> None:
    model, x = Tiny(), _x()
    g, out = _captured(model, x)
    expected = _eager(model, x)
    assert torch.equal(out, expected)
    out.zero_()
    g.replay()
    assert torch.equal(out, expected)


# -- writes into captured memory are seen -------------------------------------------------


def _write_param_data_copy(m: Tiny) -> None:
    m.w.data.copy_(torch.randn(4, 4))  # the loader idiom


def _write_param_mul(m: Tiny) -> None:
    with torch.no_grad():
        m.w.mul_(0.5)


def _write_param_index(m: Tiny) -> None:
    with torch.no_grad():
        m.w[1:3, 0] = 7.0


def _write_buffer(m: Tiny) -> None:
    m.b.copy_(torch.randn(4))


def _write_attribute(m: Tiny) -> None:
    m.scale.fill_(3.0)


def _write_list_item(m: Tiny) -> None:
    m.cache[1].add_(1.0)


def _write_dict_item(m: Tiny) -> None:
    m.tables["k"][0] = -4.0


WRITES = [
    _write_param_data_copy,
    _write_param_mul,
    _write_param_index,
    _write_buffer,
    _write_attribute,
    _write_list_item,
    _write_dict_item,
]


@pytest.mark.parametrize("write", WRITES, ids=[w.__name__ for w in WRITES])
def test_in_place_writes_into_captured_tensors_are_seen(write: Callable[[Tiny], None]) -> None:
    model, x = Tiny(), _x()
    g, out = _captured(model, x)
    before = out.clone()
    write(model)
    after = _eager(model, x)
    assert not torch.equal(after, before)  # the write matters
    g.replay()
    assert torch.equal(out, after)


def test_a_static_input_updated_with_copy_is_seen() -> None:
    model, x = Tiny(), _x()
    g, out = _captured(model, x)
    for seed in range(3):
        x.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + seed)))
        g.replay()
        assert torch.equal(out, _eager(model, x))


# -- rebinding is not seen: replay reads the old memory, as a CUDA graph does --------------


def _rebind_attribute(m: Tiny) -> None:
    m.scale = torch.full((4,), 3.0)


def _rebind_param_data(m: Tiny) -> None:
    m.w.data = torch.randn(4, 4)


def _reassign_parameter(m: Tiny) -> None:
    m.w = nn.Parameter(torch.randn(4, 4))


def _register_buffer_again(m: Tiny) -> None:
    m.register_buffer("b", torch.randn(4))


def _set_(m: Tiny) -> None:
    m.scale.set_(torch.full((4,), 3.0))


def _replace_list_item(m: Tiny) -> None:
    m.cache[1] = torch.randn(4)


def _replace_dict_item(m: Tiny) -> None:
    m.tables["k"] = torch.randn(4)


REBINDINGS = [
    _rebind_attribute,
    _rebind_param_data,
    _reassign_parameter,
    _register_buffer_again,
    _set_,
    _replace_list_item,
    _replace_dict_item,
]


@pytest.mark.parametrize("rebind", REBINDINGS, ids=[r.__name__ for r in REBINDINGS])
def test_rebinding_is_replayed_as_a_stale_read(rebind: Callable[[Tiny], None]) -> None:
    model, x = Tiny(), _x()
    g, out = _captured(model, x)
    old = out.clone()
    rebind(model)
    new = _eager(model, x)
    assert not torch.equal(new, old)  # eager sees the rebinding...
    g.replay()
    assert torch.equal(out, old)  # ...the graph reads the memory it captured


def test_the_old_memory_stays_alive_and_still_takes_writes_through_old_views() -> None:
    model, x = Tiny(), _x()
    old_w = model.w.data  # another handle on the captured storage
    g, out = _captured(model, x)
    model.w.data = torch.randn(4, 4)
    old_w.mul_(2.0)  # writes into the memory the graph reads
    g.replay()
    model.w.data = old_w
    assert torch.equal(out, _eager(model, x))


# -- outputs are static ---------------------------------------------------------------------


def test_outputs_keep_their_identity_and_memory_across_replays() -> None:
    model, x = Tiny(), _x()
    g = Graph(backend="cpu")
    with torch.no_grad(), g.capture():
        y = model(x)
        outs = {"y": y, "pair": (y.sum(0), y.t())}
    objects = (id(outs["y"]), id(outs["pair"][0]), id(outs["pair"][1]))
    pointers = (y.data_ptr(), outs["pair"][0].data_ptr(), outs["pair"][1].data_ptr())
    for step in range(3):
        model.w.data.mul_(1.5)
        x.add_(float(step))
        g.replay()
        expected = _eager(model, x)
        assert (id(outs["y"]), id(outs["pair"][0]), id(outs["pair"][1])) == objects
        assert (y.data_ptr(), outs["pair"][0].data_ptr(), outs["pair"][1].data_ptr()) == pointers
        assert torch.equal(outs["y"], expected)
        assert torch.equal(outs["pair"][0], expected.sum(0))
        assert torch.equal(outs["pair"][1], expected.t())


def test_replay_writes_the_output_memory_even_if_the_caller_rebinds_the_output() -> None:
    model, x = Tiny(), _x()
    g, out = _captured(model, x)
    view = out.view(-1)  # shares the output's memory
    out.data = torch.zeros(3, 4)  # like a CUDA graph, replay keeps writing the old memory
    model.w.data.mul_(2.0)
    g.replay()
    assert torch.equal(view, _eager(model, x).view(-1))
    assert torch.equal(out, torch.zeros(3, 4))


# -- things a graph cannot capture ----------------------------------------------------------


VALUE_READS: list[tuple[Callable[[torch.Tensor], object], str]] = [
    (lambda t: t.sum().item(), r"`\.item\(\)`"),
    (lambda t: bool(t[0, 0] > 0), r"`bool\(t\)`"),
    (lambda t: t.tolist(), r"`\.tolist\(\)`"),
    (lambda t: int(t[0, 0]), r"`int\(t\)`"),
    (lambda t: float(t[0, 0]), r"`float\(t\)`"),
    (lambda t: t.numpy(), r"`\.numpy\(\)`"),
    (lambda t: print(t), r"printing a tensor"),
    (lambda t: torch.equal(t, t), r"`torch\.equal`"),
    (lambda t: (t > 0).any().item(), r"`\.item\(\)`"),
]


@pytest.mark.parametrize(("read", "what"), VALUE_READS)
def test_reading_a_value_into_python_during_capture_raises(
    read: Callable[[torch.Tensor], object], what: str
) -> None:
    x = _x()
    g = Graph(backend="cpu")
    with (
        pytest.raises(CaptureError, match=rf"{what}.* reads a tensor's value into Python"),
        g.capture(),
    ):
        read(x * 2)
    with pytest.raises(CaptureError, match="replay\\(\\) before a successful capture"):
        g.replay()


@pytest.mark.parametrize(
    "op",
    [lambda t: t.nonzero(), lambda t: t[t > 0], lambda t: torch.unique(t)],
    ids=["nonzero", "mask", "unique"],
)
def test_ops_whose_output_shape_depends_on_values_raise(
    op: Callable[[torch.Tensor], object],
) -> None:
    g = Graph(backend="cpu")
    with (
        pytest.raises(CaptureError, match="shape depends on tensor values"),
        g.capture(),
    ):
        op(_x())


def test_control_integer_indexing_and_fixed_shape_masking_capture_fine() -> None:
    x = _x()
    idx = torch.tensor([2, 0])
    g = Graph(backend="cpu")
    with g.capture():
        picked = x[idx]
        masked = torch.where(x > 0, x, 0.0)
    x.copy_(-x)
    g.replay()
    assert torch.equal(picked, x[idx])
    assert torch.equal(masked, torch.where(x > 0, x, 0.0))


def test_changing_an_outside_tensors_layout_inside_capture_raises() -> None:
    buf = torch.zeros(4, 4)
    g = Graph(backend="cpu")
    with (
        pytest.raises(CaptureError, match=r"aten\.t_.*changes the storage or layout"),
        g.capture(),
    ):
        buf.t_()


def test_capturing_twice_and_replaying_before_capture_raise() -> None:
    g = Graph(backend="cpu")
    with pytest.raises(CaptureError, match=r"replay\(\) before a successful capture"):
        g.replay()
    with g.capture():
        torch.ones(1) + 1
    with pytest.raises(CaptureError, match="already captured"), g.capture():
        pass
    backend = CPUBackend()
    with backend.capture():
        pass
    with pytest.raises(CaptureError, match="already captured"), backend.capture():
        pass


# -- faithful replay of trickier ops ---------------------------------------------------


def test_views_of_parameters_and_in_place_ops_on_intermediates() -> None:
    w = nn.Parameter(torch.randn(4, 4))
    x = _x()

    def body() -> torch.Tensor:
        row = w[1]  # a view of the parameter
        col = w.t()[:, 2]
        h = x * row + col  # [3, 4]
        h.relu_()
        h[:, 0] = h[:, 1]
        h.mul_(w.view(-1)[:4])
        left, right = h.chunk(2, dim=1)  # list output
        return torch.cat([right, left], dim=1)  # list input

    g = Graph(backend="cpu")
    with torch.no_grad(), g.capture():
        out = body()
    before = out.clone()
    with torch.no_grad():
        w.mul_(-1.5)
        x.add_(0.25)
        expected = body()
    assert not torch.equal(expected, before)
    g.replay()
    assert torch.equal(out, expected)


def test_out_kwargs_write_into_outside_buffers_on_replay() -> None:
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    dest = torch.empty(3, 3)
    g = Graph(backend="cpu")
    with g.capture():
        torch.mm(a, b, out=dest)
    a.mul_(2.0)
    dest.zero_()
    g.replay()
    assert torch.equal(dest, a @ b)


def test_a_kv_cache_written_at_a_device_side_position() -> None:
    cache = torch.zeros(6, 4)
    pos = torch.tensor([0])
    x = _x()[:1]
    g = Graph(backend="cpu")
    with g.capture():
        cache.index_copy_(0, pos, x)
        total = cache.sum(0)
    for p in range(1, 4):
        pos.fill_(p)
        x.fill_(float(p))
        g.replay()
        assert torch.equal(cache[p], torch.full((4,), float(p)))
        assert torch.equal(total, cache.sum(0))


class Knobs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.factor = 2.0  # a Python float
        self.add = True  # a Python branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.factor if self.add else x * self.factor


def test_python_scalars_and_control_flow_are_frozen_at_capture() -> None:
    model, x = Knobs(), torch.ones(2)
    g = Graph(backend="cpu")
    with g.capture():
        y = model(x)
    model.factor, model.add = 10.0, False
    assert torch.equal(model(x), torch.full((2,), 10.0))  # eager follows the change...
    g.replay()
    assert torch.equal(y, torch.full((2,), 3.0))  # ...the graph, as on a GPU, does not


def test_random_ops_draw_again_on_each_replay() -> None:
    drop = nn.Dropout(0.5).train()
    g = Graph(backend="cpu")
    with g.capture():
        y = drop(torch.ones(1000))
    first = y.clone()
    g.replay()
    assert not torch.equal(first, y)
    assert set(y.unique().tolist()) <= {0.0, 2.0}


def test_capture_with_grad_enabled_and_under_inference_mode() -> None:
    model, x = Tiny(), _x()
    g = Graph(backend="cpu")
    with g.capture():
        out = model(x)
    assert out.requires_grad
    model.w.data.mul_(2.0)
    g.replay()
    assert torch.equal(out, _eager(model, x))

    g2 = Graph(backend="cpu")
    with torch.inference_mode(), g2.capture():
        out2 = model(x)
    model.b.copy_(torch.randn(4))
    g2.replay()  # outside inference mode: replay enters it again
    assert torch.equal(out2, _eager(model, x))


def test_unused_intermediates_are_not_replayed() -> None:
    x = _x()
    g = CPUBackend()
    with g.capture():
        (x * 3).exp()  # dropped at once: a dead value
        y = x + 1
    assert g.compiled is not None
    assert g.compiled.num_ops == 1
    x.fill_(2.0)
    g.replay()
    assert torch.equal(y, torch.full_like(y, 3.0))


def test_a_rebinding_inside_capture_is_followed_as_a_cuda_graph_would() -> None:
    # Kernels captured after `a.data = ...` read the new memory; those before, the old.
    a = torch.ones(3)
    g = Graph(backend="cpu")
    with torch.no_grad(), g.capture():
        before = a * 2
        a.data = torch.full((3,), 5.0)
        after = a * 2
    g.replay()
    assert before.tolist() == [2.0, 2.0, 2.0]
    assert after.tolist() == [10.0, 10.0, 10.0]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.head = nn.Linear(8, 5)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))  # [B, 8]
        return F.softmax(self.head(F.silu(h)), dim=-1)  # [B, 5]


@given(
    scales=st.lists(st.floats(-2.0, 2.0, allow_nan=False), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_property_an_mlp_replays_bit_identical_to_eager_after_in_place_updates(
    scales: list[float], seed: int
) -> None:
    torch.manual_seed(seed)
    model = MLP().eval()
    x = torch.randn(4, 8)
    g, out = _captured(model, x)
    params = list(model.parameters())
    for i, s in enumerate(scales):
        with torch.no_grad():
            params[(seed + i) % len(params)].mul_(s).add_(0.01)
            x.add_(s)
        g.replay()
        assert torch.equal(out, _eager(model, x))
