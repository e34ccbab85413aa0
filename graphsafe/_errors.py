"""Errors raised by graphsafe: each says what, where, expected against got, and the fix,
and keeps the same facts as attributes so that callers can act on them."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CaptureError",
    "DerivationDriftError",
    "FrozenWeightsError",
    "GraphSafetyError",
    "GraphSafetyWarning",
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

    Each argument is kept as an attribute of the same name; subclasses take the same
    arguments, and may add their own.

    Args:
        summary: One line saying what went wrong.
        module_class: Class name of the module involved.
        path: Dotted path of the tensor involved, from the model root.
        derivation: Qualified name of the derivation involved.
        expected: What graphsafe expected to find.
        got: What it found instead.
        fix: How to fix it.

    Examples:
        >>> e = GraphSafetyError("boom", path="layers.0.w", fix="do not")
        >>> e.path, str(e).splitlines()[1]
        ('layers.0.w', '  tensor:     layers.0.w')
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
    """A derivation cannot be registered or bound: an unknown input path, a duplicate or
    colliding output name, a dependency cycle, or a signature that does not fit."""


class DerivationDriftError(GraphSafetyError):
    """A new result's shape, dtype, device or layout differs from its buffer's: writing it
    would corrupt the buffer or reallocate it behind captured graphs. Nothing is written;
    the buffer is marked stale."""


class StorageMovedError(GraphSafetyError):
    """A pinned tensor or submodule was rebound after `Runtime.pin()` or a graph capture:
    a captured graph would read its old memory.

    Args:
        drifts: One `Drift` per way a pinned tensor or submodule moved.
    """

    def __init__(self, summary: str, *, drifts: Sequence[object] = (), **kwargs: Any) -> None:
        self.drifts = tuple(drifts)
        super().__init__(summary, **kwargs)


class ImpureDerivationError(GraphSafetyError):
    """A derivation wrote into one of its inputs or another tensor of the model. It must be
    pure: a write into a parameter (folding a scale with `mul_`, say) makes every later
    load give different results."""


class StaleError(GraphSafetyError):
    """The model is used while derived buffers do not match their inputs.

    Args:
        paths: Dotted paths of the stale derived buffers.
    """

    def __init__(self, summary: str, *, paths: Sequence[str] = (), **kwargs: Any) -> None:
        self.paths = tuple(paths)
        super().__init__(summary, **kwargs)


class NotMaterializedError(StaleError, AttributeError):
    """A derived buffer is read before a first load materialized it; an `AttributeError`
    too, so that `hasattr(module, name)` stays False until then."""


class CaptureError(GraphSafetyError):
    """A callable cannot be captured as a graph (for example it reads a tensor's value
    into Python with `.item()`, which a captured graph cannot replay).

    Args:
        source: The frame of user code (outside torch, graphsafe and transformers) that
            did it, when known; the message names it under `where:`.
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

    Args:
        name: The checkpoint entry's name.
    """

    def __init__(self, summary: str, *, name: str, **kwargs: Any) -> None:
        self.name = name
        super().__init__(summary, **kwargs)


class FrozenWeightsError(GraphSafetyError):
    """Compiled code holds weights of the model as constants (`torch.compile` with
    inductor's `freezing`): a load writes the weights and the compiled code keeps the old
    values. Raised at the pin: a graph's capture, or an engine's pin.

    Args:
        paths: Dotted paths of the weights frozen.
    """

    def __init__(self, summary: str, *, paths: Sequence[str] = (), **kwargs: Any) -> None:
        self.paths = tuple(paths)
        super().__init__(summary, **kwargs)


class GraphSafetyWarning(UserWarning):
    """A guarantee graphsafe cannot give here, and how to get it: e.g. no process-wide
    write observer without the compiled build (`graphsafe native build`)."""


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
    FrozenWeightsError,
    GraphSafetyWarning,
):
    _cls.__module__ = "graphsafe"
