"""ONNX export (attnkit._onnx): ``torch.onnx.export(..., dynamo=True)`` with no argument of
attnkit's, the model run in onnxruntime and compared with eager attnkit in float32.

Calls forced onto the ``chunked`` backend are exported with ``torch.export`` first, checked to hold
attnkit's operator, and that program is handed to ``torch.onnx.export``: the exporter must write
the operator as its dense form. Calls on ``auto`` and the modules are handed to
``torch.onnx.export`` as they are, as a user would.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit import masks
from attnkit._onnx import exporting_to_onnx
from attnkit.testing import assert_close

# torch's ONNX exporter (2.13) trips over its own deprecation of LeafSpec; nothing of attnkit's.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")

OPERATOR = "attnkit.attention.default"
B, H, T, DK = 2, 4, 10, 8


@pytest.fixture(scope="module")
def ort() -> ModuleType:
    pytest.importorskip("onnxscript", reason="ONNX export needs the test extra onnxscript")
    return pytest.importorskip("onnxruntime", reason="the test extra onnxruntime runs the model")


class Call(nn.Module):
    """``forward(q, k, v[, extra])``: one ``attention()`` call, ``extra`` made into its arguments
    by ``make`` (a mask from padding lengths or document ids, a bias)."""

    def __init__(self, backend: str, make: Callable[..., dict[str, Any]], **settings: Any) -> None:
        super().__init__()
        self.backend, self.make, self.settings = backend, make, settings

    def forward(self, q: Tensor, k: Tensor, v: Tensor, extra: Tensor | None = None) -> Tensor:
        kwargs = {**self.settings, **(self.make() if extra is None else self.make(extra))}
        out: Tensor = attnkit.attention(q, k, v, backend=self.backend, **kwargs)
        return out


def _none() -> dict[str, Any]:
    return {}


def _padding(lengths: Tensor) -> dict[str, Any]:
    return {"mask": masks.causal() & masks.key_padding(lengths)}


def _documents(ids: Tensor) -> dict[str, Any]:
    return {"mask": masks.documents(ids=ids) & masks.causal()}


def _window_or_padding(lengths: Tensor) -> dict[str, Any]:
    return {"mask": masks.sliding_window(2) | masks.key_padding(lengths, side="left")}


def _bias(bias: Tensor) -> dict[str, Any]:
    return {"bias": bias}


def qkv(
    hkv: int = H, tq: int = T, tk: int = T, dv: int = DK, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, tq, DK, generator=gen)
    k = torch.randn(B, hkv, tk, DK, generator=gen)
    return q, k, torch.randn(B, hkv, tk, dv, generator=gen)


# name -> (the call's make, its settings, its inputs)
CASES: dict[str, Callable[[], tuple[Callable[..., dict[str, Any]], dict[str, Any], tuple]]] = {
    "plain": lambda: (_none, {}, qkv()),
    "causal": lambda: (_none, {"causal": True}, qkv()),
    "causal_and_padding": lambda: (_padding, {}, (*qkv(), torch.tensor([T, T - 4]))),
    "sliding_window": lambda: (_none, {"mask": masks.sliding_window(3)}, qkv()),
    "documents_and_causal": lambda: (
        _documents,
        {},
        (*qkv(), torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])),
    ),
    "window_or_left_padding": lambda: (_window_or_padding, {}, (*qkv(), torch.tensor([3, 5]))),
    "bias": lambda: (_bias, {}, (*qkv(), torch.randn(B, H, T, T))),
    "softcap": lambda: (_none, {"softcap": 2.0, "causal": True}, qkv()),
    "sinks": lambda: (_none, {"sinks": torch.randn(H)}, qkv()),
    "gqa": lambda: (_none, {"causal": True}, qkv(hkv=2)),
    "tq_neq_tk": lambda: (_none, {"causal": True}, qkv(tq=3)),
    "dv_neq_dk": lambda: (_none, {}, qkv(dv=5)),
}


def session(ort: ModuleType, program: Any, path: Path) -> Any:
    """An onnxruntime session of ``torch.onnx.export(program, ...)``'s model."""
    program.save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run(sess: Any, *inputs: Tensor) -> Tensor:
    names = [i.name for i in sess.get_inputs()]
    assert len(names) == len(inputs), names
    (out,) = sess.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)})
    return torch.from_numpy(out)


@pytest.mark.parametrize("name", list(CASES))
def test_the_operator_exports_as_its_dense_form(ort: ModuleType, name: str, tmp_path: Path) -> None:
    make, settings, inputs = CASES[name]()
    call = Call("chunked", make, **settings).eval()
    program = torch.export.export(call, inputs)
    assert OPERATOR in {str(n.target) for n in program.graph.nodes}
    sess = session(ort, torch.onnx.export(program, dynamo=True, verbose=False), tmp_path / "a.onnx")
    with torch.no_grad():
        assert_close(run(sess, *inputs), call(*inputs), dtype=torch.float32)


