"""FlexAttention-style mods and BlockMasks in qkv, unchanged.

FlexAttention evaluates mask_mods and score_mods under ``torch.vmap`` with 0-d indices, so
mods written for it may index twice (``table[q_idx][kv_idx]``) or take ``torch.dot`` of
gathered rows; qkv calls them with broadcastable index tensors, where those fail. qkv probes
each mod and evaluates the vmap-only ones through vmap (``qkv._flex.compat``). Every mod here
has a broadcast twin computing the same thing; the oracle runs the twin in float64.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import qkv
from qkv._door import validate
from qkv._flex.compat import ModCall
from qkv.backends.blocksparse.autograd import captured as _captured
from qkv_testing import assert_matches_oracle, compare_to_oracle

flex = pytest.importorskip("torch.nn.attention.flex_attention")

Tensor = torch.Tensor
BACKENDS = ["auto", "blocksparse", "reference"]
# (B, Hq, Hkv, Lq, Lk, D): lengths 1, 7, 113 (not block multiples), Lq != Lk, GQA, MQA.
SHAPES = [
    (1, 2, 2, 1, 7, 8),
    (2, 4, 2, 7, 113, 16),
    (1, 3, 1, 113, 64, 8),
    (2, 2, 2, 113, 113, 59),
]


def _inputs(shape, seed=0):
    B, Hq, Hkv, Lq, Lk, D = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=gen)
    k = torch.randn(B, Hkv, Lk, D, generator=gen)
    v = torch.randn(B, Hkv, Lk, D, generator=gen)
    return q, k, v, gen


# ------------------------------------------------------------------ vmap-only mods and twins


def table_mods(Lq, Lk, gen):
    """Double indexing of a captured table: ``table[q_idx][kv_idx]``."""
    table = torch.rand(Lq, Lk, generator=gen) > 0.4
    table[:, 0] = True  # every row sees a key (fully masked rows are tested elsewhere)

    def table_twice(b, h, q_idx, kv_idx):
        return table[q_idx][kv_idx]

    return table_twice, lambda b, h, q_idx, kv_idx: table[q_idx, kv_idx]


def features(Lq, Lk, gen):
    """Integer feature rows ``[Lq, 6]``, ``[Lk, 6]``: their dot products are exact, so vmap
    and a matmul agree on every comparison with a threshold."""
    fq = torch.randint(-2, 3, (Lq, 6), generator=gen).float()
    fk = torch.randint(-2, 3, (Lk, 6), generator=gen).float()
    return fq, fk


def dot_mods(Lq, Lk, gen):
    """``torch.dot`` of gathered feature rows above a threshold (key 0 always visible)."""
    fq, fk = features(Lq, Lk, gen)

    def dot_above(b, h, q_idx, kv_idx):
        return (torch.dot(fq[q_idx], fk[kv_idx]) > 0.5) | (kv_idx == 0)

    def twin(b, h, q_idx, kv_idx):
        s = (fq @ fk.T)[q_idx, kv_idx]  # [1, 1, Lq, Lk]
        return (s > 0.5) | (kv_idx == 0)

    return dot_above, twin


def score_mods(Hq, Lq, Lk, gen):
    """A learnable captured tensor indexed vmap-style, and its broadcast twin (the same
    tensor, so gradients into it are compared)."""
    bias = (0.5 * torch.randn(Hq, Lq, Lk, generator=gen)).requires_grad_()

    def learned_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h][q_idx][kv_idx] * (b + 1)

    def twin(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx] * (b + 1)

    return learned_bias, twin, bias


def _fast(mask=None, score_mod=None, **kw):
    """``qkv.attention`` with the vmap-only mods, whatever ``compare_to_oracle`` passes (it
    gives the broadcast twins to plain PyTorch and to the float64 oracle)."""

    def fn(q, k, v, **twins):
        return qkv.attention(q, k, v, mask=mask, score_mod=score_mod, return_lse=True, **kw)

    return fn


# ------------------------------------------------------------------ forward and gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [table_mods, dot_mods], ids=["table_twice", "dot_above"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_vmap_mask_mod_matches_oracle(shape, make, backend):
    q, k, v, gen = _inputs(shape)
    mod, twin = make(shape[3], shape[4], gen)
    p = validate(q, k, v, mask=mod)
    assert isinstance(p.mask.mask_mod, ModCall) and p.mask.mask_mod.why is not None  # vmap
    assert p.mask.is_user and p.mask.evaluation == "vmap"
    fn = _fast(mask=mod, backend=backend)
    assert_matches_oracle(compare_to_oracle(fn, q, k, v, mask=twin))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_vmap_score_mod_gradients_reach_the_captured_tensor(shape, backend):
    q, k, v, gen = _inputs(shape, seed=1)
    _, Hq, _, Lq, Lk, _ = shape
    mod, twin, bias = score_mods(Hq, Lq, Lk, gen)
    mask, mask_twin = table_mods(Lq, Lk, gen)
    fn = _fast(mask=mask, score_mod=mod, backend=backend)
    res = compare_to_oracle(fn, q, k, v, mask=mask_twin, score_mod=twin, extra_params=(bias,))
    assert [c.name for c in res][-1] == "dparam0"  # the captured tensor's gradient is checked
    assert_matches_oracle(res)


def test_wrapper_keeps_captured_tensors_discoverable():
    """The block-sparse backward finds a score_mod's learnable tensors through its closure;
    the wrapper holds the user's function, so they are still found."""
    q, k, v, gen = _inputs(SHAPES[1])
    mod, _, bias = score_mods(4, 7, 113, gen)
    p = validate(q, k, v, score_mod=mod)
    assert isinstance(p.score.score_mod, ModCall) and p.score.score_mod.fn is mod
    assert any(t is bias for t in _captured(p.score.score_mod))


