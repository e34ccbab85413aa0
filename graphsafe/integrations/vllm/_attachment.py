"""graphsafe's state on one vLLM model (`Attachment`) and the map of attached models, below
`attach` and the vLLM patches, so that patched vLLM code finds a model's attachment."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from graphsafe._declare.registry import Registry
from graphsafe._graphs.guard import Guard
from graphsafe._graphs.reads import ReadTracker
from graphsafe._memory.walk import storage_key
from graphsafe.integrations._engine import EngineAttachment
from graphsafe.integrations.vllm._reads import StepReadTracker

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Attachment] = weakref.WeakKeyDictionary()


class Attachment(EngineAttachment):
    """graphsafe's state on one vLLM model: its runtime, the guard once pinned (and the
    read set it checks), and the weight update in progress.

    Args:
        model: The loaded model (`worker.model_runner.get_model()`).
        registries: Where its derived buffers are declared.
    """

    loads_tracked = True  # vLLM's weight loaders write with torch ops (`copy_`, `narrow`)

    def __init__(self, model: nn.Module, registries: Iterable[Registry]) -> None:
        super().__init__(model, registries)
        self._read_paths: frozenset[str] = frozenset()
        """Where the discovered tensors the recorded forward read are held: a forward
        that runs op by op reads whatever is bound there, so a later load that binds a
        new one (vLLM's post-load step makes a new kernel handle) keeps it in the read
        set."""

    def _updated(self) -> None:
        self._follow_read_paths()

    # -- the first forward's read set ------------------------------------------------

    def _read_tracker(self) -> ReadTracker:
        return StepReadTracker()

    def _narrowed(self, guard: Guard, reads: frozenset[int] | None,
                  outside: list[torch.Tensor]) -> None:
        """vLLM runs each layer's own ops (attention, fused MoE) by the layer's name, so a
        forward reads exactly its layers' state (`StepReadTracker`): the guard checks only
        the model's tensors it read, unless compiled code or an opaque vLLM op ran, or it
        read nothing of the model (then the whole model stays checked)."""
        if reads is not None and reads & guard.ledger.storages:
            guard.narrow(reads, outside)
            self._read_paths = frozenset(p for p, k in self._discovered() if k in reads)

    def _discovered(self) -> list[tuple[str, int]]:
        """(path, storage key) of each discovered tensor that is checked (not exempted)."""
        return [(i.path, storage_key(i.held)) for i in self.runtime.audit_items()]

    def _follow_read_paths(self) -> None:
        """After an update: add to the read set the discovered tensors now held where the
        recorded forward read one (`_read_paths`)."""
        guard = self.guard
        if guard is None or guard.reads is None or not self._read_paths:
            return
        keys = {k for p, k in self._discovered() if k and p in self._read_paths}
        if not keys <= guard.reads:
            guard.narrow(guard.reads | keys, guard.inputs)

    def status(self) -> dict[str, Any]:
        """What graphsafe holds for this model, as plain data (for `collective_rpc`)."""
        return self._describe(read_set=True)


def attachment(model: nn.Module) -> Attachment | None:
    """The attachment of `model`, if it has one."""
    return _ATTACHED.get(model)
