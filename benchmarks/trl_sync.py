"""What graphsafe costs in TRL's weight sync into its colocated vLLM engine, side by side.

Run it in the environment `scripts/test-vllm` makes (vLLM's CPU build, TRL):

    .venv-vllm/bin/python benchmarks/trl_sync.py

It builds TRL's `GRPOTrainer` (vLLM colocated, float32, op by op) on a random Llama of
about 60M parameters, with graphsafe on in one line (`gs_trl.enable`, the fused-QKV
registry of tests_vllm/), and alternates, in the same engine, TRL's own
`VLLMGeneration.sync_weights` (one `load_weights([(name, p)])` per parameter):

1. as graphsafe runs it: one weight update per sync, one refresh at its end;
2. with graphsafe detached (vLLM's own `load_weights`, no attachment: no tracking, no
   refresh, no checks);
3. with graphsafe attached but TRL's sync unwrapped: each call an update of its own.

The write tracker of graphsafe's updates is the compiled one, as users get it (built by
the first use where a C++ compiler is, or by `graphsafe native build`), else the Python
one (`GRAPHSAFE_NATIVE=0`, slower per op); the output says which. It reports the median
of paired ratios (harness.py), and how many refreshes each sync ran (a refresh: a new
refresh report of the model's runtime that recomputed at least one derived buffer).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "graphsafe")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(TESTS), str(HERE)]

import trl_util as tu  # noqa: E402
from harness import interleave, paired  # noqa: E402

from graphsafe import _native  # noqa: E402
from graphsafe.integrations import trl as gs_trl  # noqa: E402
from graphsafe.integrations import vllm as gsv  # noqa: E402

# About 60M parameters: the embedding and LM head 16.4M each, 8 layers of 3.4M.
SIZE = {
    "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 8, "intermediate_size": 1536, "vocab_size": 32000,
}


@contextlib.contextmanager
def detached(worker: Any) -> Iterator[None]:
    """graphsafe off for the body: vLLM's own `load_weights`, no attachment."""
    state = worker._graphsafe
    att = state.pop("model")
    model = att.model
    wrapped_load = model.__dict__.pop("load_weights")
    gsv._ATTACHED.pop(model)
    try:
        yield
    finally:
        gsv._ATTACHED[model] = att
        model.load_weights = wrapped_load
        state["model"] = att


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile one graphsafe sync")
    args = ap.parse_args()

    from trl.generation.vllm_generation import VLLMGeneration

    assert gs_trl.enable("vllm_derivations:registry")
    restore = tu.float32_engine(enforce_eager=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = tu.model_dir(Path(tmp) / "model", **SIZE)
        trainer = tu.trainer(path, Path(tmp) / "out", steps=1)
        restore()
        generation = trainer.vllm_generation
        n_params = sum(p.numel() for p in generation.model.parameters())
        worker = generation.llm.llm_engine.model_executor.driver_worker.worker
        att = worker._graphsafe["model"]
        rt = att.runtime
        engine_model = att.model
        wrapped = VLLMGeneration.sync_weights
        unwrapped = wrapped.__wrapped__
        refreshes: list[int] = []
        load = engine_model.load_weights

        def refreshed(before: Any) -> bool:
            now = rt.last_report
            return now is not None and now is not before and bool(now.refreshed)

        def counting(weights: Any) -> Any:
            before = rt.last_report
            done = load(weights)
            refreshes[-1] += refreshed(before)
            return done

        def sync(how: str) -> float:
            refreshes.append(0)
            before = rt.last_report
            fn = unwrapped if how != "graphsafe" else wrapped
            ctx = detached(worker) if how == "detached" else contextlib.nullcontext()
            with ctx:
                if how != "detached":
                    engine_model.load_weights = counting
                t = time.perf_counter()
                fn(generation)
                dt = time.perf_counter() - t
                if how != "detached":
                    engine_model.load_weights = load
            if how == "graphsafe":
                refreshes[-1] += refreshed(before)  # the one at the update's end
                report = rt.last_report
                refresh_s.append(report.seconds if refreshed(before) and report else 0.0)
            counts[how].append(refreshes[-1])
            return dt

        counts: dict[str, list[int]] = {"graphsafe": [], "detached": [], "per_call": []}
        refresh_s: list[float] = []
        if args.profile:
            import cProfile
            import pstats

            sync("graphsafe")
            with cProfile.Profile() as prof:
                sync("graphsafe")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
            return
        stats = interleave(
            {k: (lambda k=k: sync(k)) for k in counts}, args.repeats,
        )
        stale = list(att.status()["stale"])
        k = len(stats["detached"].samples)
        own = [g - r for g, r in zip(stats["graphsafe"].samples[-k:], refresh_s[-k:])]
        del trainer
        gc.collect()

    out = {
        "parameters": n_params,
        # The write tracker of graphsafe's updates: compiled (built on first use) or Python.
        "tracker": "compiled" if _native.get() is not None else "python",
        "sync_ratio": paired(stats["graphsafe"], stats["detached"]),
        "sync_ratio_without_refresh": paired(own, stats["detached"]),
        "refresh_s": sorted(refresh_s)[len(refresh_s) // 2],
        "per_call_ratio": paired(stats["per_call"], stats["detached"]),
        "sync_s": {k: v.median for k, v in stats.items()},
        "refreshes_per_sync": sorted(counts["graphsafe"])[len(counts["graphsafe"]) // 2],
        "refreshes_per_sync_unwrapped": sorted(counts["per_call"])[len(counts["per_call"]) // 2],
        "stale_after": stale,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"TRL's colocated sync, vLLM CPU build, random Llama of {n_params / 1e6:.1f}M "
          f"parameters, {args.repeats} paired repeats, {out['tracker']} write tracker")
    print(f"  1. one graphsafe update per sync / graphsafe detached: {out['sync_ratio']:.3f}  "
          f"({stats['graphsafe'].median * 1e3:.1f} ms vs "
          f"{stats['detached'].median * 1e3:.1f} ms); refreshes per sync: "
          f"{out['refreshes_per_sync']}")
    print(f"     of which the refresh itself (the fused QKV buffers of {SIZE['num_hidden_layers']} "
          f"layers recomputed) {out['refresh_s'] * 1e3:.1f} ms; graphsafe's tracking and "
          f"checks alone: {out['sync_ratio_without_refresh']:.3f}")
    print(f"  2. unwrapped, one update per parameter / detached: {out['per_call_ratio']:.3f}  "
          f"({stats['per_call'].median * 1e3:.1f} ms); refreshes per sync: "
          f"{out['refreshes_per_sync_unwrapped']}")
    print(f"  stale after the runs: {stale}")


if __name__ == "__main__":
    main()
