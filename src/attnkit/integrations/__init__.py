"""attnkit inside other libraries.

* :mod:`attnkit.integrations.transformers`: ``register()`` makes attnkit an attention
  implementation of Hugging Face transformers models (``attn_implementation="attnkit"``).

Each integration imports its library only when it is used, so attnkit itself never needs it.
"""
