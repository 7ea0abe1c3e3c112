"""``qkv.document(ids)`` with one row of ids per batch element (``[B, L]``): every batch row
packed its own way, as in training.

Each case compares qkv with the float64 oracle given the *dense bool mask* built here from the
ids (``ids[b, i] == ids[b, j]``, and-ed or or-ed with the other masks written out by hand), so
the mask's own formula is under test too: output, lse and the gradients of q, k and v under a
random upstream gradient, by error ratio against plain PyTorch. Covered: every backend, the
compiled band kernel (which ``qkv.plan`` must say runs) forward and backward, the tile plan's
states, Triton's kernels in its interpreter, ``torch.compile`` without a recompile for new ids,
transformers' packed sequences, ``qkv.distributed``'s plan, and the errors for bad shapes.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
import torch._dynamo.testing

import qkv
from catalogue import Shape, lay_out, make_qkv
from qkv_testing import assert_matches_oracle, compare_to_oracle

Tensor = torch.Tensor

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None, reason="no C++ compiler to build qkv's CPU kernel"
)


def packed(B: int, L: int, docs: list[int], gen: torch.Generator) -> Tensor:
    """Sorted ids ``[B, L]``: row ``b`` cut at random into ``docs[b]`` documents (at most L)."""
    rows = []
    for b in range(B):
        n = min(docs[b], L)
        cuts = torch.randperm(L - 1, generator=gen)[: n - 1] + 1 if n > 1 else torch.zeros(0)
        starts = torch.zeros(L, dtype=torch.int64)
        starts[cuts.long()] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)  # [B, L]


def dense(ids: Tensor, Lq: int, Lk: int) -> Tensor:
    """The document mask written out: bool ``[B, 1, Lq, Lk]``, ``ids[b, i] == ids[b, j]``."""
    ids = ids if ids.ndim == 2 else ids.unsqueeze(0)
    return ids[:, None, :Lq, None] == ids[:, None, None, :Lk]


def band(Lq: int, Lk: int, lo: int | None, hi: int | None) -> Tensor:
    """``lo <= j - i <= hi`` written out: bool ``[1, 1, Lq, Lk]``."""
    d = torch.arange(Lk).view(1, Lk) - torch.arange(Lq).view(Lq, 1)
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if lo is not None:
        ok &= d >= lo
    if hi is not None:
        ok &= d <= hi
    return ok.view(1, 1, Lq, Lk)


def keys_below(lengths: Tensor, Lk: int) -> Tensor:
    """``j < lengths[b]`` written out: bool ``[B, 1, 1, Lk]``."""
    return (torch.arange(Lk).view(1, Lk) < lengths.view(-1, 1)).view(-1, 1, 1, Lk)


def combos(ids: Tensor, Lq: int, Lk: int) -> dict[str, tuple[Any, Tensor]]:
    """qkv's masks over ``ids`` and the same masks as dense bool tensors."""
    doc = dense(ids, Lq, Lk)
    return {
        "document": (qkv.document(ids), doc),
        "causal": (qkv.and_masks(qkv.document(ids), qkv.causal), doc & band(Lq, Lk, None, 0)),
        "window": (
            qkv.and_masks(qkv.document(ids), qkv.sliding_window(6)),
            doc & band(Lq, Lk, -6, 0),
        ),
        "or": (
            qkv.or_masks(qkv.document(ids), qkv.sliding_window(2)),
            doc | band(Lq, Lk, -2, 0),
        ),
    }


def against_dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Any,
    want: Tensor,
    *,
    backend: str = "auto",
    lse: bool = True,
    grads: bool = True,
    seed: int = 0,
) -> None:
    """qkv with ``mask`` against the oracle and plain PyTorch given the dense ``want``."""

    def fast(q: Tensor, k: Tensor, v: Tensor, **_: Any) -> Any:
        return qkv.attention(q, k, v, mask=mask, backend=backend, return_lse=lse)

    assert_matches_oracle(compare_to_oracle(fast, q, k, v, mask=want, grads=grads, seed=seed))


# ------------------------------------------------------------------- every backend, small


