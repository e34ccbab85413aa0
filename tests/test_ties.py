"""Ties a reload breaks: an LM head tied to the embedding, recorded when the model is bound.

A tied checkpoint carries the shared tensor once (`emb.weight`). A load that unties the
head (binds it to a parameter of its own, or repacks the weights into one flat buffer
where the head owns a copy) is refused naming both paths, and so is every later sync
that writes one side of the broken tie: the head would keep the old values. Each control
shows the head really is stale; the no-false-alarm cases keep the tie (a load writing the
shared storage once, a `.data` rebinding of the shared parameter, a draft sharing the
target's submodules).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe._runtime.bind import ties as ties_module
from graphsafe._runtime.bind.ties import Ties

V, C = 6, 4  # vocabulary, width


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    return {"emb.weight": torch.randn(V, C, generator=torch.Generator().manual_seed(seed))}


def _reference(ck: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w = ck["emb.weight"]  # the head is the embedding
    return (w[x] @ w.t()).softmax(-1)  # [T, V]


@gs.graphsafe
class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = self.emb.weight  # tied, as tie_word_embeddings does

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T] token ids
        return self.head(self.emb(x)).softmax(-1)  # [T, V]

    def load_weights(self, weights: dict[str, torch.Tensor], how: str = "copy") -> None:
        with torch.no_grad():
            if how == "untie":  # the head gets a parameter of its own
                self.head.weight = nn.Parameter(weights["emb.weight"].clone())
            if how == "repack":  # one flat buffer, a slot per name: the head owns a copy
                _repack(self)
            if how == "both":  # every side written
                self.head.weight.copy_(weights["emb.weight"])
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)


def _repack(m: nn.Module) -> None:
    named = list(m.named_parameters(remove_duplicate=False))
    flat = torch.empty(sum(p.numel() for _, p in named))
    at = 0
    for name, p in named:
        owner, _, leaf = name.rpartition(".")
        view = flat[at:at + p.numel()].view(p.shape)
        view.copy_(p.detach())
        m.get_submodule(owner)._parameters[leaf] = nn.Parameter(view)
        at += p.numel()


def _loaded() -> TiedLM:
    torch.manual_seed(0)
    m = TiedLM()
    m.load_weights(_checkpoint(0))
    return m


X = torch.tensor([0, 3, 5])


def test_the_tie_is_recorded_at_bind() -> None:
    m = _loaded()
    assert gs.runtime(m)._binder.ties.groups == (("emb.weight", "head.weight"),)


def test_weights_that_share_a_flat_buffer_at_other_offsets_are_no_tie() -> None:
    m = nn.Module()
    flat = torch.zeros(8)
    m.a = nn.Parameter(flat[:4])
    m.b = nn.Parameter(flat[4:])
    assert Ties.record(m).groups == ()


def _shared_module() -> nn.Module:
    shared = nn.Linear(2, 2)
    return nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared))


def _same_parameter() -> nn.Module:
    return TiedLM()


def _views_of_one_region() -> nn.Module:
    m = nn.Module()
    flat = torch.zeros(8)
    m.a = nn.Parameter(flat[:4])
    m.b = nn.Parameter(flat[:6][:4])  # another view object of the same region
    m.c = nn.Parameter(flat[4:])
    return m


def _persistent_buffer_and_parameter() -> nn.Module:
    m = nn.Linear(2, 2)
    m.register_buffer("kept", m.weight.detach())  # persistent: a weight too
    m.register_buffer("scratch", m.bias.detach(), persistent=False)  # no weight
    return m


def _untied() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))


_MODELS = [_shared_module, _same_parameter, _views_of_one_region,
           _persistent_buffer_and_parameter, _untied]


@pytest.mark.parametrize("build", _MODELS, ids=lambda f: f.__name__.strip("_"))
def test_the_quick_check_gives_what_the_full_pass_gives(
        build: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Most models share no storage, and the ties are recorded without making a path;
    where they do (or a module is bound twice), the paths are read as before."""
    m = build()
    quick = Ties.record(m).groups
    monkeypatch.setattr(ties_module, "_shares_storage", lambda modules: True)
    assert Ties.record(m).groups == quick
    assert (quick != ()) == (build is not _untied)


