"""Tiny random transformers models of each family qkv.hf is tested on (tests/test_hf_*.py).

Real layer structure at toy width: the attention code paths are the model's own (GQA,
sliding-window layers, softcapping, local attention, cross-attention); only the sizes are
small. Every dropout is 0 so that a training step is deterministic under both
implementations; dropout itself is tested separately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

V = 128  # vocabulary
WINDOW = 8  # sliding window of the models that have one (shorter than the test sequences)


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], Any]  # () -> model (random weights, seeded by the caller)
    kind: str  # "causal" (a causal LM), "masked" (an encoder with an LM head), "seq2seq",
    # "extra" (tested for one feature only, in test_hf.py)


def _decoder_common() -> dict[str, Any]:
    return dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per key/value head
        max_position_embeddings=256,
        attention_dropout=0.0,
        pad_token_id=0,
    )


def _llama() -> Any:
    import transformers as T

    return T.LlamaForCausalLM(T.LlamaConfig(**_decoder_common()))


def _qwen3() -> Any:
    import transformers as T

    cfg = T.Qwen3Config(
        **_decoder_common(),
        head_dim=16,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,  # layer 0 full, layers 1-2 sliding
    )
    return T.Qwen3ForCausalLM(cfg)


def _mistral() -> Any:
    import transformers as T

    return T.MistralForCausalLM(T.MistralConfig(**_decoder_common(), sliding_window=WINDOW))


def _gemma2() -> Any:
    import transformers as T

    cfg = T.Gemma2Config(
        **_decoder_common(),
        head_dim=16,
        sliding_window=WINDOW,  # alternating sliding / full layers (the config's default)
        attn_logit_softcapping=5.0,  # small, so that the cap really bends the scores
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    )
    return T.Gemma2ForCausalLM(cfg)


def _gemma3() -> Any:
    import transformers as T

    cfg = T.Gemma3TextConfig(
        **_decoder_common(), head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16
    )
    return T.Gemma3ForCausalLM(cfg)


def _gpt2() -> Any:
    import transformers as T

    cfg = T.GPT2Config(
        vocab_size=V,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return T.GPT2LMHeadModel(cfg)


def _bert() -> Any:
    import transformers as T

    cfg = T.BertConfig(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=256,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    return T.BertForMaskedLM(cfg)


def _modernbert() -> Any:
    import transformers as T

    cfg = T.ModernBertConfig(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=256,
        local_attention=WINDOW,  # |q - k| <= 4 in the local layers
        global_attn_every_n_layers=3,  # layer 0 global, layers 1-2 local
        attention_dropout=0.0,
        mlp_dropout=0.0,
        embedding_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    return T.ModernBertForMaskedLM(cfg)


def _whisper() -> Any:
    import transformers as T

    cfg = T.WhisperConfig(
        vocab_size=V,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=32,  # input features of 64 frames
        max_target_positions=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return T.WhisperForConditionalGeneration(cfg)


def _gpt_oss() -> Any:
    import transformers as T

    cfg = T.GptOssConfig(
        **_decoder_common(),
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = T.GptOssForCausalLM(cfg)
    for layer in model.model.layers:
        layer.self_attn.sinks.data.normal_()  # the sinks start at 0: make them matter
    return model


def _t5() -> Any:
    import transformers as T

    cfg = T.T5Config(
        vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T.T5ForConditionalGeneration(cfg)


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", _llama, "causal"),
        Family("qwen3", _qwen3, "causal"),
        Family("mistral", _mistral, "causal"),
        Family("gemma2", _gemma2, "causal"),
        Family("gemma3", _gemma3, "causal"),
        Family("gpt2", _gpt2, "causal"),
        Family("bert", _bert, "masked"),
        Family("modernbert", _modernbert, "masked"),
        Family("whisper", _whisper, "seq2seq"),
        # Two more for single features: GPT-OSS's attention sinks (s_aux), T5's position bias.
        Family("gpt_oss", _gpt_oss, "extra"),
        Family("t5", _t5, "extra"),
    )
}
CAUSAL = [n for n, f in FAMILIES.items() if f.kind == "causal"]
TEXT = [n for n, f in FAMILIES.items() if f.kind in ("causal", "masked")]


def build(name: str) -> Any:
    """A fresh model of the family with the same random weights every time."""
    torch.manual_seed(0)
    return FAMILIES[name].build().eval()


def padded_batch(L: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [3, L], attention_mask [3, L])``: a left-padded row, a right-padded row
    and a full row; every length is longer than :data:`WINDOW`."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, L), generator=g)
    am = torch.ones(3, L, dtype=torch.long)
    am[0, :5] = 0
    am[1, -4:] = 0
    ids[am == 0] = 0
    return ids, am


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    """max |ref - got| / max |ref|."""
    ref, got = ref.detach().double(), got.detach().double()
    return float((ref - got).abs().max() / ref.abs().max().clamp(min=1e-30))


def pack(lengths: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(sequences, input_ids [1, total], position_ids [1, total])``: random sequences of
    these lengths packed in one row, positions restarting at each."""
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]  # [1, total]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # restarts per sequence
    return seqs, ids, pos
