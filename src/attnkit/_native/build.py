"""Finding, verifying, building and loading the native kernel's library.

Where the library comes from, in order:

1. **Shipped in the package** (a wheel built with the kernel, see ``setup.py``): a library per
   vector instruction set next to this file, used when ``_built.json`` says it was built against
   the running torch.
2. **The user's cache** (``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else
   ``~/.cache/attnkit``): one folder per build, named by torch's version and commit, the vector
   instruction set torch chose for this CPU and a hash of the sources and flags, so a cache
   shared between environments or machines never loads a binary built for another torch or CPU.
   A folder holds the library and a manifest of its size and SHA-256, and the library is loaded
   only if it matches: a truncated or foreign file is rebuilt, never mapped (a truncated library
   would kill the process with SIGBUS). Loading needs no compiler and no write access.
3. **Built on first use**, when neither holds one: in a private folder under the cache folder,
   then renamed into place (the library first, its manifest last), so a process killed at any
   moment leaves either a complete build or none. Builders take an ``flock`` on the build's
   lock file, which the system releases when a process dies however it dies (SIGKILL included):
   no lock is ever stale. A process that waits for another's build waits at most
   ``$ATTNKIT_BUILD_TIMEOUT`` seconds (default 600), then runs the eager kernel and says so.

One line on stderr announces a build before it starts; a fallback to the eager kernel warns once
with its reason. :func:`state` answers without building or loading anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .._base.env import choice, number, switch
from ._flags import CAPABILITY_FLAGS, CFLAGS, LDFLAGS

__all__ = ["BuildState", "cache_dir", "capability", "load", "loaded", "state"]

_log = logging.getLogger("attnkit")
_HERE = Path(__file__).parent
SOURCES = tuple(sorted((_HERE / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((_HERE / "csrc").glob("*.h")))
# What a shipped library records (setup.py writes it beside the libraries).
SHIPPED_INFO = _HERE / "_built.json"


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module's docstring)."""
    own = os.environ.get("ATTNKIT_CACHE_DIR")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnkit"


def capability() -> str:
    """The vector instructions torch chose for this CPU: ``AVX512``, ``AVX2`` or ``DEFAULT``."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "DEFAULT"
    return cap if cap in CAPABILITY_FLAGS else "DEFAULT"


def torch_key() -> str:
    """The torch a library is built against: its version and commit (a build links to them)."""
    commit = (getattr(torch.version, "git_version", None) or "unknown")[:12]
    return f"{torch.__version__}+{commit}"


def build_name(cap: str) -> str:
    """The cached build's name: torch, the instruction set and a hash of sources and flags."""
    digest = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    digest.update(" ".join([*CFLAGS, *CAPABILITY_FLAGS[cap], torch_key()]).encode())
    version = re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)
    return f"attnkit_native_{version}_{cap.lower()}_{digest.hexdigest()[:12]}"


def shipped_library(cap: str) -> tuple[Path | None, str]:
    """The library shipped in the package for ``cap`` and the running torch, else why not."""
    if not SHIPPED_INFO.exists():
        return None, "no kernel shipped in the package"
    try:
        info = json.loads(SHIPPED_INFO.read_text())
    except (OSError, ValueError) as exc:
        return None, f"unreadable {SHIPPED_INFO.name}: {exc}"
    if info.get("torch") != torch_key():
        return None, f"the shipped kernel is for torch {info.get('torch')}, not {torch_key()}"
    name = info.get("libraries", {}).get(cap)
    path = _HERE / name if name else None
    if path is None or not path.exists():
        return None, f"no shipped kernel for {cap}"
    return path, "shipped"


# --------------------------------------------------------------------------------------------------
# A build in the cache: the library and its manifest