def test_control_a_quick_check_that_counted_a_shared_module_once_misses_its_tie(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A module bound at two paths holds its weights at both: a check over each module
    once sees no storage twice. The quick check refuses to answer for such a tree."""
    m = _shared_module()
    assert Ties.record(m).groups == (("0.weight", "2.0.weight"), ("0.bias", "2.0.bias"))
    monkeypatch.setattr(ties_module, "_unshared", lambda model: list(model.modules()))
    assert Ties.record(m).groups == ()


def test_a_load_that_keeps_the_tie_is_no_false_alarm() -> None:
    m = _loaded()
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = m(X)
    m.load_weights(_checkpoint(1))  # the shared storage, written once
    g.replay()
    assert torch.allclose(y, _reference(_checkpoint(1), X))


def test_a_data_rebinding_of_the_shared_parameter_keeps_the_tie() -> None:
    m = _loaded()
    m.emb.weight.data = torch.zeros(V, C)  # one object at both paths: still tied
    m.load_weights(_checkpoint(1))
    gs.runtime(m).assert_fresh()
    with torch.no_grad():
        assert torch.allclose(m(X), _reference(_checkpoint(1), X))


@pytest.mark.parametrize("how", ["untie", "repack"])
def test_a_load_that_breaks_the_tie_is_refused_naming_both_paths(how: str) -> None:
    m = _loaded()
    with pytest.raises(gs.StaleError, match=r"broke the tie") as info:
        m.load_weights(_checkpoint(1), how=how)
    assert info.value.paths == ("emb.weight", "head.weight")
    message = str(info.value)
    assert "expected:" in message and "got:" in message and "re-tie" in message
    with pytest.raises(gs.StaleError, match=r"emb\.weight and head\.weight"):
        gs.runtime(m).assert_fresh()  # refused until healed
    m.load_weights(_checkpoint(2), how="both")  # every side written
    gs.runtime(m).assert_fresh()
    with torch.no_grad():
        assert torch.allclose(m(X), _reference(_checkpoint(2), X))


@pytest.mark.parametrize("how", ["untie", "repack"])
def test_control_after_the_tie_broke_a_sync_of_the_one_name_leaves_the_head_stale(
    how: str,
) -> None:
    m = _loaded()
    with pytest.raises(gs.StaleError):
        m.load_weights(_checkpoint(1), how=how)
    with pytest.raises(gs.StaleError, match=r"wrote emb\.weight.*the sides now differ"):
        m.load_weights(_checkpoint(2))  # the checkpoint carries the tied tensor once
    with torch.no_grad():  # what the refusals guard against: the head kept old values
        assert not torch.allclose(m(X), _reference(_checkpoint(2), X))
        assert not torch.equal(m.head.weight, m.emb.weight)


def test_a_tie_broken_outside_any_load_then_a_sync_of_one_side_refuses_the_replay() -> None:
    m = _loaded()
    m.head.weight = nn.Parameter(m.emb.weight.detach().clone())  # untied by hand
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        m(X)
    with pytest.raises(gs.StaleError, match=r"wrote emb\.weight.*the sides now differ"):
        m.load_weights(_checkpoint(1))
    with pytest.raises(gs.StaleError, match=r"tie"):
        g.replay()


def test_control_unguarded_the_same_replay_reads_the_stale_head() -> None:
    m = _loaded()
    m.head.weight = nn.Parameter(m.emb.weight.detach().clone())
    g = gs.Graph(backend="cpu")
    with torch.no_grad(), g.capture():
        y = m(X)
    with pytest.raises(gs.StaleError):
        m.load_weights(_checkpoint(1))
    g.replay()
    assert not torch.allclose(y, _reference(_checkpoint(1), X))


@gs.graphsafe
class Draft(nn.Module):
    """A draft sharing the target's embedding submodule, its head tied to it."""

    def __init__(self, target: TiedLM) -> None:
        super().__init__()
        self.emb = target.emb
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = target.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x)).softmax(-1)  # [T, V]

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)


