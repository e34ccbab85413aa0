"""Every write path of a load reaches the journal, and a failed load stays failed until
what it may have written is written again (`graphsafe._runtime.loads.driver`, `.load`).

Each test drives small models through the public API and the CPU graph, which reads
memory with a CUDA graph's address semantics, and pairs what must hold with a control
that shows the bug it catches: an unguarded graph replaying stale memory, or the mix of
old and new weights a guarded replay must refuse.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._memory.journal import JOURNAL
from graphsafe._memory.walk import storage_key

Weights = Sequence[tuple[str, torch.Tensor]]

NEW = torch.tensor([[-1.0, 4.0, 2.5], [0.5, -3.0, 7.0]])  # new values for a [2, 3] weight


def _copy_in(module: nn.Module, weights: Weights) -> None:
    """The loader idiom: write each tensor in place (`.data.copy_` moves no version)."""
    for name, t in weights:
        gs.load_into(_tensor(module, name), t, name=name)


def _tensor(module: nn.Module, path: str) -> torch.Tensor:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    assert isinstance(obj, torch.Tensor)
    return obj


def _capture(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> tuple[gs.Graph, torch.Tensor]:
    g = gs.Graph(backend="cpu", guard=model, **kwargs)
    with torch.no_grad(), g.capture():
        out = model(x)
    return g, out


def _plain(model: nn.Module, x: torch.Tensor) -> tuple[gs.Graph, torch.Tensor]:
    """An unguarded graph of `model(x)`: the control that replays whatever memory holds."""
    g = gs.Graph(backend="cpu")
    with torch.no_grad(), g.capture():
        out = model(x)
    return g, out


def _x() -> torch.Tensor:
    return torch.tensor([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]])  # [T=2, 3]


# -- models --------------------------------------------------------------------------------


@gs.graphsafe
class Layer(nn.Module):
    """`weight` [2, 3] with its derived `weight_t` = 2 * weight^T [3, 2], and `bias` [2],
    which nothing derives from. The forward reads the derived buffer and the bias, so a
    replay of new `weight_t` with an old `bias` is the mix of a half-applied update.

    `fault`, when set, is raised (once) by the derivation.
    """

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(1.0, 7.0).reshape(2, 3))
        self.bias = nn.Parameter(torch.zeros(2))
        self.fault: type[BaseException] | None = None

    @gs.derive("weight_t", inputs=["weight"])
    def _weight_t(self, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault("derivation interrupted")
        return torch.mul(weight.t(), 2.0, out=out)  # [3, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t + self.bias  # [T, 2]

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, weights)


def _reference(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return x @ (m.weight.t() * 2.0) + m.bias


def _layer() -> Layer:
    m = Layer()
    m.load_weights([])  # materializes weight_t
    return m


def _all_of(m: nn.Module, scale: float) -> list[tuple[str, torch.Tensor]]:
    """A complete checkpoint: every parameter, scaled."""
    return [(n, p.detach() * scale + 1.0) for n, p in m.named_parameters()]


def _fail_update(m: nn.Module, *writes: tuple[str, torch.Tensor], **kwargs: Any) -> None:
    """A `weight_update` block that writes `writes`, then dies (a sync lost midway)."""
    with pytest.raises(RuntimeError, match="midway"), gs.weight_update(m, **kwargs):
        m.load_weights(list(writes))
        raise RuntimeError("sync died midway")


@gs.graphsafe
class Target(nn.Module):
    """A target model: `embed` [4, 3] (nothing of the target derives from it) and `head`
    [2, 3] with its derived `head_t`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.arange(12.0).reshape(4, 3))
        self.head = nn.Parameter(torch.ones(2, 3))

    @gs.derive("head_t", inputs=["head"])
    def _head_t(self, head: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mul(head.t(), 1.0, out=out)  # [3, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.head_t

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, weights)


