"""The adapter: attnkit's conventions on torch's ``scaled_dot_product_attention``.

torch picks its own kernel (flash, memory-efficient, cuDNN or math) for the device and inputs; this
adapter translates attnkit's conventions, which differ from torch's in three places:

* attnkit's causal alignment is bottom-right and torch's ``is_causal`` top-left (they agree when
  ``Tq == Tk``), and torch refuses ``is_causal`` together with a mask: such calls, and every
  structured mask other than key padding, need a bool mask written out, a cost
  (:func:`sdpa_cost`) that ``auto`` avoids where another backend has none. Packed documents go
  to torch one document at a time (``documents.py``).
* attnkit's ``bias`` is torch's float ``attn_mask``; with a mask as well, the two are merged.
* A :class:`~attnkit.scores.ScoreTerm` (no gradients) is served one block of queries at a time
  (``terms.py``).

Outside torch.compile the output is screened (``screen.py``): one that breaks attnkit's non-finite
policy is handed over to the backend registered as ``chunked``. Calls that need gradients are not
given to this backend at all when their inputs hold NaN/inf (torch's backward would let masked
ones into the gradients). Where torch's kernels are the slower, ``costs.py`` says so.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._base.checks import check_int, dim_str, shape_str
from ..._base.devices import on_gpu, target
from ..._base.transforms import transforms_active
from ..._call import AttentionCall
from ..._kernel import no_autocast
from ...masks import Geometry, Mask
from ..base import Backend, CallInputs
from . import screen, terms
from .caches import cache_attention, cache_cost, cache_refusal, dense_rows
from .costs import sdpa_slower
from .documents import document_cuts, per_document
from .kernels import KernelChoice, TorchArgs, torch_kernel
from .terms import TERM_KEYS

__all__ = ["EXACT", "SDPA", "gpu_kernel", "sdpa_check", "sdpa_cost", "torch_args"]

#: The registered name of the backend a call goes to when torch's output breaks the policy.
EXACT = "chunked"


def _batched(t: Tensor, batch: tuple[int, ...]) -> Tensor:
    """``(B|1, ...)`` with the batch dims flattened -> ``(*batch|1, ...)``."""
    if t.size(0) == 1:
        return t.reshape(*(1,) * len(batch), *t.shape[1:])
    return t.reshape(*batch, *t.shape[1:])


def _is_causal(call_q: int, call_k: int, mask: Mask | None, has_bias: bool) -> bool | None:
    """True: torch's ``is_causal`` serves the mask; False: no mask at all; None: write it out."""
    if mask is None:
        return False
    band = mask.band
    if band is not None and band[:2] == (-math.inf, 0) and not has_bias:
        if band[2] == "top_left":  # torch's own alignment
            return True
        if call_q <= 1:  # one query, bottom-right: it sees every key
            return False
        if call_q == call_k:
            return True
    return None


def _cheap_mask(mask: Mask) -> bool:
    """The mask's dense form costs nothing new: a tensor given as is, or key padding."""
    return mask.tensor is not None or mask.keys_only


def _small_next_to_the_cache(call: AttentionCall) -> bool:
    """On a GPU, a mask's dense form (Tq booleans a key) is small next to the keys and values
    the call reads anyway (a decode step or a short chunk against a cache): at most a sixteenth
    of their bytes. torch's fused kernels then take it at little cost, where FlexAttention would
    compile once per length of the cache."""
    if not on_gpu(call.device):
        return False
    kv_bytes = call.num_kv_heads * (call.qk_dim + call.v_dim) * call.dtype.itemsize
    return bool(16 * call.q_len <= kv_bytes)


