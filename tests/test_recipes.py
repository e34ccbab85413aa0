"""Recipes (`graphsafe.recipes`): each against a plain-torch reference written here.

Every property has a control: the same check applied to a plausible wrong variant (the
wrong dim, a non-contiguous transpose, the scale of the wrong FP8 format, an untransposed
`w_uv`, ...) fails. The `out=` path equals the no-out result and keeps the out storage;
wired into graphsafe by every declaration path, a recipe refreshes on the fast path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import graphsafe as gs
from graphsafe import recipes

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
dtypes = st.sampled_from(DTYPES)


def _tensor(shape: Sequence[int], dtype: torch.dtype, seed: int, scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(tuple(shape), generator=g)).to(dtype)


def _owns(result: Tensor, inputs: Sequence[Tensor]) -> bool:
    """The result shares no memory with any input (it may outlive their next load)."""
    ptr = result.untyped_storage().data_ptr()
    return all(ptr != t.untyped_storage().data_ptr() for t in inputs)


def _fill_garbage(t: Tensor) -> Tensor:
    """Out buffers that hold something else first, as stale derived buffers do."""
    if t.dtype in FP8:
        return t.view(torch.uint8).fill_(0x55).view(t.dtype)
    return t.fill_(7.0)


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.uint8) if t.dtype in FP8 else t


def _bytes(t: Tensor) -> Tensor:
    """Raw bytes: uninitialized float memory may hold NaNs, which equal nothing."""
    return t.contiguous().view(torch.uint8)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def check_out_path(fn: recipes.Recipe, *inputs: Tensor) -> None:
    """`fn(..., out=buffers)` writes the no-out result into the buffers and returns them."""
    fresh = fn(None, *inputs)
    several = isinstance(fresh, tuple)
    results = fresh if several else (fresh,)
    buffers = tuple(_fill_garbage(torch.empty_like(r)) for r in results)
    ptrs = [b.data_ptr() for b in buffers]
    ret = fn(None, *inputs, out=buffers if several else buffers[0])
    rets = ret if several else (ret,)
    assert all(r is b for r, b in zip(rets, buffers)), "out= must return the out buffers"
    assert [b.data_ptr() for b in buffers] == ptrs
    for r, b in zip(results, buffers):
        assert _same(b, r), "out= result differs from the no-out result"


# -----------------------------------------------------------------------------
# concat


def ref_concat(tensors: Sequence[Tensor], dim: int) -> Tensor:
    d = dim % tensors[0].dim()
    shape = list(tensors[0].shape)
    shape[d] = sum(t.shape[d] for t in tensors)
    out = torch.empty(shape, dtype=tensors[0].dtype)
    start = 0
    for t in tensors:
        out.narrow(d, start, t.shape[d]).copy_(t)
        start += t.shape[d]
    return out


def check_concat(fn: recipes.Recipe, tensors: Sequence[Tensor], dim: int) -> None:
    got = fn(None, *tensors)
    assert _same(got, ref_concat(tensors, dim))
    assert got.is_contiguous() and _owns(got, tensors)


concat_cases = st.builds(
    lambda rows, cols, dim, dtype, seed: (
        [_tensor((r, cols) if dim == 0 else (cols, r), dtype, seed + i)
         for i, r in enumerate(rows)],
        dim,
    ),
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.integers(1, 6),
    st.sampled_from([0, 1, -1]),
    dtypes,
    st.integers(0, 1000),
)


@given(concat_cases)
def test_concat_equals_the_reference(case: tuple[list[Tensor], int]) -> None:
    tensors, dim = case
    check_concat(recipes.concat(dim), tensors, dim)
    check_out_path(recipes.concat(dim), *tensors)


def test_control_concat_along_the_wrong_dim_fails_the_check() -> None:
    tensors = [_tensor((2, 3), torch.float32, 0), _tensor((2, 3), torch.float32, 1)]
    with pytest.raises(AssertionError):
        check_concat(recipes.concat(1), tensors, 0)


# -----------------------------------------------------------------------------
# transpose


def ref_transpose(w: Tensor, dim0: int, dim1: int) -> Tensor:
    perm = list(range(w.dim()))
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    out = torch.empty([w.shape[p] for p in perm], dtype=w.dtype)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in w.shape]).view(-1, w.dim()):
        src = index.tolist()
        out[tuple(src[p] for p in perm)] = w[tuple(src)]
    return out


def check_transpose(fn: recipes.Recipe, w: Tensor, dim0: int, dim1: int) -> None:
    got = fn(None, w)
    assert _same(got, ref_transpose(w, dim0, dim1))
    assert got.is_contiguous(), "a kernel reading [in, out] needs contiguous memory"
    assert _owns(got, [w])


@given(
    st.lists(st.integers(1, 4), min_size=2, max_size=3),
    st.data(),
    dtypes,
    st.integers(0, 1000),
)
def test_transpose_is_a_contiguous_copy(shape: list[int], data: Any, dtype: torch.dtype,
                                        seed: int) -> None:
    dim0, dim1 = data.draw(st.permutations(range(len(shape))))[:2]
    w = _tensor(shape, dtype, seed)
    check_transpose(recipes.transpose(dim0, dim1), w, dim0, dim1)
    check_out_path(recipes.transpose(dim0, dim1), w)


def test_transpose_over_a_size_one_dim_still_owns_its_memory() -> None:
    w = _tensor((1, 5), torch.float32, 0)  # w.t() is contiguous: .contiguous() is a view
    check_transpose(recipes.transpose(), w, 0, 1)


def test_control_a_transposed_view_fails_the_check() -> None:
    def view_only(module: object, w: Tensor, *, out: Tensor | None = None) -> Tensor:
        return w.t()

    with pytest.raises(AssertionError, match="contiguous"):
        check_transpose(view_only, _tensor((3, 4), torch.float32, 0), 0, 1)


# -----------------------------------------------------------------------------
# fp8_quantize


def ref_fp8(
    w: Tensor, block: tuple[int, int] | None, fp8: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Block by block in plain torch: scale = amax / finfo.max, zeros get 1 / finfo.max."""
    fmax = torch.finfo(fp8).max
    wf = w.float()
    if block is None:
        amax = wf.abs().max()
        s = amax / fmax if amax / fmax > 0 else torch.tensor(1.0 / fmax)
        return (wf / s).clamp(-fmax, fmax).to(fp8), s.reshape(1)
    (M, N), (bm, bn) = w.shape, block
    Mb, Nb = math.ceil(M / bm), math.ceil(N / bn)
    q = torch.empty(M, N, dtype=fp8)
    scales = torch.empty(Mb, Nb)
    for i in range(Mb):
        for j in range(Nb):
            blk = wf[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            s = blk.abs().max() / fmax
            s = s if s > 0 else torch.tensor(1.0 / fmax)
            scales[i, j] = s
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (blk / s).clamp(-fmax, fmax).to(fp8)
    return q, scales


def ref_dequant(q: Tensor, scales: Tensor, block: tuple[int, int] | None) -> Tensor:
    if block is None:
        return q.float() * scales
    (M, N), (bm, bn) = q.shape, block
    full = scales.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:M, :N]
    return q.float() * full