@gs.graphsafe
class Draft(nn.Module):
    """An MTP/EAGLE-style draft sharing the target's `embed` (the very parameter), with a
    derivation of its own on it, and a weight of its own, `proj` [3, 3]."""

    def __init__(self, target: Target) -> None:
        super().__init__()
        self.embed = target.embed
        self.proj = nn.Parameter(torch.eye(3))

    @gs.derive("embed_sum", inputs=["embed"])
    def _embed_sum(self, embed: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sum(embed, dim=0, out=out)  # [3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.embed_sum) @ self.proj  # [T, 3]

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, weights)


def _draft_reference(d: Draft, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return (x * d.embed.sum(0)) @ d.proj


def _pair() -> tuple[Target, Draft]:
    target = Target()
    draft = Draft(target)
    target.load_weights([])
    draft.load_weights([])
    return target, draft


EMBED = torch.full((4, 3), 0.5)


# -- A. a load journals every storage it writes ---------------------------------------------


def test_a_load_of_the_target_refreshes_a_draft_deriving_from_their_shared_embedding() -> None:
    target, draft = _pair()
    x = _x()
    g, out = _capture(draft, x)
    plain, plain_out = _plain(draft, x)
    # Control: the same write, seen by nothing, leaves the draft's memory stale.
    target.embed.data.copy_(EMBED * 3.0)
    plain.replay()
    assert not torch.equal(plain_out, _draft_reference(draft, x))
    gs.runtime(draft).refresh()
    target.load_weights([("embed", EMBED)])  # the target reads nothing derived from it
    plain.replay()
    assert torch.equal(plain_out, _draft_reference(draft, x))  # refreshed at once, in place
    g.replay()
    assert torch.equal(out, _draft_reference(draft, x))
    assert gs.runtime(draft).stale == ()


def test_a_checkpoint_entry_loaded_into_a_derived_buffer_is_recomputed_by_the_load() -> None:
    m, x = _layer(), _x()
    junk = torch.full((3, 2), 99.0)
    # Control: the same write outside any load is seen by nothing: the buffer holds it.
    gs.load_into(m.weight_t, junk, name="weight_t")
    assert torch.equal(m.weight_t, junk)
    gs.runtime(m).refresh()
    g, out = _capture(m, x)
    m.load_weights([("weight_t", junk), ("weight", NEW)])
    assert torch.equal(m.weight_t, NEW.t() * 2.0)  # the derivation's value, not the entry's
    g.replay()
    assert torch.equal(out, _reference(m, x))


# -- B. writes that land after the wrapped call returns -------------------------------------


@gs.graphsafe
class Lazy(Layer):
    """A plain (not generator) loader that returns a lazy generator of its writes."""

    def load_weights(self, weights: Weights) -> Iterator[str]:  # type: ignore[override]
        return (self._one(n, t) for n, t in weights)

    def _one(self, name: str, t: torch.Tensor) -> str:
        gs.load_into(_tensor(self, name), t, name=name)
        return name


@gs.graphsafe
class Helped(Layer):
    """A plain loader returning the generator of a helper."""

    def load_weights(self, weights: Weights) -> Iterator[str]:  # type: ignore[override]
        return self._stream(weights)

    def _stream(self, weights: Weights) -> Iterator[str]:
        for name, t in weights:
            gs.load_into(_tensor(self, name), t, name=name)
            yield name


@pytest.mark.parametrize("cls", [Lazy, Helped], ids=["genexpr", "helper"])
def test_a_generator_returned_by_a_plain_loader_is_one_tracked_load(cls: type[Layer]) -> None:
    m, x = cls(), _x()
    list(m.load_weights([]))
    g, out = _capture(m, x)
    plain, plain_out = _plain(m, x)
    assert list(m.load_weights([("weight", NEW), ("bias", torch.ones(2))])) == ["weight", "bias"]
    plain.replay()
    assert torch.equal(plain_out, _reference(m, x))  # refreshed in place: no graph is stale
    g.replay()
    assert torch.equal(out, _reference(m, x))
    gen = m.load_weights([("weight", -NEW), ("bias", torch.zeros(2))])
    assert next(gen) == "weight"
    with pytest.raises(gs.StaleError, match="in progress"):
        g.replay()  # one load, still running: refused, not a replay of half of it
    del gen
    gc.collect()
    with pytest.raises(gs.StaleError, match="failed"):
        g.replay()  # dropped half-way: failed closed


def test_control_a_generator_iterated_outside_any_load_leaves_the_graph_stale() -> None:
    m, x = Lazy(), _x()
    list(m.load_weights([]))
    g, out = _plain(m, x)
    gen = Lazy._one  # the same writes, made by no tracked load
    gen(m, "weight", NEW)
    g.replay()
    assert not torch.equal(out, _reference(m, x))


@gs.graphsafe
class Async(Layer):
    """An `async def` loader awaiting between its writes (checkpoint shards arriving)."""

    async def load_weights(self, weights: Weights) -> list[str]:  # type: ignore[override]
        done = []
        for name, t in weights:
            await asyncio.sleep(0)
            gs.load_into(_tensor(self, name), t, name=name)
            done.append(name)
        return done


def test_an_async_loader_is_one_tracked_load_over_its_whole_run() -> None:
    m, x = Async(), _x()
    asyncio.run(m.load_weights([]))
    g, out = _capture(m, x)
    seen: list[str] = []

    async def replay_meanwhile() -> None:
        for _ in range(3):
            await asyncio.sleep(0)
            try:
                g.replay()
            except gs.StaleError as exc:
                seen.append(exc.summary)
            else:
                seen.append("replayed")

    async def main() -> list[str]:
        loaded, _ = await asyncio.gather(
            m.load_weights([("weight", NEW), ("bias", torch.ones(2))]), replay_meanwhile()
        )
        return loaded

    assert asyncio.run(main()) == ["weight", "bias"]
    assert any("in progress" in s for s in seen)  # the other task saw the load running
    g.replay()
    assert torch.equal(out, _reference(m, x))


def test_an_async_loader_that_raises_leaves_the_model_failed_closed() -> None:
    m, x = Async(), _x()
    asyncio.run(m.load_weights([]))
    g, out = _capture(m, x)
    with pytest.raises(gs.WeightLoadError):
        asyncio.run(m.load_weights([("weight", NEW), ("bias", torch.ones(5))]))
    with pytest.raises(gs.StaleError, match="failed"):
        g.replay()
    asyncio.run(m.load_weights(_all_of(m, 2.0)))
    g.replay()
    assert torch.equal(out, _reference(m, x))


# -- C. a failure follows the model, and heals only where it is written again ---------------


def _refused(g: gs.Graph, match: str = "failed") -> gs.StaleError:
    with pytest.raises(gs.StaleError, match=match) as caught:
        g.replay()
    return caught.value


@pytest.mark.parametrize("partial", ["an empty load", "a one-entry load", "an empty block"])
def test_a_partial_load_after_a_failed_update_does_not_heal_it(partial: str) -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x)
    _fail_update(m, ("weight", NEW))  # weight written, bias old: the mix
    _refused(g)
    if partial == "an empty load":
        m.load_weights([])
    elif partial == "a one-entry load":
        m.load_weights([("weight", NEW * 3.0)])
    else:
        with gs.weight_update(m):
            pass
    assert gs.runtime(m).stale == ()  # nothing derived is stale: only the weights are mixed
    refused = _refused(g)
    assert "bias" in str(refused)  # still owed: nothing rewrote it
    gs.runtime(m).refresh()
    _refused(g)  # a refresh cannot repair half-loaded weights
    m.load_weights([("weight", NEW * 2.0), ("bias", torch.ones(2))])  # every weight
    g.replay()
    assert torch.equal(out, _reference(m, x))


