"""The vLLM tests: a real engine on vLLM's CPU build (run them with `scripts/test-vllm`).

graphsafe's plugin is turned on here, before vLLM is imported, naming the registry of
derived buffers on vLLM's classes that the engine tests use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# vLLM starts subprocesses (model inspection) that load the plugin too: the registry's
# module must be importable there, so this folder goes on their path.
_here = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_here, os.environ.get("PYTHONPATH", "")) if p
)
os.environ["GRAPHSAFE_VLLM_REGISTRIES"] = "vllm_derivations:registry"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "graphsafe")


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "graphsafe" for ep in entry_points(group="vllm.general_plugins"))


PLUGIN_INSTALLED = _plugin_installed()
if not PLUGIN_INSTALLED:
    # Run from a source tree that is not installed (scripts/gpu-check): vLLM cannot find
    # the entry point, so the plugin is turned on here, in this (the engine's) process.
    from graphsafe.integrations import vllm as gsv

    gsv.plugin()


@pytest.fixture
def compiled_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An environment where vLLM compiles. Building a config for an architecture that
    defaults to breakable CUDA graphs (test_deepseek_v4 builds DeepSeek V4's) sets
    VLLM_USE_BREAKABLE_CUDAGRAPH=1 for the whole process, and every engine started after
    it then runs uncompiled; vLLM caches its environment once an engine has started."""
    from vllm import envs

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    envs.disable_envs_cache()
    yield
    envs.disable_envs_cache()  # later engines read the environment restored
