"""The compiled recorder discovers what the Python recorder does.

Where the compiled checks are built, a recorded load runs the compiled recorder
(`graphsafe._lineage.record.native`); the Python `Recorder` is the reference. The suites
that record bring-ups (engines' post-load steps, numbers, handles, threads, in-place
rewrites, caches outside the model, the stateful replay machine, the audit) run once with
each, in a subprocess with the `recorder_log` plugin, which logs per test what was
discovered (path, kind, sources, chain), what each audit checked and left unchecked, and
how each replay ended; the two logs must agree, and every test must pass with both. The
control plants a bug in the compiled recorder (it loses what some ops wrote) and shows
that the comparison catches it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from graphsafe import _native

SUITES = ("test_discovered.py", "test_bringup.py", "test_lineage_hooks.py",
          "test_beyond_tree.py", "test_stateful_replay.py", "test_audit.py")
_HERE = Path(__file__).parent

pytestmark = pytest.mark.skipif(
    _native.get() is None, reason="the compiled recorder needs the compiled checks")


def _start(which: str, files: tuple[str, ...], log: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "GRAPHSAFE_TEST_RECORDER": which,
           "GRAPHSAFE_TEST_RECORDER_LOG": str(log)}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", *files, "-q", "-p", "recorder_log",
         "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=_HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str], log: Path) -> tuple[int, str, dict[str, Any]]:
    out, _ = proc.communicate(timeout=1200)
    logged = json.loads(log.read_text()) if log.exists() else {}
    return proc.returncode, out[-3000:], logged


def _same_run(value: Any) -> Any:
    """`value` without what differs between two runs of the same test: addresses and
    ids in names (five digits or more), OS thread ids."""
    if isinstance(value, str):
        return re.sub(r"\d{5,}|(?<=OS thread )\d+", "#", value)
    if isinstance(value, list):
        return [_same_run(v) for v in value]
    return value


def _normal(entry: list[Any]) -> Any:
    """A logged entry, comparable across runs. A discovered tensor's sources are a set:
    found by the load tracker's taint, they come in the order of their addresses, and so
    does the first link of its chain."""
    if entry[0] != "discovered":
        return _same_run(entry)
    rows = []
    for path, kind, cls, sources, chain, opaque, stale, exempt in entry[1]:
        ops = chain.split(" -> ", 1)[1] if " -> " in chain else chain
        rows.append(_same_run([path, kind, cls, sorted(sources), ops, opaque, stale, exempt]))
    return ["discovered", sorted(rows)]


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Per test of either log, the first entry where the two differ."""
    found = []
    for test in sorted(set(a) | set(b)):
        x = [_normal(e) for e in a.get(test, [])]
        y = [_normal(e) for e in b.get(test, [])]
        if x != y:
            first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            found.append(f"{test}: python {x[first:first + 1]} != compiled {y[first:first + 1]}")
    return found


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, dict[str, Any]]]:
    where = tmp_path_factory.mktemp("recorders")
    procs = {w: _start(w, SUITES, where / f"{w}.json") for w in ("python", "native")}
    return {w: _finish(p, where / f"{w}.json") for w, p in procs.items()}


def test_the_compiled_recorder_discovers_audits_and_replays_as_the_python_one(
        logs: dict[str, tuple[int, str, dict[str, Any]]]) -> None:
    for which, (code, out, _) in logs.items():
        assert code == 0, f"the recording suites failed with the {which} recorder:\n{out}"
    python, compiled = logs["python"][2], logs["native"][2]
    assert len(python) >= 200  # every test of the suites logged
    assert sum(e[0] == "discovered" for t in python.values() for e in t) >= 100
    differences = _differences(python, compiled)
    assert not differences, "\n".join(differences[:10])


def test_control_a_compiled_recorder_that_loses_writes_is_caught(
        logs: dict[str, tuple[int, str, dict[str, Any]]], tmp_path: Path) -> None:
    log = tmp_path / "planted.json"
    _, _, planted = _finish(_start("planted", ("test_discovered.py",), log), log)
    python = {t: e for t, e in logs["python"][2].items() if t.startswith("test_discovered.py")}
    differences = _differences(python, planted)
    assert any("'discovered'" in d for d in differences), differences
