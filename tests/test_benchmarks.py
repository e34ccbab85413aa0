"""The benchmark script runs and reports every figure (no timing is judged here)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import graphsafe as gs

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", *args],
        capture_output=True, text=True, timeout=600, check=False,
    )


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("graphsafe_bench_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path for its imports
    return module


run = _load()
from figures import Ctx, Sizes  # noqa: E402  (after _load)
from fingerprint import fig13  # noqa: E402


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["figure"]: row for row in report["rows"]}


def test_quick_run_reports_every_figure_as_json():
    done = _run()
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # nothing but JSON on stdout
    rows = _rows(report)
    assert {"1a", "1b", "2a", "3a", "4a", "4b", "5a", "5b", "5c", "5d", "5e", "6a", "6b", "7a",
            "10a", "10b", "10c", "10d", "11a", "11b", "11c", "11d", "12a", "12b",
            "14a"} <= set(rows)
    assert ("13a" in rows) == hasattr(gs, "fingerprint") != ("13" in rows)
    measured = [row for row in report["rows"] if not row["skipped"]]
    assert all(row["value"] is not None and row["value"] >= 0 for row in measured)
    # A recorded first load keeps its lineage and entries: many more Python objects than
    # the same load untracked, which keeps the post-load step's copies alone.
    kept = rows["11a"]["details"]["python_blocks_kept"]
    assert kept["recorded"] > 2 * kept["untracked"] > 0, kept
    # The Python checks' guarded replay of the preset runs everywhere; the compiled one
    # where it is built, and says why not elsewhere.
    assert not rows["5e"]["skipped"] and rows["5e"]["details"]["checks"]["ledger"] == "python"
    if rows["5d"]["skipped"]:
        assert "compiled checks" in rows["5d"]["skipped"]
    else:
        assert rows["5d"]["details"]["checks"]["ledger"] == "compiled"
    # On the CPU, the CUDA-only rows are SKIP rows that say so.
    cuda_only = ["4c", "14a", *(fig for fig in ("8e", "13b") if fig in rows)]
    for fig in cuda_only:
        assert rows[fig]["skipped"].startswith("CUDA only"), rows[fig]
    assert set(report["meta"]["seconds_per_figure"]) == set(run.FIGURES)


def test_only_takes_rows_and_repeats_sets_the_samples():
    done = _run("--repeats", "2", "--only", "14,5e,4b")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [row["figure"] for row in report["rows"]] == ["14a", "5e", "4b"]  # as named
    assert report["meta"]["repeats"] == 2
    assert list(report["meta"]["seconds_per_figure"]) == ["14", "5", "4"]
    assert "run.py: figure 5 took" in done.stderr  # one line per figure as it ends


def test_a_row_no_figure_gives_is_a_skip_row_and_exit_1():
    done = _run("--only", "4z")
    assert done.returncode == 1
    (row,) = json.loads(done.stdout)["rows"]
    assert row["figure"] == "4z" and "gave no row 4z" in row["skipped"]


def test_parse_only():
    assert run.parse_only("5,4c") == (["5", "4"], {"4": {"4c"}})  # in the order named
    assert run.parse_only("4c,4,4b") == (["4"], {})  # the whole figure wins
    assert run.parse_only("") == (list(run.FIGURES), {})
    for bad in ("99", "4c1", "x", "4-"):
        with pytest.raises(ValueError, match="unknown figure or row"):
            run.parse_only(bad)


def test_fingerprint_figure_times_gs_fingerprint_against_a_clone(monkeypatch):
    ctx = Ctx(device=torch.device("cpu"), sizes=Sizes.quick().with_repeats(1))
    if not hasattr(gs, "fingerprint"):
        (row,) = fig13(ctx)
        assert row.figure == "13" and "no `fingerprint`" in row.skipped

        def stand_in(obj: dict[str, torch.Tensor]) -> dict[str, str]:
            return {k: hashlib.sha256(t.numpy().tobytes()).hexdigest() for k, t in obj.items()}

        monkeypatch.setattr(gs, "fingerprint", stand_in, raising=False)
    rows = {row.figure: row for row in fig13(ctx)}
    assert set(rows) == {"13a", "13b", "13c", "13d"}
    assert rows["13b"].skipped.startswith("CUDA only")
    row = rows["13a"]
    assert not row.skipped and row.value > 0 and row.baseline > 0 and row.ratio > 0
    assert row.details["same_twice"] is True
    for packing in (rows["13c"], rows["13d"]):  # the packing's own check passed
        assert not packing.skipped and packing.ratio > 0, packing.skipped
        assert packing.details["same_digest_as_the_packed_copy"] is True


def test_refresh_graph_check_is_bitwise_and_catches_a_replay_that_did_nothing():
    # Figure 14's check, on the CPU: the engine's own loop stands in for the graph replay.
    from figures import _many_small
    from refresh_graph import _check_bitwise, _engine_loop

    ctx = Ctx(device=torch.device("cpu"), sizes=Sizes.quick())
    model, rt, _, _ = _many_small(ctx, 50)
    assert _check_bitwise(ctx, model, rt, _engine_loop(rt), seed=1) == 50
    with pytest.raises(AssertionError, match="differs from the eager one in 50 of 50"):
        _check_bitwise(ctx, model, rt, lambda: None, seed=2)
