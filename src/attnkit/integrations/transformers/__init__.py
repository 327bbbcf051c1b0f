"""attnkit as an attention implementation of Hugging Face transformers models.

::

    from attnkit.integrations.transformers import register
    register()  # once per process: "attnkit" becomes an attention implementation
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnkit")
    # or, on a model already loaded: model.set_attn_implementation("attnkit")

:func:`register` installs two functions under one name (transformers 5.20 or later):

* a **mask function** (transformers' ``AttentionMaskInterface``). Each model forward calls it once
  per kind of layer, with the query and key ranges, the 2-d padding mask and a pattern function
  (causal, sliding window, bidirectional). It returns a :class:`TransformersMask`: the pattern and
  the key padding already in :func:`attnkit.attention`'s terms, built once for all layers. The
  common case, causal plus padding, never becomes a ``(Tq, Tk)`` tensor, so ``auto`` can take an
  O(T)-memory backend; so do packed sequences (``DataCollatorWithFlattening``'s packed
  ``position_ids``), as :func:`attnkit.masks.documents`. A pattern it does not recognise (chunked
  attention, a model's own ``or``/``and`` overlays) becomes transformers' own dense bool mask,
  exactly as ``sdpa`` would get it; the mask's ``repr()`` says which form it took and why. A model
  that asks for a tensor (``allow_is_causal_skip=False``, as sparse-attention indexers do, which
  slice it) gets transformers' own bool tensor, and a model transformers runs with eager only
  gets eager's float mask (its code may widen or edit it).
* an **attention function** (``AttentionInterface``), which every attention layer calls with
  ``(module, q, k, v, mask, **kwargs)`` in the ``(B, H, T, D)`` layout. It returns the output as
  ``(B, T, H, D)``, and the weights when the model collects them.

Both are needed: with an attention function alone, transformers hands it ``mask=None`` and padded
tokens are silently attended to. A model whose attention layers do not call transformers'
attention interface (BLOOM, GPT-Neo, ...) is refused when it is built or switched to attnkit, as
transformers refuses ``"sdpa"`` for it.

What transformers passes, and what the attention function makes of it:

=============================  ===================================================================
transformers passes            attnkit gets
=============================  ===================================================================
a ``TransformersMask``         its ``mask`` and ``causal``; keys that no query may see (a static
                               cache's unfilled slots) are left out of the call
a bool 4-d tensor              ``mask=`` (True = may attend): a mask the caller built
a float 4-d tensor             ``bias=``: an additive, eager-style mask the caller built
``None``                       transformers' meaning: causal **top-left** (query ``i`` sees keys
                               ``j <= i``) if the module is causal and ``Tq > 1``, else no mask
``position_bias`` (T5)         ``bias=`` (summed with a float mask)
``softcap`` (Gemma 2)          ``softcap=``
``s_aux``/``sinks`` (GPT-OSS)  ``sinks=``
``sinks`` ``(B, H, Tq, 1)``    one logit per query (Inkling 2): the output and weights without
                               sinks, times ``sigmoid(lse - sink)``, the share the sink leaves
``indices`` (DeepSeek V3.2)    the keys an indexer selected, ``(B, Tq, topk)``: ANDed into the mask
``cu_seq_lens_q/k``             packed sequences without padding, as transformers' flash-attention
``max_length_q/k``               path takes them: :func:`attnkit.flash_attn.varlen_mask` (documents,
                               causal within each when the module is causal) ANDed with the mask
packed ``position_ids``        the same, the sequences read from the positions (one batch row, a
                               new one wherever they do not step by 1); not when the 2-d mask
                               hides a token: flash-attention then attends by the mask alone
``dropout``                    ``dropout_p=``, only while ``module.training``
attention weights wanted       ``return_weights=True`` when the model collects them
                               (``output_attentions=True``) or :func:`attnkit.capture_attention`
                               covers the layer; captured under the layer's module name
=============================  ===================================================================

Shape letters: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``Tq`` queries, ``Tk``
keys, ``D`` head size.
"""

from ._masks import TransformersMask, build_mask
from ._register import register

__all__ = ["TransformersMask", "build_mask", "register"]
