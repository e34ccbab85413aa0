"""Figure 9: the walk that reaches everything a model keeps, and the graph's read set.

- 9a: the walk at capture, per 1,000 tensors, against the walk it replaced (parameters,
  buffers and tensors in list, tuple and dict attributes only), on a model both reach
  whole: what entering every object costs where there is nothing more to find.
- 9b: the same walk over an engine-style model (each layer keeps a kernel object with
  three tensors, a dataclass of scales, a partial and a closure), per 1,000 tensors: what
  reaching them costs.
- 9c: a guarded replay's ledger check of a graph that reads a tenth of the model (its read
  set), against the same check over the whole model: what the read set saves.
- 9d: a tracked reload of every parameter of the engine-style model (`gs.weight_update`
  around a copy into each, as a weight sync does each step), against the same copies
  untracked: what a load pays for the objects on the way (before each load, the check
  that the walk still holds reads every one of them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from harness import Row, interleave
from torch import nn

import graphsafe as gs
from graphsafe._memory.ledger import Ledger
from graphsafe._memory.walk import walk, walk_modules

__all__ = ["fig9"]

_INTERNALS = frozenset(vars(nn.Module()))


def _old_walk(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The walk before objects were entered: the baseline of 9a."""
    seen: set[int] = set()
    for where in walk_modules(model):
        module = where.module
        if id(module) in seen:
            continue
        seen.add(id(module))
        head = f"{where.path}." if where.path else ""
        for container in (module._parameters, module._buffers):
            for name, value in tuple(container.items()):
                if isinstance(value, torch.Tensor):
                    yield head + name, value
        for name, value in tuple(module.__dict__.items()):
            if name not in _INTERNALS:
                yield from _old_held(value, head + name, set())


def _old_held(value: Any, path: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if isinstance(value, nn.Module) or id(value) in seen:
        return
    if isinstance(value, (list, tuple)):
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return
    seen.add(id(value))
    for key, item in tuple(items):
        yield from _old_held(item, f"{path}.{key}", seen)


class _Kernel:
    def __init__(self, w: torch.Tensor) -> None:
        self.w_packed = w.t().contiguous()
        self.strides = torch.tensor(w.stride())
        self.workspace = torch.zeros(4)


@dataclasses.dataclass
class _Scales:
    scale: torch.Tensor


def _closure(t: torch.Tensor) -> Any:
    return lambda x: x + t


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4))
        self.b = nn.Parameter(torch.zeros(4))
        self.register_buffer("r", torch.zeros(4))
        self.cache = [torch.zeros(1), torch.zeros(1)]
        self.hidden_size, self.name_ = 4, "layer"


class _Engine(_Plain):
    def __init__(self) -> None:
        super().__init__()
        w = self.w.detach()
        self.quant_method = _Kernel(w)
        self.scales = _Scales(torch.ones(1))
        self.fn = functools.partial(torch.add, torch.zeros(4))
        self.lora = _closure(torch.zeros(4))


def _per_1000(seconds: float, tensors: int) -> float:
    return seconds / tensors * 1000


def fig9(ctx: Any) -> list[Row]:
    """The walk at capture against the old one; what reaching objects costs; what the read
    set saves at each guarded replay."""
    layers = max(ctx.sizes.fig5_tensors // 6, 10)
    plain = nn.Sequential(*[_Plain() for _ in range(layers)])
    engine = nn.Sequential(*[_Engine() for _ in range(layers)])
    n_plain = sum(1 for _ in _old_walk(plain))
    assert len(walk(plain).sites) == n_plain  # both reach the whole plain model
    n_engine = len(walk(engine).sites)
    stats = interleave({
        "old": ctx.timer(lambda: sum(1 for _ in _old_walk(plain))),
        "new": ctx.timer(lambda: walk(plain)),
        "engine": ctx.timer(lambda: walk(engine)),
    }, ctx.sizes.repeats)
    old = _per_1000(stats["old"].median, n_plain)
    new = _per_1000(stats["new"].median, n_plain)
    eng = _per_1000(stats["engine"].median, n_engine)
    rows = [
        Row("9a", f"walk at capture, {n_plain} tensors", new, old, "walk before objects",
            ratio=new / old, ratio_def="walk / old walk, per tensor", op="<=", target=3.0,
            details={"per_1000_tensors_us": {"new": round(new * 1e6, 1),
                                             "old": round(old * 1e6, 1)}}),
        Row("9b", f"walk of an engine-style model, {n_engine} tensors", eng, new,
            "the plain model's walk", ratio=eng / new,
            ratio_def="per tensor, engine-style / plain",
            details={"per_1000_tensors_us": round(eng * 1e6, 1)}),
    ]
    whole = Ledger.snapshot(engine)
    read = {s for i, layer in enumerate(engine) if i % 10 == 0
            for s in Ledger.snapshot(layer).storages}
    part = whole.restricted(read)
    checks = interleave({
        "whole": ctx.timer(whole.assert_stable, number=20),
        "read": ctx.timer(part.assert_stable, number=20),
    }, ctx.sizes.repeats)
    rows.append(Row(
        "9c", f"ledger check of a graph reading {len(part)} of {len(whole)} tensors",
        checks["read"].median, checks["whole"].median, "the whole model's ledger",
        ratio=checks["read"].median / checks["whole"].median,
        ratio_def="read set / whole model",
        details={"per_1000_pinned_us": round(_per_1000(checks["whole"].median, len(whole))
                                              * 1e6, 1)},
    ))
    if ctx.wants("9d"):
        rows.append(_reload_row(ctx, engine))
    return rows


def _reload_row(ctx: Any, engine: nn.Module) -> Row:
    params = list(engine.parameters())
    gen = torch.Generator().manual_seed(9)
    new = [torch.randn(p.shape, generator=gen) for p in params]

    def copies() -> None:
        with torch.no_grad():
            for p, w in zip(params, new):
                p.copy_(w)

    def tracked() -> None:
        with gs.weight_update(engine):
            copies()

    tracked()  # the first load: binds, and records the bring-up
    stats = interleave({"tracked": ctx.timer(tracked), "untracked": ctx.timer(copies)},
                       ctx.sizes.repeats)
    t, u = stats["tracked"], stats["untracked"]
    return Row("9d", f"tracked reload of the engine-style model, {len(params)} parameters",
               t.median, u.median, "the same copies untracked", ratio=t.median / u.median,
               ratio_def="tracked / untracked",
               details={"overhead_us_per_param": round((t.median - u.median) / len(params)
                                                       * 1e6, 2)})
