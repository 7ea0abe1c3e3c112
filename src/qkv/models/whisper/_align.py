"""Word timestamps from cross-attention: Whisper's alignment (Radford et al. 2022, §3.8 of the
code release; faster-whisper and CTranslate2 implement it the same way).

A few cross-attention heads (the checkpoint's ``alignment_heads``) look at the audio frame
where the token they predict is spoken. Their weights over the window's real frames are
standardised over the tokens (per frame), median-filtered along time (width 7), averaged over
the heads, and dynamic time warping finds the monotonic path through the token × frame matrix
that collects the most weight: each token's first frame on the path is when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ._text import WhisperTokenizer

Tensor = torch.Tensor

__all__ = ["Word", "align_words", "alignment_matrix", "dtw"]

TOKENS_PER_SECOND = 50  # encoder positions per second (20 ms each)
PREPEND = "\"'“¿([{-"  # punctuation merged into the next word (faster-whisper's defaults)
APPEND = "\"'.。,，!！?？:：”)]}、"  # and into the previous one
_SENTENCE_END = ".。!！?？"


@dataclass
class Word:
    """One word of a transcription, as faster-whisper names its fields."""

    word: str  # with its leading space, punctuation attached: " tired."
    start: float  # seconds from the start of the audio (rounded to 10 ms)
    end: float
    probability: float  # mean probability of its tokens


def alignment_matrix(weights: Tensor, n_frames: int, *, width: int = 7) -> np.ndarray:
    """The alignment heads' cross-attention ``weights [heads, T, 1500]`` (softmax over all
    1500 positions) → ``[T, n_frames]``: renormalised over the window's ``n_frames`` real
    positions, standardised over the tokens, median-filtered along time, averaged over
    heads."""
    w = weights[..., :n_frames].double()
    w = w / w.sum(-1, keepdim=True)  # = the softmax over the real frames only
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, correction=0)
    w = (w - mean) / std  # [heads, T, n]
    pad = width // 2
    if n_frames > pad:  # reflect-padded running median, as CTranslate2's MedianFilter
        padded = F.pad(w, (pad, pad), mode="reflect")  # [heads, T, n + 2*pad]
        w = padded.unfold(-1, width, 1).median(-1).values  # [heads, T, n]
    return w.mean(0).float().numpy()  # [T, n]


def dtw(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The path of dynamic time warping over ``-matrix`` ``[N, M]`` from (0, 0) to
    (N-1, M-1): ``(text_indices, time_indices)``, ties broken as OpenAI's and CTranslate2's
    (diagonal, then up, then left). Computed one anti-diagonal at a time."""
    n, m = matrix.shape
    cost = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    cost[0, 0] = 0.0
    x = (-matrix).astype(np.float32)
    for d in range(2, n + m + 1):  # cells (i, j) with i + j = d, 1 <= i <= n, 1 <= j <= m
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        c = np.where(t == 0, c0, np.where(t == 1, c1, c2))
        cost[i, j] = x[i - 1, j - 1] + c
        trace[i, j] = t
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = n, m
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    arr = np.array(path[::-1], dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def _merge_punctuation(words: list[dict]) -> None:
    """Punctuation joins its neighbour word: opening marks the next, closing marks the
    previous (faster-whisper's ``merge_punctuations``)."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        prev, nxt = words[i], words[j]
        if prev["word"].startswith(" ") and prev["word"].strip() in PREPEND:
            nxt["word"], nxt["tokens"] = prev["word"] + nxt["word"], prev["tokens"] + nxt["tokens"]
            prev["word"], prev["tokens"] = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        prev, nxt = words[i], words[j]
        if not prev["word"].endswith(" ") and nxt["word"] in APPEND:
            prev["word"], prev["tokens"] = (
                prev["word"] + nxt["word"],
                prev["tokens"] + nxt["tokens"],
            )
            nxt["word"], nxt["tokens"] = "", []
        else:
            i = j
        j += 1


def align_words(
    tok: WhisperTokenizer,
    text_tokens: list[int],
    matrix: np.ndarray,
    token_probs: list[float],
    *,
    offset: float,
    window: tuple[float, float],
    last_speech: float,
) -> tuple[list[Word], float, list[int]]:
    """The words of one window's ``text_tokens`` timed by ``matrix`` ``[n + 1, frames]``
    (:func:`alignment_matrix` of the rows that predicted the tokens and the end token), with
    faster-whisper's adjustments (words at sentence ends and after pauses no longer than twice
    the median word, the window's bounds). ``offset``: the window's start in seconds;
    ``window``: its (start, end) in seconds; ``last_speech``: the end of the previous word.
    Returns the words, the new ``last_speech`` (the last word's end) and how many of
    ``text_tokens`` each word holds (consecutive: word ``k`` holds the tokens after those of
    words ``0..k-1``)."""
    if not text_tokens:
        return [], last_speech, []
    text_idx, time_idx = dtw(matrix)
    names, groups = tok.split_to_words([*text_tokens, tok.eot])
    if len(groups) <= 1:
        return [], last_speech, []
    bounds = np.pad(np.cumsum([len(g) for g in groups[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] / TOKENS_PER_SECOND
    starts, ends = jump_times[bounds[:-1]], jump_times[bounds[1:]]
    words = [
        {
            "word": name,
            "tokens": ids,
            "start": float(s),
            "end": float(e),
            "prob": float(np.mean(token_probs[a:b])),
        }
        for name, ids, s, e, a, b in zip(
            names, groups, starts, ends, bounds[:-1], bounds[1:], strict=False
        )
    ]
    durations = np.array([w["end"] - w["start"] for w in words])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    if len(durations):  # a word at a sentence boundary is at most twice the median
        for i in range(1, len(words)):
            if words[i]["end"] - words[i]["start"] > longest:
                if words[i]["word"] in _SENTENCE_END:
                    words[i]["end"] = words[i]["start"] + longest
                elif words[i - 1]["word"] in _SENTENCE_END:
                    words[i]["start"] = words[i]["end"] - longest
    _merge_punctuation(words)
    kept = [w for w in words if w["word"]]
    out = [
        Word(w["word"], round(offset + w["start"], 2), round(offset + w["end"], 2), w["prob"])
        for w in kept
    ]
    counts = [len(w["tokens"]) for w in kept]
    if not out:
        return out, last_speech, counts
    first = out[0]
    if first.end - last_speech > median * 4 and (
        first.end - first.start > longest
        or (len(out) > 1 and out[1].end - first.start > longest * 2)
    ):  # the first word after a pause: at most twice the median
        if len(out) > 1 and out[1].end - out[1].start > longest:
            boundary = max(out[1].end / 2, out[1].end - longest)
            first.end = out[1].start = boundary
        first.start = max(0.0, first.end - longest)
    start, end = window  # a word that overhangs the window by over 0.5 s is cut to it
    if start < first.end and start - 0.5 > first.start:
        first.start = max(0.0, min(first.end - median, start))
    last = out[-1]
    if end > last.start and end + 0.5 < last.end:
        last.end = max(last.start + median, end)
    return out, last.end, counts
