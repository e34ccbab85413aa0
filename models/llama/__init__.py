"""Llama reading kernel-format weights: fused QKV and gate-up, or FP8 by block from
transient checkpoint projections."""

from graphsafe.models.llama import model
from graphsafe.models.llama.model import *  # noqa: F403  (its `__all__` is the list)

__all__ = model.__all__
