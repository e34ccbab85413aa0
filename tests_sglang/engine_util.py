"""A real SGLang `Engine` on the CPU for the tier-2 tests: tiny checkpoints on disk, the
engine's start and stop, greedy tokens from it and from Hugging Face, and a probe that
reports from inside the scheduler process."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sglang_models as sm
import torch

PROMPTS = [[1, 5, 9, 17], [3, 100, 42], [7, 7, 64, 2, 11]]
NEW_TOKENS = 6
PROBE = "engine_util.probe"
"""The custom weight loader that reports graphsafe's state (`probe`)."""


def save(kind: str, seed: int, root: Path) -> str:
    """Hugging Face's model of `kind` with seed's weights, saved under `root`."""
    path = root / f"{kind}-{seed}"
    if not path.exists():
        sm.hf_model(kind, seed).save_pretrained(path)
    return str(path)


@contextmanager
def engine(model_path: str, probe_file: Path, *, graphsafe: bool, **overrides: Any
           ) -> Iterator[Any]:
    """An SGLang Engine on the CPU, small (a 1024-token KV pool), with graphsafe's plugin on
    (`GRAPHSAFE_SGLANG_REGISTRIES` naming the shipped MLA registry) or off; `probe` writes
    to `probe_file`. It and its subprocesses are stopped when the block exits, whatever
    happened in it."""
    import sglang as sgl

    from graphsafe.integrations import sglang as gss

    saved = os.environ.pop(gss.ENV, None)
    if graphsafe:
        os.environ[gss.ENV] = gss.DEEPSEEK_MLA
    os.environ["GRAPHSAFE_TEST_PROBE"] = str(probe_file)
    kwargs: dict[str, Any] = dict(
        model_path=model_path, device="cpu", attention_backend="torch_native",
        sampling_backend="pytorch", skip_tokenizer_init=True, disable_cuda_graph=True,
        dtype="float32", mem_fraction_static=0.05, max_total_tokens=1024,
        max_running_requests=4, chunked_prefill_size=256, log_level="error", random_seed=0,
        custom_weight_loader=[PROBE],
    )
    kwargs.update(overrides)
    eng = None
    try:
        eng = sgl.Engine(**kwargs)
        eng.graphsafe_probe_file = probe_file
        yield eng
    finally:
        if eng is not None:
            eng.shutdown()
        if saved is None:
            os.environ.pop(gss.ENV, None)
        else:
            os.environ[gss.ENV] = saved


def generate(eng: Any) -> list[list[int]]:
    """Greedy tokens for `PROMPTS` (EOS ignored)."""
    outs = eng.generate(
        input_ids=PROMPTS,
        sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    )
    return [o["output_ids"] for o in outs]


def hf_generate(kind: str, seed: int) -> list[list[int]]:
    """Hugging Face's greedy tokens for `PROMPTS` with seed's weights."""
    model = sm.hf_model(kind, seed)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt):])
    return out


def update(eng: Any, named: list[tuple[str, torch.Tensor]], fmt: str | None = None) -> None:
    """`update_weights_from_tensor` inside SGLang's begin/end session (0.5.23 requires
    one), each step asserted to succeed."""
    assert ok(eng.begin_weight_update())
    assert ok(eng.update_weights_from_tensor(named, load_format=fmt))
    assert ok(eng.end_weight_update())


def update_distributed(eng: Any, kind: str, seed: int) -> None:
    """`update_weights_from_distributed` inside a session, from a sender process
    (`dist_sender.py`, rank 0 of a gloo group) broadcasting seed's checkpoint."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = "graphsafe_test"
    sender = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("dist_sender.py")), str(port), group,
         kind, str(seed)])
    try:
        assert ok(eng.init_weights_update_group(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
            group_name=group, backend="gloo"))
        named = sm.checkpoint(kind, seed)
        assert ok(eng.begin_weight_update())
        assert ok(eng.update_weights_from_distributed(
            names=[n for n, _ in named], dtypes=[str(w.dtype).split(".")[-1] for _, w in named],
            shapes=[list(w.shape) for _, w in named], group_name=group))
        assert ok(eng.end_weight_update())
        assert sender.wait(timeout=120) == 0
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()


def ok(result: Any) -> bool:
    """Whether an Engine update call succeeded (`(success, message)` or an output with
    `success`)."""
    success = result[0] if isinstance(result, tuple) else getattr(result, "success", result)
    return bool(success)


def probe(model: torch.nn.Module, named_tensors: Any) -> None:
    """Runs in the scheduler (SGLang calls it as a custom loader): writes graphsafe's
    status on the model, its fingerprints (with each tensor's dtype and shape), whether
    MLA's `w_kc`/`w_vc` match `kv_b_proj`, and where they are, to the file
    `GRAPHSAFE_TEST_PROBE` names."""
    from graphsafe.integrations import sglang as gss

    a = gss.attachment(model)
    mla = hasattr(model.model.layers[0].self_attn, "kv_b_proj")
    report = {
        "attached": a is not None,
        "status": None if a is None else a.status(),
        "fingerprints": None if a is None else a.fingerprint(),
        "held": {n: [str(t.dtype).removeprefix("torch."), list(t.shape)]
                 for n, t in model.state_dict().items()},
        "mla_fresh": sm.mla_fresh(model) if mla else None,
        "mla_addresses": sm.mla_addresses(model) if mla else None,
        "addresses": {n: p.data_ptr() for n, p in model.named_parameters()},
    }
    Path(os.environ["GRAPHSAFE_TEST_PROBE"]).write_text(json.dumps(report))


def probed(eng: Any) -> dict[str, Any]:
    """What `probe` finds in the engine's scheduler now (through a session that loads
    nothing but the probe)."""
    out: Path = eng.graphsafe_probe_file
    if out.exists():
        out.unlink()
    update(eng, [("probe", torch.zeros(1))], PROBE)
    result: dict[str, Any] = json.loads(out.read_text())
    return result
