"""`Job`: what every process of `graphsafe verify --pp N` is started with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from graphsafe._verify.single.oracle import Oracle
from graphsafe._verify.target import VerifyTarget

__all__ = ["Job"]


@dataclass(frozen=True)
class Job:
    """One pipeline run's settings, pickled to every process."""

    target: VerifyTarget
    preset: str
    device: str
    backend: Literal["cuda", "cpu"]
    pp: int
    refits: int
    seed: int
    timeout: float
    oracle: Oracle = "fresh"
    """The trainer's eager logits come from a model built fresh from each refit's
    checkpoint (`fresh`), or from its own model, refitted (`self`)."""
    audit: bool = True
    """Every stage audits its derived tensors after each sync."""
