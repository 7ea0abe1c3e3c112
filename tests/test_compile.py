"""qkv.attention under torch.compile(fullgraph=True): every mask and score kind traces into one
graph, forward and backward, and equals eager, at every size; a mod dynamo cannot trace is
refused in one line.

While dynamo traces, ``auto`` takes SDPA where it can, the plain formula for small calls (in
checkpointed chunks past the dense limit for a user's score_mod), and beyond that the
block-sparse engine as registered operators (a window: the band kernel's own). The matrix
uses ``backend="aot_eager"`` (it traces what inductor compiles, without code generation); a
few cases run inductor itself.
``benchmarks/compile_matrix.py`` reports graph breaks and compile times per case.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import qkv
from catalogue import LAYOUTS, Shape, lay_out, make_qkv
from qkv._core.lru import LRU
from qkv_testing import plain_attention

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-inductor-"))

SHAPE = Shape(2, 4, 2, 40, 40, 16)


def _cases() -> dict[str, dict]:
    L = SHAPE.Lk
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(L) * 3 // L
    return {
        "none": {},
        "causal": {"mask": qkv.causal},
        "window": {"mask": qkv.sliding_window(5)},
        "prefix_lm": {"mask": qkv.prefix_lm(6)},
        "document": {"mask": qkv.document(ids)},
        "padding": {"mask": qkv.padding(torch.tensor([L - 5, 9]))},
        "and": {"mask": qkv.and_masks(qkv.causal, qkv.document(ids))},
        "or": {"mask": qkv.or_masks(qkv.sliding_window(3), qkv.prefix_lm(4))},
        "bool": {"mask": torch.rand(L, L, generator=gen) > 0.3},
        "blockmask": {"mask": qkv.block_mask(qkv.causal, 2, 4, L, L, block_size=16)},
        "mask_mod": {"mask": lambda b, h, qi, ki: (qi - ki) % 3 == 0},
        "bias": {"score_mod": torch.randn(1, 4, L, L, generator=gen)},
        "alibi": {"mask": qkv.causal, "score_mod": qkv.alibi(qkv.alibi_slopes(4))},
        "softcap": {"score_mod": qkv.softcap(20.0)},
        "score_mod": {"score_mod": lambda s, b, h, qi, ki: s * 0.5 + h},
        "lse": {"mask": qkv.sliding_window(4), "return_lse": True},
        "gqa_lq_ne_lk": {"mask": qkv.causal, "return_lse": True},
    }


CASES = _cases()


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _fwd_bwd(fn, q, k, v, kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    loss = out[0].sum() + out[1].sum() if isinstance(out, tuple) else out.sum()
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_traces_and_equals_eager(name: str):
    q, k, v = make_qkv(SHAPE.replace(Lq=23) if name == "gqa_lq_ne_lk" else SHAPE, gen=1)
    kw = CASES[name]
    want = _fwd_bwd(qkv.attention, q, k, v, kw)
    f = torch.compile(qkv.attention, fullgraph=True, backend="aot_eager")
    got = _fwd_bwd(f, q, k, v, kw)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mods_made_inside_the_compiled_function_trace():
    """Closures made inside the compiled function are new at every call, so their calling
    convention is decided while dynamo traces (no value comparisons there): a broadcasting
    mask_mod, a score_mod with a learnable tensor, and a mask_mod written for vmap, within
    the dense limit and past it (in chunks, the first not checkpointed: a mod decides how to
    call it on its first call, which a checkpointed region may not). Against
    eager float64 (as the oracle tests measure): the output within 2x and the gradients
    within 3x the error of the plain formula in float32 (the gradient of the score_mod's
    tensor sums 12800 terms, in another order once compiled)."""
    q, k, v = make_qkv(SHAPE, gen=6)
    t = torch.randn(SHAPE.Hq, generator=torch.Generator().manual_seed(6))
    table = torch.rand(SHAPE.Lq, SHAPE.Lk, generator=torch.Generator().manual_seed(6)) > 0.2
    table.fill_diagonal_(True)

    def f(q, k, v, t, n, vmap_only, attend=qkv.attention):
        def first_n(b, h, qi, ki):
            return (ki <= qi) | (ki < n)

        def per_element(b, h, qi, ki):
            return table[qi][ki]  # indexing twice: works only one element at a time

        def bias(s, b, h, qi, ki):
            return s + t[h] * (qi - ki).abs()

        return attend(q, k, v, mask=per_element if vmap_only else first_n, score_mod=bias)

    def plain(*args, **kw):
        return plain_attention(*args, **kw)[0]

    def run(fn, dtype, vmap_only, **kw):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, t)]
        out = fn(*leaves, torch.tensor(7), vmap_only, **kw)
        return [out, *torch.autograd.grad(out.sum(), leaves)]

    # and past a dense limit of 64 KiB: the plain formula in chunks of query rows (13 rows)
    for vmap_only, limit in ((False, None), (True, None), (False, 1 << 16), (True, 1 << 16)):
        torch._dynamo.reset()
        g = torch.compile(f, fullgraph=True, backend="aot_eager")
        old = qkv.set_dense_limit(limit) if limit else None
        try:
            got = run(g, torch.float32, vmap_only)  # first: nothing decided before the trace
        finally:
            if old is not None:
                qkv.set_dense_limit(old)
        base, exact = (
            run(f, torch.float32, vmap_only, attend=plain),
            run(f, torch.float64, vmap_only),
        )
        for i, (a, b, x) in enumerate(zip(got, base, exact, strict=True)):
            err, plain_err = (a.double() - x).abs().max(), (b.double() - x).abs().max()
            name, factor = ["out", "dq", "dk", "dv", "dt"][i], 2 if i == 0 else 3
            assert err <= factor * plain_err + 1e-6, f"{name}: {err:.3g}, plain {plain_err:.3g}"


def test_new_values_of_the_same_shapes_do_not_recompile():
    q, k, v = make_qkv(SHAPE, gen=2)
    counter = torch._dynamo.testing.CompileCounter()
    f = torch.compile(qkv.attention, fullgraph=True, backend=counter)
    f(q, k, v, mask=qkv.document(torch.arange(40) // 20))
    q2, k2, v2 = make_qkv(SHAPE, gen=3)
    out = f(q2, k2, v2, mask=qkv.document(torch.arange(40) // 10))  # new ids, same shape
    want = qkv.attention(q2, k2, v2, mask=qkv.document(torch.arange(40) // 10))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_beyond_the_dense_limit_it_still_runs():
    """The plain formula is taken only within the dense limit; beyond it the block-sparse
    engine runs (with graph breaks) rather than the call failing."""
    q, k, v = make_qkv(SHAPE, gen=4)
    old = qkv.set_dense_limit(1024)
    try:
        want = qkv.attention(q, k, v, mask=qkv.sliding_window(5))
        got = torch.compile(qkv.attention, backend="aot_eager")(q, k, v, mask=qkv.sliding_window(5))
    finally:
        qkv.set_dense_limit(old)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L", [30, 520], ids=["dense", "operators"])
def test_multi_head_attention_with_a_window_and_documents_compiles_fullgraph(L):
    """A training step through MultiHeadAttention, whose q/k/v are transposed views of its
    projections, equals eager: in the dense formula and (past 2^20 scores) through the
    engine's operators and the band kernel's, whose gradients the compiled backward views
    by the strides their fake implementations give (they differed once: a RuntimeError)."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, n_kv_heads=2, rope=True)
    x = torch.randn(1 if L > 30 else 2, L, 32)

    def step(module, mask):
        xl = x.detach().requires_grad_()
        out = module(xl, mask=mask)
        return [out.detach(), *torch.autograd.grad(out.sum(), [xl, *mha.parameters()])]

    for mask in (qkv.sliding_window(6), qkv.document(torch.arange(L) // (L // 3))):
        want = step(mha, mask)
        got = step(torch.compile(mha, fullgraph=True, backend="aot_eager"), mask)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# Beyond SMALL_DENSE (2^20 scores): the block-sparse engine, as the qkv::blocksparse operator
# while dynamo traces. GQA and Lq != Lk in every case.
BIG = Shape(1, 4, 2, 600, 520, 16)


def _big_cases() -> dict[str, dict]:
    L = BIG.Lk
    gen = torch.Generator().manual_seed(7)
    ids = torch.arange(BIG.Lq) * 4 // BIG.Lq  # covering max(Lq, Lk)
    return {
        "window": {"mask": qkv.sliding_window(40)},
        "causal_document": {"mask": qkv.and_masks(qkv.causal, qkv.document(ids))},
        "padding": {"mask": qkv.padding(torch.tensor([L - 77]), start=torch.tensor([5]))},
        "prefix_lm": {"mask": qkv.prefix_lm(50)},
        "bool": {"mask": torch.rand(BIG.Lq, L, generator=gen) > 0.4},
        "bias": {"score_mod": torch.randn(1, 4, BIG.Lq, L, generator=gen).requires_grad_()},
        # (the engine's backward plans anew in the graph: a bias needing a gradient is not fused)
        "prefix_bias": {
            "mask": qkv.prefix_lm(50),
            "score_mod": torch.randn(1, 4, BIG.Lq, L, generator=gen).requires_grad_(),
        },
        "alibi": {"mask": qkv.causal, "score_mod": qkv.alibi(qkv.alibi_slopes(4).requires_grad_())},
        "softcap": {"mask": qkv.sliding_window(64), "score_mod": qkv.softcap(5.0)},
        "relative": {"score_mod": qkv.relative_bias(torch.randn(17, 4).requires_grad_(), 8)},
        "lse": {"mask": qkv.sliding_window(30), "return_lse": True},
    }


def _learnable(kw: dict) -> list[torch.Tensor]:
    s = kw.get("score_mod")
    found = (
        [s] if isinstance(s, torch.Tensor) else [getattr(s, a, None) for a in ("slopes", "table")]
    )
    return [t for t in found if isinstance(t, torch.Tensor) and t.requires_grad]


def _graph_ops(counter) -> set[str]:
    """What the graphs a counting backend saw call, nested graphs (an autograd.Function's
    forward and backward bodies) included."""
    return {
        str(n.target)
        for g in counter.graphs
        for m in g.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
    }


@pytest.mark.parametrize("name", list(_big_cases()))
def test_fullgraph_beyond_the_dense_formula_runs_the_engine_as_an_operator(name: str):
    kw = _big_cases()[name]
    q, k, v = make_qkv(BIG, gen=8)

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, **kw)
        loss = out[0].sum() + out[1].sum() if isinstance(out, tuple) else out.sum()
        return [loss.detach(), *torch.autograd.grad(loss, leaves + _learnable(kw))]

    want = run(qkv.attention)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = run(torch.compile(qkv.attention, fullgraph=True, backend=counter))
    assert counter.frame_count == 1
    ops = _graph_ops(counter)
    # (a bias alone is SDPA's, as in eager; a window takes the band kernel's own operator)
    engine = {"bias": None, "window": "qkv.band"}.get(name, "qkv.blocksparse")
    if engine is not None:
        assert engine in ops, sorted(ops)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _tilt(s, b, h, qi, ki):
    return s - 0.01 * (qi - ki).abs()


# The compiled paths beyond the dense formula: the engine's operator (documents), the band
# kernel's own operators (a window), and the plain formula in chunks (a user's score_mod past
# a 6 MiB dense limit: 2 rows, then 230 at a time). Each path runs in every layout; the
# chunks' slower compiles run in three by default (a last-dim stride of 2, permuted storage,
# and contiguous), the others in the extended run.
# contiguous chunks are test_fullgraph_beyond_the_dense_formula_runs_the_engine_as_an_operator's
_CHUNKS_DEFAULT = {"every_other", "permuted"}
_PATHS = {
    "operator": ({"mask": qkv.document(torch.arange(BIG.Lq) * 3 // BIG.Lq)}, None),
    "band": ({"mask": qkv.sliding_window(40)}, None),
    "chunks": ({"mask": qkv.causal, "score_mod": _tilt}, 6 << 20),
}


@pytest.mark.parametrize(
    ("layout", "path"),
    [
        (lay, path)
        if path != "chunks" or lay in _CHUNKS_DEFAULT
        else pytest.param(lay, path, marks=pytest.mark.extended)
        for lay in LAYOUTS
        for path in _PATHS
    ],
)
def test_the_compiled_paths_take_any_memory_layout_and_pass_a_nan_on(layout: str, path: str):
    """q, k, v strided, transposed, permuted, offset or expanded reach each compiled path as
    they are: output and gradients equal eager's; a NaN in a query row makes that row NaN."""
    q, k, v = make_qkv(BIG, gen=12)
    kw, limit = _PATHS[path]
    f = torch.compile(qkv.attention, fullgraph=True, backend="aot_eager")

    def run(fn, a):
        leaves = [lay_out(x.detach(), layout).requires_grad_() for x in (a, k, v)]
        out = fn(*leaves, **kw)
        return [out, *torch.autograd.grad(out.sum(), leaves)]

    old = qkv.set_dense_limit(limit) if limit else None
    try:
        for a, b in zip(run(f, q), run(qkv.attention, q), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        bad = q.clone()
        bad[0, :, 300] = float("nan")  # every head (an expanded layout keeps one head's values)
        out = f(lay_out(bad, layout), lay_out(k, layout), lay_out(v, layout), **kw)
    finally:
        if old is not None:
            qkv.set_dense_limit(old)
    assert out[0, :, 300].isnan().all() and torch.isfinite(out[0, :, :300]).all()


def test_the_operator_takes_new_ids_and_user_mask_mods():
    q, k, v = make_qkv(BIG, gen=9)
    counter = torch._dynamo.testing.CompileCounter()
    f = torch.compile(qkv.attention, fullgraph=True, backend=counter)
    for cut in (100, 300):  # new document ids of the same shape: the same graph
        mask = qkv.document((torch.arange(BIG.Lq) >= cut).long())
        torch.testing.assert_close(f(q, k, v, mask=mask), qkv.attention(q, k, v, mask=mask))
    assert counter.frame_count == 1

    # A user's mask_mod is code: evaluated in the graph into a bool tensor for the operator.
    def near(b, h, qi, ki):
        return ki <= qi + 3

    torch.testing.assert_close(f(q, k, v, mask=near), qkv.attention(q, k, v, mask=near))


@pytest.mark.parametrize("shape", [SHAPE, BIG], ids=["dense", "operator"])
def test_flexattention_block_masks_compile_fullgraph(shape):
    """A FlexAttention BlockMask (its block lists and mask_mod) is converted in the graph:
    fullgraph, forward and backward equal to eager, and a new BlockMask of the same shapes
    (new document ids in a new closure, as a training loop makes one per batch) reuses the
    graph. Within the dense formula and through the engine's operator."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = make_qkv(shape, gen=23)

    def documents(ids):
        def mod(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx + shape.Lk - shape.Lq)

        return mod

    L = max(shape.Lq, shape.Lk)
    masks = [documents(torch.arange(L) // n) for n in (7, 23)] + [flex.noop_mask]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = torch.compile(qkv.attention, fullgraph=True, backend=counter)
    for mod in masks:
        bm = flex.create_block_mask(mod, shape.B, None, shape.Lq, shape.Lk, device="cpu")
        got, want = (_fwd_bwd(fn, q, k, v, {"mask": bm}) for fn in (f, qkv.attention))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 2, counter.frame_count  # the documents' graph, noop's


def _dynamic_case(name: str, shape, n: int) -> dict:
    if name == "window":
        return {"mask": qkv.sliding_window(n)}
    if name == "or":
        return {"mask": qkv.or_masks(qkv.sliding_window(n), qkv.prefix_lm(2 * n))}
    if name == "softcap":
        return {"mask": qkv.prefix_lm(n), "score_mod": qkv.softcap(float(n))}
    if name == "relative":
        table = torch.linspace(-1, 1, (2 * n + 1) * shape.Hq).view(2 * n + 1, shape.Hq)
        return {"score_mod": qkv.relative_bias(table, n)}
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    mod = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= n  # noqa: E731
    return {"mask": flex.create_block_mask(mod, shape.B, None, shape.Lq, shape.Lk, device="cpu")}


@pytest.mark.parametrize(
    "name, shape",
    [("window", BIG), ("or", BIG), ("relative", BIG), ("softcap", SHAPE), ("flex_bm", BIG)],
    ids=["window", "or", "relative", "softcap-dense", "flex_bm"],
)
def test_dynamic_true_traces_and_new_parameters_give_their_own_answers(name, shape):
    """``torch.compile(dynamic=True)`` makes the ints and floats a mask or score carries
    symbolic (a window's edges, a softcap, a relative distance): they cannot be written into
    an operator's spec, sorted, or named while tracing. They travel as 0-d tensors instead,
    and a second call with other parameters, through the same compiled function, equals
    eager (a kept plan keyed by the spec alone would answer for the first). Backend
    "eager": what fails is dynamo's tracing, and AOTAutograd traces symbolic shapes 3-4x
    slower."""
    q, k, v = make_qkv(shape, gen=31)
    f = torch.compile(qkv.attention, fullgraph=True, dynamic=True, backend="eager")
    for n in (9, 4) if shape is BIG else (9,):  # (the dense formula keeps no plan)
        kw = _dynamic_case(name, shape, n)
        got, want = (_fwd_bwd(fn, q, k, v, kw) for fn in (f, qkv.attention))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vmap_only", [False, True], ids=["broadcasting", "vmap"])
def test_a_mod_made_in_the_trace_serves_every_length_under_dynamic_shapes(vmap_only):
    """A closure made inside the compiled function has its calling convention decided while
    dynamo traces, by probing positions: with symbolic lengths those must not be computed
    from the length (each would guard on it, and every new length would recompile). One
    graph serves three lengths, equal to eager."""
    table = torch.rand(64, 64, generator=torch.Generator().manual_seed(5)) > 0.3
    table.fill_diagonal_(True)

    def f(q, k, v):
        def near(b, h, qi, ki):
            return (ki <= qi) & (qi - ki < 9)

        def per_element(b, h, qi, ki):
            return table[qi][ki]  # indexing twice: works only one element at a time

        return qkv.attention(q, k, v, mask=per_element if vmap_only else near)

    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    g = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for L in (20, 33, 47):
        q, k, v = make_qkv(Shape(1, 2, 2, L, L, 8), gen=L)
        torch.testing.assert_close(g(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_is_symbolic_tells_dynamos_symbolic_numbers():
    """qkv tells a symbolic int or float from a constant by ``(x == x) is not True``; this
    fails if dynamo changes how it answers."""
    from qkv._core.tracing import is_symbolic

    class Holder:
        def __init__(self, n: int, x: float) -> None:
            self.n, self.x = n, x

    def f(t, h):
        return t + 10 * is_symbolic(h.n) + is_symbolic(h.x)

    assert not is_symbolic(3) and not is_symbolic(0.5)
    for dynamic, want in ((True, 11.0), (False, 0.0)):
        torch._dynamo.reset()
        g = torch.compile(f, fullgraph=True, dynamic=dynamic, backend="eager")
        assert g(torch.zeros(()), Holder(3, 0.5)).item() == want, dynamic


@pytest.mark.parametrize("spec", ["causal", "band(-8,0)", "prefix(5)", "doc(#0)"])
def test_the_operators_outputs_have_the_strides_their_fake_implementations_give(spec):
    """The compiled graph lays out what follows an operator by its fake implementation's
    strides, so the real outputs must have them, for q/k/v in any layout (a causal call's
    kernel wrote its output as [B, L, H, D] while the fake said contiguous)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(2, 40, 4, 16).transpose(1, 2)  # a projection's layout
    k, v = (torch.randn(2, 40, 2, 16).transpose(1, 2) for _ in range(2))
    mt = [torch.arange(40) // 15] if spec.startswith("doc") else []
    slopes = [qkv.alibi_slopes(4)]
    fwd, bwd = torch.ops.qkv.blocksparse, torch.ops.qkv.blocksparse_backward

    def run(q, k, v, mt, slopes):
        out, lse = fwd(q, k, v, spec, mt, "alibi(#0)", slopes, 0.25, True)
        grads = bwd(q, k, v, out, lse, out, None, spec, mt, "alibi(#0)", slopes, 0.25,
                    [True, True, True, True])  # fmt: skip
        return [out, lse, *grads]

    real = run(q, k, v, mt, slopes)
    with FakeTensorMode() as mode:
        fake = run(*(mode.from_tensor(t) for t in (q, k, v)),
                   [mode.from_tensor(t) for t in mt], [mode.from_tensor(slopes[0])])  # fmt: skip
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dslopes"], real, fake, strict=True):
        assert (a.shape, a.stride()) == (b.shape, b.stride()), name


def test_a_user_score_mod_beyond_the_dense_formula_compiles_whole():
    """A score_mod is code and cannot cross the engine's operator: under torch.compile the
    plain formula takes it into the graph (gradients into the tensor it closes over
    included). Past the dense limit it works in checkpointed chunks of query rows, still one
    graph; only when one row's scores pass the limit does the default compile run the engine
    eagerly behind one graph break, and fullgraph=True fails saying why. qkv.plan says so
    beforehand."""
    q, k, v = make_qkv(BIG, gen=11)
    t = torch.rand(BIG.Hq, generator=torch.Generator().manual_seed(11)).requires_grad_()

    def tilt(s, b, h, qi, ki):
        return s - 0.01 * t[h] * (qi - ki).abs()

    def run(fn, **kw):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = fn(*leaves, mask=qkv.causal, score_mod=tilt, return_lse=True, **kw)
        return [out, lse, *torch.autograd.grad(out.sum(), [*leaves, t])]

    def same(got, want):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    want = run(qkv.attention)
    torch._dynamo.reset()
    same(run(torch.compile(qkv.attention, fullgraph=True, backend="aot_eager")), want)

    # 8 MiB: all the scores at once need ~15.5 MiB, one row ~26 KiB: chunks of 2, 308, 290 rows
    old = qkv.set_dense_limit(1 << 23)
    try:
        plan = qkv.plan(q, k, v, mask=qkv.causal, score_mod=tilt)
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        same(run(torch.compile(qkv.attention, fullgraph=True, backend=counter)), want)
        assert counter.frame_count == 1, counter.frame_count
        # dropout's mask is drawn once per chunk: the recomputed chunk draws the same one
        # (out is linear in v, so <g, out> = <v, d<g, out>/dv> holds only if it does)
        f = torch.compile(qkv.attention, fullgraph=True, backend="aot_eager")
        vv = v.detach().requires_grad_()
        out = f(q, k, vv, mask=qkv.causal, score_mod=tilt, dropout_p=0.3)
        g = torch.randn_like(out)
        (dv,) = torch.autograd.grad((out * g).sum(), [vv])
        torch.testing.assert_close((dv * vv).sum(), (out * g).sum(), rtol=1e-4, atol=1e-4)

        qkv.set_dense_limit(1 << 10)  # not even one row's scores fit
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        same(run(torch.compile(qkv.attention, backend=counter)), want)
        assert counter.frame_count <= 2, counter.frame_count  # around the one break
        torch._dynamo.reset()
        f = torch.compile(qkv.attention, fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception, match="score_mod \\(code\\) beyond 2\\^20 scores"):
            f(q, k, v, mask=qkv.causal, score_mod=tilt)
    finally:
        qkv.set_dense_limit(old)
    # qkv.plan (eager) says so beforehand, naming the mod; a built-in score compiles whole.
    notes = [n for n in plan.notes if "under torch.compile" in n and "tilt" in n]
    assert notes and "chunks of query rows" in notes[0], plan.notes
    notes = qkv.plan(q, k, v, mask=qkv.causal, score_mod=qkv.alibi(qkv.alibi_slopes(BIG.Hq))).notes
    assert not [n for n in notes if "under torch.compile" in n], notes


def test_mods_written_for_vmap_compile_whole():
    """A user's mods that work only one element at a time (FlexAttention's convention): under
    broadcasting the score_mod raises (its shapes do not broadcast), which no ``except`` in
    traced code can catch, so functions that exist outside the trace are decided there, on
    real tensors, by a function dynamo calls eagerly (assume_constant_result). Fullgraph
    equals eager, gradients into the score_mod's table included: within the dense formula,
    past the dense limit (in chunks), and with a mask_mod evaluated for the engine's
    operator."""
    gen = torch.Generator().manual_seed(12)
    table = (0.1 * torch.randn(BIG.Lq, BIG.Lk, generator=gen)).requires_grad_()
    allowed = torch.rand(BIG.Lq, BIG.Lk, generator=gen) > 0.3

    def per_element_score(s, b, h, qi, ki):
        return s + table[qi][ki]  # indexing twice: one element at a time only

    def per_element_mask(b, h, qi, ki):
        return allowed[qi][ki]

    def run(fn, q, k, v, **kw):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, **kw)
        params = [table] if "score_mod" in kw else []
        return [out, *torch.autograd.grad(out.sum(), [*leaves, *params])]

    small = SHAPE.replace(Lq=40, Lk=40)
    for shape, limit, kw in (
        (small, None, {"score_mod": per_element_score, "mask": per_element_mask}),
        (BIG, 1 << 23, {"score_mod": per_element_score, "mask": qkv.causal}),
        (BIG, None, {"mask": per_element_mask}),
    ):
        q, k, v = make_qkv(shape, gen=13)
        old = qkv.set_dense_limit(limit) if limit else None
        try:
            want = run(qkv.attention, q, k, v, **kw)
            torch._dynamo.reset()
            f = torch.compile(qkv.attention, fullgraph=True, backend="aot_eager")
            got = run(f, q, k, v, **kw)
        finally:
            if old is not None:
                qkv.set_dense_limit(old)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


_FLAG = torch.tensor(True)
_WEIGHT = torch.tensor([0.5])


def _branches_on_a_value(b, h, q_idx, kv_idx):
    if _FLAG:  # a Python branch on a tensor's value: eager only
        return kv_idx <= q_idx
    return kv_idx >= 0


def _reads_floats(score, b, h, q_idx, kv_idx):
    return score * _WEIGHT.tolist()[0]  # float values read in Python: eager only


_TABLE = torch.rand(SHAPE.Lq, SHAPE.Lk)


def _reads_floats_per_element(score, b, h, q_idx, kv_idx):
    # FlexAttention's convention (indexing twice: qkv runs it through torch.vmap)
    return score + _TABLE[q_idx][kv_idx] * _WEIGHT.tolist()[0]


def _line_of(fn, text: str) -> str:
    import inspect

    lines, first = inspect.getsourcelines(fn)
    at = next(i for i, line in enumerate(lines) if text in line)
    return f"{os.path.basename(inspect.getsourcefile(fn))}:{first + at}"


@pytest.mark.parametrize(
    "how", ["mask_mod", "and_masks", "block_mask", "score_mod", "vmap"]
)  # fmt: skip
def test_a_mod_dynamo_cannot_trace_is_refused_in_one_line_under_fullgraph(how: str):
    """A user mod dynamo cannot trace fails a fullgraph compile with one line naming the mod,
    its line and why (not dynamo's report from inside qkv); without fullgraph it runs, equal
    to eager; qkv.plan says the same line beforehand."""
    q, k, v = make_qkv(SHAPE, gen=21)
    mod, line = _branches_on_a_value, _line_of(_branches_on_a_value, "if _FLAG")
    kw = {
        "mask_mod": {"mask": mod},
        "and_masks": {"mask": qkv.and_masks(qkv.sliding_window(6), mod)},
        "block_mask": {"mask": qkv.block_mask(mod, 2, 4, SHAPE.Lq, SHAPE.Lk, block_size=16)},
        "score_mod": {"score_mod": _reads_floats, "mask": qkv.causal},
        "vmap": {"score_mod": _reads_floats_per_element},
    }[how]
    if how == "score_mod":
        mod, line = _reads_floats, _line_of(_reads_floats, "tolist")
    if how == "vmap":
        mod = _reads_floats_per_element
        line = _line_of(mod, "tolist")
    kind = "score_mod" if how in ("score_mod", "vmap") else "mask_mod"
    f = torch.compile(qkv.attention, fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.UserError) as info:
        f(q, k, v, **kw)
    head, *rest = str(info.value).splitlines()
    assert head.startswith(f"{kind} {mod.__name__} cannot be traced by torch.compile, at {line}")
    assert "fullgraph=True" in head and "torch.where" in head
    assert not any("/qkv/" in r for r in rest)  # dynamo's stack shows the caller's, not qkv's
    assert head in qkv.plan(q, k, v, **kw).notes
    traceable = qkv.plan(q, k, v, mask=lambda b, h, qi, ki: torch.where(_FLAG, ki <= qi, True))
    assert not [n for n in traceable.notes if "cannot be traced" in n], traceable.notes
    if how == "mask_mod":
        torch._dynamo.reset()
        g = torch.compile(qkv.attention, backend="aot_eager")  # graph breaks allowed: it runs
        torch.testing.assert_close(g(q, k, v, **kw), qkv.attention(q, k, v, **kw))


def test_assume_constant_result_still_only_marks_the_function():
    """qkv marks functions as torch.compiler.assume_constant_result would, without importing
    dynamo at ``import qkv``; this fails if the decorator changes."""
    from qkv._core.tracing import assume_constant_result
    from qkv._flex import compat

    def f():
        return 0

    marked = torch.compiler.assume_constant_result(f)
    assert marked is f and vars(f) == {"_dynamo_marked_constant": True}

    def g():
        return 0

    assert assume_constant_result(g) is g and vars(g) == vars(f)
    assert compat._convention_outside._dynamo_marked_constant is True


@pytest.mark.parametrize("make_cache", [lambda: qkv.KVCache(48), lambda: qkv.SlidingWindowCache(8)])
def test_decoding_with_a_cache_compiles_fullgraph(make_cache):
    """A prefill and 32 single-token steps: the compiled module equals eager, and the steps
    share one graph (the growing cache length is dynamic after the first step)."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, n_kv_heads=2, rope=True).eval()
    x = torch.randn(1, 40, 32)

    def decode(module):
        cache = make_cache()
        outs = [module(x[:, :8], cache=cache, mask=qkv.causal)]
        outs += [module(x[:, i : i + 1], cache=cache, mask=qkv.causal) for i in range(8, 40)]
        return torch.cat(outs, 1)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        want = decode(mha)
        got = decode(torch.compile(mha, fullgraph=True, backend=counter))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2, f"{counter.frame_count} graphs for a prefill and 32 steps"


@pytest.mark.slow
def test_inductor_compiles_a_window_forward_and_backward():
    q, k, v = make_qkv(SHAPE, gen=5)
    kw = {"mask": qkv.sliding_window(5)}
    want = _fwd_bwd(qkv.attention, q, k, v, kw)
    got = _fwd_bwd(torch.compile(qkv.attention, fullgraph=True), q, k, v, kw)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_new_sequence_length_recompiles_at_most_once():
    counter = torch._dynamo.testing.CompileCounter()
    f = torch.compile(qkv.attention, fullgraph=True, backend=counter)
    for L in (40, 48, 56, 72):
        q, k, v = make_qkv(SHAPE.replace(Lq=L, Lk=L), gen=L)
        out = f(q, k, v, mask=qkv.sliding_window(5))
        torch.testing.assert_close(out, qkv.attention(q, k, v, mask=qkv.sliding_window(5)))
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles for 4 lengths"


def test_a_padding_mask_made_inside_the_compiled_function_traces():
    """qkv.padding(lengths) built inside the compiled function: one graph, equal to eager; its
    check of the lengths runs when the graph runs (a negative length still fails)."""

    def f(q, k, v, lengths):
        return qkv.attention(q, k, v, mask=qkv.padding(lengths))

    q, k, v = make_qkv(SHAPE.replace(B=2), gen=5)
    lengths = torch.tensor([SHAPE.Lk // 3, SHAPE.Lk])
    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(g(q, k, v, lengths), f(q, k, v, lengths), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="padding lengths must be >= 0"):
        g(q, k, v, torch.tensor([-1, SHAPE.Lk]))


def test_mods_decided_eagerly_and_then_collected_do_not_touch_a_compiled_graph():
    """Eager calls remember each user mod's calling convention in a weak dictionary; a trace
    must not guard on it, or collecting another mod recompiles (or, mid-trace, fails)."""
    import gc

    q, k, v = make_qkv(SHAPE, gen=9)

    def make(c):
        return lambda s, b, h, qi, ki: s + c * (qi - ki)

    mods = [make(0.01 * i) for i in range(6)]
    for m in mods:
        qkv.attention(q, k, v, score_mod=m)  # decided eagerly, remembered
    keep = mods[-1]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = torch.compile(qkv.attention, backend=counter, fullgraph=True)
    want = f(q, k, v, score_mod=keep)
    del mods[:-1]
    gc.collect()
    torch.testing.assert_close(f(q, k, v, score_mod=keep), want)
    assert counter.frame_count == 1, counter.frame_count


def test_a_window_compiled_first_traces_the_band_kernel_once(monkeypatch):
    """A window compiled before any eager call: the band kernel cannot be loaded inside the
    trace, so it is loaded by a function dynamo runs eagerly; the graph calls the kernel's
    operator from the first trace on, and later calls (the kernel loaded by then) do not
    recompile."""
    from qkv.backends.blocksparse import native

    state = {k: v for k, v in native.LIBRARY._state.items() if k != "ops"}
    monkeypatch.setattr(native.LIBRARY, "_state", state)  # as in a new process
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(qkv.attention, fullgraph=True, backend=counter)
    mask = qkv.sliding_window(30)
    for gen in (23, 24):
        q, k, v = make_qkv(BIG, gen=gen)
        torch.testing.assert_close(fn(q, k, v, mask=mask), qkv.attention(q, k, v, mask=mask))
    ops = _graph_ops(counter)
    assert counter.frame_count == 1 and "qkv.band" in ops, sorted(ops)


@pytest.mark.parametrize(("name", "plans"), [("prefix_lm", 2), ("window", 0)])
def test_the_operators_plan_a_mask_without_tensors_once_per_shape(monkeypatch, name, plans):
    """Inside the compiled graph, the engine's operators keep the job of a mask without
    tensors (a prefix-LM) per shape: new q, k, v plan nothing again (one job for the forward
    operator, one for the backward's), and the results stay equal to eager's. A window on
    the band kernel plans nothing at all when the graph runs: the graph calls the kernel's
    own operators. (A trace's look at the route is not counted.)"""
    from qkv.backends.blocksparse import compiled, operators

    planned = []
    real = compiled.make_job

    def counted(*a, **kw):
        if not kw.get("dry_run"):
            planned.append(1)
        return real(*a, **kw)

    for module in (compiled, operators):
        monkeypatch.setattr(module, "make_job", counted)
    monkeypatch.setattr(operators, "_JOBS", LRU(64))
    mask = {"prefix_lm": qkv.prefix_lm(40), "window": qkv.sliding_window(40)}[name]
    fn = torch.compile(qkv.attention, fullgraph=True, backend="aot_eager")
    for gen in (20, 21, 22):
        q, k, v = (t.requires_grad_() for t in make_qkv(BIG, gen=gen))
        out = fn(q, k, v, mask=mask)
        got = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(qkv.attention(q, k, v, mask=mask).sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(planned) == plans


def test_a_window_with_huge_logits_compiles_to_the_engine_backward():
    """The band kernel's backward recomputes the scores in another order than its forward,
    which loses digits at logits past ~128; eager redoes such rows with explicit matmuls, and
    so does the compiled graph (a torch.cond on the lse to the engine's backward operator):
    gradients equal eager's exactly, with ordinary and with huge logits."""
    mask = qkv.sliding_window(30)
    for mult in (1.0, 300.0):
        q, k, v = make_qkv(BIG, gen=25)
        q = q * mult

        def run(fn, q=q, k=k, v=v):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, mask=mask)
            weights = torch.linspace(-1, 1, out.shape[-1])
            return [out, *torch.autograd.grad((out * weights).sum(), leaves)]

        want = run(qkv.attention)
        torch._dynamo.reset()
        got = run(torch.compile(qkv.attention, fullgraph=True, backend="aot_eager"))
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(got[1:], want[1:], strict=True):
            assert torch.equal(a, b), (mult, float((a - b).abs().max()))


def test_a_padding_mask_under_the_default_compile_breaks_no_graph():
    """Evaluating a padding mask while dynamo traces names it only in an error (its name
    reads its lengths: three graph breaks under the default compile when it was made
    eagerly for every block)."""
    q, k, v = make_qkv(Shape(1, 4, 2, 200, 200, 32), gen=23)
    mask = qkv.padding(torch.tensor([195]))
    explained = torch._dynamo.explain(qkv.attention)(q, k, v, mask=mask)
    assert explained.graph_break_count == 0, [b.reason[:200] for b in explained.break_reasons]


@pytest.mark.parametrize("mask", ["window", "document"])
def test_a_mask_over_growing_lengths_compiles_at_most_twice(mask: str):
    """Four lengths that cross the dense limit (8 heads: 160² x 8 is under 2^20 scores, 376²
    x 8 over): the first compile is static, the second dynamic, and that one graph serves
    the rest. Asking the size (small enough for the plain formula?) or splitting the band
    kernel's work by it specialised the graph: 3 compiles before."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = torch.compile(qkv.attention, backend=counter, fullgraph=True)
    for L in (160, 232, 304, 376):
        m = qkv.sliding_window(16) if mask == "window" else qkv.document(torch.arange(L) // 50)
        q, k, v = make_qkv(Shape(1, 8, 8, L, L, 32), gen=L, requires_grad=True)
        out = f(q, k, v, mask=m)
        got = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(qkv.attention(q, k, v, mask=m).sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2, f"{counter.frame_count} graphs for 4 lengths"