def sdpa_check(call: AttentionCall) -> list[str]:
    """Why torch's SDPA cannot serve a call (empty when it can)."""
    reasons = []
    refused = cache_refusal(call)
    if refused is not None:
        reasons.append(refused)
    if call.return_weights:
        reasons.append("does not return attention weights (only reference does)")
    if call.return_lse:
        reasons.append("torch's SDPA returns no log-sum-exp (chunked and reference do)")
    if call.softcap is not None:
        reasons.append("torch's kernel has no softcap")
    if call.sinks:
        reasons.append("torch's kernel has no sinks")
    if call.forward_ad:
        reasons.append(
            "torch's fused kernels compute no forward-mode derivative (torch.func.jvp, "
            "torch.autograd.forward_ad): reference does"
        )
    if call.score_term is not None:
        if torch.compiler.is_compiling():
            reasons.append(
                "torch.compile/export is tracing: its loop over blocks of queries would unroll "
                "per block"
            )
        if call.requires_grad:
            reasons.append(
                "serves a score term only without gradients (torch would keep each block's "
                "probabilities for the backward); use torch.no_grad() or inference_mode()"
            )
        if call.dtype in (torch.float16, torch.bfloat16):
            reasons.append(
                f"its float mask would round the score term to {str(call.dtype)[6:]}; chunked "
                "keeps it in float32"
            )
    if not call.requires_grad and transforms_active() and not torch.compiler.is_compiling():
        # (run() screens an output without gradients by reading its values)
        reasons.append(
            "screens torch's output for the non-finite policy by reading its values on the host, "
            "which torch.func.vmap cannot (an inference call under vmap: chunked applies the "
            "policy itself)"
        )
    if call.finite is False and call.requires_grad:
        reasons.append(
            "q, k or v hold NaN/inf and gradients are needed: torch's backward would let masked "
            "ones into the gradients"
        )
    return reasons


def torch_args(call: AttentionCall) -> TorchArgs:
    """What torch's kernel choice reads of the ``scaled_dot_product_attention`` call
    :meth:`SDPA.run` makes for ``call``: an ``attn_mask`` wherever a bias, a score term or a
    mask that is not torch's ``is_causal`` is given (packed documents go one document at a time,
    with none)."""
    call = call.dense_views or call
    mask, has_bias = call.mask, call.bias_shape is not None
    causal = _is_causal(call.q_len, call.kv_len, mask, has_bias)
    docs = None
    if not has_bias and call.score_term is None:
        docs = document_cuts(mask, call.q_len, call.kv_len)
    return TorchArgs(
        dtype=call.dtype,
        qk_dim=call.qk_dim,
        v_dim=call.v_dim,
        q_len=call.q_len,
        kv_len=call.kv_len,
        num_heads=call.num_heads,
        num_kv_heads=call.num_kv_heads,
        mask=call.cache is not None
        or (docs is None and (has_bias or call.score_term is not None or causal is None)),
        causal=bool(docs[1]) if docs else bool(causal),
        dropout_p=call.dropout_p,
        requires_grad=call.requires_grad,
    )


def gpu_kernel(call: AttentionCall) -> KernelChoice | None:
    """Which of torch's kernels serves ``call`` on the GPU it runs on (None: not on a GPU)."""
    if not on_gpu(call.device):
        return None
    return torch_kernel(target(call.device), torch_args(call))


