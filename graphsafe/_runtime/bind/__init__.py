"""Derivations bound to module instances: what each reads, through which holder, in which
order (`binding`, `inputs`); where every storage of the model is (`model_map`).
"""
