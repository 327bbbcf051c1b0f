"""The device a call runs on, as the routing rules see it: explain()'s device names, the GPU it
assumes where this process has none, what stands in inside ``assuming``, and the device rules
(FlexAttention's kernel_options, how auto weighs slow paths against costs)."""

from __future__ import annotations

import pytest
import torch

from attnkit._base import devices
from attnkit._base.devices import Target

H100 = Target("cuda", "nvidia", (9, 0), present=False, flash_cute=True)


def test_device_names() -> None:
    cuda = devices.parse_device("cuda")
    assert (cuda.type, cuda.gpu) == ("cuda", True)
    if not torch.cuda.is_available():
        assert (cuda.vendor, cuda.capability, cuda.present) == ("nvidia", (9, 0), False)
    # torch names an AMD GPU "cuda"; explain() takes "rocm" for it.
    rocm = devices.parse_device("rocm")
    assert (rocm.type, rocm.vendor) == ("cuda", "amd")
    assert devices.parse_device(torch.device("xpu")).vendor == "intel"
    cpu = devices.parse_device("cpu")
    assert (cpu.type, cpu.gpu, cpu.present) == ("cpu", False, True)
    assert devices.parse_device("cuda:1").type == "cuda"


@pytest.mark.parametrize(
    ("device", "error", "words"),
    [
        ("tpu", ValueError, "'cuda', 'rocm', 'xpu' or 'cpu' (optionally with ':index'), got 'tpu'"),
        ("cuda:x", ValueError, "got 'cuda:x'"),
        (3, TypeError, "got int"),
    ],
)
def test_bad_device_names(device: object, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        devices.parse_device(device)


def test_assuming_stands_in_for_its_device_type_only() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    before = devices.target(cpu)
    with devices.assuming(H100):
        assert devices.target(cuda) is H100
        assert devices.target(cpu) == before
        # the call's tensors are elsewhere: nothing on the assumed device is read
        assert not devices.readable(cuda)
        assert devices.readable(cpu)
    assert devices.target(cuda) is not H100
    assert not devices.readable(torch.device("meta"))


def test_on_gpu_is_the_targets_answer_from_the_type_alone() -> None:
    """A device's target is of its own type, inside ``assuming`` too (which stands in for one
    type), so ``on_gpu`` answers what ``target(device).gpu`` does without the look-up."""
    kinds = ["cpu", "meta", "cuda", "cuda:1", "xpu"]
    for kind in kinds:
        device = torch.device(kind)
        assert devices.on_gpu(device) == devices.target(device).gpu
        assert devices.target(device).type == device.type
    for stand_in in (H100, Target("cpu"), Target("xpu", "intel", present=False)):
        with devices.assuming(stand_in):
            for kind in kinds:
                device = torch.device(kind)
                assert devices.on_gpu(device) == devices.target(device).gpu, (kind, stand_in)
    assert devices.on_gpu(torch.device("cuda"))
    assert not devices.on_gpu(torch.device("meta"))


def test_describe_says_what_was_assumed() -> None:
    text = H100.describe()
    assert text.startswith("cuda (NVIDIA, sm_90, assumed: torch sees no such device), torch ")
    assert devices.Target("cpu").describe().startswith("cpu, torch ")


def test_slow_paths_cost_more_on_gpus_only() -> None:
    assert devices.slow_paths_cost_more(H100)
    assert devices.slow_paths_cost_more(Target("xpu", "intel"))
    assert not devices.slow_paths_cost_more(Target("cpu"))


def test_compiled_flex_runs_with_gradients_on_gpus() -> None:
    assert devices.compiled_refusal(H100) is None
    assert "no backward on cpu" in str(devices.compiled_refusal(Target("cpu")))
    assert "Triton is not installed" in str(devices.compiled_refusal(Target("cuda", triton=False)))


@pytest.mark.parametrize(
    ("device", "dtype", "dims", "grads", "words"),
    [
        (H100, torch.bfloat16, (128, 128), False, "FlashAttention-4"),
        (H100, torch.float32, (128, 128), False, "float16/bfloat16, not float32"),
        (H100, torch.bfloat16, (96, 96), False, "head sizes 64 or 128"),
        (H100, torch.bfloat16, (64, 64), True, "no gradients to tensors the score_mod captures"),
        (Target("cuda", "nvidia", (8, 0)), torch.bfloat16, (64, 64), False, "sm_90/sm_100"),
        (Target("cuda", "amd"), torch.bfloat16, (64, 64), False, "sm_90/sm_100"),
        (
            Target("cuda", "nvidia", (10, 0)),
            torch.float16,
            (64, 64),
            False,
            "flash_attn.cute (FlashAttention-4) is not installed",
        ),
    ],
)
def test_flex_kernel_options(
    device: Target, dtype: torch.dtype, dims: tuple[int, int], grads: bool, words: str
) -> None:
    options, why = devices.flex_kernel_options(device, dtype, dims, grads)
    assert words in why
    assert options == ({"BACKEND": "FLASH"} if words == "FlashAttention-4" else {})
