"""KV caches: decoding in chunks equals one pass over the whole sequence."""

from __future__ import annotations

import pytest
import torch

import qkv

Tensor = torch.Tensor

L = 23
CHUNKINGS = {
    "one-pass": [L],
    "tokens": [1] * L,
    "prefill+tokens": [9] + [1] * (L - 9),
    "ragged": [3, 1, 5, 2, 1, 7, 4],
    "big-chunks": [11, 12],
}


def _decode(mha, x, cache, chunks, **kw) -> Tensor:
    outs, i = [], 0
    for c in chunks:
        outs.append(mha(x[:, i : i + c], cache=cache, **kw))
        i += c
    assert i == x.shape[1]
    return torch.cat(outs, dim=1)  # [B, L, d_model]


def _module(gqa: bool, rope: bool) -> qkv.MultiHeadAttention:
    torch.manual_seed(0)
    return qkv.MultiHeadAttention(
        48, 6, n_kv_heads=2 if gqa else None, rope=rope, bias=True, qk_norm=gqa
    ).eval()


@pytest.mark.parametrize("chunks", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
def test_full_cache_equals_causal_pass(chunks, gqa, rope):
    mha = _module(gqa, rope)
    x = torch.randn(2, L, 48)
    with torch.no_grad():
        full = mha(x, mask=qkv.causal)
        cache = qkv.KVCache(max_len=32)
        steps = _decode(mha, x, cache, chunks, mask=qkv.causal)
    assert cache.length == L
    assert float((steps - full).abs().max()) <= 1e-5


@pytest.mark.parametrize("window", [1, 4, 7, 30])
@pytest.mark.parametrize("chunks", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
@pytest.mark.parametrize("gqa,rope", [(False, False), (True, True)], ids=["mha", "gqa-rope"])
def test_sliding_window_cache_equals_windowed_pass(window, chunks, gqa, rope):
    mha = _module(gqa, rope)
    x = torch.randn(2, L, 48)
    with torch.no_grad():
        full = mha(x, mask=qkv.sliding_window(window - 1))
        for mask in (None, qkv.causal, qkv.sliding_window(window - 1)):
            cache = qkv.SlidingWindowCache(window)
            steps = _decode(mha, x, cache, chunks, mask=mask)
            assert float((steps - full).abs().max()) <= 1e-5, mask
    assert cache._k is not None and cache._k.shape[2] == window  # memory of `window` tokens


@pytest.mark.parametrize("chunks", ["ragged", "tokens"])
@pytest.mark.parametrize("make_cache", [lambda: qkv.KVCache(40), lambda: qkv.SlidingWindowCache(6)])
def test_mask_and_score_mods_see_absolute_positions(make_cache, chunks):
    """A user mask_mod (here a document mask) and score_mod (ALiBi) give the full pass's
    result when evaluated through the cache."""
    mha = _module(gqa=True, rope=True)
    x = torch.randn(1, L, 48)
    doc = torch.tensor([0] * 5 + [1] * 10 + [2] * 8)
    cache = make_cache()
    window = getattr(cache, "window", L)
    mask = qkv.and_masks(
        qkv.sliding_window(window - 1), lambda b, h, q, k: doc[q] == doc[k]
    )  # the full pass's mask, restricted to the ring's window when there is one
    sm = qkv.alibi(qkv.alibi_slopes(6))
    with torch.no_grad():
        full = mha(x, mask=mask, score_mod=sm)
        user = qkv.and_masks(qkv.causal, lambda b, h, q, k: doc[q] == doc[k])
        steps = _decode(mha, x, cache, CHUNKINGS[chunks], mask=user, score_mod=sm)
    assert float((steps - full).abs().max()) <= 1e-5


def test_need_weights_under_cache_are_the_full_rows():
    mha = _module(gqa=True, rope=True)
    x = torch.randn(1, 12, 48)
    with torch.no_grad():
        _, w_full = mha(x, mask=qkv.causal, need_weights=True)
        cache = qkv.KVCache(16)
        mha(x[:, :7], cache=cache, mask=qkv.causal)
        _, w = mha(x[:, 7:10], cache=cache, mask=qkv.causal, need_weights=True)
        assert w.shape == (1, 6, 3, 10)
        assert float((w - w_full[:, :, 7:10, :10]).abs().max()) < 1e-6
        ring = qkv.SlidingWindowCache(4)
        _, w_full = mha(x, mask=qkv.sliding_window(3), need_weights=True)
        mha(x[:, :9], cache=ring)
        _, w = mha(x[:, 9:10], cache=ring, need_weights=True)
        # columns: the 4 cached positions 5..8, then the new one (9), oldest first
        assert w.shape == (1, 6, 1, 5)
        assert float((w - w_full[:, :, 9:10, 5:10]).abs().max()) < 1e-6


def test_gradients_through_the_cache_equal_the_full_pass():
    """With autograd on, cache writes are out of place so every step's keys keep their graph."""
    mha = _module(gqa=True, rope=True)
    x = torch.randn(1, 10, 48)
    do = torch.randn(1, 10, 48)
    for cache in (qkv.KVCache(10), qkv.SlidingWindowCache(3)):
        mask = qkv.causal if isinstance(cache, qkv.KVCache) else qkv.sliding_window(2)
        mha.zero_grad()
        (mha(x, mask=mask) * do).sum().backward()
        want = [p.grad.clone() for p in mha.parameters()]
        mha.zero_grad()
        (_decode(mha, x, cache, [4, 1, 1, 3, 1], mask=mask) * do).sum().backward()
        for p, g in zip(mha.parameters(), want, strict=True):
            assert float((p.grad - g).abs().max()) < 1e-5


def test_decoding_writes_in_place_without_reallocation():
    mha = _module(gqa=True, rope=True)
    x = torch.randn(1, 20, 48)
    for cache in (qkv.KVCache(20), qkv.SlidingWindowCache(5)):
        with torch.no_grad():
            mha(x[:, :8], cache=cache, mask=qkv.causal)
            assert cache._k is not None
            ptr = (cache._k.data_ptr(), cache._v.data_ptr())
            for i in range(8, 20):
                mha(x[:, i : i + 1], cache=cache, mask=qkv.causal)
                assert (cache._k.data_ptr(), cache._v.data_ptr()) == ptr


def test_overflow_is_refused_before_anything_changes():
    mha = _module(gqa=False, rope=True)
    x = torch.randn(1, 10, 48)
    cache = qkv.KVCache(max_len=8)
    with torch.no_grad():
        mha(x[:, :6], cache=cache, mask=qkv.causal)
        with pytest.raises(ValueError, match=r"holds 6 of max_len=8.*3 more would need 9"):
            mha(x[:, 6:9], cache=cache, mask=qkv.causal)
        assert cache.length == 6
        mha(x[:, 6:8], cache=cache, mask=qkv.causal)  # what fits still works
    assert cache.length == 8


def test_reset_and_reuse():
    mha = _module(gqa=True, rope=True)
    a, b = torch.randn(2, 12, 48), torch.randn(1, 9, 48)
    cache = qkv.KVCache(16)
    with torch.no_grad():
        _decode(mha, a, cache, [5, 7], mask=qkv.causal)
        with pytest.raises(ValueError, match=r"batch size 2.*batch size 1.*reset"):
            mha(b[:, :1], cache=cache, mask=qkv.causal)
        cache.reset()
        assert cache.length == 0
        steps = _decode(mha, b, cache, [2, 1, 6], mask=qkv.causal)
        assert float((steps - mha(b, mask=qkv.causal)).abs().max()) <= 1e-5
        ptr = cache._k.data_ptr()  # type: ignore[union-attr]
        cache.reset()
        _decode(mha, b, cache, [9], mask=qkv.causal)
        assert cache._k.data_ptr() == ptr  # type: ignore[union-attr]


def test_truncate_rolls_back_without_copying():
    """Decode two continuations of one cached prompt: each equals its own full pass."""
    mha = _module(gqa=True, rope=True)
    prompt, a, b = torch.randn(1, 8, 48), torch.randn(1, 3, 48), torch.randn(1, 5, 48)
    cache = qkv.KVCache(16)
    with torch.no_grad():
        mha(prompt, cache=cache, mask=qkv.causal)
        for cont in (a, b):
            cache.truncate(8)
            got = _decode(mha, cont, cache, [1] * cont.shape[1], mask=qkv.causal)
            want = mha(torch.cat((prompt, cont), 1), mask=qkv.causal)[:, 8:]
            assert float((got - want).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match=r"\[0, 13\].*got 14"):
        cache.truncate(14)
    with pytest.raises(AttributeError):
        cache.length = 3  # type: ignore[misc]


def test_inference_mode_decoding_and_leaving_it():
    mha = _module(gqa=True, rope=True)
    x = torch.randn(1, 6, 48)
    cache = qkv.KVCache(8)
    with torch.inference_mode():
        got = _decode(mha, x, cache, [3, 1, 1, 1], mask=qkv.causal)
    with torch.no_grad():
        assert float((got - mha(x, mask=qkv.causal)).abs().max()) <= 1e-5
        with pytest.raises(RuntimeError, match="inference_mode"):
            mha(x[:, :1], cache=cache, mask=qkv.causal)
        cache.reset()
        assert float((_decode(mha, x, cache, [6], mask=qkv.causal) - got).abs().max()) <= 1e-5


@pytest.mark.parametrize("make_cache", [lambda: qkv.KVCache(30), lambda: qkv.SlidingWindowCache(4)])
def test_a_failed_step_leaves_the_cache_usable(make_cache):
    """A mask_mod that raises inside the attention call: the cache does not advance, and
    retrying the same chunk gives the full pass's result."""
    mha = _module(gqa=True, rope=True)
    x = torch.randn(1, 12, 48)
    cache = make_cache()
    window = getattr(cache, "window", 12)

    def broken(b, h, q, k):
        raise RuntimeError("boom")

    with torch.no_grad():
        full = mha(x, mask=qkv.sliding_window(window - 1))
        first = mha(x[:, :6], cache=cache, mask=qkv.causal)
        for chunk in (slice(6, 9), slice(6, 7)):
            with pytest.raises(RuntimeError, match="boom"):
                mha(x[:, chunk], cache=cache, mask=broken)
            assert cache.length == 6
        rest = _decode(mha, x[:, 6:], cache, [3, 1, 2], mask=qkv.causal)
    assert float((torch.cat((first, rest), 1) - full).abs().max()) <= 1e-5


def test_unbatched_decoding():
    mha = _module(gqa=False, rope=True)
    x = torch.randn(7, 48)
    cache = qkv.KVCache(7)
    with torch.no_grad():
        steps = torch.cat([mha(x[i : i + 1], cache=cache, mask=qkv.causal) for i in range(7)])
        assert float((steps - mha(x, mask=qkv.causal)).abs().max()) <= 1e-5


def test_cache_misuse_errors():
    m1, m2 = _module(False, False), _module(False, False)
    x = torch.randn(1, 4, 48)
    cache = qkv.KVCache(8)
    with torch.no_grad():
        m1(x, cache=cache)
        with pytest.raises(ValueError, match="one layer"):
            m2(x, cache=cache)
        with pytest.raises(ValueError, match="self-attention"):
            m1(x, x, cache=qkv.KVCache(8))
        ring = qkv.SlidingWindowCache(3)
        with pytest.raises(TypeError, match="mask tensor"):
            m1(x, cache=ring, mask=torch.ones(4, 4, dtype=torch.bool))
        with pytest.raises(TypeError, match="score_mod tensor"):
            m1(x, cache=ring, score_mod=torch.zeros(4, 4))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            qkv.KVCache(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="positive int"):
            qkv.SlidingWindowCache(bad)  # type: ignore[arg-type]
    assert "length=4" in repr(cache)


def test_documented_alignment_grid_and_unmasked_decoding():
    """The grid in the docs: 3 cached tokens, a chunk of 2, qkv.causal at absolute positions;
    and a single decoded token under qkv.causal needs no mask at all."""
    # private: the cache's position shift is the unit tested
    from qkv._positions import mask_at

    m = mask_at(qkv.causal, 3, 0, 2, 5)
    assert callable(m)
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long)
    grid = m(b, h, torch.arange(2).view(1, 1, 2, 1), torch.arange(5).view(1, 1, 1, 5))
    assert grid[0, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert mask_at(qkv.causal, 9, 0, 1, 10) is None
    assert mask_at(qkv.sliding_window(9), 9, 0, 1, 10) is None
    assert mask_at(qkv.sliding_window(8), 9, 0, 1, 10) is not None
