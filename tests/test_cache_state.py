"""KV caches as state: saving (pickle, torch.save), copying (deepcopy) and
threads. A saved or copied cache continues decoding exactly, keeps its layer when it travels
with it, and one cache fed from two threads at once raises instead of corrupting itself."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import qkv

Tensor = torch.Tensor

D_MODEL = 48
CACHES: dict[str, Callable[[], Any]] = {
    "kv": lambda: qkv.KVCache(40),
    # window 5 < the 10 tokens filled: the ring has wrapped when it is saved.
    "window": lambda: qkv.SlidingWindowCache(5),
}
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _module(seed: int = 0) -> qkv.MultiHeadAttention:
    torch.manual_seed(seed)
    return qkv.MultiHeadAttention(D_MODEL, 6, n_kv_heads=2, rope=True, qk_norm=True).eval()


def _filled(make_cache: Callable[[], Any], mode: str = "no_grad") -> tuple[Any, Any, Tensor]:
    """A module, its cache after a prefill of 7 tokens and 3 single steps, and the next
    inputs (5 single tokens, then a chunk of 3); the same ones at every call."""
    mha, cache = _module(), make_cache()
    x = torch.randn(1, 18, D_MODEL)
    with MODES[mode]():
        mha(x[:, :7], cache=cache, mask=qkv.causal)
        for i in range(7, 10):
            mha(x[:, i : i + 1], cache=cache, mask=qkv.causal)
    assert cache.length == 10
    return mha, cache, x[:, 10:]


def _continue(mha: Any, cache: Any, rest: Tensor, mode: str = "no_grad") -> Tensor:
    with MODES[mode]():
        outs = [mha(rest[:, i : i + 1], cache=cache, mask=qkv.causal) for i in range(5)]
        outs.append(mha(rest[:, 5:], cache=cache, mask=qkv.causal))
    return torch.cat(outs, dim=1)


def _pickle(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))


def _torch_save(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


SAVES = {"pickle": _pickle, "torch.save": _torch_save, "deepcopy": copy.deepcopy}


def _refuses(mha: Any, cache: Any) -> None:
    """``mha`` is not the cache's layer: a step is refused before anything changes."""
    n = cache.length
    with torch.no_grad(), pytest.raises(ValueError, match="belongs to one layer"):
        mha(torch.randn(1, 1, mha.d_model), cache=cache, mask=qkv.causal)
    assert cache.length == n


# ------------------------------------------------------------------- saved with its layer


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("save", list(SAVES))
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("cache_first", [False, True], ids=["layer-first", "cache-first"])
def test_a_cache_saved_with_its_layer_keeps_it_and_continues_exactly(kind, save, mode, cache_first):
    mha, cache, rest = _filled(CACHES[kind], mode)
    if cache_first:
        cache2, mha2 = SAVES[save]((cache, mha))
    else:
        mha2, cache2 = SAVES[save]((mha, cache))
    assert cache2 is not cache and cache2.length == 10
    assert repr(cache2) == repr(cache)
    _refuses(mha, cache2)  # the copy belongs to the copied layer, not the original
    _refuses(mha2, cache)  # and the original still belongs to the original layer
    got = _continue(mha2, cache2, rest, mode)
    want = _continue(mha, cache, rest, mode)  # the original is unaffected by the copy's steps
    assert torch.equal(got, want)
    assert cache2.length == cache.length == 18