@pytest.mark.parametrize("backend", ["reference", "sdpa", "blocksparse", "auto"])
@pytest.mark.parametrize("combo", ["document", "causal", "window", "or"])
def test_every_backend_equals_the_dense_mask(backend: str, combo: str) -> None:
    """GQA, Lq != Lk both ways, rows of 1, 3 and 9 documents, with gradients."""
    gen = torch.Generator().manual_seed(1)
    for s in (Shape(3, 4, 2, 29, 41, 16), Shape(3, 4, 2, 41, 13, 8)):
        ids = packed(s.B, max(s.Lq, s.Lk), [1, 3, 9], gen)
        q, k, v = make_qkv(s, gen=gen)
        mask, want = combos(ids, s.Lq, s.Lk)[combo]
        against_dense(q, k, v, mask, want, backend=backend, lse=backend != "sdpa")


@pytest.mark.parametrize("L", [1, 7, 113])
def test_odd_lengths_unsorted_rows_and_rows_without_keys(L: int) -> None:
    """Odd lengths; a row of sorted ids beside a row of unsorted ones (the band kernel narrows
    one and masks the other score by score); padding that leaves a batch element no key at
    all (output 0, lse -inf, zero gradients). Without gradients the engine runs them on the
    band kernel, with gradients on its tiles; auto as it chooses."""
    gen = torch.Generator().manual_seed(L)
    s = Shape(3, 2, 1, L, L, 16)
    ids = packed(3, L, [2, 1, 5], gen)
    ids[1] = torch.randint(0, 3, (L,), generator=gen)  # unsorted
    lengths = torch.tensor([L, 0, (L + 1) // 2])
    causal, dead = qkv.causal, qkv.padding(lengths)
    want = dense(ids, L, L)
    q, k, v = make_qkv(s, gen=gen)
    cases = [
        (qkv.document(ids), want),
        (qkv.and_masks(qkv.document(ids), causal), want & band(L, L, None, 0)),
        (qkv.and_masks(qkv.document(ids), dead), want & keys_below(lengths, L)),
    ]
    for mask, m in cases:
        engine = qkv.plan(q, k, v, mask=mask, backend="blocksparse").forward
        assert "compiled band kernel" in engine
        against_dense(q, k, v, mask, m, backend="blocksparse", grads=False)
        against_dense(q, k, v, mask, m, backend="blocksparse")  # tiles, with gradients
        against_dense(q, k, v, mask, m)
    out = qkv.attention(q, k, v, mask=cases[2][0])
    assert out[1].abs().max() == 0  # batch 1 sees no key: zeros, not NaN


def test_one_row_of_ids_serves_every_batch_element() -> None:
    """``[L]``, ``[1, L]`` and ``[B, L]`` holding the same row in each give the same answer."""
    gen = torch.Generator().manual_seed(3)
    s = Shape(3, 2, 2, 50, 50, 16)
    row = packed(1, 50, [4], gen)  # [1, 50]
    q, k, v = make_qkv(s, gen=gen)
    got = [
        qkv.attention(q, k, v, mask=qkv.and_masks(qkv.causal, qkv.document(ids)))
        for ids in (row[0], row, row.expand(3, 50).clone())
    ]
    want = qkv.reference.attention(q, k, v, mask=dense(row, 50, 50) & band(50, 50, None, 0))[0]
    for out in got:
        torch.testing.assert_close(out, want)


# --------------------------------------------------------------- the compiled band kernel


def _job(q: Tensor, k: Tensor, v: Tensor, mask: Any) -> Any:
    from qkv._door import validate
    from qkv.backends.blocksparse.plan import make_job

    return make_job(validate(q, k, v, mask=mask))


@needs_compiler
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "permuted"])
def test_band_kernel_forward_and_backward(layout: str) -> None:
    """Past 2^20 scores sorted per-row ids take the compiled band kernel with gradients too
    (``qkv.plan`` says so): a row that is one document, rows of many (one of them a document
    per token), GQA, a window inside documents, padding that leaves a row no key; q, k, v in
    odd memory layouts."""
    gen = torch.Generator().manual_seed(7)
    s = Shape(4, 4, 2, 300, 300, 32)
    ids = packed(4, 300, [1, 6, 40, 300], gen)
    q, k, v = (lay_out(t, layout) for t in make_qkv(s, gen=gen))
    m = combos(ids, 300, 300)
    lengths = torch.tensor([300, 0, 150, 299])
    m["padding"] = (
        qkv.and_masks(qkv.document(ids), qkv.padding(lengths)),
        dense(ids, 300, 300) & keys_below(lengths, 300),
    )
    for name in ("document", "causal", "window", "padding"):
        mask, want = m[name]
        qg = q.detach().requires_grad_()
        plan = qkv.plan(qg, k, v, mask=mask, backend="blocksparse")
        assert "compiled band kernel" in plan.forward and "document ids" in plan.forward, name
        assert "compiled band kernel" in plan.backward, name
        assert _job(q, k, v, mask).native_band is not None, name
        against_dense(q, k, v, mask, want, backend="blocksparse", seed=len(name))


