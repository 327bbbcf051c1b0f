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
# -fopenmp: at::parallel_for is inline OpenMP, serial without it.
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
