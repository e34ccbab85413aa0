"""`graphsafe verify` holds each refit to a model built fresh from the checkpoint, and to
the content audit, not to the model it checks.

The target here loads the input of DeepSeek V4's derived buffer through a NumPy view:
the values land, but no mechanism of graphsafe sees the write, so the derived buffer is
never refreshed. The model's replay and its own eager forward read the same stale
buffer and agree; only an oracle that does not share the model's state sees it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import ClassVar

import pytest
import torch
from torch import Tensor, nn

import graphsafe as gs
from graphsafe._errors import one_line
from graphsafe._verify import VerifyReport, load_target, run_verify, run_verify_pp
from graphsafe._verify.report.format import quote
from graphsafe._verify.single.oracle import Oracle, fresh_model
from graphsafe.cli import main
from graphsafe.models.deepseek_v4 import DeepseekV4Model, DeepseekV4Target, verify_target

_BROADCAST = "layers.0.hc_attn_fn_broadcast"


@gs.graphsafe
class NumpyLoadedDeepseekV4(DeepseekV4Model):
    """DeepSeek V4 whose loader writes every `hc_attn_fn` through a NumPy view."""

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        rest: list[tuple[str, Tensor]] = []
        written: set[str] = set()
        for entry, w in weights:
            name = entry.removeprefix("model.")
            if name.endswith("hc_attn_fn") and name in params:
                # Same values, behind torch's back: no version bump, no dispatch.
                params[name].detach().numpy()[...] = w.detach().cpu().numpy()
                written.add(name)
            else:
                rest.append((entry, w))
        return written | self._load_weights(rest)


@dataclasses.dataclass(frozen=True)
class NumpyLoaderTarget(DeepseekV4Target):
    """The DeepSeek V4 target with the NumPy loader (CPU only: NumPy views host memory)."""

    name: str = "numpy-loader"
    presets: tuple[str, ...] = ("tiny",)
    model_cls: ClassVar[type[nn.Module]] = NumpyLoadedDeepseekV4


NUMPY_LOADER = NumpyLoaderTarget()


def _stale_rows(report: VerifyReport) -> list[tuple[str, tuple[str, ...]]]:
    return [(r.verdict, r.stale) for r in report.refits]


# -----------------------------------------------------------------------------
# the NumPy loader: caught by the fresh oracle and by the audit, not by the model itself


def test_verify_exits_non_zero_on_a_numpy_loader_naming_the_tensor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--target", "test_verify_oracle:NUMPY_LOADER", "--refits", "2",
                 "--backend", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "oracle: fresh model from the checkpoint, after every refit" in out
    assert "content audit after every refit" in out
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("1 ", "2 "))]
    assert len(rows) == 2 and all("stale: StaleError: 1 tensor(s) differ from a fresh "
                                  "numpy-loader model" in row for row in rows)
    assert all(f"{_BROADCAST} (DeepseekV4DecoderLayer, max|held-fresh|" in r for r in rows)
    assert all("gs.audit: 1 derived tensor(s) differ" in r for r in rows)
    assert out.rstrip().endswith(f"FAIL: stale after a refit: {_BROADCAST}")


def test_numpy_loader_report_names_the_derived_buffer_not_its_input() -> None:
    report = run_verify(NUMPY_LOADER, refits=2, backend="cpu")
    assert not report.ok and report.oracle == "fresh" and report.audit
    assert _stale_rows(report) == [("stale", (_BROADCAST,))] * 2
    # The NumPy write itself landed: the parameter equals the fresh model's.
    assert all("hc_attn_fn " not in (r.error or "") for r in report.refits)
    assert all(r.refreshed == () and r.storage_held for r in report.refits)  # unseen
    assert all(r.max_abs_diff > report.tolerance for r in report.refits)
    assert all(r.audited is None for r in report.refits)
    assert report.control.caught and report.control.stale_read  # the control still holds


def test_control_the_same_model_oracle_and_the_guard_alone_pass_the_numpy_loader() -> None:
    # Before issue 19: replay against the model's own eager forward, no audit. Every
    # row reads `refreshed 0`, `exact`, and the run passes: the bug is real and silent.
    report = run_verify(NUMPY_LOADER, refits=2, backend="cpu", oracle="self", audit=False)
    assert report.ok and report.oracle == "self" and not report.audit
    assert _stale_rows(report) == [("exact", ())] * 2
    assert all(r.refreshed == () and r.max_abs_diff == 0.0 for r in report.refits)
    assert all(r.error is None for r in report.refits)  # the guarded replay raised nothing


@pytest.mark.parametrize(("oracle", "audit"), [("fresh", False), ("self", True)],
                         ids=["fresh-oracle-alone", "audit-alone"])
def test_either_check_alone_fails_the_numpy_loader(oracle: Oracle, audit: bool) -> None:
    report = run_verify(NUMPY_LOADER, refits=1, backend="cpu", oracle=oracle, audit=audit)
    assert not report.ok
    assert _stale_rows(report) == [("stale", (_BROADCAST,))]
    why = report.refits[0].error or ""
    if audit:
        assert why.startswith("StaleError: gs.audit: 1 derived tensor(s) differ")
        assert report.refits[0].max_abs_diff == 0.0  # the model agrees with itself
    else:
        assert why.startswith("StaleError: 1 tensor(s) differ from a fresh numpy-loader")


def test_verify_pp_on_a_numpy_loader_fails_by_the_fresh_oracle_and_the_stages_audit() -> None:
    report = run_verify_pp(NUMPY_LOADER, pp=2, refits=1, backend="cpu", timeout=120.0)
    assert not report.ok and report.oracle == "fresh"
    (row,) = report.refits
    assert row.verdict == "stale" and row.stale == (_BROADCAST,)
    assert row.max_abs_diff > report.tolerance  # the trainer's fresh model disagrees
    assert (row.error or "").startswith("stage 0: StaleError: gs.audit: 1 derived tensor(s)")
    assert [(s.stage, s.stale) for s in report.syncs] == [(0, (_BROADCAST,)), (1, ())]
    assert report.control.stale_read and report.control.caught  # fresh oracle there too


def test_control_verify_pp_with_the_trainers_own_model_finds_the_numpy_loader_exact() -> None:
    # The trainer's model goes through the same NumPy loader as the stages: it is as
    # stale as they are, and the replay matches it. (Its control then fails too: the
    # trainer's stale eager logits equal the naive stages' stale replay.)
    report = run_verify_pp(NUMPY_LOADER, pp=2, refits=1, backend="cpu", timeout=120.0,
                           oracle="self", audit=False)
    assert _stale_rows(report) == [("exact", ())]
    assert report.refits[0].max_abs_diff == 0.0 and report.refits[0].error is None
    assert not report.control.stale_read


# -----------------------------------------------------------------------------
# healthy targets: the fresh oracle and the audit agree


@pytest.mark.parametrize(("spec", "preset", "audited", "unaudited"), [
    ("deepseek_v4", "tiny", 1, 0),
    ("llama", "tiny", 4, 0),
    # FP8 weights from transient checkpoint-format inputs, released between updates:
    # the audit cannot recompute them, the fresh model still checks them.
    ("llama", "tiny-fp8", 0, 16),
])
def test_healthy_targets_pass_the_fresh_oracle_and_the_audit(
    capsys: pytest.CaptureFixture[str], spec: str, preset: str, audited: int, unaudited: int
) -> None:
    assert main(["verify", "--target", spec, "--preset", preset, "--refits", "2",
                 "--json", "--backend", "cpu"]) == 0
    report = VerifyReport.model_validate(json.loads(capsys.readouterr().out))
    assert report.ok and report.oracle == "fresh" and report.audit
    assert [(r.verdict, r.stale, r.audited, r.unaudited) for r in report.refits] == [
        ("exact", (), audited, unaudited)] * 2
    assert all(r.max_abs_diff == 0.0 for r in report.refits)  # bitwise, on the CPU
    assert report.oracle_seconds > 0 and report.audit_seconds > 0


# -----------------------------------------------------------------------------
# errors quoted whole


def test_the_llama_control_line_names_every_moved_tensor() -> None:
    report = run_verify(load_target("llama"), refits=1, backend="cpu")
    line = report.control.guard_error or ""
    assert line.startswith("StorageMovedError: 4 pinned tensors moved after graph capture "
                           "(4 drifts): model.layers.0.self_attn.qkv_weight "
                           "(NaiveLlamaAttention): storage moved; ")
    for layer in ("0", "1"):
        for path in ("self_attn.qkv_weight", "mlp.gate_up_weight"):
            assert f"model.layers.{layer}.{path} " in line
    assert "expected" not in line and "0x" not in line  # the list, not its details


def test_control_one_line_keeps_only_the_head_of_a_listed_error() -> None:
    exc = gs.StorageMovedError("2 pinned tensors moved after graph capture (2 drifts):\n"
                               "  a.w (A): storage moved\n    expected: storage 0x1\n"
                               "  b.w (B): storage moved", fix="copy_ into it")
    assert one_line(exc).endswith("(2 drifts):")  # what the control line printed before
    assert quote(exc) == ("StorageMovedError: 2 pinned tensors moved after graph capture "
                          "(2 drifts): a.w (A): storage moved; b.w (B): storage moved")
    assert quote(ValueError("one\ntwo")) == "ValueError: one"
    assert quote(gs.StaleError("x is stale", fix="refresh")) == "StaleError: x is stale"


# -----------------------------------------------------------------------------
# the control phase says each step


def test_verify_says_each_step_of_the_control_as_it_goes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--refits", "1", "--json", "--backend", "cpu"]) == 0
    err = capsys.readouterr().err.splitlines()
    steps = [f"control {i}/5: " for i in range(1, 6)]
    starts = [next(n for n, line in enumerate(err) if s in line and line.endswith("..."))
              for s in steps]
    ends = [next(n for n, line in enumerate(err) if s in line and "done in" in line)
            for s in steps]
    assert starts == sorted(starts) and all(a < b for a, b in zip(starts, ends))
    outer = [n for n, line in enumerate(err) if "control: the naive variant" in line]
    assert len(outer) == 2 and outer[0] < starts[0] and ends[-1] < outer[1]


def test_a_fresh_model_is_not_the_model_under_test() -> None:
    # The oracle shares no tensor with the model it checks.
    model = verify_target.build("tiny", False, torch.device("cpu"))
    ck = verify_target.checkpoint(model, 0)
    model.load_weights(ck)
    fresh = fresh_model(verify_target, "tiny", torch.device("cpu"), ck)
    ours = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    theirs = {t.untyped_storage().data_ptr() for t in [*fresh.parameters(), *fresh.buffers()]}
    assert not ours & theirs
    assert torch.equal(fresh.layers["0"].hc_attn_fn_broadcast,
                       model.layers["0"].hc_attn_fn_broadcast)
