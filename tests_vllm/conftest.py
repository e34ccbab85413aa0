"""The vLLM tests: a real engine on vLLM's CPU build (run them with `scripts/test-vllm`).

graphsafe's plugin is turned on here, before vLLM is imported, naming the registry of
derived buffers on vLLM's classes that the engine tests use.
"""

from __future__ import annotations

import os

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
