"""One test per kind of bad input: the exception type and the key words of its message.

Every check must fire before any attention arithmetic; a mask_mod that raises when called
proves the shape checks ran first.
"""

from __future__ import annotations

import pytest
import torch

import qkv


def qkv4(B=1, Hq=4, Hkv=2, Lq=5, Lk=6, D=8, Dv=8, dtype=torch.float32):
    return (
        torch.randn(B, Hq, Lq, D, dtype=dtype),
        torch.randn(B, Hkv, Lk, D, dtype=dtype),
        torch.randn(B, Hkv, Lk, Dv, dtype=dtype),
    )


def _boom(b, h, q_idx, kv_idx):  # a mask_mod that must never be reached
    raise AssertionError("the mask_mod ran before the input checks")


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_wrong_ndim(backend):
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"q has 5 dims .*\[B, H, L, D\]"):
        qkv.attention(q[None], k[None], v[None], mask=_boom, backend=backend)
    with pytest.raises(ValueError, match=r"q has 1 dims"):
        qkv.attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], backend=backend)


def test_mixed_ndim():
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"same number of dims.*\(1, 4, 5, 8\).*\(2, 6, 8\)"):
        qkv.attention(q, k[0], v[0], mask=_boom)


def test_mismatched_head_dims():
    q, k, v = qkv4(D=8)
    with pytest.raises(ValueError, match=r"q has head dim 8 but k has 7"):
        qkv.attention(q, k[..., :7], v, mask=_boom)


def test_batch_mismatch():
    q, k, v = qkv4(B=2)
    with pytest.raises(ValueError, match=r"batch sizes differ: q has 2, k has 1, v has 2"):
        qkv.attention(q, k[:1], v, mask=_boom)


def test_kv_length_mismatch():
    q, k, v = qkv4(Lk=6)
    with pytest.raises(ValueError, match=r"k has length 6 but v has 5"):
        qkv.attention(q, k, v[:, :, :5], mask=_boom)


def test_kv_head_mismatch():
    q, k, v = qkv4(Hq=4, Hkv=2)
    with pytest.raises(ValueError, match=r"k has 2 heads but v has 1"):
        qkv.attention(q, k, v[:, :1], mask=_boom)


def test_heads_not_divisible():
    q, k, v = qkv4(Hq=8, Hkv=3)
    with pytest.raises(ValueError, match=r"q has 8 heads and k has 3: q heads must be a multiple"):
        qkv.attention(q, k, v, mask=_boom)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_tensor_input(which):
    args = dict(zip("qkv", qkv4(Hkv=4), strict=True))
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=rf"{which} must be a torch.Tensor, got list"):
        qkv.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_float_dtypes(dtype):
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=rf"q has dtype {dtype}.*floating"):
        qkv.attention(q.to(dtype), k, v)


def test_mixed_dtypes():
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"share one dtype.*torch.float32.*torch.float64"):
        qkv.attention(q, k.double(), v, mask=_boom)


def test_mixed_devices():
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"one device, got cpu, meta and cpu"):
        qkv.attention(q, k.to("meta"), v, mask=_boom)


def test_mask_not_broadcastable():
    q, k, v = qkv4(Lq=5, Lk=6)
    bad = torch.ones(5, 5, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"mask of shape \(5, 5\) does not broadcast.*\[1, 4, 5, 6\]"
    ):
        qkv.attention(q, k, v, mask=bad)


def test_float_mask_points_to_score_mod():
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"mask is a torch.float32 tensor.*score_mod"):
        qkv.attention(q, k, v, mask=torch.zeros(5, 6))


def test_integer_mask():
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"mask has dtype torch.int64.*mask.bool\(\)"):
        qkv.attention(q, k, v, mask=torch.ones(5, 6, dtype=torch.int64))


def test_mask_on_other_device():
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"mask is on meta but q is on cpu"):
        qkv.attention(q, k, v, mask=torch.ones(5, 6, dtype=torch.bool, device="meta"))


def test_bias_not_broadcastable():
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"bias of shape \(3, 6\) does not broadcast"):
        qkv.attention(q, k, v, score_mod=torch.zeros(3, 6))


def test_bias_not_float():
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"has dtype torch.bool.*a bool tensor is a mask"):
        qkv.attention(q, k, v, score_mod=torch.ones(5, 6, dtype=torch.bool))


