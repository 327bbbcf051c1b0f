"""The model and data of ``attnkit demo``: a synthetic sequence-to-sequence task (reverse, copy or
sort a string of symbols) and a small encoder-decoder Transformer of attnkit modules, with greedy
decoding through the decoder's KV caches and exact-match evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

import attnkit

PAD, BOS, EOS = 0, 1, 2
FIRST_SYMBOL = 3
TASKS: dict[str, Callable[[list[int]], list[int]]] = {
    "reverse": lambda s: s[::-1],
    "copy": lambda s: list(s),
    "sort": sorted,
}
CONFIG_FORMAT = "attnkit-demo/1"


@dataclass(frozen=True)
class DemoConfig:
    """Everything that defines a run; saved as config.json next to the model."""

    task: str = "reverse"
    attention: str = "mha"
    steps: int = 2000
    seed: int = 0
    symbols: int = 10
    min_len: int = 4
    max_len: int = 12
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 256
    batch_size: int = 128
    lr: float = 3e-3
    warmup: int = 100
    eval_size: int = 500

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.attention not in ("mha", "relative"):
            raise ValueError(f"attention must be 'mha' or 'relative', got {self.attention!r}")
        for name in (
            "steps",
            "symbols",
            "min_len",
            "d_model",
            "heads",
            "layers",
            "d_ff",
            "batch_size",
            "eval_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_len < self.min_len:
            raise ValueError(f"max_len ({self.max_len}) is below min_len ({self.min_len})")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) is not divisible by heads ({self.heads})")

    @classmethod
    def from_json(cls, data: object, source: str) -> DemoConfig:
        if not isinstance(data, dict) or data.get("format") != CONFIG_FORMAT:
            raise ValueError(f"{source} is not an attnkit demo configuration ({CONFIG_FORMAT})")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(known) - {"format"})
        if unknown:
            raise ValueError(f"{source} has unknown keys: {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> dict[str, Any]:
        return {"format": CONFIG_FORMAT, **asdict(self)}

    @property
    def vocab(self) -> int:
        return FIRST_SYMBOL + self.symbols


# --------------------------------------------------------------------------------------------------
# Data


@dataclass
class Batch:
    src: Tensor  # (B, Ts) symbols, PAD after the end
    src_len: Tensor  # (B,)
    tgt: Tensor  # (B, Ts + 2): BOS, the answer, EOS, then PAD

    @property
    def src_mask(self) -> Tensor:
        return attnkit.masks.padding_mask(self.src_len, self.src.size(1))  # (B, 1, 1, Ts)


def sequences(
    cfg: DemoConfig,
    gen: torch.Generator,
    n: int,
    avoid: set[tuple[int, ...]],
    *,
    unique: bool = False,
) -> list[list[int]]:
    """``n`` random symbol strings, none of them in ``avoid`` (and no repeats when ``unique``)."""
    out: list[list[int]] = []
    while len(out) < n:
        lengths = torch.randint(cfg.min_len, cfg.max_len + 1, (n,), generator=gen).tolist()
        symbols = torch.randint(FIRST_SYMBOL, cfg.vocab, (n, cfg.max_len), generator=gen)
        for length, row in zip(lengths, symbols.tolist(), strict=True):
            seq = row[:length]
            if tuple(seq) not in avoid and len(out) < n:
                out.append(seq)
                if unique:
                    avoid.add(tuple(seq))
    return out


def make_batch(cfg: DemoConfig, seqs: list[list[int]]) -> Batch:
    solve = TASKS[cfg.task]
    src = torch.full((len(seqs), cfg.max_len), PAD, dtype=torch.long)
    tgt = torch.full((len(seqs), cfg.max_len + 2), PAD, dtype=torch.long)
    for i, seq in enumerate(seqs):
        src[i, : len(seq)] = torch.tensor(seq)
        tgt[i, : len(seq) + 2] = torch.tensor([BOS, *solve(seq), EOS])
    return Batch(src, torch.tensor([len(s) for s in seqs]), tgt)


# --------------------------------------------------------------------------------------------------
# The model: attnkit's Transformer between an embedding and an output projection


class Seq2Seq(nn.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab, d, padding_idx=PAD)
        self.pos = attnkit.SinusoidalPositionalEncoding(d)
        self.transformer = attnkit.Transformer(
            d,
            cfg.heads,
            num_encoder_layers=cfg.layers,
            num_decoder_layers=cfg.layers,
            d_ff=cfg.d_ff,
            dropout=0.0,
            norm_first=True,
        )
        if cfg.attention == "relative":
            # A Conformer-style encoder: relative positions inside the self-attention, so the
            # encoder's inputs carry no absolute encoding.
            for layer in self.transformer.encoder_layers:
                layer.self_attn = attnkit.RelativeMultiHeadAttention(d, cfg.heads)
        self.out = nn.Linear(d, cfg.vocab)

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        x = self.embed(src) * math.sqrt(self.cfg.d_model)
        if self.cfg.attention == "mha":
            x = self.pos(x)
        memory: Tensor = self.transformer.encode(x, mask=src_mask)
        return memory

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_mask: Tensor,
        cache: list[attnkit.KVCache] | None = None,
        offset: int = 0,
    ) -> Tensor:
        y = self.pos(self.embed(tgt) * math.sqrt(self.cfg.d_model), offset=offset)
        h = self.transformer.decode(y, memory, memory_mask=src_mask, cache=cache)
        logits: Tensor = self.out(h)
        return logits

    def forward(self, batch: Batch) -> Tensor:
        mask = batch.src_mask
        return self.decode(batch.tgt[:, :-1], self.encode(batch.src, mask), mask)


@torch.inference_mode()
def greedy_decode(model: Seq2Seq, batch: Batch) -> Tensor:
    """Generated tokens ``(B, <= max_len + 1)``, one step at a time through the KV caches."""
    mask = batch.src_mask
    memory = model.encode(batch.src, mask)
    b, steps = batch.src.size(0), model.cfg.max_len + 1
    cache = model.transformer.make_cache(batch_size=b, max_len=steps)
    token = torch.full((b, 1), BOS, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    out = []
    for t in range(steps):
        token = model.decode(token, memory, mask, cache=cache, offset=t)[:, -1].argmax(-1)
        token = token.unsqueeze(-1)
        out.append(token)
        done |= token[:, 0] == EOS
        if bool(done.all()):
            break
    return torch.cat(out, 1)


def exact_match(generated: Tensor, batch: Batch) -> Tensor:
    """Per example: the generated tokens up to and including EOS equal the answer and its EOS."""
    want = batch.tgt[:, 1:]
    hits = []
    for g, w in zip(generated.tolist(), want.tolist(), strict=True):
        answer = w[: w.index(EOS) + 1]
        hits.append(g[: len(answer)] == answer)
    return torch.tensor(hits)


def eval_set(cfg: DemoConfig) -> list[list[int]]:
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    return sequences(cfg, gen, cfg.eval_size, avoid=set(), unique=True)


def evaluate(model: Seq2Seq, seqs: list[list[int]]) -> float:
    model.eval()
    hits = []
    for i in range(0, len(seqs), 256):
        batch = make_batch(model.cfg, seqs[i : i + 256])
        hits.append(exact_match(greedy_decode(model, batch), batch))
    return float(torch.cat(hits).float().mean())
