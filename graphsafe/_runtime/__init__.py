"""Keeping one model's derived buffers correct, in sub-stages that each import only the
ones before them: `bind` (what each derivation reads, resolved on module instances; where
every storage of the model is), `transient` (checkpoint-format inputs held only while a
load writes them), `writes` (the ways writes are seen: a load's tracker, the process-wide
observer, the witnesses), `refresh` (what is stale and recomputing it: the engine, and
the binder that keeps the engine of the model's current tree), `loads` (a load from its
beginning to its end), then the runtime itself (`runtime`, `freshness`, `decorator`,
`load_into`)."""
