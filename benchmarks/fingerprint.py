"""Figure 13: what `gs.fingerprint` costs next to a copy of the same bytes.

`gs.fingerprint(obj) -> Mapping[str, str]` names the content of every tensor of `obj`;
it reads each byte once, so a copy of the same bytes (`dst.copy_(t)` into a buffer that
exists: read once, write once, no allocation) is the yardstick, at most 1.0. Each row
times `gs.fingerprint({"w": t})`, the copy and `t.clone()` (the copy with a fresh
allocation, in the details) of one float32 tensor of `fig13_bytes` (64 MiB; 4 MiB with
`--quick`), alternated in one run; the ratio is the median of the paired ratios (see
harness.py).

- 13a: the tensor in host memory (torch's CPU threads as `--threads` sets them).
- 13b: CUDA only: the tensor on the GPU.
- 13c, 13d: a weight sync's packing on the CPU, verified: the tensor copied into a
  staging buffer with its fingerprint taken as it is read (`Digests.add(t, into=...)`,
  what `send_weights` does for a packed entry), against the packing copy alone (what it
  does with `verify=False`); 13c the tensor contiguous, 13d a transposed view of it (its
  logical order is what is packed and digested). The details give, for the same
  tensor, the separate passes a packing without the fused kernel takes (a contiguous
  copy of a view, its fingerprint, the packing copy) against the same copy.

Where graphsafe has no `fingerprint` (an older version), the figure is one SKIP row
saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from figures import Ctx
from harness import Row, fmt_bytes, gbps, interleave, paired

import graphsafe as gs

__all__ = ["fig13"]


def _row(ctx: Ctx, fig: str, device: torch.device) -> Row:
    numel = ctx.sizes.fig13_bytes // 4
    t = torch.randn(numel, generator=torch.Generator().manual_seed(13)).to(device)
    # Not in every version of graphsafe (fig13 checks first).
    fingerprint: Callable[[Any], Mapping[str, str]] = getattr(gs, "fingerprint")  # noqa: B009
    first = fingerprint({"w": t})
    if not isinstance(first, Mapping) or set(first) != {"w"}:
        raise TypeError(f"gs.fingerprint({{'w': t}}) gave {type(first).__name__} "
                        f"{list(first)[:4] if isinstance(first, Mapping) else first!r:.80}, "
                        "not a mapping of 'w' to its fingerprint")
    dst = torch.empty_like(t)
    stats = interleave(
        {
            "fingerprint": ctx.timer(lambda: fingerprint({"w": t})),
            "copy": ctx.timer(lambda: dst.copy_(t)),
            "clone": ctx.timer(t.clone),
        },
        ctx.sizes.repeats,
    )
    f, c, cl = stats["fingerprint"], stats["copy"], stats["clone"]
    return Row(
        fig, f"gs.fingerprint of {fmt_bytes(t.nbytes)} on {device.type}", f.median, c.median,
        baseline_name="dst.copy_(t)", ratio=paired(f, c), ratio_def="fingerprint / copy",
        op="<=", target=1.0,
        details={
            "bytes": fmt_bytes(t.nbytes),
            "fingerprint_over_clone": round(paired(f, cl), 3),
            "fingerprint_read_bandwidth": gbps(t.nbytes, f.median),
            "copy_bandwidth": gbps(2 * t.nbytes, c.median),  # read + write
            "clone_bandwidth": gbps(2 * t.nbytes, cl.median),
            "fingerprint": str(first["w"])[:32],
            "same_twice": fingerprint({"w": t}) == first,
            "spread": [round(f.spread, 3), round(c.spread, 3), round(cl.spread, 3)],
        },
    )


def _packing_row(ctx: Ctx, fig: str, transposed: bool) -> Row:
    # What send_weights packs with; private, and in the versions with gs.fingerprint only.
    from graphsafe._fingerprint.digest import Digests

    numel = ctx.sizes.fig13_bytes // 4
    cols = 1024
    base = torch.randn(numel // cols, cols, generator=torch.Generator().manual_seed(13))
    t = base.t() if transposed else base
    slot = torch.empty(t.shape, dtype=t.dtype)

    def fused() -> None:
        Digests().add(t, "w", into=slot)

    def separate() -> None:  # the passes without the fused kernel
        digests = Digests()
        digests.add(t.contiguous(), "w")
        slot.copy_(t)

    fused()
    if not torch.equal(slot, t):
        raise AssertionError("the packing did not copy the tensor's logical values")
    same = gs.fingerprint({"w": t})["w"] == gs.fingerprint({"w": slot})["w"]
    stats = interleave(
        {
            "fused": ctx.timer(fused),
            "copy": ctx.timer(lambda: slot.copy_(t)),
            "separate": ctx.timer(separate),
        },
        ctx.sizes.repeats,
    )
    f, c, sep = stats["fused"], stats["copy"], stats["separate"]
    what = f"a transposed view [{cols}, {numel // cols}]" if transposed else "a contiguous"
    return Row(
        fig, f"packing {what} {fmt_bytes(t.nbytes)} float32 tensor with its fingerprint",
        f.median, c.median, baseline_name="slot.copy_(t) (verify=False)",
        ratio=paired(f, c), ratio_def="packing with fingerprint / packing copy",
        details={
            "bytes": fmt_bytes(t.nbytes),
            "separate_passes_over_copy": round(paired(sep, c), 3),
            "same_digest_as_the_packed_copy": same,
            "spread": [round(f.spread, 3), round(c.spread, 3), round(sep.spread, 3)],
        },
    )


def fig13(ctx: Ctx) -> list[Row]:
    """gs.fingerprint vs a clone, on the CPU, and on the GPU where the run is on one."""
    name = "gs.fingerprint vs t.clone()"
    if not hasattr(gs, "fingerprint"):
        return [Row("13", name, skipped=(
            f"graphsafe {gs.__version__} has no `fingerprint` "
            "(gs.fingerprint(obj) -> Mapping[str, str] is not in this version)"
        ))]
    rows = ctx.attempt("13a", f"{name}, cpu", lambda: _row(ctx, "13a", torch.device("cpu")))
    for fig, transposed in (("13c", False), ("13d", True)):
        rows += ctx.attempt(fig, "a verified sync's packing vs its copy",
                            lambda fig=fig, transposed=transposed: _packing_row(
                                ctx, fig, transposed))
    if ctx.device.type == "cuda":
        rows += ctx.attempt("13b", f"{name}, cuda", lambda: _row(ctx, "13b", ctx.device))
    elif ctx.wants("13b"):
        rows.append(Row("13b", f"{name}, cuda",
                        skipped="CUDA only: the tensor on the GPU (this run is on the CPU)"))
    return rows
