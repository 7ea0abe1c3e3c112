"""``qkv explain --model smollm2`` and ``qkv generate``, through the console script."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoder_testing import one_thread, smollm2
from qkv import cli
from qkv._cli import explain  # private: the record-based maps are a unit tested here

pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_thread")
__all__ = ["one_thread"]  # the fixture, imported for pytest to find

QKV = str(Path(sys.executable).with_name("qkv"))
TEXT = "The cat sat because it was tired."
SPEED = re.compile(
    r"\[SmolLM2-135M-Instruct on qkv: prompt (\d+) tokens at [\d.]+ tokens/s, "
    r"decode (\d+) tokens at [\d.]+ tokens/s\]"
)


def run_qkv(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    env.pop("FORCE_COLOR", None)
    return subprocess.run([QKV, *args], capture_output=True, text=True, timeout=300, env=env)


def test_explain_record_path_equals_attention_maps() -> None:
    model = smollm2()
    maps = explain.attention_maps(model, TEXT)
    tokens, w = model.attention_maps(TEXT)
    assert maps.tokens == [t.strip() for t in tokens] == [*TEXT[:-1].split(), "."]
    assert torch.allclose(maps.weights, w, atol=1e-5)


def test_explain_smollm2_table_says_it_is_causal(tmp_path: Path) -> None:
    png, page = tmp_path / "maps.png", tmp_path / "maps.html"
    r = run_qkv("explain", "--model", "smollm2", "--png", str(png), "--html", str(page))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Model:  SmolLM2-135M-Instruct (30 layers × 9 heads)" in out
    assert "Tokens: The0 cat1 sat2 because3 it4 was5 tired6 .7" in out
    assert "“it” (token 4) can attend only to: The cat sat because it" in " ".join(out.split())
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 3 * 30  # --top 3 tokens per layer, all of them visible to "it"
    for line in rows:  # the table lists only tokens "it" can see, never a later one
        assert not re.search(r"\b(was|tired)\b", line), line
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = page.read_text(encoding="utf-8")
    assert "because" in html and "SmolLM2-135M-Instruct" in html


def test_generate_streams_and_ends_with_the_speed_line(monkeypatch) -> None:
    writes: list[str] = []

    class Out(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

    monkeypatch.setattr(sys, "stdout", Out())
    assert cli.main(["generate", "Once upon a time", "--max-new-tokens", "12"]) == 0
    text = "".join(writes)
    assert len(writes) > 3  # piece by piece, not one write at the end
    assert writes[0] != "" and not writes[0].startswith("\n[")
    body, speed = text.rsplit("\n", 2)[0], text.rstrip("\n").rsplit("\n", 1)[1]
    m = SPEED.fullmatch(speed)
    assert m and m.group(2) == "12", speed
    assert body == smollm2().generate("Once upon a time", max_new_tokens=12)


def test_generate_chat_sampling_is_seeded() -> None:
    """The console script's sampled text is the library's with the same seed (seeded sampling
    repeating itself is the library's test; a second process here would add ~4 s)."""
    args = ("generate", "Name a fruit.", "--chat", "--temperature", "0.8", "--seed", "3")
    a = run_qkv(*args, "--max-new-tokens", "8", "--threads", "1")
    assert a.returncode == 0, a.stderr
    m = SPEED.fullmatch(a.stdout.splitlines()[-1])
    assert m and int(m.group(1)) > 20  # the chat template's system turn is in the prompt
    want = smollm2().generate("Name a fruit.", chat=True, temperature=0.8, seed=3, max_new_tokens=8)
    assert "\n".join(a.stdout.splitlines()[:-1]) == want


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "gpt5"), "unknown model name 'gpt5'; known names: 'all-minilm-l6-v2'"),
        (("--model", "all-minilm-l6-v2"), "is an encoder (TextEncoder), which does not generate"),
        (("--max-new-tokens", "-2"), "must be at least 1 (how many tokens to generate), got -2"),
        # 0 ran nothing and printed "0.0 tokens/s" twice
        (("--max-new-tokens", "0"), "--max-new-tokens must be at least 1 (how many tokens"),
    ],
)
def test_generate_errors_are_one_line(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (``qkv.cli.main``, what the console script calls: a process start
    costs ~4 s); the console script itself is run by the tests around."""
    from qkv.cli import main

    code = main(["generate", "hi", *args])
    r = capsys.readouterr()
    assert code == 2
    assert r.out == ""
    assert r.err.count("\n") == 1 and r.err.startswith("qkv generate: error: ")
    assert message in r.err


def test_speed_line_gives_only_measured_rates() -> None:
    """No "0.0 tokens/s" for a rate that was never measured."""
    from qkv.models import GenerationStats

    s = GenerationStats()
    s.prompt_tokens = 7
    assert repr(s) == "prompt 7 tokens, decode 0 tokens"  # nothing ran (the context was full)
    s.prefill_s, s.new_tokens = 0.5, 1
    assert repr(s) == "prompt 7 tokens at 14.0 tokens/s, decode 1 tokens"  # came with the prompt
    s.new_tokens, s.decode_s = 5, 2.0
    assert repr(s) == "prompt 7 tokens at 14.0 tokens/s, decode 5 tokens at 2.0 tokens/s"