def check_fp8(
    fn: recipes.Recipe, w: Tensor, block: tuple[int, int] | None, fp8: torch.dtype
) -> None:
    q, scales = fn(None, w)
    want_q, want_s = ref_fp8(w, block, fp8)
    assert _same(scales, want_s), "scales differ from amax / finfo(dtype).max"
    assert _same(q, want_q), "quantized weights differ"
    deq = ref_dequant(q, scales, block)
    assert torch.isfinite(deq).all() and torch.isfinite(scales).all()
    # Half an FP8 step: eps/2 relative for normal values, eps/2 * tiny * scale below.
    info = torch.finfo(fp8)
    scale_of = ref_dequant(torch.ones_like(q), scales, block)
    bound = info.eps / 2 * torch.maximum(w.float().abs(), scale_of * info.tiny)
    assert ((deq - w.float()).abs() <= bound * (1 + 1e-6)).all(), "error above half a step"
    assert torch.equal(recipes.dequantize_fp8(q, scales, block=block), deq)


def _weights_with_zero_blocks(data: Any, M: int, N: int, dtype: torch.dtype) -> Tensor:
    w = _tensor((M, N), dtype, data.draw(st.integers(0, 10_000)),
                scale=data.draw(st.sampled_from([1e-3, 1.0, 300.0])))
    for _ in range(data.draw(st.integers(0, 2))):  # zero rectangles: all-zero blocks
        i, j = data.draw(st.integers(0, M - 1)), data.draw(st.integers(0, N - 1))
        w[i : i + data.draw(st.integers(1, M)), j : j + data.draw(st.integers(1, N))] = 0
    return w


