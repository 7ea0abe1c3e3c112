"""transformers models on ``attn_implementation="qkv"`` inside ``torch.compile(fullgraph=True)``.

Every text family of tests/hf_families.py compiles a training step's forward and loss as one
graph (``backend="aot_eager"``: what inductor would compile, without code generation), and
its logits and every parameter's gradient equal the same weights on ``eager``, uncompiled.
transformers builds its mask closures inside the compiled function, where qkv cannot read
what they close over; there qkv keeps them as mask_mods (exact, evaluated tile by tile) and
keeps the padding mask as a key mask, instead of reading values to choose a kind.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import qkv.hf  # transformers: installed by `make test` (the hf extra)
from hf_families import CAUSAL, TEXT, build, pack, padded_batch, rel_err

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-inductor-"))
qkv.hf.register()

TOL = 1e-5  # relative, fp32, as tests/test_hf_families.py


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(model: Any, fn: Any, ids: torch.Tensor, am: torch.Tensor, labels: torch.Tensor) -> Any:
    model.train()
    model.zero_grad()
    logits, loss = fn(ids, am, labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


# Extended (make test-all), 3-6 s each: Qwen3 and Gemma 3 take the paths Mistral and Gemma 2
# take (sliding layers; softcap and alternating windows), GPT-2 Llama's (causal and padding),
# ModernBERT Mistral's (a window closure kept as a mask_mod) with BERT's padding.
_EXTENDED = ("qwen3", "gemma3", "gpt2", "modernbert")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.extended) if n in _EXTENDED else n for n in TEXT],
)
def test_compiled_training_step_matches_eager(name: str) -> None:
    eager, ours = build(name), build(name)
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("qkv")
    ids, am = padded_batch()
    # the loss at each position's own logits (not shifted): a pad's row, which sees no key
    # under a causal mask (eager and qkv differ there by design, README), is left out with
    # every pad
    labels = ids.masked_fill(am == 0, -100)

    def run(model: Any) -> Any:
        def fn(ids: torch.Tensor, am: torch.Tensor, labels: torch.Tensor) -> Any:
            # the loss outside the model: transformers' own loss lookup logs a warning for
            # some configs (GPT-2), which dynamo cannot trace, with any attention
            logits = model(input_ids=ids, attention_mask=am).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return logits, loss

        return fn

    ref_logits, ref_grads = _step(eager, run(eager), ids, am, labels)
    compiled = torch.compile(run(ours), backend="aot_eager", fullgraph=True)
    logits, grads = _step(ours, compiled, ids, am, labels)
    real = am.bool()
    assert rel_err(ref_logits[real], logits[real]) <= TOL
    assert ref_grads.keys() == grads.keys() and len(grads) > 10
    G = max(float(g.abs().max()) for g in ref_grads.values())
    for n, g in ref_grads.items():
        scale = max(float(g.abs().max()), 1e-3 * G)
        assert float((g - grads[n]).abs().max()) <= TOL * scale, n


def test_new_lengths_share_one_dynamic_graph() -> None:
    """A training loop's batches come in other lengths: the second length makes dynamo trace
    with a symbolic one, and that graph serves every later length (as with ``sdpa``), equal
    to eager: no mask's name or probe may read the length."""
    eager, ours = build("mistral"), build("mistral")
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("qkv")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda i, a: ours(input_ids=i, attention_mask=a).logits, backend=counter, fullgraph=True
    )
    for L in (24, 30, 41):
        g = torch.Generator().manual_seed(L)
        ids = torch.randint(3, 128, (2, L), generator=g)
        am = torch.ones_like(ids)
        am[0, :5] = 0
        with torch.no_grad():
            got, ref = compiled(ids, am), eager(input_ids=ids, attention_mask=am).logits
        assert rel_err(ref[am.bool()], got[am.bool()]) <= TOL, L
    assert counter.frame_count == 2


@pytest.mark.parametrize("name", ["llama", pytest.param("mistral", marks=pytest.mark.extended)])
def test_compiled_packed_batch_equals_sequences_one_by_one(name: str) -> None:
    """Position ids that restart: transformers' packed-sequence closure, made in the graph,
    keeps the sequences apart (one sequence is longer than Mistral's window)."""
    assert name in CAUSAL
    ours = build(name)
    ours.set_attn_implementation("qkv")
    seqs, ids, pos = pack([7, 13, 6])
    compiled = torch.compile(
        lambda i, p: ours(input_ids=i, position_ids=p, use_cache=False).logits,
        backend="aot_eager",
        fullgraph=True,
    )
    with torch.no_grad():
        packed = compiled(ids, pos)[0]
        alone = torch.cat([ours(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    assert rel_err(alone, packed) <= TOL


def test_compiled_whisper_matches_eager() -> None:
    """Cross-attention and causal decoder self-attention in one graph."""
    eager, ours = build("whisper"), build("whisper")
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("qkv")
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(2, 16, 64, generator=g)
    dec = torch.randint(3, 128, (2, 12), generator=g)
    compiled = torch.compile(
        lambda f, d: ours(input_features=f, decoder_input_ids=d).logits,
        backend="aot_eager",
        fullgraph=True,
    )
    with torch.no_grad():
        ref = eager(input_features=feats, decoder_input_ids=dec).logits
        got = compiled(feats, dec)
    assert rel_err(ref, got) <= TOL


def test_compiled_static_cache_generation_matches_eager() -> None:
    """transformers' recipe for compiled decoding: a static cache and the forward compiled
    with fullgraph; prefill longer than the window, then 8 greedy steps, on a left-padded
    batch, token for token as eager."""
    eager, ours = build("mistral"), build("mistral")
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("qkv")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 20), generator=g)
    am = torch.ones_like(ids)
    am[1, :7] = 0
    ids[am == 0] = 0
    kw: dict = dict(
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        cache_implementation="static",
    )
    ref = eager.generate(ids, attention_mask=am, **kw)
    ours.forward = torch.compile(ours.forward, backend="aot_eager", fullgraph=True)
    got = ours.generate(ids, attention_mask=am, **kw)
    assert ref.shape == (2, 28)
    assert torch.equal(ref, got)
