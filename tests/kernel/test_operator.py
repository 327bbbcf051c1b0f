"""attnkit's kernel as one operator in compiled and exported graphs: no graph break, the operator
in the graph (no dense mask), results and gradients equal to eager, one graph across lengths,
the dispatch record kept, and torch's own checker (opcheck) satisfied."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks, scores
from attnkit.testing import assert_close


@pytest.fixture(autouse=True)
def fresh_compiler() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Graphs:
    """A torch.compile backend that keeps every graph it is given and runs it as it is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example: object) -> Callable[..., object]:
        self.graphs.append(gm)
        return gm.forward

    def targets(self) -> list[str]:
        return [
            str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"
        ]


def _qkv(
    t: int = 40, h: int = 4, hkv: int = 2, d: int = 8, dtype: torch.dtype = torch.float32
) -> list[Tensor]:
    g = torch.Generator().manual_seed(t)
    return [
        torch.randn(2, n, t, d, generator=g, dtype=dtype).requires_grad_() for n in (h, hkv, hkv)
    ]


CALLS: dict[str, Callable[[], dict[str, object]]] = {
    "causal": lambda: {"mask": masks.causal()},
    "window": lambda: {"mask": masks.sliding_window(7, 2)},
    "padding lengths": lambda: {"mask": masks.key_padding(torch.tensor([40, 23]))},
    "padding valid": lambda: {
        "mask": masks.key_padding(valid=torch.arange(40) < torch.tensor([[40], [9]]))
    },
    "documents": lambda: {"mask": masks.documents([[13, 27], [40]])},
    "causal & padding": lambda: {"mask": masks.causal() & masks.key_padding([31, 40])},
    "window | documents": lambda: {"mask": masks.sliding_window(3) | masks.documents([10, 30])},
    "dense bool": lambda: {
        "mask": torch.rand(40, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    },
    "bias": lambda: {"bias": torch.randn(4, 40, 40, generator=torch.Generator().manual_seed(2))},
    "softcap & sinks": lambda: {"softcap": 5.0, "sinks": torch.zeros(4).requires_grad_()},
    "distance bias": lambda: {
        "bias": scores.DistanceBias(torch.randn(4, 79).requires_grad_(), first=-39),
        "mask": masks.causal(),
    },
    "position term": lambda: {
        "bias": scores.RelativePositionTerm(
            torch.randn(2, 4, 40, 8).requires_grad_(), torch.randn(4, 79, 8).requires_grad_(), 0.3
        ),
        "mask": masks.sliding_window(9),
    },
    "lse": lambda: {"mask": masks.causal(), "return_lse": True},
}


def _leaves(kw: dict[str, object]) -> list[Tensor]:
    found: list[Tensor] = []
    for x in kw.values():
        if isinstance(x, Tensor) and x.requires_grad:
            found.append(x)
        if isinstance(x, scores.ScoreTerm):
            found += [t for t in x.inputs() if t.requires_grad]
    return found


@pytest.mark.parametrize("name", list(CALLS))
def test_compiled_calls_run_the_operator_and_equal_eager(name: str) -> None:
    kw = CALLS[name]()
    q, k, v = _qkv()

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = attnkit.attention(q, k, v, backend="chunked", **kw)  # type: ignore[arg-type]
        return out[0] * 1 + out[1].unsqueeze(-1) if isinstance(out, tuple) else out

    graphs = Graphs()
    compiled = torch.compile(f, backend=graphs, fullgraph=True)
    got = compiled(q, k, v)
    want = f(q, k, v)
    assert_close(got, want, dtype=torch.float32)
    assert "attnkit.attention" in graphs.targets()
    leaves = [q, k, v, *_leaves(kw)]
    cot = torch.randn_like(want)
    for a, b in zip(
        torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, leaves, cot), strict=True
    ):
        assert_close(a, b, dtype=torch.float32)