@given(
    st.integers(1, 40), st.integers(1, 40),
    st.one_of(st.none(), st.tuples(st.integers(1, 16), st.integers(1, 16))),
    dtypes, st.sampled_from(FP8), st.data(),
)
def test_fp8_quantize_equals_the_reference_within_half_a_step(
    M: int, N: int, block: tuple[int, int] | None, dtype: torch.dtype, fp8: torch.dtype,
    data: Any,
) -> None:
    w = _weights_with_zero_blocks(data, M, N, dtype)
    fn = recipes.fp8_quantize(block=block, dtype=fp8)
    check_fp8(fn, w, block, fp8)
    check_out_path(fn, w)
    _, scales = fn(None, w)
    assert scales.shape == ((1,) if block is None else (-(-M // block[0]), -(-N // block[1])))


def test_fp8_all_zero_weight_gets_finite_scales_and_zeros() -> None:
    q, scales = recipes.fp8_quantize(block=(2, 3))(None, torch.zeros(3, 5))
    assert torch.equal(scales, torch.full((2, 2), 1 / 448.0))
    assert torch.equal(q.float(), torch.zeros(3, 5))


def test_fp8_per_tensor_takes_any_shape() -> None:
    w = _tensor((2, 3, 4), torch.bfloat16, 0)
    check_fp8(recipes.fp8_quantize(), w, None, torch.float8_e4m3fn)


def test_control_scale_of_the_wrong_format_fails_the_check() -> None:
    """A scale computed with e5m2's max but stored as e4m3 saturates the weights."""
    def wrong_finfo(module: object, w: Tensor, *, out: Any = None) -> tuple[Tensor, Tensor]:
        _, s = recipes.fp8_quantize(block=(4, 4), dtype=torch.float8_e5m2)(module, w)
        return (w.float() / s.repeat_interleave(4, 0).repeat_interleave(4, 1)[: w.shape[0],
                : w.shape[1]]).clamp(-448, 448).to(torch.float8_e4m3fn), s

    with pytest.raises(AssertionError, match="scales differ"):
        check_fp8(wrong_finfo, _tensor((6, 6), torch.float32, 0), (4, 4), torch.float8_e4m3fn)


def test_control_scale_grid_transposed_fails_the_check() -> None:
    def transposed(module: object, w: Tensor, *, out: Any = None) -> tuple[Tensor, Tensor]:
        q, s = recipes.fp8_quantize(block=(2, 2))(module, w)
        return q, s.t().contiguous()

    with pytest.raises(AssertionError, match="scales differ"):
        check_fp8(transposed, _tensor((4, 6), torch.float32, 1), (2, 2), torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block": (0, 4)}, "two positive ints"),
        ({"block": (4,)}, "two positive ints"),
        ({"dtype": torch.float16}, "float8_e4m3fn or torch.float8_e5m2"),
    ],
)
def test_fp8_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        recipes.fp8_quantize(**kwargs)


def test_fp8_block_needs_a_matrix() -> None:
    with pytest.raises(ValueError, match=r"expected a 2-D weight \[M, N\]"):
        recipes.fp8_quantize(block=(2, 2))(None, torch.ones(2, 2, 2))


# -----------------------------------------------------------------------------
# mla_absorb


def ref_mla(w: Tensor, H: int, dn: int, dv: int) -> tuple[Tensor, Tensor]:
    r = w.shape[1]
    w_uk = torch.empty(H, dn, r, dtype=w.dtype)
    w_uv = torch.empty(H, r, dv, dtype=w.dtype)
    for h in range(H):
        rows = w[h * (dn + dv) : (h + 1) * (dn + dv)]  # [dn + dv, r]: k_nope rows, then v rows
        w_uk[h] = rows[:dn]
        for c in range(dv):
            w_uv[h, :, c] = rows[dn + c]
    return w_uk, w_uv


def check_mla(fn: recipes.Recipe, w: Tensor, H: int, dn: int, dv: int) -> None:
    w_uk, w_uv = fn(None, w)
    want_uk, want_uv = ref_mla(w, H, dn, dv)
    assert _same(w_uk, want_uk), "w_uk differs"
    assert _same(w_uv, want_uv), "w_uv differs"
    assert w_uk.is_contiguous() and w_uv.is_contiguous()
    assert _owns(w_uk, [w]) and _owns(w_uv, [w])


@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 5), st.integers(1, 6), dtypes,
       st.integers(0, 1000))
