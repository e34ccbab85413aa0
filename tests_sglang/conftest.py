"""The SGLang tests: SGLang's real model classes in this process (tier 1) and its real CPU
Engine (tier 2). Run them with `scripts/test-sglang`, which makes their environment.

SGLang's CPU path is switched on and the stand-ins for the packages without a CPU build
are installed here, before SGLang is imported; the Engine's subprocesses load them through
`sitecustomize.py`, so this folder goes on their path.
"""

from __future__ import annotations

import os

_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(_here)
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(
    dict.fromkeys(p for p in (_here, _root, *os.environ.get("PYTHONPATH", "").split(os.pathsep))
                  if p)
)

import sglang_stubs  # noqa: E402

sglang_stubs.install()

import pytest  # noqa: E402


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "graphsafe" for ep in entry_points(group="sglang.srt.plugins"))


PLUGIN_INSTALLED = _plugin_installed()
"""Whether SGLang finds graphsafe's entry point (graphsafe installed in this environment)."""


@pytest.fixture(scope="session")
def dist() -> None:
    """A one-process gloo group and SGLang's model-parallel groups (its layers need them)."""
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(backend="gloo")


@pytest.fixture(scope="session")
def patched(dist: None) -> None:
    """graphsafe's patches to SGLang's classes, in this process (what the plugin installs
    in each SGLang process). A model not attached passes through them unchanged."""
    from graphsafe.integrations import sglang as gss

    gss.install(gss.DEEPSEEK_MLA)
