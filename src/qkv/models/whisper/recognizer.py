"""The loaded Whisper model: audio in, text (and word times, and cross-attention maps) out."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import _audio
from ._align import Word, align_words, alignment_matrix
from ._light import LightLogits
from ._text import WhisperTokenizer
from .model import WhisperConfig, WhisperDecoder, WhisperEncoder

Tensor = torch.Tensor

__all__ = ["SpeechRecognizer", "Transcription", "WordAttention"]

WINDOW = 3000  # mel frames per window: 30 s
MAX_NEW_TOKENS = 224  # CTranslate2's cap with faster-whisper's max_length 448 (half of it)
# faster-whisper's defaults for skipping a window as silence: the no-speech token's probability
# after <|startoftranscript|> above 0.6 *and* an average log-probability below -1.
NO_SPEECH, LOGPROB = 0.6, -1.0


@dataclass
class Transcription:
    """What :meth:`SpeechRecognizer.transcribe` returns."""

    text: str  # the windows' texts joined: " The cat sat because it was tired."
    tokens: list[int]  # the text tokens, no special tokens
    words: list[Word] = field(default_factory=list)  # with word_timestamps=True
    duration: float = 0.0  # seconds of audio


@dataclass
class WordAttention:
    """A word of a transcription and what the decoder's cross-attention listened to while it
    predicted the word's tokens (what :meth:`SpeechRecognizer.word_attention` returns)."""

    word: Word  # its text and times, as in Transcription.words
    pieces: list[str]  # its tokens' text: [" tir", "ed."]
    offset: float  # seconds from the audio's start to encoder position 0 of the word's window
    frames: int  # encoder positions of that window holding audio (the rest is padding)
    weights: Tensor  # [layers, heads, len(pieces), 1500]: row i predicted pieces[i]


@dataclass
class _Window:
    start: int  # first mel frame
    frames: int  # real (unpadded) frames
    tokens: list[int]
    skipped: bool  # judged silent: no text


