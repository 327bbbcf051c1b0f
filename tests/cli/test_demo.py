"""`attnkit demo`, the command: files written and valid, determinism, --load, errors, Ctrl-C."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from safetensors.torch import load_file, save_file

from attnkit.cli import _demo_run, demo, main

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
        "manifest.json",
        "metrics.json",
        "model.safetensors",
    ]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["format"] == "attnkit-demo-run/1"
    assert len(manifest["run"]) == 32
    assert manifest["files"] == {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in run_dir.iterdir()
        if p.name != "manifest.json"
    }
    assert not [p for p in run_dir.parent.iterdir() if p.name.startswith(".")]  # no leftovers
    assert run_dir.stat().st_mode & 0o777 == 0o777 & ~_demo_run._UMASK  # mkdtemp makes 0700
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
    # Permissions of an ordinary new file (mkstemp's temporaries and safetensors' files are 0600).
    for p in run_dir.iterdir():
        assert p.stat().st_mode & 0o777 == 0o666 & ~_demo_run._UMASK, p.name


def test_load_evaluates_the_saved_model(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["demo", "--load", str(run_dir)]) == 0
    accuracy = json.loads((run_dir / "metrics.json").read_text())["accuracy"]
    assert f"exact-match accuracy {accuracy:.4f}" in capsys.readouterr().out


def test_same_seed_same_run_replacing_an_earlier_one(run_dir: Path, tmp_path: Path) -> None:
    # The folder of an earlier run, whose weights differ: the new run replaces every file.
    out = tmp_path / "out"
    shutil.copytree(run_dir, out)
    state = load_file(str(out / "model.safetensors"))
    save_file({k: v + 1 for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "metrics.json").write_text("{}")
    assert main(["demo", "--out", str(out), *TINY]) == 0
    first, second = (json.loads((d / "metrics.json").read_text()) for d in (run_dir, out))
    assert first["final_loss"] == second["final_loss"]
    assert first["accuracy"] == second["accuracy"]
    a, b = (load_file(str(d / "model.safetensors")) for d in (run_dir, out))
    assert all(torch.equal(a[k], b[k]) for k in a)
    runs = [json.loads((d / "manifest.json").read_text())["run"] for d in (run_dir, out)]
    assert runs[0] != runs[1]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the earlier run's folder is gone


def test_relative_attention_runs(tmp_path: Path) -> None:
    assert main(["demo", "--out", str(tmp_path), "--attention", "relative", *TINY]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["attention"] == "relative"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "steps must be a positive integer, got 0"),
        (["--out", "FILE"], "exists and is not a directory"),
        (["--load", "MISSING"], "MISSING: no such folder"),
        (["--out", "FILE/sub/out"], "FILE is not a directory"),
    ],
)
def test_bad_options(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "FILE").write_text("not a folder")
    args = [str(tmp_path / a) if a.isupper() or "/" in a else a for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *args, "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.splitlines()) == 1


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
    for d in (corrupt, other):  # each is one run's files: the manifest says so
        _demo_run.write_manifest(d)
    for folder, message in [
        (corrupt, "is not a readable safetensors file"),
        (other, "out.weight: shape (7, 64) in"),
        (other, "out.bias: missing from"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["demo", "--load", str(folder)])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_interrupted_run_leaves_the_earlier_run_as_it_was(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    shutil.copytree(run_dir, out)
    before = listing(out)
    # Interrupted after the new weights, config and loss curve were written (the evaluation,
    # which the interruption does not depend on, is skipped to keep the test short).
    monkeypatch.setattr(demo, "evaluate", lambda model, seqs: 0.5)
    monkeypatch.setattr(demo, "plot_attention", interrupt)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--out", str(out), "--seed", "1", *TINY])
    assert exit_.value.code == 130
    assert listing(out) == before  # not one byte of the new run
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left


def test_interrupted_first_run_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "train", interrupt)
    (tmp_path / "empty").mkdir()
    for name in ("new", "empty"):
        with pytest.raises(SystemExit) as exit_:
            main(["demo", "--out", str(tmp_path / name), *TINY])
        assert exit_.value.code == 130
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]
    assert not list((tmp_path / "empty").iterdir())


def test_out_holding_other_files_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--out", str(out), *TINY])
    assert exit_.value.code == 2
    assert "holds files attnkit demo does not write (notes.txt)" in capsys.readouterr().err
    assert sorted(listing(out)) == ["config.json", "notes.txt"]


def test_load_refuses_files_of_different_runs(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # New weights next to an earlier run's config.json and metrics.json, as an interrupted run
    # that wrote file by file left them.
    mixed = tmp_path / "mixed"
    shutil.copytree(run_dir, mixed)
    state = load_file(str(mixed / "model.safetensors"))
    state["out.bias"] = state["out.bias"] + 1.0
    save_file(state, str(mixed / "model.safetensors"))
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--load", str(mixed)])
    assert exit_.value.code == 2
    assert (
        "model.safetensors is not the file its run wrote (its SHA-256 differs from the one in "
        "manifest.json): the folder mixes files of different runs" in capsys.readouterr().err
    )
    (mixed / "manifest.json").unlink()
    with pytest.raises(SystemExit):
        main(["demo", "--load", str(mixed)])
    assert "no manifest.json (was it written by attnkit demo?)" in capsys.readouterr().err


def test_unreadable_files_are_one_line_errors(
    run_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Tests run as root, who may enter any folder: the file system is made to say no instead.
    locked = tmp_path / "locked"
    real_stat, real_open = Path.stat, Path.open

    def stat(self: Path, **kwargs: object) -> object:
        if locked in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, **kwargs)  # type: ignore[arg-type]

    def open_(self: Path, *args: object, **kwargs: object) -> object:
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "open", open_)
    for args, message in [
        (["--out", str(locked / "out")], f"Permission denied: '{locked / 'out'}'"),
        (["--load", str(run_dir)], f"Permission denied: '{run_dir / 'config.json'}'"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["demo", *args, *TINY])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert message in err
        assert len(err.splitlines()) == 1, err


def test_os_errors_anywhere_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(demo, "train", disk_full)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--out", str(tmp_path / "out"), *TINY])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit demo: error: ")
    assert f"No space left on device: '{tmp_path / 'x'}'" in err
    assert len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())


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
        'needs tqdm: install the cli extra, pip install "attnkit[cli]" (or ".[cli]" from a '
        "checkout)" in capsys.readouterr().err
    )


def test_a_run_says_what_it_does_and_lists_what_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = torch.get_num_threads()
    out = tmp_path / "out"
    assert main(["demo", "--out", str(out), "--threads", "1", *TINY]) == 0
    assert torch.get_num_threads() == before  # the run's thread count was for the run only
    text = capsys.readouterr().out
    assert "3 steps on 1 CPU thread" in text
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(str(p) for p in out.iterdir())
    assert json.loads((out / "metrics.json").read_text())["threads"] == 1


def test_threads_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--out", str(tmp_path / "out"), "--threads", "0", *TINY])
    assert exit_.value.code == 2
    assert "--threads must be a positive integer, got 0" in capsys.readouterr().err
