"""``attnkit demo``: train a small encoder-decoder Transformer of attnkit modules on the CPU.

The task is a synthetic sequence-to-sequence problem (reverse, copy or sort a string of symbols).
Training shows a progress bar; evaluation decodes held-out sequences greedily, one token at a time
through the decoder's KV caches, and reports exact-match accuracy. The run writes to ``--out``:

* ``metrics.json``: accuracy, steps, seconds, throughput and the configuration;
* ``attention.png``: the cross-attention of every decoder layer and head for one example, with the
  source tokens on the x axis and the generated tokens on the y axis;
* ``loss.png``: the training curve;
* ``model.safetensors`` and ``config.json``: the trained model (no pickle), which
  ``attnkit demo --load DIR`` evaluates again;
* ``manifest.json``: the run's id and the SHA-256 of every other file.

The results are written into a new hidden folder beside ``--out`` and swapped in once all are
there, so an interrupted run leaves ``--out`` as it was: never half-written, never one run's
weights next to another run's configuration. A run replaces the folder of an earlier run, and
refuses a folder that holds anything else. ``--load`` checks every file against the manifest.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit

from .._checks import int_arg

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


def _sequences(
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


# --------------------------------------------------------------------------------------------------
# Files: a run writes its results into a new hidden folder next to --out, then swaps it in whole


_UMASK = os.umask(0)
os.umask(_UMASK)

RUN_FORMAT = "attnkit-demo-run/1"
MANIFEST = "manifest.json"
# Every name a run writes. A folder that holds nothing else is an earlier run, which a new run
# replaces; a run never replaces a folder holding anything else.
RESULT_FILES = (
    "config.json",
    "model.safetensors",
    "metrics.json",
    "loss.png",
    "attention.png",
    MANIFEST,
)


def _os_reason(err: OSError) -> str:
    """``Permission denied: 'path'``: an OSError in one line, without the errno."""
    if err.strerror is None:
        return str(err)
    return err.strerror + (f": {os.fspath(err.filename)!r}" if err.filename is not None else "")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_manifest(folder: Path) -> None:
    """List every file in ``folder`` with its SHA-256 under a new run id, in manifest.json.

    Written last: ``--load`` then refuses a folder whose files do not all match it, such as the
    weights of one run next to the configuration of another.
    """
    files = {
        p.name: _sha256(p.read_bytes()) for p in sorted(folder.iterdir()) if p.name != MANIFEST
    }
    manifest = {"format": RUN_FORMAT, "run": uuid.uuid4().hex, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _foreign_files(folder: Path) -> list[str]:
    """What in ``folder`` a run did not write (empty for an earlier run's folder)."""
    return sorted(p.name for p in folder.iterdir() if p.name not in RESULT_FILES)


def _check_replaceable(target: Path, out: Path) -> None:
    """Refuse an ``--out`` that is not a folder, or holds files no run wrote: the run replaces
    the whole folder, and must not take the user's other files with it."""
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        raise ValueError(f"--out {out} is the current folder or holds it; choose another folder")
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    foreign = _foreign_files(target)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"--out {out} holds files attnkit demo does not write ({shown}); a run replaces "
            "the whole folder, so choose a new or empty folder, or one of an earlier run"
        )


def _prepare_out(out: Path) -> tuple[Path, Path]:
    """``(target, staging)``: the folder the run will replace (links followed) and the new
    hidden folder beside it that receives the results."""
    try:
        target = out.resolve()
        _check_replaceable(target, out)
        existing = next(p for p in target.parents if p.exists())  # the root exists
        if not existing.is_dir():  # mkdir would say "File exists"
            raise ValueError(f"--out {out}: {existing} is not a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot write there: {_os_reason(err)}") from None
    return target, Path(staging)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C during the block takes effect when it ends: between the two renames of a swap,
    ``--out`` does not exist. (Python runs signal handlers in the main thread only.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt


def _swap_in(staging: Path, target: Path, out: Path) -> None:
    """Put the finished results at ``target``, replacing the earlier run there if any."""
    # mkdtemp makes 0700 and safetensors writes 0600: results are an ordinary folder and files.
    os.chmod(staging, 0o777 & ~_UMASK)
    for p in staging.iterdir():
        os.chmod(p, 0o666 & ~_UMASK)
    # Checked again: files may have been added during the minutes of training.
    _check_replaceable(target, out)
    with _interrupts_deferred():
        if not os.path.lexists(target):
            os.rename(staging, target)
            return
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)  # the earlier run stays where it was
            raise
        shutil.rmtree(old, ignore_errors=True)


