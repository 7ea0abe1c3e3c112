"""The door of every attention call, and the vocabulary behind it.

- ``checks.py``    argument checks, each error naming the offending value and the fix;
- ``problem.py``   ``validate``: the arguments checked and classified into one ``Problem``;
- ``evaluate.py``  masks and scores evaluated over any region of the score grid (the one
                   place that calls a mask_mod or score_mod, or slices a mask or bias);
- ``dense.py``     a problem's mask and score as dense tensors (the reference, SDPA);
- ``tiles.py``     tile classification (empty / full / partial) of a mask;
- ``positions.py`` masks and scores at shifted positions (a KV cache's later queries).

The kinds a mask or score is classified into are :mod:`qkv._kinds` (beside the built-in
masks and scores they know).
"""