def test_the_refusal_counts_and_names_what_is_owed_and_says_how_to_heal() -> None:
    m, x = _layer(), _x()
    g, _ = _capture(m, x)
    _fail_update(m, ("weight", NEW))
    m.load_weights([("weight", NEW)])
    err = _refused(g)
    assert "1 tensor(s)" in str(err) and err.path == "bias"
    assert err.module_class == "Layer"
    assert err.fix is not None and "load the weights again: a complete load heals it" in err.fix
    with pytest.raises(gs.StaleError, match="still owed"):
        gs.runtime(m).assert_fresh(repair=True)  # never repaired


def _to_float64_and_back(m: nn.Module) -> None:
    m.to(torch.float64)
    m.to(torch.float32)


def _share_memory(m: nn.Module) -> None:
    m.share_memory()


@pytest.mark.parametrize("move", [_to_float64_and_back, _share_memory], ids=["to", "share"])
def test_a_failed_update_is_not_forgotten_when_the_model_moves(
    move: Callable[[nn.Module], None],
) -> None:
    m, x = _layer(), _x()
    before = {n: p.untyped_storage().data_ptr() for n, p in m.named_parameters()}
    _fail_update(m, ("weight", NEW))
    move(m)
    assert all(p.untyped_storage().data_ptr() != before[n] for n, p in m.named_parameters())
    g, out = _capture(m, x)
    _refused(g)
    m.load_weights(_all_of(m, 2.0))  # a complete load heals
    g.replay()
    assert torch.equal(out, _reference(m, x))


