"""Key/value caches for decoding: contiguous (:class:`KVCache`) and paged
(:class:`PagedKVCache`)."""