def test_unsorted_rows_past_2_20_scores_take_the_tiles() -> None:
    """A batch row of unsorted ids would make the kernel compare scores one by one over the
    whole band: past 2^20 scores the tile plans run it, and say why not the kernel."""
    from qkv._door import validate
    from qkv.backends.blocksparse.plan import native_band

    gen = torch.Generator().manual_seed(9)
    s = Shape(2, 2, 1, 520, 520, 16)
    ids = packed(2, 520, [3, 1], gen)
    ids[1, ::7] = 5  # every 7th position in a document of its own: unsorted
    q, k, v = make_qkv(s, gen=gen)
    mask, want = combos(ids, 520, 520)["causal"]
    assert "not sorted" in str(native_band(validate(q, k, v, mask=mask)))
    assert _job(q, k, v, mask).route == "pieces"
    against_dense(q, k, v, mask, want)


class _Kernel(torch.autograd.Function):
    """The band kernel's forward and backward with a mask's document ids, called as the engine
    calls them (small problems take the kernel only without gradients; its backward is
    reached here directly)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Any) -> tuple[Tensor, Tensor]:
        from qkv._door import validate
        from qkv.backends.blocksparse import native
        from qkv.backends.blocksparse.plan import band_edges

        p = validate(q, k, v, mask=mask)
        lo, hi = band_edges(p)
        more = native.extras(p.mask.terms, p.B)
        out, lse = native.band_forward(q, k, v, lo, hi, p.scale, more)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (lo, hi, p.scale, more)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor) -> tuple[Any, ...]:
        from qkv.backends.blocksparse import native
        from qkv.backends.blocksparse.grads import lse_hi_lo

        q, k, v, out, lse = ctx.saved_tensors
        lo, hi, scale, more = ctx.meta
        lse_hi, lse_lo = lse_hi_lo(lse.double(), torch.float32)
        dq, dk, dv = native.band_backward(
            q, k, v, out, dout, lse_hi, lse_lo, dlse, lo, hi, scale, more
        )
        return dq, dk, dv, None


@needs_compiler
@pytest.mark.parametrize("L", [1, 7, 113])
def test_band_kernel_backward_at_odd_lengths(L: int) -> None:
    """The kernel's own backward on small problems, gradients through the lse too: sorted
    and unsorted rows side by side, Lq != Lk, GQA, rows of ids longer than the sequence (the
    kernel steps a whole row per batch element)."""
    gen = torch.Generator().manual_seed(11 + L)
    for s in (Shape(3, 4, 2, L, L, 16), Shape(3, 4, 1, L, L + 5, 8)):
        n = max(s.Lq, s.Lk) + 3
        ids = packed(3, n, [3, 1, 7], gen)
        ids[2] = torch.randint(0, 2, (n,), generator=gen)  # unsorted
        q, k, v = make_qkv(s, gen=gen)
        for mask, want in list(combos(ids, s.Lq, s.Lk).values())[:3]:

            def kernel(q: Tensor, k: Tensor, v: Tensor, *, m: Any = mask, **_: Any) -> Any:
                return _Kernel.apply(q.contiguous(), k.contiguous(), v.contiguous(), m)

            assert_matches_oracle(compare_to_oracle(kernel, q, k, v, mask=want))


@needs_compiler
def test_band_kernel_refuses_ids_of_another_batch() -> None:
    """The operator checks the ids it is given (the Python side never passes these)."""
    from qkv.backends.blocksparse import native

    q = torch.randn(2, 1, 8, 8)
    for ids in (torch.zeros(3, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long)):
        with pytest.raises(RuntimeError, match=r"ids must be .* \[L\] or \[1 or B, L\]"):
            native.band_forward(q, q, q, -7, 7, 1.0, (None, None, ids))


def test_without_the_compiled_kernel_the_tiles_run(torch_kernels: None) -> None:
    """``QKV_NATIVE=0``: the engine plans each batch row's tiles from its ids and runs them."""
    gen = torch.Generator().manual_seed(5)
    s = Shape(4, 4, 2, 300, 300, 16)
    ids = packed(4, 300, [1, 3, 5, 60], gen)
    q, k, v = make_qkv(s, gen=gen)
    mask, want = combos(ids, 300, 300)["causal"]
    assert "compiled band kernel" not in qkv.plan(q, k, v, mask=mask).forward
    against_dense(q, k, v, mask, want)


