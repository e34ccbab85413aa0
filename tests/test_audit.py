"""The content audit (`gs.audit`, `gs.Graph(..., audit_every=N)`): writes no mechanism of
the guard sees are found by recomputing every derived tensor and comparing.

The control of each finding is the same write under the guard alone: a NumPy write into a
derivation's input moves no version counter and runs no dispatcher op, so the guarded
replay runs stale without the audit.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence

import pytest
import torch
from helpers import scaled_layer_class
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsafe as gs
from graphsafe._memory.compare import compare
from graphsafe._memory.journal import JOURNAL


@gs.graphsafe
class Packed(nn.Module):
    """A weight, its column sums (`out=`: the engine's hot path) and its transpose (no
    `out=`: computed apart), both read by the forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 6))

    @gs.derive("w_sum", inputs=["w"])
    def _w_sum(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sum(w, dim=0, out=out)  # [6]

    @gs.derive("w_t", inputs=["w"])
    def _w_t(self, w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous()  # [6, 4]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, 6]
        return x @ self.w_t + self.w_sum[:4]  # [N, 4]

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        for _, t in weights:
            gs.load_into(self.w, t, name="w")


def _loaded(seed: int = 0) -> Packed:
    model = Packed()
    model.load_weights([("w", torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)))])
    return model


def _x() -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(7))


def _correct(model: Packed, x: torch.Tensor) -> torch.Tensor:
    """What the forward pass gives with derived buffers recomputed from the weight as it is
    (through a transposed copy laid out as `w_t` is: a matmul over a transposed view may
    round differently, and the tests compare bit for bit)."""
    with torch.no_grad():
        w = model.w.detach()
        return x @ w.t().contiguous() + w.sum(0)[:4]


def _numpy_write(model: Packed, value: float = 3.0) -> None:
    model.w.detach().numpy()[:] = value  # no version counter, no dispatcher op


def _captured(model: nn.Module, x: torch.Tensor, **kw: object) -> tuple[gs.Graph, torch.Tensor]:
    g = gs.Graph(backend="cpu", guard=model, **kw)  # type: ignore[arg-type]
    with torch.no_grad(), g.capture():
        out = model(x)
    return g, out


# -- a NumPy write: invisible to the guard, visible to the audit ---------------------------


def test_control_a_numpy_write_replays_stale_under_the_guard_alone() -> None:
    model, x = _loaded(), _x()
    g, out = _captured(model, x)
    _numpy_write(model)
    g.replay()  # the guard sees nothing: no witness moved
    assert gs.runtime(model).stale == ()
    assert not torch.allclose(out, _correct(model, x))  # stale: the old derived buffers


def test_audit_finds_a_numpy_write_into_a_derivations_input() -> None:
    model = _loaded()
    assert gs.audit(model).checked == ("w_sum", "w_t")  # control: fresh, it passes
    _numpy_write(model)
    with pytest.raises(gs.StaleError, match=r"gs.audit: 2 derived tensor\(s\) differ") as info:
        gs.audit(model)
    assert info.value.paths == ("w_sum", "w_t")
    message = str(info.value)
    assert "w_sum (Packed._w_sum): 6 of 6 elements differ (bitwise)" in message
    assert "max abs difference" in message
    # The guard saw nothing: the write was one it cannot see.
    assert "no write graphsafe saw since its last refresh (w last recorded as written by " \
        "Packed.load_weights)" in message
    assert "gs.mark_written" in message and "refresh()" in message


def test_audit_keeps_its_host_scratch_with_the_model_and_still_finds_a_write() -> None:
    # A fresh host block is faulted in page by page on every audit; the one kept with the
    # model is reused, and what it held from the last audit is overwritten by the
    # recomputation, so it cannot hide a difference.
    from graphsafe._audit.audit import _AUDITORS

    model = _loaded()
    gs.audit(model)
    kept = _AUDITORS[model]._scratch[torch.device("cpu")]
    gs.audit(model)
    assert _AUDITORS[model]._scratch[torch.device("cpu")] is kept  # reused, not reallocated
    _numpy_write(model)  # control: the reused block holds the old sums; they must not pass
    with pytest.raises(gs.StaleError, match=r"w_sum \(Packed._w_sum\): 6 of 6 elements differ"):
        gs.audit(model)
    assert _AUDITORS[model]._scratch[torch.device("cpu")] is kept
    gs.runtime(model).refresh()
    gs.audit(model)  # refreshed: the same block, a clean audit


