"""`graphsafe.integrations.trl` where TRL is not installed (the main test environment):
it imports, and `enable` changes nothing. The TRL tests themselves run in vLLM's
environment (`tests_vllm/test_trl.py`, `scripts/test-vllm`)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from graphsafe.integrations import trl as gs_trl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is not None, reason="TRL is installed here"
)


def test_without_trl_enable_returns_false_and_changes_nothing() -> None:
    before = dict(os.environ)
    assert gs_trl.installed() is False
    assert gs_trl.enable("my_pkg.derived:registry", lazy_refresh=True) is False
    assert dict(os.environ) == before  # the vLLM plugin was not turned on


class _NoEngine:
    """A generation object without a colocated engine (TRL's server mode)."""


def test_without_trl_the_record_and_lookup_still_work() -> None:
    assert gs_trl.syncs(_NoEngine()) == []
    assert gs_trl.engine_attachment(_NoEngine()) is None  # no engine: nothing attached
    record = gs_trl.SyncRecord(updates=1, refreshed=2, stale=(), seconds=0.1,
                               refresh_seconds=0.01)
    with pytest.raises(ValueError, match="frozen"):
        record.updates = 2  # type: ignore[misc]
