"""graphsafe's state on one vLLM model (`Attachment`) and the map of attached models, below
`attach` and the vLLM patches, so that patched vLLM code finds a model's attachment."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from graphsafe._declare.registry import Registry
from graphsafe._graphs.guard import Guard
from graphsafe._memory.walk import storage_key
from graphsafe.integrations._engine import EngineAttachment, read_by_address
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
        self.recording = False
        """Whether the next guarded forward is recorded, to narrow the guard to its reads."""
        self._bring_up = contextlib.ExitStack()
        """Holds the model's bring-up open from the pin of an engine that records its
        first forward until that forward ends: a cache outside the model that it reads
        is matched against what the bring-up computed from the weights."""
        self._read_paths: frozenset[str] = frozenset()
        """Where the discovered tensors the recorded forward read are held: a forward
        that runs op by op reads whatever is bound there, so a later load that binds a
        new one (vLLM's post-load step makes a new kernel handle) keeps it in the read
        set."""

    def _updated(self) -> None:
        self._follow_read_paths()

    # -- pin and guard -----------------------------------------------------------

    def pin(self, *, record_reads: bool = False, graphs: bool = True) -> None:
        """Pin the model as the engine's graphs saw it (after capture or warm-up).

        Every parameter, buffer, derived buffer and tensor attribute is pinned except
        host scalars kept as plain attributes (the attention layers' `_k_scale_cpu`):
        kernels take them by value, so a graph bakes in their value at capture, never
        their address, and vLLM's own reload binds them anew.

        Args:
            record_reads: The engine captures no graphs and runs op by op: its first
                guarded forward (`recorded`) is recorded, and from then on the guard
                checks only what that forward read.
            graphs: The engine captured graphs that read the model by address: a moved
                tensor is refused. False (vLLM's CPU engine, `enforce_eager`): each step
                reads what is bound, so a tensor rebound to new memory (a packed copy
                vLLM's post-load step rebuilt) is followed and listed in the status
                (`moved`); stale content is refused either way.
        """
        if self.guard is None:
            if record_reads:  # no capture ends the bring-up: the first recorded forward does
                self._bring_up.enter_context(self.runtime.capturing())
            guard = self.guard = Guard(self.model, self, repair=False, keep=read_by_address,
                                       holds_addresses=graphs)
            self.recording = record_reads
            # Every pinned tensor the guard checks, not only derivation inputs, is checked
            # when a load or update ends, so a rebinding raises through the call that made
            # it (the guard's ledger as it is then: narrowed after the first forward).
            self.runtime.add_load_check(guard.assert_stable)

    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        """One forward under the guard's checks, recorded while `recording`: then the
        guard checks only the model's tensors it read, and lists what it read that the
        model does not hold (`guard.inputs`); those the bring-up computed from the
        weights (a kernel library's cache of packed weights) are guarded, and the
        bring-up ends. A forward that ran compiled code, or read nothing of the model,
        leaves the whole model checked; either way later forwards are not recorded. A
        forward that raises is not counted.

        Raises:
            StorageMovedError: A tensor or submodule the guard checks was rebound.
            StaleError: Derived buffers are stale, or the last weight update failed or has
                not ended.
        """
        guard = self.guard
        if guard is None:
            yield
            return
        with guard.replaying():
            if not self.recording:
                yield
                return
            with StepReadTracker() as rec:
                yield
            self.recording = False
            reads = rec.reads
            try:
                if reads is not None and reads & guard.ledger.storages:
                    # What it read outside the model, computed from the weights: guarded.
                    guard.narrow(reads, rec.outside())
                    self._read_paths = frozenset(p for p, k in self._discovered()
                                                 if k in reads)
            finally:
                self._bring_up.close()  # the bring-up ends with the first recorded forward

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