class Holder(nn.Module):
    """A layer and its cache, both attributes of a module."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = _module()
        self.cache = qkv.KVCache(40)

    def forward(self, x: Tensor) -> Tensor:
        return self.mha(x, cache=self.cache, mask=qkv.causal)


def test_a_module_holding_its_cache_saves_and_continues_exactly():
    """A module that keeps its layer and cache as attributes (torch.save(model))."""

    model = Holder()
    x = torch.randn(2, 12, D_MODEL)
    with torch.inference_mode():
        model(x[:, :8])
    got = []
    for save in (_torch_save, _pickle, copy.deepcopy):
        twin = save(model)
        _refuses(model.mha, twin.cache)
        with torch.inference_mode():
            got.append(torch.cat([twin(x[:, i : i + 1]) for i in range(8, 12)], dim=1))
        assert twin.cache.length == 12 and model.cache.length == 8
    with torch.inference_mode():
        want = torch.cat([model(x[:, i : i + 1]) for i in range(8, 12)], dim=1)
    assert all(torch.equal(g, want) for g in got)


def test_a_decoder_and_its_caches_save_together_and_continue_exactly():
    from qkv.models.llama import LlamaConfig, LlamaDecoder

    config = LlamaConfig(
        vocab_size=50,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_positions=64,
        rope_base=10000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        name="tiny",
    )
    torch.manual_seed(0)
    model = LlamaDecoder(config).eval()
    ids = torch.randint(0, 50, (1, 12))
    caches = model.new_caches(16)
    with torch.inference_mode():
        model(ids[:, :9], caches=caches)
    model2, caches2 = _torch_save((model, caches))
    for i, (c, c2) in enumerate(zip(caches, caches2, strict=True)):
        _refuses(model.layers[i].attention, c2)
        _refuses(model2.layers[1 - i].attention, c2)  # each cache keeps its own layer
        assert c2.length == c.length == 9
    with torch.inference_mode():
        for i in range(9, 12):
            got = model2(ids[:, i : i + 1], caches=caches2).logits
            want = model(ids[:, i : i + 1], caches=caches).logits
            assert torch.equal(got, want)


# --------------------------------------------------------------------- saved on its own


@pytest.mark.parametrize("save", list(SAVES))
@pytest.mark.parametrize("kind", list(CACHES))
def test_a_cache_saved_alone_is_unowned_and_the_first_layer_adopts_it(kind, save):
    """Saved or copied without its layer, a cache cannot name it: it loads unowned (its
    tokens kept), and the first layer that uses it adopts it, e.g. the layer that filled it
    (a decoding branch from a cached prompt, or a model rebuilt from its weights)."""
    mha, cache, rest = _filled(CACHES[kind])
    twin = SAVES[save](cache)
    assert twin.length == 10
    assert twin._k.data_ptr() != cache._k.data_ptr()  # nothing shared with the original
    rebuilt = _module()  # the same weights, a different module object
    got = _continue(rebuilt, twin, rest)
    _refuses(mha, twin)  # adopted by `rebuilt`
    _refuses(rebuilt, cache)  # the original still belongs to `mha`
    assert torch.equal(got, _continue(mha, cache, rest))


def test_a_cache_saved_alone_forgets_a_layer_that_is_gone():
    """The layer a cache was filled by can be collected; the cache then has no owner."""
    mha, cache, rest = _filled(CACHES["kv"])
    state = pickle.dumps((mha, cache))
    twin = pickle.loads(state)[1]  # its layer, loaded with it, is garbage at once
    gc.collect()
    got = _continue(_module(), twin, rest)
    assert torch.equal(got, _continue(mha, cache, rest))


# ------------------------------------------------------------------------------ threads


def _hold_busy(cache: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, Any]:
    """Patch ``cache`` so that the first step that reaches its ``_extend`` (in the middle of a
    step: keys projected, nothing attended yet) stops there until ``go`` is set. Returns
    ``(inside, go)``: ``inside`` is set once a step is held."""
    inside, go = threading.Event(), threading.Event()
    extend = cache._extend

    def held(*args: Any, **kw: Any) -> Any:
        if not inside.is_set():
            inside.set()
            assert go.wait(10), "the test never released the held step"
        return extend(*args, **kw)

    monkeypatch.setattr(cache, "_extend", held)
    return inside, go


@pytest.mark.parametrize("kind", list(CACHES))
def test_one_cache_fed_from_two_threads_at_once_raises(kind, monkeypatch):
    mha, cache, rest = _filled(CACHES[kind])
    ref_mha, ref_cache, _ = _filled(CACHES[kind])  # the same module, inputs and cache
    want = _continue(ref_mha, ref_cache, rest)
    inside, go = _hold_busy(cache, monkeypatch)
    outs: list[Tensor] = []
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with torch.no_grad():
                outs.append(mha(rest[:, :1], cache=cache, mask=qkv.causal))
        except BaseException as e:  # pragma: no cover - reported by the assert below
            errors.append(e)

    a = threading.Thread(target=first, name="decoder-A")
    a.start()
    try:
        assert inside.wait(10)
        # While thread A is inside its step, every use of the cache from here is refused
        # before it changes anything.
        with torch.no_grad(), pytest.raises(RuntimeError) as info:
            mha(rest[:, :1], cache=cache, mask=qkv.causal)
        msg = str(info.value)
        assert type(cache).__name__ in msg and "decoder-A" in msg
        assert "one decoding stream at a time" in msg and "own cache" in msg
        with pytest.raises(RuntimeError, match="one decoding stream at a time"):
            cache.truncate(3) if kind == "kv" else cache.reset()
        with pytest.raises(RuntimeError, match="one decoding stream at a time"):
            pickle.dumps(cache)
    finally:
        go.set()
        a.join(10)
    assert not errors and cache.length == 11  # thread A's step went through, alone

    # A step that raises (here in a mask_mod) frees the cache as well.
    def broken(b, h, q, k):
        raise RuntimeError("boom")

    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        mha(rest[:, 1:3], cache=cache, mask=broken)
    # One thread after the other is fine: a third thread continues where A stopped.
    more: list[Tensor] = []
    c = threading.Thread(target=lambda: more.append(_continue_from(mha, cache, rest, 1)))
    c.start()
    c.join(30)
    assert len(more) == 1 and torch.equal(torch.cat([outs[0], more[0]], dim=1), want)


def _continue_from(mha: Any, cache: Any, rest: Tensor, start: int) -> Tensor:
    with torch.no_grad():
        outs = [mha(rest[:, i : i + 1], cache=cache, mask=qkv.causal) for i in range(start, 5)]
        outs.append(mha(rest[:, 5:], cache=cache, mask=qkv.causal))
    return torch.cat(outs, dim=1)


def test_a_nested_step_on_the_same_cache_raises(monkeypatch):
    """A step that re-enters the cache from its own thread (say, a score_mod that calls the
    layer again) would interleave two steps just as two threads do."""
    mha, cache, rest = _filled(CACHES["kv"])
    extend = cache._extend
    nested: list[BaseException] = []
    entered = threading.Event()

    def reentrant(*args: Any, **kw: Any) -> Any:
        if not entered.is_set():  # re-enter once (else the nested step would recurse here)
            entered.set()
            try:
                mha(rest[:, :1], cache=cache, mask=qkv.causal)
                nested.append(AssertionError("the nested step went through"))
            except RuntimeError as e:
                nested.append(e)
        return extend(*args, **kw)

    monkeypatch.setattr(cache, "_extend", reentrant)
    with torch.no_grad():
        mha(rest[:, :1], cache=cache, mask=qkv.causal)
    assert len(nested) == 1 and "already inside a step" in str(nested[0])
    assert cache.length == 11
