"""qkv.hf's pieces: registration, the mask function against transformers' own dense masks, the
attention function's keywords (sinks, position bias, dropout, errors), recording a model."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers as T
from transformers import masking_utils as mu

import qkv
import qkv.hf
from hf_families import build, padded_batch, rel_err
from qkv._core.kinds import classify_mask  # which kind a translated mask is: the point of the test
from qkv.hf import HFMask, mask_function

qkv.hf.register()


def _dense(m: HFMask) -> torch.Tensor:
    """The qkv mask of ``m`` evaluated at every position of its buffer: [B, 1, Lq, Lk]."""
    B, _, Lq, Lk = m.shape
    if m.mask is None:
        return torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    mod = _kind(m.mask).mask_mod
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    i, j = torch.arange(Lq).view(1, 1, Lq, 1), torch.arange(Lk).view(1, 1, 1, Lk)
    return mod(b, h, i, j).expand(B, 1, Lq, Lk)


def _kind(mask: object) -> Any:
    return mask.kind if isinstance(mask, qkv.BlockMask) else classify_mask(mask)


def _sdpa_dense(**kw: Any) -> torch.Tensor:
    out = mu.sdpa_mask(allow_is_causal_skip=False, **kw)
    B, Lq, Lk = kw["batch_size"], kw["q_length"], kw["kv_length"]
    return torch.ones(B, 1, Lq, Lk, dtype=torch.bool) if out is None else out


_PAD = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 9 + [0] * 3]).bool()  # [2, 12]
_HOLES = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1], [0] * 3 + [1] * 9]).bool()
CASES = {
    "causal": dict(mask_function=mu.causal_mask_function),
    "causal, padding": dict(mask_function=mu.causal_mask_function, attention_mask=_PAD),
    "window": dict(mask_function=mu.sliding_window_causal_mask_function(4)),
    "window, padding": dict(
        mask_function=mu.sliding_window_causal_mask_function(4), attention_mask=_PAD
    ),
    "bidirectional window": dict(mask_function=mu.sliding_window_bidirectional_mask_function(2)),
    "bidirectional, padding": dict(
        mask_function=mu.bidirectional_mask_function, attention_mask=_PAD
    ),
    "padding with holes": dict(mask_function=mu.causal_mask_function, attention_mask=_HOLES),
    "chunked": dict(
        mask_function=mu.chunked_causal_mask_function(5, torch.tensor([0, 2])),
        attention_mask=_PAD,
    ),
    "packed": dict(
        mask_function=mu.and_masks(
            mu.causal_mask_function,
            mu.packed_sequence_mask_function(torch.tensor([[0] * 5 + [1] * 7] * 2)),
        )
    ),
    "packed, two rows": dict(
        mask_function=mu.and_masks(
            mu.causal_mask_function,
            mu.packed_sequence_mask_function(torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])),
        )
    ),
    "or overlay": dict(
        mask_function=mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 3)
    ),
}
FRAMES = {  # (q_length, kv_length, q_offset, kv_offset)
    "prefill": (12, 12, 0, 0),
    "chunk after a cache": (4, 12, 8, 0),
    "decode": (1, 12, 11, 0),
    "sliding cache": (3, 6, 9, 6),
}


# transformers finds packed sequences only without a cache, i.e. only in the prefill frame.
PAIRS = [(c, f) for c in CASES for f in FRAMES if "packed" not in c or f == "prefill"]


@pytest.mark.parametrize(("case", "frame"), PAIRS)
def test_mask_function_equals_transformers_dense_mask(case: str, frame: str) -> None:
    Lq, Lk, qo, ko = FRAMES[frame]
    kw = dict(CASES[case])
    if "attention_mask" in kw:
        kw["attention_mask"] = kw["attention_mask"][:, : ko + Lk]
    common = dict(batch_size=2, q_length=Lq, kv_length=Lk, q_offset=qo, kv_offset=ko)
    got = mask_function(**common, **kw)  # type: ignore[arg-type]
    assert got.shape == (2, 1, Lq, Lk)
    assert not isinstance(got.mask, torch.Tensor)  # never a dense mask
    assert torch.equal(_dense(got), _sdpa_dense(**common, **kw))


def test_mask_kinds_reach_their_kernels() -> None:
    causal = mask_function(2, 64, 64, mask_function=mu.causal_mask_function)
    assert causal.mask is qkv.causal  # SDPA's is_causal path
    q = torch.randn(2, 4, 64, 16)
    assert qkv.plan(q, q, q, mask=causal.mask).backend == "sdpa"
    right = mask_function(2, 12, 12, attention_mask=_PAD[[1, 1]])
    right_kind = _kind(right.mask)  # causal and padding lengths: a band and a key range
    assert right_kind.terms.causal and right_kind.terms.keys is not None
    assert right_kind.terms.only(band=True, keys=True)
    window = mask_function(1, 512, 512, mask_function=mu.sliding_window_causal_mask_function(64))
    assert _kind(window.mask).is_band
    q = torch.randn(1, 2, 512, 16)
    assert "band" in qkv.plan(q, q, q, mask=window.mask).forward
    step = mask_function(1, 1, 64, q_offset=63, mask_function=mu.causal_mask_function)
    assert step.mask is None  # one query row sees every cached key: unmasked
    left = mask_function(2, 12, 12, attention_mask=_PAD)  # left and right padding
    parts = _kind(left.mask).parts  # each row's key range: planned without evaluation
    assert [p.is_causal for p in parts] == [True, False] and parts[1].terms.keys is not None
    holes = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]]).bool()
    odd = mask_function(1, 12, 12, attention_mask=holes)
    assert isinstance(odd.mask, qkv.BlockMask)  # evaluated once, reused by every layer


def test_register_is_idempotent_and_fills_both_interfaces() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert qkv.hf.register() == "qkv" == qkv.hf.register()
    assert AttentionInterface._global_mapping["qkv"] is qkv.hf.attention_forward
    assert AttentionMaskInterface._global_mapping["qkv"] is qkv.hf.mask_function
    assert qkv.hf.register(name="qkv-test") == "qkv-test"
    with pytest.raises(ValueError, match="sdpa"):
        qkv.hf.register(name="sdpa")


def test_from_pretrained_with_attn_implementation_qkv(tmp_path: Any) -> None:
    ref = build("mistral")
    ref.save_pretrained(tmp_path)
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="qkv").eval()
    assert model.config._attn_implementation == "qkv"
    ids, am = padded_batch()
    with torch.no_grad():
        ref.set_attn_implementation("eager")
        want, got = ref(ids, attention_mask=am).logits, model(ids, attention_mask=am).logits
    assert rel_err(want[am.bool()], got[am.bool()]) <= 1e-5


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_import_qkv_does_not_import_transformers() -> None:
    r = _run("import sys, qkv; print('transformers' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_importing_qkv_hf_registers_qkv() -> None:
    """A new process (registration is process-global): before the import transformers refuses
    the name, after ``import qkv.hf`` alone a model loads and runs with it."""
    code = (
        "import torch, transformers as T\n"
        "cfg = T.MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)\n"
        "try:\n"
        "    T.MistralForCausalLM._from_config(cfg, attn_implementation='qkv')\n"
        "    print('loaded before the import')\n"
        "except Exception as e:\n"
        "    print('refused before the import')\n"
        "import qkv.hf\n"
        "m = T.MistralForCausalLM._from_config(cfg, attn_implementation='qkv').eval()\n"
        "with torch.no_grad():\n"
        "    out = m(torch.randint(0, 32, (1, 9))).logits\n"
        "print(m.config._attn_implementation, tuple(out.shape))\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["refused before the import", "qkv (1, 9, 32)"]


def test_import_qkv_hf_without_transformers_names_the_extra() -> None:
    r = _run("import sys; sys.modules['transformers'] = None; import qkv.hf")
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "pip install 'qkv[hf]'" in r.stderr


def test_attention_sinks_s_aux_match_eager_with_gradients() -> None:
    eager, ours = build("gpt_oss"), build("gpt_oss")
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("qkv")
    ids, am = padded_batch()
    real = am.bool()
    with torch.no_grad():
        ref = eager(ids, attention_mask=am, output_attentions=True)
        got = ours(ids, attention_mask=am, output_attentions=True)
    assert rel_err(ref.logits[real], got.logits[real]) <= 1e-5
    for r, g in zip(ref.attentions, got.attentions, strict=True):
        assert float(((r - g) * real[:, None, :, None]).abs().max()) <= 1e-5
    labels = torch.where(am.bool(), ids, -100)
    labels[0, 5] = -100  # predicted from a fully masked pad row (see test_hf_families.py)
    for m in (eager, ours):
        m.train()
        m(ids, attention_mask=am, labels=labels).loss.backward()
    se = eager.model.layers[0].self_attn.sinks.grad
    sq = ours.model.layers[0].self_attn.sinks.grad
    assert se is not None and sq is not None and float(se.abs().max()) > 0
    assert rel_err(se, sq) <= 1e-5


def test_t5_position_bias_matches_eager() -> None:
    eager, ours = build("t5"), build("t5")
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("qkv")
    ids, am = padded_batch()
    kw = dict(input_ids=ids, attention_mask=am, decoder_input_ids=ids[:, :10])
    with torch.no_grad():
        assert rel_err(eager(**kw).logits, ours(**kw).logits) <= 1e-5


def test_dropout_reaches_qkv_only_in_training_and_gqa_is_not_expanded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qkv.hf import _attention

    seen: list[float] = []
    real = _attention.attention

    def spy(*args: Any, **kw: Any) -> Any:
        q, k, v = args
        assert q.shape[1] == 4 and k.shape[1] == v.shape[1] == 2  # GQA as is: no repeat_kv
        seen.append(kw["dropout_p"])
        return real(*args, **kw)

    monkeypatch.setattr(_attention, "attention", spy)
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.25,
    )  # fmt: skip
    model = T.LlamaForCausalLM(cfg)
    model.set_attn_implementation("qkv")
    ids = torch.randint(0, 128, (1, 16))
    model.eval()
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert seen == [0.0, 0.0, 0.0, 0.0] and torch.equal(a, b)
    model.train()
    c, d = model(ids).logits, model(ids).logits
    assert seen[4:] == [0.25] * 4
    assert not torch.equal(c, d) and torch.isfinite(c).all()


def test_unknown_attention_keyword_is_refused_naming_the_model() -> None:
    q = torch.randn(1, 2, 5, 8)
    layer = torch.nn.Linear(1, 1)
    with pytest.raises(NotImplementedError, match="indices=Tensor of Linear"):
        qkv.hf.attention_forward(layer, q, q, q, None, indices=torch.tensor([1]))


def test_a_mask_for_other_lengths_is_refused() -> None:
    q = torch.randn(1, 2, 5, 8)
    m = mask_function(1, 5, 7, mask_function=mu.causal_mask_function)
    with pytest.raises(ValueError, match="built for Lq=5, Lk=7 but its query and keys have"):
        qkv.hf.attention_forward(torch.nn.Module(), q, q, q, m)


def test_a_prepared_mask_passes_through_the_mask_function() -> None:
    """generate prepares masks ahead for static caches and the model hands them back."""
    m = mask_function(2, 3, 12, q_offset=9, mask_function=mu.causal_mask_function)
    assert mask_function(2, 3, 12, q_offset=9, attention_mask=m) is m  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"prepared for \[2, 1, 3, 12\] was passed where"):
        mask_function(2, 4, 12, attention_mask=m)  # type: ignore[arg-type]


def test_fully_masked_rows_are_zero_never_nan() -> None:
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    pad = torch.tensor([[0, 0, 1, 1, 1]]).bool()
    m = mask_function(1, 5, 5, mask_function=mu.causal_mask_function, attention_mask=pad)
    out, _ = qkv.hf.attention_forward(torch.nn.Module(), q, q, q, m)  # [1, 5, 2, 8]
    assert torch.equal(out[0, :2], torch.zeros(2, 2, 8))  # rows 0, 1 see only padding
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_record_names_transformers_layers_and_feeds_the_viewer() -> None:
    model = build("llama")
    model.set_attn_implementation("qkv")
    ids, am = padded_batch()
    with torch.no_grad(), qkv.inspect.record(model) as rec:
        model(ids, attention_mask=am)
    names = [f"model.layers.{i}.self_attn" for i in range(3)]
    assert rec.layers == names
    eager = build("llama")
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        ref = eager(ids, attention_mask=am, output_attentions=True).attentions
    real = am.bool()[:, None, :, None]
    for name, r in zip(names, ref, strict=True):
        assert float(((rec[name].weights() - r) * real).abs().max()) <= 1e-5

    class Tok:
        def __call__(self, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.tensor([[5 + len(w) for w in text.split()]])}

        def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
            return [f"t{i}" for i in ids]

    maps = qkv.hf.attention_maps(model, Tok(), "the cat sat because it was tired")
    assert maps.weights.shape == (3, 4, 7, 7)
    assert torch.allclose(maps.weights.sum(-1), torch.ones(3, 4, 7))
    assert float(maps.weights.triu(1).abs().max()) == 0.0  # causal: nothing above the diagonal
    from rich.console import Console

    from qkv.viz import terminal

    console = Console(record=True, width=120)
    terminal.render(maps, focus=4, top=3, layer=None, head=None, console=console)
    assert "t7" in console.export_text()
