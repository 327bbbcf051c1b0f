"""attnkit as a package: what `python -m build` makes installs and works, the version is written
once, and every install hint the code and the docs print names an extra that exists, in both the
form for a package index and the form for a checkout."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit._native import build

ROOT = Path(__file__).resolve().parents[2]

# What a run of the tests, the docs build or the demo leaves in a checkout: not the package's.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "site", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
    ".hypothesis", "attnkit-demo",
)  # fmt: skip

# A compiler's warning: "file.h:12:3: warning: ..." (the column is optional).
COMPILER_WARNING = re.compile(r"\.(?:h|hpp|c|cc|cpp):\d+(?::\d+)?: warning: ")

SMOKE = """
import importlib.metadata, sys
from pathlib import Path
import torch, attnkit
assert Path(attnkit.__file__).is_relative_to(sys.prefix), attnkit.__file__
assert importlib.metadata.version("attnkit") == attnkit.__version__
q, k, v = (torch.randn(2, 4, 33, 16, dtype=torch.float64) for _ in range(3))
mask = attnkit.masks.causal() & attnkit.masks.key_padding([33, 20])
out = attnkit.attention(q, k, v, mask=mask, backend="chunked")
ref = attnkit.attention(q, k, v, mask=mask, backend="reference")
torch.testing.assert_close(out, ref)
print(attnkit.__version__)
from attnkit import _native
with attnkit.record_dispatch() as calls:
    attnkit.attention(q.float(), k.float(), v.float(), mask=mask, backend="chunked")
print(calls[0].kernel.split()[0], _native.loaded())
"""


class Build:
    """``python -m build`` of a copy of this checkout, started and not yet waited for: the wheel is
    built from the sdist (build's default), so the sdist is known to be complete; built where
    torch is importable, it carries the kernel (here for this CPU's instructions only: a release
    builds every instruction set, see docs/deploying.md). Started with the session (``early``),
    at a lower priority than the tests, so that it takes the cores they leave idle; started by
    its test, which waits for it, at theirs (niced beside busy workers, it could wait an hour)."""

    def __init__(self, folder: Path, early: bool = True) -> None:
        src = folder / "src"
        shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
        self.dist = folder / "dist"
        self.log = folder / "build.log"
        nice = ["nice", "-n", "10"] if early and shutil.which("nice") else []
        with open(self.log, "w") as out:
            command = [*nice, sys.executable, "-m", "build", "--no-isolation", "--outdir"]
            self.proc = subprocess.Popen(
                [*command, str(self.dist), str(src)],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "ATTNKIT_NATIVE_CAPABILITIES": build.capability()},
            )

    def output(self) -> str:
        try:
            code = self.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        text = self.log.read_text()
        assert code == 0, text[-3000:]
        return text


# The build tests/conftest.py starts as the session starts, when this test is to run.
STARTED: list[Build] = []


@pytest.mark.packaging
def test_wheel_and_sdist_build_install_and_work(tmp_path: Path) -> None:
    built = STARTED.pop() if STARTED else Build(tmp_path, early=False)
    dist = built.dist
    cap = build.capability()
    # The kernel's build prints only what matters: attnkit's sources compile without a warning
    # under -Wall -Wextra, and torch's headers, passed as system headers, keep theirs.
    output = built.output().splitlines()
    warnings = [line for line in output if COMPILER_WARNING.search(line)]
    assert not warnings, f"{len(warnings)} compiler warnings:\n" + "\n".join(warnings[:20])
    version = attnkit.__version__
    (wheel,) = dist.glob(f"attnkit-{version}-*.whl")
    sdist = dist / f"attnkit-{version}.tar.gz"
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel.name, sdist.name])
    assert not wheel.name.endswith("-none-any.whl"), "a wheel with a kernel names its platform"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for name in ("README.md", "LICENSE", "CHANGELOG.md", "src/attnkit/py.typed", "setup.py"):
        assert name in names, name
    for source in build.SOURCES + build.HEADERS:
        assert f"src/attnkit/_native/csrc/{source.name}" in names, source.name
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = json.loads(whl.read("attnkit/_native/_built.json"))
    assert "attnkit/py.typed" in names
    assert "attnkit/cli/__init__.py" in names
    assert info["torch"] == build.torch_key()
    assert f"attnkit/_native/{info['libraries'][cap]}" in names
    assert "attnkit/_native/csrc/forward.cpp" in names  # a source install's first-use build

    # A new venv with nothing of this checkout in it; torch (several hundred MB) is reused from
    # the running interpreter through a .pth line, which adds its folder but runs none of the
    # .pth files there (so not the editable install of attnkit either).
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "torch_from_parent.pth").write_text(f"{Path(torch.__file__).parents[1]}\n")
    pip = [sys.executable, "-m", "pip", "--python", python]
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--quiet", wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # No compiler on PATH and an empty cache: the kernel that runs is the wheel's.
    bare = tmp_path / "bin"
    bare.mkdir()
    clean = {
        k: v for k, v in os.environ.items() if k not in ("ATTNKIT_NATIVE", "CXX", "PYTHONPATH")
    }
    clean.update(PATH=str(bare), ATTNKIT_CACHE_DIR=str(tmp_path / "cache"))
    smoke = subprocess.run(
        [python, "-c", SMOKE], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=clean
    )
    assert smoke.returncode == 0, smoke.stderr
    assert smoke.stdout.split() == [version, "native", "True"], smoke.stdout
    assert not (tmp_path / "cache").exists()
    command = subprocess.run(
        [env / "bin" / "attnkit", "--version"], capture_output=True, text=True, timeout=300
    )
    assert command.stdout.strip() == f"attnkit {version}", command.stderr


def test_the_version_is_written_once() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert not re.search(r"^version\s*=\s*\"", pyproject, flags=re.MULTILINE)
    assert 'dynamic = ["version"]' in pyproject
    assert importlib.metadata.version("attnkit") == attnkit.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", attnkit.__version__)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = re.findall(r"^## (\d+\.\d+\.\d+)", changelog, flags=re.MULTILINE)
    assert released
    assert released[0] == attnkit.__version__


def _hint_files() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "src" / "attnkit").rglob("*.py")),
    ]


def test_every_install_hint_names_a_real_extra_in_both_forms() -> None:
    extras = importlib.metadata.metadata("attnkit").get_all("Provides-Extra") or []
    assert "hf" in extras
    found = 0
    for path in _hint_files():
        text = path.read_text()
        for m in re.finditer(r"pip install (['\"]?)(attnkit|\.)\[([\w,]+)\]\1", text):
            found += 1
            where = f"{path.relative_to(ROOT)}: {m.group(0)}"
            assert m.group(1) == '"', f"{where}: quote the extra with double quotes"
            for extra in m.group(3).split(","):
                assert extra in extras, f"{where}: no extra {extra!r} in pyproject.toml"
            if m.group(2) == "attnkit" and path.suffix == ".py":
                # What the code prints must also work from a checkout, where there is no
                # package of that name to download.
                near = text[m.end() : m.end() + 80]
                assert f'".[{m.group(3)}]"' in near, f"{where}: says nothing of a checkout"
    assert found
