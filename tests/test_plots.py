"""The refit figures' script: its measurement runs and checks what it measures.

The measurement needs no matplotlib and always runs; only drawing the PNGs is skipped
where matplotlib (the `bench` extra) is not installed. No timing is judged here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "plots.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("graphsafe_bench_plots", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path for its imports
    return module


plots = _load()
from bench_models import fold_stack_class, untracked_load  # noqa: E402  (after _load)
from harness import Clock  # noqa: E402

TINY = plots.PlotSizes(counts=(4, 8), fraction_count=8, fractions=(1 / 4, 1.0), repeats=1)


@pytest.fixture(scope="module")
def sweeps() -> tuple[list[Any], list[Any]]:
    clock = Clock(torch.device("cpu"))
    return plots.size_sweep(TINY, clock), plots.fraction_sweep(TINY, clock)


def test_sweeps_measure_every_line_and_refresh_exactly_what_was_loaded(sweeps):
    by_size, by_fraction = sweeps
    assert [p.derivations for p in by_size] == [4, 8]
    assert [p.loaded for p in by_fraction] == [2, 8]
    for p in [*by_size, *by_fraction]:
        assert p.refreshed == p.loaded  # the load's refresh ran the loaded layers only
        assert p.fresh
        assert min(p.graphsafe_s, p.hand_s, p.capture_s) > 0


def test_stale_layers_catches_a_load_that_bypasses_graphsafe():
    reg = plots.gs.Registry()
    model = fold_stack_class(reg, plots.N, plots.C)([plots.ROWS] * 3)
    plots.gs.runtime(model, reg).refresh()
    assert plots.stale_layers(model) == []
    new = [("layers.1.w", torch.randn(plots.ROWS, plots.N * plots.C))]
    untracked_load(model, new)  # control: the weights change, the derived buffer does not
    assert plots.stale_layers(model) == [1]
    model.load_weights(new)
    assert plots.stale_layers(model) == []


def test_main_quick_prints_both_tables_without_drawing(capsys, tmp_path):
    threads = torch.get_num_threads()
    assert plots.main(["--quick", "--no-draw", "--threads", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "figure 1: load of every weight" in out
    assert "figure 2: load of a fraction of 16" in out
    assert " NO" not in out  # every point's buffers were fresh
    assert not list(tmp_path.iterdir())
    assert torch.get_num_threads() == threads


def test_draw_writes_two_small_pngs(sweeps, tmp_path):
    pytest.importorskip("matplotlib", reason="drawing needs the bench extra (matplotlib)")
    by_size, by_fraction = sweeps
    paths = plots.draw(by_size, by_fraction, tmp_path / "img", "CPU (test)")
    assert sorted(p.name for p in paths) == ["refit_vs_fraction.png", "refit_vs_size.png"]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) < 200 * 1024