def test_mla_absorb_splits_and_transposes(H: int, dn: int, dv: int, r: int,
                                          dtype: torch.dtype, seed: int) -> None:
    w = _tensor((H * (dn + dv), r), dtype, seed)
    fn = recipes.mla_absorb(num_heads=H, qk_nope_head_dim=dn, v_head_dim=dv)
    check_mla(fn, w, H, dn, dv)
    check_out_path(fn, w)


def test_control_w_uv_not_transposed_fails_the_check() -> None:
    H, dn, dv, r = 2, 3, 4, 4  # r == dv: the untransposed w_uv has the right shape
    def untransposed(module: object, w: Tensor, *, out: Any = None) -> tuple[Tensor, Tensor]:
        kv = w.view(H, dn + dv, r)
        return kv[:, :dn].clone(), kv[:, dn:].clone()

    with pytest.raises(AssertionError, match="w_uv differs"):
        check_mla(untransposed, _tensor((H * (dn + dv), r), torch.float32, 0), H, dn, dv)


def test_mla_absorb_rejects_a_weight_of_the_wrong_height() -> None:
    fn = recipes.mla_absorb(num_heads=2, qk_nope_head_dim=3, v_head_dim=4)
    with pytest.raises(ValueError, match=r"\[14, r\], got \[13, 5\]"):
        fn(None, torch.ones(13, 5))


# -----------------------------------------------------------------------------
# lora_merge

LORA_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def check_lora(fn: recipes.Recipe, base: Tensor, a: Tensor, b: Tensor, scaling: float) -> None:
    got = fn(None, base, a, b)
    want = base.double() + scaling * (b.double() @ a.double())
    tol = LORA_TOL[base.dtype] * (1 + want.abs().max().item())
    assert got.dtype == base.dtype and got.shape == base.shape
    assert (got.double() - want).abs().max().item() <= tol, "merged weight differs"
    assert _owns(got, [base, a, b])


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 4), st.floats(-4, 4), dtypes,
       st.integers(0, 1000))
def test_lora_merge_equals_base_plus_scaled_product(n_out: int, n_in: int, r: int,
                                                    scaling: float, dtype: torch.dtype,
                                                    seed: int) -> None:
    shapes = [(n_out, n_in), (r, n_in), (n_out, r)]  # base, lora_a, lora_b
    base, a, b = (_tensor(s, dtype, seed + k) for k, s in enumerate(shapes))
    fn = recipes.lora_merge(scaling=scaling)
    check_lora(fn, base, a, b, scaling)
    check_out_path(fn, base, a, b)


def test_control_scaling_on_the_base_fails_the_check() -> None:
    def wrong(module: object, base: Tensor, a: Tensor, b: Tensor, *, out: Any = None) -> Tensor:
        return 0.5 * base + b @ a

    base, a, b = _tensor((4, 4), torch.float32, 0), _tensor((2, 4), torch.float32, 1), _tensor(
        (4, 2), torch.float32, 2)
    with pytest.raises(AssertionError, match="merged weight differs"):
        check_lora(wrong, base, a, b, 0.5)


