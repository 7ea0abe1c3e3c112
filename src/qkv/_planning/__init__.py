"""Planning apart from the tensors: a call's signature and the decisions kept by it.

- ``signature.py``: what a decision reads, as one hashable value (shapes, dtypes, devices,
  gradient flags, the mask and score as tokens, the scalars, the environment);
- ``kept.py``: the plans kept under their signatures, so a repeat call of a signature is not
  decided again (:func:`qkv.planner.decide` looks there first);
- ``about.py``: what :func:`qkv.plan` shows of a call beyond its decision.
"""
