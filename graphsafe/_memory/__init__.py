"""What a model holds and what was written to it: the walk, snapshots, the ledger, the journal."""
