"""What graphsafe costs inside vLLM's engine: each case with and without it, in one engine.

Run it in the environment `scripts/test-vllm` makes (vLLM's CPU build):

    .venv-vllm/bin/python benchmarks/vllm_engine.py

It serves the tests' tiny random Llama (tests_vllm/), with their registry of derived
buffers on `QKVParallelLinear`, and alternates, in the same engine:

1. greedy generation of 8 tokens with graphsafe's step check (the guard before each
   `execute_model`) and without it;
2. `reload_weights` from an iterator as a graphsafe update and as vLLM alone does it
   (graphsafe detached for that call: no tracking, no refresh, no checks).

Both report the median of paired ratios (see harness.py). The per-step figure grows with
the number of pinned tensors (about 0.6 us each on this CPU, figure 5b of run.py); the
model here has 40.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests_vllm"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p
)
os.environ["GRAPHSAFE_VLLM_REGISTRIES"] = "vllm_derivations:registry"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "graphsafe")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path[:0] = [str(TESTS), str(HERE)]

import engine_util as eu  # noqa: E402
from harness import interleave, paired  # noqa: E402

from graphsafe.integrations import vllm as gsv  # noqa: E402


@contextlib.contextmanager
def detached(worker: Any) -> Iterator[None]:
    """graphsafe off for the body: vLLM's own methods, no attachment for the patches."""
    state = worker._graphsafe
    att = state.pop("model")
    model = att.model
    wrapped_load = model.__dict__.pop("load_weights")
    wrapped_reload = worker.__dict__.pop("reload_weights")
    gsv._ATTACHED.pop(model)
    try:
        yield
    finally:
        gsv._ATTACHED[model] = att
        worker.reload_weights = wrapped_reload
        model.load_weights = wrapped_load
        state["model"] = att


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        hf = {s: eu.hf_model(Path(tmp) / f"s{s}", s) for s in (0, 1)}
        llm = eu.engine(Path(tmp) / "s0")
        worker = llm.llm_engine.model_executor.driver_worker.worker
        att = worker._graphsafe["model"]
        guard = att.guard
        steps = [0]
        execute = worker.execute_model

        def counted(*a: Any, **k: Any) -> Any:
            steps[0] += 1
            return execute(*a, **k)

        worker.execute_model = counted

        def generate(on: bool) -> float:
            att.guard = guard if on else None
            t = time.perf_counter()
            eu.generate(llm)
            dt = time.perf_counter() - t
            att.guard = guard
            return dt

        weights = [eu.weights(hf[s]) for s in (0, 1)]
        turn = [0]

        def reload(on: bool) -> float:
            turn[0] ^= 1
            w = iter(weights[turn[0]])
            ctx = contextlib.nullcontext() if on else detached(worker)
            with ctx:
                t = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": w})
                dt = time.perf_counter() - t
            return dt

        steps[0] = 0
        gen = interleave(
            {"guarded": lambda: generate(True), "unguarded": lambda: generate(False)},
            args.repeats,
        )
        per_gen = steps[0] / (2 * (args.repeats + 1))
        upd = interleave(
            {"graphsafe": lambda: reload(True), "vllm": lambda: reload(False)}, args.repeats
        )
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights[0])})
        healthy = eu.generate(llm) == eu.hf_greedy(hf[0])
        pinned = len(guard.ledger.paths)
        llm.llm_engine.engine_core.shutdown()

    step_diff = (gen["guarded"].median - gen["unguarded"].median) / per_gen
    out = {
        "generate_ratio": paired(gen["guarded"], gen["unguarded"]),
        "generate_s": {k: v.median for k, v in gen.items()},
        "steps_per_generate": per_gen,
        "guard_us_per_step": step_diff * 1e6,
        "pinned_tensors": pinned,
        "reload_ratio": paired(upd["graphsafe"], upd["vllm"]),
        "reload_s": {k: v.median for k, v in upd.items()},
        "healthy_after": healthy,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"graphsafe in vLLM's engine (CPU build, tiny Llama, {pinned} pinned tensors, "
          f"{args.repeats} paired repeats)")
    print(f"  1. generate 8 tokens ({per_gen:.0f} steps): guarded / unguarded "
          f"{out['generate_ratio']:.3f}  ({gen['guarded'].median * 1e3:.1f} ms vs "
          f"{gen['unguarded'].median * 1e3:.1f} ms; about {out['guard_us_per_step']:.0f} us "
          "per step)")
    print(f"  2. reload_weights: graphsafe update / vLLM alone {out['reload_ratio']:.3f}  "
          f"({upd['graphsafe'].median * 1e3:.1f} ms vs {upd['vllm'].median * 1e3:.1f} ms)")
    print(f"  serving matches Hugging Face after the runs: {healthy}")


if __name__ == "__main__":
    main()
