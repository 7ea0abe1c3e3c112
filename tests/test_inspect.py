"""qkv.inspect: weights rebuilt from the lse, blockwise statistics, and recording.

Every quantity is compared with the same quantity computed from the full weights of the float64
oracle (``qkv.reference.attention``); the allowed error is 2x the error plain float32 makes
(the reference run on the float32 inputs) plus the float32 floor, as in conftest.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import pytest
import torch

import qkv
from catalogue import SHAPES, Shape, make_mask, make_qkv, make_score

# private: the blockwise statistics unit, run with chosen block sizes (qkv.inspect.stats
# fixes them), and its tile cache
from qkv.inspect._stats import stats_of_problem
from qkv.inspect._weights import check_problem
from qkv_testing import FLOOR, Comparison, _maxerr

Tensor = torch.Tensor


def _shapes(B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int, seed: int) -> tuple[Tensor, ...]:
    return make_qkv(Shape(B, Hq, Hkv, Lq, Lk, D), gen=seed)


def _case(mask_name: str, score_name: str, shape: Shape) -> dict[str, Any]:
    """The catalogue's mask and score_mod (nothing needs a gradient) as attention kwargs."""
    gen = torch.Generator().manual_seed(5)
    mask = make_mask(mask_name, shape, gen)
    return {"mask": mask, "score_mod": make_score(score_name, shape, gen, grad=False)[0]}


