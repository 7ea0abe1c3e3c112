"""Built-in masks and scores are values: equal (and hashed alike) when made with equal
parameters, so a mask written inside ``forward`` finds the decision its last call kept; the
plan store is bounded and drops its least recently used entry, never all of them at once."""

from __future__ import annotations

import itertools

import pytest
import torch

import qkv
from catalogue import Shape, make_qkv
from qkv._core.builtin_mods import BuiltinMask
from qkv._core.kinds import classify_mask
from qkv._core.kindspec import mask_from_spec, mask_spec
from qkv._core.lru import LRU
from qkv._core.spec import number, read, registered
from qkv._core.terms import Keys, Terms

IDS = torch.arange(48) // 16
LENGTHS = torch.tensor([40, 48, 30, 20])
STARTS = torch.tensor([0, 0, 4, 8])
SLOPES = qkv.alibi_slopes(4)
TABLE = torch.randn(9, 4)

# Every public constructor of a mask or a score, twice over with other parameters: (name of
# the public function, a factory, a factory of the same function with other parameters).
CASES = {
    "causal": (lambda: qkv.causal, lambda: qkv.sliding_window(3)),
    "sliding_window": (lambda: qkv.sliding_window(8), lambda: qkv.sliding_window(8, 1)),
    "prefix_lm": (lambda: qkv.prefix_lm(5), lambda: qkv.prefix_lm(6)),
    "document": (lambda: qkv.document(IDS), lambda: qkv.document(IDS.clone())),
    "padding": (lambda: qkv.padding(LENGTHS), lambda: qkv.padding(LENGTHS, start=STARTS)),
    "and_masks": (
        lambda: qkv.and_masks(qkv.causal, qkv.document(IDS)),
        lambda: qkv.and_masks(qkv.sliding_window(4), qkv.document(IDS)),
    ),
    "or_masks": (
        lambda: qkv.or_masks(qkv.sliding_window(2), qkv.padding(LENGTHS)),
        lambda: qkv.or_masks(qkv.sliding_window(3), qkv.padding(LENGTHS)),
    ),
    "alibi": (lambda: qkv.alibi(SLOPES), lambda: qkv.alibi(SLOPES * 2)),
    "softcap": (lambda: qkv.softcap(30.0), lambda: qkv.softcap(20)),
    "relative_bias": (
        lambda: qkv.relative_bias(TABLE, 4),
        lambda: qkv.relative_bias(TABLE.clone(), 4),
    ),
}


def test_every_public_mask_and_score_is_enumerated():
    """A new built-in mask or score must be added here (and so be a value)."""
    public = {*qkv.masks.__all__, *qkv.scores.__all__} - {"alibi_slopes"}
    assert public == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_equal_parameters_make_equal_values(name: str):
    make, other = CASES[name]
    a, b = make(), make()
    assert a == b and hash(a) == hash(b), f"{name}: two equal masks differ"
    assert a != other() and other() != a, f"{name}: other parameters compare equal"
    assert len({a, b, other()}) == 2


def test_values_of_different_kinds_differ():
    values = [make() for make, _ in CASES.values()] + [other() for _, other in CASES.values()]
    for a, b in itertools.combinations(values, 2):
        assert a != b, (a, b)


def test_tensors_in_a_value_are_compared_by_identity_and_version():
    ids = torch.arange(10) // 3
    a = qkv.document(ids)
    assert a == qkv.document(ids) and a != qkv.document(ids.clone())
    token = qkv._core.kindspec.mask_token(a)
    ids[0] = 5  # an in-place edit: the same mask (it reads ids), but a new signature token
    assert a == qkv.document(ids) and hash(a) == hash(qkv.document(ids))
    assert qkv._core.kindspec.mask_token(a) != token


