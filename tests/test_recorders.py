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

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphsafe as gs
from graphsafe import _native
from graphsafe._lineage.record.recorder import RECORDING

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


# -- what RecordFunction sees under the compiled recorder -----------------------------


@torch.library.custom_op("gstest_recorders::pack_t", mutates_args=())
def _pack_t(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


@_pack_t.register_fake
def _(w: torch.Tensor) -> torch.Tensor:
    return w.new_empty(w.shape[::-1])


@torch.library.custom_op("gstest_recorders::copy_unsaid", mutates_args=())
def _copy_unsaid(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A kernel that writes `dst`, which its schema says nothing of (a custom op with its
    `mutates_args` left out)."""
    dst.copy_(src)


@_copy_unsaid.register_fake
def _(dst: torch.Tensor, src: torch.Tensor) -> None:
    return None


def _called_back(fn: Callable[[], object]) -> set[str]:
    """The ops RecordFunction saw `fn` run (torch's profiler is one of its callbacks)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        fn()
    return {e.name for e in p.events()}


class _Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@gs.graphsafe
class _Packs(nn.Module):
    """A loader, then a post-load step (`post`) that runs what the test looks at."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def load_weights(self, weights: dict[str, torch.Tensor],
                     post: Callable[[_Packs], None] | None = None) -> None:
        with torch.no_grad():
            self.w.copy_(weights["w"])
        if post is not None:
            post(self)


_NESTED = {"aten::empty_like", "aten::copy_"}
"""What `clone`'s kernel runs."""


def _pack(m: _Packs) -> None:
    m.packed = m.w.detach().t().contiguous()


def test_the_ops_a_recorded_aten_op_runs_are_not_called_back_and_it_is_discovered() -> None:
    seen: dict[str, set[str]] = {}
    control = _called_back(lambda: torch.ones(4, 4).t().contiguous())  # no recording

    def post(m: _Packs) -> None:
        seen["packing"] = _called_back(lambda: _pack(m))
        with contextlib.suppress(RuntimeError):
            torch.ones(4).view(3)  # an aten op that raises under the recording
        seen["after a raise"] = _called_back(lambda: _pack(m))

    m = _Packs()
    m.load_weights({"w": torch.randn(4, 4)}, post)
    assert control >= _NESTED
    assert "aten::clone" in seen["packing"] and not _NESTED & seen["packing"]
    assert "aten::clone" in seen["after a raise"]  # RecordFunction came back on
    assert [d.path for d in gs.runtime(m).discovered] == ["packed"]


def test_under_a_custom_op_or_a_dispatch_mode_the_ops_it_runs_are_called_back() -> None:
    seen: dict[str, set[str]] = {}

    def post(m: _Packs) -> None:
        seen["custom op"] = _called_back(lambda: _pack_t(m.w))
        with _Passing():
            seen["dispatch mode"] = _called_back(lambda: _pack(m))

    _Packs().load_weights({"w": torch.randn(4, 4)}, post)
    assert seen["custom op"] >= _NESTED and seen["dispatch mode"] >= _NESTED


@pytest.mark.parametrize("unseen", [False, True], ids=["recorded", "control_unseen"])
def test_a_write_a_custom_op_does_not_declare_in_a_recorded_load_is_refreshed(
        unseen: bool) -> None:
    """The write below a custom op, in a recorded load (every load is, here), reaches the
    load: what is derived from the weight is fresh. Control: the same write with
    RecordFunction off (as under an aten op the recorder quiets) is missed, and what is
    derived stays stale."""

    @gs.graphsafe
    class Unsaid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

        @gs.derive("w_t", inputs=["w"])
        def _w_t(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
            return w.t().contiguous() if out is None else out.copy_(w.t())

        def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():
                if unseen:
                    torch.autograd._enable_record_function(False)
                try:
                    # Through `.data`, as a loader does: no version bump to witness.
                    _copy_unsaid(self.w.data, weights["w"])
                finally:
                    torch.autograd._enable_record_function(True)

    saved, RECORDING[0] = RECORDING[0], "all"
    try:
        m = Unsaid()
        m.load_weights({"w": torch.randn(4, 4)})
        new = torch.randn(4, 4)
        m.load_weights({"w": new})
    finally:
        RECORDING[0] = saved
    assert torch.equal(m.w, new)
    assert torch.equal(m.w_t, new.t()) is not unseen
