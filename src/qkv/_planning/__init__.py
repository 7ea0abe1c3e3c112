"""Planning apart from the tensors: a call's signature and the decisions kept by it.

- ``signature.py``: what a decision reads, as one hashable value (shapes, dtypes, devices,
  gradient flags, the mask and score as tokens, the scalars, the environment);
- :mod:`qkv.planner` decides from a problem and keeps the plan under its signature, so a
  repeat call of the same signature is not decided again.
"""