# ------------------------------------------------------------------------------ tile plans


@pytest.mark.parametrize("sort", [True, False])
def test_tile_states_per_row_equal_the_dense_mask_reduced(sort: bool) -> None:
    """Each batch row's block states (empty, partial, full) come from its ids alone, no
    position evaluated, and equal the dense mask reduced block by block."""
    gen = torch.Generator().manual_seed(2)
    L, bs = 100, 16
    ids = packed(3, L, [1, 4, 30], gen)
    if not sort:
        ids[1:] = torch.randint(0, 3, (2, L), generator=gen)
    bm = qkv.block_mask(qkv.document(ids), 3, 2, L, L, block_size=bs)
    assert not bm.evaluated
    n = -(-L // bs)
    m = torch.nn.functional.pad(dense(ids, L, L)[:, 0], (0, n * bs - L, 0, n * bs - L))
    blocks = m.view(3, n, bs, n, bs)
    real = torch.nn.functional.pad(
        torch.ones(L, L, dtype=torch.bool), (0, n * bs - L, 0, n * bs - L)
    )
    real = real.view(n, bs, n, bs)
    anyb = blocks.any(4).any(2)
    allb = (blocks | ~real).all(4).all(2)
    want = anyb.to(torch.int8) + (anyb & allb).to(torch.int8)  # [3, n, n]
    assert torch.equal(bm.states.expand(3, 2, n, n)[:, 0], want)


# ---------------------------------------------------------------------- errors and values


def test_bad_shapes_are_refused_with_the_fix() -> None:
    q = torch.randn(2, 1, 8, 4)
    with pytest.raises(ValueError, match=r"got shape \(2, 2, 8\).*reshape\(-1, ids.shape\[-1\]\)"):
        qkv.document(torch.zeros(2, 2, 8, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"shape \[3, 8\]: 3 rows but the batch size is 2.*\[2, L\]"
    ):
        qkv.attention(q, q, q, mask=qkv.document(torch.zeros(3, 8, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"has 6 entries per row \(shape \[2, 6\]\).*= 8"):
        qkv.attention(
            q,
            q,
            q,
            mask=qkv.and_masks(qkv.causal, qkv.document(torch.zeros(2, 6, dtype=torch.long))),
        )


def test_per_row_ids_are_a_value_and_name_their_shape() -> None:
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert qkv.document(ids) == qkv.document(ids) != qkv.document(ids.clone())
    assert repr(qkv.document(ids)) == "qkv.document(<2 x 8 ids>)"


# ------------------------------------------------------------------ Triton's interpreter


@pytest.mark.parametrize("sort", [True, False])
def test_triton_reads_each_rows_ids(sort: bool) -> None:
    """Triton's kernels read batch b's row of ids in the kernel (not as bits); forward,
    gradients and lse equal the dense mask (in the interpreter on a CPU)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(4)
    s = Shape(3, 4, 2, 70, 70, 16)
    ids = packed(3, 75, [1, 3, 9], gen)  # (rows longer than the sequence)
    if not sort:
        ids[1] = torch.randint(0, 3, (75,), generator=gen)
    mask, want = combos(ids.to(device), 70, 70)["causal"]
    q, k, v = make_qkv(s, gen=gen, device=device)
    plan = qkv.plan(q, k, v, mask=mask, backend="triton")
    assert "ids[b, q] == ids[b, kv]" in plan.forward
    against_dense(q, k, v, mask, want, backend="triton")


# ----------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("s", [Shape(2, 2, 2, 40, 40, 16), Shape(2, 4, 2, 600, 600, 16)])
def test_compiled_new_ids_do_not_recompile(s: Shape) -> None:
    """New ids (new tensors, new values, same shape) reuse the graph: the dense formula in
    the graph for a small call, the engine's operator beyond; equal to eager, gradients too."""
    gen = torch.Generator().manual_seed(6)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = torch.compile(qkv.attention, fullgraph=True, backend=counter)
    for docs in ([1, 4], [7, 2], [3, 3]):
        ids = packed(s.B, s.Lq, docs, gen)
        mask = qkv.and_masks(qkv.document(ids), qkv.causal)
        q, k, v = make_qkv(s, gen=gen, requires_grad=True)
        got = f(q, k, v, mask=mask)
        want = qkv.attention(q, k, v, mask=mask)
        up = torch.randn(got.shape, generator=gen)
        for a, b in zip(
            torch.autograd.grad(got, (q, k, v), up),
            torch.autograd.grad(want, (q, k, v), up),
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


# -------------------------------------------------------------- transformers, distributed


def test_transformers_packed_rows_become_per_row_documents() -> None:
    """transformers' packed-sequence ids ``[B, L]`` that differ between rows translate into
    ``qkv.document`` with those rows (the kernels' fast paths), no value read to decide."""
    mu = pytest.importorskip("transformers.masking_utils")
    from qkv._core.kinds import classify_mask
    from qkv.hf import mask_function

    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])  # [2, 12]
    fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(ids))
    got = mask_function(2, 12, 12, mask_function=fn)
    terms = classify_mask(got.mask).terms
    assert terms.causal and terms.ids is not None and torch.equal(terms.ids, ids)


def test_distributed_plan_keeps_each_rows_documents_apart() -> None:
    """``qd.plan`` classifies per-row ids at global positions: a chunk pair is skipped only
    where no batch row's documents meet."""
    import qkv.distributed as qd

    ids = torch.zeros(2, 1000, dtype=torch.int64)
    ids[0, 500:] = 1  # row 0: two documents [0, 500), [500, 1000); row 1: one document
    split = qd.plan(1, 1, 1000, 16, mask=qkv.document(ids[:1]), world_size=4, layout="contiguous")
    assert [rp.peers for rp in split.ranks] == [(1,), (0,), (3,), (2,)]
    both = qd.plan(2, 1, 1000, 16, mask=qkv.document(ids), world_size=4, layout="contiguous")
    assert [sorted(rp.peers) for rp in both.ranks] == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]


def _world(rank: int, W: int, port: int, out: str) -> None:
    """A spawned rank: ``dist_cases.run_case`` on per-row documents (with causal), both
    layouts, against single-process qkv and the float64 oracle."""
    import dist_cases
    from dist_testing import finish, init_worker

    def rows(L: int, g: torch.Generator) -> Any:
        ids = torch.stack([dist_cases._docs(L, g), torch.zeros(L, dtype=torch.int64)])
        return qkv.and_masks(qkv.causal, qkv.document(ids))

    dist_cases.CASES["per-row documents"] = dist_cases.Case(B=2, mask=rows)
    init_worker(rank, W, port)
    results = {
        lay: dist_cases.run_case(rank, W, lay, "per-row documents")
        for lay in ("zigzag", "contiguous")
    }
    finish(out, rank, results)


@pytest.mark.extended
def test_distributed_attention_with_per_row_documents() -> None:
    from dist_testing import run_world

    fails = [
        f"rank {r}: {f}"
        for r, res in enumerate(run_world(2, _world))
        for x in res.values()
        for f in x
    ]
    assert not fails, "\n".join(fails)


# ---------------------------------------------------------------------------- decode step


def test_a_decode_step_with_per_row_documents() -> None:
    """One query row per batch element against its cached keys (Lq = 1 < Lk)."""
    gen = torch.Generator().manual_seed(8)
    s = Shape(3, 4, 2, 1, 40, 16)
    ids = packed(3, 40, [1, 2, 5], gen)
    q, k, v = make_qkv(s, gen=gen)
    mask, want = combos(ids, 1, 40)["document"]
    against_dense(q, k, v, mask, want, grads=False)
    against_dense(q, k, v, mask, want)