# -----------------------------------------------------------------------------
# fold_streams


def check_fold(fn: recipes.Recipe, hc_fn: Tensor, n: int, C: int) -> None:
    got = fn(None, hc_fn)
    want = hc_fn[:, :C].double()
    for k in range(1, n):  # stream k's block of columns: k*C .. (k+1)*C
        want = want + hc_fn[:, k * C : (k + 1) * C].double()
    assert got.shape == (hc_fn.shape[0], C)
    assert torch.allclose(got.double(), want, rtol=1e-2 if hc_fn.dtype != torch.float32 else
                          1e-6, atol=1e-2 if hc_fn.dtype != torch.float32 else 1e-6)


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 8), dtypes, st.integers(0, 1000))
def test_fold_streams_sums_the_stream_blocks(n: int, C: int, mix: int, dtype: torch.dtype,
                                             seed: int) -> None:
    hc_fn = _tensor((mix, n * C), dtype, seed)
    check_fold(recipes.fold_streams(n, C), hc_fn, n, C)
    check_out_path(recipes.fold_streams(n, C), hc_fn)


def test_control_fold_with_the_streams_interleaved_fails_the_check() -> None:
    def interleaved(module: object, hc_fn: Tensor, *, out: Any = None) -> Tensor:
        return hc_fn.view(hc_fn.shape[0], 3, 2).sum(2)  # [mix, C, n]: the wrong layout

    with pytest.raises(AssertionError):
        check_fold(interleaved, _tensor((4, 6), torch.float32, 0), 2, 3)


def test_flagship_fold_streams_is_the_recipe() -> None:
    from graphsafe.models.deepseek_v4 import fold_streams

    hc_fn = _tensor((24, 4 * 8), torch.float32, 0)
    assert torch.equal(fold_streams(hc_fn, 4, 8), recipes.fold_streams(4, 8)(None, hc_fn))


# -----------------------------------------------------------------------------
# out= fits or is refused


@pytest.mark.parametrize(
    ("fn", "inputs", "out"),
    [
        (recipes.concat(0), (torch.ones(2, 3), torch.ones(1, 3)), torch.empty(2, 3)),
        (recipes.transpose(), (torch.ones(2, 3),), torch.empty(2, 3)),
        (recipes.fp8_quantize(block=(2, 2)), (torch.ones(4, 4),),
         (torch.empty(4, 4, dtype=torch.float8_e4m3fn), torch.empty(2, 3))),
        (recipes.fp8_quantize(), (torch.ones(4, 4),),
         (torch.empty(4, 4), torch.empty(1))),  # float32 where FP8 belongs
        (recipes.mla_absorb(num_heads=1, qk_nope_head_dim=2, v_head_dim=3), (torch.ones(5, 4),),
         (torch.empty(1, 2, 4), torch.empty(1, 3, 4))),
        (recipes.lora_merge(scaling=1.0), (torch.ones(3, 3), torch.ones(1, 3), torch.ones(3, 1)),
         torch.empty(3, 1)),
        (recipes.fold_streams(2, 3), (torch.ones(4, 6),), torch.empty(4, 1)),
    ],
)
def test_an_out_buffer_that_does_not_fit_is_refused_before_writing(
    fn: recipes.Recipe, inputs: tuple[Tensor, ...], out: Any
) -> None:
    buffers = out if isinstance(out, tuple) else (out,)
    before = [_bytes(b).clone() for b in buffers]
    with pytest.raises(gs.DerivationDriftError, match="does not fit the result"):
        fn(None, *inputs, out=out)
    assert all(torch.equal(_bytes(b), x) for b, x in zip(buffers, before))


# -----------------------------------------------------------------------------
# every declaration path, on the fast path