# auto: the operator where chunked serves the call, torch's SDPA where it does (their mix is
# what these cases check; the operator's own cases are above).
@pytest.mark.parametrize("name", ["plain", "causal_and_padding", "documents_and_causal", "sinks"])
def test_calls_on_auto_export(ort: ModuleType, name: str, tmp_path: Path) -> None:
    make, settings, inputs = CASES[name]()
    call = Call("auto", make, **settings).eval()
    onnx_program = torch.onnx.export(call, inputs, dynamo=True, verbose=False)
    sess = session(ort, onnx_program, tmp_path / "a.onnx")
    with torch.no_grad():
        assert_close(run(sess, *inputs), call(*inputs), dtype=torch.float32)


# q, k and v share the one dimension T: torch's exporter says it names it once.
@pytest.mark.filterwarnings("ignore:# The axis name")
def test_the_operator_exports_with_a_dynamic_length(ort: ModuleType, tmp_path: Path) -> None:
    # One model for every length: the mask is rebuilt from the lengths given, at the length run.
    call = Call("chunked", _padding, causal=False).eval()
    length = torch.export.Dim("T", min=4, max=128)
    seq = {2: length}
    onnx_program = torch.onnx.export(
        call,
        (*qkv(), torch.tensor([T, T - 4])),
        dynamic_shapes=(seq, seq, seq, None),
        dynamo=True,
        verbose=False,
    )
    sess = session(ort, onnx_program, tmp_path / "a.onnx")
    for n in (7, 23):
        inputs = (*qkv(tq=n, tk=n, seed=n), torch.tensor([n, n - 3]))
        with torch.no_grad():
            assert_close(run(sess, *inputs), call(*inputs), dtype=torch.float32)


D_MODEL = 32


class Padded(nn.Module):
    """``forward(x, lengths)``: the module with a key padding mask (and its flags)."""

    def __init__(self, module: nn.Module, **flags: bool) -> None:
        super().__init__()
        self.module, self.flags = module, flags

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        out: Tensor = self.module(x, mask=masks.key_padding(lengths), **self.flags)
        return out


MODULES: dict[str, Callable[[], nn.Module]] = {
    "multihead_gqa_padded_causal": lambda: Padded(
        attnkit.MultiHeadAttention(D_MODEL, 4, num_kv_heads=2), causal=True
    ),
    "relative": lambda: attnkit.RelativeMultiHeadAttention(D_MODEL, 4),
    "relative_padded": lambda: Padded(attnkit.RelativeMultiHeadAttention(D_MODEL, 4)),
    "conformer_padded": lambda: Padded(attnkit.ConformerLayer(D_MODEL, 4)),
    "encoder_layer_padded_causal": lambda: Padded(
        attnkit.TransformerEncoderLayer(D_MODEL, 4), causal=True
    ),
}


def module_inputs(name: str, length: int) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, D_MODEL, generator=gen)
    return (x, torch.tensor([length, length - 3])) if "padded" in name else (x,)


@pytest.mark.parametrize("name", list(MODULES))
def test_modules_export_with_a_dynamic_length(ort: ModuleType, name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = MODULES[name]().eval()
    length = torch.export.Dim("T", min=4, max=256)
    inputs = module_inputs(name, 10)
    shapes = ({1: length}, None)[: len(inputs)]
    onnx_program = torch.onnx.export(m, inputs, dynamic_shapes=shapes, dynamo=True, verbose=False)
    sess = session(ort, onnx_program, tmp_path / "m.onnx")
    for n in (10, 7, 23):
        inputs = module_inputs(name, n)
        with torch.no_grad():
            assert_close(run(sess, *inputs), m(*inputs), dtype=torch.float32)


@pytest.mark.filterwarnings("ignore:Exporting a model while it is in training mode")
def test_dropout_in_training_mode_says_to_export_in_eval_mode() -> None:
    pytest.importorskip("onnxscript", reason="ONNX export needs the test extra onnxscript")
    call = Call("chunked", _none, dropout_p=0.1)
    with pytest.raises(
        Exception, match=r"dropout_p=0.1 has no dense form: export the model in eval"
    ):
        torch.onnx.export(call, qkv(), dynamo=True, verbose=False)


def test_other_traces_keep_the_operator() -> None:
    # Outside ONNX export the rule records the operator as the tracing mode would: decomposing
    # an exported program keeps it, and the program still runs attnkit's kernel.
    assert not exporting_to_onnx()
    call = Call("chunked", _none, causal=True).eval()
    inputs = qkv()
    program = torch.export.export(call, inputs).run_decompositions()
    assert OPERATOR in {str(n.target) for n in program.graph.nodes}
    with torch.no_grad():
        assert_close(program.module()(*inputs), call(*inputs), dtype=torch.float32)


def test_import_attnkit_imports_no_onnx() -> None:
    child = (
        "import sys, attnkit; "
        "print(sorted(m for m in ('onnx', 'onnxscript', 'onnxruntime', 'torch.onnx') "
        "if m in sys.modules))"
    )
    got = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]"
