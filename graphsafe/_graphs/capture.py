"""The life of one capture: new, capturing, then captured or failed. Shared by `Graph`
and its backends, so that all refuse a second capture, and a replay before a successful
one, with the same errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from graphsafe._errors import CaptureError

__all__ = ["CaptureState"]

State = Literal["new", "capturing", "captured", "failed"]


class CaptureState:
    """Where a graph is in its one capture.

    Examples:
        >>> state = CaptureState()
        >>> with state.capturing():
        ...     pass
        >>> state.captured, state.state
        (True, 'captured')
    """

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: State = "new"

    @property
    def captured(self) -> bool:
        """Whether a capture succeeded."""
        return self.state == "captured"

    def check_new(self) -> None:
        """Raise `CaptureError` if a capture already began, succeeded or failed."""
        if self.state != "new":
            raise CaptureError(
                "this graph was already captured"
                if self.state == "captured"
                else f"this graph cannot capture again (state: {self.state})",
                expected="one capture per graph",
                got=f"a second capture (state: {self.state})",
                fix="create a new Graph for each capture",
            )

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Mark the body as the capture: captured if it exits normally, else failed."""
        self.check_new()
        self.state = "capturing"
        try:
            yield
        except BaseException:
            self.state = "failed"
            raise
        self.state = "captured"

    def check_replay(self) -> None:
        """Raise `CaptureError` unless a capture succeeded."""
        if self.state != "captured":
            raise CaptureError(
                "replay() before a successful capture",
                expected="a captured graph",
                got=f"state {self.state}",
                fix="capture first: `with g.capture(): out = model(static_x)`",
            )