def test_a_structured_mask_never_becomes_a_dense_one_in_the_graph() -> None:
    q, k, v = _qkv(t=64)
    graphs = Graphs()

    @torch.compile(backend=graphs, fullgraph=True)
    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnkit.attention(q, k, v, mask=masks.causal() & masks.key_padding([64, 50]))

    f(q, k, v)
    shapes = [
        tuple(n.meta["example_value"].shape)
        for g in graphs.graphs
        for n in g.graph.nodes
        if isinstance(n.meta.get("example_value"), Tensor)
    ]
    assert not [s for s in shapes if s.count(64) >= 2], shapes  # no (Tq, Tk) tensor anywhere
    assert "attnkit.attention" in graphs.targets()


def test_one_graph_serves_every_length() -> None:
    graphs = Graphs()

    @torch.compile(backend=graphs, dynamic=True, fullgraph=True)
    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnkit.attention(q, k, v, mask=masks.sliding_window(5))

    for t in (20, 33, 47):
        q, k, v = _qkv(t=t)
        assert_close(f(q, k, v), attnkit.attention(q, k, v, mask=masks.sliding_window(5)))
    assert len(graphs.graphs) == 1


def test_the_dispatch_record_sees_compiled_calls_and_agrees_with_explain() -> None:
    q, k, v = _qkv()
    mask = masks.sliding_window(6)
    compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, mask=mask), fullgraph=True)
    compiled(q, k, v)
    with attnkit.record_dispatch() as calls:
        compiled(q, k, v)
        attnkit.attention(q, k, v, mask=mask)
    assert [(c.chosen, c.served_by) for c in calls] == [("chunked", "chunked")] * 2
    kernels = {c.kernel for c in calls}
    assert len(kernels) == 1
    (kernel,) = kernels
    assert kernel is not None
    assert kernel.split(" (")[0] in str(attnkit.explain(q, k, v, mask=mask))


def test_compiled_dropout_drops_the_same_pairs_in_both_passes() -> None:
    # With inductor's random numbers drawn as eager's (fallback_random), the seed the graph draws
    # is eager's: the compiled call and its gradients equal eager's bit for bit.
    q, k, v = _qkv(dtype=torch.float64)
    f = lambda q, k, v: attnkit.attention(q, k, v, mask=masks.causal(), dropout_p=0.3)  # noqa: E731
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(f, fullgraph=True)
        torch.manual_seed(5)
        got = compiled(q, k, v)
        grads = torch.autograd.grad(got.sum(), (q, k, v))
    torch.manual_seed(5)
    want = f(q, k, v)
    wants = torch.autograd.grad(want.sum(), (q, k, v))
    assert torch.equal(got, want)
    for a, b in zip(grads, wants, strict=True):
        assert torch.equal(a, b)


def test_compiled_multihead_attention_trains_like_eager() -> None:
    torch.manual_seed(0)
    m = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2)
    x = torch.randn(2, 50, 32)
    mask = masks.causal() & masks.key_padding([50, 31])
    graphs = Graphs()
    compiled = torch.compile(m, backend=graphs, fullgraph=True)
    got = compiled(x, mask=mask)
    want = m(x, mask=mask)
    assert_close(got, want, dtype=torch.float32)
    assert "attnkit.attention" in graphs.targets()
    g1 = torch.autograd.grad(got.sum(), list(m.parameters()))
    g2 = torch.autograd.grad(want.sum(), list(m.parameters()))
    for a, b in zip(g1, g2, strict=True):
        assert_close(a, b, dtype=torch.float32)