MADE_INLINE = {
    "window": lambda: qkv.sliding_window(8),
    "document": lambda: qkv.document(IDS),
    "padding": lambda: qkv.padding(LENGTHS),
    "prefix": lambda: qkv.prefix_lm(5),
    "and": lambda: qkv.and_masks(qkv.causal, qkv.document(IDS)),
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", list(MADE_INLINE))
def test_a_mask_made_in_every_call_is_decided_once(name: str, grad: bool, monkeypatch):
    from qkv import planner

    qkv._planning.kept.clear()
    decided = []
    real = planner._decide
    monkeypatch.setattr(planner, "_decide", lambda *a, **kw: decided.append(1) or real(*a, **kw))
    q, k, v = make_qkv(Shape(4, 4, 4, 48, 48, 32), gen=1, requires_grad=grad)
    outs = [qkv.attention(q, k, v, mask=MADE_INLINE[name]()) for _ in range(5)]
    assert len(decided) == 1, f"{name}: decided {len(decided)} times for 5 equal masks"
    want = qkv.attention(q, k, v, mask=MADE_INLINE[name](), backend="reference")
    for out in outs:
        torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-5)


def test_a_score_made_in_every_call_is_decided_once(monkeypatch):
    from qkv import planner

    qkv._planning.kept.clear()
    decided = []
    real = planner._decide
    monkeypatch.setattr(planner, "_decide", lambda *a, **kw: decided.append(1) or real(*a, **kw))
    q, k, v = make_qkv(Shape(2, 4, 4, 40, 40, 32), gen=2)
    for _ in range(4):
        qkv.attention(q, k, v, mask=qkv.causal, score_mod=qkv.softcap(20.0))
        qkv.attention(q, k, v, mask=qkv.causal, score_mod=qkv.alibi(SLOPES))
    assert len(decided) == 2


def test_the_plan_store_drops_its_oldest_entry_not_all(monkeypatch):
    """Past the bound, the least recently used plan goes; the ones in use stay."""
    kept = qkv._planning.kept
    monkeypatch.setattr(kept, "_KEPT", LRU(4, on_evict=kept._evicted))
    q, k, v = make_qkv(Shape(1, 2, 2, 20, 20, 16), gen=3)
    hot = qkv.sliding_window(1)
    qkv.attention(q, k, v, mask=hot)
    for w in range(2, 12):  # ten other signatures, the hot one used between each
        qkv.attention(q, k, v, mask=qkv.sliding_window(w))
        qkv.attention(q, k, v, mask=hot)
        assert len(kept._KEPT) <= 4
    tokens = [key[6] for key in kept._KEPT]  # the mask token of each signature
    assert hot in tokens, "the signature in use was dropped"
    assert qkv.sliding_window(11) in tokens and qkv.sliding_window(2) not in tokens


def test_lru_bounds():
    seen = []
    c: LRU[str, int] = LRU(2, on_evict=seen.append)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # "a" is now the newest
    c.put("c", 3)
    assert seen == ["b"] and list(c) == ["a", "c"]
    with pytest.raises(ValueError, match="at least one"):
        LRU(0)


# ------------------------------------------------ a new built-in mask: one class, one file


@registered("keyrange")  # the name of its spec, under which a compiled graph reads it back
class KeyRange(BuiltinMask):
    """Attend iff ``lo <= kv_idx < hi`` (the same keys for every query): a mask that is not
    in qkv, written as a contributor would add one (docs/contributing/design.md)."""

    plain = True  # its parameters are numbers: it is its own signature token

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx >= self.lo) & (kv_idx < self.hi)

    def params(self):
        return (self.lo, self.hi)

    def tile_states(self, g):  # a key block inside the range is full, one across an edge partial
        inside = (g.k_start >= self.lo) & (g.k_last < self.hi)  # [nk]
        touches = (g.k_last >= self.lo) & (g.k_start < self.hi)  # [nk]
        row = touches.to(torch.int8) + inside.to(torch.int8)  # [nk]: 0 empty, 1 partial, 2 full
        return row.view(1, 1, 1, -1).expand(1, 1, g.nq, g.nk)

    def terms(self):  # what kernels read: a key range (the decode and Triton kernels take one)
        return Terms(keys=Keys(self.hi, self.lo))

    def spec(self, tensors):  # how it crosses a custom operator under torch.compile
        return f"keyrange({number(self.lo, tensors)},{number(self.hi, tensors)})"

    @classmethod
    def from_spec(cls, args, tensors):
        return cls(*(read(a, tensors) for a in args.split(",")))

    def __repr__(self):
        return f"KeyRange({self.lo}, {self.hi})"


B_S = "blocksparse"