def test_a_failure_healed_after_the_model_moved_leaves_no_poison_at_the_old_addresses() -> None:
    # `share_memory()` frees the weights' old bytes while their storages live on: the
    # failure's poison follows them, and the old addresses are free for any model.
    m, x = _layer(), _x()
    old = {p.untyped_storage().data_ptr() for p in m.parameters()}
    _fail_update(m, ("weight", NEW))
    assert old <= JOURNAL.poisoned.keys()  # control: the failure poisoned them there
    m.share_memory()
    g, _ = _capture(m, x)
    _refused(g)
    m.load_weights(_all_of(m, 2.0))  # a complete load heals
    g.replay()
    assert not old & JOURNAL.poisoned_keys()  # a fresh model there replays


def test_a_draft_refuses_the_targets_failure_after_the_shared_storage_moved() -> None:
    target, draft = _pair()
    x = _x()
    g, _ = _capture(draft, x)
    _fail_update(target, ("embed", EMBED))
    target.share_memory()  # moves the shared embedding's bytes, poison and all
    assert storage_key(draft.embed) in JOURNAL.poisoned_keys()
    with pytest.raises(gs.GraphSafetyError):  # moved under the graph, and poisoned
        g.replay()
    g.reset()  # the move needs a new capture; a load that writes the embedding heals
    draft.load_weights([("embed", EMBED * 2.0)])
    assert storage_key(draft.embed) not in JOURNAL.poisoned_keys()


def test_a_drafts_own_load_does_not_heal_the_targets_failure_on_their_shared_embedding() -> None:
    target, draft = _pair()
    x = _x()
    g, out = _capture(draft, x)
    _fail_update(target, ("embed", EMBED))  # the target's sync died after writing embed
    _refused(g)  # the draft reads what the failed sync may have written
    draft.load_weights([("proj", torch.eye(3) * 2.0)])  # the draft's own weight only
    _refused(g)
    draft.load_weights([("embed", EMBED * 2.0)])  # now the shared storage is rewritten
    g.replay()
    assert torch.equal(out, _draft_reference(draft, x))


def test_another_models_load_heals_only_the_storages_it_wrote() -> None:
    target, draft = _pair()
    x = _x()
    g, out = _capture(target, x)
    _fail_update(target, ("embed", EMBED))
    draft.load_weights([("embed", EMBED * 2.0)])  # rewrites the shared embedding only
    err = _refused(g)
    assert err.path == "head"  # still owed: only the target's own loads write it
    target.load_weights([("head", torch.full((2, 3), 3.0))])
    g.replay()
    assert torch.equal(out, x @ target.head.t())


