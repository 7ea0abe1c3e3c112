"""Audio in: WAV files or samples → 16 kHz mono float32 → Whisper's log-mel features.

WAV files are read with ``scipy.io.wavfile`` (PCM 8/16/24/32-bit and float, any channel
count), downmixed by averaging the channels and resampled to 16 kHz by
``scipy.signal.resample_poly`` (a polyphase FIR filter, Kaiser window). The features are
Whisper's (Radford et al. 2022): a periodic Hann window of ``N_FFT = 400`` samples every
``HOP = 160`` samples (10 ms), power spectrum, 80 Slaney-scaled mel filters, ``log10`` clipped
at 1e-10, floored at the maximum minus 8, then ``(x + 4) / 4`` — computed as faster-whisper's
``FeatureExtractor`` does it (160 zeros appended, reflect padding, the last frame dropped,
one maximum over the whole recording), so the two agree to ~1e-5.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

__all__ = ["HOP", "N_FFT", "N_MELS", "SAMPLE_RATE", "as_samples", "log_mel", "read_wav"]

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 80


def read_wav(path: str | os.PathLike[str]) -> np.ndarray:
    """The samples of a WAV file as float32 ``[N]`` in [-1, 1], mono, at 16 kHz."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such audio file: {str(p)!r}; give the path of a WAV file")
    if p.is_dir():
        raise ValueError(f"{str(p)!r} is a directory; give the path of a WAV file")
    from scipy.io import wavfile

    try:
        rate, data = wavfile.read(p, mmap=False)
    except (ValueError, EOFError, OSError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(
            f"{str(p)!r} is not a readable WAV file ({reason}); convert it first, e.g. "
            f"`sox in.mp3 -r 16000 -c 1 out.wav` or `ffmpeg -i in.mp3 -ar 16000 -ac 1 out.wav`"
        ) from None
    x = _to_float(data, p)
    if x.ndim == 2:
        x = x.mean(axis=1)  # [N, channels] -> [N]
    if rate != SAMPLE_RATE and x.size:
        from scipy.signal import resample_poly

        g = math.gcd(int(rate), SAMPLE_RATE)
        x = resample_poly(x, SAMPLE_RATE // g, int(rate) // g).astype(np.float32)
    return np.ascontiguousarray(x, dtype=np.float32)


def _to_float(data: np.ndarray, path: Path) -> np.ndarray:
    kind = data.dtype
    if kind == np.uint8:  # 8-bit PCM is unsigned, centred on 128
        return (data.astype(np.float32) - 128.0) / 128.0
    if kind in (np.int16, np.int32, np.int64):
        # scipy left-justifies 24-bit samples in int32, so every width scales by its own range
        return (data.astype(np.float64) / float(2 ** (8 * kind.itemsize - 1))).astype(np.float32)
    if kind in (np.float32, np.float64):
        return data.astype(np.float32)
    raise ValueError(f"{str(path)!r} holds {kind} samples, which qkv does not read")


def as_samples(audio: object) -> np.ndarray:
    """A path (str or PathLike) or 1-D float samples at 16 kHz (tensor or ndarray) → float32
    ``[N]``; anything else is refused with a one-line ValueError/TypeError."""
    if isinstance(audio, (str, os.PathLike)):
        return read_wav(audio)
    if isinstance(audio, torch.Tensor):
        audio = (
            audio.detach().cpu().numpy()
            if audio.dtype != torch.bfloat16
            else (audio.detach().float().cpu().numpy())
        )
    if not isinstance(audio, np.ndarray):
        raise TypeError(
            f"audio must be a WAV path or 1-D float samples at 16 kHz (torch.Tensor or "
            f"numpy.ndarray), got {type(audio).__name__}"
        )
    if audio.ndim != 1:
        hint = "; downmix first, e.g. x.mean(0)" if audio.ndim == 2 else ""
        raise ValueError(
            f"audio samples must be 1-D [N] at 16 kHz, got shape {list(audio.shape)}{hint}"
        )
    if not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(
            f"audio samples must be floats in [-1, 1], got dtype {audio.dtype}; scale "
            f"integer PCM first (int16: x / 32768)"
        )
    if not np.isfinite(audio).all():
        raise ValueError("audio samples contain NaN or infinity; give finite samples in [-1, 1]")
    return np.ascontiguousarray(audio, dtype=np.float32)


def _mel_filters() -> np.ndarray:
    """``[80, 201]`` Slaney-style mel filterbank (librosa's ``mel(sr=16000, n_fft=400,
    n_mels=80)``), computed as faster-whisper computes it."""
    fftfreqs = np.fft.rfftfreq(n=N_FFT, d=1.0 / SAMPLE_RATE)
    mels = np.linspace(0.0, 45.245640471924965, N_MELS + 2)  # mel(8000 Hz) on Slaney's scale
    f_sp = 200.0 / 3
    freqs = f_sp * mels
    min_log_mel = 1000.0 / f_sp  # linear below 1 kHz, logarithmic above
    log_t = mels >= min_log_mel
    freqs[log_t] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels[log_t] - min_log_mel))
    fdiff = np.diff(freqs)
    ramps = freqs.reshape(-1, 1) - fftfreqs.reshape(1, -1)  # [82, 201]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))  # [80, 201]
    weights *= (2.0 / (freqs[2 : N_MELS + 2] - freqs[:N_MELS]))[:, None]  # constant energy
    return weights.astype(np.float32)


_FILTERS: torch.Tensor | None = None


def log_mel(samples: np.ndarray) -> torch.Tensor:
    """float32 samples ``[N]`` at 16 kHz → log-mel features ``[80, N // 160]`` (float32): one
    column per 10 ms; empty samples give ``[80, 0]``."""
    global _FILTERS
    if _FILTERS is None:
        _FILTERS = torch.from_numpy(_mel_filters())
    if samples.size == 0:
        return torch.zeros(N_MELS, 0)
    x = np.pad(samples.astype(np.float32, copy=False), (0, HOP))  # as faster-whisper pads
    x = np.pad(x, N_FFT // 2, mode="reflect")  # numpy reflects past short inputs too
    t = torch.from_numpy(x)
    frames = t.unfold(0, N_FFT, HOP)  # [n_frames, 400]
    window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float32)
    spec = torch.fft.rfft(frames[:-1] * window, dim=-1)  # [N // 160, 201], last frame dropped
    power = spec.real.square() + spec.imag.square()
    mel = power @ _FILTERS.T  # [frames, 80]
    log = mel.clamp_min(1e-10).log10()
    log = torch.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).T.contiguous()  # [80, frames]
