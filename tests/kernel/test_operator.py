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