def _oracle_weights(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    """Full weights in float64 (the oracle) and in float32 (plain PyTorch's error baseline)."""
    kw64 = {**kw}
    if isinstance(kw.get("score_mod"), Tensor):
        kw64["score_mod"] = kw["score_mod"].double()
    _, w64 = qkv.reference.attention(q.double(), k.double(), v.double(), **kw64)
    _, w32 = qkv.reference.attention(q, k, v, **kw)
    return w64, w32


def _assert_close(name: str, got: Tensor, want64: Tensor, plain: Tensor) -> None:
    c = Comparison(name, _maxerr(got, want64), _maxerr(plain, want64), 2.0, FLOOR[torch.float32])
    assert c.ok, str(c)


# --------------------------------------------------------------------------- weights from lse

# The catalogue's entries (catalogue.MASKS / SCORES say what each is for): every built-in,
# and/or combinations, bool tensors of both broadcast shapes, an arbitrary and a
# head-dependent mask_mod, fully masked rows.
MASKS = [
    "none",
    "causal",
    "window",
    "window2",
    "document",
    "padding",
    "prefix_lm",
    "and",
    "or",
    "dead_rows",
    "bool",
    "rows_masked",
    "head_dependent",
]
SCORES = ["none", "alibi", "softcap", "relative", "bias", "closure"]


@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("score_name", SCORES)
def test_weights_from_lse_equal_reference(mask_name: str, score_name: str) -> None:
    shape = SHAPES["odd"]  # GQA, Lq != Lk, odd head dim
    B, Lq, Lk = shape.B, shape.Lq, shape.Lk
    q, k, v = make_qkv(shape, gen=zlib.crc32(f"{mask_name}-{score_name}".encode()))
    kw = _case(mask_name, score_name, shape)
    _out, lse = qkv.attention(q, k, v, return_lse=True, **kw)
    w64, w32 = _oracle_weights(q, k, v, **kw)
    g = torch.Generator().manual_seed(1)
    rows = [*torch.randperm(Lq, generator=g)[:5].tolist(), -1]
    heads = [3, 0, 1]
    got = qkv.inspect.weights(q, k, lse=lse, rows=rows, heads=heads, **kw)
    assert got.shape == (B, len(heads), len(rows), Lk)
    sel = (slice(None), heads)
    want, plain = w64[sel][:, :, rows], w32[sel][:, :, rows]
    _assert_close("weights", got, want, plain)
    # Fully masked rows (lse = -inf) give exact zeros, never NaN.
    dead = ~torch.isfinite(lse[sel][:, :, rows])
    assert torch.isfinite(got).all()
    assert (got[dead] == 0).all()
    # Rows that see any key sum to 1.
    sums = got.sum(-1)[~dead]
    assert torch.allclose(sums.double(), torch.ones_like(sums, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize(
    ("B", "Hq", "Hkv", "Lq", "Lk", "D"),
    [(1, 1, 1, 1, 1, 8), (1, 3, 1, 7, 113, 111), (2, 8, 2, 113, 7, 16), (1, 2, 2, 0, 5, 4)],
)
def test_weights_odd_shapes_all_rows(B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int) -> None:
    q, k, v = _shapes(B, Hq, Hkv, Lq, Lk, D, seed=Lq * 31 + Lk)
    _, lse = qkv.attention(q, k, v, mask=qkv.causal, return_lse=True)
    w64, w32 = _oracle_weights(q, k, v, mask=qkv.causal)
    got = qkv.inspect.weights(q, k, lse=lse, mask=qkv.causal)  # every row and head
    assert got.shape == w64.shape
    _assert_close("weights", got, w64, w32)


def test_weights_unbatched_and_lse_from_any_backend() -> None:
    q, k, v = torch.randn(9, 16), torch.randn(12, 16), torch.randn(12, 16)
    _, w64 = qkv.reference.attention(q.double(), k.double(), v.double(), scale=0.3)
    # lse from the oracle itself (another "backend"): the rebuild must not care where it came from
    q64, k64, v64 = q.double(), k.double(), v.double()
    _, lse_oracle = qkv.attention(q64, k64, v64, scale=0.3, return_lse=True, backend="reference")
    _, lse = qkv.attention(q, k, v, scale=0.3, return_lse=True)
    for l in (lse, lse_oracle.float()):
        got = qkv.inspect.weights(q, k, lse=l, rows=[2, 8], scale=0.3)
        assert got.shape == (2, 12)
        assert torch.allclose(got.double(), w64[[2, 8]], atol=2e-6)
    q3, k3 = q.view(1, 9, 16).expand(2, 9, 16), k.view(1, 12, 16).expand(2, 12, 16)
    _, lse3 = qkv.attention(q3, k3, k3, return_lse=True)
    assert qkv.inspect.weights(q3, k3, lse=lse3, heads=1, rows=0).shape == (1, 1, 12)


def test_weights_half_precision_inputs() -> None:
    q, k, v = (t.bfloat16() for t in _shapes(1, 2, 1, 20, 30, 16, seed=3))
    _, lse = qkv.attention(q, k, v, mask=qkv.causal, return_lse=True)
    got = qkv.inspect.weights(q, k, lse=lse, rows=[0, 19], mask=qkv.causal)
    assert got.dtype == torch.float32
    _, w64 = qkv.reference.attention(q.double(), k.double(), v.double(), mask=qkv.causal)
    assert torch.allclose(got.double(), w64[:, :, [0, 19]], atol=1e-5)


def test_weights_memory_is_rows_times_keys() -> None:
    """The mask_mod and score_mod see at most rows × Lk positions: no Lq × Lk matrix."""
    seen: list[int] = []

    def mask(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        seen.append(torch.broadcast_shapes(b.shape, h.shape, qi.shape, ki.shape).numel())
        return qi >= ki

    q, k, v = _shapes(1, 2, 2, 2048, 2048, 8, seed=0)
    _, lse = qkv.attention(q, k, v, mask=mask, return_lse=True)
    seen.clear()
    w = qkv.inspect.weights(q, k, lse=lse, rows=[5, 2000], heads=1, mask=mask)
    assert max(seen) <= 2 * 2048
    assert w.shape == (1, 1, 2, 2048)
    seen.clear()
    qkv.inspect.stats(q, k, lse=lse, mask=mask)
    assert max(seen) <= 2 * 64 * 512  # heads x block_q x block_k


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"rows": [0, 40]}, ValueError, "rows [40] out of range: q has 37 query rows"),
        ({"rows": -38}, ValueError, "rows [-38] out of range"),
        ({"heads": 4}, ValueError, "heads [4] out of range: q has 4 heads, valid 0..3"),
        ({"rows": 1.5}, TypeError, "rows must be an int"),
        ({"heads": torch.tensor([0.5])}, TypeError, "heads must be an int"),
        ({"rows": ["a"]}, TypeError, "rows must contain ints"),
        ({"lse": torch.zeros(2, 4, 36)}, ValueError, "lse has shape [2, 4, 36] but q"),
        ({"lse": [1.0]}, TypeError, "lse must be the tensor"),
        ({"lse": torch.zeros(2, 4, 37, dtype=torch.int64)}, TypeError, "float"),
        ({"mask": torch.zeros(3, 3, dtype=torch.bool)}, ValueError, "does not broadcast"),
    ],
)
def test_weights_bad_input(kwargs: dict[str, Any], exc: type, words: str) -> None:
    q, k, v = _shapes(2, 4, 2, 37, 29, 8, seed=0)
    _, lse = qkv.attention(q, k, v, return_lse=True)
    call = {"lse": lse, **kwargs}
    with pytest.raises(exc) as e:
        qkv.inspect.weights(q, k, **call)
    assert words in str(e.value)


