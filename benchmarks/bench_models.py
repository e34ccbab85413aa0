"""Synthetic models for the benchmarks, written the way a graphsafe user writes them.

Each builder makes fresh classes registered in the registry it is given, so that no
benchmark leaves derivations in `gs.default_registry`. Parameters never require grad (an
inference model, like the flagship), and every loader writes in place, vLLM style:
`params[name].data.copy_(w)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

import graphsafe as gs

__all__ = ["copy_load", "fold_stack_class", "llm_stack_class", "untracked_load"]


def copy_load(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The loader of every synthetic model: look each entry up, copy it in place."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights:
            params[name].data.copy_(w)


def untracked_load(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
    """Call the model's loading method without graphsafe's wrapper: the baseline load.

    `gs.graphsafe` wraps `load_weights` with `functools.wraps`, so the original function
    is `__wrapped__`; this calls exactly the code the tracked load runs, minus tracking
    and refresh.
    """
    return type(model).load_weights.__wrapped__(model, weights)  # type: ignore[attr-defined]


def fold_stack_class(
    registry: gs.Registry, hc_mult: int, hidden: int, *, out_path: bool = True
) -> type[nn.Module]:
    """A stack of layers, each owning `w [rows, n*C]` and `w_folded = w.view(-1, n, C).sum(1)`.

    This is the mHC broadcast derivation of DeepSeek V4 (`hc_attn_fn_broadcast`), at
    whatever size a benchmark needs. The stack is built as `Stack(rows_per_layer)` and
    loads with `copy_load`.

    Args:
        registry: Where to register the derivation.
        hc_mult: `n`, streams summed over.
        hidden: `C`.
        out_path: Declare the derivation with `out=` (the fast path); False gives the
            slow path (computed apart, then copied into the buffer by the runtime).

    Returns:
        The stack class.
    """
    n, C = hc_mult, hidden

    if out_path:

        def fold(self: nn.Module, w: torch.Tensor, *, out: torch.Tensor | None = None) -> Any:
            return torch.sum(w.view(-1, n, C), dim=1, out=out)  # [rows, C]

    else:

        def fold(self: nn.Module, w: torch.Tensor) -> Any:  # type: ignore[misc]
            return w.view(-1, n, C).sum(1)  # [rows, C], a new tensor

    class FoldLayer(nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(rows, n * C), requires_grad=False)

        _fold = gs.derive("w_folded", inputs=["w"])(fold)

    class FoldStack(nn.Module):
        def __init__(self, rows_per_layer: Sequence[int]) -> None:
            super().__init__()
            self.layers = nn.ModuleList(FoldLayer(r) for r in rows_per_layer)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            copy_load(self, weights)

    gs.graphsafe(registry=registry)(FoldLayer)
    return gs.graphsafe(registry=registry)(FoldStack)


def llm_stack_class(registry: gs.Registry, hidden: int, inter: int) -> type[nn.Module]:
    """A stack of LLM-like decoder blocks: q, kv, o, gate_up, down and two norms.

    One derivation, on the first block only (`norm_plus_one = attn_norm + 1`, the
    Gemma-style stored-minus-one norm), so that a load is all about write tracking and
    the refresh it triggers is negligible. Built as `Stack(num_layers)`.

    Args:
        registry: Where to register the derivation.
        hidden: Model width.
        inter: FFN width.

    Returns:
        The stack class.
    """
    shapes = {
        "q": (hidden, hidden),
        "kv": (hidden // 2, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "attn_norm": (hidden,),
        "ffn_norm": (hidden,),
    }

    class Block(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index
            for name, shape in shapes.items():
                self.register_parameter(
                    name, nn.Parameter(torch.randn(shape), requires_grad=False)
                )

        @gs.derive("norm_plus_one", inputs=["attn_norm"], when=lambda self: self.index == 0)
        def _norm_plus_one(
            self, attn_norm: torch.Tensor, *, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            return torch.add(attn_norm, 1.0, out=out)  # type: ignore[call-overload,no-any-return]

    class LLMStack(nn.Module):
        def __init__(self, num_layers: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block(i) for i in range(num_layers))

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            copy_load(self, weights)

    gs.graphsafe(registry=registry)(Block)
    return gs.graphsafe(registry=registry)(LLMStack)
