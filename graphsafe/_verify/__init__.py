"""`graphsafe verify`: the end-to-end check, in one process or as a pipeline of processes.

A verify target (a model family) says how to build the model, make checkpoints and
inputs; the run does the rest the same way for every target: capture the forward with a
guarded graph, load new weights bucket by bucket, replay, and check that the replay
equals eager on the new weights. A control runs the same refits on the naive variant (a
fresh tensor bound on every load) and must show the stale read and the guard catching
it. `run_verify` runs it in one process, `run_verify_pp` as a trainer and pipeline stages.
"""

from graphsafe._verify.pp.pipeline import run_verify_pp
from graphsafe._verify.report.format import format_report
from graphsafe._verify.report.rows import (
    ControlRow,
    RefitRow,
    SyncRow,
    VerifyReport,
)
from graphsafe._verify.single.run import run_verify
from graphsafe._verify.target import (
    VerifyTarget,
    load_target,
)

# In the order of the API reference (docs/api.md renders by `__all__`).
__all__ = [
    "VerifyTarget",
    "RefitRow",
    "ControlRow",
    "SyncRow",
    "VerifyReport",
    "load_target",
    "run_verify",
    "run_verify_pp",
    "format_report",
]