class Attn(nn.Module):
    """A plain module with the inputs of every recipe."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.kv_b = nn.Parameter(torch.randn(2 * (3 + 4), 5))
        self.lora_a, self.lora_b = nn.Parameter(torch.randn(2, 8)), nn.Parameter(torch.randn(8, 2))
        self.hc_fn = nn.Parameter(torch.randn(6, 4 * 2))
        self.requires_grad_(False)

    def load_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))


DECLARED: list[tuple[tuple[str, ...], list[str], recipes.Recipe]] = [
    (("wqkv",), ["wq.weight", "wk.weight", "wv.weight"], recipes.concat(0)),
    (("wq_t",), ["wq.weight"], recipes.transpose()),
    (("wk_fp8", "wk_scale_inv"), ["wk.weight"], recipes.fp8_quantize(block=(3, 5))),
    (("w_uk", "w_uv"), ["kv_b"], recipes.mla_absorb(num_heads=2, qk_nope_head_dim=3,
                                                    v_head_dim=4)),
    (("wq_merged",), ["wq.weight", "lora_a", "lora_b"], recipes.lora_merge(scaling=0.25)),
    (("hc_folded",), ["hc_fn"], recipes.fold_streams(4, 2)),
]


def _register_all(reg: gs.Registry, cls: type, how: str) -> None:
    for outputs, inputs, fn in DECLARED:
        if how == "register":
            reg.register(cls, gs.Derivation(outputs=outputs, inputs=inputs, fn=fn))
        else:
            reg.derive(cls, outputs, inputs=inputs)(fn)


def _class_body_declared(registry: gs.Registry) -> type[nn.Module]:
    namespace: dict[str, Any] = {
        f"_d{i}": recipes.derive(outputs, inputs=inputs, fn=fn)
        for i, (outputs, inputs, fn) in enumerate(DECLARED)
    }
    return gs.graphsafe(registry=registry)(type("DeclaredAttn", (Attn,), namespace))


def _expected(m: nn.Module) -> dict[str, Tensor]:
    values: dict[str, Tensor] = {}
    for outputs, inputs, fn in DECLARED:
        args = [m.get_parameter(p) for p in inputs]
        result = fn(m, *args)
        values.update(zip(outputs, result if isinstance(result, tuple) else (result,)))
    return values


@pytest.mark.parametrize("how", ["register", "derive", "class body"])
def test_every_declaration_path_refreshes_in_place_on_the_fast_path(how: str) -> None:
    reg = gs.Registry()
    if how == "class body":
        model = _class_body_declared(reg)()
    else:
        class Local(Attn):
            pass

        _register_all(reg, Local, how)
        model = Local()
    rt = gs.runtime(model, reg)
    with gs.weight_update(model):
        model.load_weights(0)
    buffers = {name: getattr(model, name) for name in _expected(model)}
    ptrs = {name: t.data_ptr() for name, t in buffers.items()}
    with gs.weight_update(model):
        model.load_weights(1)
    report = rt.last_report
    assert report is not None and len(report.refreshed) == len(DECLARED)
    assert report.slow_path == (), "every recipe takes out= and returns it"
    for name, want in _expected(model).items():
        assert getattr(model, name) is buffers[name]
        assert getattr(model, name).data_ptr() == ptrs[name]
        assert _same(getattr(model, name), want), name


def test_control_a_function_that_ignores_out_takes_the_slow_path() -> None:
    reg = gs.Registry()

    class Local(Attn):
        pass

    reg.derive(Local, "wqkv", inputs=["wq.weight", "wk.weight", "wv.weight"])(
        lambda m, *ws, out=None: torch.cat(ws)
    )
    model = Local()
    rt = gs.runtime(model, reg)
    for seed in (0, 1):
        with gs.weight_update(model):
            model.load_weights(seed)
    assert rt.last_report is not None and rt.last_report.slow_path == ("wqkv",)


def test_one_recipe_object_serves_several_class_body_declarations() -> None:
    fuse = recipes.concat(0)
    reg = gs.Registry()
    namespace = {
        "_qk": recipes.derive("wqk", inputs=["wq.weight", "wk.weight"], fn=fuse),
        "_kv": recipes.derive("wkv", inputs=["wk.weight", "wv.weight"], fn=fuse),
    }
    model = gs.graphsafe(registry=reg)(type("Fused", (Attn,), namespace))()
    gs.runtime(model, reg).refresh()
    assert model.wqk.shape == (12, 8) and model.wkv.shape == (8, 8)


def test_control_marking_one_function_twice_loses_a_declaration() -> None:
    fuse = recipes.concat(0)
    namespace = {
        "_qk": gs.derive("wqk", inputs=["wq.weight", "wk.weight"])(fuse),
        "_kv": gs.derive("wkv", inputs=["wk.weight", "wv.weight"])(fuse),
    }
    with pytest.raises(gs.RegistrationError, match="output 'wkv' is declared twice"):
        gs.graphsafe(registry=gs.Registry())(type("Fused", (Attn,), namespace))


def test_recipe_signatures_are_checked_at_registration() -> None:
    reg = gs.Registry()

    class Local(Attn):
        pass

    with pytest.raises(gs.RegistrationError, match="signature that does not fit its inputs"):
        reg.register(Local, gs.Derivation(outputs="t", inputs=["wq.weight", "wk.weight"],
                                          fn=recipes.transpose()))


def test_recipes_are_named_in_reports() -> None:
    names: list[Callable[..., Any]] = [recipes.concat(1), recipes.fp8_quantize(block=(2, 2))]
    assert [gs.Derivation(outputs="x", inputs=["w"], fn=f).name for f in names] == [
        "concat(dim=1)",
        "fp8_quantize(block=(2, 2), dtype=torch.float8_e4m3fn)",
    ]


@pytest.mark.parametrize(
    "fn",
    [recipes.concat(1), recipes.transpose(), recipes.fp8_quantize(), recipes.fp8_quantize(
        block=(3, 4)), recipes.mla_absorb(num_heads=2, qk_nope_head_dim=3, v_head_dim=4),
     recipes.fold_streams(5, 1)],
    ids=lambda f: f.__qualname__,
)
def test_a_non_contiguous_input_gives_the_contiguous_input_result(fn: recipes.Recipe) -> None:
    w = _tensor((5, 14), torch.float32, 0).t()  # [14, 5], strides (1, 14)
    got, want = fn(None, w), fn(None, w.contiguous())
    for a, b in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        assert _same(a, b)


# -----------------------------------------------------------------------------
# place_experts: an expert-load balancer's physical slots


E, P, D = 3, 5, 2  # logical experts, physical slots, expert width


@gs.graphsafe
class BalancedMoE(nn.Module):
    """Experts served from physical slots by a balancer's map, the slots declared."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.zeros(E, D, D), requires_grad=False)
        self.register_buffer("physical_to_logical", torch.tensor([0, 1, 2, 0, 1]),
                             persistent=False)

    _physical = recipes.derive("physical", inputs=["experts", "physical_to_logical"],
                               fn=recipes.place_experts())

    def load_weights(self, weights: dict[str, Tensor]) -> None:
        for name, w in weights.items():
            gs.load_into(self.get_parameter(name), w, name=name)

    def forward(self, x: Tensor, slots: Tensor) -> Tensor:
        return torch.einsum("td,tde->te", x, self.physical[slots])  # [T, D]


