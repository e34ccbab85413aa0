"""Expert layouts: stacked expert weights whose physical slots an expert-load balancer
maps to logical experts, and the loads that write them in checkpoint order.

A balancer (vLLM's and SGLang's EPLB) serves each logical expert from one or more
physical slots of a module's stacked expert weights (`w13_weight [P, ...]`) and moves
experts between slots while serving, keeping a map beside them. A checkpoint holds the
experts in logical order; a sync that writes them into the slots in that order (slot `s`
gets expert `s mod E`, the placement before any rebalance) under a map that moved them
serves each token the wrong expert, silently (prime-rl #3583).

A model's layouts are found by the names engines give the map on the module that holds
the weights (`physical_to_logical_map`; `logical_to_physical_map` with
`logical_replica_count`, vLLM's `FusedMoE`; `expert_map` for the slots of one
expert-parallel rank), or declared (`Runtime.expert_layout`). A load that ended having
written a layout's weights, while its map is not the checkpoint's placement, is judged
by the evidence it left:

- a derivation reads the map (`recipes.place_experts`): the slots are derived and
  refreshed from the logical experts;
- every write into the weights copied values computed from the model's state (a
  rebalance moving slot contents, `w[a].copy_(w[b])`): no raw values were loaded;
- the load read the map (numbers taken from it, `int(map[e])`, `.item()`, `.tolist()`,
  or values gathered through it, `w.copy_(ckpt[map])`): written through the map.

Otherwise it is refused by name, and every freshness check repeats the refusal until a
load writes the weights through the map, or the map places each slot's checkpoint
expert again. Loads keep the ops that write the weights (`weight_keys`) and follow what
they compute from the maps (`map_keys`); a load that begins while a map moved experts
also notes the numbers it reads out of the maps in Python (`MapReads`: `.tolist()` takes
them without an op the trackers see).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from graphsafe._errors import GraphSafetyError, StaleError
from graphsafe._lineage.record.recorder import DERIVED_COPY
from graphsafe._memory.snapshot import PLAIN
from graphsafe._memory.walk import storage_key

__all__ = ["ExpertLayouts", "Layout", "MapReads", "MapRef"]

P2L = "physical_to_logical_map"
"""A 1-D map: the logical expert of each physical slot (SGLang's, per layer)."""
L2P = "logical_to_physical_map"
"""A 2-D map `[E, R]`: the physical slots of each logical expert, -1 padded (vLLM's)."""
REPLICAS = "logical_replica_count"
"""`[E]`: how many slots of each row of `L2P` are valid (vLLM's)."""
EP_MAPS = ("_expert_map", "expert_map")
"""`[P]`: the local slot of each global physical slot on this rank, -1 (vLLM's)."""
_MAP_NAMES = (P2L, L2P, REPLICAS, *EP_MAPS)
"""The names a layout's maps are found under (a path ending in one may hold one)."""

MapRef = str | Callable[[], torch.Tensor]
"""Where a declared map is: an attribute path under the module, or a callable giving it."""


class Slots(NamedTuple):
    """What a layout's map says of its local slots, now."""

    logical: tuple[int, ...]
    """The logical expert each local slot serves (-1: none)."""
    checkpoint: tuple[int, ...]
    """The expert a write in checkpoint order puts there (global slot mod E)."""

    def moved(self) -> list[int]:
        """The local slots the map moved away from the checkpoint's placement."""
        return [s for s, (e, c) in enumerate(zip(self.logical, self.checkpoint))
                if e >= 0 and e != c]


class Layout:
    """One module's stacked expert weights and the map of its slots.

    Args:
        path: The module's dotted path from the root.
        module: The module.
        maps: Map name -> where it is (`P2L` or `L2P`, then optionally `REPLICAS` and
            `expert_map`), each a name held by the module or a declared `MapRef`.
        weights: The names of the stacked weights (None: every parameter of the module
            whose first dimension is the number of local slots).
        experts: The number of logical experts (None: read from the map).
    """

    __slots__ = ("_module", "experts", "maps", "names", "path")

    def __init__(self, path: str, module: nn.Module, maps: Mapping[str, MapRef],
                 weights: Sequence[str] | None, experts: int | None) -> None:
        self.path = path
        self._module = weakref.ref(module)
        self.maps = dict(maps)
        self.names = None if weights is None else tuple(weights)
        self.experts = experts

    def _where(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def tensors(self) -> dict[str, torch.Tensor]:
        """Each map held now, by its role (`P2L`, `L2P`, `REPLICAS`, `expert_map`)."""
        module = self._module()
        found: dict[str, torch.Tensor] = {}
        if module is None:
            return found
        for role, ref in self.maps.items():
            t = ref() if callable(ref) else _held(module, ref)
            if isinstance(t, torch.Tensor):
                found[role] = t
        return found

    def map_path(self) -> str:
        """The map's path, for messages."""
        for role in (P2L, L2P):
            ref = self.maps.get(role)
            if ref is not None:
                return self._where(ref) if isinstance(ref, str) else f"{self.path} (declared map)"
        return self.path

    def map_keys(self) -> frozenset[int]:
        """The storage keys of its maps."""
        with PLAIN():
            return frozenset(k for t in self.tensors().values() if (k := storage_key(t)))

    def slots(self) -> Slots | None:
        """Where the map places experts now (None: no map held, or not one)."""
        maps = self.tensors()
        with PLAIN(), torch.no_grad():
            if P2L in maps and maps[P2L].dim() == 1:
                logical = [int(e) for e in maps[P2L].tolist()]
                experts = self.experts or max(logical, default=-1) + 1
            elif L2P in maps and maps[L2P].dim() == 2:
                table = maps[L2P].tolist()
                counts = maps[REPLICAS].tolist() if REPLICAS in maps else None
                experts = self.experts or len(table)
                places = {p: e for e, row in enumerate(table) for r, p in enumerate(row)
                          if p >= 0 and (counts is None or r < counts[e])}
                logical = [places.get(p, -1) for p in range(max(places, default=-1) + 1)]
            else:
                return None
            if experts <= 0:
                return None
            local = maps.get("expert_map")
            if local is None or local.dim() != 1:
                return Slots(tuple(logical), tuple(p % experts for p in range(len(logical))))
            at = {j: p for p, j in enumerate(local.tolist()) if j >= 0}  # local -> global
            order = range(max(at, default=-1) + 1)
            return Slots(
                tuple(logical[at[j]] if at.get(j, len(logical)) < len(logical) else -1
                      for j in order),
                tuple(at[j] % experts if j in at else -1 for j in order))

    def weights(self, slots: int | None = None) -> dict[str, torch.Tensor]:
        """The stacked weights, by path (`slots`: the number of local slots, when the
        weights are not named)."""
        module = self._module()
        if module is None:
            return {}
        if self.names is not None:
            held = {n: _held(module, n) for n in self.names}
            return {self._where(n): t for n, t in held.items() if isinstance(t, torch.Tensor)}
        with PLAIN():
            return {self._where(n): p for n, p in module._parameters.items()
                    if p is not None and p.dim() >= 1
                    and (slots is None or p.shape[0] == slots)}


def _held(module: nn.Module, name: str) -> Any:
    """What `module` holds at the dotted `name`, without running properties."""
    obj: Any = module
    for part in name.split("."):
        if isinstance(obj, nn.Module):
            d = obj.__dict__
            for table in ("_parameters", "_buffers", "_modules"):
                if part in d[table]:
                    obj = d[table][part]
                    break
            else:
                obj = d.get(part)
        else:
            obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class ExpertLayouts:
    """The expert layouts of one model (found by name, and declared) and the loads
    refused for writing them in checkpoint order.

    `find` refreshes what is found when the model's walk changed; `judge` is the only
    writer of `refused`.
    """

    __slots__ = ("_declared", "_followed", "_found", "_walk", "refused")

    def __init__(self) -> None:
        self._followed: tuple[frozenset[int], frozenset[int], frozenset[int]] | None = None
        self._declared: dict[str, Layout] = {}
        self._found: dict[str, Layout] = {}
        self._walk: frozenset[int] | None = None
        self.refused: dict[str, tuple[tuple[str, ...], str]] = {}
        """Module path -> the weights the last load that wrote them left in checkpoint
        order, and why it was refused."""

    def __bool__(self) -> bool:
        return bool(self._found or self._declared)

    def layouts(self) -> list[Layout]:
        """Every layout: the declared, then those found by name."""
        return [*self._declared.values(),
                *(lay for p, lay in self._found.items() if p not in self._declared)]

    def find(self, model: nn.Module, walk: frozenset[int], paths: Iterable[str]) -> None:
        """Find the layouts held under the known names among `paths` (every tensor path
        of the model), from the walk whose key set is `walk` (`ModelMap.key_set`: kept,
        it holds no tensor alive; nothing is done while it is the same object)."""
        if walk is self._walk:
            return
        self._walk = walk
        found: dict[str, dict[str, str]] = {}
        for path in [p for p in paths if p.endswith(_MAP_NAMES)]:  # most paths: none
            prefix, _, name = path.rpartition(".")
            if name in (P2L, L2P, REPLICAS, *EP_MAPS):
                found.setdefault(prefix, {})["expert_map" if name in EP_MAPS else name] = name
        self._found = {}
        for prefix, maps in found.items():
            if P2L not in maps and L2P not in maps:
                continue
            try:
                module = model.get_submodule(prefix)
            except AttributeError:
                continue
            self._found[prefix] = Layout(prefix, module, maps, None, None)

    def declare(self, model: nn.Module, path: str, physical_to_logical: MapRef,
                weights: Sequence[str] | None, experts: int | None) -> None:
        """Declare the layout of the module at `path` (see `Runtime.expert_layout`).

        Raises:
            GraphSafetyError: No module at `path`, no 1-D integer map there, or a named
                weight it does not hold.
        """
        model_class = type(model).__name__
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise GraphSafetyError(
                f"expert_layout: {model_class} has no module at {path!r}",
                module_class=model_class, path=path,
                expected="the dotted path of the module holding the stacked expert weights",
                got=repr(path),
                fix="use a name from model.named_modules()",
            ) from None
        layout = Layout(path, module, {P2L: physical_to_logical}, weights, experts)
        m = layout.tensors().get(P2L)
        if m is None or m.dim() != 1 or m.dtype not in (torch.int32, torch.int64):
            got = "nothing" if m is None else f"shape {tuple(m.shape)}, dtype {m.dtype}"
            raise GraphSafetyError(
                f"expert_layout: the map of {path} is not a 1-D integer tensor",
                module_class=type(module).__name__, path=path,
                expected="the logical expert of each physical slot (int32/int64, 1-D)",
                got=got,
                fix="pass the attribute path under the module that holds the map, or a "
                "callable returning it",
            )
        missing = [n for n in weights or () if not isinstance(_held(module, n), torch.Tensor)]
        if missing:
            raise GraphSafetyError(
                f"expert_layout: {path} holds no tensor {missing[0]!r}",
                module_class=type(module).__name__, path=f"{path}.{missing[0]}",
                expected="names of the stacked expert weights the module holds",
                got=", ".join(missing),
                fix="name the weights as in module.named_parameters()",
            )
        self._declared[path] = layout

    def weight_keys(self) -> frozenset[int]:
        """The storage keys of every layout's weights: a load keeps the ops writing each."""
        with PLAIN():
            return frozenset(k for lay in self.layouts()
                             for t in lay.weights().values() if (k := storage_key(t)))

    def map_keys(self) -> frozenset[int]:
        """The storage keys of every layout's maps: a load follows what it takes from
        them."""
        return frozenset().union(*(lay.map_keys() for lay in self.layouts()))

    def follow(self, weights: frozenset[int]) -> frozenset[int]:
        """What a load's tracker follows: `weights` and the maps' keys (one set while
        both hold: the compiled tracker reads a set it was given before once)."""
        maps = self.map_keys()
        if not maps:
            return weights
        kept = self._followed
        if kept is None or kept[0] is not weights or kept[1] != maps:
            kept = self._followed = (weights, maps, weights | maps)
        return kept[2]

    def moved_maps(self) -> frozenset[int]:
        """The storage keys of the maps that place some slot's expert elsewhere than
        checkpoint order now (a load that begins so notes its reads of them)."""
        return frozenset().union(*(lay.map_keys() for lay in self.layouts()
                                   if (slots := lay.slots()) is not None and slots.moved()))

    def judge(
        self,
        written: Container[int],
        ops: Mapping[int, Sequence[str]],
        tainted: Mapping[int, tuple[tuple[int, ...], str]],
        taken: Iterable[tuple[int, ...]],
        derived: Container[int],
        what: str,
        model_class: str,
        read: Container[int] = (),
    ) -> StaleError | None:
        """What a load that ended did to the layouts: the refusal standing, or None.

        Args:
            written: The storage keys it wrote.
            ops: The ops that wrote each weight's storage, in order (`weight_keys`).
            tainted: What it computed from the weights and maps (its tracker's).
            taken: The sources of each number it took from them.
            derived: The storage keys derivations read (a map read by one is derived).
            what: The load, for messages.
            model_class: The model's class, for messages.
            read: The maps' storage keys it read numbers out of (`MapReads`).
        """
        taken = list(taken)
        for lay in self.layouts():
            slots = lay.slots()
            moved = [] if slots is None else slots.moved()
            maps = lay.map_keys()
            if not moved or any(k in derived for k in maps):
                self.refused.pop(lay.path, None)  # checkpoint placement, or derived
                continue
            assert slots is not None
            weights = lay.weights(len(slots.logical))
            with PLAIN():
                keys = {p: storage_key(t) for p, t in weights.items()}
            wrote = [p for p, k in keys.items() if k in written]
            if not wrote:
                continue
            raw = [p for p in wrote if any(op != DERIVED_COPY for op in ops.get(keys[p], ()))
                   or not ops.get(keys[p])]
            if not raw or any(k in read for k in maps) or _read(maps, tainted, taken):
                self.refused.pop(lay.path, None)  # moved from model state, or through the map
                continue
            self.refused[lay.path] = (tuple(raw), (
                f"{what} wrote {', '.join(raw)} with loaded values and never read the map "
                f"{lay.map_path()}, which serves "
                + ", ".join(f"slot {s} from expert {slots.logical[s]} (checkpoint order: "
                            f"{slots.checkpoint[s]})" for s in moved[:4])
                + (" ..." if len(moved) > 4 else "")))
        return self.error(model_class)

    def error(self, model_class: str) -> StaleError | None:
        """The refusal of every layout written in checkpoint order, or None."""
        if not self.refused:
            return None
        modules = [p or f"the root ({model_class})" for p in self.refused]
        weights = [w for ws, _ in self.refused.values() for w in ws]
        return StaleError(
            f"{len(modules)} expert layout(s) of {model_class} written in checkpoint order "
            f"({', '.join(modules)}) under a balancer's map that moved experts: each token "
            "would be served by the wrong expert",
            paths=weights,
            module_class=model_class,
            path=", ".join(weights[:8]) + (" ..." if len(weights) > 8 else ""),
            expected="each physical slot written with the logical expert the map places "
            "there (slot s <- expert physical_to_logical[s])",
            got="; ".join(why for _, why in list(self.refused.values())[:4]),
            fix="declare the physical slots as derived from the logical experts and the "
            f"map (`recipes.place_experts()` on {modules[0]}, the experts loaded in "
            "logical order), or write through the map in the load (for each logical "
            "expert, the slots the map gives it); the refusal stands until a load does",
        )


def _read(maps: frozenset[int], tainted: Mapping[int, tuple[tuple[int, ...], str]],
          taken: Iterable[tuple[int, ...]]) -> bool:
    """Whether the load read one of `maps`: a number it took, or a tensor it computed
    and still holds, came from one."""
    return (any(not maps.isdisjoint(src) for src in taken)
            or any(not maps.isdisjoint(src) for src, _ in tainted.values()))


class MapReads(TorchFunctionMode):
    """Notes, in the threads of a load, the maps (`keys`: storage keys) it reads numbers
    out of in Python: `.tolist()`, `.item()`, `int()`, `float()`, `operator.index()`,
    `.numpy()` of a map or a view of one (`read`)."""

    def __init__(self, keys: frozenset[int]) -> None:
        super().__init__()
        self.keys = keys
        self.read: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if func in _READS and args and isinstance(args[0], torch.Tensor):
            with PLAIN():
                key = storage_key(args[0])
            if key in self.keys:
                self.read.add(key)
        return func(*args, **(kwargs or {}))


_READS = frozenset({torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__,
                    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy})
"""How a number leaves a tensor into Python."""


def without(keys: frozenset[int], tainted: dict[int, tuple[tuple[int, ...], str]],
            taken: list[Any]) -> tuple[dict[int, tuple[tuple[int, ...], str]], list[Any]]:
    """What a load computed from the weights, the maps `keys` taken out of the sources
    (what came from the maps alone dropped): discovery follows weights only."""
    if not keys:
        return tainted, taken
    out = {}
    for k, (src, op) in tainted.items():
        rest = tuple(s for s in src if s not in keys)
        if rest:
            out[k] = (rest, op)
    kept = []
    for t in taken:
        rest = tuple(s for s in t.sources if s not in keys)
        if rest:
            kept.append(t._replace(sources=rest))
    return out, kept

