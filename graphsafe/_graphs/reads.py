"""The read set of a capture: the storages the captured body reads.

A graph reads only what its body's ops read; a guard that checks only those refuses no
replay for a stale tensor the graph never reads, and `Graph.inputs` lists what the graph
reads that the model does not own (static inputs, KV caches). The CPU graph records every
op anyway, so its read set is what its eager body read. On CUDA, `ReadTracker` notes
the storages of every tensor argument of every op during capture; kernels that bypass the
dispatcher (Triton, inductor: `torch.compile`'s code) read memory no op names, so on
either backend a capture that ran compiled code is not trusted, and the guard checks the
whole model instead.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphsafe._memory.walk import storage_key

__all__ = ["CompiledFrames", "ReadTracker", "compiled_code"]

# Where code that launches kernels past the dispatcher lives: dynamo's transformed
# frames, FX graph modules, inductor's generated modules, Triton's launcher.
_COMPILED_NAMES = ("__compiled_fn", "__transformed_code", "torch_dynamo_resume_in_")
_COMPILED_FILES = ("<eval_with_key>", "torchinductor", "/triton/")


def compiled_code(frame: FrameType) -> bool:
    """Whether `frame` runs code that launches kernels the dispatcher does not see."""
    code = frame.f_code
    return code.co_name.startswith(_COMPILED_NAMES) or any(
        f in code.co_filename for f in _COMPILED_FILES
    )


class CompiledFrames:
    """While entered, notes whether any Python frame ran compiled code (`compiled_code`),
    keeping a profiler already set (coverage tools) running."""

    def __init__(self) -> None:
        self.compiled = False
        self._previous: Any = None

    def __enter__(self) -> CompiledFrames:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and not self.compiled and compiled_code(frame):
            self.compiled = True
        if self._previous is not None:
            self._previous(frame, event, arg)


class ReadTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch stubs
    """Notes the storage of every tensor an op reads or writes, and of every tensor one
    makes, while it is entered; and whether compiled code ran (then `reads` is None).

    Examples:
        >>> w, x = torch.ones(2), torch.ones(2)
        >>> with ReadTracker() as rec:
        ...     y = w * x
        >>> rec.reads == {storage_key(w), storage_key(x)}, storage_key(y) in rec.made
        (True, True)
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.read: dict[int, torch.Tensor] = {}  # storage key -> a tensor read there
        self.made: set[int] = set()
        self._watch = CompiledFrames()

    @property
    def compiled(self) -> bool:
        """Whether compiled code ran while it was entered."""
        return self._watch.compiled

    @property
    def reads(self) -> frozenset[int] | None:
        """Storage keys read (made inside the capture or not); None if compiled code ran."""
        return None if self.compiled else frozenset(self.read)

    def outside(self) -> list[torch.Tensor]:
        """A tensor per storage read that no op of the capture made."""
        return [t for k, t in self.read.items() if k not in self.made]

    def __enter__(self) -> ReadTracker:
        self._watch.__enter__()
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        self._watch.__exit__(*exc)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self._note(args)
        self._note(kwargs.values())
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key and key not in self.read:
                    self.made.add(key)
        return out

    def _note(self, values: Iterable[Any]) -> None:
        for v in values:
            if isinstance(v, torch.Tensor):
                key = storage_key(v)
                if key:
                    self.read.setdefault(key, v)
            elif isinstance(v, (list, tuple)):
                self._note(v)