def test_a_failed_update_that_named_its_writes_owes_only_those() -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x)
    _fail_update(m, ("weight", NEW), writes=["weight"])
    _refused(g)
    m.load_weights([("weight", NEW * 2.0)])
    g.replay()  # bias was never to be written: nothing else is owed
    assert torch.equal(out, _reference(m, x))
    # Control: the same failure, unnamed, owes every weight; the same load leaves bias owed.
    _fail_update(m, ("weight", NEW))
    m.load_weights([("weight", NEW * 2.0)])
    assert _refused(g).path == "bias"


def test_an_update_naming_a_tensor_the_model_does_not_have_is_refused_by_name() -> None:
    m = _layer()
    with (pytest.raises(gs.GraphSafetyError, match="weigth") as caught,
          gs.weight_update(m, writes=["weight", "weigth"])):
        pass
    assert caught.value.path == "weigth"


def _size_mismatch(m: Layer) -> None:
    # torch copies the entries that fit, runs the post hooks, then raises for the one
    # that does not.
    m.load_state_dict({"weight": NEW.clone(), "bias": torch.ones(5)})


def _missing_key(m: Layer) -> None:
    m.load_state_dict({"weight": NEW.clone()})  # strict: raises once it has copied weight


@pytest.mark.parametrize("load", [_size_mismatch, _missing_key], ids=["size", "missing"])
def test_a_load_state_dict_that_raises_midway_leaves_the_model_failed_closed(
    load: Callable[[Layer], None],
) -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x)
    with pytest.raises(RuntimeError, match="Error"):
        load(m)
    assert torch.equal(m.weight, NEW)  # control: half of it landed, a replay would mix
    _refused(g)
    m.load_state_dict({"weight": NEW * 2.0, "bias": torch.ones(2)})  # complete: heals
    g.replay()
    assert torch.equal(out, _reference(m, x))


def test_control_a_partial_load_state_dict_that_is_not_strict_is_a_load_like_any() -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x)
    m.load_state_dict({"weight": NEW.clone()}, strict=False)
    g.replay()
    assert torch.equal(out, _reference(m, x))


# -- D. the journal heals only the storages it is given -------------------------------------


def test_a_draft_still_refuses_the_targets_failure_after_its_refresh_and_other_loads() -> None:
    # Only the journal's storage poison makes the draft refuse (the failure is the
    # target's): a heal of every poisoned storage would let it replay the mix.
    target, draft = _pair()
    x = _x()
    g, _ = _capture(draft, x)
    _fail_update(target, ("embed", EMBED))
    gs.runtime(draft).refresh()  # heals the draft's derived buffers, not the weights
    _refused(g)
    target.load_weights([("head", torch.full((2, 3), 3.0))])  # a complete load of another
    _refused(g)


# -- E. a derivation that raised during a load is never repaired by a replay ----------------


def test_on_stale_refresh_never_repairs_a_derivation_that_raised_during_a_load() -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x, on_stale="refresh")
    m.fault = ValueError
    with pytest.raises(ValueError, match="interrupted"):
        m.load_weights([("weight", NEW)])
    assert m.fault is None  # it raised once; computing it now would succeed
    for _ in range(2):
        _refused(g, match="do not match")
    m.load_weights([])  # a load retries it
    g.replay()
    assert torch.equal(out, _reference(m, x))


def test_control_on_stale_refresh_repairs_a_write_the_version_counters_saw() -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x, on_stale="refresh")
    with torch.no_grad():
        m.weight.mul_(2.0)
    g.replay()
    assert torch.equal(out, _reference(m, x))


# -- F. every write moves the epoch ---------------------------------------------------------


