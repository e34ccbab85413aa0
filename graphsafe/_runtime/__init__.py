"""Keeping one model's derived buffers correct: binding, the engine, loads, the runtime."""
