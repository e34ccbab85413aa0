"""What is stale and recomputing it: the engine of one binding (`engine`), the checked and
first runs of a derivation (`materialize`), the checks of its results (`checks`), and
the binder that keeps the engine of the model's current tree (`binder`).
"""
