"""A pytest plugin for `test_recorders.py`: runs a suite with the recorder that
`GRAPHSAFE_TEST_RECORDER` names (`python`, `native`, or `planted`: the compiled one with a
bug planted, for the control) and writes, per test, what the tests saw discovered, audited
and replayed to the JSON file `GRAPHSAFE_TEST_RECORDER_LOG`.

It only observes: each read of `Runtime.discovered`, each `gs.audit` and each
`Graph.replay` is logged with its result (or the error it raised) and returned unchanged.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest

import graphsafe as gs
from graphsafe._graphs.graph import Graph
from graphsafe._lineage.record import native
from graphsafe._runtime.runtime import Runtime

_LOG: dict[str, list[Any]] = {}
_NOW: list[str] = [""]


def _note(*entry: Any) -> None:
    _LOG.setdefault(_NOW[0], []).append(list(entry))


def _plant() -> None:
    """The control's bug: the compiled recorder forgets every third storage it saw an op
    make (a lost writer, as a record dropped by mistake would lose it)."""
    apply = native._Log.apply

    def planted(self: Any, lineage: Any) -> None:
        before = set(lineage.writers)
        apply(self, lineage)
        made = [sid for sid, (call, _) in lineage.writers.items()
                if sid not in before and call is not None and call.outs]
        for sid in made[::3]:
            del lineage.writers[sid]

    native._Log.apply = planted  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    which = os.environ.get("GRAPHSAFE_TEST_RECORDER", "native")
    native.NATIVE_RECORDER[0] = which != "python"
    if which == "planted":
        _plant()
    discovered = Runtime.discovered.fget
    assert discovered is not None

    def logged_discovered(self: Runtime) -> Any:
        found = discovered(self)
        _note("discovered", sorted(
            (d.path, d.kind, d.module_class, list(d.sources), d.chain, d.opaque, d.stale,
             d.exempt) for d in found))
        return found

    Runtime.discovered = property(logged_discovered)  # type: ignore[method-assign,assignment]
    audit, replay = gs.audit, Graph.replay

    @functools.wraps(audit)
    def logged_audit(model: Any, **kw: Any) -> Any:
        try:
            report = audit(model, **kw)
        except Exception as e:
            _note("audit", type(e).__name__)
            raise
        _note("audit", sorted(report.checked), sorted(report.discovered),
              sorted((u.path, u.why) for u in report.unchecked))
        return report

    def logged_replay(self: Graph) -> None:
        try:
            replay(self)
        except Exception as e:
            _note("replay", type(e).__name__)
            raise
        _note("replay", "ok")

    gs.audit = logged_audit  # type: ignore[assignment]
    Graph.replay = logged_replay  # type: ignore[method-assign]


def pytest_runtest_setup(item: pytest.Item) -> None:
    _NOW[0] = item.nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _note("outcome", report.outcome)


def pytest_unconfigure(config: pytest.Config) -> None:
    path = os.environ.get("GRAPHSAFE_TEST_RECORDER_LOG")
    if path:
        with open(path, "w") as f:
            json.dump(_LOG, f, indent=0, sort_keys=True)
