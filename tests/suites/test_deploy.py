"""Deployment: torch.compile, torch.export and ONNX for the modules people put in production, and
loading their weights safely.

MultiHeadAttention, RelativeMultiHeadAttention and TransformerEncoderLayer are each traced with a
padding mask and compared with eager, at the traced length and at others. Tracing is the slow part,
so each module is exported once (module-scoped fixtures) and its ONNX model is converted from that
same exported program.

While tracing, the chunked backend's call becomes one node of attnkit's operator
(``torch.ops.attnkit.attention``), which plans and runs the kernel when the program runs;
``torch.onnx.export`` of that same program writes the operator as its dense form (the reference
formula) with no argument of attnkit's, so the ONNX comparisons are also ones between two
different code paths.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit import masks
from attnkit.testing import assert_close
from attnkit.weights import load, save

from ..helpers import needs_cxx

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


@pytest.fixture
def fresh_compiler() -> Iterator[None]:
    """Empty dynamo caches. WithMask.forward is one code object for every module, grad mode and
    autocast state here (and the suite compiles other modules too): in one process they would
    pass dynamo's recompile limit of 8, a hard error with fullgraph=True."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@needs_cxx
@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("name", NAMES)
def test_compile_fullgraph_matches_eager(name: str) -> None:
    m = build(name)
    # fullgraph=True turns any graph break into an error; dynamic=True: one graph for all lengths.
    compiled = torch.compile(m, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for length in (TRACED_LENGTH, *OTHER_LENGTHS):
            x, pad = inputs(length)
            assert_close(compiled(x, pad), m(x, pad), dtype=torch.float32)


@needs_cxx
@pytest.mark.usefixtures("fresh_compiler")
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


@needs_cxx
@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("name", NAMES)
def test_compiled_under_autocast_matches_eager(name: str) -> None:
    # bfloat16 inference of float32 weights, compiled: the autocast casts trace too.
    m = build(name)
    compiled = torch.compile(m, fullgraph=True)
    x, pad = inputs(TRACED_LENGTH)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x, pad), m(x, pad)
    assert got.dtype == want.dtype
    assert_close(got, want.double(), dtype=torch.bfloat16)


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
    # The program holds attnkit's operator; the exporter writes its dense form unasked.
    onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    assert onnx_program is not None
    path = tmp_path_factory.mktemp("onnx") / f"{name}.onnx"
    onnx_program.save(str(path))
    return path


# torch's ONNX exporter (2.13) trips over its own deprecation of LeafSpec; nothing of attnkit's.
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
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


def test_relative_attention_traces_into_attnkits_operator() -> None:
    # Forced onto the chunked backend, the traced call is attnkit's operator, position term and
    # all, and the exported program equals eager.
    m = attnkit.RelativeMultiHeadAttention(D_MODEL, 4).eval()
    x, pad = inputs(TRACED_LENGTH)

    class Forced(nn.Module):
        def forward(self, x: Tensor, pad: Tensor) -> Tensor:
            out: Tensor = m(x, mask=pad, backend="chunked")
            return out

    program = torch.export.export(Forced(), (x, pad))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "attnkit.attention.default" in targets
    with torch.no_grad():
        assert_close(program.module()(x, pad), Forced()(x, pad), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Checkpoints: nothing is unpickled, and a mismatch names the parameter and both shapes

ROOT = Path(__file__).resolve().parents[2]


def loads_of(path: Path) -> list[str]:
    """Every call in ``path`` that could unpickle: ``torch.load`` without ``weights_only=True``,
    and any ``pickle``/``dill``/``joblib`` loader."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        owner_name = owner.id if isinstance(owner, ast.Name) else None
        where = f"{path.name}:{node.lineno}"
        if owner_name == "torch" and node.func.attr == "load":
            safe = any(
                kw.arg == "weights_only"
                and isinstance(kw.value, ast.Constant)
                and kw.value.value is True
                for kw in node.keywords
            )
            if not safe:
                found.append(f"{where} torch.load without weights_only=True")
        if owner_name in ("pickle", "dill", "joblib", "cloudpickle") and "load" in node.func.attr:
            found.append(f"{where} {owner_name}.{node.func.attr}")
    return found


def test_no_code_path_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    files = sorted((ROOT / "src" / "attnkit").rglob("*.py")) + sorted(
        (ROOT / "benchmarks").glob("*.py")
    )
    assert len(files) > 20
    assert [hit for f in files for hit in loads_of(f)] == []
    # The scan itself can fail: it sees an unsafe load when there is one.
    bad = tmp_path / "unsafe.py"
    bad.write_text("import pickle, torch\ntorch.load('m.pt')\npickle.loads(b'')\n")
    assert loads_of(bad) == [
        "unsafe.py:2 torch.load without weights_only=True",
        "unsafe.py:3 pickle.loads",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_and_mismatch_report(name: str, tmp_path: Path) -> None:
    m = build(name).module
    save(m, tmp_path / "m.safetensors")
    fresh = BUILDERS[name]().module  # other initial weights
    load(tmp_path / "m.safetensors", fresh)
    x, pad = inputs(TRACED_LENGTH)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x, mask=pad), m(x, mask=pad))

    wide = type(m)(d_model=2 * D_MODEL, num_heads=4)  # the same names, other shapes
    save(wide, tmp_path / "wide.safetensors")
    with pytest.raises(ValueError, match="does not fit") as err:
        load(tmp_path / "wide.safetensors", m)
    key, want = next(iter(m.state_dict().items()))
    got = wide.state_dict()[key]
    source = tmp_path / "wide.safetensors"
    assert f"{key}: shape {tuple(got.shape)} in {source}, {tuple(want.shape)}" in str(err.value)


def test_torch_load_state_dict_reports_both_shapes_for_every_module() -> None:
    # No attnkit module loads its state in its own way: torch's strict loading names the
    # parameter and both shapes.
    for m in (build(name).module for name in NAMES):
        state = m.state_dict()
        key = next(iter(state))
        state[key] = torch.zeros(*state[key].shape[:-1], state[key].shape[-1] + 1)
        with pytest.raises(RuntimeError) as err:
            m.load_state_dict(state)
        message = str(err.value)
        assert f"size mismatch for {key}" in message
        assert f"torch.Size({list(state[key].shape)})" in message
        assert f"torch.Size({list(m.state_dict()[key].shape)})" in message


def test_importers_refuse_tensors_of_the_wrong_shape() -> None:
    theirs = nn.MultiheadAttention(D_MODEL, 4, batch_first=True)
    theirs.in_proj_weight = nn.Parameter(torch.randn(1, D_MODEL))  # would broadcast into each row
    with pytest.raises(
        ValueError, match=re.escape("in_proj_weight has shape (1, 16), expected (48, 16)")
    ):
        attnkit.interop.torch.from_torch(theirs)

    class Openspeech(nn.Module):  # the attributes openspeech.relative_attention reads
        def __init__(self) -> None:
            super().__init__()
            for part in ("query_proj", "key_proj", "value_proj", "out_proj"):
                setattr(self, part, nn.Linear(D_MODEL, D_MODEL))
            self.pos_proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
            self.u_bias = nn.Parameter(torch.zeros(4, D_MODEL // 4))
            self.v_bias = nn.Parameter(torch.zeros(4, D_MODEL // 4))
            self.num_heads = 4

    os_module = Openspeech()
    attnkit.interop.openspeech.relative_attention(os_module)  # fits as it is
    os_module.key_proj.bias = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=re.escape("key_proj.bias is (1), expected (16)")):
        attnkit.interop.openspeech.relative_attention(os_module)
