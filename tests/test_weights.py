"""Weights: safetensors round trip, weights-only torch.load, and the mismatch report."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit.weights import load, load_state_dict, save


def test_safetensors_round_trip(tmp_path: Path) -> None:
    a, b = attnkit.MultiHeadAttention(16, 4), attnkit.MultiHeadAttention(16, 4)
    save(a, tmp_path / "m.safetensors")
    load(tmp_path / "m.safetensors", b)
    x = torch.randn(2, 5, 16)
    assert torch.equal(a(x), b(x))


def test_torch_file_is_read_weights_only(tmp_path: Path) -> None:
    a, b = attnkit.MultiHeadAttention(16, 4), attnkit.MultiHeadAttention(16, 4)
    torch.save(a.state_dict(), tmp_path / "m.pt")
    load(tmp_path / "m.pt", b)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


class _Payload:
    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (Path(_Payload.target),))

    target = ""


def test_pickled_code_is_refused(tmp_path: Path) -> None:
    _Payload.target = str(tmp_path / "pwned")
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"w": _Payload()}, f, protocol=2)
    with pytest.raises(
        ValueError, match=r"does not unpickle arbitrary objects: .* refused it: Unsupported global"
    ):
        load(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_damaged_files_are_a_value_error_naming_the_file(tmp_path: Path, suffix: str) -> None:
    m = attnkit.MultiHeadAttention(16, 4)
    good = tmp_path / f"good{suffix}"
    if suffix == ".pt":
        torch.save(m.state_dict(), good)
    else:
        save(m, good)
    data = good.read_bytes()
    for name, content in [
        ("truncated", data[: len(data) // 2]),
        ("cut-short", data[:-5]),
        ("empty", b""),
        ("garbage", b"not a checkpoint at all"),
    ]:
        path = tmp_path / f"{name}{suffix}"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} is not a readable") as err:
            load(path, attnkit.MultiHeadAttention(16, 4))
        assert err.value.__cause__ is None
    with pytest.raises(FileNotFoundError):  # a file that is not there is no ValueError
        load(tmp_path / f"missing{suffix}")


def test_mismatch_report_lists_every_problem() -> None:
    m = attnkit.MultiHeadAttention(16, 4)
    state = m.state_dict()
    state["out_proj.weight"] = torch.zeros(8, 16)
    del state["out_proj.bias"]
    state["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="does not fit") as err:
        load_state_dict(m, state, source="ckpt")
    assert str(err.value).splitlines() == [
        "ckpt does not fit MultiHeadAttention:",
        "  out_proj.weight: shape (8, 16) in ckpt, (16, 16) in the module",
        "  out_proj.bias: missing from ckpt (the module has shape (16,))",
        "  extra: in ckpt but not in the module",
    ]


def test_save_wants_safetensors_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("writes .safetensors files, got")):
        save(attnkit.MultiHeadAttention(16, 4), tmp_path / "m.pt")
