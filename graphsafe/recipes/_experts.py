"""The expert-layout recipe: physical expert slots placed from the logical experts by a map.

An expert-load balancer (vLLM's and SGLang's EPLB) serves each logical expert from one or
more physical slots and moves experts between slots while serving. The slots are a
function of the logical experts and the current map; declared so, a load of the experts
and a rebalance of the map both refresh them in place, and a map written outside any
load is stale, not silently served. Without it, a load that writes the slots in
checkpoint order under a map that moved experts is refused by name (the runtime's
expert layouts: the map found by the names engines give it, or
`Runtime.expert_layout`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphsafe._errors import GraphSafetyError
from graphsafe.recipes._recipe import Recipe, check_fits, named

__all__ = ["place_experts"]


def place_experts() -> Recipe:
    """Physical expert slots from the logical experts and the map of each slot's expert:
    `physical[s] = logical[physical_to_logical[s]]`.

    Returns:
        `fn(module, logical [E, ...], physical_to_logical [P] (an integer tensor, each in
        [0, E)), out=None) -> [P, ...]`.

    Raises:
        GraphSafetyError: (from the returned function) a map of another dtype or rank, or
            naming an expert that does not exist; nothing is written.

    Examples:
        >>> import torch
        >>> fn = place_experts()
        >>> logical = torch.arange(3.0).reshape(3, 1)
        >>> fn(None, logical, torch.tensor([2, 0, 2, 1])).flatten().tolist()
        [2.0, 0.0, 2.0, 1.0]
    """
    name = "place_experts()"

    def fn(module: object, logical: Tensor, physical_to_logical: Tensor, *,
           out: Tensor | None = None) -> Tensor:
        _check_map(name, module, physical_to_logical, logical.shape[0])
        shape = (physical_to_logical.shape[0], *logical.shape[1:])
        if out is None:
            return logical.index_select(0, physical_to_logical)  # [P, ...]
        check_fits(name, module, "the physical slots", out, shape, logical.dtype)
        return torch.index_select(logical, 0, physical_to_logical, out=out)

    return named(fn, name)


def _check_map(recipe: str, module: object, m: Tensor, experts: int) -> None:
    """Refuse a map that is not a 1-D integer tensor of experts in [0, `experts`)."""
    got = None
    if m.dim() != 1 or m.dtype not in (torch.int32, torch.int64):
        got = f"shape {tuple(m.shape)}, dtype {m.dtype}"
    elif m.numel() and not bool(((m >= 0) & (m < experts)).all()):
        bad = m[(m < 0) | (m >= experts)]
        got = f"expert {int(bad[0])} in the map"
    if got is not None:
        raise GraphSafetyError(
            f"{recipe}: the map of physical slots to logical experts is not one",
            module_class=type(module).__name__,
            derivation=recipe,
            expected=f"a 1-D int32/int64 tensor of experts in [0, {experts})",
            got=got,
            fix="pass the balancer's physical-to-logical map (one logical expert per "
            "physical slot)",
        )
