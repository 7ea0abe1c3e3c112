"""``qkv explain``: through the installed console script (exit codes, stdout, files, escaping),
plus the record-based weights against the model's independent ``attention_maps`` path and the
terminal/PNG renderers on synthetic maps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv._cli import explain  # private: the command's token search and maps are units tested
from qkv.viz import AttentionMaps, png, terminal

QKV = str(Path(sys.executable).with_name("qkv"))
TEXT = "The cat sat because it was tired."
TOKENS = ["[CLS]", "the", "cat", "sat", "because", "it", "was", "tired", ".", "[SEP]"]


def qkv_explain(*args: str) -> subprocess.CompletedProcess[str]:
    # A wide terminal for rich, so that assertions on table rows do not depend on wrapping.
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("FORCE_COLOR", None)
    return subprocess.run(
        [QKV, "explain", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return qkv.models.load()


@pytest.fixture(scope="module")
def reference_maps(model: torch.nn.Module) -> torch.Tensor:
    """``[layers, heads, L, L]`` from the model's own need_weights path (not qkv.inspect)."""
    tokens, w = model.attention_maps(TEXT)  # type: ignore[operator]
    assert tokens == TOKENS
    return w


def test_record_path_equals_attention_maps(model: torch.nn.Module, reference_maps: torch.Tensor):
    maps = explain.attention_maps(model, TEXT)
    assert maps.tokens == TOKENS
    assert maps.weights.shape == (6, 12, 10, 10)
    assert torch.allclose(maps.weights, reference_maps, atol=1e-5)


def test_default_run_prints_the_table(reference_maps: torch.Tensor) -> None:
    r = qkv_explain()
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = r.stdout
    assert "Text:   The cat sat because it was tired." in out
    assert "Tokens: [CLS]0 the1 cat2 sat3 because4 it5 was6 tired7 .8 [SEP]9" in out
    assert "What does “it” (token 5) attend to?" in out
    assert "all-MiniLM-L6-v2 (6 layers × 12 heads)" in out
    # Every layer's top-3 (mean over heads) appears with its weight, as the reference says.
    for layer in range(6):
        mean = reference_maps[layer, :, 5].mean(0)  # [L]
        for j in mean.topk(3).indices.tolist():
            assert re.search(rf"{re.escape(TOKENS[j])}\s+{mean[j]:.2f}", out), (layer, j)
    # The most focused head of the last layer and its top token.
    w = reference_maps[5, :, 5].double()  # [heads, L]
    ent = -torch.special.xlogy(w, w).sum(-1)
    h = int(ent.argmin())
    assert re.search(rf"│\s+{h}\s+│", out)
    assert f"H={float(ent[h]):.2f}" in out
    assert out.count("█") > 20  # bars drawn by rich