def test_exported_multihead_attention_holds_the_operator_and_takes_a_mask() -> None:
    torch.manual_seed(0)
    m = attnkit.MultiHeadAttention(32, 4).eval()

    class Padded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: Tensor, mask: masks.Mask) -> Tensor:
            out: Tensor = self.m(x, mask=mask)
            return out

    x = torch.randn(2, 24, 32)
    mask = masks.causal() & masks.key_padding(torch.tensor([24, 17]))
    t = torch.export.Dim("T", min=2, max=512)
    program = torch.export.export(Padded(), (x, mask), dynamic_shapes={"x": {1: t}, "mask": [None]})
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "attnkit.attention.default" in targets
    run = program.module()
    for length, lengths in ((24, [24, 17]), (40, [11, 40])):
        x = torch.randn(2, length, 32)
        mask = masks.causal() & masks.key_padding(torch.tensor(lengths))
        with torch.no_grad():
            assert_close(run(x, mask), m(x, mask=mask), dtype=torch.float32)


def test_untraceable_masks_and_score_mods_go_elsewhere_visibly() -> None:
    q, k, v = _qkv()
    mask = masks.from_fn(lambda b, h, i, j: (i - j) % 4 != 1)

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnkit.attention(q, k, v, mask=mask)

    assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))
    # (torch.compile reports the backend's error as its own, with the message)
    with pytest.raises(Exception, match="cannot be traced into attnkit's operator"):
        torch.compile(
            lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend="chunked"),
            fullgraph=True,
        )(q, k, v)


def test_opcheck_attention_operator() -> None:
    from attnkit._kernel.operator import attention_op

    q, k, v = _qkv(t=12)
    lengths = torch.tensor([12, 5])
    kwargs = dict(
        numbers=[],
        mask='["and",["causal","bottom_right"],["key_padding",0,null,"right"]]',
        term="null",
        scale=0.3,
        softcap=None,
        dropout_p=0.0,
        block_q=-1,
        block_k=-1,
        fused_rows=768,
        native=True,
        register_tiles=True,
        skewed_position=True,
    )
    sinks = torch.randn(4, requires_grad=True)
    args = (q, k, v, None, sinks, [lengths], [], None)
    torch.library.opcheck(attention_op, args, kwargs)


# --------------------------------------------------------------------------------------------------
# Values of another size than the queries and keys (Dv != Dk): the fake kernels must give the
# output v's size, or every graph traced after the operator holds the wrong shapes.

DK, DV = 8, 5

VALUE_SIZE_CALLS: dict[str, Callable[[], dict[str, object]]] = {
    "causal": lambda: {"mask": masks.causal()},
    "window & padding": lambda: {
        "mask": masks.sliding_window(6, 2) & masks.key_padding(torch.tensor([30, 17]))
    },
    "softcap & sinks, lse": lambda: {
        "softcap": 4.0,
        "sinks": torch.linspace(-1, 1, 4).requires_grad_(),
        "return_lse": True,
    },
}


def _qkv_dv(t: int = 30, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """q, k ``(2, 4|2, t, DK)`` and v ``(2, 2, t, DV)``, leaves needing gradients."""
    g = torch.Generator().manual_seed(t + 1)
    shapes = [(2, 4, t, DK), (2, 2, t, DK), (2, 2, t, DV)]
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


class AotGraphs(Graphs):
    """Graphs that keeps what dynamo traced and runs it through AOTAutograd (``aot_eager``),
    which traces the forward and the backward from the fake kernels' outputs."""

    def __call__(self, gm: torch.fx.GraphModule, example: object) -> Callable[..., object]:
        self.graphs.append(gm)
        compiled: Callable[..., object] = torch._dynamo.lookup_backend("aot_eager")(gm, example)
        return compiled


def _projected(q: Tensor, k: Tensor, v: Tensor, w: Tensor, backend: str, **kw: object) -> Tensor:
    """attention(q, k, v) times w ``(DV, 3)``: an op after the operator that reads its last size
    (a fake output of q's size would not multiply)."""
    out = attnkit.attention(q, k, v, backend=backend, **kw)  # type: ignore[arg-type]
    if isinstance(out, tuple):
        return out[0] @ w + out[1].unsqueeze(-1)
    return out @ w


@pytest.mark.parametrize("name", list(VALUE_SIZE_CALLS))
def test_compiled_calls_with_values_of_another_size_equal_the_reference(name: str) -> None:
    kw = VALUE_SIZE_CALLS[name]()
    q, k, v = _qkv_dv()
    w = torch.randn(DV, 3, generator=torch.Generator().manual_seed(3)).requires_grad_()
    leaves = [q, k, v, w, *_leaves(kw)]
    graphs = AotGraphs()
    traced = torch.compile(
        lambda *xs: _projected(*xs, backend="chunked", **kw), backend=graphs, fullgraph=True
    )
    got = traced(q, k, v, w)
    assert "attnkit.attention" in graphs.targets()
    wide = {n: x.double() if isinstance(x, Tensor) else x for n, x in kw.items()}
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, w)]
    ref_leaves += [t for t in wide.values() if isinstance(t, Tensor)]
    want = _projected(*ref_leaves[:4], backend="reference", **wide)
    assert_close(got, want, dtype=torch.float32)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = torch.autograd.grad(got, leaves, cot.float())
    wants = torch.autograd.grad(want, ref_leaves, cot)
    for a, b in zip(grads, wants, strict=True):
        assert a.shape == b.shape
        assert_close(a, b, dtype=torch.float32)


