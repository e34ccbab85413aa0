"""Tier 2: SGLang's real CPU Engine (scheduler and detokenizer in their own processes) with
graphsafe's plugin loaded there from its entry point: a tiny Llama held to Hugging Face's
greedy tokens across SGLang's update entry points, and to the trainer's fingerprints (the
engine serves what was sent, bit for bit, wherever the names map one to one), a tiny
DeepSeek V3 (MLA + MoE) held to itself and to exact derived buffers, and the direct path
without graphsafe (the control)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import engine_util as eu
import pytest
import sglang_models as sm
import torch
from conftest import PLUGIN_INSTALLED

import graphsafe as gs

pytestmark = pytest.mark.skipif(
    not PLUGIN_INSTALLED, reason="graphsafe is not installed here: SGLang cannot load its "
    "plugin (scripts/test-sglang installs it)")


def sglang_llama_names(seed: int) -> list[tuple[str, torch.Tensor]]:
    """seed's Llama weights under SGLang's parameter names (fused qkv and gate-up), what
    `load_format="direct"` writes without SGLang's loader."""
    sd = dict(sm.checkpoint("llama", seed))
    out = []
    for name, w in sd.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            k, v = (sd[name.replace("q_proj", x)] for x in ("k_proj", "v_proj"))
            out.append((name.replace("q_proj", "qkv_proj"), torch.cat([w, k, v])))
        elif ".gate_proj." in name:
            up = sd[name.replace("gate_proj", "up_proj")]
            out.append((name.replace("gate_proj", "gate_up_proj"), torch.cat([w, up])))
        else:
            out.append((name, w))
    return out


def mismatches(probe: dict[str, Any], sent: list[tuple[str, torch.Tensor]]
               ) -> tuple[int, list[str]]:
    """How many of the `sent` entries the engine holds under the same name and shape, and
    those whose fingerprint differs from the engine's (each cast to the engine's dtype
    first, as the engine's loader casts it)."""
    held = probe["held"]
    same = {n: w.to(getattr(torch, held[n][0])) for n, w in sent
            if n in held and list(w.shape) == held[n][1]}
    mine = gs.fingerprint(same)
    return len(same), [n for n in same if mine[n] != probe["fingerprints"][n]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang")


def test_llama_engine_matches_hugging_face_across_updates(root: Path) -> None:
    with eu.engine(eu.save("llama", 0, root), root / "llama.json", graphsafe=True) as eng:
        start = eu.probed(eng)
        assert start["attached"] and start["status"]["pinned"]
        assert start["status"]["graphs"] is False  # SGLang's CPU engine captures none
        assert start["status"]["recording"]  # op by op: its first two forwards are recorded
        assert eu.generate(eng) == eu.hf_generate("llama", 0)
        assert eu.probed(eng)["status"]["recording"] is False  # recorded, and no refusal

        eu.update(eng, sm.checkpoint("llama", 1))  # load_format None: SGLang's loader
        assert eu.generate(eng) == eu.hf_generate("llama", 1)
        # The engine serves the sent weights wherever a name maps one to one (SGLang's
        # loader fuses q, k, v and gate, up: those have no counterpart); control: the
        # engine's first weights differ from them in every one.
        compared, changed = mismatches(eu.probed(eng), sm.checkpoint("llama", 1))
        assert compared == 2 * 4 + 3 and changed == []
        assert len(mismatches(start, sm.checkpoint("llama", 1))[1]) == compared

        eu.update(eng, sglang_llama_names(2), "direct")
        assert eu.generate(eng) == eu.hf_generate("llama", 2)
        # In SGLang's own names, fused tensors included, every entry compares.
        sent = sglang_llama_names(2)
        assert mismatches(eu.probed(eng), sent) == (len(sent), [])

        assert eu.ok(eng.update_weights_from_disk(eu.save("llama", 3, root)))
        assert eu.generate(eng) == eu.hf_generate("llama", 3)

        eu.update_distributed(eng, "llama", 4)  # from a sender process, over gloo
        assert eu.generate(eng) == eu.hf_generate("llama", 4)

        end = eu.probed(eng)
        assert end["addresses"] == start["addresses"]  # no weight moved
        assert end["status"]["stale"] == [] and end["status"]["moved"] == {}
        # Each probe and each update above is one graphsafe update.
        assert end["status"]["updates"] == start["status"]["updates"] + 8


def _kv_b(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(n, w) for n, w in sm.checkpoint("deepseek", seed) if "kv_b_proj" in n]


def test_deepseek_engine_refreshes_mla_on_the_direct_path(root: Path) -> None:
    """With graphsafe, the direct update of `kv_b_proj` (which skips `post_load_weights`)
    gives the tokens a full load of the same weights gives, and `w_kc`/`w_vc` stay exact
    and in place; the engine returns to its first tokens when its first weights come back."""
    with eu.engine(eu.save("deepseek", 0, root), root / "dsv3.json", graphsafe=True) as eng:
        start = eu.probed(eng)
        assert start["status"]["derived"]  # the shipped registry's w_kc/w_vc
        first = eu.generate(eng)

        eu.update(eng, _kv_b(1), "direct")
        direct = eu.generate(eng)
        after = eu.probed(eng)
        assert after["mla_fresh"] and after["mla_addresses"] == start["mla_addresses"]

        eu.update(eng, _kv_b(1))  # the same weights through SGLang's loader
        assert eu.generate(eng) == direct != first

        eu.update(eng, sm.checkpoint("deepseek", 2))
        assert eu.probed(eng)["mla_fresh"]
        assert eu.ok(eng.update_weights_from_disk(eu.save("deepseek", 0, root)))
        assert eu.generate(eng) == first
        end = eu.probed(eng)
        assert end["mla_fresh"] and end["status"]["stale"] == []
        assert end["addresses"] == start["addresses"]
        assert end["mla_addresses"] == start["mla_addresses"]


def test_deepseek_engine_serves_stale_mla_without_graphsafe(root: Path) -> None:
    """The control: SGLang alone, after the direct update of `kv_b_proj`, keeps serving
    the old `w_kc`/`w_vc`: the tokens do not change. SGLang loads graphsafe's plugin here
    too (its entry point), which without `GRAPHSAFE_SGLANG_REGISTRIES` does nothing."""
    with eu.engine(eu.save("deepseek", 0, root), root / "ctl.json", graphsafe=False) as eng:
        assert not eu.probed(eng)["attached"]
        first = eu.generate(eng)
        eu.update(eng, _kv_b(1), "direct")
        assert not eu.probed(eng)["mla_fresh"]
        assert eu.generate(eng) == first
        eu.update(eng, _kv_b(1))
        assert eu.generate(eng) != first
