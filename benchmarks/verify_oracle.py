"""Figure 12: what `graphsafe verify`'s from-scratch oracle adds to each refit.

After each refit, verify now builds the target's model anew, loads the refit's
checkpoint into it, recomputes its derivations and runs it (the fresh oracle), compares
its parameters and derived buffers with the refitted model's, and audits the refitted
model (`gs.audit`); before, it ran the refitted model's own eager forward. Both are
timed on the flagship preset (`fig7_preset`: flash at full size), alternated in one run,
with the refit itself (bucketed load and guarded replay) to put them in proportion.

- 12a: the fresh oracle with the audit, against the model's own eager forward; the
  details split it (build, load and refresh, forward, comparison, audit) and give the
  time it adds to each refit.
- 12b: a whole verify refit with the fresh oracle and the audit, against the same refit
  with the self oracle (what `graphsafe verify --oracle self --no-audit` runs).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch
from figures import Ctx
from harness import Row, interleave, paired

from graphsafe._graphs.graph import Graph
from graphsafe._verify.single.oracle import audit_model, differing, fresh_model
from graphsafe._verify.single.run import _Run
from graphsafe._verify.target import Checkpoint
from graphsafe.models.deepseek_v4 import verify_target

__all__ = ["fig12"]


def fig12(ctx: Ctx) -> list[Row]:
    """The fresh oracle and the audit against the self oracle, per verify refit."""
    preset = ctx.sizes.fig7_preset
    device = ctx.device
    run = _Run(verify_target, preset, device, 0, random.Random(0), lambda line: None)
    parts: dict[str, list[float]] = {"build_load_refresh": [], "forward": [], "compare": []}
    with torch.no_grad():
        model, x = run.build(naive=False)
        graph = Graph(backend="cuda" if device.type == "cuda" else "cpu", guard=model)
        with graph.capture(warmup=lambda: model(*x)):
            model(*x)
        held: list[Checkpoint] = []  # the checkpoint the model holds now
        k = [0]

        def refit() -> float:
            """A verify refit without its checks: a new checkpoint in buckets, replay."""
            ctx.clock.sync()
            t0 = time.perf_counter()
            ck, _ = run.refit(model, k[0], critical_last=k[0] == 0)
            graph.replay()
            ctx.clock.sync()
            k[0] += 1
            held[:] = [ck]
            return time.perf_counter() - t0

        def fresh() -> float:
            """The fresh oracle: build, load, refresh, run, compare."""
            ctx.clock.sync()
            t0 = time.perf_counter()
            oracle = fresh_model(verify_target, preset, device, held[0])
            ctx.clock.sync()
            t1 = time.perf_counter()
            oracle(*x)
            ctx.clock.sync()
            t2 = time.perf_counter()
            assert differing(model, oracle, verify_target.name) is None
            t3 = time.perf_counter()
            for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[name].append(dt)
            return t3 - t0

        stats: dict[str, Any] = interleave(
            {
                "refit": refit,
                "fresh": fresh,
                "audit": lambda: audit_model(model).seconds,
                "self": ctx.timer(lambda: model(*x)),
            },
            ctx.sizes.repeats,
        )
    refit_s, fresh_s, audit_s, self_s = (stats[n] for n in ("refit", "fresh", "audit", "self"))
    checks = [f + a for f, a in zip(fresh_s.samples, audit_s.samples)]
    after = [r + c for r, c in zip(refit_s.samples, checks)]
    before = [r + s for r, s in zip(refit_s.samples, self_s.samples)]
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return [
        Row(
            "12a", f"verify's fresh oracle + audit per refit ({preset})",
            statistics.median(checks), self_s.median,
            baseline_name="the model's own eager forward",
            ratio=paired(checks, self_s), ratio_def="(fresh + audit) / self",
            details={
                "added_s_per_refit": round(_paired_diff(checks, self_s.samples), 4),
                **{f"{n}_s": round(statistics.median(v), 4) for n, v in parts.items()},
                "audit_s": round(audit_s.median, 4),
                "weights_mib": round(mib, 1),
                "spread": [round(fresh_s.spread, 3), round(self_s.spread, 3)],
            },
        ),
        Row(
            "12b", f"a verify refit with the fresh oracle + audit ({preset})",
            statistics.median(after), statistics.median(before),
            baseline_name="the same refit, --oracle self --no-audit",
            ratio=paired(after, before), ratio_def="after / before",
            details={"refit_without_checks_s": round(refit_s.median, 4),
                     "added_s": round(_paired_diff(after, before), 4)},
        ),
    ]


def _paired_diff(a: list[float], b: list[float]) -> float:
    """The median over repeats of `a_i - b_i` (see `harness.paired`)."""
    return statistics.median(x - y for x, y in zip(a, b))