def _experts(seed: int) -> Tensor:
    return torch.randn(E, D, D, generator=torch.Generator().manual_seed(seed))


def _served(experts: Tensor, mapping: Tensor, x: Tensor, slots: Tensor) -> Tensor:
    return torch.einsum("td,tde->te", x, experts[mapping[slots]])


def _balanced_capture() -> tuple[BalancedMoE, gs.Graph, Tensor, Tensor, Tensor]:
    m = BalancedMoE()
    m.load_weights({"experts": _experts(0)})
    x, slots = torch.ones(P, D), torch.arange(P)
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = m(x, slots)
    return m, g, y, x, slots


def test_place_experts_follows_a_load_and_a_rebalance_in_place() -> None:
    m, g, y, x, slots = _balanced_capture()
    m.load_weights({"experts": _experts(1)})
    g.replay()
    assert torch.allclose(y, _served(_experts(1), m.physical_to_logical, x, slots))
    # A rebalance while serving, in an update block: the slots follow the new map.
    moved = torch.tensor([2, 2, 1, 0, 0])
    with gs.weight_update(m):
        m.physical_to_logical.copy_(moved)
    g.replay()
    assert torch.allclose(y, _served(_experts(1), moved, x, slots))


def test_control_a_rebalance_outside_any_update_is_refused_not_served() -> None:
    m, g, _, _, _ = _balanced_capture()
    m.physical_to_logical.copy_(torch.tensor([2, 2, 1, 0, 0]))  # seen by its version
    with pytest.raises(gs.StaleError, match="physical"):
        g.replay()