def test_the_kept_scratch_goes_with_the_model() -> None:
    from graphsafe._audit.audit import _AUDITORS

    model = _loaded()
    gs.audit(model)
    assert model in _AUDITORS
    gone = weakref.ref(model)
    del model
    gc.collect()  # (models of earlier tests may go with it: counts would not tell)
    assert gone() is None


def test_audit_every_1_refuses_the_replay_a_numpy_write_would_make_stale() -> None:
    model, x = _loaded(), _x()
    g, out = _captured(model, x, audit_every=1)
    g.replay()
    assert g.last_audit is not None and g.last_audit.checked == ("w_sum", "w_t")
    before = out.clone()
    _numpy_write(model)
    with pytest.raises(gs.StaleError, match=r"gs.audit: 2 derived tensor\(s\) differ") as info:
        g.replay()
    assert info.value.paths == ("w_sum", "w_t")
    assert torch.equal(out, before)  # nothing replayed
    gs.runtime(model).refresh()  # the fix the error names: recompute from the weight as it is
    g.replay()
    torch.testing.assert_close(out, _correct(model, x), rtol=0, atol=0)


def test_audit_every_refuses_even_with_on_stale_refresh() -> None:
    """There is no witness to repair from: the audit found a write nothing saw."""
    model, x = _loaded(), _x()
    g, _ = _captured(model, x, audit_every=1, on_stale="refresh")
    _numpy_write(model)
    with pytest.raises(gs.StaleError, match=r"gs\.audit"):
        g.replay()
    # Control: a write the guard sees is repaired by on_stale="refresh", and the audit of
    # the same replay (after the repair) passes.
    gs.runtime(model).refresh()
    with torch.no_grad():
        model.w.mul_(2.0)  # moves the version counter
    g.replay()
    assert g.last_audit is not None and g.last_audit.checked == ("w_sum", "w_t")


def test_a_failed_audit_runs_again_at_the_next_replay() -> None:
    model, x = _loaded(), _x()
    g, _ = _captured(model, x, audit_every=3)
    _numpy_write(model)
    for _ in range(2):
        g.replay()  # replays 1, 2: not audited, stale (the control)
    for _ in range(2):  # replay 3 and the one after: audited, refused
        with pytest.raises(gs.StaleError, match=r"gs\.audit"):
            g.replay()
    gs.runtime(model).refresh()
    g.replay()
    first = g.last_audit
    assert first is not None
    g.replay()
    assert g.last_audit is first  # passed: back to every third replay


def test_audit_every_3_audits_replays_3_6_and_9() -> None:
    model, x = _loaded(), _x()
    g, _ = _captured(model, x, audit_every=3)
    audited, last = [], g.last_audit
    for n in range(1, 10):
        g.replay()
        if g.last_audit is not last:
            audited.append(n)
            last = g.last_audit
    assert audited == [3, 6, 9]
    # Control: without audit_every, no replay audits.
    plain, _ = _captured(_loaded(), x)
    for _ in range(3):
        plain.replay()
    assert plain.last_audit is None


