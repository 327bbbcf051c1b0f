"""Which of torch's SDPA kernels serves a call on a GPU, by torch's rules (its order of preference
and each kernel's limits), on GPUs described rather than present; the user's switches read as
torch reads them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from attnkit._base.devices import Target
from attnkit.backends.sdpa.kernels import TorchArgs, torch_kernel

H100 = Target("cuda", "nvidia", (9, 0), present=False)
H100_NEW_CUDNN = replace(H100, cudnn=91600)
A10 = Target("cuda", "nvidia", (8, 6), present=False)
T4 = Target("cuda", "nvidia", (7, 5), present=False)
MI300 = Target("cuda", "amd", present=False)

PLAIN = TorchArgs(
    dtype=torch.bfloat16,
    qk_dim=64,
    v_dim=64,
    q_len=1024,
    kv_len=1024,
    num_heads=8,
    num_kv_heads=8,
    mask=False,
    causal=True,
    dropout_p=0.0,
    requires_grad=True,
)


@pytest.fixture
def switches() -> Iterator[None]:
    """Restores torch's SDPA switches after a test that turns one off."""
    cuda = torch.backends.cuda
    saved = (
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
    )
    yield
    cuda.enable_flash_sdp(saved[0])
    cuda.enable_mem_efficient_sdp(saved[1])
    cuda.enable_math_sdp(saved[2])
    cuda.enable_cudnn_sdp(saved[3])


@pytest.mark.parametrize(
    ("device", "args", "kernel", "why"),
    [
        (H100, PLAIN, "flash", ""),
        # cuDNN goes first where torch puts it first: Hopper with a cuDNN newer than 9.15
        (H100_NEW_CUDNN, PLAIN, "cuDNN", ""),
        (H100, replace(PLAIN, mask=True), "memory-efficient", "flash: takes no attn_mask"),
        (
            H100_NEW_CUDNN,
            replace(PLAIN, dtype=torch.float32),
            "memory-efficient",
            "cuDNN: takes float16/bfloat16, not float32; flash: takes float16/bfloat16",
        ),
        (H100, replace(PLAIN, dtype=torch.float64), "math", "memory-efficient: takes float16/"),
        (H100, replace(PLAIN, qk_dim=512, v_dim=512), "memory-efficient", "Dk == Dv <= 256"),
        (H100, replace(PLAIN, q_len=100), "memory-efficient", "is_causal only with Tq == Tk"),
        (
            H100,
            replace(PLAIN, qk_dim=60, v_dim=60, mask=True),
            "math",
            "multiples of 8, not 60, 60",
        ),
        (A10, replace(PLAIN, qk_dim=200, v_dim=200), "memory-efficient", "no backward for head"),
        (A10, replace(PLAIN, qk_dim=200, v_dim=200, requires_grad=False), "flash", ""),
        (T4, replace(PLAIN, dtype=torch.float16), "memory-efficient", "sm_80 to sm_121, not sm_75"),
        (T4, PLAIN, "math", "float16/float32, not bfloat16"),
        (MI300, replace(PLAIN, qk_dim=512, v_dim=512), "flash", ""),
        (MI300, replace(PLAIN, mask=True, num_kv_heads=2), "math", "no grouped-query heads"),
    ],
)
def test_torch_kernel(device: Target, args: TorchArgs, kernel: str, why: str) -> None:
    choice = torch_kernel(device, args)
    assert choice.kernel == kernel, choice.describe()
    assert why in choice.describe()
    assert choice.fused == (kernel != "math")


def test_cudnn_never_on_rocm() -> None:
    choice = torch_kernel(replace(MI300, cudnn=91600), replace(PLAIN, dtype=torch.float32))
    assert choice.kernel == "memory-efficient"


@pytest.mark.usefixtures("switches")
def test_the_users_switches() -> None:
    torch.backends.cuda.enable_flash_sdp(False)
    choice = torch_kernel(H100, PLAIN)
    assert choice.kernel == "memory-efficient"
    assert "flash: turned off (torch.backends.cuda.enable_flash_sdp(False))" in choice.describe()
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    assert torch_kernel(H100, PLAIN).kernel == "math"
    torch.backends.cuda.enable_math_sdp(False)
    assert torch_kernel(H100, PLAIN).kernel == "cuDNN"  # last in torch's default order
    torch.backends.cuda.enable_cudnn_sdp(False)
    assert torch_kernel(H100, PLAIN).kernel == "none"


def test_intel_gpus() -> None:
    xpu = Target("xpu", "intel", present=False)
    assert torch_kernel(xpu, PLAIN).fused
    assert torch_kernel(xpu, replace(PLAIN, dtype=torch.float64)).kernel == "math"