def test_token_layer_head_top_options(reference_maps: torch.Tensor) -> None:
    r = qkv_explain("--token", "cat", "--layer", "2", "--head", "7", "--top", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "What does “cat” (token 2) attend to?" in out
    rows = re.findall(r"^│\s+(\d)\s+│", out, flags=re.MULTILINE)
    assert rows == ["2"]  # only the chosen layer
    head = reference_maps[2, 7, 2]
    for j in head.topk(2).indices.tolist():
        assert re.search(rf"{re.escape(TOKENS[j])}\s+{head[j]:.2f}", out)
    by_position = qkv_explain("--token", "#2", "--layer", "2", "--head", "7", "--top", "2")
    assert by_position.stdout == out


def test_png_and_html_files(tmp_path: Path) -> None:
    png_path, html_path = tmp_path / "map.png", tmp_path / "map.html"
    r = qkv_explain(
        "--png", str(png_path), "--html", str(html_path), "--layer", "5", "--head", "11"
    )
    assert r.returncode == 0, r.stderr
    assert f"wrote {png_path}" in r.stdout and f"wrote {html_path}" in r.stdout
    data = png_path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    page = html_path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and 'id="qkv-data"' in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page  # no CDN: one offline file


def test_hostile_text_is_escaped(tmp_path: Path) -> None:
    text = "<script>alert(1)</script> <img src=x onerror=alert(1)> [bold]it[/bold] &amp;"
    html_path = tmp_path / "x.html"
    r = qkv_explain(text, "--html", str(html_path))
    assert r.returncode == 0, r.stderr
    assert f"Text:   {text}" in r.stdout  # rich markup in the text prints literally
    page = html_path.read_text(encoding="utf-8")
    assert "<script>alert" not in page and "<img" not in page and "[bold]" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &lt;img src=x onerror=alert(1)&gt;" in page
    assert "&amp;amp;" in page  # the literal "&amp;" of the text, escaped once more


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--token", "dog"], "--token 'dog' is not a token of the text; its tokens are 0:[CLS]"),
        (["--token", "#10"], "--token #10 is out of range: the text has 10 tokens (#0..#9)"),
        (["--layer", "6"], "--layer 6 is out of range: all-MiniLM-L6-v2 has 6 layers (0..5)"),
        (["--head", "12"], "--head 12 is out of range: all-MiniLM-L6-v2 has 12 heads (0..11)"),
        (["--head", "-1"], "--head -1 is out of range"),
        (["--top", "0"], "--top must be at least 1, got 0"),
        (["--png", "/nonexistent-dir/x.png"], "the directory '/nonexistent-dir' does not exist"),
        (["--html", "/"], "--html '/' is a directory; give a file name"),
        (["--model", "/nonexistent-model"], "/nonexistent-model does not exist"),
        (["word " * 600], "the text is 602 tokens long ([CLS] and [SEP] included) but this"),
        (["--layer", "x"], "argument --layer: invalid int value: 'x'"),
    ],
)
def test_errors_are_one_line(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (``qkv.cli.main``, what the console script calls: one process start
    costs ~4 s here); the console script itself is run by the tests around."""
    from qkv.cli import main

    try:
        code = main(["explain", *args])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    r = capsys.readouterr()
    assert code == 2
    assert r.out == ""
    lines = r.err.strip().splitlines()
    assert "Traceback" not in r.err
    assert words in lines[-1]
    if args[0] != "--layer" or args[1] != "x":  # argparse prints its usage line first
        assert len(lines) == 1, r.err


def test_unwritable_output_leaves_no_file(tmp_path: Path) -> None:
    r = qkv_explain("--png", str(tmp_path / "ok.png"), "--layer", "9")
    assert r.returncode == 2 and "--layer 9 is out of range" in r.stderr
    assert not (tmp_path / "ok.png").exists()  # the write check leaves nothing behind


def test_find_token_rules() -> None:
    toks = ["[CLS]", "un", "##believ", "##able", "it", "It", "[SEP]"]
    offsets = [(0, 0), (0, 2), (2, 8), (8, 12), (13, 15), (16, 18), (0, 0)]
    text = "unbelievable it It"
    assert explain.find_token(toks, offsets, text, None) == 4  # "it" by default
    assert explain.find_token(toks, offsets, text, "It") == 5  # exact match first
    assert explain.find_token(toks, offsets, text, "UNBELIEVABLE") == 1  # a split word
    assert explain.find_token(toks, offsets, text, "#6") == 6
    assert explain.find_token(["[CLS]", "a", "[SEP]"], [(0, 0), (0, 1), (0, 0)], "a", None) == 1


# ------------------------------------------------------------------------ renderers, synthetic


def _maps(L: int = 6) -> AttentionMaps:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, L, L, generator=g).mul(3).softmax(-1)  # [layers, heads, L, L]
    tokens = ["[CLS]", "[red]x[/red]", "a-very-long-token-indeed", "b", "c", "[SEP]"][:L]
    return AttentionMaps(tokens, w, text="synthetic", model="toy")


def test_terminal_renderer_numbers() -> None:
    from rich.console import Console

    maps = _maps()
    console = Console(record=True, width=140, color_system=None)
    terminal.render(maps, focus=1, top=2, layer=None, head=None, console=console)
    out = console.export_text()
    assert "[red]x[/red]" in out  # markup-looking tokens print literally
    assert "a-very-long-t…" in out  # long tokens are cut, not wrapped
    for layer in range(3):
        h, ent = maps.most_focused_head(layer, 1)
        assert ent == pytest.approx(float(maps.entropy(layer, 1).min()))
        assert re.search(rf"│\s+{h}\s+│", out)
        for _j, w in maps.top(layer, 1, 2):
            assert f"{w:.2f}" in out


def test_attention_maps_checks_shapes() -> None:
    with pytest.raises(ValueError, match=r"weights must be \[layers, heads, L, L\] with L = 2"):
        AttentionMaps(["a", "b"], torch.zeros(1, 1, 3, 3))


@pytest.mark.parametrize(("layer", "head"), [(None, None), (1, None), (None, 2), (2, 3)])
def test_png_renderer_layouts(tmp_path: Path, layer: int | None, head: int | None) -> None:
    import matplotlib.image

    path = tmp_path / "m.png"
    png.render(_maps(), path, focus=1, layer=layer, head=head)
    img = matplotlib.image.imread(path)  # [H, W, 4]
    assert img.shape[0] > 200 and img.shape[1] > 300
    assert (img[..., :3] < 0.9).any(-1).mean() > 0.02  # not blank


def test_documented_sample_is_real_output() -> None:
    """Every line of the inspection guide's sample (but the "..." elision) is in the real
    output."""
    guide = (Path(__file__).parents[1] / "docs" / "guides" / "inspect.md").read_text("utf-8")
    section = guide[guide.index("## The main job: `qkv explain`") :]
    sample = re.search(r"```\n(Model:.*?)```", section, flags=re.DOTALL)
    assert sample is not None
    r = subprocess.run(
        [QKV, "explain", "--top", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert r.returncode == 0, r.stderr
    real = [line.rstrip() for line in r.stdout.splitlines()]
    for line in sample.group(1).splitlines():
        if line.strip() != "...":
            assert line.rstrip() in real, line


def test_hf_transformers_model_on_qkv_shows_the_same_table(reference_maps: torch.Tensor) -> None:
    """``--hf``: the same checkpoint, run by transformers itself with attn_implementation="qkv"
    (qkv.hf), recorded layer by layer: the same weights as qkv's own encoder."""
    r = qkv_explain("--hf")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "(transformers on qkv) (6 layers × 12 heads)" in out
    assert "Tokens: [CLS]0 the1 cat2 sat3 because4 it5 was6 tired7 .8 [SEP]9" in out
    for layer in range(6):
        mean = reference_maps[layer, :, 5].mean(0)  # [L]
        for j in mean.topk(3).indices.tolist():
            assert re.search(rf"{re.escape(TOKENS[j])}\s+{mean[j]:.2f}", out), (layer, j)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--hf", "/nonexistent-model"], "--hf '/nonexistent-model' is not a folder"),
        (["--hf", "--model", "smollm2"], "give either --model or --hf, not both"),
    ],
)
def test_hf_errors_are_one_line(args: list[str], words: str) -> None:
    r = qkv_explain(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert words in r.stderr.strip().splitlines()[-1]
