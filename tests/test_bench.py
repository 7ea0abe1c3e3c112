"""`qkv bench`: a tiny sweep runs, prints the table and writes JSON (and a PNG when
matplotlib is installed). Timing values are not asserted: benchmarks are not tests."""

from __future__ import annotations

import importlib.util
import json

import pytest

from qkv._cli import bench, bench_cases  # private: the bench command's mask specs are tested
from qkv.cli import main


@pytest.fixture(autouse=True)
def _small_peak(monkeypatch):
    """The matmul peak on 256² products, not 2048² (7 per case: most of a tiny sweep's time);
    no value here is asserted."""
    monkeypatch.setattr(bench, "_PEAK_N", 256)


def test_bench_sweep_prints_table_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "--lengths", "64", "--masks", "none,causal,window,document,prefix"]
    argv += ["--modes", "both", "--repeats", "1", "--window", "16", "--prefix", "8"]
    argv += ["--no-progress", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "matmul peak" in text and "/sdpa" in text
    for name in ("none", "causal", "window16", "doc8-causal", "prefix8"):
        assert name in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 5 * 2 * 2  # masks x modes x peers
    sdpa = [r for r in rows if r["peer"] == "sdpa"]
    assert all(r["vs_sdpa"] == pytest.approx(1.0) for r in sdpa)


def test_bench_png(tmp_path, capsys):
    png = tmp_path / "t.png"
    argv = ["bench", "--lengths", "32", "--masks", "causal", "--repeats", "1", "--no-progress"]
    code = main([*argv, "--png", str(png)])
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2
        assert "pip install matplotlib" in capsys.readouterr().err
    else:
        assert code == 0 and png.stat().st_size > 0


def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "--masks", "diagonal", "--no-progress"]) == 2
    assert "unknown mask 'diagonal'" in capsys.readouterr().err
    assert main(["bench", "--peers", "xformers", "--no-progress"]) == 2


def test_visible_pair_counts_match_the_masks():
    """The FLOP counts behind GFLOP/s come from closed forms; check them against the masks."""
    from types import SimpleNamespace

    args = SimpleNamespace(window=16, docs=5, prefix=20)
    for name in bench.MASKS:
        spec = bench_cases.make_mask(name, 100, args)
        if spec.mod is None:
            assert spec.pairs == 100 * 100
            continue
        assert spec.pairs == int(bench_cases.dense_bool(spec, 100).sum()), name