def sdpa_cost(call: AttentionCall) -> list[str]:
    """Why ``auto`` should prefer another backend although torch's SDPA could serve the call."""
    call = call.dense_views or call
    costs = cache_cost(call)
    kernel = gpu_kernel(call)
    if kernel is not None and not kernel.fused:
        costs.append(
            f"would run torch's math kernel on {call.device.type}, which writes out the scores "
            f"(..., H, Tq, Tk) = {shape_str(call.scores_shape)} ("
            + "; ".join(f"{name}: {why}" for name, why in kernel.passed_over)
            + ")"
        )
    mask = call.mask
    if (
        mask is not None
        and call.score_term is None
        and _is_causal(call.q_len, call.kv_len, mask, call.bias_shape is not None) is None
        and not _cheap_mask(mask)
        and not _small_next_to_the_cache(call)
        and (call.bias_shape is not None or document_cuts(mask, call.q_len, call.kv_len) is None)
    ):
        size = shape_str((call.q_len, call.kv_len))
        if call.causal and call.q_len != call.kv_len:
            why = (
                f"a (Tq, Tk) = {size} causal mask: Tq != Tk ({dim_str(call.q_len)} != "
                f"{dim_str(call.kv_len)}) and torch's is_causal is top-left aligned"
            )
        elif call.causal:
            why = (
                f"a (Tq, Tk) = {size} causal mask: torch does not take is_causal together with "
                "a mask or bias"
            )
        else:
            why = f"the mask {mask!r} as a (Tq, Tk) = {size} tensor"
        costs.append(f"would materialise {why}")
    if call.bias_requires_grad and call.score_term is None:
        costs.append(
            f"would keep the probabilities (..., H, Tq, Tk) = {shape_str(call.scores_shape)} for "
            "the backward: torch computes a bias gradient only in its math kernel"
        )
    return costs


def _plain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    bias: Tensor | None,
    scale: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor | None]:
    """One fused call; returns the output and the float/bool mask torch saw."""
    shape = q.shape
    batch, h, tq = tuple(shape[:-3]), shape[-3], shape[-2]
    tk = k.size(-2)
    is_causal = False
    attn_mask: Tensor | None = None
    causal = _is_causal(tq, tk, mask, bias is not None)
    if causal is None and mask is not None:
        geo = Geometry(batch, h, tq, tk, q.device)
        attn_mask = _batched(mask.tile(geo, 0, tq, 0, tk), batch)
    elif causal:
        is_causal = True
    if bias is not None:
        attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))
    if attn_mask is not None and attn_mask.ndim < 2:
        attn_mask = attn_mask.unsqueeze(0)  # torch wants (..., Tq|1, Tk); ours may be just (Tk,)
    if scale == 0.0:
        # torch's causal kernels scale their -inf too (0 * -inf = NaN, torch 2.13 CPU): zero
        # queries with scale 1 give the same all-zero scores and the same zero gradient of q.
        q, scale = q * 0.0, 1.0
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        # (a branch, not the comparison: under dynamic shapes that is a SymBool, which torch's
        # binding refuses; torch.compile guards on the branch)
        enable_gqa=True if q.size(-3) != k.size(-3) else False,  # noqa: SIM210
    )
    empty = screen.empty_rows(attn_mask)
    if empty is not None and (q.device.type != "cpu" or torch.compiler.is_compiling()):
        # On CPU torch >= 2.5 returns 0 for a query with no visible key (its math and flash kernels
        # use a safe softmax); the CUDA kernels have differed between releases, so make sure. A
        # traced graph says it too: ONNX's attention gives such a query the mean of the values.
        out = out.masked_fill(empty, 0.0)
    return out, attn_mask


def _documents(call: AttentionCall) -> int:
    """How many fused calls packed documents take (0: the call is not served document by
    document); the documents' lengths are read, nothing else."""
    if call.mask is None or call.bias_shape is not None or call.score_term is not None:
        return 0
    docs = document_cuts(call.mask, call.q_len, call.kv_len)
    if not docs:
        return 0
    return sum(sum(b > a for a, b in itertools.pairwise(row)) for row in docs[0])


