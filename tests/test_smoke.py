import functools

import torch

import qkv


def test_auto_matches_oracle_smoke(check):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 5)
    check(functools.partial(qkv.attention, return_lse=True), q, k, v, mask=qkv.causal)
    check(functools.partial(qkv.attention, backend="sdpa"), q, k, v, mask=qkv.causal)
