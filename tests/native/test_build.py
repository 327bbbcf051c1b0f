"""The native kernel's build and load: never wedged by a killed process, never crashed by a broken
file, loaded without a compiler or write access, and honest about what it does.

Each case runs real processes: a build is replaced by a copy of the library this test session
built (a real compile takes a minute), and processes are killed with real signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from attnkit import _native
from attnkit._native import build

pytestmark = pytest.mark.skipif(
    not _native.load(), reason=f"needs a built native kernel: {_native.status()[1]}"
)

# The script every process runs: its build (compile_library) is a copy of a real library, made
# slow or failing on request, and it reports what it loaded.
SCRIPT = textwrap.dedent(
    """
    import json, os, shutil, sys, time, warnings
    from pathlib import Path
    import torch
    from attnkit._native import build

    REAL = os.environ["TEST_REAL_LIBRARY"]
    MARK = Path(os.environ["TEST_MARK"])

    def fake_compile(name, cap, folder):
        MARK.write_text("compiling")
        time.sleep(float(os.environ.get("TEST_COMPILE_SECONDS", "0")))
        if os.environ.get("TEST_COMPILE_FAILS"):
            raise RuntimeError("error: this source does not compile")
        shutil.copy(REAL, Path(folder) / f"{name}.so")
        torch.ops.load_library(str(Path(folder) / f"{name}.so"))
        return Path(folder) / f"{name}.so"

    build.compile_library = fake_compile
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import attnkit
        from attnkit import _native
        before = _native.status()
        q = torch.randn(1, 2, 40, 8, requires_grad=True)
        if os.environ.get("TEST_ASK_ONLY"):
            print(attnkit.explain(q, q, q, causal=True, backend="chunked"), file=sys.stderr)
            attnkit.backends.Chunked().notes(attnkit.explain(q, q, q).call)
            loaded = None
        else:
            for _ in range(2):
                out = attnkit.attention(q, q, q, causal=True, backend="chunked")
                out.sum().backward()
            ref = attnkit.attention(q.double(), q.double(), q.double(), causal=True,
                                    backend="reference")
            assert torch.allclose(out.double(), ref, atol=1e-5)
            loaded = _native.loaded()
    print(json.dumps({
        "before": list(before),
        "after": list(_native.status()),
        "loaded": loaded,
        "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
    }))
    """
)


def real_library() -> Path:
    """The library this session loaded (built by the suite's first native call)."""
    cap = build.capability()
    shipped, _ = build.shipped_library(cap)
    if shipped is not None:
        return shipped
    b = build.Build(build.cache_dir() / build.build_name(cap), build.build_name(cap))
    assert b.verified()[0], b
    return b.library


def the_build(cache: Path) -> build.Build:
    cap = build.capability()
    return build.Build(cache / build.build_name(cap), build.build_name(cap))


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNKIT_NATIVE", "CXX")}
    env.update(
        ATTNKIT_CACHE_DIR=str(tmp_path / "cache"),
        TEST_REAL_LIBRARY=str(real_library()),
        TEST_MARK=str(tmp_path / "mark"),
        **extra,
    )
    return env


def start(tmp_path: Path, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        env=env_for(tmp_path, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[dict[str, object], str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def run(tmp_path: Path, timeout: float = 120, **extra: str) -> tuple[dict[str, object], str]:
    return finish(start(tmp_path, **extra), timeout)


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def place(cache: Path, library: bytes, manifest: dict[str, object] | None) -> build.Build:
    """A build in ``cache`` holding ``library`` and, when given, ``manifest``."""
    b = the_build(cache)
    b.folder.mkdir(parents=True)
    b.library.write_bytes(library)
    if manifest is not None:
        b.manifest.write_text(json.dumps(manifest))
    return b


def manifest_of(data: bytes) -> dict[str, object]:
    import hashlib

    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_builder_killed_mid_build_never_blocks_the_next(tmp_path: Path, sig: int) -> None:
    first = start(tmp_path, TEST_COMPILE_SECONDS="600")
    wait_for(tmp_path / "mark")  # it holds the build lock and is compiling
    first.send_signal(sig)
    first.wait(timeout=30)
    assert first.returncode == -sig
    (tmp_path / "mark").unlink()
    began = time.monotonic()
    report, err = run(tmp_path, timeout=120)
    assert report["loaded"] is True
    assert time.monotonic() - began < 90
    b = the_build(tmp_path / "cache")
    assert b.verified()[0]
    assert not list(b.folder.glob("tmp-*")), "the killed builder's folder is cleared"
    assert err.count("attnkit: compiling the native CPU kernel") == 1


def test_a_waiter_gives_up_after_its_timeout_and_says_where(tmp_path: Path) -> None:
    first = start(tmp_path, TEST_COMPILE_SECONDS="600")
    try:
        wait_for(tmp_path / "mark")
        began = time.monotonic()
        report, _ = run(tmp_path, ATTNKIT_BUILD_TIMEOUT="2")
        assert time.monotonic() - began < 60
        assert report["loaded"] is False
        folder = str(the_build(tmp_path / "cache").folder)
        (warning,) = report["warnings"]
        assert "waited 2 s for another process building the kernel" in warning
        assert folder in warning
        assert "eager kernel" in warning
    finally:
        first.kill()
        first.wait()


def test_a_stale_lock_file_from_an_older_build_is_ignored(tmp_path: Path) -> None:
    b = the_build(tmp_path / "cache")
    b.folder.mkdir(parents=True)
    (b.folder / "lock").write_text("")  # what torch's own builder leaves when killed
    b.lock.write_text("")
    report, _ = run(tmp_path, timeout=120)
    assert report["loaded"] is True


@pytest.mark.parametrize("damage", ["truncated", "foreign", "no manifest", "garbage"])
def test_a_broken_library_is_detected_and_rebuilt_not_loaded(tmp_path: Path, damage: str) -> None:
    data = real_library().read_bytes()
    if damage == "truncated":  # loading it would be a SIGBUS
        place(tmp_path / "cache", data[: len(data) // 2], manifest_of(data))
    elif damage == "foreign":
        place(tmp_path / "cache", os.urandom(4096), manifest_of(data))
    elif damage == "no manifest":  # killed between the library's rename and the manifest's
        place(tmp_path / "cache", data, None)
    else:  # garbage that its manifest describes: the load fails, then a rebuild
        junk = os.urandom(4096)
        place(tmp_path / "cache", junk, manifest_of(junk))
    report, err = run(tmp_path)
    assert report["loaded"] is True
    assert "attnkit: rebuilding the native kernel" in err  # logged, with the reason
    assert (tmp_path / "mark").exists(), "rebuilt"
    assert the_build(tmp_path / "cache").verified()[0]


def test_a_library_with_one_byte_changed_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    # The same size as its manifest says, one byte flipped: only the SHA-256 tells, and the
    # library is rebuilt (its reason logged), never mapped.
    real = real_library().read_bytes()
    data = bytearray(real)
    data[len(data) // 2] ^= 0xFF
    b = place(tmp_path / "cache", bytes(data), manifest_of(real))
    assert b.library.stat().st_size == json.loads(b.manifest.read_text())["size"]
    report, err = run(tmp_path)
    assert report["loaded"] is True
    assert f"rebuilding the native kernel: {b.library} does not match its manifest's SHA-256" in err
    assert (tmp_path / "mark").exists(), "rebuilt"
    assert b.verified()[0]
    assert b.library.read_bytes() == real
    # The same answer in this process, without loading anything.
    again = place(tmp_path / "again", bytes(data), manifest_of(real))
    assert again.verified() == (False, f"{again.library} does not match its manifest's SHA-256")


def _complete_build(cache: Path) -> build.Build:
    data = real_library().read_bytes()
    return place(cache, data, manifest_of(data))


def test_a_finished_build_loads_without_a_compiler(tmp_path: Path) -> None:
    _complete_build(tmp_path / "cache")
    empty = tmp_path / "bin"
    empty.mkdir()
    report, _ = run(tmp_path, PATH=str(empty))
    assert report["loaded"] is True
    assert not (tmp_path / "mark").exists(), "nothing compiled"
    assert report["warnings"] == []


# A read-only file system as Python sees it: every write under the cache fails with EROFS (the
# suite may run as root, for whom permission bits do not stop writes).
READ_ONLY = textwrap.dedent(
    """
    import builtins, errno, os, pathlib
    ROOT = os.environ["ATTNKIT_CACHE_DIR"]
    def refuse(path):
        if str(path).startswith(ROOT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
    _open, _os_open = builtins.open, os.open
    def open_(file, mode="r", *a, **k):
        if any(c in mode for c in "wax+"):
            refuse(file)
        return _open(file, mode, *a, **k)
    def os_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return _os_open(path, flags, *a, **k)
    builtins.open, os.open = open_, os_open
    for name in ("mkdir", "makedirs", "replace", "rename", "remove", "unlink"):
        real = getattr(os, name)
        def guard(p, *a, _real=real, **k):
            refuse(p)
            return _real(p, *a, **k)
        setattr(os, name, guard)
    """
)


def test_a_finished_build_in_a_read_only_cache_is_loaded(tmp_path: Path) -> None:
    b = _complete_build(tmp_path / "cache")
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(READ_ONLY)
    env = env_for(
        tmp_path, PYTHONPATH=os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", "import sitecustomize\n" + SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["loaded"] is True
    assert sorted(p.name for p in b.folder.iterdir()) == sorted([b.library.name, b.manifest.name])


def test_one_line_announces_a_build_and_later_calls_stay_quiet(tmp_path: Path) -> None:
    report, err = run(tmp_path)
    lines = [ln for ln in err.splitlines() if ln.startswith("attnkit: ")]
    assert len(lines) == 1, err
    folder = str(the_build(tmp_path / "cache").folder)
    assert "compiling the native CPU kernel" in lines[0]
    assert "about a minute" in lines[0]
    assert folder in lines[0]
    assert report["loaded"] is True
    # The next process loads the cached build, silently.
    (tmp_path / "mark").unlink()
    report, err = run(tmp_path)
    assert report["loaded"] is True
    assert "attnkit: " not in err
    assert not (tmp_path / "mark").exists()


def test_a_failed_build_warns_once_with_its_reason_and_calls_still_work(tmp_path: Path) -> None:
    report, _ = run(tmp_path, TEST_COMPILE_FAILS="1")
    assert report["loaded"] is False
    (warning,) = report["warnings"]  # two calls, one warning
    assert "build failed: error: this source does not compile" in warning
    assert report["after"] == [False, "build failed: error: this source does not compile"]


def test_without_a_compiler_the_eager_kernel_runs_and_says_why(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    report, _ = run(tmp_path, PATH=str(empty))
    assert report["loaded"] is False
    assert report["before"] == [False, "no C++ compiler (c++ is not on PATH)"]
    (warning,) = report["warnings"]
    assert "no C++ compiler" in warning
    assert not (tmp_path / "cache").exists()


def test_asking_questions_never_builds(tmp_path: Path) -> None:
    report, err = run(tmp_path, TEST_ASK_ONLY="1")
    assert report["before"][0] is True
    assert "compiled on first use" in report["before"][1]
    assert "native kernel (compiled on first use" in err  # what explain() says
    assert not (tmp_path / "mark").exists()
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("spelled", ["0", "off", "OFF", " False ", "no"])
def test_disabled_by_the_environment_neither_builds_nor_warns(tmp_path: Path, spelled: str) -> None:
    report, _ = run(tmp_path, ATTNKIT_NATIVE=spelled)
    assert report["loaded"] is False
    assert report["before"] == [False, f"disabled by ATTNKIT_NATIVE={spelled.strip()}"]
    assert report["warnings"] == []
    assert not (tmp_path / "mark").exists()


@pytest.mark.parametrize(("spelled", "warned"), [("on", False), ("YES", False), ("maybe", True)])
def test_on_or_unreadable_in_the_environment_keeps_the_kernel(
    tmp_path: Path, spelled: str, warned: bool
) -> None:
    """ATTNKIT_NATIVE=off once kept the kernel on without a word (only "0" was off). A value that
    is no spelling of on or off keeps the default, the kernel, and warns once (two calls) naming
    the variable, the value and what is accepted; import and calls never fail on it."""
    report, _ = run(tmp_path, ATTNKIT_NATIVE=spelled)
    assert report["loaded"] is True
    expected = [
        f"attnkit: ATTNKIT_NATIVE='{spelled}', which is neither on (1, on, true, yes) nor off "
        "(0, off, false, no), in any case; taken as on, the default"
    ]
    assert report["warnings"] == (expected if warned else [])


def test_the_build_name_names_torch_and_the_instruction_set() -> None:
    name = build.build_name(build.capability())
    assert name.startswith(
        "attnkit_native_" + torch.__version__.replace(".", "_").replace("+", "_")
    )
    assert build.capability().lower() in name
    # Paths of the environment are not part of it: environments with one torch share a build.
    assert sys.prefix not in name


def test_status_is_a_constant_while_traced_without_importing_dynamo() -> None:
    # attnkit marks status() as torch.compiler.assume_constant_result would, without importing
    # torch._dynamo at import time (seconds): the mark must be the one torch's decorator sets.
    def probe() -> int:
        return 0

    torch.compiler.assume_constant_result(probe)
    marks = {k for k in vars(probe) if k.startswith("_dynamo")}
    assert marks == {k for k in vars(_native._traced_status) if k.startswith("_dynamo")}
    done = subprocess.run(
        [sys.executable, "-c", "import sys, attnkit; print('torch._dynamo' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "False", done.stderr
