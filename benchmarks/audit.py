"""Figure 10: what the content audit (`gs.audit`) costs next to one full refresh.

The audit recomputes every declared derivation out of place, from the inputs as they
are, and compares each result with its buffer; a full `rt.refresh()` recomputes the same
derivations into their buffers. Each row times both on the same model, alternated in one
run; the ratio is the median of the paired ratios (see harness.py).

- 10a: memory-bound, a sum: the mHC fold (`w.view(-1, 4, C).sum(1)`, `out=`) of 8 layers,
  64 MiB of weights in all (the audit reads the weights, and the buffers twice: the
  result and the held buffer).
- 10b: memory-bound, a transpose (`w.t().contiguous()`, no `out=`: computed apart, as a
  refresh of a derivation without `out=` computes it) of 8 square weights, 64 MiB in all.
- 10c: compute-bound, a matmul (an absorbed weight `w_a @ w_b`, `out=`) of 4 layers of
  1024 x 1024 f32.
- 10d: memory: the audit's peak allocation above what the model holds, against one
  derivation's output (the 10a model): it recomputes one derivation at a time.

Each time row also gives `audit_kept_s`: the audit of a graph with `audit_every`, which
keeps its scratch block between audits (the plain `gs.audit` frees it, so every call
allocates it afresh).
"""

from __future__ import annotations

from typing import Any

import torch
from bench_models import fold_stack_class
from figures import Ctx
from harness import Row, fmt_bytes, interleave, paired, peak_extra_bytes
from torch import nn

import graphsafe as gs
from graphsafe._audit.audit import Auditor

__all__ = ["fig10"]

MiB = 1 << 20
_LAYERS = 8


def _transpose_class(registry: gs.Registry) -> type[nn.Module]:
    class Square(nn.Module):
        def __init__(self, side: int) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(side, side), requires_grad=False)

    @registry.derive(Square, "w_t", inputs=["w"])
    def _w_t(m: Square, w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous()  # [side, side]

    class Stack(nn.Module):
        def __init__(self, side: int, layers: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Square(side) for _ in range(layers))

    return Stack


def _matmul_class(registry: gs.Registry) -> type[nn.Module]:
    class Absorbed(nn.Module):
        def __init__(self, side: int) -> None:
            super().__init__()
            self.w_a = nn.Parameter(torch.randn(side, side) / side**0.5, requires_grad=False)
            self.w_b = nn.Parameter(torch.randn(side, side) / side**0.5, requires_grad=False)

    @registry.derive(Absorbed, "w_ab", inputs=["w_a", "w_b"])
    def _w_ab(m: Absorbed, w_a: torch.Tensor, w_b: torch.Tensor, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.matmul(w_a, w_b, out=out)  # [side, side]

    class Stack(nn.Module):
        def __init__(self, side: int, layers: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Absorbed(side) for _ in range(layers))

    return Stack


def _models(ctx: Ctx) -> dict[str, tuple[nn.Module, str]]:
    """Figure -> (model with its derivations materialized, what it derives)."""
    quick = ctx.sizes.smoke
    total = (1 if quick else 64) * MiB  # bytes of weights in all, 10a and 10b
    n, C = 4, 1024
    rows = max(1, total // _LAYERS // (n * C * 4))
    side = max(8, int((total // _LAYERS // 4) ** 0.5))
    mm_side, mm_layers = (64, 2) if quick else (1024, 4)
    out: dict[str, tuple[nn.Module, str]] = {}
    with torch.device(ctx.device):
        reg = gs.Registry()
        fold = fold_stack_class(reg, n, C)([rows] * _LAYERS)
        gs.runtime(fold, reg)
        out["10a"] = (fold, f"sum over n of {_LAYERS} x [{rows}, {n}, {C}] f32")
        reg = gs.Registry()
        tr = _transpose_class(reg)(side, _LAYERS)
        gs.runtime(tr, reg)
        out["10b"] = (tr, f"transpose of {_LAYERS} x [{side}, {side}] f32")
        reg = gs.Registry()
        mm = _matmul_class(reg)(mm_side, mm_layers)
        gs.runtime(mm, reg)
        out["10c"] = (mm, f"matmul of {mm_layers} x [{mm_side}, {mm_side}] f32")
    for model, _ in out.values():
        gs.runtime(model).refresh()  # materialize
    return out


def _time_row(ctx: Ctx, fig: str, model: nn.Module, what: str, bound: str) -> Row:
    rt = gs.runtime(model)
    kept = Auditor()

    def audit_kept() -> None:
        kept.audit(model)

    stats: dict[str, Any] = interleave(
        {
            "refresh": ctx.timer(rt.refresh),
            "audit": ctx.timer(lambda: gs.audit(model)),
            "audit_kept": ctx.timer(audit_kept),
        },
        ctx.sizes.repeats,
    )
    refresh, audit, held = stats["refresh"], stats["audit"], stats["audit_kept"]
    report = gs.audit(model)
    return Row(
        fig, f"gs.audit vs one full refresh, {bound}", audit.median, refresh.median,
        baseline_name="rt.refresh()", ratio=paired(audit, refresh), ratio_def="audit / refresh",
        op="<=", target=1.2,
        details={
            "derivations": what,
            "compared": fmt_bytes(report.nbytes),
            "audit_kept_s": held.median,
            "kept_ratio": round(paired(held, refresh), 3),
            "spread": [round(audit.spread, 3), round(refresh.spread, 3)],
        },
    )


def _memory_row(ctx: Ctx, model: nn.Module, what: str) -> Row:
    largest = max(d.nbytes for d in gs.runtime(model).derivations)
    total = sum(d.nbytes for d in gs.runtime(model).derivations)
    peak = peak_extra_bytes(lambda: gs.audit(model), ctx.device)
    return Row(
        "10d", "gs.audit's peak extra memory vs one derivation's output", float(peak),
        float(largest), baseline_name="largest derivation output", unit="B",
        ratio=peak / largest, ratio_def="peak / largest", op="<=", target=1.1,
        details={"derivations": what, "all_outputs": fmt_bytes(total)},
    )


def fig10(ctx: Ctx) -> list[Row]:
    """The audit next to a full refresh: a sum and a transpose (memory-bound), a matmul
    (compute-bound); its peak memory."""
    models = _models(ctx)
    bounds: dict[str, str] = {"10a": "memory-bound sum", "10b": "memory-bound transpose",
                              "10c": "compute-bound matmul"}
    rows = [_time_row(ctx, fig, model, what, bounds[fig]) for fig, (model, what) in models.items()]
    model, what = models["10a"]
    rows.append(_memory_row(ctx, model, what))
    return rows
