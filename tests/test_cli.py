"""`graphsafe verify`: the main job's exit code, table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import torch
from torch import nn

from graphsafe._verify import VerifyReport, run_verify
from graphsafe.cli import main
from graphsafe.models.deepseek_v4 import verify_target


def test_verify_json_reports_exact_refits_and_a_detected_control(capsys):
    assert main(["verify", "--refits", "2", "--json", "--backend", "cpu"]) == 0
    captured = capsys.readouterr()
    report = VerifyReport.model_validate(json.loads(captured.out))  # nothing else on stdout
    assert report.ok and report.backend == "cpu"
    assert [r.verdict for r in report.refits] == ["exact", "exact"]
    assert all(r.refreshed == ("layers.0.hc_attn_fn_broadcast",) for r in report.refits)
    assert all(r.max_abs_diff == 0.0 and r.weights_effect > 0 for r in report.refits)
    assert report.refits[0].critical_last
    assert report.control.stale_read and report.control.caught
    assert "StorageMovedError" in (report.control.guard_error or "")


def test_verify_says_each_phase_with_its_time_on_stderr_as_it_goes(capsys):
    assert main(["verify", "--refits", "1", "--json", "--backend", "cpu"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout stays pure JSON
    err = captured.err.splitlines()
    for name in ("build deepseek_v4", "capture (cpu graph)", "refit 1/1", "control"):
        started = [line for line in err if name in line and line.endswith("...")]
        ended = [line for line in err if name in line and "done in" in line]
        assert started and ended, (name, err)
    # Started lines come before their ends, in run order.
    assert err.index(next(s for s in err if "capture" in s)) > err.index(
        next(s for s in err if "build" in s and "done in" in s)
    )


def test_python_dash_m_prints_the_table_and_exits_zero():
    done = subprocess.run(
        [sys.executable, "-m", "graphsafe", "verify", "--refits", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "max|replay-eager|" in done.stdout
    assert "stale read reproduced" in done.stdout
    assert "PASS" in done.stdout


@dataclass(frozen=True)
class _NaiveEverywhere:
    """A broken target: its "managed" model is the naive rebinding one."""

    name: str = "naive-everywhere"
    presets: tuple[str, ...] = ("tiny",)
    critical: tuple[str, ...] = ("hc_attn_fn",)

    def build(self, preset: str, naive: bool, device: torch.device) -> nn.Module:
        return verify_target.build(preset, True, device)

    def checkpoint(self, model, seed):
        return verify_target.checkpoint(model, seed)

    def example_input(self, model, seed):
        return verify_target.example_input(model, seed)


NAIVE_EVERYWHERE = _NaiveEverywhere()


def test_control_verify_fails_when_the_managed_model_rebinds():
    report = run_verify(NAIVE_EVERYWHERE, refits=1, backend="cpu")
    assert not report.ok
    assert report.refits[0].verdict == "error"
    assert "StorageMovedError" in (report.refits[0].error or "")


def test_verify_exit_code_is_one_when_a_refit_fails(capsys):
    assert main(["verify", "--target", "test_cli:NAIVE_EVERYWHERE", "--refits", "1"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_rejects_unknown_preset_and_target(capsys):
    assert main(["verify", "--preset", "huge"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err
    assert main(["verify", "--target", "nope"]) == 1
    assert "unknown verify target 'nope'" in capsys.readouterr().err