def test_audit_every_is_checked() -> None:
    model = _loaded()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="audit_every must be a positive integer"):
            gs.Graph(backend="cpu", guard=model, audit_every=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass guard=model"):
        gs.Graph(backend="cpu", audit_every=2)


# -- the audit changes nothing -------------------------------------------------------------


def _state(model: nn.Module) -> dict[str, tuple[torch.Tensor, int, int, int]]:
    """Value, address, `_version` and object of every parameter and buffer."""
    return {
        name: (t.detach().clone(), t.data_ptr(), t._version, id(t))
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }


def _assert_same(before: dict[str, tuple[torch.Tensor, int, int, int]], model: nn.Module) -> None:
    after = _state(model)
    assert after.keys() == before.keys()
    for name, (value, ptr, version, obj) in before.items():
        v, p, ver, o = after[name]
        assert torch.equal(v, value), name
        assert (p, ver, o) == (ptr, version, obj), name


@pytest.mark.parametrize("stale", [False, True], ids=["clean", "numpy-written"])
def test_the_audit_changes_no_value_address_version_or_journal_clock(stale: bool) -> None:
    model, x = _loaded(), _x()
    g, _ = _captured(model, x)  # pinned: the process-wide observer watches the model
    rt = gs.runtime(model)
    if stale:
        _numpy_write(model)
    gc.collect()  # storages of earlier tests that die advance the clock when swept:
    len(JOURNAL)  # sweep them now, not during the audit
    before, clock, report = _state(model), JOURNAL.clock, rt.last_report
    for _ in range(2):
        try:
            gs.audit(model)
        except gs.StaleError:
            assert stale
    _assert_same(before, model)
    assert JOURNAL.clock == clock  # no write recorded, none drained
    assert rt.last_report is report  # nothing refreshed
    assert rt.stale == ()  # nothing marked: the guard's view is the same
    assert g.captured and rt.pinned
    # Control: the state compared is one a refresh does change.
    if stale:
        rt.refresh()
        with pytest.raises(AssertionError):
            _assert_same(before, model)


# -- reports, tolerance, several mismatches ------------------------------------------------


def test_a_clean_model_passes_and_the_report_counts_what_it_checked() -> None:
    layer = scaled_layer_class()()
    layer.load_weights([("w", torch.randn(2, 3))])
    report = gs.audit(layer)
    assert set(report.checked) == {"w_scaled", "col_sum", "bias2"}
    assert report.declared == report.checked and report.discovered == ()
    assert report.unchecked == ()
    assert report.nbytes == sum(
        getattr(layer, name).nbytes for name in ("w_scaled", "col_sum", "bias2")
    )
    assert report.bitwise and report.atol == 0.0 and report.rtol == 0.0
    assert report.seconds >= 0.0
    with pytest.raises(Exception, match="frozen"):
        report.nbytes = 0  # type: ignore[misc]


def test_a_model_never_loaded_is_reported_unchecked_not_passed() -> None:
    layer = scaled_layer_class()()
    report = gs.audit(layer)
    assert report.checked == ()
    assert {u.path for u in report.unchecked} == {"w_scaled", "col_sum", "bias2"}
    assert all("never materialized" in u.why for u in report.unchecked)


@gs.graphsafe
class Kernel(nn.Module):
    """A checkpoint-format weight released between updates (transient) and its
    kernel-format transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    @gs.derive("weight_k", inputs=["weight"], transient=["weight"])
    def _weight_k(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t().contiguous()  # [4, 4]

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        for _, t in weights:
            self.weight.data.copy_(t)


@gs.graphsafe
class ResidentKernel(Kernel):
    """The same, keeping its checkpoint-format weight (the control)."""

    @gs.derive("weight_k", inputs=["weight"])
    def _weight_k(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t().contiguous()


def test_a_derivation_of_a_released_transient_input_is_reported_unchecked() -> None:
    model = Kernel()
    model.load_weights([("weight", torch.randn(4, 4))])
    report = gs.audit(model)  # its input is gone: nothing to recompute it from
    assert report.checked == ()
    assert [u.path for u in report.unchecked] == ["weight_k"]
    assert "transient input weight is released" in report.unchecked[0].why
    # Control: the same derivation of a resident input is recomputed and compared.
    resident = ResidentKernel()
    resident.load_weights([("weight", torch.randn(4, 4))])
    assert gs.audit(resident).checked == ("weight_k",)


def test_tolerance() -> None:
    model = _loaded()
    buf = model.w_sum.numpy()
    buf[0] += 1e-5 * max(1.0, abs(float(buf[0])))  # a non-deterministic kernel's noise
    with pytest.raises(gs.StaleError, match=r"w_sum .* 1 of 6 elements differ \(bitwise\)"):
        gs.audit(model)
    report = gs.audit(model, atol=1e-3)
    assert report.atol == 1e-3 and not report.bitwise and "w_sum" in report.checked
    gs.audit(model, rtol=1e-3)
    # Control: a difference beyond the tolerance is still found.
    buf[1] += 1.0
    with pytest.raises(gs.StaleError, match=r"1 of 6 elements differ \(beyond atol=0.001"):
        gs.audit(model, atol=1e-3)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="atol must be a finite number"):
            gs.audit(model, atol=bad)


def test_every_mismatch_is_named_when_several_are_stale() -> None:
    layer = scaled_layer_class()()
    layer.load_weights([("w", torch.randn(2, 3))])
    layer.w.detach().numpy()[:] = 1.0  # w_scaled, and col_sum which reads it
    layer.bias.numpy()[:] = 9.0  # bias2
    with pytest.raises(gs.StaleError, match=r"3 derived tensor\(s\) differ") as info:
        gs.audit(layer)
    assert set(info.value.paths) == {"w_scaled", "col_sum", "bias2"}
    message = str(info.value)
    assert "col_sum (ScaledLayer._col_sum): reads w_scaled, which differs" in message
    assert "bias2 (ScaledLayer._bias2): 3 of 3 elements differ" in message
    # Control: a write into one input names only what reads it.
    gs.runtime(layer).refresh()
    layer.bias.numpy()[:] = 1.0
    with pytest.raises(gs.StaleError) as one:
        gs.audit(layer)
    assert one.value.paths == ("bias2",)


def test_a_mismatch_the_guard_sees_too_is_named_with_how_it_was_written() -> None:
    model = _loaded()
    with torch.no_grad():
        model.w.mul_(2.0)  # in place outside a load: the version counter moves
    with pytest.raises(gs.StaleError) as info:
        gs.audit(model)
    assert "the guard sees it too: w written in place outside a tracked load" in str(info.value)
    # Control: a NumPy write into the derived buffer itself is one the guard does not see.
    gs.runtime(model).refresh()
    model.w_t.numpy()[:] = 0.0
    with pytest.raises(gs.StaleError, match=r"w_t .* no write graphsafe saw") as invisible:
        gs.audit(model)
    assert invisible.value.paths == ("w_t",)


# -- engine-derived tensors the runtime discovered -----------------------------------------


@gs.graphsafe
class PostLoad(nn.Module):
    """An engine-style post-load step: a packed copy made once after the first load,
    never declared."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 6))
        self.packed: torch.Tensor | None = None

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        for _, t in weights:
            self.w.data.copy_(t)
        if self.packed is None:
            self.packed = self.w.t().contiguous() * 2.0  # [6, 4]


def test_audit_recomputes_a_discovered_engine_derived_tensor() -> None:
    model = PostLoad()
    model.load_weights([("w", torch.randn(4, 6))])
    report = gs.audit(model)
    assert report.discovered == ("packed",) and report.declared == ()
    model.w.detach().numpy()[:] = 1.0
    with pytest.raises(gs.StaleError, match="packed") as info:
        gs.audit(model)
    assert info.value.paths == ("packed",)
    assert "engine-derived, from w" in str(info.value)


_KERNELS: dict[int, torch.Tensor] = {}


@torch.library.custom_op("gstest_audit::make_handle", mutates_args=())
def make_handle(w: torch.Tensor) -> int:
    """A kernel library's handle: its packed weight lives behind an int."""
    _KERNELS[len(_KERNELS) + 1] = w.t().contiguous()
    return len(_KERNELS)


@gs.graphsafe
class Handle(nn.Module):
    """A post-load step that makes a handle: a value that left torch (an int an op made
    from the weights, as vLLM's `torch.tensor(<int from the op>)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 6))
        self.handle: torch.Tensor | None = None

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        for _, t in weights:
            self.w.data.copy_(t)
        if self.handle is None:
            self.handle = torch.tensor(make_handle(self.w), dtype=torch.int64)


def test_an_opaque_engine_derived_result_is_reported_unchecked_not_passed() -> None:
    model = Handle()
    model.load_weights([("w", torch.randn(4, 6))])
    report = gs.audit(model)
    assert report.checked == ()
    assert [u.path for u in report.unchecked] == ["handle"]
    assert "opaque" in report.unchecked[0].why
    # Control: a packed copy made the same way, but in torch, is checked.
    packed = PostLoad()
    packed.load_weights([("w", torch.randn(4, 6))])
    assert gs.audit(packed).unchecked == ()


# -- the comparison ------------------------------------------------------------------------


@settings(max_examples=40)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64,
                           torch.int8, torch.int64, torch.bool, torch.complex64]),
    numel=st.integers(1, 3 * (1 << 18)),  # up to three of the CPU's pieces
    at=st.floats(0.0, 1.0, exclude_max=True),
    layout=st.sampled_from(["contiguous", "transposed"]),
)
def test_compare_finds_any_one_flipped_bit(dtype: torch.dtype, numel: int, at: float,
                                           layout: str) -> None:
    """Bitwise: a copy compares equal; one element with one bit flipped does not, wherever
    it is, through the C library's memcmp (contiguous) or the pieces (transposed)."""
    gen = torch.Generator().manual_seed(numel)
    base = (torch.randn(numel, generator=gen) * 100).to(dtype)
    held = base.clone()
    r = base.clone()
    if layout == "transposed":
        cols = 4 if numel % 4 == 0 and numel >= 8 else 1
        held = held.view(-1, cols).t().contiguous().t()  # same values, column-major
        r = r.view(-1, cols)
    else:
        held = held.view(r.shape)
    assert compare(r, held, atol=0.0, rtol=0.0) is None
    i = int(at * numel)
    flat = r.reshape(-1).view(torch.uint8) if dtype != torch.bool else None
    if flat is None:
        r.view(-1)[i] = not bool(r.view(-1)[i])
    else:
        width = r.element_size()
        flat[i * width] ^= 1  # the lowest bit of element i
    got = compare(r, held, atol=0.0, rtol=0.0)
    assert got is not None and got.startswith("1 of ")


def test_compare_is_bitwise_for_signed_zeros_and_nans() -> None:
    zero, nan = torch.tensor([0.0, float("nan")]), torch.tensor([0.0, float("nan")])
    assert compare(zero, nan, atol=0.0, rtol=0.0) is None  # the same bits, NaN included
    # Control: -0.0 == 0.0 for torch, but not bitwise.
    minus = torch.tensor([-0.0, float("nan")])
    assert torch.equal(minus[:1], zero[:1])
    assert compare(minus, zero, atol=0.0, rtol=0.0) is not None


@gs.graphsafe
class TwoOutputs(nn.Module):
    """One derivation with two outputs: both are compared."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 6))

    @gs.derive(("w_t", "w_neg"), inputs=["w"])
    def _both(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w.t().contiguous(), -w

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        for _, t in weights:
            gs.load_into(self.w, t, name="w")


def test_every_output_of_a_derivation_with_two_is_compared() -> None:
    model = TwoOutputs()
    model.load_weights([("w", torch.randn(4, 6, generator=torch.Generator().manual_seed(0)))])
    assert set(gs.audit(model).checked) == {"w_t", "w_neg"}
    model.w_neg.numpy()[0, 0] += 1.0  # the second output only, invisible to the guard
    with pytest.raises(gs.StaleError, match=r"w_neg") as info:
        gs.audit(model)
    assert info.value.paths == ("w_neg",)


def test_an_audit_that_checked_nothing_warns_instead_of_passing_silently() -> None:
    plain = nn.Linear(3, 2)  # nothing declared, nothing recorded
    with pytest.warns(gs.GraphSafetyWarning, match=r"checked nothing"):
        report = gs.audit(plain)
    assert report.checked == ()
    # Control: an audit that compared something says nothing more than its report.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.GraphSafetyWarning)
        assert gs.audit(_loaded()).checked
