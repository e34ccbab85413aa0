"""`GraphsafeCallback`: graphsafe's record of each TRL weight sync, into TRL's logs."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from graphsafe.integrations.trl._sync import SyncRecord, syncs

PREFIX = "graphsafe/"
"""The prefix of the metrics the callback logs."""


class GraphsafeCallback(TrainerCallback):
    """Puts what graphsafe did at each weight sync into the trainer's logs.

    At the end of every step, each sync into the colocated vLLM engine since the last
    step adds `graphsafe/updates`, `graphsafe/refreshed`, `graphsafe/stale` (how many
    tensors were stale after it), `graphsafe/sync_seconds`,
    `graphsafe/fingerprints_compared` (the policy's parameters compared with the
    engine's after the sync, where the names and shapes match) and
    `graphsafe/fingerprint_mismatches` (how many of those the engine does not serve bit
    for bit) to the metrics the trainer logs next, as TRL's own timings reach them
    (`trainer._metrics`). `records` keeps every
    sync's `SyncRecord`. `gs_trl.enable()` adds one to every `GRPOTrainer` that uses vLLM.

    Args:
        trainer: The trainer (TRL's `GRPOTrainer`), as TRL's `LogCompletionsCallback`
            takes it.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.records: list[SyncRecord] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        generation = getattr(self.trainer, "vllm_generation", None)
        if generation is None:
            return control
        new = syncs(generation)[len(self.records):]
        self.records.extend(new)
        metrics = getattr(self.trainer, "_metrics", None)
        train = metrics.get("train") if isinstance(metrics, dict) else None
        if train is not None:
            for r in new:
                for key, value in (
                    ("updates", float(r.updates)),
                    ("refreshed", float(r.refreshed)),
                    ("stale", float(len(r.stale))),
                    ("sync_seconds", r.seconds),
                    ("fingerprints_compared", float(r.fingerprints_compared)),
                    ("fingerprint_mismatches", float(len(r.fingerprint_mismatches))),
                ):
                    train[PREFIX + key].append(value)
        return control
