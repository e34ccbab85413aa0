"""Kernel-format weights: the FP8 block-quantize refresh, and the memory of an FP8 refit.

    python benchmarks/kernel_formats.py [--json] [--quick] [--threads N]

Prints one table in the style of `run.py`: graphsafe beside its baseline, measured in
the same run, their ratio, the target and pass/MISS; the absolute numbers follow under
the table. The exit status is 0 whatever the figures say. `--quick` is a smoke run with
tiny sizes: its numbers mean nothing.

- 8a, 8b: `gs.runtime(m).refresh()` of one `recipes.fp8_quantize(block=(128, 128))`
  derivation over a 4096 x 4096 bf16 (8a) or fp32 (8b) weight, written into its `out=`
  buffers, vs `reference_fp8`: the obvious plain-torch recipe (pad into blocks, amax,
  scale, clamp, cast). Target: refresh / reference <= 1.
- 8c, 8d: the peak memory of a bucketed refit (one bucket per layer, in a
  `gs.weight_update`) of an FP8 Llama from an fp32 checkpoint: with transient
  checkpoint-format projections (8c), against the bound `kernel-format weights + one
  layer's checkpoint-format projections + one bucket + the quantizer's float32 scratch
  (one row of blocks)`, all computed from the config; and beside it the same model
  keeping its projections resident (8d).

How the peak is measured (CPU): what the model holds when the refit starts (the bytes of
its parameters' and buffers' storages that are not on the meta device, each storage
once), plus the peak extra bytes during the refit from the CPU allocator's own events,
recorded by `torch.profiler` with `profile_memory=True` (`harness.peak_extra_bytes`):
every allocation and free in time order, temporaries inside ops included, whatever holds
them. Each bucket is cloned inside the measured refit, as a received bucket would be
allocated, and dropped after its load.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import (
    Clock,
    Row,
    add_machine_args,
    fmt_bytes,
    gbps,
    interleave,
    machine,
    paired,
    peak_extra_bytes,
)
from run import emit
from torch import Tensor, nn

import graphsafe as gs
from graphsafe import recipes
from graphsafe.models.llama import LlamaConfig, LlamaForCausalLM, random_checkpoint

__all__ = ["bounds", "fp8_rows", "main", "memory_rows", "reference_fp8"]

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn


def reference_fp8(w: Tensor, block: tuple[int, int] = BLOCK) -> tuple[Tensor, Tensor]:
    """Plain torch: FP8 weight and `weight_scale_inv` per block, the obvious way.

    Args:
        w: `[M, N]` weight, any float dtype.
        block: `(bm, bn)`.

    Returns:
        `(weight_q [M, N], scale_inv [ceil(M / bm), ceil(N / bn)])`.
    """
    fmax = torch.finfo(FP8).max
    (M, N), (bm, bn) = w.shape, block
    Mb, Nb = math.ceil(M / bm), math.ceil(N / bn)
    padded = torch.zeros(Mb * bm, Nb * bn, dtype=torch.float32, device=w.device)
    padded[:M, :N] = w
    blocks = padded.view(Mb, bm, Nb, bn)  # [Mb, bm, Nb, bn]
    scale = blocks.abs().amax(dim=(1, 3)) / fmax  # [Mb, Nb]
    scale = torch.where(scale > 0, scale, 1 / fmax)
    q = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).to(FP8)
    return q.view(Mb * bm, Nb * bn)[:M, :N].contiguous(), scale


def _fp8_linear(reg: gs.Registry, w: Tensor) -> nn.Module:
    """One weight and its FP8 kernel format, the way a graphsafe user declares it."""

    @gs.graphsafe(registry=reg)
    class FP8Linear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(w, requires_grad=False)

        _quantize = recipes.derive(("weight_q", "scale_inv"), inputs=["weight"],
                                   fn=recipes.fp8_quantize(block=BLOCK))

    return FP8Linear()


def fp8_rows(device: torch.device, size: int, repeats: int) -> list[Row]:
    """Rows 8a and 8b: the refresh of the FP8 recipe vs the plain-torch reference."""
    clock = Clock(device)
    rows = []
    for fig, dtype in (("8a", torch.bfloat16), ("8b", torch.float32)):
        w = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
        w = w.to(device=device, dtype=dtype)
        reg = gs.Registry()
        m = _fp8_linear(reg, w)
        rt = gs.runtime(m, reg)
        rt.refresh()  # materialize
        want_q, want_s = reference_fp8(w)
        exact = torch.equal(m.weight_q.view(torch.uint8), want_q.view(torch.uint8)) and \
            torch.equal(m.scale_inv, want_s)
        stats = interleave(
            {"refresh": lambda rt=rt: clock.time(rt.refresh),
             "reference": lambda w=w: clock.time(lambda: reference_fp8(w))},
            repeats,
        )
        g, ref = stats["refresh"], stats["reference"]
        traffic = w.nbytes + m.weight_q.nbytes + m.scale_inv.nbytes
        rows.append(Row(
            fig, f"fp8_quantize{BLOCK} refresh, {size}x{size} {str(dtype)[6:]}", g.median,
            ref.median, baseline_name="plain-torch reference", ratio=paired(g, ref),
            ratio_def="refresh / reference", op="<=", target=1.0,
            details={
                "bit_exact_vs_reference": exact,
                "refresh": gbps(traffic, g.median),
                "reference": gbps(traffic, ref.median),
                "spread": [round(g.spread, 3), round(ref.spread, 3)],
            },
        ))
    return rows


def llama_config(quick: bool, transient: bool) -> LlamaConfig:
    """The FP8 Llama of rows 8c and 8d (hidden 1024, 8 layers, GQA 16/4 heads of 64)."""
    if quick:
        sizes: dict[str, Any] = {"vocab_size": 256, "hidden_size": 256,
                                 "intermediate_size": 512, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 64}
    else:
        sizes = {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816,
                 "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
                 "head_dim": 64}
    return LlamaConfig(**sizes, fp8=True, fp8_block=BLOCK, transient=transient)


def bounds(c: LlamaConfig) -> dict[str, int]:
    """Bytes, from the config alone: the kernel-format weights (everything the transient
    model holds between updates), one layer's checkpoint-format projections (fp32), the
    largest bucket (fp32), and the quantizer's scratch (one row of blocks, float32, with
    its block maxima)."""
    assert c.fp8_block is not None
    (bm, bn), f32 = c.fp8_block, 4
    C, inner, V, D = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    HD, KVD = c.num_attention_heads * D, c.num_key_value_heads * D
    shapes = [(HD + 2 * KVD, C), (C, HD), (2 * inner, C), (C, inner)]  # qkv, o, gate_up, down

    def fp8(M: int, N: int) -> int:  # weight_q (1 byte each) + float32 block scales
        return M * N + math.ceil(M / bm) * math.ceil(N / bn) * f32

    norms = 2 * C * f32
    layer_kernel = sum(fp8(M, N) for M, N in shapes) + norms
    heads = (1 if c.tie_word_embeddings else 2) * V * C * f32
    kernel = c.num_hidden_layers * layer_kernel + heads + C * f32 + D // 2 * f32  # + inv_freq
    layer_ckpt = (HD + 2 * KVD + HD + 3 * inner) * C * f32
    bucket = max(layer_ckpt + norms, heads + C * f32)
    # One row of blocks of float32, and its column-block maxima (amax, amin, maximum).
    widest = max(N for _, N in shapes)
    scratch = (bm * widest + 3 * math.ceil(widest / bn)) * f32
    return {"kernel": kernel, "layer": layer_ckpt, "bucket": bucket, "scratch": scratch}


def _held_bytes(model: nn.Module) -> int:
    """Bytes of the model's storages that hold memory (not on meta), each counted once."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _refit_peak(config: LlamaConfig, device: torch.device) -> dict[str, int]:
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.load_weights(random_checkpoint(config, 0, device=device))
    ck = random_checkpoint(config, 1, device=device)
    buckets = [[e for e in ck if not e[0].startswith("model.layers.")]]
    buckets += [[e for e in ck if e[0].startswith(f"model.layers.{i}.")]
                for i in range(config.num_hidden_layers)]

    def refit() -> None:
        with gs.weight_update(model):
            for bucket in buckets:
                received = [(n, w.clone()) for n, w in bucket]  # the bucket as it arrives
                model.load_weights(received)
                del received

    refit()  # one-time allocations out of the way
    held = _held_bytes(model)
    extra = peak_extra_bytes(refit, device)
    return {"held": held, "extra": extra, "peak": held + extra}