# ------------------------------------------------------------------------------ statistics


def _full_stats(w: Tensor, K: int) -> tuple[Tensor, Tensor, Tensor]:
    received = w.sum(dim=-2)  # [B, Hq, Lk]
    entropy = -torch.special.xlogy(w, w).sum(dim=-1)  # [B, Hq, Lq]
    top = w.topk(K, dim=-1).values  # [B, Hq, Lq, K]
    return received, entropy, top


@pytest.mark.parametrize("mask_name", ["none", "causal", "padding", "document", "dead_rows", "or"])
@pytest.mark.parametrize("score_name", ["none", "alibi", "softcap", "relative"])
@pytest.mark.parametrize(
    ("Lq", "Lk", "blocks"), [(37, 29, (8, 8)), (113, 1025, None)], ids=["37-29-8-8", "113-1025"]
)
def test_stats_equal_full_weights(
    mask_name: str, score_name: str, Lq: int, Lk: int, blocks: tuple[int, int] | None
) -> None:
    K = 3
    shape = Shape(2, 4, 2, Lq, Lk, 16)
    q, k, v = make_qkv(shape, gen=Lq + len(mask_name) * 7 + len(score_name))
    kw = _case(mask_name, score_name, shape)
    _, lse = qkv.attention(q, k, v, return_lse=True, **kw)
    w64, w32 = _oracle_weights(q, k, v, **kw)
    if blocks is None:  # the public function, with its own 64 x 512 tiles
        s = qkv.inspect.stats(q, k, lse=lse, top_k=K, **kw)
    else:  # private: the blockwise unit with 8 x 8 tiles, so that 37 x 29 spans many
        p, lse4 = check_problem(q, k, lse, kw["mask"], kw["score_mod"], None)
        s = stats_of_problem(p, lse4, K, block_q=blocks[0], block_k=blocks[1])
    want, plain = _full_stats(w64, K), _full_stats(w32, K)
    _assert_close("received", s.received, want[0], plain[0])
    _assert_close("entropy", s.entropy, want[1], plain[1])
    _assert_close("top_weights", s.top_weights, want[2], plain[2])
    _check_top_keys(s.top_weights, s.top_keys, w64)


def _check_top_keys(top_w: Tensor, top_i: Tensor, w64: Tensor) -> None:
    """Listed keys carry exactly the listed weights, are distinct, and -1 marks no-weight slots."""
    listed = top_i >= 0
    gathered = w64.gather(-1, top_i.clamp(min=0))
    assert torch.allclose(gathered[listed], top_w[listed].double(), atol=1e-6)
    assert (top_w[~listed] == 0).all()
    nonzero = (w64 > 0).sum(-1, keepdim=True)  # [B, Hq, Lq, 1]
    slot = torch.arange(top_i.shape[-1])
    assert torch.equal(listed, slot < nonzero)
    srt = top_i.sort(dim=-1).values
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    assert not dup.any()


