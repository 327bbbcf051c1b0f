"""Deployment: torch.compile, torch.export and ONNX for the modules people put in production.

MultiHeadAttention, RelativeMultiHeadAttention and TransformerEncoderLayer are each traced with a
padding mask and compared with eager, at the traced length and at others. Tracing is the slow part,
so each module is exported once (module-scoped fixtures) and its ONNX model is converted from that
same exported program.

While tracing, attention() takes sdpa instead of the chunked kernel and RelativeMultiHeadAttention
takes its materialised path (both fast paths loop over blocks in Python); eager takes the fast
paths, so every comparison below is also one between two different code paths.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit import masks
from attnkit.testing import assert_close

D_MODEL = 16
TRACED_LENGTH = 8
OTHER_LENGTHS = (5, 13)  # lengths the traced forms never saw


class WithMask(nn.Module):
    """``forward(x, pad)``: the module under test called with a padding mask (and its flags)."""

    def __init__(self, module: nn.Module, **flags: bool) -> None:
        super().__init__()
        self.module = module
        self.flags = flags

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        out: Tensor = self.module(x, mask=pad, **self.flags)
        return out


BUILDERS: dict[str, Callable[[], WithMask]] = {
    # Grouped-query, rotary and causal: eager takes the chunked kernel here, tracing takes sdpa.
    "multihead": lambda: WithMask(
        attnkit.MultiHeadAttention(
            D_MODEL, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(D_MODEL // 4)
        ),
        causal=True,
    ),
    "relative": lambda: WithMask(attnkit.RelativeMultiHeadAttention(D_MODEL, 4), causal=True),
    "encoder_layer": lambda: WithMask(attnkit.TransformerEncoderLayer(D_MODEL, 4, dropout=0.0)),
}
NAMES = list(BUILDERS)


def build(name: str) -> WithMask:
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


def inputs(length: int) -> tuple[Tensor, Tensor]:
    """``x`` (2, T, D) and a padding mask (2, 1, 1, T) whose second sequence is 3 tokens short."""
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, D_MODEL, generator=gen)
    return x, masks.padding_mask([length, length - 3])


# --------------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("name", NAMES)
def test_compile_fullgraph_matches_eager(name: str) -> None:
    m = build(name)
    # fullgraph=True turns any graph break into an error; dynamic=True: one graph for all lengths.
    compiled = torch.compile(m, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for length in (TRACED_LENGTH, *OTHER_LENGTHS):
            x, pad = inputs(length)
            assert_close(compiled(x, pad), m(x, pad), dtype=torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_training_step_matches_eager(name: str) -> None:
    m = build(name).train()  # no dropout in these modules: training is deterministic
    twin = copy.deepcopy(m)
    compiled = torch.compile(twin, fullgraph=True)
    x, pad = inputs(TRACED_LENGTH)
    m(x, pad).square().sum().backward()
    compiled(x, pad).square().sum().backward()
    for (key, p), q in zip(m.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None, key
        assert q.grad is not None, key
        assert_close(q.grad, p.grad)


# --------------------------------------------------------------------------------------------------
# torch.export and ONNX: one export per module, shared


@pytest.fixture(scope="module", params=NAMES)
def exported(request: pytest.FixtureRequest) -> tuple[str, WithMask, torch.export.ExportedProgram]:
    name: str = request.param
    m = build(name)
    # Exported before any eager call: an encoding table cached while tracing would be a fake
    # tensor that breaks the eager calls the tests make afterwards.
    length = torch.export.Dim("T", min=4, max=256)
    program = torch.export.export(
        m, inputs(TRACED_LENGTH), dynamic_shapes={"x": {1: length}, "pad": {3: length}}
    )
    return name, m, program


def test_export_matches_eager_at_every_length(
    exported: tuple[str, WithMask, torch.export.ExportedProgram],
) -> None:
    _, m, program = exported
    run = program.module()
    with torch.no_grad():
        for length in (TRACED_LENGTH, *OTHER_LENGTHS):
            x, pad = inputs(length)
            assert_close(run(x, pad), m(x, pad), dtype=torch.float32)


@pytest.fixture(scope="module")
def onnx_file(
    exported: tuple[str, WithMask, torch.export.ExportedProgram],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    pytest.importorskip("onnxscript", reason="ONNX export needs the test extra onnxscript")
    name, _, program = exported
    onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    assert onnx_program is not None
    path = tmp_path_factory.mktemp("onnx") / f"{name}.onnx"
    onnx_program.save(str(path))
    return path


def test_onnx_runs_in_onnxruntime_at_other_lengths(
    exported: tuple[str, WithMask, torch.export.ExportedProgram], onnx_file: Path
) -> None:
    ort = pytest.importorskip("onnxruntime", reason="the test extra onnxruntime runs the model")
    _, m, _ = exported
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert len(names) == 2, names
    for length in OTHER_LENGTHS:
        x, pad = inputs(length)
        (got,) = session.run(None, {names[0]: x.numpy(), names[1]: pad.numpy()})
        with torch.no_grad():
            want = m(x, pad)
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-4, rtol=0)


def test_relative_attention_refuses_fast_paths_while_tracing() -> None:
    # Forced onto a fast path, tracing fails with the reason instead of a tracer error.
    m = attnkit.RelativeMultiHeadAttention(D_MODEL, 4).eval()
    x, pad = inputs(TRACED_LENGTH)

    class Forced(nn.Module):
        def forward(self, x: Tensor, pad: Tensor) -> Tensor:
            out: Tensor = m(x, mask=pad, backend="chunked")
            return out

    with pytest.raises(attnkit.BackendError, match=re.escape("torch.compile/export is tracing")):
        torch.export.export(Forced(), (x, pad))
