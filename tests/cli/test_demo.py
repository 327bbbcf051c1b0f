"""`attnkit demo`: files written and valid, determinism, --load, errors, interruption."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from safetensors.torch import load_file, save_file

from attnkit.cli import demo, main

TINY = ["--steps", "3", "--quiet"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "out"
    assert main(["demo", "--out", str(out), *TINY]) == 0
    return out


def test_writes_every_file(run_dir: Path) -> None:
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "attention.png",
        "config.json",
        "loss.png",
        "metrics.json",
        "model.safetensors",
    ]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 3
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert metrics["seconds"] > 0
    assert metrics["config"]["task"] == "reverse"
    for png in ("attention.png", "loss.png"):
        image = plt.imread(run_dir / png)
        assert image.ndim == 3
        assert image.shape[0] > 100
    state = load_file(str(run_dir / "model.safetensors"))
    assert "embed.weight" in state
    # Permissions of an ordinary new file (mkstemp's temporaries are 0600).
    assert (run_dir / "metrics.json").stat().st_mode & 0o777 == 0o666 & ~demo._UMASK


def test_load_evaluates_the_saved_model(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["demo", "--load", str(run_dir)]) == 0
    accuracy = json.loads((run_dir / "metrics.json").read_text())["accuracy"]
    assert f"exact-match accuracy {accuracy:.4f}" in capsys.readouterr().out


def test_same_seed_same_run(run_dir: Path, tmp_path: Path) -> None:
    assert main(["demo", "--out", str(tmp_path), *TINY]) == 0
    first, second = (json.loads((d / "metrics.json").read_text()) for d in (run_dir, tmp_path))
    assert first["final_loss"] == second["final_loss"]
    assert first["accuracy"] == second["accuracy"]
    a, b = (load_file(str(d / "model.safetensors")) for d in (run_dir, tmp_path))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_greedy_decoding_with_cache_equals_full_forward() -> None:
    # The KV-cached greedy decoder must produce what the uncached model scores highest.
    cfg = demo.DemoConfig(steps=1, eval_size=8)
    model = demo.Seq2Seq(cfg).eval()
    batch = demo.make_batch(cfg, demo.eval_set(cfg))
    generated = demo.greedy_decode(model, batch)
    tgt = torch.cat([torch.full((8, 1), demo.BOS), generated], 1)
    with torch.no_grad():
        full = model.decode(tgt[:, :-1], model.encode(batch.src, batch.src_mask), batch.src_mask)
    assert torch.equal(full.argmax(-1), generated)


def test_training_never_sees_the_held_out_sequences() -> None:
    cfg = demo.DemoConfig(min_len=1, max_len=2, symbols=3, eval_size=5)
    held_out = {tuple(s) for s in demo.eval_set(cfg)}
    gen = torch.Generator().manual_seed(0)
    seen = {tuple(s) for s in demo._sequences(cfg, gen, 400, avoid=held_out)}
    assert not seen & held_out
    assert len(seen) == 12 - 5  # every other sequence of length 1 or 2 over 3 symbols


def test_relative_attention_runs(tmp_path: Path) -> None:
    assert main(["demo", "--out", str(tmp_path), "--attention", "relative", *TINY]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["attention"] == "relative"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "steps must be a positive integer, got 0"),
        (["--out", "FILE"], "exists and is not a directory"),
        (["--load", "MISSING"], "no config.json (was it written by attnkit demo?)"),
    ],
)
def test_bad_options(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "FILE").write_text("not a folder")
    args = [str(tmp_path / a) if a in ("FILE", "MISSING") else a for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *args, "--quiet"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_corrupt_and_mismatched_checkpoints(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt, other = tmp_path / "corrupt", tmp_path / "other"
    for d in (corrupt, other):
        d.mkdir()
        (d / "config.json").write_text((run_dir / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage")
    state = load_file(str(run_dir / "model.safetensors"))
    state["out.weight"] = torch.zeros(7, 64)
    del state["out.bias"]
    save_file(state, str(other / "model.safetensors"))
    for folder, message in [
        (corrupt, "is not a readable safetensors file"),
        (other, "out.weight: shape (7, 64) in"),
        (other, "out.bias: missing from"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["demo", "--load", str(folder)])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_interrupt_leaves_no_half_written_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "plot_attention", interrupted)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--out", str(tmp_path), *TINY])
    assert exit_.value.code == 130
    # What was written before the interrupt is complete; nothing else, no temporary files.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "loss.png",
        "model.safetensors",
    ]
    json.loads((tmp_path / "config.json").read_text())
    load_file(str(tmp_path / "model.safetensors"))


def test_missing_cli_extra_is_explained(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = demo.importlib.util.find_spec
    monkeypatch.setattr(
        demo.importlib.util, "find_spec", lambda name: None if name == "tqdm" else real(name)
    )
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *TINY])
    assert exit_.value.code == 2
    assert (
        "needs tqdm: install the cli extra, pip install 'attnkit[cli]'" in capsys.readouterr().err
    )