def test_a_second_declared_write_makes_the_guard_refuse_again() -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x)
    for value in (NEW, NEW * 2.0):
        m.weight.data.numpy()[:] = value.numpy()  # invisible to torch
        gs.mark_written(m.weight)
        _refused(g, match="weight_t")
        gs.runtime(m).refresh_stale()
        g.replay()
        assert torch.equal(out, _reference(m, x))


def test_a_declared_write_through_a_numpy_view_of_part_of_a_weight_is_matched_by_address(
) -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x)
    region = m.weight.data.numpy()[1:]  # the second row: another storage object
    region[:] = NEW[1].numpy()
    gs.mark_written(torch.from_numpy(region))
    _refused(g, match="weight_t")
    gs.runtime(m).refresh_stale()
    g.replay()
    assert torch.equal(out, _reference(m, x))


def test_control_a_declared_write_of_other_memory_marks_nothing_of_the_model() -> None:
    m, x = _layer(), _x()
    g, out = _capture(m, x)
    gs.mark_written(torch.from_numpy(NEW.numpy().copy()))
    g.replay()  # nothing of the model's memory was declared written
    assert torch.equal(out, _reference(m, x))


# -- G. errors a user can hit say what, where and how to fix --------------------------------


_COMPILED: list[Callable[[torch.Tensor], torch.Tensor]] = []


