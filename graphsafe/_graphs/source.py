"""Where in the user's code something happened: the innermost frame that is not torch,
graphsafe, transformers or the standard library. Capture errors name it."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import traceback
from types import FrameType

import torch

__all__ = ["user_frame", "user_frame_of"]


@functools.cache
def _library_dirs() -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(torch and graphsafe, the standard library, graphsafe's reference models).

    The models shipped as `graphsafe.models` count as user code; transformers is looked
    up apart, since it may be imported after the first capture.
    """
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # graphsafe/
    packages = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, here + os.sep)
    paths = sysconfig.get_paths()
    stdlib = {os.path.abspath(p) + os.sep for k in ("stdlib", "platstdlib") if (p := paths[k])}
    return packages, tuple(sorted(stdlib)), os.path.join(here, "models") + os.sep


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, FX's <eval_with_key>
        return not filename.startswith(("<stdin>", "<ipython"))
    path = os.path.abspath(filename)
    packages, stdlib, models = _library_dirs()
    if path.startswith(models):
        return False
    if path.startswith(packages):
        return True
    transformers = getattr(sys.modules.get("transformers"), "__file__", None)
    if transformers is not None and path.startswith(os.path.dirname(transformers) + os.sep):
        return True
    # Packages installed under the standard library's tree (a system site-packages) are not.
    return path.startswith(stdlib) and "-packages" + os.sep not in path


def user_frame() -> traceback.FrameSummary | None:
    """The innermost frame of the caller's stack that is user code, not torch,
    graphsafe, transformers or the standard library; None when there is none."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not _is_library(code.co_filename):
            return traceback.FrameSummary(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def user_frame_of(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost user frame of `error`'s traceback; None when all are library code."""
    for summary in reversed(traceback.extract_tb(error.__traceback__)):
        if not _is_library(summary.filename):
            return summary
    return None
