"""`gs.load_into`: the in-place write of a checkpoint entry, refusing what `copy_` fudges.

Each refusal is paired with its control: the same entry through the bare loader idiom
`param.data.copy_(w)` loads silently wrong (broadcast rows, a cast dtype). A property
test checks that where shapes and dtypes match, `load_into` is exactly `copy_` and keeps
the parameter's storage.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import graphsafe as gs

D = 4


def _param() -> nn.Parameter:
    return nn.Parameter(torch.arange(D * D, dtype=torch.float32).view(D, D), requires_grad=False)


def _storage(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return (id(t), t.data_ptr(), tuple(t.shape), t.stride())


def test_load_into_writes_in_place() -> None:
    p = _param()
    before = _storage(p)
    w = torch.randn(D, D)
    gs.load_into(p, w, name="w")
    assert torch.equal(p, w)
    assert _storage(p) == before


def test_load_into_refuses_a_row_that_copy_would_broadcast() -> None:
    p = _param()
    old = p.detach().clone()
    row = torch.randn(1, D)
    with pytest.raises(
        gs.WeightLoadError,
        match=r"checkpoint entry 'layers\.0\.w' has the wrong shape\n(.|\n)*"
        rf"expected: +shape \({D}, {D}\)\n +got: +shape \(1, {D}\)\n +fix: +convert the entry",
    ) as info:
        gs.load_into(p, row, name="layers.0.w")
    assert info.value.name == "layers.0.w"
    assert torch.equal(p, old)  # nothing written


def test_control_copy_broadcasts_the_row_silently() -> None:
    p = _param()
    row = torch.randn(1, D)
    p.data.copy_(row)  # no error: every row is now the checkpoint's one row
    assert torch.equal(p, row.expand(D, D))


def test_load_into_refuses_another_dtype_unless_cast() -> None:
    p = _param()
    old = p.detach().clone()
    w = torch.randn(D, D, dtype=torch.float64)
    with pytest.raises(
        gs.WeightLoadError,
        match=r"'w' has the wrong dtype\n(.|\n)*expected: +dtype torch\.float32\n"
        r" +got: +dtype torch\.float64\n +fix: .*cast=True",
    ):
        gs.load_into(p, w, name="w")
    assert torch.equal(p, old)
    gs.load_into(p, w, name="w", cast=True)
    assert torch.equal(p, w.to(torch.float32))


def test_control_copy_casts_silently() -> None:
    p = _param()
    w = torch.full((D, D), 1.0 + 2.0**-30, dtype=torch.float64)
    p.data.copy_(w)  # no error: the low bits are gone
    assert p.dtype == torch.float32
    assert not torch.equal(p.double(), w)


def test_cast_does_not_excuse_a_wrong_shape() -> None:
    p = _param()
    old = p.detach().clone()
    with pytest.raises(gs.WeightLoadError, match="wrong shape"):
        gs.load_into(p, torch.randn(1, D, dtype=torch.float64), name="w", cast=True)
    assert torch.equal(p, old)


@pytest.mark.parametrize(
    ("value", "got"),
    [([[0.0] * D] * D, "list"), (None, "NoneType"), (3.0, "float")],
    ids=["list", "none", "float"],
)
def test_load_into_refuses_a_non_tensor(value: object, got: str) -> None:
    p = _param()
    old = p.detach().clone()
    with pytest.raises(
        gs.WeightLoadError,
        match=rf"'w' is not a tensor\n(.|\n)*expected: +a torch\.Tensor of shape \({D}, {D}\) "
        rf"and dtype torch\.float32\n +got: +{got}\n +fix: .*torch\.as_tensor",
    ):
        gs.load_into(p, value, name="w")
    assert torch.equal(p, old)


def test_an_unnamed_entry_says_so() -> None:
    with pytest.raises(gs.WeightLoadError, match=r"checkpoint entry \(name unknown\)") as info:
        gs.load_into(_param(), torch.zeros(D))
    assert info.value.name == "<unknown>"


def test_load_into_needs_a_tensor_to_write() -> None:
    with pytest.raises(TypeError, match="load_into writes into a tensor, got list"):
        gs.load_into([0.0], torch.zeros(1))  # type: ignore[arg-type]


def test_a_zero_dim_entry_is_not_a_one_element_vector() -> None:
    p = nn.Parameter(torch.zeros(1), requires_grad=False)
    with pytest.raises(gs.WeightLoadError, match=r"expected: +shape \(1,\)\n +got: +shape \(\)"):
        gs.load_into(p, torch.tensor(1.0), name="scale")
    p.data.copy_(torch.tensor(1.0))  # control: copy_ takes it
    assert p.item() == 1.0


# -----------------------------------------------------------------------------
# in a graphsafe loader


@gs.graphsafe
class Scaled(nn.Module):
    """One weight and its derived double, loaded through `gs.load_into`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(D, D), requires_grad=False)

    @gs.derive("w2", inputs=["w"])
    def _w2(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mul(w, 2.0, out=out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w2.t()  # [T, D]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            gs.load_into(params[name], w, name=name)


def test_a_loader_built_on_load_into_is_tracked_and_refits_a_guarded_graph() -> None:
    model = Scaled()
    model.load_weights([("w", torch.randn(D, D))])
    x = torch.randn(3, D)
    g = gs.Graph(backend="cpu", guard=model)
    with torch.no_grad(), g.capture():
        out = model(x)
    new = torch.randn(D, D)
    with gs.weight_update(model):
        model.load_weights([("w", new)])
    g.replay()
    assert torch.allclose(out, x @ (2 * new).t())


def test_a_refused_entry_fails_the_load_closed() -> None:
    model = Scaled()
    model.load_weights([("w", torch.randn(D, D))])
    before = model.w.detach().clone()
    with pytest.raises(gs.WeightLoadError, match=r"'w' has the wrong shape"):
        model.load_weights([("w", torch.randn(1, D))])
    assert torch.equal(model.w, before)
    with pytest.raises(gs.StaleError, match="the last weight update failed"):
        gs.runtime(model).assert_fresh()


# -----------------------------------------------------------------------------
# properties

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32]


@st.composite
def _pair(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    dtype = draw(st.sampled_from(_DTYPES))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    src = (torch.randn(shape, generator=g) * 100).to(dtype)
    dst = torch.zeros(shape, dtype=dtype)
    if draw(st.booleans()) and dst.dim() >= 2:
        # A non-contiguous target: the transpose of a tensor of the reversed shape.
        dst = torch.zeros(shape[::-1], dtype=dtype).permute(*reversed(range(len(shape))))
    return dst, src


@given(_pair())
def test_property_load_into_equals_copy_and_keeps_storage(
    pair: tuple[torch.Tensor, torch.Tensor],
) -> None:
    dst, src = pair
    expected = dst.clone().copy_(src)
    p = nn.Parameter(dst, requires_grad=False)
    before = _storage(p)
    gs.load_into(p, src, name="p")
    assert torch.equal(p.detach(), expected)
    assert _storage(p) == before


@given(_pair(), st.sampled_from(_DTYPES), st.integers(0, 3))
def test_property_any_mismatch_is_refused_and_writes_nothing(
    pair: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, extra: int
) -> None:
    dst, src = pair
    src = src.to(dtype)
    if extra:
        src = src.unsqueeze(0).expand(extra, *src.shape)  # broadcastable into nothing
    assume(src.shape != dst.shape or src.dtype != dst.dtype)
    before = dst.clone()
    with pytest.raises(gs.WeightLoadError, match=r"'p' (has the wrong (shape|dtype))"):
        gs.load_into(dst, src, name="p")
    assert torch.equal(dst, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_into_cuda_copies_across_devices() -> None:
    p = nn.Parameter(torch.zeros(D, D, device="cuda"), requires_grad=False)
    before = _storage(p)
    w = torch.randn(D, D)  # on the host, as checkpoints are
    gs.load_into(p, w, name="w")
    assert torch.equal(p.cpu(), w)
    assert _storage(p) == before
    with pytest.raises(gs.WeightLoadError, match="wrong shape"):
        gs.load_into(p, torch.randn(1, D), name="w")


# -----------------------------------------------------------------------------
# entries without data, parameters without memory, and other odd tensors


def test_load_into_refuses_an_entry_on_the_meta_device() -> None:
    p = _param()
    old = p.detach().clone()
    lazy = torch.empty(D, D, device="meta")  # a checkpoint loaded with device="meta"
    with pytest.raises(
        gs.WeightLoadError,
        match=r"checkpoint entry 'layers\.0\.w' holds no data: it is on the meta device\n"
        rf" +expected: +a dense tensor with data, of shape \({D}, {D}\) and dtype "
        r"torch\.float32\n +got: +a meta tensor of shape .*\n +fix: +load the checkpoint onto "
        r"a real device .*map_location=\"cpu\".*materialize a lazy tensor",
    ) as info:
        gs.load_into(p, lazy, name="layers.0.w")
    assert info.value.name == "layers.0.w"
    assert torch.equal(p, old)


def test_control_copy_from_meta_raises_torchs_raw_error() -> None:
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        _param().data.copy_(torch.empty(D, D, device="meta"))


def test_load_into_refuses_a_parameter_on_the_meta_device() -> None:
    lin = nn.Linear(D, D, device="meta")  # built on meta, never materialized
    with pytest.raises(
        gs.WeightLoadError,
        match=r"the parameter of checkpoint entry 'weight' holds no memory: it is on the meta "
        r"device\n(.|\n)*got: +a meta tensor of shape .* that no tracked load gives memory: "
        r"the write would be lost\n +fix: +materialize the model before loading "
        r"\(`model\.to_empty\(device=\.\.\.\)`",
    ):
        gs.load_into(lin.weight, torch.ones(D, D), name="weight")


def test_control_copy_into_meta_loses_the_write_silently() -> None:
    lin = nn.Linear(D, D, device="meta")
    lin.weight.data.copy_(torch.ones(D, D))  # no error, and nothing was written anywhere
    assert lin.weight.device.type == "meta"


@gs.graphsafe
class TransientScaled(nn.Module):
    """A transient checkpoint-format `w` (on meta between loads), loaded by `load_into`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(D, D), requires_grad=False)

    @gs.derive("w2", inputs=["w"], transient=["w"])
    def _w2(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w2.t()  # [T, D]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            gs.load_into(self.get_parameter(name), w, name=name)


def test_load_into_writes_a_released_transient_input_inside_a_tracked_load() -> None:
    model = TransientScaled()
    model.load_weights([("w", torch.randn(D, D))])
    assert model.w.device.type == "meta"  # released: the loader writes into a meta tensor
    x = torch.randn(3, D)
    g = gs.Graph(backend="cpu", guard=model)
    with torch.no_grad(), g.capture():
        out = model(x)
    new = torch.randn(D, D)
    with gs.weight_update(model):
        model.load_weights([("w", new)])
    g.replay()
    assert torch.allclose(out, x @ (2 * new).t())


def test_control_the_same_write_outside_a_tracked_load_is_refused() -> None:
    model = TransientScaled()
    model.load_weights([("w", torch.randn(D, D))])
    w2 = model.w2.clone()
    with pytest.raises(gs.WeightLoadError, match="holds no memory: it is on the meta device"):
        gs.load_into(model.w, torch.randn(D, D), name="w")  # no load gives it memory
    assert torch.equal(model.w2, w2)


@pytest.mark.parametrize(
    ("entry", "got"),
    [
        (torch.eye(D).to_sparse(), "a sparse_coo tensor"),
        (torch.nested.nested_tensor([torch.ones(D)] * D, layout=torch.jagged), "a nested tensor"),
    ],
    ids=["sparse", "nested"],
)
def test_load_into_refuses_an_entry_that_is_not_dense(entry: torch.Tensor, got: str) -> None:
    p = _param()
    old = p.detach().clone()
    with pytest.raises(
        gs.WeightLoadError,
        match=rf"'w' is not a dense tensor\n(.|\n)*got: +{got}\n +fix: .*to_dense",
    ):
        gs.load_into(p, entry, name="w")
    assert torch.equal(p, old)
    with pytest.raises((RuntimeError, ValueError)):  # control: copy_ raises torch's raw error
        p.data.copy_(entry)


def test_load_into_refuses_a_parameter_whose_elements_share_memory() -> None:
    row = torch.zeros(D)
    expanded = row.expand(D, D)  # every row is the same memory
    with pytest.raises(
        gs.WeightLoadError,
        match=rf"the parameter of checkpoint entry 'w' has elements that share memory\n"
        rf"(.|\n)*got: +stride \(0, 1\) for shape \({D}, {D}\) \(an expanded view\)",
    ):
        gs.load_into(expanded, torch.randn(D, D), name="w")
    assert torch.equal(row, torch.zeros(D))
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        expanded.copy_(torch.randn(D, D))  # control: torch's raw error


def test_load_into_refuses_a_complex_entry_even_with_cast() -> None:
    p = _param()
    old = p.detach().clone()
    entry = torch.full((D, D), 1 + 2j, dtype=torch.complex64)
    with pytest.raises(
        gs.WeightLoadError,
        match=r"'w' is complex and its parameter is not\n(.|\n)*got: +dtype torch\.complex64\n"
        r" +fix: +converting it would drop the imaginary part",
    ):
        gs.load_into(p, entry, name="w", cast=True)
    assert torch.equal(p, old)
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        p.data.copy_(entry)  # control: copy_ only warns, and the imaginary part is gone
    assert torch.equal(p, torch.ones(D, D))
