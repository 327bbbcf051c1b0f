"""The ``flex`` backend: attnkit's calls lowered to torch's FlexAttention
(``torch.nn.attention.flex_attention``).

(Not to be confused with :mod:`attnkit.flex`, FlexAttention's API on :func:`attnkit.attention`,
whose calls any backend that takes a ``score_mod`` may serve. The backend is registered as
``flex``, ``backend="flex"``: that names torch's FlexAttention, which is what serves the call.)

Every mask of :mod:`attnkit.masks` becomes a ``mask_mod`` (:mod:`.mask_mod`) with its
``BlockMask`` made from the call's block plan (:mod:`.block_mask`); softcap, biases, score terms
and the call's own ``score_mod`` become one ``score_mod`` (:mod:`.score_mod`); sinks are folded in
through the log-sum-exp (:mod:`.sinks`). :func:`lowering_refusal` says, on any device, why a call
cannot be lowered (:mod:`.lowering`); :class:`Flex` runs lowered calls compiled on GPUs, with
gradients, and on the CPU for inference (:mod:`.backend`).
"""

from .backend import Flex, flex_available, run_lowered
from .lowering import Lowered, lower_call, lowering_refusal

__all__ = ["Flex", "Lowered", "flex_available", "lower_call", "lowering_refusal", "run_lowered"]
