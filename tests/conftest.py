"""Test configuration: hypothesis profiles, and each test's thread recording no
bring-up's tail an earlier test left.

`ci` (the default) keeps the property tests to a few seconds, with the same examples on
every run; `long` runs many more, drawn afresh. Choose with the environment variable
HYPOTHESIS_PROFILE, e.g. `HYPOTHESIS_PROFILE=long python -m pytest tests/test_properties.py`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from graphsafe import _native
from graphsafe._lineage.window import end_here

# `ci` draws the same examples on every run, so that CI sees what a developer saw (a
# property test that fails only now and then fails every run or never); `long` explores.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _no_tail_of_an_earlier_test() -> Iterator[None]:
    """A model an earlier test loaded and never ran (garbage not collected yet) keeps its
    thread recording until another model's first load (the bring-up's tail,
    `graphsafe._lineage.window`): each test begins without it."""
    end_here()
    yield


@pytest.fixture(scope="module")
def compiled_checks() -> None:
    """Build the compiled checks (cached after the first time; `scripts/setup` builds
    them), or skip the module's tests where no C++ compiler can."""
    try:
        _native.build()
    except _native.NativeBuildError as exc:  # no C++ compiler on this machine
        pytest.skip(f"the compiled checks cannot be built here: {exc}")
