"""The vocabulary every attention call is read in: the bottom layer, importing nothing of qkv
above it (the door that fills it is :mod:`qkv._door`).

- ``checks.py``    argument checks, each error naming the offending value and the fix;
- ``problem.py``   ``Problem``: one call's tensors as 4-D views, its mask and score classified;
- ``evaluate.py``  masks and scores evaluated over any region of the score grid (the one
                   place that calls a mask_mod or score_mod, or slices a mask or bias);
- ``dense.py``     a problem's mask and score as dense tensors (the reference, SDPA);
- ``tiles.py``     tile classification (empty / full / partial) of a mask;
- ``builtin_mods.py`` the built-in masks' classes (``qkv.masks`` makes them), each
                   carrying its formula, value, tile rule, terms and spec;
- ``combinations.py`` ``and_masks`` / ``or_masks`` as classes of their own;
- ``builtin_scores.py`` the built-in scores' classes (``qkv.scores`` makes them);
- ``terms.py``     a mask as the terms kernels read (band, prefix, key range, ids, rest);
- ``spec.py``      spec strings for custom operators, and the registry that reads them back;
- ``usermod.py``   a user's mod as qkv calls it (the base of FlexAttention's wrapper);
- ``kinds.py``     ``MaskKind`` / ``ScoreKind``: every mask and score classified once into
                   its value and terms, combinations of built-ins simplified;
- ``kindspec.py``  kinds as specs (for custom operators), and as the tokens of a call's
                   signature;
- ``tracing.py``   what qkv tells dynamo without importing it (``assume_constant_result``).
"""
