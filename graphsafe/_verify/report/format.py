"""How the verify report reads: an error quoted in one line, and the whole report as the
table `graphsafe verify` prints.

An error whose summary ends in a list (`4 pinned tensors moved after graph capture (4
drifts):` and one line per tensor) loses what it names when only its first line is kept;
`quote` keeps each item of the list, without the details indented under it.
"""

from __future__ import annotations

from graphsafe._errors import GraphSafetyError, one_line
from graphsafe._verify.report.rows import VerifyReport

__all__ = ["ORACLES", "format_report", "quote"]

ORACLES: dict[str, str] = {
    "fresh": "fresh model from the checkpoint",
    "self": "the model under test (its own eager forward, which reads the same derived "
    "state as the replay)",
}
"""How the report names each oracle."""

_LEGEND = (
    "(buckets: load calls; critical last: derivation inputs came last; refreshed: "
    "derivations recomputed; storage held: no tensor moved; replay-eager: the replay "
    "against the oracle's eager output, 0 is exact; a stale verdict names the tensors)"
)
_PP_LEGEND = (
    "(buckets: broadcasts of the sync; critical last: derivation inputs came last; "
    "refreshed: derivations recomputed on all stages; storage held: no tensor of any "
    "stage moved; replay-eager: last stage's replayed logits against the oracle's "
    "eager logits, on the trainer)"
)


def quote(exc: BaseException) -> str:
    """`exc` as `Type: summary` in one line, with every item its summary lists.

    Args:
        exc: The error.

    Returns:
        The class name and the summary; the items of a list in the summary (its lines
        indented by two spaces) follow the colon that introduces them, joined by `; `.

    Examples:
        >>> quote(GraphSafetyError("2 tensors moved:\\n  a.w (A): storage moved\\n"
        ...                        "    expected: 0x1\\n  b.w (B): storage moved", fix="f"))
        'GraphSafetyError: 2 tensors moved: a.w (A): storage moved; b.w (B): storage moved'
    """
    if not isinstance(exc, GraphSafetyError):
        return one_line(exc)
    head, *rest = exc.summary.strip().splitlines() or [""]
    # Items of the list sit two spaces in; what is indented deeper details one of them.
    items = [line.strip() for line in rest if line.startswith("  ") and line[2:3] != " "]
    if not items:
        return f"{type(exc).__name__}: {head}"
    return f"{type(exc).__name__}: {head} {'; '.join(items)}"


def format_report(report: VerifyReport) -> str:
    """The report as a readable table.

    Args:
        report: A verify report.

    Returns:
        Text for a terminal.
    """
    return "\n".join([*_refits(report), *_syncs(report), *_verdict(report)])


def _refits(report: VerifyReport) -> list[str]:
    graph = "real CUDA graphs" if report.backend == "cuda" else "the CPU graph"
    where = (f"a trainer and {report.pp} pipeline stage(s) over gloo, " if report.pp else "")
    lines = [
        f"graphsafe verify: {report.target} (preset {report.preset}) on {report.device}, "
        f"{where}{graph}, torch {report.torch_version}",
        _oracle(report),
        "",
        f"{'refit':>5}  {'buckets':>7}  {'critical last':>13}  {'refreshed':>9}  "
        f"{'storage held':>12}  {'max|replay-eager|':>17}  {'max|new-old|':>12}  verdict",
    ]
    for r in report.refits:
        lines.append(
            f"{r.refit:>5}  {r.buckets:>7}  {'yes' if r.critical_last else 'no':>13}  "
            f"{len(r.refreshed):>9}  {'yes' if r.storage_held else 'NO':>12}  "
            f"{r.max_abs_diff:>17.3e}  {r.weights_effect:>12.3e}  "
            + (r.verdict if r.error is None else f"{r.verdict}: {r.error}")
        )
    lines.append(_PP_LEGEND if report.pp else _LEGEND)
    return lines


def _oracle(report: VerifyReport) -> str:
    """Which oracle the replays were held to, and whether the audit ran, with their time."""
    where = ", on the trainer" if report.pp else ""
    unaudited = max((r.unaudited for r in report.refits), default=0)
    cannot = (f"; {unaudited} derived tensor(s) it cannot recompute, vouched for by the "
              "oracle alone" if unaudited else "")
    audit = (f"content audit after every refit{' on every stage' if report.pp else ''} "
             f"({report.audit_seconds:.2f} s in all{cannot})" if report.audit
             else "content audit: off")
    return (f"oracle: {ORACLES[report.oracle]}{where}, after every refit "
            f"({report.oracle_seconds:.2f} s in all); {audit}")


def _syncs(report: VerifyReport) -> list[str]:
    if not report.syncs:
        return []
    lines = [
        "",
        f"{'refit':>5}  {'stage':>5}  {'layers':>6}  {'accepted':>8}  {'MiB':>8}  "
        f"{'sync s':>8}  {'refresh s':>9}  {'refreshed':>9}  storage held",
    ]
    for y in report.syncs:
        lines.append(
            f"{y.refit:>5}  {y.stage:>5}  {y.layers:>6}  {y.accepted:>8}  "
            f"{y.bytes / 2**20:>8.2f}  {y.seconds:>8.4f}  {y.refresh_seconds:>9.4f}  "
            f"{len(y.refreshed):>9}  {'yes' if y.storage_held else 'NO'}"
            + (f"  error: {y.error}" if y.error else "")
        )
    return lines


def _verdict(report: VerifyReport) -> list[str]:
    c = report.control
    return [
        "",
        "control: naive variant (binds a fresh derived tensor on every load)",
        f"  unguarded replay after refit: max|replay-eager| = {c.unguarded_max_abs_diff:.3e}"
        f"  -> {'stale read reproduced' if c.stale_read else 'NOT reproduced'}",
        "  guarded replay after refit:   "
        + (f"refused ({c.guard_error})" if c.caught else "replayed stale memory: NOT caught"),
        "",
        *([f"guard checks: {report.guard}"] if report.guard else []),
        f"tolerance {report.tolerance:.0e}; "
        + ("PASS: every refit exact, control detected" if report.ok else _failed(report)),
    ]


def _failed(report: VerifyReport) -> str:
    """`FAIL`, naming the tensors a refit left stale."""
    stale = sorted({p for r in report.refits for p in r.stale})
    return f"FAIL: stale after a refit: {', '.join(stale)}" if stale else "FAIL"