def test_mask_of_wrong_kind():
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"mask must be None, a bool tensor.*got str"):
        qkv.attention(q, k, v, mask="causal")
    with pytest.raises(TypeError, match=r"score_mod must be None.*got int"):
        qkv.attention(q, k, v, score_mod=3)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_mask_mod_returning_non_bools(backend):
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"mask_mod .* returned a torch.int64 tensor.*bools"):
        qkv.attention(q, k, v, mask=lambda b, h, qi, ki: qi - ki, backend=backend)
    with pytest.raises(TypeError, match=r"returned float.*bool tensor"):
        qkv.attention(q, k, v, mask=lambda b, h, qi, ki: 1.0, backend=backend)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_mask_mod_unbroadcastable(backend):
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"returned shape \(3, 3\), which does not broadcast"):
        qkv.attention(
            q, k, v, mask=lambda b, h, qi, ki: torch.ones(3, 3, dtype=torch.bool), backend=backend
        )


def test_score_mod_bad_results():
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"score_mod .* returned int"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: 0)
    with pytest.raises(TypeError, match=r"returned dtype torch.bool; it must return floats"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s > 0)
    with pytest.raises(ValueError, match=r"returned shape \(2, 2\), which does not broadcast"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.zeros(2, 2))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_out_of_range(p):
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=rf"dropout_p must be in \[0, 1\), got {p}"):
        qkv.attention(q, k, v, dropout_p=p, mask=_boom)


def test_dropout_wrong_type():
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"dropout_p must be a float.*got str"):
        qkv.attention(q, k, v, dropout_p="0.1")


def test_unknown_backend_lists_valid_ones():
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"unknown backend 'flash'.*'auto'.*'sdpa'.*'reference'"):
        qkv.attention(q, k, v, backend="flash")


def test_backend_that_cannot_compute_says_why():
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot.*callable score_mod"):
        qkv.attention(q, k, v, score_mod=qkv.softcap(5.0), backend="sdpa")
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot.*log-sum-exp"):
        qkv.attention(q, k, v, return_lse=True, backend="sdpa")


def test_bad_scale_and_flags():
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"scale must be finite, got inf"):
        qkv.attention(q, k, v, scale=float("inf"))
    with pytest.raises(TypeError, match=r"scale must be a float or None, got str"):
        qkv.attention(q, k, v, scale="1")
    with pytest.raises(TypeError, match=r"return_lse must be True or False, got int"):
        qkv.attention(q, k, v, return_lse=1)


def test_builtin_mask_constraints_checked_against_the_problem():
    q, k, v = qkv4(B=1, Lq=5, Lk=6)
    with pytest.raises(ValueError, match=r"document ids has 4 entries but q_len=5 and kv_len=6"):
        qkv.attention(q, k, v, mask=qkv.document(torch.tensor([0, 0, 1, 1])))
    with pytest.raises(ValueError, match=r"has 2 lengths but the batch size is 1"):
        qkv.attention(q, k, v, mask=qkv.padding(torch.tensor([3, 4])))
    with pytest.raises(ValueError, match=r"slopes has 3 entries but q has 4 heads"):
        qkv.attention(q, k, v, score_mod=qkv.alibi(torch.ones(3)))
    with pytest.raises(ValueError, match=r"table's second axis has 2 entries but q has 4 heads"):
        qkv.attention(q, k, v, score_mod=qkv.relative_bias(torch.zeros(5, 2), 2))
    # combinators check the masks they combine
    with pytest.raises(ValueError, match=r"document ids has 4 entries"):
        qkv.attention(
            q, k, v, mask=qkv.and_masks(qkv.causal, qkv.document(torch.zeros(4, dtype=torch.long)))
        )


def test_plan_validates_like_attention():
    q, k, v = qkv4(Hq=8, Hkv=3)
    with pytest.raises(ValueError, match=r"q heads must be a multiple of kv heads"):
        qkv.plan(q, k, v)
    q, k, v = qkv4()
    with pytest.raises(ValueError, match=r"unknown backend"):
        qkv.plan(q, k, v, backend="nope")


def test_reference_validates_too():
    q, k, v = qkv4()
    with pytest.raises(TypeError, match=r"mask is a torch.float32 tensor"):
        qkv.reference.attention(q, k, v, mask=torch.zeros(5, 6))


