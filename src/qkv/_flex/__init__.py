"""FlexAttention compatibility: its mod conventions and block masks, read as qkv's own.

- ``compat.py``    a mask_mod or score_mod written for FlexAttention's vmap convention,
                   detected and wrapped; FlexAttention ``BlockMask`` recognised;
- ``blockmask.py`` a FlexAttention ``BlockMask`` converted into a ``qkv.BlockMask``;
- ``plan.py``      what ``qkv.plan`` says about mods evaluated through vmap.
"""
