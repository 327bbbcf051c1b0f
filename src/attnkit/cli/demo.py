"""``attnkit demo``: train a small encoder-decoder Transformer of attnkit modules on the CPU.

The task is a synthetic sequence-to-sequence problem (reverse, copy or sort a string of symbols).
Training runs on one thread unless ``--threads`` says otherwise (a model this small gains little
from a second thread, and loses much when another process holds its core), shows a progress bar
and, after the first steps, how long the rest will take; evaluation decodes held-out sequences
greedily, one token at a time through the decoder's KV caches, and reports exact-match accuracy.
The run writes to ``--out``, and lists what it wrote:

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
import importlib.util
import json
import shutil
import time
from pathlib import Path

import torch

import attnkit

from .._base.checks import int_arg
from ._demo_model import TASKS, DemoConfig, eval_set, evaluate, make_batch
from ._demo_plot import plot_attention, plot_loss
from ._demo_run import load_model, os_reason, prepare_out, save_model, swap_in, write_manifest
from ._demo_train import default_threads, threads, train

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
    p.add_argument(
        "--threads",
        type=int_arg,
        metavar="N",
        help="torch threads for the run (default: 1 for a model of this size, which a second "
        "thread does not speed up and a busy machine slows down a lot)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _require_cli_extra() -> None:
    missing = [
        m for m in ("tqdm", "matplotlib", "safetensors") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise RuntimeError(
            f"attnkit demo needs {', '.join(missing)}: install the cli extra, "
            'pip install "attnkit[cli]" (or ".[cli]" from a checkout)'
        )


# What each file of a run holds, as the last lines of a run list them.
_WROTE = {
    "attention.png": "the decoder's cross-attention on one example, every layer and head",
    "loss.png": "the training curve",
    "metrics.json": "accuracy, steps, seconds, throughput and the configuration",
    "model.safetensors": "the trained weights",
    "config.json": "the model's configuration",
    "manifest.json": "the SHA-256 of every other file, checked by --load",
}


def run(args: argparse.Namespace) -> int:
    _require_cli_extra()
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {args.threads}")
    if args.load is not None:
        with threads(args.threads or 1):
            model = load_model(args.load)
            accuracy = evaluate(model, eval_set(model.cfg))
        print(
            f"{args.load}: task {model.cfg.task}, exact-match accuracy {accuracy:.4f} on "
            f"{model.cfg.eval_size} held-out sequences"
        )
        return 0
    cfg = DemoConfig(task=args.task, attention=args.attention, steps=args.steps, seed=args.seed)
    out: Path = args.out
    target, staging = prepare_out(out)
    n_threads = args.threads or default_threads(cfg)
    print(
        f"attnkit demo: trains a Transformer of attnkit modules ({cfg.layers} encoder and "
        f"{cfg.layers} decoder layers, d_model {cfg.d_model}, {cfg.heads} heads) to {cfg.task} "
        f"strings of {cfg.min_len} to {cfg.max_len} symbols: {cfg.steps} steps on "
        f"{n_threads} CPU thread{'s' if n_threads > 1 else ''} (how long that takes is "
        f"printed after the first steps), then decodes {cfg.eval_size} held-out strings and "
        f"writes {out}/",
        flush=True,
    )
    try:
        start = time.perf_counter()
        with threads(n_threads):
            model, losses, rate = train(cfg, progress=not args.quiet, say=print)
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
            "threads": n_threads,
            "torch": torch.__version__,
            "attnkit": attnkit.__version__,
        }
        save_model(model, staging)
        plot_loss(losses, staging / "loss.png")
        with threads(n_threads):
            plot_attention(model, make_batch(cfg, seqs[:1]), staging / "attention.png")
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        write_manifest(staging)
        swap_in(staging, target, out)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot write the results: {os_reason(err)}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once swapped in
    print(
        f"exact-match accuracy {accuracy:.4f} on {len(seqs)} held-out sequences "
        f"({cfg.task}), {seconds:.0f} s. Wrote:"
    )
    width = max(len(str(out / name)) for name in _WROTE)
    for name, what in _WROTE.items():
        print(f"  {out / name!s:<{width}}  {what}")
    print(f"attnkit demo --load {out} evaluates the saved model again.")
    return 0
