"""Small shared builders for graphsafe's tests.

Kept deliberately small; import what you need:

- `write(model, path, value)`: write a tensor of the model in place, as real loaders do
  (`param.data.copy_(w)` for parameters, which does not bump `_version`).
- `Identity` / `identity(t)` / `identities(model, paths)`: the storage identity of a
  tensor (object, data pointer, shape, stride, dtype, device) that a captured graph
  relies on.
- `expected_scaled(layer)`: its derived buffers recomputed from scratch.
- `scaled_layer_class(registry=None)`: a fresh `gs.graphsafe` class (a new class per call,
  so tests never share registrations) with a parameter, a persistent buffer, a plain
  tensor attribute, a fast-path and a slow-path derivation, a derivation reading another
  derivation, call counters and fault switches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

import graphsafe as gs

__all__ = [
    "HoldingLayer",
    "HoldingStack",
    "Identity",
    "expected_scaled",
    "identities",
    "identity",
    "resolve",
    "scaled_layer_class",
    "write",
]


def resolve(model: nn.Module, path: str) -> Any:
    """The object at dotted `path` from `model` (a tensor, a module, or None)."""
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def write(model: nn.Module, path: str, value: torch.Tensor | float) -> None:
    """Write `value` into the tensor at `path` in place (no rebinding).

    Parameters are written through `.data.copy_`, the loader idiom whose writes do not
    bump the parameter's version counter.
    """
    t = resolve(model, path)
    with torch.no_grad():
        if isinstance(t, nn.Parameter):
            if isinstance(value, torch.Tensor):
                t.data.copy_(value)
            else:
                t.data.fill_(value)
        elif isinstance(value, torch.Tensor):
            t.copy_(value)
        else:
            t.fill_(value)


class Identity(NamedTuple):
    """What a captured graph depends on: the same object and the same memory layout."""

    obj: int
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def identity(t: torch.Tensor) -> Identity:
    """The storage identity of `t`."""
    return Identity(id(t), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def identities(model: nn.Module, paths: Iterable[str]) -> dict[str, Identity]:
    """`identity` of each tensor at `paths` (dotted, from `model`)."""
    return {p: identity(resolve(model, p)) for p in paths}


def scaled_layer_class(registry: gs.Registry | None = None) -> type[nn.Module]:
    """A fresh graphsafe layer class (see the module docstring).

    Tensors: `w` [2, 3] parameter, `bias` [3] persistent buffer, `scale` [3] plain
    attribute. Derivations (outputs <- inputs):

    - `w_scaled` <- w, scale: slow path (no `out`), `w * scale`  # [2, 3]
    - `col_sum` <- w_scaled: fast path, `sum(w_scaled, 0)`        # [3]
    - `bias2` <- bias: fast path, `bias * 2`                      # [3]

    `layer.calls` counts calls per output name. `layer.fault` set to one of
    "raise", "wrong_shape", "wrong_dtype", "impure", "out_shrink", "out_grow" makes
    `w_scaled` (faults of the slow path) or `col_sum` (faults of `out=`) misbehave.
    `load_weights(weights)` takes `(path, tensor)` pairs and raises KeyError on an
    unknown name after writing the entries before it.
    """

    class ScaledLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))
            self.register_buffer("bias", torch.tensor([1.0, 2.0, 3.0]))
            self.scale = torch.tensor([1.0, 0.5, 2.0])
            self.calls: Counter[str] = Counter()
            self.fault: str | None = None

        @gs.derive("w_scaled", inputs=["w", "scale"])
        def _w_scaled(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            self.calls["w_scaled"] += 1
            if self.fault == "raise":
                raise ValueError("derivation blew up")
            if self.fault == "wrong_shape":
                return torch.zeros(3, 2)
            if self.fault == "wrong_dtype":
                return (w * scale).double()
            if self.fault == "impure":
                return w.mul_(scale)
            return w * scale

        @gs.derive("col_sum", inputs=["w_scaled"])
        def _col_sum(
            self, w_scaled: torch.Tensor, *, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            self.calls["col_sum"] += 1
            if self.fault == "out_shrink":
                return torch.sum(w_scaled, dim=1, out=out)  # [2] into a [3] buffer
            if self.fault == "out_grow":
                return torch.mul(w_scaled, 1.0, out=out)  # [2, 3] into a [3] buffer
            return torch.sum(w_scaled, dim=0, out=out)

        @gs.derive("bias2", inputs=["bias"])
        def _bias2(self, bias: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
            self.calls["bias2"] += 1
            return torch.mul(bias, 2.0, out=out)

        def load_weights(self, weights: Sequence[tuple[str, torch.Tensor | float]]) -> int:
            n = 0
            for name, value in weights:
                if name not in ("w", "bias", "scale"):
                    raise KeyError(f"unknown checkpoint entry {name!r}")
                write(self, name, value)
                n += 1
            return n

    return gs.graphsafe(registry=registry)(ScaledLayer)


def expected_scaled(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The derived buffers of a `scaled_layer_class` instance, recomputed from scratch."""
    with torch.no_grad():
        w_scaled = layer.w * layer.scale
        return {
            "w_scaled": w_scaled,
            "col_sum": torch.sum(w_scaled, dim=0),
            "bias2": torch.mul(layer.bias, 2.0),
        }


class HoldingLayer(nn.Module):
    """A parameter, a buffer, a plain tensor attribute and tensors inside a list: every
    kind of place the compiled checks read."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6), requires_grad=False)
        self.register_buffer("b", torch.randn(6))
        self.extra = torch.randn(3)  # a plain tensor attribute
        self.listed = [torch.randn(2), torch.randn(2)]  # tensors inside a list


class HoldingStack(nn.Module):
    """Three `HoldingLayer`s."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([HoldingLayer() for _ in range(3)])
