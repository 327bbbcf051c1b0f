"""The run folder of ``attnkit demo``: results are written into a new hidden folder beside ``--out``
and swapped in whole, with a manifest of every file's SHA-256 that ``--load`` checks.

An interrupted run leaves ``--out`` as it was: never half-written, never one run's weights next to
another run's configuration. A run replaces the folder of an earlier run, and refuses a folder
that holds anything else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import attnkit

from ._demo_model import DemoConfig, Seq2Seq

_UMASK = os.umask(0)
os.umask(_UMASK)

RUN_FORMAT = "attnkit-demo-run/1"
MANIFEST = "manifest.json"
# Every name a run writes. A folder that holds nothing else is an earlier run, which a new run
# replaces; a run never replaces a folder holding anything else.
RESULT_FILES = (
    "config.json",
    "model.safetensors",
    "metrics.json",
    "loss.png",
    "attention.png",
    MANIFEST,
)


def os_reason(err: OSError) -> str:
    """``Permission denied: 'path'``: an OSError in one line, without the errno."""
    if err.strerror is None:
        return str(err)
    return err.strerror + (f": {os.fspath(err.filename)!r}" if err.filename is not None else "")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_manifest(folder: Path) -> None:
    """List every file in ``folder`` with its SHA-256 under a new run id, in manifest.json.

    Written last: ``--load`` then refuses a folder whose files do not all match it, such as the
    weights of one run next to the configuration of another.
    """
    files = {
        p.name: _sha256(p.read_bytes()) for p in sorted(folder.iterdir()) if p.name != MANIFEST
    }
    manifest = {"format": RUN_FORMAT, "run": uuid.uuid4().hex, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _foreign_files(folder: Path) -> list[str]:
    """What in ``folder`` a run did not write (empty for an earlier run's folder)."""
    return sorted(p.name for p in folder.iterdir() if p.name not in RESULT_FILES)


def _check_replaceable(target: Path, out: Path) -> None:
    """Refuse an ``--out`` that is not a folder, or holds files no run wrote: the run replaces
    the whole folder, and must not take the user's other files with it."""
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        raise ValueError(f"--out {out} is the current folder or holds it; choose another folder")
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    foreign = _foreign_files(target)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"--out {out} holds files attnkit demo does not write ({shown}); a run replaces "
            "the whole folder, so choose a new or empty folder, or one of an earlier run"
        )


def prepare_out(out: Path) -> tuple[Path, Path]:
    """``(target, staging)``: the folder the run will replace (links followed) and the new
    hidden folder beside it that receives the results."""
    try:
        target = out.resolve()
        _check_replaceable(target, out)
        existing = next(p for p in target.parents if p.exists())  # the root exists
        if not existing.is_dir():  # mkdir would say "File exists"
            raise ValueError(f"--out {out}: {existing} is not a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot write there: {os_reason(err)}") from None
    return target, Path(staging)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C during the block takes effect when it ends: between the two renames of a swap,
    ``--out`` does not exist. (Python runs signal handlers in the main thread only.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt


def swap_in(staging: Path, target: Path, out: Path) -> None:
    """Put the finished results at ``target``, replacing the earlier run there if any."""
    # mkdtemp makes 0700 and safetensors writes 0600: results are an ordinary folder and files.
    os.chmod(staging, 0o777 & ~_UMASK)
    for p in staging.iterdir():
        os.chmod(p, 0o666 & ~_UMASK)
    # Checked again: files may have been added during the minutes of training.
    _check_replaceable(target, out)
    with _interrupts_deferred():
        if not os.path.lexists(target):
            os.rename(staging, target)
            return
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)  # the earlier run stays where it was
            raise
        shutil.rmtree(old, ignore_errors=True)


def save_model(model: Seq2Seq, folder: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(model.cfg.to_json(), indent=1) + "\n")


def _read_run(folder: Path, needed: tuple[str, ...]) -> dict[str, bytes]:
    """The contents of the ``needed`` files of the run saved in ``folder``, once every file its
    manifest lists is there with the SHA-256 recorded when the run was written."""
    where = f"--load {folder}"
    manifest_path = folder / MANIFEST
    try:
        if not folder.is_dir():
            raise ValueError(f"{where}: no such folder")
        for name in (*needed, MANIFEST):
            if not (folder / name).is_file():
                raise ValueError(f"{where}: no {name} (was it written by attnkit demo?)")
        raw = manifest_path.read_bytes()
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{manifest_path} is not valid JSON: {err}") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if (
            not isinstance(files, dict)
            or manifest.get("format") != RUN_FORMAT
            or not all(
                n in RESULT_FILES and n != MANIFEST and isinstance(h, str) for n, h in files.items()
            )
        ):
            raise ValueError(f"{manifest_path} is not an attnkit demo manifest ({RUN_FORMAT})")
        contents = {}
        for name, digest in files.items():
            if not (folder / name).is_file():
                raise ValueError(f"{where}: {name}, listed in {MANIFEST}, is missing")
            data = (folder / name).read_bytes()
            if _sha256(data) != digest:
                raise ValueError(
                    f"{where}: {name} is not the file its run wrote (its SHA-256 differs from "
                    f"the one in {MANIFEST}): the folder mixes files of different runs, or {name} "
                    "was changed since"
                )
            contents[name] = data
    except OSError as err:
        raise ValueError(f"{where}: cannot read the run: {os_reason(err)}") from None
    for name in needed:
        if name not in contents:
            raise ValueError(f"{manifest_path} does not list {name}")
    return {name: contents[name] for name in needed}


def load_model(folder: Path) -> Seq2Seq:
    """The model of the run saved in ``folder``; errors say which file is wrong and how."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    contents = _read_run(folder, ("config.json", "model.safetensors"))
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    try:
        data = json.loads(contents["config.json"])
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from None
    try:
        cfg = DemoConfig.from_json(data, str(config_path))
    except TypeError as err:  # a field of the wrong type reaches the dataclass
        raise ValueError(f"{config_path}: {err}") from None
    try:
        state = load(contents["model.safetensors"])
    except SafetensorError as err:
        raise ValueError(f"{weights_path} is not a readable safetensors file: {err}") from None
    model = Seq2Seq(cfg)
    attnkit.weights.load_state_dict(model, state, source=str(weights_path))
    return model