def test_stats_public_api_unbatched_and_top_k_larger_than_keys() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=gen) for n in (6, 4, 4))
    _, lse = qkv.attention(q, k, v, mask=qkv.causal, return_lse=True)
    s = qkv.inspect.stats(q, k, lse=lse, mask=qkv.causal, top_k=10)
    _, w = qkv.reference.attention(q.double(), k.double(), v.double(), mask=qkv.causal)
    assert s.received.shape == (4,) and s.entropy.shape == (6,)
    assert s.top_weights.shape == s.top_keys.shape == (6, 4)  # K clamped to Lk
    assert torch.allclose(s.received.double(), w.sum(0), atol=1e-6)
    assert s.top_keys[0].tolist() == [0, -1, -1, -1]  # row 0 sees key 0 only
    # one visible key: entropy 0 up to float rounding of exp(s - lse) (seen: 7e-15)
    assert 0 <= float(s.entropy[0]) < 1e-6
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        qkv.inspect.stats(q, k, lse=lse, top_k=-1)


# ------------------------------------------------------------------------------- recording


class _TwoCalls(torch.nn.Module):
    """A model that calls qkv.attention directly (no MultiHeadAttention submodule)."""

    def forward(self, x: Tensor) -> Tensor:
        h = qkv.attention(x, x, x, mask=qkv.causal)
        assert isinstance(h, Tensor)
        return qkv.attention(h, x, x, score_mod=qkv.softcap(3.0))  # type: ignore[return-value]


def test_record_plain_calls_and_caller_output_unchanged() -> None:
    x = torch.randn(1, 2, 11, 16)
    model = _TwoCalls()
    want = model(x)
    with qkv.inspect.record(model) as rec:
        got = model(x)
    assert torch.allclose(got, want, atol=1e-6)  # the caller still gets plain `out`
    assert isinstance(got, Tensor)
    assert len(rec) == 2 and rec.layers == [""]
    first, second = rec[0], rec[1]
    assert first.mask is qkv.causal and second.score_mod is not None
    _, w64 = qkv.reference.attention(x.double(), x.double(), x.double(), mask=qkv.causal)
    assert torch.allclose(first.weights(rows=[3]).double(), w64[:, :, [3]], atol=1e-6)
    model(x)  # after the block: nothing more is recorded
    assert len(rec) == 2


def test_record_keep_stats_and_nesting() -> None:
    x = torch.randn(1, 2, 11, 16)
    model = _TwoCalls()
    with qkv.inspect.record(model, keep="stats", top_k=2) as outer:
        model(x)
        with qkv.inspect.record(model) as inner:
            model(x)
        model(x)
    assert len(outer) == 4 and len(inner) == 2
    cap = outer[0]
    assert cap.q is None and cap.stats is not None
    assert cap.statistics().top_keys.shape == (1, 2, 11, 2)
    with pytest.raises(ValueError, match="keep='qk'"):
        cap.weights(rows=0)
    with pytest.raises(ValueError, match="top_k=2"):
        cap.statistics(top_k=4)
    full = inner[0].statistics(top_k=2)
    assert torch.allclose(full.entropy, cap.statistics().entropy, atol=1e-6)


def test_record_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"torch.nn.Module"), qkv.inspect.record("model"):  # type: ignore[arg-type]
        pass
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="keep must be"), qkv.inspect.record(linear, keep="all"):  # type: ignore[arg-type]
        pass
    with pytest.raises(KeyError, match="no qkv attention call was recorded in layer 'x'"):
        with qkv.inspect.record(torch.nn.Linear(2, 2)) as rec:
            pass
        rec["x"]


def test_recording_check_is_cheap_when_off() -> None:
    """Nothing records outside a block: the ContextVar holds None."""
    assert qkv._recording.ACTIVE.get() is None  # private: the off-path's ContextVar is the unit
    f = functools.partial(qkv.attention, mask=qkv.causal)
    x = torch.randn(4, 8)
    assert isinstance(f(x, x, x), Tensor)


