"""Training for ``attnkit demo``: AdamW with a linear warm-up and cosine decay, fresh batches every
step (never a held-out sequence)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ._demo_model import PAD, DemoConfig, Seq2Seq, eval_set, make_batch, sequences

# Steps timed before the duration of the rest is estimated (the first ones pay for warm-up).
_WARMUP_STEPS, _TIMED_STEPS = 5, 20


def default_threads(cfg: DemoConfig) -> int:
    """Threads for training ``cfg``'s model: one for models of the demo's size.

    Each step is a few hundred small operations (matrices of d_model x d_ff on batches of a few
    thousand tokens); a second thread saves little on such operations and costs a wait at every
    one of them when another process holds the core it needs, which on a busy machine makes the
    run several times slower. Larger models (d_model 256 or more) take up to 4 threads.
    """
    if cfg.d_model < 256:
        return 1
    return max(1, min(4, torch.get_num_threads()))


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    return f"{seconds / 60:.0f} min"


def train(
    cfg: DemoConfig, *, progress: bool = True, say: Callable[[str], None] | None = None
) -> tuple[Seq2Seq, list[float], float]:
    """The trained model, its per-step losses, and its training throughput in tokens/s.

    ``say`` receives one line once the first steps are timed: how long the rest will take.
    """
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    model = Seq2Seq(cfg)
    held_out = {tuple(s) for s in eval_set(cfg)}
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:  # linear warm-up, then cosine decay to 0
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses: list[float] = []
    tokens, start = 0, time.perf_counter()
    model.train()
    bar = tqdm(
        range(cfg.steps),
        desc=f"training ({cfg.task})",
        disable=not progress,
        unit="step",
        dynamic_ncols=True,
    )
    timed_from = 0.0
    for step in bar:
        if step == _WARMUP_STEPS:
            timed_from = time.perf_counter()
        if step == _WARMUP_STEPS + _TIMED_STEPS and say is not None:
            per_step = (time.perf_counter() - timed_from) / _TIMED_STEPS
            left = per_step * (cfg.steps - step)
            line = f"about {_duration(left)} of training left ({per_step * 1000:.0f} ms a step)"
            (bar.write if progress else say)(line)
        batch = make_batch(cfg, sequences(cfg, gen, cfg.batch_size, avoid=held_out))
        logits = model(batch)
        labels = batch.tgt[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1), ignore_index=PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        real = labels != PAD
        tokens += int(real.sum()) + int(batch.src_len.sum())
        if step % 10 == 0 or step == cfg.steps - 1:
            acc = float((logits.argmax(-1) == labels)[real].float().mean())
            rate = tokens / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}", tok_s=f"{rate:,.0f}")
    return model, losses, tokens / (time.perf_counter() - start)