def _dequantize(t: torch.Tensor) -> torch.Tensor:
    """`t * 2 + 1` through a `torch.compile(fullgraph=True)` function (made on first use:
    importing dynamo takes seconds, which the processes this module starts need not)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(lambda t: t * 2.0 + 1.0, fullgraph=True, backend="eager"))
    return _COMPILED[0](t)


@gs.graphsafe
class Compiled(Layer):
    """A loader that converts each entry with a `torch.compile(fullgraph=True)` function."""

    def load_weights(self, weights: Weights) -> None:
        for name, t in weights:
            gs.load_into(_tensor(self, name), _dequantize(t), name=name)


def test_a_compiled_function_in_a_loader_under_the_python_tracker_is_refused_by_name() -> None:
    m = Compiled()
    with _native.using(False):
        m.load_weights([])
        with pytest.raises(gs.GraphSafetyError, match=r"torch\.compile") as caught:
            m.load_weights([("weight", NEW)])
    err = caught.value
    assert err.module_class == "Compiled" and "Compiled.load_weights" in str(err)
    assert err.fix is not None and "graphsafe native build" in err.fix
    assert isinstance(err.__cause__, RuntimeError)  # what dynamo raised, kept as the cause


def test_control_dynamo_refuses_a_fullgraph_compile_under_any_dispatch_mode() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Noop(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                               ) -> Any:
            return func(*args, **(kwargs or {}))

    fresh = torch.compile(lambda t: t * 2.0 + 1.0, fullgraph=True, backend="eager")
    assert torch.equal(fresh(torch.ones(3)), torch.full((3,), 3.0))  # outside: compiled
    with Noop(), pytest.raises(RuntimeError, match="fullgraph=True found no compiled frames"):
        fresh(torch.ones(3))  # even its cached code is refused: no write goes unseen


@gs.graphsafe
class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 3))

    @gs.derive("weight_t", inputs=["weight"])
    def _weight_t(self, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.mul(weight.t(), 2.0, out=out)

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, weights)


@gs.graphsafe
class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = Decoder()

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, weights)


def test_a_submodule_kept_after_its_wrapper_was_dropped_gets_a_runtime_of_its_own() -> None:
    wrapper = Wrapper()
    wrapper.load_weights([("decoder.weight", NEW)])
    decoder = wrapper.decoder
    assert gs.runtime(decoder) is gs.runtime(wrapper)  # control: a submodule's loads join
    del wrapper
    gc.collect()
    rt = gs.runtime(decoder)
    assert rt.model is decoder
    decoder.load_weights([("weight", NEW * 2.0)])
    assert torch.equal(decoder.weight_t, NEW.t() * 4.0)


def test_a_runtime_whose_model_is_gone_names_the_models_class() -> None:
    rt = gs.runtime(Decoder())
    gc.collect()
    with pytest.raises(gs.GraphSafetyError, match="no longer exists") as caught:
        _ = rt.model
    assert caught.value.module_class == "Decoder" and "Decoder" in caught.value.summary


# -- C. a failed sync names what it writes --------------------------------------------------


@gs.graphsafe
class Synced(Layer):
    """A receiver whose loader refuses an entry of the wrong shape (before writing it)."""


@gs.graphsafe
class Renamed(Layer):
    """The same, with a loader that maps checkpoint names (`W` is `weight`), as loaders of
    stacked projections do: the sync's names are not the model's tensor paths."""

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, [("weight" if n == "W" else n, t) for n, t in weights])


def _sync_side(rank: int, port: int, results: Any) -> None:
    """One rank of a two-rank world: rank 0 sends four syncs, rank 1 receives them."""
    import datetime
    import os
    import traceback

    import torch.distributed as dist

    import graphsafe.distributed as gsd

    error = None
    try:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        timeout = datetime.timedelta(seconds=30)
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
        group = dist.new_group(timeout=timeout)
        syncs = [[("weight", torch.zeros(3, 2))], [("weight", NEW)],
                 [("W", torch.zeros(3, 2))], [("W", NEW)]]
        if rank == 0:
            for i, sync in enumerate(syncs):
                if i % 2 == 0:
                    with pytest.raises(gsd.WeightSyncError, match="did not apply"):
                        gsd.send_weights(sync, src=0, group=group, partial=True)
                else:
                    gsd.send_weights(sync, src=0, group=group, partial=True)
        else:
            x = _x()
            for cls in (Synced, Renamed):  # two syncs each: one rejected, one complete
                m = cls()
                m.load_weights([])
                g, out = _capture(m, x)
                # The checkpoint names each loader takes (Renamed maps `W` to `weight`).
                expects = ["W", "bias"] if cls is Renamed else None
                with pytest.raises(gsd.WeightSyncError, match="rejected 1 entry"):
                    gsd.receive_weights(m, src=0, group=group, expects=expects)
                _refused(g)
                gsd.receive_weights(m, src=0, group=group, expects=expects)  # `weight` again
                if cls is Synced:  # its sync named `weight`: nothing else was owed
                    g.replay()
                    assert torch.equal(out, _reference(m, x))
                else:  # control: unnamed, it owes every weight; `bias` still is
                    assert _refused(g).path == "bias"
        dist.destroy_process_group()
    except BaseException:
        error = traceback.format_exc()
    results.put((rank, error))


def test_a_failed_sync_whose_entries_are_tensors_of_the_model_owes_only_those() -> None:
    import multiprocessing

    from graphsafe._verify.pp.processes import free_port

    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "graphsafe.distributed"])
    else:
        ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_sync_side, args=(r, port, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        errors = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()
    assert errors == {0: None, 1: None}, "\n".join(e for e in errors.values() if e)


@gs.graphsafe
class Deferred(Layer):
    """A plain loader returning the coroutine of an async helper."""

    def load_weights(self, weights: Weights) -> Any:  # type: ignore[override]
        return self._fetch(weights)

    async def _fetch(self, weights: Weights) -> None:
        for name, t in weights:
            await asyncio.sleep(0)
            gs.load_into(_tensor(self, name), t, name=name)


def test_a_coroutine_returned_by_a_plain_loader_is_tracked_once_awaited() -> None:
    m, x = Deferred(), _x()
    asyncio.run(m.load_weights([]))
    g, out = _capture(m, x)
    plain, plain_out = _plain(m, x)
    asyncio.run(m.load_weights([("weight", NEW), ("bias", torch.ones(2))]))
    plain.replay()
    assert torch.equal(plain_out, _reference(m, x))  # refreshed in place
    g.replay()
    assert torch.equal(out, _reference(m, x))
