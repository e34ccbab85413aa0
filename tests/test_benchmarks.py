"""The benchmark script runs and reports every figure (no timing is judged here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def test_quick_run_reports_every_figure_as_json():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # nothing but JSON on stdout
    figures = {row["figure"] for row in report["rows"]}
    assert {"1a", "1b", "2a", "3a", "4a", "4b", "5a", "5b", "5c", "6a", "6b", "7a",
            "10a", "10b", "10c", "10d", "11a", "11b", "11c", "12a", "12b"} <= figures
    measured = [row for row in report["rows"] if not row["skipped"]]
    assert all(row["value"] is not None and row["value"] >= 0 for row in measured)
