"""graphsafe verify: the end-to-end check, in one process or as a pipeline of processes."""
