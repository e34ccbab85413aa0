"""The compiled checks: C++ for the guard's flat checks and the load-time write tracker."""

from graphsafe._native.loader import (
    Native,
    NativeBuildError,
    announced,
    build,
    describe,
    get,
    path,
    timed_build,
    using,
)
from graphsafe._native.selfcheck import only_thread

__all__ = [
    "Native",
    "NativeBuildError",
    "announced",
    "build",
    "describe",
    "get",
    "only_thread",
    "path",
    "timed_build",
    "using",
]