def test_a_draft_sharing_the_targets_submodule_is_no_false_alarm() -> None:
    target = _loaded()
    draft = Draft(target)
    draft.load_weights({})
    g = gs.Graph(backend="cpu", guard=draft)
    with torch.no_grad(), g.capture():
        y = draft(X)
    target.load_weights(_checkpoint(1))  # the target's sync writes the shared storage
    g.replay()
    assert torch.allclose(y, _reference(_checkpoint(1), X))
    draft.load_weights(_checkpoint(2))
    g.replay()
    assert torch.allclose(y, _reference(_checkpoint(2), X))


def _state_dict(seed: int, *, head: bool) -> dict[str, torch.Tensor]:
    """A checkpoint as a state dict; `head`: it also carries the head as a tensor of its
    own (equal values), as a checkpoint saved without shared tensors does."""
    sd = _checkpoint(seed)
    if head:
        sd["head.weight"] = sd["emb.weight"].clone()
    return sd


def test_load_state_dict_keeping_the_tie_is_no_false_alarm() -> None:
    m = _loaded()
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = m(X)
    m.load_state_dict(_state_dict(1, head=True))  # copies in place: one memory
    g.replay()
    assert torch.allclose(y, _reference(_checkpoint(1), X))
    shared = _checkpoint(2)["emb.weight"]
    m.load_state_dict({"emb.weight": shared, "head.weight": shared}, assign=True)
    assert gs.runtime(m)._binder.ties.broken(m) == frozenset()  # one tensor at both paths
    with pytest.raises(gs.StorageMovedError):
        g.replay()  # bound anew: the graph's addresses moved (the ledger's refusal)
    gs.runtime(m).assert_fresh()
    with torch.no_grad():
        assert torch.allclose(m(X), _reference(_checkpoint(2), X))


def test_load_state_dict_that_breaks_the_tie_is_refused_naming_both_paths() -> None:
    m = _loaded()
    with pytest.raises(gs.StaleError, match=r"load_state_dict broke the tie") as info:
        m.load_state_dict(_state_dict(1, head=True), assign=True)  # two tensors now
    assert info.value.paths == ("emb.weight", "head.weight")
    with pytest.raises(gs.StaleError, match=r"emb\.weight and head\.weight"):
        gs.runtime(m).assert_fresh()
    # The next sync carries the tied tensor once: refused, and the control shows why.
    with pytest.raises(gs.StaleError, match=r"load_state_dict wrote emb\.weight.*differ"):
        m.load_state_dict(_checkpoint(2), strict=False)
    with torch.no_grad():
        assert not torch.allclose(m(X), _reference(_checkpoint(2), X))  # the stale head
    m.load_state_dict(_state_dict(3, head=True))  # every side written, equal: healed
    gs.runtime(m).assert_fresh()
    with torch.no_grad():
        assert torch.allclose(m(X), _reference(_checkpoint(3), X))


def test_untie_lets_a_model_meant_to_be_untied_load_each_side_apart() -> None:
    m = _loaded()
    gs.runtime(m).untie("head.weight")
    assert gs.runtime(m)._binder.ties.groups == ()
    m.load_weights(_checkpoint(1), how="untie")  # the head gets a parameter of its own
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = m(X)
    head = torch.randn(V, C)
    with torch.no_grad():
        m.emb.weight.copy_(_checkpoint(2)["emb.weight"])
        m.head.weight.copy_(head)  # sides apart, as the model means them
    g.replay()
    w = _checkpoint(2)["emb.weight"]
    assert torch.allclose(y, (w[X] @ head.t()).softmax(-1))


def test_untie_of_a_path_in_no_tie_is_refused_naming_the_ties() -> None:
    m = _loaded()
    with pytest.raises(gs.GraphSafetyError, match=r"emb\.bias of TiedLM is in no tie") as info:
        gs.runtime(m).untie("emb.bias")
    assert "emb.weight and head.weight" in str(info.value)
    assert gs.runtime(m)._binder.ties.groups == (("emb.weight", "head.weight"),)  # kept