class _Encoder(torch.nn.Module):
    """Two qkv.MultiHeadAttention layers (the second GQA with RoPE) and a plain call."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [
                qkv.MultiHeadAttention(32, 4),
                qkv.MultiHeadAttention(32, 4, n_kv_heads=2, rope=True),
            ]
        )

    def forward(self, x: Tensor, mask: object = None) -> Tensor:
        for layer in self.layers:
            x = x + layer(x, mask=mask)
        return x


def test_record_names_layers_and_matches_need_weights() -> None:
    torch.manual_seed(0)
    model = _Encoder().eval()
    x = torch.randn(2, 13, 32)
    mask = qkv.padding(torch.tensor([13, 6]))
    with torch.no_grad():
        want = model(x, mask)
        with qkv.inspect.record(model) as rec:
            got = model(x, mask)
    assert torch.allclose(got, want, atol=1e-5)
    assert rec.layers == ["layers.0", "layers.1"]
    h = x
    for i, layer in enumerate(model.layers):
        with torch.no_grad():
            out, w_ref = layer(h, mask=mask, need_weights=True)  # [B, H, Lq, Lk]
        cap = rec[f"layers.{i}"]
        assert cap.q is not None and cap.k is not None
        assert cap.k.shape[1] == (4 if i == 0 else 2)
        assert torch.allclose(cap.weights(), w_ref, atol=1e-6)
        assert torch.allclose(cap.weights(rows=[12, 0], heads=3), w_ref[:, 3:4][:, :, [12, 0]])
        st = cap.statistics(top_k=2)
        assert torch.allclose(st.received, w_ref.sum(2), atol=1e-5)
        assert torch.allclose(st.top_weights, w_ref.topk(2, dim=-1).values, atol=1e-6)
        h = h + out


def test_record_resets_layer_name_when_forward_raises() -> None:
    model = _Encoder()
    with qkv.inspect.record(model) as rec:
        with pytest.raises(ValueError):
            model(torch.randn(1, 5, 31))  # wrong width: the first layer refuses it
        qkv.attention(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    assert [c.layer for c in rec] == [""]  # the plain call is not attributed to layers.0
    x = torch.randn(3, 4)
    with qkv.inspect.record(torch.nn.Identity()) as after:  # nor is one in a later recording
        qkv.attention(x, x, x)
    assert [c.layer for c in after] == [""]


def test_stats_recompute_path_equals_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row blocks too big for the tile cache recompute their tiles: same statistics."""
    from qkv.inspect import _stats  # private: the tile cache's size is the unit tested

    q, k, v = _shapes(1, 4, 2, 70, 600, 16, seed=11)
    mask = qkv.sliding_window(100, 20)
    _, lse = qkv.attention(q, k, v, mask=mask, return_lse=True)
    p, lse4 = check_problem(q, k, lse, mask, None, None)
    cached = stats_of_problem(p, lse4, 4, block_q=32, block_k=128)
    monkeypatch.setattr(_stats, "_TILE_CACHE", 0)
    recomputed = stats_of_problem(p, lse4, 4, block_q=32, block_k=128)
    for a, b in zip(vars(cached).values(), vars(recomputed).values(), strict=True):
        assert torch.equal(a, b)


def test_torch_compile_traces_attention_while_recording() -> None:
    """dynamo cannot trace a ContextVar lookup: compiled calls skip recording, fullgraph holds."""
    x = torch.randn(1, 2, 9, 16)

    def f(t: Tensor) -> Tensor:
        out = qkv.attention(t, t, t, mask=qkv.causal)
        assert isinstance(out, Tensor)
        return out * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    with qkv.inspect.record(torch.nn.Identity()) as rec:
        got = compiled(x)
    assert torch.allclose(got, f(x), atol=1e-6)
    assert len(rec) == 0  # the compiled call was not recorded
    # private: the recorder's own state after the block is the unit tested
    assert qkv._recording.current() is None and qkv._recording.OPEN == 0
