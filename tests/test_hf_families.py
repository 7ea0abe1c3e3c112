"""transformers models on ``attn_implementation="qkv"`` against the same weights on ``eager``.

Every family of tests/hf_families.py, fp32: logits on a padded batch (left- and right-padded
rows, lengths beyond the sliding window), every parameter's gradient after a training step,
``output_attentions``, greedy generation (the cache path: a prefill longer than the window,
then decode steps) and packed sequences against the same sequences run one by one.

Rows that are padding are not compared: eager spreads a query row whose keys are all masked
evenly over them, qkv gives 0 (README, "Hugging Face transformers"); no real token sees them.
"""

from __future__ import annotations

import pytest
import torch

import qkv.hf  # transformers: installed by `make test` (the hf extra)
from hf_families import CAUSAL, FAMILIES, TEXT, WINDOW, build, pack, padded_batch, rel_err

qkv.hf.register()

TOL = 1e-5  # relative, fp32 (the bar; measured 2e-7 .. 2e-6)


def _models(name: str) -> tuple[object, object]:
    eager, ours = build(name), build(name)
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("qkv")
    return eager, ours


@pytest.mark.parametrize("name", TEXT)
def test_logits_match_eager_on_a_padded_batch(name: str) -> None:
    eager, ours = _models(name)
    ids, am = padded_batch()
    assert ids.shape[1] > WINDOW
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=am).logits
        got = ours(input_ids=ids, attention_mask=am).logits
    real = am.bool()
    assert rel_err(ref[real], got[real]) <= TOL


@pytest.mark.parametrize("name", TEXT)
def test_output_attentions_match_eager(name: str) -> None:
    eager, ours = _models(name)
    ids, am = padded_batch()
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=am, output_attentions=True).attentions
        got = ours(input_ids=ids, attention_mask=am, output_attentions=True).attentions
    assert len(got) == len(ref) == eager.config.num_hidden_layers
    real = am.bool()[:, None, :, None]  # [B, 1, L, 1]: rows of real tokens
    for r, g in zip(ref, got, strict=True):
        assert g is not None and g.shape == r.shape
        assert float(((r - g) * real).abs().max()) <= TOL


def _grads(model: object, ids: torch.Tensor, am: torch.Tensor, causal: bool) -> dict:
    model.train()  # type: ignore[attr-defined]
    labels = ids.clone()
    labels[am == 0] = -100
    if causal:
        # The logits of a left-padded row's last pad predict its first real token: that pad's
        # row has every key masked (eager and qkv differ there by design), so leave it out.
        first = am.argmax(-1)
        for b in range(ids.shape[0]):
            if first[b] > 0:
                labels[b, first[b]] = -100
    out = model(input_ids=ids, attention_mask=am, labels=labels)  # type: ignore[operator]
    out.loss.backward()
    named = model.named_parameters()  # type: ignore[attr-defined]
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


