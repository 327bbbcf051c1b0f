"""The demo's model and data: cached greedy decoding, held-out sequences."""

from __future__ import annotations

import torch

from attnkit.cli import _demo_model


def test_greedy_decoding_with_cache_equals_full_forward() -> None:
    # The KV-cached greedy decoder must produce what the uncached model scores highest.
    cfg = _demo_model.DemoConfig(steps=1, eval_size=8)
    model = _demo_model.Seq2Seq(cfg).eval()
    batch = _demo_model.make_batch(cfg, _demo_model.eval_set(cfg))
    generated = _demo_model.greedy_decode(model, batch)
    tgt = torch.cat([torch.full((8, 1), _demo_model.BOS), generated], 1)
    with torch.no_grad():
        full = model.decode(tgt[:, :-1], model.encode(batch.src, batch.src_mask), batch.src_mask)
    assert torch.equal(full.argmax(-1), generated)


def test_training_never_sees_the_held_out_sequences() -> None:
    cfg = _demo_model.DemoConfig(min_len=1, max_len=2, symbols=3, eval_size=5)
    held_out = {tuple(s) for s in _demo_model.eval_set(cfg)}
    gen = torch.Generator().manual_seed(0)
    seen = {tuple(s) for s in _demo_model.sequences(cfg, gen, 400, avoid=held_out)}
    assert not seen & held_out
    assert len(seen) == 12 - 5  # every other sequence of length 1 or 2 over 3 symbols
