"""Transient inputs: checkpoint-format weights held only while a load writes them
(`transients`), and which of their elements a load defined (`coverage`, `regions`).
"""
