"""attnkit registered with ``backend="flex"``: every layer's call lowered to torch's FlexAttention
(its unfused form in float64 on the CPU, compiled in float32), with the structured masks the mask
function builds (padding with causal, sliding windows, a static cache's unfilled slots left out),
Gemma 2's softcap, GPT-OSS's sinks and T5's position bias; compared with the chunked backend's
implementation, which the other tests hold to transformers' eager and sdpa."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import attnkit  # noqa: E402
from attnkit.integrations import transformers as hf  # noqa: E402

# attnkit registered as 'attnkit' and 'attnkit_chunked' for this module, on one thread
from ..integrations.transformers.conftest import registered  # noqa: E402, F401
from ..integrations.transformers.helpers import inputs, main_output, model, run, use  # noqa: E402

LOWERED = "attnkit_lowered"  # a name with "flex" in it is transformers' own


@pytest.fixture(scope="module", autouse=True)
def lowered() -> Iterator[None]:
    hf.register(LOWERED, backend="flex")
    yield
    AttentionInterface._global_mapping.pop(LOWERED, None)
    mu.AttentionMaskInterface._global_mapping.pop(LOWERED, None)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss", "t5"])
def test_float64_logits_equal_the_chunked_backend(name: str) -> None:
    m = model(name, torch.float64)
    batch, real = inputs(name, "left", torch.float64)
    with attnkit.record_dispatch() as seen:
        ours = main_output(run(m, LOWERED, **batch))[real]
    assert seen
    assert {d.chosen for d in seen} == {"flex"}
    theirs = main_output(run(m, "attnkit_chunked", **batch))[real]
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_float64_generation_equals_the_chunked_backend(cache: str) -> None:
    """Decode steps over a growing cache, prefill with left padding (Mistral's window of 4)."""
    m = model("mistral", torch.float64)
    batch, _ = inputs("mistral", "left", torch.float64)
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kw["cache_implementation"] = "static"
    ids = {}
    for impl in (LOWERED, "attnkit_chunked"):
        with use(m, impl), torch.no_grad():
            ids[impl] = m.generate(**batch, **kw)
    assert torch.equal(ids[LOWERED], ids["attnkit_chunked"])


def test_float32_compiled_logits_equal_eager() -> None:
    m = model("llama")
    batch, real = inputs("llama", "right", torch.float32)
    ours = main_output(run(m, LOWERED, **batch))[real]
    theirs = main_output(run(m, "eager", **batch))[real]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