class SDPA(Backend):
    """torch's SDPA as a backend; ``block_q``, ``product_q`` and ``term_keys`` size the blocks of a
    call with a score term: queries per fused call, queries per product of the term (when
    ``product_q >= block_q`` the term's tiles go to torch as they are, without a copy), and keys
    per tile asked of the term.

    When torch's output breaks attnkit's non-finite policy (NaN/inf, or a zero row that neither
    the mask nor the values explain), the call is handed over to the backend registered as
    ``chunked`` (dropout included: it drops in O(T) memory too), visibly: :attr:`handovers`
    counts it and :func:`~attnkit.record_dispatch` records it; ``explain()`` says when it can
    happen.
    """

    # a KV cache view, on GPUs (see caches.py)
    accepts_cache = True

    def __init__(
        self, *, block_q: int = 192, product_q: int = 64, term_keys: int = TERM_KEYS
    ) -> None:
        super().__init__("sdpa")
        self.block_q = check_int("block_q", block_q)
        self.product_q = check_int("product_q", product_q)
        self.term_keys = check_int("term_keys", term_keys)

    def check(self, call: AttentionCall) -> list[str]:
        return sdpa_check(call)

    def cost(self, call: AttentionCall) -> list[str]:
        return sdpa_cost(call)

    def slower(self, call: AttentionCall) -> list[str]:
        call = call.dense_views or call
        slow = sdpa_slower(call)
        if on_gpu(call.device) and torch_args(call).mask is False and _documents(call):
            # a kernel launch per document, where a variable-length kernel would take one
            slow.append(f"would run one fused call per document ({_documents(call)} calls)")
        return slow

    def notes(self, call: AttentionCall) -> list[str]:
        call = call.dense_views or call
        notes = []
        kernel = gpu_kernel(call)
        if kernel is not None and kernel.fused:
            notes.append(f"runs {kernel.describe()}")
        plain = call.bias_shape is None and call.score_term is None
        if call.mask is not None and plain:
            n = _documents(call)
            if n:
                notes.append(f"one fused call per document: {n} calls")
        if not call.requires_grad:
            notes.append(
                f"hands the call to {EXACT} if torch's output breaks the non-finite policy "
                "(NaN/inf, or a zero row that neither the mask nor the values explain)"
            )
        return notes

    def run(self, call: AttentionCall, inputs: CallInputs) -> Tensor:
        q, k, v = inputs.q, inputs.k, inputs.v
        given, dense = call, call.dense_views
        if dense is not None and call.cache is not None:
            k, v = call.cache.dense()  # views of the cache's rows
            call = dense
        mask, scale, dropout_p = call.mask, call.scale, call.dropout_p
        if call.cache is not None:
            k, v = dense_rows(call.cache)  # every row's first Tk positions
            out, attn_mask = cache_attention(call, q, k, v)
            trusted = (
                torch.compiler.is_compiling()
                or given.requires_grad  # (under vmap, out says False for what autograd tracks)
                or (torch.is_grad_enabled() and out.requires_grad)
                or screen.trustworthy(out, attn_mask, qkv=(q, k, v), dropout=dropout_p > 0)
            )
        elif call.score_term is not None:
            with no_autocast(q.device):
                out, trusted = terms.blocked_term(
                    q, k, v, mask, None, call.score_term, scale, dropout_p, self.block_q,
                    self.product_q, self.term_keys,
                )  # fmt: skip
        else:
            bias = inputs.bias
            # Documents read their lengths on the host: not while torch.compile traces.
            docs = None
            if bias is None and not torch.compiler.is_compiling():
                docs = document_cuts(mask, q.size(-2), k.size(-2))
            if docs:
                out, attn_mask = per_document(q, k, v, *docs, scale, dropout_p), None
            else:
                out, attn_mask = _plain(q, k, v, mask, bias, scale, dropout_p)
            trusted = (
                torch.compiler.is_compiling()
                or given.requires_grad  # (under vmap, out says False for what autograd tracks)
                or (torch.is_grad_enabled() and out.requires_grad)
                or screen.trustworthy(out, attn_mask, qkv=(q, k, v), dropout=dropout_p > 0)
            )
        if trusted:
            return out
        # NaN/inf in the result, or a zero no mask explains: let attnkit's kernel apply the
        # policy (dropout included: it drops in O(T) memory too).
        result = self.hand_over(given, inputs, EXACT, "torch's output broke the non-finite policy")
        return result[0] if isinstance(result, tuple) else result

    def __repr__(self) -> str:
        return f"SDPA(block_q={self.block_q}, product_q={self.product_q})"