class SpeechRecognizer(nn.Module):
    """Whisper on qkv: :meth:`transcribe`, :meth:`cross_attention_maps`.

    Made by :func:`qkv.models.load` (``load("whisper-tiny.en")`` or a CTranslate2 Whisper
    folder). Attributes: ``config`` (:class:`~qkv.models.whisper.WhisperConfig`), ``encoder``
    (``encoder.layers[i].attention``), ``decoder`` (``decoder.layers[i].self_attention`` and
    ``.cross_attention``) — every one a :class:`qkv.MultiHeadAttention` —, ``alignment_heads``
    (the ``(layer, head)`` pairs whose cross-attention times the words), ``path`` and
    ``compute_type`` (``"float32"``, or ``"int8"``: the linear layers are
    :class:`qkv.models.int8.Int8Linear`).
    """

    def __init__(
        self,
        config: WhisperConfig,
        tokenizer: WhisperTokenizer,
        *,
        alignment_heads: list[tuple[int, int]],
        suppress_blank: list[int],
        path: Path,
    ) -> None:
        super().__init__()
        self.config = config
        self.encoder = WhisperEncoder(config)
        self.decoder = WhisperDecoder(config)
        self.tokenizer = tokenizer
        self.alignment_heads = alignment_heads
        self.path = path
        self.compute_type = "float32"  # load_ct2 sets "int8" once it has quantised the linears
        self._suppress = torch.tensor(tokenizer.suppress_tokens, dtype=torch.int64)
        self._suppress_first = torch.tensor(suppress_blank, dtype=torch.int64)
        self._light: LightLogits | None = None  # built at the first greedy step
        self._suppress_both = self._suppress

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"path={str(self.path)!r}, audio layers={c.n_audio_layers}, text layers="
            f"{c.n_text_layers}, heads={c.n_text_heads}, d_model={c.d_model}, "
            f"compute_type={self.compute_type}"
        )

    # ----------------------------------------------------------------------------- pieces

    def features(self, audio: object) -> Tensor:
        """Log-mel features ``[n_mels, frames]`` of a WAV path or 16 kHz samples (100 frames a
        second, equal to faster-whisper's ``FeatureExtractor``)."""
        return _audio.log_mel(_audio.as_samples(audio))

    def _windows(self, mel: Tensor) -> list[tuple[int, int, Tensor]]:
        """``(start, real frames, [n_mels, 3000])`` for each 30-s window, the last zero-padded."""
        content = max(mel.shape[1] - 1, 0)  # the frame after the last sample is not content
        out = []
        for start in range(0, content, WINDOW):
            n = min(WINDOW, content - start)
            seg = torch.nn.functional.pad(mel[:, start : start + n], (0, WINDOW - n))
            out.append((start, n, seg))
        return out

    def forward(self, mel: Tensor, ids: Tensor) -> Tensor:
        """Log-mel ``[B, n_mels, 3000]`` and token ids ``[B, L]`` → logits ``[B, L, vocab]``."""
        return self.decoder(ids, self.encoder(mel))

    def _prompt(self) -> list[int]:
        return [*self.tokenizer.sot_sequence, self.tokenizer.no_timestamps]

    @torch.inference_mode()
    def _greedy(self, audio: Tensor) -> tuple[list[int], bool]:
        """Greedy decoding of one window's audio states ``[1, 1500, d]``: the text tokens, and
        whether the window is judged silent."""
        tok, dec = self.tokenizer, self.decoder
        prompt = self._prompt()
        caches = dec.new_caches()
        states, _ = dec.states(torch.tensor([prompt]), audio, caches=caches)  # [1, P, d]
        sot_at = prompt.index(tok.sot)
        # Whether the no-speech token's probability after <|startoftranscript|> is above
        # NO_SPEECH, from the light logits' bounds where they decide it (the full float32
        # product over the 51864 x 384 embedding, ~15-30 ms a window, where they do not).
        maybe_silent = self._light_logits().prob_above(states[0, sot_at], tok.no_speech, NO_SPEECH)
        if maybe_silent is None:
            sot_logits = dec.logits(states[0, sot_at])  # [vocab]
            maybe_silent = float(sot_logits.softmax(-1)[tok.no_speech]) > NO_SPEECH
        # The score (a log-softmax over all logits) only decides anything when the window may
        # be silent; otherwise the next token is the argmax, found with the light logits.
        scored = maybe_silent
        logits = dec.logits(states[0, -1]) if scored else None  # [vocab]
        tokens: list[int] = []
        logprob = 0.0
        fast = dec.can_step()
        for step in range(MAX_NEW_TOKENS):
            if scored:
                assert logits is not None
                logits[self._suppress] = -torch.inf
                if step == 0:
                    logits[self._suppress_first] = -torch.inf
                nxt = int(logits.argmax())
                logprob += float(logits.log_softmax(-1)[nxt])
            else:
                nxt = self._light_argmax(states[0, -1], first=step == 0)
            if nxt == tok.eot:
                break
            tokens.append(nxt)
            if step + 1 == MAX_NEW_TOKENS:
                break
            if fast:
                states = dec.step(nxt, audio, caches)  # [1, 1, d]
            else:
                states, _ = dec.states(torch.tensor([[nxt]]), audio, caches=caches)
            if scored:
                logits = dec.logits(states[0, -1])  # [vocab]
        silent = scored and logprob / (len(tokens) + 1) < LOGPROB
        return tokens, silent

    def _light_logits(self) -> LightLogits:
        """The light copy of the tied embedding (:class:`~._light.LightLogits`), made again
        when the embedding moves."""
        w = self.decoder.embed.weight
        if self._light is None or self._light.source != (w.data_ptr(), w.device, w.dtype):
            self._light = LightLogits(w)
            self._suppress_both = torch.cat([self._suppress, self._suppress_first])
        return self._light

    def _light_argmax(self, state: Tensor, *, first: bool) -> int:
        """The argmax of the (suppressed) logits of ``state [d]`` from a light copy of the
        tied embedding, confirmed in float32 (:class:`~._light.LightLogits`)."""
        light = self._light_logits()
        return light.argmax(state, self._suppress_both if first else self._suppress)

    @torch.inference_mode()
    def _teacher_forced(self, audio: Tensor, tokens: list[int]) -> tuple[Tensor, Tensor]:
        """One pass over ``prompt + tokens + [eot]``: each text token's and the end token's
        probability over the text vocabulary ``[n + 1]`` and the cross-attention weights of
        the rows that predicted them ``[layers, heads, n + 1, 1500]``."""
        tok = self.tokenizer
        prompt = self._prompt()
        ids = torch.tensor([[*prompt, *tokens, tok.eot]])  # [1, L]
        states, maps = self.decoder.states(ids, audio, need_weights=True)
        rows = slice(len(prompt) - 1, ids.shape[1] - 1)  # the rows that predicted tokens + eot
        logits = self.decoder.logits(states[0, rows])  # [n + 1, vocab]
        probs = logits[:, : tok.eot].softmax(-1)  # over the text tokens, as CTranslate2
        nxt = ids[0, len(prompt) :]  # [n + 1]
        p = probs.gather(1, nxt.clamp_max(tok.eot - 1)[:, None])[:, 0]
        weights = torch.stack([m[0, :, rows] for m in maps])  # [layers, H, n + 1, 1500]
        return p, weights

    # ------------------------------------------------------------------------------ calls

    @torch.inference_mode()
    def transcribe(self, audio: object, *, word_timestamps: bool = False) -> Transcription:
        """Speech to text, greedy, as faster-whisper's ``transcribe(beam_size=1,
        temperature=0, without_timestamps=True, condition_on_previous_text=False,
        vad_filter=False)``: same tokens, same text.

        Args:
            audio: a WAV file path (any sample rate and channel count: downmixed and resampled
                to 16 kHz) or 1-D float samples at 16 kHz (``torch.Tensor`` or ``ndarray``).
                Longer than 30 s: consecutive 30-s windows decoded independently.
            word_timestamps: also time each word from the alignment heads' cross-attention
                (``.words``: :class:`~qkv.models.whisper.Word` with ``word``, ``start``,
                ``end``, ``probability``).

        Returns:
            :class:`Transcription` ``(text, tokens, words, duration)``; empty or silent audio
            gives ``text == ""``.
        """
        if not isinstance(word_timestamps, bool):
            raise TypeError(f"word_timestamps must be True or False, got {word_timestamps!r}")
        samples = _audio.as_samples(audio)
        mel = _audio.log_mel(samples)
        result = Transcription("", [], [], samples.size / _audio.SAMPLE_RATE)
        last_speech = 0.0
        for start, n, seg in self._windows(mel):
            states = self.encoder(seg[None])  # [1, 1500, d]
            tokens, silent = self._greedy(states)
            text = self.tokenizer.decode(tokens)
            if silent or not text.strip():
                continue
            result.text += text
            result.tokens += tokens
            if word_timestamps:
                words, last_speech, _, _ = self._time_words(states, tokens, start, n, last_speech)
                result.words += words
        return result

    def _time_words(
        self, states: Tensor, tokens: list[int], start: int, n: int, last_speech: float
    ) -> tuple[list[Word], float, list[int], Tensor]:
        """The window's words, the new ``last_speech``, how many tokens each word holds, and
        the cross-attention of the rows that predicted the tokens and the end token
        ``[layers, heads, n + 1, 1500]``."""
        probs, weights = self._teacher_forced(states, tokens)
        heads = torch.stack([weights[layer, head] for layer, head in self.alignment_heads])
        matrix = alignment_matrix(heads, n // 2)  # encoder positions are 2 mel frames
        offset = start / 100
        words, last_speech, counts = align_words(
            self.tokenizer,
            tokens,
            matrix,
            probs[:-1].tolist(),
            offset=offset,
            window=(offset, offset + n / 100),
            last_speech=last_speech,
        )
        return words, last_speech, counts, weights

    @torch.inference_mode()
    def cross_attention_maps(self, audio: object, *, window: int = 0) -> tuple[list[str], Tensor]:
        """What each text token listened to: every decoder layer's cross-attention weights
        over the audio, for the greedy transcription of one 30-s window.

        Returns ``(tokens, weights)``: the window's text tokens as strings, then
        ``"<|endoftext|>"`` (T of them), and ``weights [layers, heads, T, 1500]`` (float32):
        row ``i`` is the decoder query that predicted ``tokens[i]``, a softmax over all 1500
        encoder positions (20 ms each; positions past the audio's end see the zero-padded
        features), exactly the weights the model used. Rows sum to 1.
        """
        mel = self.features(audio)
        windows = self._windows(mel)
        if not isinstance(window, int) or not 0 <= window < max(len(windows), 1):
            raise ValueError(
                f"window={window!r} is out of range: the audio has {len(windows)} windows of 30 s"
            )
        if not windows:
            raise ValueError("the audio is empty: there is nothing to attend to")
        _, _, seg = windows[window]
        states = self.encoder(seg[None])
        tokens, _ = self._greedy(states)
        _, weights = self._teacher_forced(states, tokens)
        pieces = [self.tokenizer.decode([t]) for t in tokens] + ["<|endoftext|>"]
        return pieces, weights.float()

    @torch.inference_mode()
    def word_attention(self, audio: object) -> list[WordAttention]:
        """Every word of the transcription (as ``transcribe(audio, word_timestamps=True)``
        gives them) with the cross-attention weights of the decoder queries that predicted
        its tokens: :class:`WordAttention` ``(word, pieces, offset, frames, weights)``,
        ``weights [layers, heads, len(pieces), 1500]`` (float32, rows sum to 1; position
        ``j`` is the audio from ``offset + 0.02 j`` to ``offset + 0.02 (j + 1)`` seconds).
        What ``qkv explain --audio`` shows."""
        samples = _audio.as_samples(audio)
        mel = _audio.log_mel(samples)
        out: list[WordAttention] = []
        last_speech = 0.0
        for start, n, seg in self._windows(mel):
            states = self.encoder(seg[None])  # [1, 1500, d]
            tokens, silent = self._greedy(states)
            if silent or not self.tokenizer.decode(tokens).strip():
                continue
            words, last_speech, counts, weights = self._time_words(
                states, tokens, start, n, last_speech
            )
            assert sum(counts) <= len(tokens), (counts, len(tokens))
            row = 0
            for word, k in zip(words, counts, strict=True):
                ids = tokens[row : row + k]
                pieces = [self.tokenizer.decode([t]) for t in ids]
                w = weights[:, :, row : row + k].float()  # [layers, heads, k, 1500]
                out.append(WordAttention(word, pieces, start / 100, n // 2, w))
                row += k
        return out
