"""Built-in attention backends. Use them through :func:`attnkit.attention` (``backend=``).

* ``reference`` (:mod:`.reference`): the formula as it reads; the specification the others are
  tested against.
* ``sdpa`` (:mod:`.sdpa`): torch's fused ``scaled_dot_product_attention``.
* ``chunked`` (:mod:`.chunked`): attnkit's blocked online-softmax kernel, O(T * block) memory, with
  its own backward; :func:`.chunked.chunked_attention` runs it with chosen block sizes.
"""