def test_exported_call_with_values_of_another_size_equals_the_reference() -> None:
    w = torch.randn(DV, 3, generator=torch.Generator().manual_seed(5))

    class Call(torch.nn.Module):
        def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: masks.Mask) -> Tensor:
            return _projected(q, k, v, w, backend="chunked", mask=mask)

    q, k, v = (x.detach() for x in _qkv_dv())
    mask = masks.causal() & masks.key_padding(torch.tensor([30, 21]))
    t = torch.export.Dim("T", min=2, max=256)
    dims = {"q": {2: t}, "k": {2: t}, "v": {2: t}, "mask": [None]}
    program = torch.export.export(Call(), (q, k, v, mask), dynamic_shapes=dims)
    (node,) = [n for n in program.graph.nodes if str(n.target) == "attnkit.attention.default"]
    assert node.meta["val"][0].shape[-1] == DV
    run = program.module()
    for length, lengths in ((30, [30, 21]), (45, [12, 45])):
        q, k, v = (x.detach() for x in _qkv_dv(t=length))
        mask = masks.causal() & masks.key_padding(torch.tensor(lengths))
        want = _projected(q.double(), k.double(), v.double(), w.double(), "reference", mask=mask)
        with torch.no_grad():
            assert_close(run(q, k, v, mask), want, dtype=torch.float32)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_opcheck_attention_operator_with_values_of_another_size(dropout_p: float) -> None:
    from attnkit._kernel.operator import attention_op

    q, k, v = _qkv_dv(t=12)
    kwargs = dict(
        numbers=[],
        mask='["and",["causal","bottom_right"],["key_padding",0,null,"right"]]',
        term="null",
        scale=0.3,
        softcap=3.0,
        dropout_p=dropout_p,
        block_q=-1,
        block_k=-1,
        fused_rows=768,
        native=True,
        register_tiles=True,
        skewed_position=True,
    )
    seed = torch.tensor(77) if dropout_p else None
    args = (q, k, v, None, None, [torch.tensor([12, 5])], [], seed)
    torch.library.opcheck(attention_op, args, kwargs)


# --------------------------------------------------------------------------------------------------
# Index masks in a graph: the operator runs the gathered kernel (O(Tq * k)) where an eager call
# would, forward and backward, by the same rules.

TI, KI = 64, 8  # keys, and the keys each query selects (an eighth: gathered, not scanned)


def _selection(hi: int, tq: int = TI, seed: int = 30) -> Tensor:
    """``(2, hi, tq, KI)`` key positions, with -1 entries and a repeat in every row."""
    idx = torch.randint(-1, TI, (2, hi, tq, KI), generator=torch.Generator().manual_seed(seed))
    idx[..., 1] = idx[..., 0]
    return idx