@dataclass(frozen=True)
class Build:
    """A cached build's paths."""

    folder: Path
    name: str

    @property
    def library(self) -> Path:
        return self.folder / f"{self.name}.so"

    @property
    def manifest(self) -> Path:
        return self.folder / f"{self.name}.json"

    @property
    def lock(self) -> Path:
        return self.folder / "build.lock"

    def verified(self) -> tuple[bool, str]:
        """Whether the library is complete and the one the manifest describes (no write)."""
        if not self.library.exists():
            return False, "not built"
        try:
            info = json.loads(self.manifest.read_text())
        except (OSError, ValueError):
            return False, f"{self.library} has no readable manifest (an interrupted build)"
        try:
            size = self.library.stat().st_size
            if size != info.get("size"):
                return (
                    False,
                    f"{self.library} is {size} bytes, its manifest says {info.get('size')}",
                )
            if _sha256(self.library) != info.get("sha256"):
                return False, f"{self.library} does not match its manifest's SHA-256"
        except OSError as exc:
            return False, f"cannot read {self.library}: {exc}"
        return True, "verified"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _replace_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _build_lock(build: Build, timeout: float) -> Iterator[bool]:
    """Yields True holding an exclusive ``flock`` on the build's lock file, False after
    ``timeout`` seconds of waiting. The system releases the lock when its process dies."""
    try:
        import fcntl
    except ImportError:  # no flock: builds are private folders renamed into place anyway
        yield True
        return
    with open(build.lock, "a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def compiler() -> str | None:
    """The C++ compiler a build would use (``$CXX``, else ``c++``), if it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _ninja() -> str | None:
    """Why ninja is missing (None: it is there). pip's ninja installs its binary next to the
    interpreter, which PATH may not include: that folder is added."""
    if shutil.which("ninja") is not None:
        return None
    try:
        import ninja  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return "ninja is not installed (pip install ninja)"
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    return None


def _first_error(exc: BaseException) -> str:
    """The line of a compiler's output that says what went wrong (else the message's first)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower() and not ln.lower().startswith("error building extension"):
            return ln[:300]
    return lines[0][:300] if lines else type(exc).__name__


def compile_library(name: str, cap: str, folder: Path) -> Path:
    """Compile the sources into ``folder/name.so`` (loading it into this process, which is how
    torch's builder ends) and return its path."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=name,
        sources=[str(s) for s in SOURCES],
        extra_cflags=[*CFLAGS, *CAPABILITY_FLAGS[cap]],
        extra_ldflags=LDFLAGS,
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    return folder / f"{name}.so"


def _announce(build: Build, cap: str) -> None:
    sys.stderr.write(
        f"attnkit: compiling the native CPU kernel for torch {torch.__version__} ({cap}); this "
        f"takes about a minute on two cores, once, and is cached in {build.folder}\n"
    )
    sys.stderr.flush()


def _build_into_place(build: Build, cap: str) -> None:
    """Build in a private folder and rename the library, then its manifest, into place; the
    library is loaded into this process on the way (see :func:`compile_library`)."""
    for stale in build.folder.glob("tmp-*"):  # left by killed builders (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        build.manifest.unlink()  # a reader must never pair an old manifest with a new library
    private = build.folder / f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    private.mkdir()
    try:
        library = compile_library(build.name, cap, private)
        info = {"size": library.stat().st_size, "sha256": _sha256(library), "torch": torch_key()}
        os.replace(library, build.library)
        _replace_atomically(build.manifest, json.dumps(info))
    finally:
        shutil.rmtree(private, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Loading, once per process


@dataclass(frozen=True)
class BuildState:
    """What :func:`state` knows without building anything: ``available`` says whether calls
    would run the native kernel (a build still to come counts as available), ``why`` says how or
    why not, ``loaded`` whether the library is in this process."""

    available: bool
    why: str
    loaded: bool = False


_LOCK = threading.Lock()
_loaded: dict[str, tuple[bool, str]] = {}  # "result": (loaded, why), once tried
_warned: set[str] = set()


def _unlock_in_child() -> None:
    """After ``fork()``: a lock of its own for the child. A thread of the parent that was
    loading or building the kernel (for as long as a build takes) held the lock at the fork, and
    no thread of the child would ever release it: the child's first call waited for ever."""
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_unlock_in_child)


def disabled() -> bool:
    """Whether ``ATTNKIT_NATIVE`` turns the kernel off (0, off, false or no; any other value
    warns once and keeps it on, see :mod:`attnkit._base.env`)."""
    return not switch("ATTNKIT_NATIVE", True)