def test_control_slots_written_in_checkpoint_order_serve_the_wrong_expert() -> None:
    """What the recipe prevents (prime-rl #3583): a sync writing the experts into the
    slots in checkpoint order, under a map that is not the identity."""
    mapping = torch.tensor([2, 2, 1, 0, 0])
    experts = _experts(1)
    slots_in_checkpoint_order = torch.cat([experts, experts[: P - E]])  # slot s <- expert s
    x, slots = torch.ones(P, D), torch.arange(P)
    served = torch.einsum("td,tde->te", x, slots_in_checkpoint_order[slots])
    assert not torch.allclose(served, _served(experts, mapping, x, slots))


def test_place_experts_refuses_a_map_naming_no_expert() -> None:
    fn = recipes.place_experts()
    with pytest.raises(gs.GraphSafetyError, match=r"(?s)expected:.*\[0, 3\).*got:.*expert 7"):
        fn(BalancedMoE(), _experts(0), torch.tensor([0, 7]))
    with pytest.raises(gs.GraphSafetyError, match=r"dtype torch\.float32"):
        fn(BalancedMoE(), _experts(0), torch.tensor([0.0, 1.0]))


class _PermutedSlots(nn.Module):
    """As many slots as experts, permuted by a balancer; the map under the name vLLM and
    SGLang give it, so a load's writes into `experts` are judged as an expert layout."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.zeros(E, D, D), requires_grad=False)
        self.register_buffer("physical_to_logical_map", torch.tensor([2, 0, 1]),
                             persistent=False)

    def load_weights(self, weights: dict[str, Tensor]) -> None:
        for name, w in weights.items():  # the checkpoint's logical order
            gs.load_into(self.get_parameter(name), w, name=name)


@gs.graphsafe
class PlacedMoE(_PermutedSlots):
    """The slots declared from the logical experts and the map: loads write `experts` in
    logical order, as the checkpoint holds them."""

    _physical = recipes.derive("physical", inputs=["experts", "physical_to_logical_map"],
                               fn=recipes.place_experts())

    def forward(self, x: Tensor, slots: Tensor) -> Tensor:
        return torch.einsum("td,tde->te", x, self.physical[slots])  # [T, D]


@gs.graphsafe
class UnplacedMoE(_PermutedSlots):
    """The control: `experts` serves as the physical slots themselves."""

    def forward(self, x: Tensor, slots: Tensor) -> Tensor:
        return torch.einsum("td,tde->te", x, self.experts[slots])  # [T, D]


@pytest.mark.parametrize("model_class", [PlacedMoE, UnplacedMoE],
                         ids=["place_experts", "control-no-recipe"])
def test_place_experts_under_a_balancers_map_is_no_false_alarm(
        model_class: type[_PermutedSlots]) -> None:
    m = model_class()
    x, slots = torch.ones(E, D), torch.arange(E)
    if model_class is PlacedMoE:
        m.load_weights({"experts": _experts(1)})
        assert torch.allclose(m(x, slots), _served(_experts(1), m.physical_to_logical_map,
                                                   x, slots))
    else:  # the same load into slots the map permuted: each token the wrong expert
        with pytest.raises(gs.StaleError, match=r"(?s)the root \(UnplacedMoE\).*experts "
                           r"with loaded values and never read the map "
                           r"physical_to_logical_map.*place_experts"):
            m.load_weights({"experts": _experts(1)})
        assert not torch.allclose(m(x, slots), _served(
            _experts(1), m.physical_to_logical_map, x, slots))