GATHERED_CALLS: dict[str, Callable[[], dict[str, object]]] = {
    "key_indices & causal, grouped heads": lambda: {
        "mask": masks.key_indices(_selection(2)) & masks.causal()
    },
    "key_indices, softcap & sinks": lambda: {
        "mask": masks.key_indices(_selection(1)),
        "softcap": 4.0,
        "sinks": torch.linspace(-1, 1, 4).requires_grad_(),
    },
    "block_indices & padding, lse": lambda: {
        "mask": masks.block_indices(_selection(1)[..., :2] // 4, block=4)
        & masks.key_padding(torch.tensor([64, 41])),
        "return_lse": True,
    },
    "key_indices, dense bias (sparse products)": lambda: {
        "mask": masks.key_indices(_selection(2)),
        "bias": torch.randn(
            4, TI, TI, generator=torch.Generator().manual_seed(31)
        ).requires_grad_(),
    },
    "key_indices, distance bias (sparse products)": lambda: {
        "mask": masks.key_indices(_selection(1)) & masks.causal(),
        "bias": scores.DistanceBias(torch.randn(4, 2 * TI - 1).requires_grad_(), first=1 - TI),
    },
}


@pytest.fixture
def gathered_runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each pass of the gathered kernel ran (native, or torch's sparse products)."""
    from attnkit._kernel import gathered

    runs = dict.fromkeys(["_native_forward", "_native_backward", "_forward", "_backward"], 0)

    def spy(name: str) -> Callable[..., object]:
        inner = getattr(gathered, name)

        def counted(*args: object, **kwargs: object) -> object:
            runs[name] += 1
            return inner(*args, **kwargs)

        return counted

    for name in runs:
        monkeypatch.setattr(gathered, name, spy(name))
    return runs


def _wide(kw: dict[str, object]) -> dict[str, object]:
    """The call's arguments in float64, each a leaf that needs gradients where it did."""
    out: dict[str, object] = {}
    for name, x in kw.items():
        if isinstance(x, Tensor) and x.is_floating_point():
            x = x.detach().double().requires_grad_(x.requires_grad)
        elif isinstance(x, scores.DistanceBias):
            x = scores.DistanceBias(x.table.detach().double().requires_grad_(), first=x.first)
        out[name] = x
    return out


def _joined(q: Tensor, k: Tensor, v: Tensor, backend: str, kw: dict[str, object]) -> Tensor:
    """The call's output, plus its log-sum-exp where it returns one."""
    out = attnkit.attention(q, k, v, backend=backend, **kw)  # type: ignore[arg-type]
    return out[0] + out[1].unsqueeze(-1) if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", list(GATHERED_CALLS))
def test_compiled_index_masks_run_the_gathered_kernel_and_equal_the_reference(
    name: str, gathered_runs: dict[str, int]
) -> None:
    kw = GATHERED_CALLS[name]()
    q, k, v = _qkv(t=TI)

    compiled = torch.compile(_joined, fullgraph=True)
    with attnkit.record_dispatch() as calls:
        got = compiled(q, k, v, "chunked", kw)
    assert [c.kernel.split(":")[0] for c in calls if c.kernel] == ["gathered"], calls
    wide = _wide(kw)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _joined(*ref_leaves, "reference", wide)
    assert_close(got, want, dtype=torch.float32)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
    grads = torch.autograd.grad(got, [q, k, v, *_leaves(kw)], cot.float())
    wants = torch.autograd.grad(want, [*ref_leaves, *_leaves(wide)], cot)
    for a, b in zip(grads, wants, strict=True):
        assert_close(a, b, dtype=torch.float32)
    sparse = "sparse" in name
    assert gathered_runs["_forward" if sparse else "_native_forward"] == 1, gathered_runs
    assert gathered_runs["_backward" if sparse else "_native_backward"] == 1, gathered_runs


REFUSED_CALLS: dict[str, Callable[[], dict[str, object]]] = {
    "gathered": lambda: {"mask": masks.key_indices(_selection(2)) & masks.causal()},
    "too many keys a query": lambda: {
        "mask": masks.key_indices(torch.arange(TI // 2).expand(2, 2, TI, -1))
    },
    "ORed with a band": lambda: {"mask": masks.key_indices(_selection(2)) | masks.causal()},
    "dropout": lambda: {"mask": masks.key_indices(_selection(2)), "dropout_p": 0.2},
    "NaN in a key": lambda: {"mask": masks.key_indices(_selection(2))},
}


@pytest.mark.parametrize("name", list(REFUSED_CALLS))
def test_compiled_index_masks_take_the_kernel_an_eager_call_takes(name: str) -> None:
    # The same rules inside the graph: the kernel recorded there is the eager call's, the
    # gathered one where it serves, the scanning one (and why) where it does not.
    q, k, v = (x.detach() for x in _qkv(t=TI))
    if name == "NaN in a key":
        k[0, 0, 3, 0] = torch.nan
    kw = REFUSED_CALLS[name]()

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnkit.attention(q, k, v, backend="chunked", **kw)  # type: ignore[arg-type]

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with attnkit.record_dispatch() as calls:
        compiled(q, k, v)
        f(q, k, v)
    assert len(calls) == 2
    assert calls[0].kernel is not None
    assert calls[0].kernel == calls[1].kernel
    assert calls[0].kernel.startswith("gathered") == (name == "gathered"), calls[0].kernel


@pytest.mark.parametrize("dynamic", [False, True])
def test_one_graph_serves_new_indices_on_the_gathered_kernel(
    dynamic: bool, gathered_runs: dict[str, int]
) -> None:
    # The indices are an input of the graph: new values (and, with dynamic shapes, new lengths)
    # run the same graph, each on the gathered kernel, forward and backward.
    graphs = AotGraphs()

    @torch.compile(backend=graphs, dynamic=dynamic, fullgraph=True)
    def f(q: Tensor, k: Tensor, v: Tensor, idx: Tensor) -> Tensor:
        return attnkit.attention(q, k, v, mask=masks.key_indices(idx) & masks.causal())

    lengths = (TI, TI + 24) if dynamic else (TI, TI)
    traced = []
    for seed, t in enumerate(lengths):
        q, k, v = _qkv(t=t)
        idx = torch.randint(-1, t, (2, 2, t, KI), generator=torch.Generator().manual_seed(seed))
        got = f(q, k, v, idx)
        ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
        want = attnkit.attention(
            *ref, mask=masks.key_indices(idx) & masks.causal(), backend="reference"
        )
        assert_close(got, want, dtype=torch.float32)
        for a, b in zip(
            torch.autograd.grad(got.sum(), (q, k, v)),
            torch.autograd.grad(want.sum(), ref),
            strict=True,
        ):
            assert_close(a, b, dtype=torch.float32)
        traced.append(len(graphs.graphs))
    assert traced[0] == traced[1]
    assert graphs.targets().count("attnkit.attention") == 1
    assert gathered_runs["_native_forward"] == gathered_runs["_native_backward"] == 2


def test_exported_key_indices_run_the_gathered_kernel(gathered_runs: dict[str, int]) -> None:
    class Sparse(torch.nn.Module):
        def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: masks.Mask) -> Tensor:
            return attnkit.attention(q, k, v, mask=mask)

    q, k, v = (x.detach() for x in _qkv(t=TI))
    mask = masks.key_indices(_selection(2)) & masks.causal()
    t = torch.export.Dim("T", min=16, max=512)
    dims = {"q": {2: t}, "k": {2: t}, "v": {2: t}, "mask": [{2: t}]}
    program = torch.export.export(Sparse(), (q, k, v, mask), dynamic_shapes=dims)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "attnkit.attention.default" in targets
    run = program.module()
    for length in (TI, 100):
        q, k, v = (x.detach() for x in _qkv(t=length))
        idx = torch.randint(
            -1, length, (2, 2, length, KI), generator=torch.Generator().manual_seed(length)
        )
        mask = masks.key_indices(idx) & masks.causal()
        with attnkit.record_dispatch() as calls:
            got = run(q, k, v, mask)
        (call,) = calls
        assert call.kernel is not None
        assert call.kernel.startswith("gathered"), call.kernel
        want = attnkit.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
        assert_close(got, want, dtype=torch.float32)
    assert gathered_runs["_native_forward"] == 2


@pytest.mark.parametrize("sinks", [False, True])
def test_opcheck_attention_operator_on_the_gathered_kernel(
    sinks: bool, gathered_runs: dict[str, int]
) -> None:
    # q token-major, as a module's projection gives it: the gradients the gathered kernel gives
    # are laid out as the fake kernel says (as their inputs are).
    from attnkit._kernel.operator import attention_op

    g = torch.Generator().manual_seed(33)
    q = torch.randn(2, 40, 4, 8, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 2, 40, 8, generator=g).requires_grad_() for _ in range(2))
    idx = torch.randint(-1, 40, (2, 1, 40, 6), generator=g)
    kwargs = dict(
        numbers=[],
        mask='["and",["indices",0,1],["causal","bottom_right"]]',
        term="null",
        scale=0.3,
        softcap=3.0,
        dropout_p=0.0,
        block_q=-1,
        block_k=-1,
        fused_rows=768,
        native=True,
        register_tiles=True,
        skewed_position=True,
    )
    extra = torch.randn(4, generator=g).requires_grad_() if sinks else None
    args = (q, k, v, None, extra, [idx], [], None)
    torch.library.opcheck(attention_op, args, kwargs)
    out, _ = attention_op(*args, **kwargs)
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert dq.stride() == q.stride()  # as the fake kernel says
    assert gathered_runs["_native_forward"] > 0, gathered_runs
    assert gathered_runs["_native_backward"] > 0, gathered_runs


def test_compiled_bfloat16_index_masks_equal_the_reference(gathered_runs: dict[str, int]) -> None:
    q, k, v = _qkv(t=TI, dtype=torch.bfloat16)
    mask = masks.key_indices(_selection(2)) & masks.causal()
    compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, mask=mask), fullgraph=True)
    got = compiled(q, k, v)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = attnkit.attention(*ref, mask=mask, backend="reference")
    assert_close(got, want, dtype=torch.bfloat16)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(34), dtype=torch.float64)
    grads = torch.autograd.grad(got, (q, k, v), cot.bfloat16())
    for a, b in zip(grads, torch.autograd.grad(want, ref, cot), strict=True):
        assert_close(a, b, dtype=torch.bfloat16)
    assert gathered_runs["_native_forward"] == gathered_runs["_native_backward"] == 1


@pytest.mark.filterwarnings("ignore:mask lets no query")
def test_compiled_training_keeps_masked_nan_out_of_the_gradients() -> None:
    """A decode-sized compiled training call planned its backward without reading whether q, k
    and v are finite, so NaN in keys the mask hides reached dq and dk (eager gave none)."""
    graphs = Graphs()

    @torch.compile(backend=graphs, dynamic=True, fullgraph=True)
    def f(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
        return attnkit.attention(q, k, v, mask=masks.key_padding(lengths))

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 5, generator=g, dtype=torch.float64) for _ in range(2))
    k[1, :, 4:] = v[1, :, 4:] = float("nan")  # hidden: row 1 attends no key
    k.requires_grad_()
    v.requires_grad_()
    lengths = torch.tensor([4, 0])
    dense = torch.arange(6) < lengths[:, None, None, None]
    got = torch.autograd.grad(f(q, k, v, lengths).square().sum(), (q, k, v))
    want = torch.autograd.grad(
        attnkit.attention(q, k, v, mask=dense, backend="reference").square().sum(), (q, k, v)
    )
    assert "attnkit.attention" in graphs.targets()
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
