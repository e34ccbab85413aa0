"""Specs, all frozen pydantic models: what a derivation is (`Derivation`), what a refresh
reports (`RefreshReport`), and how a pinned tensor moved (`Drift`)."""

from __future__ import annotations

import keyword
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    computed_field,
    field_validator,
    model_validator,
)

__all__ = [
    "Derivation",
    "Drift",
    "DriftKind",
    "DerivationInfo",
    "DerivationReport",
    "RefreshReport",
]


def _check_name(name: str, what: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"{what} {name!r} is not a Python identifier")
    return name


class Derivation(BaseModel):
    """A tensor, or several, computed from tensors of the module that owns it by a pure
    function: `fn` reads its inputs and writes nothing but `out`.

    Examples:
        >>> d = Derivation(outputs="w_t", inputs=["weight"], fn=lambda m, w, *, out=None: w.t())
        >>> d.outputs, d.name
        (('w_t',), '<lambda>')
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    outputs: tuple[str, ...]
    """Names of the buffers produced, registered on the owning module in this order."""

    inputs: tuple[str, ...]
    """Dotted paths, from the owning module, of the tensors read (parameters, buffers,
    plain attributes, or outputs of other derivations)."""

    fn: Callable[..., Any]
    """`fn(module, *inputs, out=None)`: one tensor per output (a tuple for several);
    refreshes pass the existing buffers as `out` where it takes one."""

    when: Callable[[Any], bool] | None = None
    """`when(module)`: whether this instance owns the buffers (else they stay `None`);
    evaluated once, at materialization."""

    method: str | None = None
    """For `gs.derive` on a class: the method's name, so that an override is honoured."""

    name: str = ""
    """Name in reports and errors; defaults to the function's qualified name."""

    transient: tuple[str, ...] = ()
    """Inputs held only while a load or weight update writes them (checkpoint-format
    weights kept only in kernel format): released once every reader has refreshed."""

    @field_validator("outputs", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value

    @field_validator("inputs", mode="before")
    @classmethod
    def _no_bare_string(cls, value: object) -> object:
        if isinstance(value, str):
            raise ValueError(f"inputs must be a list of paths, got the string {value!r}")
        return value

    @field_validator("outputs", mode="after")
    @classmethod
    def _outputs_valid(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("a derivation needs at least one output")
        for name in value:
            _check_name(name, "output name")
        if len(set(value)) != len(value):
            raise ValueError(f"output names repeat: {value}")
        return value

    @field_validator("inputs", mode="after")
    @classmethod
    def _inputs_valid(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("a derivation needs at least one input")
        for path in value:
            for part in path.split("."):
                if not part.isidentifier() and not part.isdigit():
                    raise ValueError(f"input path {path!r} is not a dotted path")
        return value

    @field_validator("transient", mode="before")
    @classmethod
    def _transient_no_bare_string(cls, value: object) -> object:
        if isinstance(value, str):
            raise ValueError(f"transient must be a list of paths, got the string {value!r}")
        return value

    @model_validator(mode="after")
    def _transient_among_inputs(self) -> Derivation:
        unknown = [p for p in self.transient if p not in self.inputs]
        if unknown:
            raise ValueError(
                f"transient inputs {unknown} are not among the inputs {list(self.inputs)}"
            )
        return self

    def model_post_init(self, context: Any, /) -> None:
        if not self.name:
            qualname = getattr(self.fn, "__qualname__", None) or repr(self.fn)
            object.__setattr__(self, "name", qualname)


class DerivationInfo(BaseModel):
    """One derivation as bound to a module instance (`Runtime.derivations`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    derivation: str
    """Qualified name of the derivation's function."""
    module: str
    """Dotted path of the owning module from the model root ('' for the root)."""
    module_class: str
    """Class name of the owning module."""
    outputs: tuple[str, ...]
    """Dotted paths of the derived buffers."""
    inputs: tuple[str, ...]
    """Dotted paths of the tensors read."""
    shapes: tuple[tuple[int, ...], ...]
    """Shape of each derived buffer (empty before materialization)."""
    dtypes: tuple[str, ...]
    """Dtype of each derived buffer (empty before materialization)."""
    nbytes: int
    """Bytes held by the derived buffers."""
    fast_path: bool
    """Whether the function accepts `out=` and so refreshes without a temporary."""


class DerivationReport(BaseModel):
    """What one refresh did to one derivation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Dotted path of the first derived buffer (the derivation's address)."""
    derivation: str
    """Qualified name of the derivation's function."""
    outputs: tuple[str, ...]
    """Dotted paths of every derived buffer of the derivation."""
    action: Literal["materialized", "refreshed", "skipped", "failed"]
    """What happened: allocated, rewritten in place, not needed, or refused."""
    path_taken: Literal["fast", "slow", "none"]
    """`fast`: computed straight into the buffer via `out=`; `slow`: computed apart and
    copied in; `none`: not computed."""
    bytes_written: int
    """Bytes written into derived buffers."""
    seconds: float
    """Wall time of this derivation."""
    storage_held: bool
    """Whether every buffer kept its storage (pointer, shape, stride, dtype, device)."""


_ACTIONS: tuple[Literal["materialized", "refreshed", "skipped", "failed"], ...] = (
    "materialized",
    "refreshed",
    "skipped",
    "failed",
)
_PATHS: tuple[Literal["fast", "slow", "none"], ...] = ("fast", "slow", "none")

# (path, derivation, outputs, nbytes) per bound derivation; shared with the runtime.
RawIdentity = tuple[str, str, tuple[str, ...], int]
# (index, action code, path code, seconds, storage held) per derivation that ran.
RawEntry = tuple[int, int, int, float, bool]


class RefreshReport(BaseModel):
    """What one refresh did. Entries are built on first access, so that the refresh itself
    stays cheap."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seconds: float = 0.0
    """Wall time of the whole refresh."""

    _identities: Sequence[RawIdentity] = PrivateAttr(default=())
    _raw: Sequence[RawEntry] = PrivateAttr(default=())

    @classmethod
    def from_raw(
        cls, identities: Sequence[RawIdentity], raw: Sequence[RawEntry], seconds: float
    ) -> RefreshReport:
        """Build a report from the runtime's raw records, without validating each entry:
        `identities` per bound derivation (`RawIdentity`), `raw` per one that ran
        (`RawEntry`)."""
        report = cls(seconds=seconds)
        report._identities = identities
        report._raw = raw
        return report

    @classmethod
    def combined(cls, reports: Sequence[RefreshReport]) -> RefreshReport:
        """One report for a load or update that refreshed in parts (a derivation whose
        transient inputs completed mid-update refreshes then).

        Args:
            reports: The parts, in the order they ran.

        Returns:
            Each derivation's last entry, with the last part's identities and the summed
            wall time.
        """
        if len(reports) == 1:
            return reports[0]
        last: dict[int, RawEntry] = {}
        for r in reports:
            for entry in r._raw:
                last[entry[0]] = entry
        return cls.from_raw(
            reports[-1]._identities, tuple(last.values()), sum(r.seconds for r in reports)
        )

    @computed_field  # type: ignore[prop-decorator]
    @cached_property
    def entries(self) -> tuple[DerivationReport, ...]:
        """One entry per bound derivation, in refresh order; those not run are skipped."""
        ran = {entry[0]: entry for entry in self._raw}
        out = []
        for index, (path, name, outputs, nbytes) in enumerate(self._identities):
            entry = ran.get(index)
            if entry is None:
                out.append(
                    DerivationReport(
                        path=path, derivation=name, outputs=outputs, action="skipped",
                        path_taken="none", bytes_written=0, seconds=0.0, storage_held=True,
                    )
                )
                continue
            _, action, taken, seconds, held = entry
            written = nbytes if action in (0, 1) else 0
            out.append(
                DerivationReport(
                    path=path, derivation=name, outputs=outputs, action=_ACTIONS[action],
                    path_taken=_PATHS[taken], bytes_written=written, seconds=seconds,
                    storage_held=held,
                )
            )
        return tuple(out)

    def by_action(self, action: str) -> tuple[DerivationReport, ...]:
        """Entries whose action is `action`: `"materialized"`, `"refreshed"`, `"skipped"`
        or `"failed"`."""
        return tuple(e for e in self.entries if e.action == action)

    @property
    def refreshed(self) -> tuple[str, ...]:
        """Paths of the derivations rewritten in place by this refresh."""
        return tuple(e.path for e in self.by_action("refreshed"))

    @property
    def materialized(self) -> tuple[str, ...]:
        """Paths of the derivations allocated by this refresh."""
        return tuple(e.path for e in self.by_action("materialized"))

    @property
    def slow_path(self) -> tuple[str, ...]:
        """Paths of the derivations that were computed apart and copied in."""
        return tuple(e.path for e in self.entries if e.path_taken == "slow")

    @property
    def bytes_written(self) -> int:
        """Bytes written into derived buffers in all."""
        return sum(e.bytes_written for e in self.entries)

    @property
    def ran(self) -> int:
        """How many derivations were computed (materialized, refreshed or failed)."""
        return len(self._raw)


DriftKind = Literal[
    "storage", "offset", "shape", "stride", "dtype", "device", "object", "module", "holder",
    "removed", "value", "handle",
]

class Drift(BaseModel):
    """One way in which a pinned tensor or module no longer matches its snapshot.

    A tensor that moved in several ways (a `.to(torch.float16)` copy changes both its
    storage and its dtype) gives one `Drift` per way.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Dotted path of the tensor (`layers.0.cache.1` for a list item), or of the module."""

    module_class: str
    """Class name of the module that holds the tensor or the replaced module."""

    what: DriftKind
    """What moved: `storage` (data pointer), `offset`, `shape`, `stride`, `dtype`,
    `device`; `object` (another tensor object, same memory and geometry: named in the
    diff, but not refused, since a graph reads the same addresses through it); `module`
    (another module, or none, is bound there; tensors of a module the model no longer
    holds are not reported); `holder` (an object on the way to pinned tensors, such as a
    kernel object, a list or a closure, was replaced: the graph reads the tensors the old
    one held); `removed` (no tensor there now); `value` (a Python number the model derived
    from its weights, which a graph bakes in, changed); or `handle` (a kernel handle it
    derived from its weights, which a graph holds, was made anew)."""

    old: str
    """The value at snapshot time."""

    new: str
    """The value now."""
