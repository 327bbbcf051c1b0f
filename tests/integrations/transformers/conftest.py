"""The transformers tests run with attnkit registered under two names, on one thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from attnkit.integrations import transformers as hf


@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    from transformers import AttentionInterface
    from transformers import masking_utils as mu

    # The models are tiny: a second thread costs more in synchronisation than it saves.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf.register()
    hf.register("attnkit_chunked", backend="chunked")
    yield
    for name in ("attnkit", "attnkit_chunked"):
        AttentionInterface._global_mapping.pop(name, None)
        mu.AttentionMaskInterface._global_mapping.pop(name, None)
    torch.set_num_threads(threads)
