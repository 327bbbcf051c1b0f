"""The demo's training: its thread count, and the estimate of its duration."""

from __future__ import annotations

import re

import torch

from attnkit.cli import _demo_model, _demo_train


def test_the_demo_model_trains_on_one_thread() -> None:
    # One thread unless --threads: more buy little on this model and cost a lot on a busy core.
    assert _demo_train.default_threads(_demo_model.DemoConfig()) == 1


def test_threads_are_set_for_the_block_only() -> None:
    before = torch.get_num_threads()
    with _demo_train.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_the_estimate_of_the_duration_is_said_once() -> None:
    lines: list[str] = []
    cfg = _demo_model.DemoConfig(steps=30, batch_size=8, d_model=16, heads=2, d_ff=32)
    _demo_train.train(cfg, progress=False, say=lines.append)
    assert len(lines) == 1
    assert re.fullmatch(r"about \d+ s of training left \(\d+ ms a step\)", lines[0])