@pytest.mark.parametrize("name", TEXT)
def test_training_step_gradients_match_eager(name: str) -> None:
    eager, ours = _models(name)
    ids, am = padded_batch()
    causal = FAMILIES[name].kind == "causal"
    ge, gq = _grads(eager, ids, am, causal), _grads(ours, ids, am, causal)
    assert ge.keys() == gq.keys() and len(ge) > 10
    # Relative to each parameter's gradient, floored at 1/1000 of the model's largest: a
    # parameter whose true gradient is 0 (a key bias under the softmax) carries only rounding.
    G = max(float(g.abs().max()) for g in ge.values())
    for n, g in ge.items():
        scale = max(float(g.abs().max()), 1e-3 * G)
        assert float((g - gq[n]).abs().max()) <= TOL * scale, n


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", CAUSAL)
def test_greedy_generation_matches_eager(name: str, cache: str) -> None:
    """Dynamic caches (a sliding layer's cache holds the window), and static caches, for which
    ``generate`` prepares the masks ahead of the forward and the model passes them through."""
    eager, ours = _models(name)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 20), generator=g)  # a prefill longer than the window
    am = torch.ones_like(ids)
    am[1, :7] = 0  # generation pads on the left
    ids[am == 0] = 0
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    if cache == "static":
        kw["cache_implementation"] = "static"
    ref = eager.generate(ids, attention_mask=am, **kw)
    got = ours.generate(ids, attention_mask=am, **kw)
    assert ref.shape == (2, 36)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("cu_seq_lens", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_batch_equals_sequences_one_by_one(name: str, cu_seq_lens: bool) -> None:
    _, ours = _models(name)
    lengths = [7, 13, 6]  # 13 > the window
    seqs, ids, pos = pack(lengths)
    kw: dict = {"position_ids": pos, "use_cache": False}
    if cu_seq_lens:  # what DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13, max_length_k=13)
    with torch.no_grad():
        packed = ours(input_ids=ids, **kw).logits[0]  # [total, V]
        alone = torch.cat([ours(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    assert rel_err(alone, packed) <= TOL


@pytest.mark.parametrize("name", ["bert", "modernbert"])
def test_packed_encoder_batch_with_cu_seq_lens(name: str) -> None:
    """An encoder gets no mask for a packed row (transformers finds packing only for causal
    masks); the ``cu_seq_lens_*`` keywords keep the sequences apart."""
    _, ours = _models(name)
    lengths = [9, 12, 5]
    seqs, ids, pos = pack(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw: dict = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12)
    if name == "bert":
        kw["position_ids"] = pos
    with torch.no_grad():
        packed = ours(input_ids=ids, **kw).logits[0]
        alone = ours(input_ids=seqs[0][None]).logits[0]
    assert rel_err(alone, packed[: lengths[0]]) <= TOL


def test_whisper_encoder_decoder_matches_eager() -> None:
    """Cross-attention (decoder queries, encoder keys) and causal decoder self-attention."""
    eager, ours = _models("whisper")
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(2, 16, 64, generator=g)  # [B, mel bins, frames]
    dec = torch.randint(3, 128, (2, 12), generator=g)
    with torch.no_grad():
        ref = eager(input_features=feats, decoder_input_ids=dec, output_attentions=True)
        got = ours(input_features=feats, decoder_input_ids=dec, output_attentions=True)
    assert rel_err(ref.logits, got.logits) <= TOL
    for kind in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        r, o = getattr(ref, kind), getattr(got, kind)
        assert len(r) == len(o) == 2
        for a, b in zip(r, o, strict=True):
            assert b is not None and float((a - b).abs().max()) <= TOL, kind
    ge = _whisper_grads(eager, feats, dec)
    gq = _whisper_grads(ours, feats, dec)
    G = max(float(g.abs().max()) for g in ge.values())
    for n, g_ in ge.items():
        assert float((g_ - gq[n]).abs().max()) <= TOL * max(float(g_.abs().max()), 1e-3 * G), n
    kw = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(eager.generate(feats, **kw), ours.generate(feats, **kw))


def _whisper_grads(model: object, feats: torch.Tensor, dec: torch.Tensor) -> dict:
    model.train()  # type: ignore[attr-defined]
    out = model(input_features=feats, decoder_input_ids=dec, labels=dec)  # type: ignore[operator]
    out.loss.backward()
    named = model.named_parameters()  # type: ignore[attr-defined]
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


@pytest.mark.parametrize("name", ["mistral", "gemma2", "bert"])
def test_bf16_error_within_eagers(name: str) -> None:
    """In bfloat16, qkv's logits are as close to the float32 model's as eager's bfloat16 are
    (the house rule: within 2x plain PyTorch's error in the same dtype)."""
    ids, am = padded_batch()
    real = am.bool()
    ref = build(name)
    ref.set_attn_implementation("eager")
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=am).logits[real]
        errs = {}
        for impl in ("eager", "qkv"):
            m = build(name).to(torch.bfloat16)
            m.set_attn_implementation(impl)
            errs[impl] = rel_err(want, m(input_ids=ids, attention_mask=am).logits.float()[real])
    assert errs["qkv"] <= 2 * errs["eager"], errs
