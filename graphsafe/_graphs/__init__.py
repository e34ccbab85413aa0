"""Graphs and their guard: capture, replay (CUDA or the CPU graph) and the checks before it."""
