"""`graphsafe verify` in one process, and the oracle every refit is held to (the `--pp`
mode holds its refits to the same oracle, and shares the run's backend choice and
measures)."""
