"""The LoRA recipe: an adapter merged into its base weight."""

from __future__ import annotations

import torch
from torch import Tensor

from graphsafe.recipes._recipe import Recipe, check_fits, named

__all__ = ["lora_merge"]


def lora_merge(*, scaling: float) -> Recipe:
    """A LoRA adapter merged into its base weight: `base + scaling * lora_b @ lora_a`.

    Args:
        scaling: The adapter's scale (`lora_alpha / r` in PEFT).

    Returns:
        `fn(module, base [O, I], lora_a [r, I], lora_b [O, r], out=None) -> [O, I]`.
    """
    name = f"lora_merge(scaling={scaling})"

    def fn(
        module: object, base: Tensor, lora_a: Tensor, lora_b: Tensor, *,
        out: Tensor | None = None,
    ) -> Tensor:
        if out is not None:
            check_fits(name, module, "the merged weight", out, base.shape)
        return torch.addmm(base, lora_b, lora_a, alpha=scaling, out=out)  # [O, I]

    return named(fn, name)
