"""Builds attnkit, with its native CPU kernel compiled in when torch is importable at build time.

pyproject.toml holds the metadata; this file only adds the kernel's libraries. Built without
torch (pip's default isolated build), the wheel is pure Python and the kernel is compiled on
first use instead (see attnkit/_native/build.py). Built with torch (``python -m build --wheel
--no-isolation`` or ``pip wheel --no-build-isolation .`` in an environment holding the torch the
wheel is for), the wheel carries one library per vector instruction set, each loaded only on a
CPU that has it and only under that same torch (a library links against one torch's C++ ABI).

``ATTNKIT_NATIVE_CAPABILITIES``: the instruction sets to build, comma-separated (default
``AVX512,AVX2,DEFAULT`` on x86-64, ``DEFAULT`` elsewhere); ``ATTNKIT_BUILD_NATIVE=0``: none.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
NATIVE = HERE / "src" / "attnkit" / "_native"


def _capabilities() -> list[str]:
    given = os.environ.get("ATTNKIT_NATIVE_CAPABILITIES")
    if given:
        return [c.strip().upper() for c in given.split(",") if c.strip()]
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return ["AVX512", "AVX2", "DEFAULT"] if x86 else ["DEFAULT"]


def _native() -> dict[str, object]:
    """setup()'s arguments for the kernel's libraries, or none when torch is not importable."""
    if os.environ.get("ATTNKIT_BUILD_NATIVE", "1").strip() == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths
    except ImportError:
        return {}
    # The flags the kernel is compiled with on first use: one list, read from the package.
    namespace: dict[str, object] = {}
    exec((NATIVE / "_flags.py").read_text(), namespace)
    flags: dict[str, list[str]] = namespace["CAPABILITY_FLAGS"]  # type: ignore[assignment]
    cflags: list[str] = namespace["CFLAGS"]  # type: ignore[assignment]
    # torch's headers as system headers, as its build on first use passes them: their warnings
    # are torch's, and would bury the kernel's own.
    cflags = [*cflags, *namespace["system_includes"](include_paths())]  # type: ignore[operator]
    ldflags: list[str] = namespace["LDFLAGS"]  # type: ignore[assignment]
    sources = sorted(str(p.relative_to(HERE)) for p in (NATIVE / "csrc").glob("*.cpp"))
    caps = _capabilities()
    extensions = [
        CppExtension(
            f"attnkit._native._kernel_{cap.lower()}",
            sources,
            # -g0: no debugging symbols (they would make the wheel ten times larger)
            extra_compile_args=[*cflags, *flags[cap], "-g0"],
            extra_link_args=ldflags,
        )
        for cap in caps
    ]
    commit = (getattr(torch.version, "git_version", None) or "unknown")[:12]

    class Build(BuildExtension):  # type: ignore[misc]
        """Builds the libraries, then records which torch they are for (_built.json)."""

        def run(self) -> None:
            super().run()
            libraries = {
                cap: Path(self.get_ext_filename(f"attnkit._native._kernel_{cap.lower()}")).name
                for cap in caps
            }
            info = {"torch": f"{torch.__version__}+{commit}", "libraries": libraries}
            for root in {self.build_lib, str(HERE / "src")} if self.inplace else {self.build_lib}:
                target = Path(root) / "attnkit" / "_native" / "_built.json"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(json.dumps(info, indent=1) + "\n")

    return {"ext_modules": extensions, "cmdclass": {"build_ext": Build}}


setup(**_native())  # type: ignore[arg-type]
