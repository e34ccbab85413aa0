"""`graphsafe verify`: the main job's exit code, table and JSON."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import graphsafe as gs
from graphsafe._verify import VerifyReport, load_target, run_verify, run_verify_pp
from graphsafe.cli import main
from graphsafe.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model, verify_target


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
    # Held to a model built fresh from each checkpoint, and audited.
    assert report.oracle == "fresh" and report.audit
    assert all(r.audited == 1 and r.stale == () and r.error is None for r in report.refits)


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
    assert "oracle: fresh model from the checkpoint, after every refit" in done.stdout
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
    assert main(["verify", "--target", "nope"]) == 2  # a usage error, like the preset
    assert "unknown verify target 'nope'" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# usage errors: --target, --timeout


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (":", "its module name is empty"),
        ("", "no verify target given"),
        (":target", "its module name is empty"),
        (".pkg:target", "its module name is not a dotted name: '.pkg'"),
        ("os:path", "'os:path' is not a verify target"),
        ("test_cli:_NaiveEverywhere", "is the class _NaiveEverywhere, not a verify target"),
    ],
    ids=["colon", "empty", "no-module", "relative", "module", "class"],
)
def test_verify_refuses_a_target_that_is_not_one_as_a_usage_error(
    capsys: pytest.CaptureFixture[str], spec: str, why: str
) -> None:
    # Before: `ValueError: Empty module name`, or `AttributeError: ... 'presets'`.
    assert main(["verify", "--target", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphsafe verify: --target: ") and why in err
    assert "expected:   an entry point of group 'graphsafe.targets'" in err  # what a target is
    assert "module:attribute naming an object with name, presets" in err
    assert "e.g. `deepseek_v4`, or `my_pkg.verify_target:target`" in err  # an example
    assert "Traceback" not in err and err.count("graphsafe verify:") == 1


def test_control_a_target_named_by_module_and_dotted_attribute_loads() -> None:
    assert load_target("graphsafe.models.deepseek_v4:verify_target") is verify_target
    assert load_target("test_cli:NAIVE_EVERYWHERE") is NAIVE_EVERYWHERE
    assert load_target("test_cli:_Holder.target") is NAIVE_EVERYWHERE


class _Holder:
    target = NAIVE_EVERYWHERE


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--timeout", "5"], "--timeout only applies with --pp"),
        (["--pp", "2", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
        (["--pp", "2", "--timeout", "-1"], "got -1"),
        (["--pp", "2", "--timeout", "nan"], "got nan"),
        (["--pp", "2", "--timeout", "inf"], "got inf"),
    ],
    ids=["without-pp", "zero", "negative", "nan", "inf"],
)
def test_verify_refuses_a_timeout_it_cannot_use_before_starting_anything(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    # Before: `--timeout 5` was ignored (a whole run), `--timeout 0` started processes
    # that died printing c10d's C++ frames.
    assert main(["verify", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphsafe verify: ") and message in err
    assert multiprocessing.active_children() == []


def test_run_verify_pp_refuses_a_timeout_that_is_not_positive() -> None:
    with pytest.raises(gs.GraphSafetyError, match="the timeout must be a positive number"):
        run_verify_pp(verify_target, pp=2, backend="cpu", timeout=0.0)
    assert multiprocessing.active_children() == []


@dataclass(frozen=True)
class _StuckStage:
    """DeepSeek V4, except that the first stage never comes to the first sync."""

    name: str = "stuck-stage"
    presets: tuple[str, ...] = ("tiny",)
    critical: tuple[str, ...] = ("hc_attn_fn",)

    def build(self, preset: str, naive: bool, device: torch.device) -> nn.Module:
        return verify_target.build(preset, naive, device)

    def build_stage(self, preset: str, naive: bool, device: torch.device, *, pp_rank: int,
                    pp_size: int) -> nn.Module:
        if pp_rank == 0:
            time.sleep(3600)  # stopped by the run once the others timed out
        with torch.device(device):
            return DeepseekV4Model(DeepseekV4Config.preset(preset, pp_rank=pp_rank,
                                                           pp_size=pp_size))

    def checkpoint(self, model: nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
        return verify_target.checkpoint(model, seed)

    def example_input(self, model: nn.Module, seed: int) -> tuple[torch.Tensor, ...]:
        return verify_target.example_input(model, seed)


STUCK_STAGE = _StuckStage()


def test_verify_pp_timeout_ends_in_one_readable_error() -> None:
    # A fresh process, so that every rank's own stderr (c10d's C++ logs) is read too.
    done = subprocess.run(
        [sys.executable, "-m", "graphsafe", "verify", "--target", "test_cli:STUCK_STAGE",
         "--pp", "2", "--timeout", "1", "--refits", "1", "--backend", "cpu"],
        capture_output=True, text=True, timeout=300, check=False,
        cwd=Path(__file__).parent,
        env={k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"},
    )
    err = done.stderr
    assert done.returncode == 1, err
    final = err[err.index("graphsafe verify: "):].splitlines()
    assert final[0].startswith(
        "graphsafe verify: GraphSafetyError: verify --pp 2: the run ended without a report: "
        "rank 0 (trainer) ")  # and maybe stage 1, which waited for the trainer
    assert final[0].endswith("timed out waiting for another rank (--timeout 1 s)")
    assert final[2].startswith("  got:        rank 0 (trainer): WeightSyncError: send_weights")
    assert "Timed out waiting 1000ms" in final[2]
    assert final[3].endswith(
        "rank 1 (stage 0): reported nothing: it was still running when the run stopped it")
    assert final[4].strip().startswith("rank 2 (stage 1): ")
    assert final[5].startswith("  fix:        raise --timeout")
    assert "Traceback" not in err and "frame #" not in err and "c10::" not in err


def test_graphsafes_own_targets_are_found_without_installed_entry_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Run from the source tree (scripts/gpu-check) no distribution metadata registers the
    # entry points: `verify --pp 2` failed there with "unknown verify target 'deepseek_v4'".
    from graphsafe._verify import target as target_module
    from graphsafe.models import llama

    monkeypatch.setattr(target_module, "entry_points", lambda group: [])
    assert load_target("deepseek_v4") is verify_target
    assert load_target("llama") is llama.verify_target
    # Control: a name that is neither installed nor graphsafe's own is still refused.
    with pytest.raises(gs.GraphSafetyError, match="unknown verify target 'bogus'") as caught:
        load_target("bogus")
    assert "installed targets: deepseek_v4, llama" in str(caught.value)


def test_the_builtin_targets_are_the_registered_entry_points() -> None:
    from importlib.metadata import entry_points

    from graphsafe._verify.target import _BUILTIN

    registered = {ep.name: ep.value for ep in entry_points(group="graphsafe.targets")}
    assert registered == _BUILTIN


# -----------------------------------------------------------------------------
# the command line itself: help, version, usage, presets, seeds


def test_verify_help_names_the_presets_of_graphsafes_own_targets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from graphsafe.models import llama

    with pytest.raises(SystemExit) as done:
        main(["verify", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for target in (verify_target, llama.verify_target):
        assert f"{target.name}: {', '.join(target.presets)}" in out
    assert "default: the target's first" in out


def test_version_names_graphsafe_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"graphsafe {gs.__version__} (torch {torch.__version__})"
    )


def test_an_unknown_verify_option_prints_verifys_own_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["verify", "--bogus"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: graphsafe verify [-h]")  # not `graphsafe [-h] ...`
    assert err.rstrip().endswith("graphsafe verify: error: unrecognized arguments: --bogus")


@dataclass(frozen=True)
class _SmallOnly:
    """A target of one preset, not named `tiny` (as docs/verify.md's fused QK example)."""

    name: str = "small-only"
    presets: tuple[str, ...] = ("small",)
    critical: tuple[str, ...] = ("hc_attn_fn",)

    def build(self, preset: str, naive: bool, device: torch.device) -> nn.Module:
        assert preset == "small", preset
        return verify_target.build("tiny", naive, device)

    def checkpoint(self, model: nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
        return verify_target.checkpoint(model, seed)

    def example_input(self, model: nn.Module, seed: int) -> tuple[torch.Tensor, ...]:
        return verify_target.example_input(model, seed)


SMALL_ONLY = _SmallOnly()


def test_a_target_without_preset_given_runs_its_own_first_preset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: "unknown preset 'tiny' for small-only", the default of graphsafe's targets.
    argv = ["verify", "--target", "test_cli:SMALL_ONLY", "--refits", "1", "--json"]
    assert main(argv) == 0
    assert VerifyReport.model_validate_json(capsys.readouterr().out).preset == "small"
    # Control: a preset the target does not have is still refused.
    assert main([*argv, "--preset", "tiny"]) == 2
    assert "unknown preset 'tiny' for small-only; choose one of small" in capsys.readouterr().err


def test_a_negative_seed_is_refused_instead_of_running_as_its_absolute_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Why: the bucket draws seed `random.Random` with the absolute value.
    assert random.Random(-1).random() == random.Random(1).random()
    assert main(["verify", "--seed", "-1"]) == 2
    assert capsys.readouterr().err == (
        "graphsafe verify: --seed must be 0 or more: expected an integer >= 0, got -1\n"
    )


@pytest.mark.parametrize(
    "argv",
    [["--refits", "0"], ["--pp", "0"], ["--seed", "-3"], ["--preset", "huge"],
     ["--timeout", "5"], ["--pp", "2", "--timeout", "nan"]],
    ids=["refits", "pp", "seed", "preset", "timeout-without-pp", "timeout-nan"],
)
def test_every_bad_value_is_one_line_and_exit_two(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert main(["verify", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphsafe verify: ") and err.count("\n") == 1, err


def test_verify_pp_from_a_script_without_a_main_guard_names_the_cause(tmp_path: Path) -> None:
    """docs/rl-weight-sync.md's example pasted without `if __name__ == "__main__":` (the
    page runs it with the guard, as a script: the control). Before, the ranks died with
    multiprocessing's bootstrapping error and the run said only `died (1)`."""
    script = tmp_path / "sync_check.py"
    script.write_text(
        "from graphsafe.cli import main\n\n"
        'main(["verify", "--pp", "2", "--refits", "1", "--backend", "cpu"])\n'
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, check=False, cwd=tmp_path)
    err = done.stderr
    final = err[err.rindex("graphsafe verify: GraphSafetyError: verify --pp 2"):]
    assert final.splitlines()[0].endswith(
        f"every rank died before its own code ran, while importing the script {script} again")
    assert '  fix:        call it under `if __name__ == "__main__":` in your script' in final
    # Each rank says why it stopped, too.
    assert err.count("verify --pp was called again inside one of its own rank processes") == 3


# -----------------------------------------------------------------------------
# the bucket draws


@given(entries=st.integers(2, 80), n_critical=st.integers(0, 3), seed=st.integers(0, 2**32),
       critical_last=st.booleans())
def test_a_refit_is_split_into_two_to_five_buckets_the_critical_one_among_them(
    entries: int, n_critical: int, seed: int, critical_last: bool
) -> None:
    """docs/verify.md: "split into 2 to 5 buckets"; the critical entries' own bucket, on
    the first refit, counts among them (before, it came on top: up to 6)."""
    from graphsafe._verify.single.run import _buckets

    n_critical = min(n_critical, entries - 1)
    ck = [(f"w{i}" + ("_crit" if i < n_critical else ""), torch.zeros(1))
          for i in range(entries)]
    buckets = _buckets(ck, random.Random(seed), ("_crit",), critical_last)
    assert 2 <= len(buckets) <= 5
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(n for n, _ in ck)  # each entry once
    if critical_last and n_critical:
        assert {n for n, _ in buckets[-1]} == {n for n, _ in ck if n.endswith("_crit")}
