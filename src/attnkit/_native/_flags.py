"""The native kernel's compiler flags, one list for the build on first use
(:mod:`attnkit._native.build`) and the wheel's (``setup.py``, which reads this file without
importing attnkit): nothing here imports anything."""

# The flags that let at::vec use the instructions torch's own kernels use on this CPU (F16C: the
# float16 conversions, which every CPU with AVX2 has).
CAPABILITY_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": [],
}
# attnkit's own sources compile without a warning under these (tests/native/test_flags.py).
WARNINGS = ["-Wall", "-Wextra"]
# -fopenmp: at::parallel_for is inline OpenMP, serial without it.
CFLAGS = ["-O3", "-fopenmp", *WARNINGS]
LDFLAGS = ["-fopenmp"]


def system_includes(folders: list[str]) -> list[str]:
    """``-isystem`` for each of torch's header folders. torch's build on first use passes them so
    already; setuptools passes a library's include folders as ``-I``, and the compiler then reports
    several hundred warnings in torch's headers (unknown pragmas, uninitialised AVX-512 values)
    that say nothing about attnkit. A folder given both ways is searched as a system folder, whose
    warnings the compiler keeps to itself."""
    return [flag for folder in folders for flag in ("-isystem", folder)]
