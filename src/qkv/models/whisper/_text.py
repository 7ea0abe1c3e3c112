"""Whisper's tokenizer: the special tokens, the start sequence, what decoding suppresses, and
how tokens group into words — as faster-whisper's ``Tokenizer`` defines them, so that the two
decode and time the same tokens."""

from __future__ import annotations

import string
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["WhisperTokenizer"]


class WhisperTokenizer:
    """``tokenizer.json`` of a Whisper checkpoint (the ``tokenizers`` library reads it)."""

    def __init__(self, path: Path, *, multilingual: bool, language: str = "en") -> None:
        from tokenizers import Tokenizer

        try:
            self._tok: Any = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception type
            msg = f"{path} is not a tokenizer.json the tokenizers library reads: {e}"
            raise ValueError(" ".join(msg.split())) from None
        self.multilingual = multilingual
        self.language = language

    def _id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"the tokenizer has no {token} token; is this a Whisper tokenizer?")
        return int(i)

    @cached_property
    def eot(self) -> int:
        return self._id("<|endoftext|>")

    @cached_property
    def sot(self) -> int:
        return self._id("<|startoftranscript|>")

    @cached_property
    def no_timestamps(self) -> int:
        return self._id("<|notimestamps|>")

    @cached_property
    def no_speech(self) -> int:
        i = self._tok.token_to_id("<|nospeech|>")
        return int(i) if i is not None else self._id("<|nocaptions|>")

    @cached_property
    def sot_sequence(self) -> list[int]:
        """What starts a window: ``<|startoftranscript|>``, then (multilingual models) the
        language and the task."""
        if not self.multilingual:
            return [self.sot]
        return [self.sot, self._id(f"<|{self.language}|>"), self._id("<|transcribe|>")]

    @cached_property
    def non_speech_tokens(self) -> tuple[int, ...]:
        """Speaker tags and sound annotations ("♪", "[", " (", ...) that greedy decoding never
        picks, keeping ordinary punctuation (faster-whisper's and OpenAI's list)."""
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        pairs = "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪"
        symbols += pairs.split(" ")
        misc = set("♩♪♫♬♭♮♯")  # one 3-byte UTF-8 prefix: suppressing the first token is safe
        out = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(misc):
            for ids in (self.encode(symbol), self.encode(" " + symbol)):
                if len(ids) == 1 or symbol in misc:
                    out.add(ids[0])
        return tuple(sorted(out))

    @cached_property
    def suppress_tokens(self) -> tuple[int, ...]:
        """Never generated: the non-speech tokens and the task and start tokens."""
        special = ("<|transcribe|>", "<|translate|>", "<|startoflm|>", "<|startofprev|>")
        ids = set(self.non_speech_tokens) | {self.sot, self.no_speech}
        ids |= {int(i) for t in special if (i := self._tok.token_to_id(t)) is not None}
        return tuple(sorted(ids))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens and timestamps left out)."""
        return str(self._tok.decode([i for i in ids if i < self.eot]))

    def _decode_all(self, ids: list[int]) -> str:
        """Text with timestamps written out, as faster-whisper's ``decode_with_timestamps``."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i >= self.no_timestamps + 1:
                out.append(self._tok.decode(run) + f"<|{(i - self.no_timestamps - 1) * 0.02:.2f}|>")
                run = []
            else:
                run.append(i)
        return "".join(out) + self._tok.decode(run)

    def split_to_words(self, ids: list[int]) -> tuple[list[str], list[list[int]]]:
        """Group tokens into words: a new word at a leading space, at punctuation and at special
        tokens; pieces that are not whole characters join the next token (faster-whisper's
        ``split_tokens_on_spaces``)."""
        whole = self._decode_all(ids)
        pieces: list[str] = []
        piece_ids: list[list[int]] = []
        current: list[int] = []
        offset = 0
        for i in ids:
            current.append(i)
            decoded = self._decode_all(current)
            bad = decoded.find("\ufffd")
            if bad < 0 or (bad + offset < len(whole) and whole[bad + offset] == "\ufffd"):
                pieces.append(decoded)
                piece_ids.append(current)
                current = []
                offset += len(decoded)
        words: list[str] = []
        word_ids: list[list[int]] = []
        for piece, pids in zip(pieces, piece_ids, strict=True):
            special = pids[0] >= self.eot
            if special or piece.startswith(" ") or piece.strip() in string.punctuation or not words:
                words.append(piece)
                word_ids.append(pids)
            else:
                words[-1] += piece
                word_ids[-1].extend(pids)
        return words, word_ids
