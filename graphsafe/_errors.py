"""Errors raised by graphsafe.

Every error says what went wrong, where (module class, dotted tensor path, derivation),
what was expected against what was found, and how to fix it. The same facts are kept as
attributes so that callers can act on them.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CaptureError",
    "DerivationDriftError",
    "GraphSafetyError",
    "ImpureDerivationError",
    "NotMaterializedError",
    "RegistrationError",
    "StaleError",
    "StorageMovedError",
    "WeightLoadError",
    "first_line",
    "one_line",
]


def first_line(exc: BaseException) -> str:
    """The first line of `exc`'s message, for one-line summaries."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def one_line(exc: BaseException) -> str:
    """`exc` as `Type: first line of its message`."""
    return f"{type(exc).__name__}: {first_line(exc)}"


class GraphSafetyError(Exception):
    """Base class of every error graphsafe raises.

    Args:
        summary: One line saying what went wrong.
        module_class: Name of the class of the module involved.
        path: Dotted path of the tensor involved, from the model root.
        derivation: Qualified name of the derivation involved.
        expected: What graphsafe expected to find.
        got: What it found instead.
        fix: How to fix it.

    Examples:
        >>> try:
        ...     raise GraphSafetyError("boom", path="layers.0.w", fix="do not")
        ... except GraphSafetyError as e:
        ...     e.path
        'layers.0.w'
    """

    def __init__(
        self,
        summary: str,
        *,
        module_class: str | None = None,
        path: str | None = None,
        derivation: str | None = None,
        expected: object = None,
        got: object = None,
        fix: str | None = None,
    ) -> None:
        self.summary = summary
        self.module_class = module_class
        self.path = path
        self.derivation = derivation
        self.expected = expected
        self.got = got
        self.fix = fix
        super().__init__(self._message())

    def _message(self) -> str:
        lines = [self.summary]
        for label, value in (
            ("module", self.module_class),
            ("tensor", self.path),
            ("derivation", self.derivation),
            ("expected", self.expected),
            ("got", self.got),
        ):
            if value is not None:
                lines.append(f"  {label + ':':<12}{value}")
        if self.fix:
            lines.append(f"  {'fix:':<12}{self.fix}")
        return "\n".join(lines)


class RegistrationError(GraphSafetyError):
    """A derivation cannot be registered or bound.

    Raised for an unknown input path, a duplicate or colliding output name, a dependency
    cycle, or a function whose signature does not fit its inputs.
    """


class DerivationDriftError(GraphSafetyError):
    """A new result does not fit the buffer materialized for it.

    Its shape, dtype, device or layout differs from the buffer's, so writing it would
    either corrupt the buffer or force a reallocation that captured graphs would not see.
    Nothing is written; the buffer is marked stale.
    """


class StorageMovedError(GraphSafetyError):
    """A pinned tensor was rebound to new storage.

    After `Runtime.pin()` or a graph capture, every tensor a graph reads must keep its
    storage. `drifts` lists each tensor that moved.

    Args:
        summary: One line saying what went wrong.
        drifts: One entry per moved tensor (see `graphsafe._ledger.Drift`).
        **kwargs: As for `GraphSafetyError`.
    """

    def __init__(self, summary: str, *, drifts: Sequence[object] = (), **kwargs: Any) -> None:
        self.drifts = tuple(drifts)
        super().__init__(summary, **kwargs)


class ImpureDerivationError(GraphSafetyError):
    """A derivation wrote into one of its inputs or another tensor of the model.

    Derivations must be pure functions of their inputs: a write into a parameter (for
    example folding a scale with `mul_`) makes every later load give different results.
    """


class StaleError(GraphSafetyError):
    """The model is used while derived buffers do not match their inputs.

    `paths` lists the stale derived buffers.

    Args:
        summary: One line saying what went wrong.
        paths: Dotted paths of the stale buffers.
        **kwargs: As for `GraphSafetyError`.
    """

    def __init__(self, summary: str, *, paths: Sequence[str] = (), **kwargs: Any) -> None:
        self.paths = tuple(paths)
        super().__init__(summary, **kwargs)


class NotMaterializedError(StaleError, AttributeError):
    """A derived buffer is read before a first load materialized it.

    Also an `AttributeError`, so `hasattr(module, name)` stays False until then.
    """


class CaptureError(GraphSafetyError):
    """A callable cannot be captured as a graph (for example it reads a tensor's value
    into Python with `.item()`, which a captured graph cannot replay).

    `source` is the line of user code that did it (outside torch, graphsafe and
    transformers), when the error comes from inside the captured body; the message
    names it under `where:`.

    Args:
        summary: One line saying what went wrong.
        source: The user code's frame: its `filename`, `lineno`, `name` and `line`.
        **kwargs: As for `GraphSafetyError`.
    """

    def __init__(
        self, summary: str, *, source: traceback.FrameSummary | None = None, **kwargs: Any
    ) -> None:
        self.source = source
        super().__init__(summary, **kwargs)

    def _message(self) -> str:
        message = super()._message()
        if self.source is None:
            return message
        src = self.source
        where = f"{src.filename}:{src.lineno}, in {src.name}"
        if src.line:
            where += f": {src.line.strip()}"
        head, sep, rest = message.partition("\n")
        return f"{head}\n  {'where:':<12}{where}" + (sep + rest if sep else "")


class WeightLoadError(GraphSafetyError):
    """A checkpoint entry cannot be loaded: unknown name, wrong shape or wrong dtype.

    `name` is the checkpoint entry.

    Args:
        summary: One line saying what went wrong.
        name: The checkpoint entry's name.
        **kwargs: As for `GraphSafetyError`.
    """

    def __init__(self, summary: str, *, name: str, **kwargs: Any) -> None:
        self.name = name
        super().__init__(summary, **kwargs)


# Tracebacks name the public home of each error: `graphsafe.StaleError`.
for _cls in (
    GraphSafetyError,
    RegistrationError,
    DerivationDriftError,
    StorageMovedError,
    ImpureDerivationError,
    StaleError,
    NotMaterializedError,
    CaptureError,
    WeightLoadError,
):
    _cls.__module__ = "graphsafe"
