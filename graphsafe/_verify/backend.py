"""The graph backend of a verify run."""

from __future__ import annotations

from typing import Literal

import torch

from graphsafe._errors import GraphSafetyError

__all__ = ["choose_backend"]


def choose_backend(backend: str) -> Literal["cuda", "cpu"]:
    """`cuda` or `cpu` as asked; `auto`: `cuda` where a GPU is visible.

    Raises:
        GraphSafetyError: Any other name.
    """
    if backend not in ("auto", "cuda", "cpu"):
        raise GraphSafetyError(
            f"unknown backend {backend!r}", expected="auto, cuda or cpu", got=backend,
            fix="pass --backend auto, cuda or cpu",
        )
    if backend == "cuda" or (backend == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"
