"""Token vectors → one sentence vector, as sentence-transformers' Pooling and Normalize do."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._config import PoolingConfig

Tensor = torch.Tensor

__all__ = ["pool"]


def pool(hidden: Tensor, lengths: Tensor, cfg: PoolingConfig) -> Tensor:
    """Pool right-padded token vectors into sentence vectors.

    Args:
        hidden: ``[N, L, d]`` the encoder's last layer; rows past ``lengths[n]`` are padding.
        lengths: ``[N]`` valid tokens per text (>= 1: every text has at least [CLS] [SEP]).
        cfg: the pooling modes (concatenated in order) and whether to L2-normalise.

    Returns:
        ``[N, len(cfg.modes) * d]``.
    """
    N, L, _ = hidden.shape
    pos = torch.arange(L, device=hidden.device)  # [L]
    valid = pos[None, :] < lengths.to(hidden.device)[:, None]  # [N, L] bool
    keep = valid[..., None].to(hidden.dtype)  # [N, L, 1]
    count = keep.sum(dim=1).clamp(min=1e-9)  # [N, 1]
    out: list[Tensor] = []
    for mode in cfg.modes:
        if mode == "cls":
            out.append(hidden[:, 0])  # [N, d]
        elif mode == "max":
            out.append(hidden.masked_fill(~valid[..., None], float("-inf")).amax(dim=1))
        elif mode == "mean":
            out.append((hidden * keep).sum(dim=1) / count)
        elif mode == "mean_sqrt_len_tokens":
            out.append((hidden * keep).sum(dim=1) / count.sqrt())
        elif mode == "weightedmean":
            w = keep * (pos + 1).to(hidden.dtype)[None, :, None]  # [N, L, 1] position weights
            out.append((hidden * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9))
        elif mode == "lasttoken":
            last = (lengths.to(hidden.device) - 1).clamp(min=0)  # [N]
            out.append(hidden[torch.arange(N, device=hidden.device), last])  # [N, d]
        else:  # _config refuses unknown modes when it reads them
            raise AssertionError(mode)
    emb = torch.cat(out, dim=-1)  # [N, modes * d]
    return F.normalize(emb, p=2.0, dim=-1) if cfg.normalize else emb
