"""attnkit's native CPU kernel: ``attention.cpp`` next to this file, compiled on first use.

The sources ship in the package and are compiled with :func:`torch.utils.cpp_extension.load` (a
C++ compiler and ``ninja`` are what it needs) the first time a call would use them, then loaded
from the user's cache folder: ``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else
``~/.cache/attnkit``. The cached build is keyed by torch's version, the sources' hash and the
vector instructions torch itself chose for this CPU (AVX2, AVX-512 or none), so a cache shared
between machines never loads a binary built for another CPU. A file lock keeps two processes from
building into the same folder at once.

``ATTNKIT_NATIVE=0`` turns it off. A failed build never breaks an import or a call: the kernel
then runs in eager PyTorch (:mod:`attnkit._kernel.softmax`), and :func:`status` says why, which is
what ``explain()`` prints.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["cache_dir", "load", "loaded", "status"]

_log = logging.getLogger("attnkit")
_SOURCES = (Path(__file__).with_name("attention.cpp"),)
# The flags that let at::vec use the instructions torch's own kernels use on this CPU.
_CAPABILITY_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}

# What the first load found: the module (None when it is not available) and the reason.
_state: dict[str, tuple[ModuleType | None, str]] = {}


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module's docstring)."""
    own = os.environ.get("ATTNKIT_CACHE_DIR")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnkit"


def _capability() -> str:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "DEFAULT"
    return cap if cap in _CAPABILITY_FLAGS else "DEFAULT"


def _build_name(cap: str) -> str:
    digest = hashlib.sha256()
    for src in _SOURCES:
        digest.update(src.read_bytes())
    digest.update(" ".join(["-fopenmp", *_CAPABILITY_FLAGS.get(cap, [])]).encode())
    version = re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)
    return f"attnkit_native_{version}_{cap.lower()}_{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` between processes (where the system has ``flock``; torch's
    own build lock remains elsewhere)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _first_error(exc: BaseException) -> str:
    """The line of a compiler's output that says what went wrong (else the message's first)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower() and not ln.lower().startswith("error building extension"):
            return ln[:300]
    return lines[0][:300] if lines else type(exc).__name__


def _compiler() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx)


def _try_load() -> tuple[ModuleType | None, str]:
    if _compiler() is None:
        return None, f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH)"
    if shutil.which("ninja") is None:
        # pip's ninja installs the binary next to the interpreter, which PATH may not include.
        try:
            import ninja  # type: ignore[import-not-found, unused-ignore]

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        except ImportError:
            return None, "ninja is not installed (pip install ninja)"
    cap = _capability()
    name = _build_name(cap)
    folder = cache_dir() / name
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        with _locked(folder):
            cached = any(folder.glob(f"{name}*.so"))
            module = cpp_extension.load(
                name=name,
                sources=[str(s) for s in _SOURCES],
                # -fopenmp: at::parallel_for is inline OpenMP, serial without it.
                extra_cflags=["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(cap, [])],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as exc:  # a failed build must never fail the call
        why = f"build failed: {_first_error(exc)}"
        _log.warning("attnkit: the native kernel is not available (%s)", why)
        return None, why
    took = time.perf_counter() - start
    how = "loaded from the cache" if cached else "built"
    _log.info("attnkit: native kernel %s in %.1f s (%s)", how, took, folder)
    return module, "native kernel"


def _disabled() -> bool:
    return os.environ.get("ATTNKIT_NATIVE", "1").strip() == "0"


def load() -> ModuleType | None:
    """The compiled kernel, building it on the first call (None when it is not available).

    ``ATTNKIT_NATIVE=0`` is read on every call, so setting it turns the kernel off at once.
    """
    if _disabled():
        return None
    if "load" not in _state:
        _state["load"] = _try_load()
    return _state["load"][0]


def loaded() -> ModuleType | None:
    """The compiled kernel if an earlier call loaded it, else None; never builds it (for helpers
    that are only faster with it, such as :func:`attnkit._call.finite`)."""
    if _disabled() or "load" not in _state:
        return None
    return _state["load"][0]


def status() -> tuple[bool, str]:
    """Whether the native kernel is available, and why not (builds it if it was never tried)."""
    if _disabled():
        return False, "disabled by ATTNKIT_NATIVE=0"
    load()
    module, why = _state["load"]
    return module is not None, why