def test_dense_limit_refuses_instead_of_allocating():
    # Meta tensors: the plan is made from shapes alone, so nothing is allocated.
    q = torch.empty(1, 8, 65536, 64, device="meta")
    with pytest.raises(
        ValueError, match=r"'reference' cannot.*would need .* GiB.*limit of 1.0 GiB"
    ):
        qkv.plan(q, q, q, score_mod=qkv.softcap(30.0), backend="reference")
    with pytest.raises(ValueError, match=r"non-negative number of bytes"):
        qkv.set_dense_limit(-1)


def _raised(fn, *args, **kw) -> BaseException:
    try:
        fn(*args, **kw)
    except Exception as e:
        return e
    raise AssertionError("no error raised")


def _heads(q, k, v):
    return qkv.attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8))


def _dtype(q, k, v):
    return qkv.attention(q, k.double(), v)


def _padding(q, k, v):
    return qkv.attention(q, k, v, mask=qkv.padding(torch.tensor([1, 2, 3])))


def _mask_type(q, k, v):
    return qkv.attention(q, k, v, mask=3)


def _return_lse(q, k, v):
    return qkv.attention(q, k, v, return_lse=1)


@pytest.mark.parametrize(
    ("call", "kind", "words"),
    [
        (_heads, ValueError, r"q has 4 heads and k has 3"),
        (_dtype, TypeError, r"share one dtype"),
        (_padding, ValueError, r"has 3 lengths but the batch size is 1"),  # a built-in's check
        (_mask_type, TypeError, r"mask must be None, a bool tensor"),  # the mask's kind
        (_return_lse, TypeError, r"return_lse must be True or False"),
    ],
    ids=lambda x: getattr(x, "__name__", "")[1:] or None,
)
def test_input_errors_are_runtime_errors_too(call, kind, words):
    """torch's SDPA raises RuntimeError for bad input: code ported from it (``except
    RuntimeError``) catches qkv's errors too, which stay ValueError / TypeError, messages
    unchanged."""
    q, k, v = qkv4()
    for caught in (RuntimeError, kind):
        with pytest.raises(caught, match=words):
            call(q, k, v)
    e = _raised(call, q, k, v)
    other = TypeError if kind is ValueError else ValueError
    assert not isinstance(e, other)  # a shape error is no TypeError, a type error no ValueError


def test_a_batch_mask_without_heads_names_the_fix():
    """A [B, Lq, Lk] tensor read right-aligned is [Hq, Lq, Lk]: the error says to add the head
    dimension, with the shapes, for a bool mask, a bias, and a float mask passed as mask."""
    q, k, v = qkv4(B=2, Hq=4, Hkv=2, Lq=5, Lk=6)
    fix = r"a \[B, Lq, Lk\] mask needs a head dimension: pass mask\[:, None\] "
    with pytest.raises(ValueError, match=r"mask of shape \(2, 5, 6\) does not broadcast.*" + fix):
        qkv.attention(q, k, v, mask=torch.ones(2, 5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(\[B, 1, Lq, Lk\] = \[2, 1, 5, 6\]\)"):
        qkv.attention(q, k, v, mask=torch.ones(2, 5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"a \[B, Lq, Lk\] bias needs .* pass bias\[:, None\]"):
        qkv.attention(q, k, v, score_mod=torch.zeros(2, 5, 6))
    with pytest.raises(TypeError, match=r"score_mod.*pass score_mod=mask\[:, None\]"):
        qkv.attention(q, k, v, mask=torch.zeros(2, 5, 6))
    # a 3-D tensor that the head dimension would not fix either gets the general advice
    e = _raised(qkv.attention, q, k, v, mask=torch.ones(3, 5, 6, dtype=torch.bool))
    assert "give it shape [Lq, Lk] = [5, 6]" in str(e) and "head dimension" not in str(e)
    # and with the head dimension it runs, equal to the formula
    m = torch.rand(2, 5, 6) > 0.3
    m[..., 0] = True
    out = qkv.attention(q, k, v, mask=m[:, None])
    torch.testing.assert_close(out, qkv.reference.attention(q, k, v, mask=m[:, None])[0])


def test_a_per_head_mask_for_unbatched_inputs_stays_valid():
    """[H, L, D] inputs take an [H, Lq, Lk] mask: a 3-D mask that broadcasts is no error."""
    q, k, v = (t[0] for t in qkv4(Hq=4, Hkv=4))
    m = torch.rand(4, 5, 6) > 0.3
    m[..., 0] = True
    out = qkv.attention(q, k, v, mask=m)
    assert out.shape == (4, 5, 8)
    torch.testing.assert_close(out, qkv.reference.attention(q, k, v, mask=m)[0])
