"""The next token's argmax without reading the 80 MB float32 logits product.

Greedy decoding needs only the argmax of ``state @ embedding.T`` (51864 x 384 in tiny.en).
A light copy of the embedding gives approximate logits with a proven error bound per token;
every token whose approximate logit could, within its bound, reach the best one is recomputed
in float64 (the int8 bounds let hundreds through: they are first narrowed by float32 logits
with a bound on float32's rounding), and the best of those wins (the lowest id on a tie).
That is the argmax of the exact logits, which the float32 product's ``argmax`` also finds
unless two logits are within its rounding (~1e-6) of each other, where the float32 answer
depends on summation order.

The same bounds decide whether one token's softmax probability is above a threshold (the
no-speech test after <|startoftranscript|>): the probability lies between
``exp(a_i - b_i - logsumexp(a + b))`` and ``exp(a_i + b_i - logsumexp(a - b))`` for approximate
logits ``a`` and bounds ``b``; only where that interval holds the threshold does the caller
need the full product (one window's greedy decoding, int8 model, one thread: 240.5 -> 222.4
ms, 9 interleaved rounds).

The copy is int8 with one scale per row (20 MB, through ``aten::_weight_int8pack_mm`` with
bfloat16 activations) where this torch has the operator, else float16 (40 MB). One thread,
tiny.en, the product alone: float32 9.8 ms, float16 5.7 ms, int8 2.8 ms (measured on the
AVX2 machine of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

__all__ = ["LightLogits"]


def _int8_works() -> bool:
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None:
        return False
    try:
        x = torch.ones(1, 32, dtype=torch.bfloat16)
        y = op(x, torch.ones(8, 32, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError):
        return False
    return bool(y.shape == (1, 8) and (y.float() == 32).all())


class LightLogits:
    """Argmax of ``state @ weight.T`` over the tokens not in ``suppressed``, exact.

    ``weight [V, d]``: the tied embedding. ``int8=None`` picks int8 on the CPU where this
    torch has the operator, float16 otherwise."""

    def __init__(self, weight: Tensor, *, int8: bool | None = None) -> None:
        self.weight = weight
        self.source = (weight.data_ptr(), weight.device, weight.dtype)  # rebuilt if it moves
        w = weight.detach().float()
        if int8 is None:  # the int8 product is measured on the CPU only
            int8 = weight.device.type == "cpu" and _int8_works()
        self.int8 = int8
        if self.int8:
            # one bfloat16 scale per row, rounded up so that |w / scale| <= 127: each weight is
            # then within scale/2 of its int8 value (plus float32 rounding of w / scale, 2^-17)
            exact = w.abs().amax(1) / 127  # [V]
            scale = exact.to(torch.bfloat16)
            up = torch.nextafter(scale, torch.full_like(scale, torch.inf))
            scale = torch.where(scale.float() < exact, up, scale).clamp_min(1e-30)
            q = torch.div(w, scale.float()[:, None]).round_()  # [V, d], in -127..127
            self.q = q.to(torch.int8)
            self.scale = scale
            self.err = scale.float() * (0.5 + 2.0**-16)  # [V]: max |w - scale q| per row
            # |scale q| <= |w| + sqrt(d) err, row by row
            self.norms = w.norm(dim=1) + w.shape[1] ** 0.5 * self.err  # [V]
        else:
            self.w16 = weight.detach().half()
            self.norms = self.w16.float().norm(dim=1)  # [V]

    def _approx(self, s: Tensor) -> tuple[Tensor, Tensor]:
        """Approximate logits of ``s [d]`` and a bound on each one's error, both ``[V]``."""
        if self.int8:
            x = s.to(torch.bfloat16)  # |x - s| <= 2^-9 |s|
            approx = torch.ops.aten._weight_int8pack_mm(x[None], self.q, self.scale)[0].float()
            # the quantised weights (err |s|_1), the rounded state (2^-9 |s| |light|), and the
            # product's own rounding: its bfloat16 result and accumulation, taken 4x over the
            # 2^-8 relative error measured (of |y| and of |x||light| by Cauchy-Schwarz)
            xn = float(s.norm())
            bound = (
                self.err * float(s.abs().sum())
                + (2.0**-9 + 2.0**-6) * xn * self.norms
                + 2.0**-6 * approx.abs()
                + 1e-3
            )
        else:
            approx = (s.half() @ self.w16.T).float()  # [V]
            # float16 rounds x and the product to 11 bits: |error| <= 2^-11 (|x||w_j| + |y_j|),
            # taken twice over, plus float32 accumulation (far below 1e-3)
            bound = 2.0**-10 * (s.norm() * self.norms + approx.abs()) + 1e-3
        return approx, bound

    def prob_above(self, state: Tensor, index: int, threshold: float) -> bool | None:
        """Whether ``softmax(weight @ state)[index] > threshold`` (exact logits, no
        suppression), where the light logits' bounds decide it; None where they do not."""
        a, b = (t.double() for t in self._approx(state.detach()))
        # l in [a - b, b + a]: p = exp(l_i - logsumexp(l)) lies between these two
        high = float(a[index] + b[index] - torch.logsumexp(a - b, 0))
        low = float(a[index] - b[index] - torch.logsumexp(a + b, 0))
        log_t = math.log(threshold)
        if low > log_t + 1e-9:
            return True
        if high < log_t - 1e-9:
            return False
        return None

    def argmax(self, state: Tensor, suppressed: Tensor) -> int:
        """The argmax of the logits of ``state [d]`` with ``suppressed`` ids (``[n]`` int64)
        set to -inf: ``(weight.double() @ state.double())`` masked, then ``argmax``."""
        s = state.detach()
        approx, bound = self._approx(s)
        approx[suppressed] = -torch.inf
        cand = (approx + bound >= (approx - bound).max()).nonzero()[:, 0]  # ascending ids
        if self.int8 and cand.numel() > 64:  # (hundreds: loose bounds): narrowed in float32
            rows = self.weight[cand].detach().float()  # [candidates, d]
            y = rows @ s.float()
            # a float32 dot product of d terms, in any order: |error| <= d 2^-24 / (1 - d 2^-24)
            # sum |w_i s_i| <= that times |w||s| (Higham 3.5), taken twice over (which also
            # covers rounding in the norms, upper bounds of |w|), plus 1e-6
            d = rows.shape[1]
            gamma = 2 * d * 2.0**-24 / (1 - d * 2.0**-24)
            b = (gamma * float(s.float().norm())) * self.norms[cand] + 1e-6
            cand = cand[y + b >= (y - b).max()]  # still ascending
        # float64 products summed row by row, the same way for every row: equal rows give
        # equal logits, so a tie goes to the lowest id
        exact = (self.weight[cand].double() * s.double()).sum(-1)  # [candidates]
        return int(cand[exact.argmax()])
