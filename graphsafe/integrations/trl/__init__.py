"""graphsafe under TRL's GRPO with vLLM colocated, on in one line.

    from graphsafe.integrations import trl as gs_trl
    gs_trl.enable("my_pkg.derived:registry")   # before building the trainer
    trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate"))

`enable` turns graphsafe's vLLM plugin on (`graphsafe.integrations.vllm.enable`) with the
CPU-build settings a bare `load_weights` sync needs, makes each TRL weight sync
(`VLLMGeneration.sync_weights`, one `load_weights` call per parameter) one graphsafe
update with one refresh at its end, compares the policy's fingerprints with the
engine's after each sync, and adds a `GraphsafeCallback` to every `GRPOTrainer` that
uses vLLM, which puts each sync's record (updates, refreshed, stale, time, fingerprint
mismatches) into TRL's logs. Where TRL is not installed, importing this module does nothing,
and `enable` returns False and changes nothing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

from graphsafe.integrations.trl._sync import SyncRecord as SyncRecord
from graphsafe.integrations.trl._sync import engine_attachment as engine_attachment
from graphsafe.integrations.trl._sync import patch_sync
from graphsafe.integrations.trl._sync import syncs as syncs

__all__ = [
    "GraphsafeCallback",
    "SyncRecord",
    "engine_attachment",
    "enable",
    "installed",
    "syncs",
]


def installed() -> bool:
    """Whether TRL (with the vLLM generation it syncs) can be imported here."""
    try:
        return importlib.util.find_spec("trl") is not None
    except (ImportError, ValueError):
        return False


def enable(
    *registries: str,
    cpu_keep_weights: bool = True,
    cpu_keep_lm_head: bool = True,
    lazy_refresh: bool | None = None,
    callback: bool = True,
    fingerprints: bool = True,
) -> bool:
    """Turn graphsafe on for TRL trainers built afterwards in this process.

    Args:
        *registries: `"module:attribute"` names of the registries declaring derived
            buffers on vLLM's classes (none: graphsafe checks what vLLM derives).
        cpu_keep_weights: On vLLM's CPU build, keep every weight TRL's sync writes
            (without it the sync fails inside vLLM). No effect on a GPU.
        cpu_keep_lm_head: On vLLM's CPU build, the LM head reads its weight, not a
            packed copy TRL's sync would leave stale (caught, by name, if off).
        lazy_refresh: See `graphsafe.integrations.vllm.enable` (None: as it is).
        callback: Add a `GraphsafeCallback` to each `GRPOTrainer` that uses vLLM.
        fingerprints: After each sync, compare the policy's parameters with the engine's
            by fingerprint, where the names and shapes match (`SyncRecord`): one read
            of both, on their devices.

    Returns:
        Whether TRL was found and patched (False: nothing was changed).
    """
    if not installed():
        return False
    from graphsafe.integrations import vllm as gsv

    # Imported by name: TRL ships no type information.
    generation = importlib.import_module("trl.generation.vllm_generation")

    gsv.enable(
        *registries,
        cpu_keep_weights=cpu_keep_weights,
        cpu_keep_lm_head=cpu_keep_lm_head,
        lazy_refresh=lazy_refresh,
    )
    patch_sync(generation.VLLMGeneration, fingerprints=fingerprints)
    if callback:
        _add_callback_on_init()
    return True


def _add_callback_on_init() -> None:
    """Every `GRPOTrainer` built from now on that uses vLLM gets a `GraphsafeCallback`."""
    from graphsafe.integrations.trl._callback import GraphsafeCallback

    trainer_cls: Any = importlib.import_module("trl").GRPOTrainer
    init = trainer_cls.__init__
    if getattr(init, "_graphsafe", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "vllm_generation", None) is not None and not any(
            isinstance(c, GraphsafeCallback) for c in self.callback_handler.callbacks
        ):
            self.add_callback(GraphsafeCallback(self))

    __init__._graphsafe = True  # type: ignore[attr-defined]
    trainer_cls.__init__ = __init__


def __getattr__(name: str) -> Any:
    if name == "GraphsafeCallback":  # needs transformers: imported when asked for
        from graphsafe.integrations.trl._callback import GraphsafeCallback

        return GraphsafeCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
