"""Backends: each computes the same contract (see :mod:`qkv.reference`) a different way.

A backend is an object with ``name``, ``rejects(problem) -> str | None`` (why it cannot
compute this problem exactly, or ``None``), ``extra_memory(problem) -> int`` (bytes it needs
beyond inputs and output) and ``run(problem) -> (out, lse | None)``.
"""