def _timeout() -> float:
    return number("ATTNKIT_BUILD_TIMEOUT", 600.0, minimum=0.0)


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))


def _try_load() -> tuple[bool, str]:
    cap = capability()
    shipped, _ = shipped_library(cap)
    if shipped is not None:
        try:
            _load_library(shipped)
            return True, "native kernel"
        except OSError as exc:  # a shipped library that does not load: try the cache, a build
            _log.warning("attnkit: the shipped native kernel does not load (%s)", exc)
    build = Build(cache_dir() / build_name(cap), build_name(cap))
    ok, why = build.verified()
    if ok:
        try:
            _load_library(build.library)
            _log.info("attnkit: native kernel loaded from %s", build.folder)
            return True, "native kernel"
        except OSError as exc:
            why = f"{build.library} does not load ({exc})"
    reuse = why == "not built"  # what another process may finish while we wait
    if why != "not built":
        _log.warning("attnkit: rebuilding the native kernel: %s", why)
    if compiler() is None:
        return False, f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH)"
    missing = _ninja()
    if missing is not None:
        return False, missing
    try:
        build.folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return False, f"cannot create the cache folder {build.folder} ({exc.strerror})"
    start = time.perf_counter()
    try:
        with _build_lock(build, _timeout()) as held:
            if not held:
                return False, (
                    f"waited {_timeout():.0f} s for another process building the kernel in "
                    f"{build.folder} (ATTNKIT_BUILD_TIMEOUT)"
                )
            if reuse and build.verified()[0]:  # another process built it while we waited
                _load_library(build.library)
                return True, "native kernel"
            _announce(build, cap)
            _build_into_place(build, cap)
    except Exception as exc:  # a failed build must never fail the call
        return False, f"build failed: {_first_error(exc)}"
    _log.info("attnkit: native kernel built in %.1f s (%s)", time.perf_counter() - start, build)
    return True, "native kernel"


def load() -> bool:
    """Load the kernel's operators into this process, building them if needed (see the module's
    docstring); False when they are not available (:func:`state` says why). Never raises."""
    if disabled():
        return False
    if "result" not in _loaded:
        with _LOCK:
            if "result" not in _loaded:
                result = _try_load()
                _loaded["result"] = result
                if not result[0]:
                    _warn_once(result[1])
                else:  # read by the kernel itself (csrc/share.h); said here when misspelt
                    choice("ATTNKIT_SHARE", ("timed", "region", "helpers"), "timed")
    return _loaded["result"][0]


def _warn_once(why: str) -> None:
    if why in _warned:
        return
    _warned.add(why)
    warnings.warn(
        f"attnkit: the native CPU kernel is not available ({why}); attention runs on the eager "
        "kernel, which is exact and slower (attnkit.explain() tells which kernel a call runs)",
        RuntimeWarning,
        stacklevel=3,
    )


def loaded() -> bool:
    """Whether the operators are loaded in this process (never loads them)."""
    return not disabled() and _loaded.get("result", (False, ""))[0]


def state() -> BuildState:
    """Whether calls would run the native kernel, and how or why not, without building or
    loading anything (for ``explain()`` and a backend's questions)."""
    if disabled():
        return BuildState(
            False, f"disabled by ATTNKIT_NATIVE={os.environ['ATTNKIT_NATIVE'].strip()}"
        )
    if "result" in _loaded:
        ok, why = _loaded["result"]
        return BuildState(ok, why, loaded=ok)
    cap = capability()
    if shipped_library(cap)[0] is not None:
        return BuildState(True, "native kernel (shipped with the package, loaded on first use)")
    name = build_name(cap)
    build = Build(cache_dir() / name, name)
    if build.library.exists() and build.manifest.exists():
        return BuildState(True, f"native kernel (built, cached in {build.folder})")
    if compiler() is None:
        return BuildState(False, f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH)")
    if shutil.which("ninja") is None and _ninja_module() is None:
        return BuildState(False, "ninja is not installed (pip install ninja)")
    return BuildState(
        True, f"native kernel (compiled on first use, about a minute, cached in {build.folder})"
    )


def _ninja_module() -> object | None:
    try:
        import ninja  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return ninja  # type: ignore[no-any-return, unused-ignore]
