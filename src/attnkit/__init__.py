"""attnkit: attention for PyTorch.

One mask convention (bool, True = may attend), a readable reference implementation of every variant,
and fast paths that are tested equal to it.
"""

from . import _onnx as _onnx  # torch.onnx.export writes attnkit's operator as its dense form
from . import (
    backends,
    distributed,
    flash_attn,
    flex,
    interop,
    masks,
    scores,
    weights,
)
from ._call import AttentionCall
from ._kernel import BlockPlan
from .attention import (
    Backend,
    BackendError,
    Explanation,
    attention,
    available_backends,
    explain,
    merge_attention,
    register_backend,
    unregister_backend,
)
from .backends.base import CallInputs, Dispatch, record_dispatch
from .backends.reference import decompositions
from .caches.kv_cache import KVCache
from .caches.paged import PagedKVCache
from .caches.streaming import StreamingKVCache
from .caches.view import CacheView
from .modules.capture import AttentionMaps, capture_attention
from .modules.conformer import ConformerLayer
from .modules.feedforward import PositionwiseFeedForward
from .modules.latent import MultiHeadLatentAttention
from .modules.layers import Transformer, TransformerDecoderLayer, TransformerEncoderLayer
from .modules.multihead import MultiHeadAttention
from .modules.positional import (
    RelativePositionEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_slopes,
    alibi_term,
    relative_encoding,
)
from .modules.relative import RelativeMultiHeadAttention
from .stats import AttentionStats, attention_stats

__version__ = "0.1.0"

__all__ = [
    "AttentionCall",
    "AttentionMaps",
    "AttentionStats",
    "Backend",
    "BackendError",
    "BlockPlan",
    "CacheView",
    "CallInputs",
    "ConformerLayer",
    "Dispatch",
    "Explanation",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PagedKVCache",
    "PositionwiseFeedForward",
    "RelativeMultiHeadAttention",
    "RelativePositionEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "StreamingKVCache",
    "Transformer",
    "TransformerDecoderLayer",
    "TransformerEncoderLayer",
    "__version__",
    "alibi_bias",
    "alibi_slopes",
    "alibi_term",
    "attention",
    "attention_stats",
    "available_backends",
    "backends",
    "capture_attention",
    "decompositions",
    "distributed",
    "explain",
    "flash_attn",
    "flex",
    "interop",
    "masks",
    "merge_attention",
    "record_dispatch",
    "register_backend",
    "relative_encoding",
    "scores",
    "unregister_backend",
    "weights",
]