def test_wrapper_evaluates_exactly_the_tile_it_is_given():
    """Gathered, non-contiguous positions (as the block-sparse engine passes keys): the
    result is that tile, value for value."""
    mod, twin = table_mods(20, 30, torch.Generator().manual_seed(3))
    wrapped = ModCall("mask_mod", mod, "test", decided=True)
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(3).view(1, 3, 1, 1)
    qi = torch.tensor([0, 4, 5, 19, 11]).view(1, 1, 5, 1)
    ki = torch.tensor([29, 0, 7, 8]).view(1, 1, 1, 4)
    got = wrapped(b, h, qi, ki)
    assert got.shape == (2, 3, 5, 4) and got.dtype == torch.bool
    assert torch.equal(got, twin(b, h, qi, ki).expand(2, 3, 5, 4))


def test_reductions_over_the_tile_are_caught():
    """``(fq[q_idx] * fk[kv_idx]).sum()`` is a dot product per element under vmap, but also
    runs under broadcasting, summing the whole tile. qkv checks one value for a whole tile
    against vmap, and other results at two positions evaluated alone; it believes vmap."""
    q, k, v, gen = _inputs(SHAPES[1])
    fq, fk = features(7, 113, gen)
    dots = fq @ fk.T  # [Lq, Lk]

    def summed(b, h, q_idx, kv_idx):
        return (fq[q_idx] * fk[kv_idx]).sum() > 0.5

    def score_sum(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (fq[q_idx] * fk[kv_idx]).sum()

    p = validate(q, k, v, mask=summed)
    assert isinstance(p.mask.mask_mod, ModCall)
    assert "depend on the rest of the tile" in p.mask.mask_mod.why
    want, _ = qkv.reference.attention(q, k, v, mask=dots > 0.5)
    torch.testing.assert_close(qkv.attention(q, k, v, mask=summed), want)
    for backend in BACKENDS:
        want, _ = qkv.reference.attention(q, k, v, score_mod=0.1 * dots)
        got = qkv.attention(q, k, v, score_mod=score_sum, backend=backend)
        torch.testing.assert_close(got, want)


def test_combinations_and_kv_cache_wrap_their_parts():
    """qkv.and_masks and the module's KV-cache positions call user mods with qkv's
    convention: a vmap-only part works inside them too."""
    q, k, v, gen = _inputs(SHAPES[3])
    mod, twin = table_mods(113, 113, gen)
    want, _ = qkv.reference.attention(q, k, v, mask=qkv.and_masks(qkv.causal, twin))
    got = qkv.attention(q, k, v, mask=qkv.and_masks(qkv.causal, mod))
    torch.testing.assert_close(got, want)

    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(48, 6, n_kv_heads=2).eval()
    x = torch.randn(1, 12, 48)
    causal_table = torch.ones(12, 12).tril().bool()

    def cached(b, h, q_idx, kv_idx):
        return causal_table[q_idx][kv_idx]

    cache = qkv.KVCache(12)
    with torch.no_grad():
        full = mha(x, mask=qkv.causal)
        steps = [mha(x[:, i:j], cache=cache, mask=cached) for i, j in ((0, 5), (5, 6), (6, 12))]
    assert float((torch.cat(steps, 1) - full).abs().max()) <= 1e-5


def test_block_mask_builder_takes_vmap_mods():
    mod, twin = table_mods(70, 90, torch.Generator().manual_seed(4))
    bm = qkv.block_mask(mod, None, None, 70, 90, block_size=16)
    want = qkv.block_mask(twin, None, None, 70, 90, block_size=16)
    assert torch.equal(bm.states, want.states)
    q, k, v, _ = _inputs((1, 2, 2, 70, 90, 8))
    torch.testing.assert_close(qkv.attention(q, k, v, mask=bm), qkv.attention(q, k, v, mask=want))


# ------------------------------------------------------------------ what is and is not wrapped


def test_broadcast_mods_are_not_wrapped_and_plan_says_nothing():
    q, k, v, _ = _inputs(SHAPES[1])
    doc = torch.arange(113) // 30

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def always(b, h, q_idx, kv_idx):
        return True

    def noop(b, h, q_idx, kv_idx):
        return b.new_ones((), dtype=torch.bool)

    for mod in (same_doc, always, noop, flex.noop_mask):
        assert validate(q, k, v, mask=mod).mask.mask_mod is mod

    def half(score, b, h, q_idx, kv_idx):
        return score * 0.5

    # A score_mod is decided on its first real call; a broadcast one is then called directly,
    # and later calls on this device type get the function itself.
    w = validate(q, k, v, score_mod=half).score.score_mod
    s = torch.randn(2, 4, 7, 113)
    assert torch.equal(w(s, *validate(q, k, v).index_tensors()), s * 0.5)
    assert w.decided and w.why is None and w.fn is half
    assert validate(q, k, v, score_mod=half).score.score_mod is half
    assert "vmap" not in str(qkv.plan(q, k, v, mask=same_doc, score_mod=half))
    p = validate(q, k, v, score_mod=qkv.softcap(5.0))
    assert type(p.score.score_mod) is qkv._core.builtin_scores.Softcap  # built-ins untouched


def test_plan_says_when_a_mod_runs_through_vmap_and_its_cost():
    q, k, v, gen = _inputs(SHAPES[2])
    mask, _ = table_mods(113, 64, gen)
    score, _, _ = score_mods(3, 113, 64, gen)
    text = str(qkv.plan(q, k, v, mask=mask, score_mod=score))
    for kind, name in (("mask_mod", "table_twice"), ("score_mod", "learned_bias")):
        pattern = (
            rf"note: {kind} {name} is evaluated through torch\.vmap \(under broadcasting it "
            rf"raised IndexError: [^\n]*\): about \d+\.\dx slower to evaluate than a "
            rf"broadcast mod \(a table lookup on a 128x128 tile: \d+ us through vmap, \d+ us "
            rf"broadcast; {name} takes \d+ us on a 113x64 tile of one \(b, h\)\)"
        )
        assert re.search(pattern, text), text
    assert "score   : learned_bias (through torch.vmap)" in text


# ------------------------------------------------------------------ errors


def test_mod_failing_both_ways_is_a_value_error_naming_it_and_the_shapes():
    q, k, v, _ = _inputs(SHAPES[1])

    def python_if(b, h, q_idx, kv_idx):
        return torch.tensor(True) if q_idx >= kv_idx else torch.tensor(False)

    with pytest.raises(ValueError) as err:
        qkv.attention(q, k, v, mask=python_if)
    msg = str(err.value)
    for words in (
        "mask_mod python_if works under neither calling convention",
        "b [2, 1, 1, 1], h [1, 4, 1, 1], q_idx [1, 1, 4, 1], kv_idx [1, 1, 1, 4]",
        "there it raised RuntimeError: Boolean value of Tensor",
        "torch.vmap with 0-d tensors",
        "there it raised RuntimeError: vmap:",
        "table[q_idx, kv_idx]",
    ):
        assert words in msg, msg

    def score_if(score, b, h, q_idx, kv_idx):
        return score if q_idx >= kv_idx else -score

    with pytest.raises(ValueError, match=r"score_mod score_if works under neither.*score \["):
        qkv.attention(q, k, v, score_mod=score_if, backend="blocksparse")


def test_same_error_both_ways_is_the_mods_own_and_raised_as_it_is():
    q, k, v, _ = _inputs(SHAPES[1])

    def broken(b, h, q_idx, kv_idx):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        qkv.attention(q, k, v, mask=broken)
    with pytest.raises(KeyError, match="boom"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, i, j: broken(b, h, i, j))


def test_wrong_dtype_keeps_the_usual_type_error():
    q, k, v, gen = _inputs(SHAPES[1])
    ints = torch.randint(0, 3, (7, 113), generator=gen)

    def int_table(b, h, q_idx, kv_idx):  # vmap-only, and not bools
        return ints[q_idx][kv_idx]

    with pytest.raises(TypeError, match=r"mask_mod int_table returned a torch.int64 tensor"):
        qkv.attention(q, k, v, mask=int_table)


# ------------------------------------------------------------------ FlexAttention BlockMasks


def _flex_forward(q, k, v, block_mask):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        return flex.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "block", [None, 16, (32, 64)], ids=["default", "16", "32x64"]
)  # FlexAttention's BLOCK_SIZE (Q, KV)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_flex_block_mask_gives_what_its_mask_mod_gives(shape, block, backend):
    q, k, v, gen = _inputs(shape, seed=2)
    B, Hq, _, Lq, Lk, _ = shape
    mod, twin = dot_mods(Lq, Lk, gen)
    kw = {} if block is None else {"BLOCK_SIZE": block}
    fbm = flex.create_block_mask(mod, B, Hq, Lq, Lk, device="cpu", **kw)
    bm = validate(q, k, v, mask=fbm).mask.block
    assert isinstance(bm, qkv.BlockMask)
    assert bm.block_size == tuple(fbm.BLOCK_SIZE)  # FlexAttention's tiles, unchanged
    fn = _fast(mask=fbm, backend=backend)
    assert_matches_oracle(compare_to_oracle(fn, q, k, v, mask=twin))
    want = qkv.attention(q, k, v, mask=mod, backend=backend)
    torch.testing.assert_close(qkv.attention(q, k, v, mask=fbm, backend=backend), want)
    torch.testing.assert_close(_flex_forward(q, k, v, fbm), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("heads", [None, "H"])
def test_flex_block_mask_broadcast_over_batch_and_heads(heads):
    q, k, v, gen = _inputs(SHAPES[3], seed=3)
    mod, twin = table_mods(113, 113, gen)
    fbm = flex.create_block_mask(mod, None, None if heads is None else 2, 113, 113, "cpu", 32)
    assert fbm.kv_indices.shape[0] == 1
    fn = _fast(mask=fbm, backend="blocksparse")
    assert_matches_oracle(compare_to_oracle(fn, q, k, v, mask=twin))


def test_flex_block_lists_without_a_mask_mod_are_the_mask():
    """``BlockMask.from_kv_blocks`` with no mask_mod (FlexAttention's noop_mask): the listed
    blocks are the mask, and qkv computes them all unmasked (no partial tiles)."""
    L, bs = 100, 16
    n = -(-L // bs)
    num = torch.tensor([[[1] + [2] * (n - 1)]], dtype=torch.int32)  # [1, 1, n]
    idx = torch.stack([torch.tensor([i, max(i - 1, 0)] + [0] * (n - 2)) for i in range(n)])
    fbm = flex.BlockMask.from_kv_blocks(
        num, idx[None, None].int(), BLOCK_SIZE=bs, seq_lengths=(L, L)
    )
    q, k, v, _ = _inputs((1, 2, 2, L, L, 8))
    bm = validate(q, k, v, mask=fbm).mask.block
    assert bm.num_blocks["partial"] == 0
    i = torch.arange(L) // bs
    dense = (i[:, None] == i[None, :]) | (i[:, None] == i[None, :] + 1)  # [L, L]
    want, _ = qkv.reference.attention(q, k, v, mask=dense)
    torch.testing.assert_close(qkv.attention(q, k, v, mask=fbm), want)
    # (Not compared with eager flex_attention: its CPU math path evaluates the mask_mod
    # alone and ignores the block lists, which its compiled kernels honour, as qkv does.)


def test_flex_block_mask_with_large_blocks_is_retiled():
    """FlexAttention blocks of 512 are re-tiled at qkv's 128 (exactly: a tile is partial
    where it covers any partial or mixed blocks)."""
    q, k, v, _ = _inputs((1, 2, 2, 700, 600, 8), seed=5)

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 40

    fbm = flex.create_block_mask(band, 1, 2, 700, 600, "cpu", BLOCK_SIZE=512)
    bm = validate(q, k, v, mask=fbm).mask.block
    assert bm.block_size == (128, 128) and bm.states.shape[-2:] == (6, 5)
    direct = qkv.block_mask(band, 1, 2, 700, 600)
    assert bool(((bm.states > 0) >= (direct.states > 0)).all())  # hides nothing it allows
    assert bool(((bm.states == 2) <= (direct.states == 2)).all())  # unmasks nothing it hides
    want, _ = qkv.reference.attention(q, k, v, mask=band)
    torch.testing.assert_close(qkv.attention(q, k, v, mask=fbm, backend="blocksparse"), want)


def test_flex_block_mask_built_for_another_problem_is_refused():
    q, k, v, _ = _inputs(SHAPES[1])  # B=2, Hq=4, Lq=7, Lk=113

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(
        ValueError,
        match=r"built for Q_LEN=8, KV_LEN=113 but the problem has "
        r"Lq=7, Lk=113; build it for this problem with create_block_mask",
    ):
        qkv.attention(q, k, v, mask=flex.create_block_mask(causal, 2, 4, 8, 113, "cpu"))
    with pytest.raises(ValueError, match=r"block lists for B=3, H=4 .* the problem has B=2"):
        qkv.attention(q, k, v, mask=flex.create_block_mask(causal, 3, 4, 7, 113, "cpu"))
    sliced = flex.create_block_mask(causal, 2, 4, 7, 113, "cpu")[0]
    with pytest.raises(ValueError, match=r"sliced and has no mask_mod"):
        qkv.attention(q, k, v, mask=sliced)


def test_flex_block_mask_converted_once_and_reused():
    q, k, v, gen = _inputs(SHAPES[1])
    mod, _ = dot_mods(7, 113, gen)
    fbm = flex.create_block_mask(mod, 2, 4, 7, 113, "cpu")
    first = validate(q, k, v, mask=fbm).mask.block
    assert validate(q, k, v, mask=fbm).mask.block is first
    assert "mask_mod dot_above is evaluated through torch.vmap" in str(qkv.plan(q, k, v, mask=fbm))