def test_a_new_mask_class_gets_tile_skipping_and_caching(monkeypatch):
    from qkv import planner

    m = KeyRange(100, 300)
    assert m == KeyRange(100, 300) and hash(m) == hash(KeyRange(100, 300))
    assert m != KeyRange(100, 301)
    bm = qkv.block_mask(m, None, None, 512, 512, block_size=64)
    assert bm.evaluated == [], "its rule was not used: the mask was evaluated"
    want = qkv.block_mask(lambda b, h, q, k: (k >= 100) & (k < 300), None, None, 512, 512,
                          block_size=64)  # fmt: skip
    assert want.evaluated and torch.equal(bm.states, want.states)
    q, k, v = make_qkv(Shape(1, 2, 2, 512, 512, 16), gen=5)
    # key blocks 0 and 3 of 128 keys are outside [100, 300): 4 of 16 tiles skipped
    assert "12 of 16 tiles" in str(qkv.plan(q, k, v, mask=m, backend=B_S))
    qkv._planning.kept.clear()
    decided = []
    real = planner._decide
    monkeypatch.setattr(planner, "_decide", lambda *a, **kw: decided.append(1) or real(*a, **kw))
    outs = [
        qkv.attention(q, k, v, mask=KeyRange(100, 300), backend="blocksparse") for _ in range(3)
    ]
    assert len(decided) == 1
    ref = qkv.attention(q, k, v, mask=KeyRange(100, 300), backend="reference")
    for out in outs:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_a_new_mask_class_gets_decode_compile_and_the_triton_formula():
    """The same class, nothing else edited: a decode step runs on qkv's decode kernel (the
    class's terms are one key range), a compiled call carries it through the engine's
    operator (its spec), and the Triton kernel reads it as a formula, not as bits."""
    m = KeyRange(100, 300)
    kind = classify_mask(m)
    tensors: list[torch.Tensor] = []
    spec = mask_spec(kind, tensors)
    assert spec == "keyrange(100,300)" and tensors == []
    assert mask_from_spec(spec, tensors).mask_mod == m
    q, k, v = make_qkv(Shape(2, 4, 2, 1, 512, 32), gen=6)  # one new token over 512 keys
    with torch.no_grad():
        plan = qkv.plan(q, k, v, mask=m)
        assert plan.backend == "decode", plan
        out = qkv.attention(q, k, v, mask=m)
    ref = qkv.reference.attention(q, k, v, mask=m)[0]
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)

    q, k, v = make_qkv(Shape(1, 2, 2, 320, 320, 16), gen=7)

    def f(q, k, v):
        return qkv.attention(q, k, v, mask=KeyRange(100, 300), backend="blocksparse")

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(
        got, qkv.reference.attention(q, k, v, mask=m)[0], atol=2e-6, rtol=2e-5
    )

    from qkv.backends.triton.lists import mask_spec as triton_formula

    formula = triton_formula(kind, 2, 1, 512, torch.device("cpu"))
    assert not formula.bits and formula.pad is not None
    start, limit = formula.pad
    assert start.tolist() == [100, 100] and limit.tolist() == [300, 300]


@pytest.mark.parametrize("inference", [False, True], ids=["grad_mode", "inference_mode"])
def test_a_mod_that_writes_into_its_index_tensors_gets_new_ones(inference: bool):
    """A small call's index tensors are kept between calls (qkv._core.evaluate.kept_grid); a
    mask_mod or score_mod that writes into them in place must not change what the next call
    sees: every call equals the plain formula on untouched indices."""
    q, k, v = make_qkv(Shape(1, 2, 2, 6, 6, 8), gen=3)
    idx = torch.arange(6)
    want_mask = (idx[:, None] - idx[None, :]).abs() <= 1  # [Lq, Lk]
    bias = (idx[:, None] - idx[None, :]).float() * 0.5

    def band(b, h, q_idx, kv_idx):
        out = (q_idx - kv_idx).abs() <= 1
        kv_idx.add_(3)  # a careless mod: shifts the index tensor it was handed
        return out

    def relative(score, b, h, q_idx, kv_idx):
        out = score + (q_idx - kv_idx) * 0.5
        q_idx.mul_(2)
        return out

    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        for _ in range(3):
            got = qkv.attention(q, k, v, mask=band, backend="sdpa")
            ref = qkv.reference.attention(q, k, v, mask=want_mask)[0]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
            got = qkv.attention(q, k, v, score_mod=relative, backend="reference")
            ref = qkv.reference.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[i, j])[
                0
            ]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