def save_model(model: Seq2Seq, folder: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(model.cfg.to_json(), indent=1) + "\n")


def _read_run(folder: Path, needed: tuple[str, ...]) -> dict[str, bytes]:
    """The contents of the ``needed`` files of the run saved in ``folder``, once every file its
    manifest lists is there with the SHA-256 recorded when the run was written."""
    where = f"--load {folder}"
    manifest_path = folder / MANIFEST
    try:
        if not folder.is_dir():
            raise ValueError(f"{where}: no such folder")
        for name in (*needed, MANIFEST):
            if not (folder / name).is_file():
                raise ValueError(f"{where}: no {name} (was it written by attnkit demo?)")
        raw = manifest_path.read_bytes()
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{manifest_path} is not valid JSON: {err}") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if (
            not isinstance(files, dict)
            or manifest.get("format") != RUN_FORMAT
            or not all(
                n in RESULT_FILES and n != MANIFEST and isinstance(h, str) for n, h in files.items()
            )
        ):
            raise ValueError(f"{manifest_path} is not an attnkit demo manifest ({RUN_FORMAT})")
        contents = {}
        for name, digest in files.items():
            if not (folder / name).is_file():
                raise ValueError(f"{where}: {name}, listed in {MANIFEST}, is missing")
            data = (folder / name).read_bytes()
            if _sha256(data) != digest:
                raise ValueError(
                    f"{where}: {name} is not the file its run wrote (its SHA-256 differs from "
                    f"the one in {MANIFEST}): the folder mixes files of different runs, or {name} "
                    "was changed since"
                )
            contents[name] = data
    except OSError as err:
        raise ValueError(f"{where}: cannot read the run: {_os_reason(err)}") from None
    for name in needed:
        if name not in contents:
            raise ValueError(f"{manifest_path} does not list {name}")
    return {name: contents[name] for name in needed}


