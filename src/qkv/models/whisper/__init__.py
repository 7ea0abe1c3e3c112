"""Whisper (Radford et al. 2022) on qkv: speech to text, word times from cross-attention.

::

    import qkv.models

    asr = qkv.models.load("whisper-tiny.en")  # or a CTranslate2 Whisper folder
    r = asr.transcribe("speech.wav", word_timestamps=True)
    r.text, r.tokens, r.words  # words: .word .start .end .probability
    tokens, w = asr.cross_attention_maps("speech.wav")  # w [layers, heads, T, 1500]

The checkpoint is read from CTranslate2's ``model.bin`` with numpy (``ctranslate2`` is not
needed); WAV files need ``scipy`` (``pip install 'qkv[audio]'``).
"""

from ._align import Word
from ._audio import read_wav
from ._load import is_whisper_folder, load_ct2
from .model import DecoderLayer, EncoderLayer, WhisperConfig, WhisperDecoder, WhisperEncoder
from .recognizer import SpeechRecognizer, Transcription, WordAttention

__all__ = [
    "DecoderLayer",
    "EncoderLayer",
    "SpeechRecognizer",
    "Transcription",
    "WhisperConfig",
    "WhisperDecoder",
    "WhisperEncoder",
    "Word",
    "WordAttention",
    "is_whisper_folder",
    "load_ct2",
    "read_wav",
]