def memory_rows(device: torch.device, quick: bool) -> list[Row]:
    """Rows 8c and 8d: peak memory of the bucketed FP8 refit, transient vs resident."""
    c = llama_config(quick, transient=True)
    b = bounds(c)
    three = b["kernel"] + b["layer"] + b["bucket"]
    bound = three + b["scratch"]
    t = _refit_peak(c, device)
    r = _refit_peak(llama_config(quick, transient=False), device)
    sizes = (f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, inter "
             f"{c.intermediate_size}, vocab {c.vocab_size}")
    how = ("cuda.max_memory_allocated" if device.type == "cuda"
           else "held storages + torch.profiler allocator events (running sum)")
    return [
        Row(
            "8c", f"peak memory, bucketed FP8 refit, transient ({sizes})", t["peak"], bound,
            unit="B", baseline_name="kernel + layer + bucket + scratch",
            ratio=t["peak"] / bound, ratio_def="peak / bound", op="<=", target=1.0,
            details={
                "kernel_format": fmt_bytes(b["kernel"]),
                "one_layer_checkpoint": fmt_bytes(b["layer"]),
                "one_bucket": fmt_bytes(b["bucket"]),
                "quantize_scratch": fmt_bytes(b["scratch"]),
                "peak_minus_bound_bytes": t["peak"] - bound,
                "peak_over_kernel_layer_bucket": round(t["peak"] / three, 4),
                "peak_minus_kernel_layer_bucket": fmt_bytes(t["peak"] - three),
                "held_between_updates": fmt_bytes(t["held"]),
                "held_is_kernel_format": t["held"] == b["kernel"],
                "peak_above_held": fmt_bytes(t["extra"]),
                "how": how,
            },
        ),
        Row(
            "8d", "peak memory, the same refit, resident projections", r["peak"], t["peak"],
            unit="B", baseline_name="8c (transient)", ratio=r["peak"] / t["peak"],
            ratio_def="resident / transient",
            details={
                "held_between_updates": fmt_bytes(r["held"]),
                "peak_above_held": fmt_bytes(r["extra"]),
                "all_checkpoint_projections": fmt_bytes(b["layer"] * c.num_hidden_layers),
            },
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    """Parse the options, measure, print the table or the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only, on stdout")
    add_machine_args(parser, device=False)
    args = parser.parse_args(argv)
    device = machine(args, parser)
    repeats = 3 if args.quick else 15
    rows = fp8_rows(device, 256 if args.quick else 4096, repeats)
    rows += memory_rows(device, args.quick)
    meta = {"device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
            "mode": "quick" if args.quick else "full", "repeats": repeats}
    emit(rows, meta, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