def load_model(folder: Path) -> Seq2Seq:
    """The model of the run saved in ``folder``; errors say which file is wrong and how."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    contents = _read_run(folder, ("config.json", "model.safetensors"))
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    try:
        data = json.loads(contents["config.json"])
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from None
    try:
        cfg = DemoConfig.from_json(data, str(config_path))
    except TypeError as err:  # a field of the wrong type reaches the dataclass
        raise ValueError(f"{config_path}: {err}") from None
    try:
        state = load(contents["model.safetensors"])
    except SafetensorError as err:
        raise ValueError(f"{weights_path} is not a readable safetensors file: {err}") from None
    model = Seq2Seq(cfg)
    attnkit.checkpoint.load_state_dict(model, state, source=str(weights_path))
    return model


def plot_loss(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    ax.plot(range(1, len(losses) + 1), losses, lw=0.6, alpha=0.4, label="per step")
    k = max(1, len(losses) // 50)
    smooth = torch.tensor(losses).unfold(0, k, 1).mean(1).tolist() if len(losses) >= k else losses
    ax.plot(range(k, k + len(smooth)), smooth, lw=1.5, label=f"mean of {k}")
    ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title="training loss")
    ax.legend()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def plot_attention(model: Seq2Seq, batch: Batch, path: Path) -> None:
    """Cross-attention heatmaps of one example: a row per decoder layer, a column per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with attnkit.capture_attention(model) as maps:
        generated = greedy_decode(model, batch)[0].tolist()
    n_src = int(batch.src_len[0])
    src = [_token_name(t) for t in batch.src[0, :n_src].tolist()]
    gen = (
        [_token_name(t) for t in generated[: generated.index(EOS) + 1]]
        if EOS in generated
        else [_token_name(t) for t in generated]
    )
    layers = [f"transformer.decoder_layers.{i}.cross_attn" for i in range(model.cfg.layers)]
    heads = model.cfg.heads
    fig, axes = plt.subplots(
        len(layers),
        heads,
        figsize=(2.2 * heads + 1, 2.2 * len(layers) + 0.6),
        squeeze=False,
        layout="constrained",
    )
    for r, name in enumerate(layers):
        w = torch.cat(maps[name], dim=2)[0]  # steps of (1, H, 1, Ts) -> (H, steps, Ts)
        for h in range(heads):
            ax = axes[r][h]
            ax.imshow(w[h, : len(gen), :n_src].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_xticks(range(n_src), src, fontsize=7)
            ax.set_yticks(range(len(gen)), gen, fontsize=7)
            ax.set_title(f"layer {r} head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel("generated")
            if r == len(layers) - 1:
                ax.set_xlabel("source")
    fig.suptitle(f"cross-attention, task {model.cfg.task}")
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def _token_name(t: int) -> str:
    return {PAD: "pad", BOS: "bos", EOS: "eos"}.get(t, str(t - FIRST_SYMBOL))


# --------------------------------------------------------------------------------------------------
# Training and evaluation


def eval_set(cfg: DemoConfig) -> list[list[int]]:
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    return _sequences(cfg, gen, cfg.eval_size, avoid=set(), unique=True)


def evaluate(model: Seq2Seq, seqs: list[list[int]]) -> float:
    model.eval()
    hits = []
    for i in range(0, len(seqs), 256):
        batch = make_batch(model.cfg, seqs[i : i + 256])
        hits.append(exact_match(greedy_decode(model, batch), batch))
    return float(torch.cat(hits).float().mean())


def train(cfg: DemoConfig, *, progress: bool = True) -> tuple[Seq2Seq, list[float], float]:
    """The trained model, its per-step losses, and its training throughput in tokens/s."""
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
    for step in bar:
        batch = make_batch(cfg, _sequences(cfg, gen, cfg.batch_size, avoid=held_out))
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


# --------------------------------------------------------------------------------------------------
# The command


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument(
        "--out",
        type=Path,
        default=Path("attnkit-demo"),
        help="folder for the results (default ./attnkit-demo); a new folder, an empty one, or "
        "that of an earlier run, which the new results replace",
    )
    p.add_argument(
        "--task",
        choices=sorted(TASKS),
        default=d.task,
        help=f"what the model learns to do to its input (default {d.task})",
    )
    p.add_argument(
        "--attention",
        choices=("mha", "relative"),
        default=d.attention,
        help="encoder self-attention: mha (absolute positions) or relative "
        "(Transformer-XL relative positions, as in Conformer); default mha",
    )
    p.add_argument(
        "--steps", type=int_arg, default=d.steps, help=f"training steps (default {d.steps})"
    )
    p.add_argument(
        "--seed",
        type=int_arg,
        default=d.seed,
        help="seed for the weights and the data; a run is deterministic for a seed",
    )
    p.add_argument(
        "--load",
        type=Path,
        metavar="DIR",
        help="evaluate the model saved in DIR instead of training one",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _require_cli_extra() -> None:
    missing = [
        m for m in ("tqdm", "matplotlib", "safetensors") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise RuntimeError(
            f"attnkit demo needs {', '.join(missing)}: install the cli extra, "
            "pip install 'attnkit[cli]'"
        )


def run(args: argparse.Namespace) -> int:
    _require_cli_extra()
    if args.load is not None:
        model = load_model(args.load)
        accuracy = evaluate(model, eval_set(model.cfg))
        print(
            f"{args.load}: task {model.cfg.task}, exact-match accuracy {accuracy:.4f} on "
            f"{model.cfg.eval_size} held-out sequences"
        )
        return 0
    cfg = DemoConfig(task=args.task, attention=args.attention, steps=args.steps, seed=args.seed)
    out: Path = args.out
    target, staging = _prepare_out(out)
    try:
        start = time.perf_counter()
        model, losses, rate = train(cfg, progress=not args.quiet)
        seqs = eval_set(cfg)
        accuracy = evaluate(model, seqs)
        seconds = time.perf_counter() - start
        metrics = {
            "accuracy": accuracy,
            "steps": cfg.steps,
            "seconds": round(seconds, 2),
            "train_tokens_per_second": round(rate),
            "final_loss": losses[-1],
            "eval_size": len(seqs),
            "config": cfg.to_json(),
            "torch": torch.__version__,
            "attnkit": attnkit.__version__,
        }
        save_model(model, staging)
        plot_loss(losses, staging / "loss.png")
        plot_attention(model, make_batch(cfg, seqs[:1]), staging / "attention.png")
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        write_manifest(staging)
        _swap_in(staging, target, out)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot write the results: {_os_reason(err)}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once swapped in
    print(
        f"exact-match accuracy {accuracy:.4f} on {len(seqs)} held-out sequences "
        f"({cfg.task}), {seconds:.0f} s; results in {out}/"
    )
    return 0
