"""The door of every attention call, and the vocabulary behind it.

- ``checks.py``    argument checks, each error naming the offending value and the fix;
- ``problem.py``   ``validate``: the arguments checked and classified into one ``Problem``;
- ``evaluate.py``  masks and scores evaluated over any region of the score grid (the one
                   place that calls a mask_mod or score_mod, or slices a mask or bias);
- ``dense.py``     a problem's mask and score as dense tensors (the reference, SDPA);
- ``tiles.py``     tile classification (empty / full / partial) of a mask;
- ``positions.py`` masks and scores at shifted positions (a KV cache's later queries);
- ``builtin_mods.py`` the built-in masks' and scores' classes (``qkv.masks`` and
                   ``qkv.scores`` make them);
- ``kinds.py``     ``MaskKind`` / ``ScoreKind``: every mask and score classified into one
                   tagged kind, combinations of built-ins simplified;
- ``kindspec.py``  kinds as a spec string plus tensors (for custom operators), and as the
                   tokens of a call's signature;
- ``tracing.py``   what qkv tells dynamo without importing it (``assume_constant_result``).
"""
