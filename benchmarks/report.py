"""Benchmark results (JSON) -> the Markdown tables and matplotlib plots of the benchmarks page.

    python benchmarks/report.py                      # docs/benchmarks/data -> ./benchmark-report
    python benchmarks/report.py DATA_DIR --out DIR   # DIR/benchmarks.md and DIR/plots/*.png

The documentation build calls :func:`build` on ``docs/benchmarks/data`` (see ``docs/_ext/hooks.py``)
and puts each section where ``docs/benchmarks.md`` says ``<!-- benchmarks: NAME -->``, so the page
always shows the JSON files committed next to it. To refresh the figures, rerun the scripts with
``--json docs/benchmarks/data/NAME.json`` and rebuild the docs.

Every ``*.json`` in the folder is one run, in the format of ``benchmarks/results.py``; its
``benchmark`` field says which section it belongs to, and several files may feed one section
(say ``multihead.json`` and ``multihead-causal.json``). A file holding a bare list of rows is the
output of ``attnkit bench --json`` (section ``cli``), which records no machine.

Rows per section (what the scripts write; times in seconds unless the key says ``ms``):

* ``backends`` (bench_backends.py): ``T``, ``candidate``, ``backend``, ``causal``, ``seconds``,
  ``ratio`` (to torch SDPA), ``extra_bytes``.
* ``training`` (bench_training.py): ``B``, ``T``, ``causal``, ``candidate``, ``seconds``, ``ratio``.
* ``masks`` (bench_masks.py): ``case``, ``pass``, ``seconds``, ``baseline``,
  ``baseline_seconds``, ``ratio``, ``extra_bytes``.
* ``native`` (bench_native.py): ``case``, ``pass``, ``candidate``, ``load`` (quiet, busy),
  ``seconds`` (median), ``worst_seconds``, ``rounds``, ``ratio`` (to torch SDPA under the same
  load), ``busy_ratio`` and ``worst_ratio`` (busy median and worst busy round over the quiet
  median, with ``--load both``), ``extra_bytes`` (the native call, with ``--memory``).
* ``multihead`` (bench_multihead.py): ``pass``, ``candidate``, ``seconds``, ``ratio`` (to torch).
* ``relative`` (bench_relative.py): ``what`` (speed, train-speed, load, dropout, memory,
  training), ``candidate``, ``B``, ``T``, ``seconds``, ``ratio`` (speed, train-speed: to
  MultiHeadAttention; ``paired_ratio``, its quartiles ``paired_low`` and ``paired_high`` and
  ``pairs``, from alternating rounds), ``extra_bytes``, ``largest_saved`` (elements),
  ``dropout``, and for load ``quiet_seconds``, ``busy_seconds``, ``busy_worst_seconds``.
* ``ring_cases`` (bench_ring.py --cases): ``case``, ``strategy`` (``*``: explain's pick),
  ``error`` (largest difference from one process), ``sent_forward``, ``sent_backward`` (bytes per
  rank), ``one_shard`` (one shard's k and v, bytes), ``seconds``.
* ``scaling`` (bench_scaling.py): ``world_size``, ``case``, ``strategy``, ``measured_s``,
  ``model_s``, ``model_compute_s``, ``model_links_s``, ``ratio`` (model / measured), ``sent``
  and ``model_sent`` (bytes per rank, both passes).
* ``scaling_model`` (bench_scaling.py --curves, the model alone): ``world_size``, ``case``,
  ``strategy``, ``seconds``, ``compute_s``, ``links_s``, ``exposed_s``, ``sent_mib``, ``steps``.
* ``ring`` (bench_ring.py): ``candidate``, ``causal``, ``seconds``, ``ratio``, ``inputs_mib``,
  ``extra_mib`` (one entry per rank).
* ``gpu`` (gpu_check.py): ``call``, ``T``, ``causal``, ``mode``, ``candidate``, ``ms``, ``ratio``,
  ``baseline`` (the candidate a row's ratio is to: FlexAttention written by hand, or SDPA).
* ``cli`` (attnkit bench --json): ``scenario``, ``candidate``, ``ms``, ``ratio``, ``extra_mib``.
* ``generate`` (bench_generate.py): ``dtype``, ``impl`` (sdpa, attnkit), ``prefill_s``,
  ``generate_s``, ``decode_s`` (generate - prefill), ``prefill_tok_s``, ``decode_tok_s``,
  ``generate_tok_s``, ``prefill_attention_share``, ``decode_attention_share``,
  ``generate_attention_share``, ``rounds``; the last row of a dtype has ``agreement``
  (``first_divergence``, ``row``, ``max_logit_diff``, ``margins``).
* ``auto`` (bench_backends.py --inference): ``T``, ``causal``, ``auto_s``, ``sdpa_s``,
  ``chunked_s``, ``auto_over_best``, ``chosen``, ``avoided_why``.
* ``decode`` (bench_decode.py): ``case``, ``candidate``, ``load``, ``seconds``, ``worst_seconds``,
  ``rounds``, ``baseline``, ``ratio``, ``over_floor`` (decode), ``busy_ratio`` (``--load both``).
* ``front_ends`` (bench_flex.py, bench_flash_api.py): ``api``, ``pass``, ``call``, ``baseline``,
  ``ms``, ``baseline_ms``, ``ratio`` (the median of the per-round ratios), ``ratio_min``,
  ``ratio_max``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

PLOTS = "plots"  # where the page's PNGs go, relative to the page
MIB = 2**20


@dataclass
class Run:
    """One JSON file."""

    name: str  # the file's stem
    benchmark: str
    rows: list[dict[str, Any]]
    command: str | None = None
    date: str | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """Markdown per section, and the PNG files the Markdown links to (``plots/NAME.png``)."""

    sections: dict[str, str]
    images: dict[str, bytes]


def load(data_dir: str | Path) -> list[Run]:
    runs = []
    for path in sorted(Path(data_dir).glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, list):  # attnkit bench --json
            runs.append(Run(path.stem, "cli", data))
            continue
        runs.append(
            Run(
                path.stem,
                data["benchmark"],
                data["rows"],
                data.get("command"),
                data.get("date"),
                data.get("environment", {}),
                data.get("config", {}),
            )
        )
    return runs


# ------------------------------------------------------------------------------------------------
# Formatting


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def _s(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.2f}"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _mib(nbytes: float | None) -> str:
    return "" if nbytes is None else f"{nbytes / MIB:.1f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    align = ["---:" if i in right else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def provenance(run: Run) -> str:
    """Which machine and software produced a run, in one paragraph."""
    env = run.environment
    if not env:
        return f"`{run.name}.json` records no machine or versions."
    where = env.get("gpu") or env.get("cpu", "unknown CPU")
    if not env.get("gpu") and env.get("cpu_features"):
        where += f" ({', '.join(env['cpu_features'])})"
    cores = f"{env.get('cpu_count')} cores, {env.get('torch_threads')} torch threads"
    soft = f"Python {env.get('python')}, torch {env.get('torch')}, attnkit {env.get('attnkit')}"
    text = f"Measured on {where} ({cores}; {env.get('platform')}), {soft}"
    if run.date:
        text += f", {run.date[:10]}"
    if run.command:
        text += f", by `{run.command}`"
    return text + "."


def config_line(run: Run, keys: Sequence[str]) -> str:
    parts = [f"{k}={run.config[k]}" for k in keys if k in run.config]
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------------
# Plots


def _png(fig: plt.Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _bars(labels: Sequence[str], values: Sequence[float], xlabel: str, title: str) -> bytes:
    fig, ax = plt.subplots(figsize=(6.5, 0.35 * len(labels) + 1.2))
    y = range(len(labels))
    bars = ax.barh(list(y), list(values), color="#3f51b5")
    ax.bar_label(bars, [f"{v:.2f}x" for v in values], fontsize=7, padding=2)
    ax.set_yticks(list(y), list(labels), fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    return _png(fig)


# ------------------------------------------------------------------------------------------------
# Sections


def _backends(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    body = table(
        ["T", "candidate", "ms", "ratio to torch sdpa", "extra MiB", "% of one TxT f32"],
        [
            [
                r["T"],
                r["candidate"],
                _ms(r["seconds"]),
                _ratio(r["ratio"]),
                _mib(r.get("extra_bytes")),
                ""
                if r.get("extra_bytes") is None
                else f"{100 * r['extra_bytes'] / (4 * r['T'] ** 2):.1f}",
            ]
            for r in rows
        ],
        right=(0, 2, 3, 4, 5),
    )
    # Time as a ratio to torch SDPA at the same T: in seconds, every candidate grows as T^2 and
    # the lines of the backends within a few percent of torch lie on top of one another.
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    # One colour and line style per candidate, the same in both panels.
    candidates = [b for b in dict.fromkeys(r["backend"] for r in rows) if b != "torch sdpa"]
    styles = dict(zip(candidates, ["o-", "s--", "^-.", "D:", "v-", "P--"] * 4, strict=False))
    colours = dict(zip(candidates, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, causal in zip(axes, (False, True), strict=True):
        ax.axhline(1.0, color="black", linewidth=0.8, label="torch sdpa")
        for cand in candidates:
            pts = [
                (r["T"], r["ratio"]) for r in rows if r["backend"] == cand and r["causal"] == causal
            ]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), styles[cand], color=colours[cand], label=cand, ms=5
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title("causal" if causal else "no mask", fontsize=10)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("time / torch sdpa (lower is better)")
    images[f"{run.name}-time.png"] = _png(fig)
    measured = [r for r in rows if r.get("extra_bytes") is not None]
    text = f"![time against T]({PLOTS}/{run.name}-time.png)\n\n"
    if measured:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for cand in dict.fromkeys(r["candidate"] for r in measured):
            pts = [
                (r["T"], max(r["extra_bytes"], 1) / MIB) for r in measured if r["candidate"] == cand
            ]
            ax.plot(*zip(*pts, strict=True), marker="o", label=cand)
        ts = sorted({r["T"] for r in measured})
        ax.plot(
            ts, [4 * t * t / MIB for t in ts], color="black", linestyle="--", label="one TxT f32"
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("extra peak memory, MiB")
        ax.legend(fontsize=7, ncol=2)
        images[f"{run.name}-memory.png"] = _png(fig)
        text += f"![memory against T]({PLOTS}/{run.name}-memory.png)\n\n"
    return text + body


def _training(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    labels = [
        f"B={r['B']} T={r['T']}{' causal' if r['causal'] else ''}: {r['candidate']}" for r in rows
    ]
    images[f"{run.name}.png"] = _bars(
        labels, [r["ratio"] for r in rows], "time / torch SDPA", "forward + backward"
    )
    body = table(
        ["B", "T", "causal", "candidate", "ms", "ratio to torch sdpa"],
        [
            [r["B"], r["T"], r["causal"], r["candidate"], _ms(r["seconds"]), _ratio(r["ratio"])]
            for r in rows
        ],
        right=(0, 1, 4, 5),
    )
    return f"![training step ratios]({PLOTS}/{run.name}.png)\n\n{body}"


def _masks(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    # Each case has its own baseline: the bar says which.
    labels = [f"{r['case']} ({r['pass']}) vs {r['baseline']}" for r in rows]
    images[f"{run.name}.png"] = _bars(
        labels,
        [r["ratio"] for r in rows],
        "attnkit time / the time of the baseline named on its bar (lower is better)",
        "",
    )
    body = table(
        ["case", "pass", "attnkit ms", "baseline", "baseline ms", "ratio", "attnkit extra MiB"],
        [
            [
                r["case"],
                r["pass"],
                _ms(r["seconds"]),
                r["baseline"],
                _ms(r["baseline_seconds"]),
                _ratio(r["ratio"]),
                _mib(r.get("extra_bytes")),
            ]
            for r in rows
        ],
        right=(2, 4, 5, 6),
    )
    return f"![structured mask ratios]({PLOTS}/{run.name}.png)\n\n{body}"


def _multihead(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    labels = [f"{r['pass']}: {r['candidate']}" for r in rows]
    images[f"{run.name}.png"] = _bars(
        labels, [r["ratio"] for r in rows], "time / torch's module", ""
    )
    body = table(
        ["pass", "candidate", "ms", "ratio to torch"],
        [[r["pass"], r["candidate"], _ms(r["seconds"]), _ratio(r["ratio"])] for r in rows],
        right=(2, 3),
    )
    fast = run.config.get("torch_fast_path")
    note = "" if fast is None else f"\n\ntorch's module took its native fast path: {fast}."
    return f"![MultiHeadAttention ratios]({PLOTS}/{run.name}.png)\n\n{body}{note}"


def _native(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    busy = any(r.get("busy_ratio") is not None for r in rows)
    dtypes = any("dtype" in r for r in rows)  # runs of several dtypes name each row's
    headers = ["case", "pass", "candidate", *(["dtype"] if dtypes else []), "load", "median ms"]
    headers += ["worst ms", "ratio to sdpa"]
    if dtypes:
        headers.append("/ float32")
    if busy:
        headers += ["busy / quiet", "worst busy / quiet"]
    headers.append("extra MiB")
    body = table(
        headers,
        [
            [
                r["case"],
                r["pass"],
                r["candidate"],
                *([r.get("dtype", "float32")] if dtypes else []),
                r["load"],
                _ms(r["seconds"]),
                _ms(r["worst_seconds"]),
                _ratio(r["ratio"]),
                *([_ratio(r.get("over_float32"))] if dtypes else []),
                *([_ratio(r.get("busy_ratio")), _ratio(r.get("worst_ratio"))] if busy else []),
                _mib(r.get("extra_bytes")),
            ]
            for r in rows
        ],
        right=tuple(range(5 if dtypes else 4, len(headers))),
    )
    load = run.config.get("loadavg")
    note = "" if load is None else f"\n\nLoad average (1 min) at the start and the end: {load}."
    return f"{body}{note}"


def _decode(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    busy = any(r.get("busy_ratio") is not None for r in rows)
    headers = ["case", "candidate", "dtype", "load", "median ms", "worst ms", "/ floor", "/ base"]
    headers += ["/ float32", *(["busy / quiet"] if busy else [])]
    body = table(
        headers,
        [
            [
                r["case"],
                r["candidate"],
                r.get("dtype", "float32"),
                r["load"],
                _ms(r["seconds"]),
                _ms(r["worst_seconds"]),
                _ratio(r.get("over_floor")),
                _ratio(r["ratio"]),
                _ratio(r.get("over_float32")),
                *([_ratio(r.get("busy_ratio"))] if busy else []),
            ]
            for r in rows
        ],
        right=tuple(range(4, len(headers))),
    )
    note = (
        '\n\n"/ floor": over the time to read the keys and values once (`x.sum()` over as many '
        'bytes); "/ base": over torch SDPA (decode, steps), the contiguous cache (kvcache), '
        "KVCache (modules) or the module written out with torch (steps' module) in the same "
        'dtype; "/ float32": over the same candidate in float32. A steps row times 64 decode '
        "steps of a growing cache."
    )
    load = run.config.get("loadavg")
    if load is not None:
        note += f" Load average (1 min) at the start and the end: {load}."
    return f"{body}{note}"


def _auto(run: Run, images: dict[str, bytes]) -> str:
    return table(
        ["dtype", "case", "size", "sdpa ms", "chunked ms", "chunked / sdpa"],
        [
            [
                r["dtype"],
                r["case"],
                r["size"],
                _ms(r["sdpa_seconds"]),
                _ms(r["chunked_seconds"]),
                _ratio(r["ratio"]),
            ]
            for r in run.rows
        ],
        right=(3, 4, 5),
    )


# The paired ratio of a relative row (see bench_relative.paired_ratios): blank for data without.
_PAIRED = ("paired ratio", "its quartiles")


def _paired(row: dict[str, Any]) -> list[str]:
    if "paired_ratio" not in row:
        return ["", ""]
    return [_ratio(row["paired_ratio"]), f"{row['paired_low']:.2f}-{row['paired_high']:.2f}"]


def _relative(run: Run, images: dict[str, bytes]) -> str:
    parts = []
    speed = [r for r in run.rows if r["what"] == "speed"]
    if speed:
        images[f"{run.name}-speed.png"] = _bars(
            [r["candidate"] for r in speed],
            [r["ratio"] for r in speed],
            "time / MultiHeadAttention",
            f"forward, B={speed[0]['B']} T={speed[0]['T']}, inference",
        )
        parts.append(f"![relative attention speed]({PLOTS}/{run.name}-speed.png)")
        parts.append(
            table(
                ["forward (inference)", "B", "T", "ms", "ratio to MultiHeadAttention", *_PAIRED],
                [
                    [
                        r["candidate"],
                        r["B"],
                        r["T"],
                        _ms(r["seconds"]),
                        _ratio(r["ratio"]),
                        *_paired(r),
                    ]
                    for r in speed
                ],
                right=(1, 2, 3, 4, 5, 6),
            )
        )
    steps = [r for r in run.rows if r["what"] == "train-speed"]
    if steps:
        parts.append(
            table(
                [
                    "training step (forward + backward)",
                    "B",
                    "T",
                    "ms",
                    "ratio to MultiHeadAttention",
                    *_PAIRED,
                ],
                [
                    [
                        r["candidate"],
                        r["B"],
                        r["T"],
                        _ms(r["seconds"]),
                        _ratio(r["ratio"]),
                        *_paired(r),
                    ]
                    for r in steps
                ],
                right=(1, 2, 3, 4, 5, 6),
            )
        )
    busy = [r for r in run.rows if r["what"] == "load"]
    if busy:
        parts.append(
            table(
                [
                    "forward, one core busy",
                    "B",
                    "T",
                    "quiet ms",
                    "busy median ms",
                    "busy / quiet",
                    "worst busy round / quiet",
                ],
                [
                    [
                        r["candidate"],
                        r["B"],
                        r["T"],
                        _ms(r["quiet_seconds"]),
                        _ms(r["busy_seconds"]),
                        _ratio(r["busy_seconds"] / r["quiet_seconds"]),
                        _ratio(r["busy_worst_seconds"] / r["quiet_seconds"]),
                    ]
                    for r in busy
                ],
                right=(1, 2, 3, 4, 5, 6),
            )
        )
    drops = [r for r in run.rows if r["what"] == "dropout"]
    if drops:
        none = next((r for r in drops if r["dropout"] == 0.0), drops[0])
        parts.append(
            table(
                [
                    "training step",
                    "dropout",
                    "T",
                    "s",
                    "/ no dropout",
                    "extra peak MiB",
                    "/ no dropout",
                ],
                [
                    [
                        r["candidate"],
                        r["dropout"],
                        r["T"],
                        _s(r["seconds"]),
                        _ratio(r["seconds"] / none["seconds"]),
                        _mib(r.get("extra_bytes")),
                        ""
                        if not r.get("extra_bytes") or not none.get("extra_bytes")
                        else _ratio(r["extra_bytes"] / none["extra_bytes"]),
                    ]
                    for r in drops
                ],
                right=(1, 2, 3, 4, 5, 6),
            )
        )
    rest = [r for r in run.rows if r["what"] in ("memory", "training")]
    if rest:
        parts.append(
            table(
                [
                    "measurement",
                    "candidate",
                    "T",
                    "s",
                    "extra peak MiB",
                    "largest saved MiB",
                    "one (T, T) f32 MiB",
                ],
                [
                    [
                        "inference" if r["what"] == "memory" else "training step",
                        r["candidate"],
                        r["T"],
                        _s(r["seconds"]),
                        _mib(r.get("extra_bytes")),
                        "" if r.get("largest_saved") is None else _mib(4 * r["largest_saved"]),
                        _mib(4 * r["T"] ** 2),
                    ]
                    for r in rest
                ],
                right=(2, 3, 4, 5, 6),
            )
        )
    return "\n\n".join(parts)


def _ring(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    images[f"{run.name}.png"] = _bars(
        [r["candidate"] for r in rows],
        [r["ratio"] if r.get("ratio") is not None else math.nan for r in rows],
        "time / one process, first baseline",
        "backward" if run.config.get("backward") else "forward",
    )
    body = table(
        ["candidate", "s", "ratio", "inputs MiB per rank", "extra MiB per rank"],
        [
            [
                r["candidate"],
                _s(r["seconds"]),
                _ratio(r.get("ratio")),
                f"{r['inputs_mib']:.1f}",
                ", ".join(f"{e:.1f}" for e in r["extra_mib"]),
            ]
            for r in rows
        ],
        right=(1, 2, 3),
    )
    return f"![ring attention]({PLOTS}/{run.name}.png)\n\n{body}"


def _ring_cases(run: Run, images: dict[str, bytes]) -> str:
    one = run.rows[0]["one_shard"] if run.rows else 0
    body = table(
        ["case", "strategy", "largest error", "s (slowest rank)", "MiB sent per rank, forward",
         "backward", "forward / one shard's k, v"],
        [
            [r["case"], r["strategy"], f"{r['error']:.1e}", _s(r["seconds"]),
             ", ".join(f"{b / MIB:.2f}" for b in r["sent_forward"]),
             ", ".join(f"{b / MIB:.2f}" for b in r["sent_backward"]),
             _ratio(max(r["sent_forward"]) / one) if one else ""]
            for r in run.rows
        ],
        right=(2, 3, 6),
    )  # fmt: skip
    return (
        f"One shard's k and v: {one / MIB:.2f} MiB. `*`: the strategy "
        "`attnkit.distributed.explain` picks (fewest bytes per rank).\n\n" + body
    )


def _scaling(run: Run, images: dict[str, bytes]) -> str:
    cfg = run.config
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    for name, marker in (("ring", "o"), ("ulysses", "s")):
        mine = [r for r in run.rows if r["strategy"] == name]
        ax.scatter([r["measured_s"] for r in mine], [r["model_s"] for r in mine], marker=marker,
                   label=name)  # fmt: skip
    values = [v for r in run.rows for v in (r["measured_s"], r["model_s"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured s (slowest rank)")
    ax.set_ylabel("modelled s")
    ax.set_title(f"{cfg.get('world_size')} ranks, forward + backward", fontsize=10)
    ax.legend(fontsize=8)
    images[f"{run.name}.png"] = _png(fig)
    body = table(
        ["case", "strategy", "measured s", "modelled s", "model / measured", "model: compute s",
         "model: links s", "MiB sent, most", "bytes = model"],
        [
            [r["case"], r["strategy"], _s(r["measured_s"]), _s(r["model_s"]), _ratio(r["ratio"]),
             _s(r["model_compute_s"]), f"{r['model_links_s']:.3f}", f"{max(r['sent']) / MIB:.2f}",
             "yes" if r["sent"] == r["model_sent"] else "no"]
            for r in run.rows
        ],
        right=(2, 3, 4, 5, 6, 7),
    )  # fmt: skip
    link = (
        f"Measured for the model: a ring step's link {cfg['link_bandwidth'] / 1e9:.2f} GB/s and "
        f"{cfg['link_latency'] * 1e6:.0f} us a message, attention {cfg['flops'] / 1e9:.1f} "
        f"GFLOP/s per rank, {cfg.get('overhead', 0) * 1e3:.1f} ms a pass on the host, every "
        "rank busy at once."
    )
    return f"{link}\n\n![model against measurement]({PLOTS}/{run.name}.png)\n\n{body}"


def _curves(run: Run, key: str, ylabel: str, scale: float) -> bytes:
    cases = list(dict.fromkeys(r["case"] for r in run.rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(3.4 * len(cases), 3.2))
    for ax, case in zip(axes, cases, strict=True):
        for name, style in (("ring", "-o"), ("ulysses", "-s"), ("hybrid", "-^")):
            mine = [r for r in run.rows if r["case"] == case and r["strategy"] == name]
            if mine:
                ax.plot([r["world_size"] for r in mine], [r[key] * scale for r in mine], style,
                        markersize=3, label=name)  # fmt: skip
        if key == "seconds":
            mine = [r for r in run.rows if r["case"] == case and r["strategy"] == "ring"]
            ax.plot([r["world_size"] for r in mine], [r["compute_s"] * scale for r in mine], ":",
                    color="grey", label="arithmetic")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("ranks")
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def _scaling_model(run: Run, images: dict[str, bytes]) -> str:
    cfg = run.config
    images[f"{run.name}-time.png"] = _curves(run, "seconds", "modelled ms per call", 1e3)
    images[f"{run.name}-bytes.png"] = _curves(run, "sent_mib", "MiB sent by a rank", 1.0)
    hw = cfg.get("hardware", {})
    where = (
        f"{hw.get('name')}: {hw.get('flops', 0) / 1e12:.0f} TFLOP/s per rank, "
        f"{hw.get('local', {}).get('bandwidth', 0) / 1e9:.0f} GB/s within a node of "
        f"{hw.get('ranks_per_node')}, {hw.get('remote', {}).get('bandwidth', 0) / 1e9:.0f} GB/s "
        "between nodes"
    )
    worlds = sorted({r["world_size"] for r in run.rows})
    most = max(worlds)
    body = table(
        ["case", "strategy", f"ms at {min(worlds)} ranks", f"ms at {most} ranks",
         f"MiB sent at {most}", f"steps at {most}"],
        [
            [case, name, f"{lo['seconds'] * 1e3:.2f}", f"{hi['seconds'] * 1e3:.2f}",
             f"{hi['sent_mib']:.0f}", hi["steps"]]
            for case in dict.fromkeys(r["case"] for r in run.rows)
            for name in ("ring", "ulysses", "hybrid")
            for lo, hi in [(
                next((r for r in run.rows if (r["case"], r["strategy"]) == (case, name)), None),
                next((r for r in run.rows[::-1] if (r["case"], r["strategy"]) == (case, name)),
                     None),
            )]
            if lo is not None and hi is not None
        ],
        right=(2, 3, 4, 5),
    )  # fmt: skip
    return (
        f"Modelled, not measured: every rank holds {cfg.get('shard')} tokens, H={cfg.get('H')}, "
        f"Hkv={cfg.get('Hkv')}, D={cfg.get('D')}, {cfg.get('dtype')}, forward and backward, on "
        f"{where}.\n\n"
        f"![modelled time per call]({PLOTS}/{run.name}-time.png)\n\n"
        f"![modelled bytes per rank]({PLOTS}/{run.name}-bytes.png)\n\n{body}"
    )


def _front_ends(run: Run, images: dict[str, bytes]) -> str:
    body = table(
        ["pass", "call", "against", "ms", "against ms", "ratio", "range"],
        [
            [
                r["pass"],
                r["call"],
                r["baseline"],
                f"{r['ms']:.2f}",
                f"{r['baseline_ms']:.2f}",
                _ratio(r["ratio"]),
                f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
            ]
            for r in run.rows
        ],
        right=(3, 4, 5, 6),
    )
    extra = run.config.get("extra_mib") or {}
    note = ""
    if extra:
        parts = ", ".join(f"{name} {mib:.0f} MiB" for name, mib in extra.items())
        note = f"\n\nExtra peak memory of flex's forward+backward: {parts}."
    return f"{body}{note}"


def _gpu(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    failures = run.config.get("failures", [])
    body = table(
        ["call", "T", "pass", "candidate", "ms", "ratio", "to"],
        [
            [
                r.get("call", "causal" if r["causal"] else "plain"),
                r["T"],
                r["mode"],
                r["candidate"],
                f"{r['ms']:.3f}",
                _ratio(r["ratio"]),
                r.get("baseline", r["candidate"]),
            ]
            for r in rows
        ],
        right=(1, 4, 5),
    )
    checks = f"{len(failures)} failed correctness checks" + (
        ": " + ", ".join(failures) if failures else ""
    )
    return f"{checks}.\n\n{body}"


def _cli(run: Run, images: dict[str, bytes]) -> str:
    return table(
        ["scenario", "candidate", "ms", "ratio", "extra MiB"],
        [
            [
                r["scenario"],
                r["candidate"],
                f"{r['ms']:.2f}",
                _ratio(r["ratio"]),
                "" if r["extra_mib"] is None else f"{r['extra_mib']:.1f}",
            ]
            for r in run.rows
        ],
        right=(2, 3, 4),
    )


def _policy(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    return table(
        ["call", "with the checks (ms)", "without (ms)", "ratio", "the checks alone"],
        [
            [
                r["call"],
                _ms(r["with"]),
                _ms(r["without"]),
                _ratio(r.get("ratio", r["with"] / r["without"])),
                f"{r['check_alone'] * 1e6:.1f} us" if "check_alone" in r else "",
            ]
            for r in rows
        ],
        right=(1, 2, 3, 4),
    )


def _sharing(run: Run, images: dict[str, bytes]) -> str:
    return table(
        ["ATTNKIT_SHARE", "load", "T", "1 thread (ms)", "2 threads (ms)", "2 / 1"],
        [
            [
                r["way"],
                r["load"],
                str(r["T"]),
                _ms(r["one_thread"]),
                _ms(r["two_threads"]),
                _ratio(r["ratio"]),
            ]
            for r in run.rows
        ],
        right=(2, 3, 4, 5),
    )


def _long_audio(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for module in sorted({r["module"] for r in rows}):
        mine = [r for r in rows if r["module"] == module]
        ts = [r["T"] for r in mine]
        axes[0].plot(ts, [r["seconds"] for r in mine], marker="o", label=module)
        if all(r.get("extra_bytes") is not None for r in mine):
            axes[1].plot(ts, [r["extra_bytes"] / 2**20 for r in mine], marker="o", label=module)
    axes[0].set(xlabel="frames (40 ms each)", ylabel="seconds", title="forward time")
    axes[1].set(xlabel="frames (40 ms each)", ylabel="MiB", title="extra peak memory")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    images[f"{run.name}.png"] = _png(fig)
    body = table(
        ["module", "frames", "audio", "seconds", "extra MiB"],
        [
            [r["module"], str(r["T"]), f"{r['T'] * 0.04 / 60:.0f} min", _s(r["seconds"]),
             _mib(r.get("extra_bytes"))]
            for r in rows
        ],
        right=(1, 2, 3, 4),
    )  # fmt: skip
    return f"![long audio]({PLOTS}/{run.name}.png)\n\n{body}"


def _transformers(run: Run, images: dict[str, bytes]) -> str:
    timed = [r for r in run.rows if r.get("seconds") is not None]
    sdpa = {(r["T"], r["padding"]): r["seconds"] for r in timed if r["impl"] == "sdpa"}
    body = table(
        ["T", "padding", "attention", "forward (ms)", "/ sdpa", "extra MiB"],
        [
            [str(r["T"]), "yes" if r["padding"] else "no", r["impl"], _ms(r["seconds"]),
             _ratio(r["seconds"] / sdpa[r["T"], r["padding"]]), _mib(r.get("extra_bytes"))]
            for r in timed
        ],
        right=(0, 3, 4, 5),
    )  # fmt: skip
    memory = [r for r in run.rows if r.get("seconds") is None]
    if memory:
        mem = {r["impl"]: r["extra_bytes"] for r in memory}
        t = memory[0]["T"]
        body += (
            f"\n\nExtra peak memory of one forward at T={t} with padding: sdpa {_mib(mem['sdpa'])} "
            f"MiB, attnkit {_mib(mem['attnkit'])} MiB ({mem['attnkit'] / mem['sdpa']:.2f}x sdpa)."
        )
    return body


def _floor(run: Run, images: dict[str, bytes]) -> str:
    rows = run.rows
    rate = rows[0]["gemm_flops_per_second"] / 1e9 if rows else 0.0
    body = table(
        ["case", "pass", "visited / visible pairs", "floor (ms)", "native (ms)", "sdpa (ms)",
         "native / floor", "sdpa / floor", "floor / sdpa"],
        [
            [r["case"], r["pass"], f"{r['visited_pairs'] / r['visible_pairs']:.3f}",
             _ms(r["floor_seconds"]), _ms(r["native_seconds"]), _ms(r["sdpa_seconds"]),
             _ratio(r["native_over_floor"]), _ratio(r["sdpa_over_floor"]),
             _ratio(r["floor_over_sdpa"])]
            for r in rows
        ],
        right=(2, 3, 4, 5, 6, 7, 8),
    )  # fmt: skip
    return f"GEMM rate at the native kernel's block shape: {rate:.0f} GFLOP/s.\n\n{body}"


def _compile(run: Run, images: dict[str, bytes]) -> str:
    return table(
        ["T", "pass", "eager (ms)", "compiled (ms)", "compiled / eager", "eager extra MiB",
         "compiled extra MiB", "compiled / eager"],
        [
            [r["T"], r["pass"], _ms(r["eager_s"]), _ms(r["compiled_s"]), _ratio(r["time_ratio"]),
             _mib(r["eager_bytes"]), _mib(r["compiled_bytes"]),
             _ratio(r["compiled_bytes"] / max(r["eager_bytes"], 1))
             if r["compiled_bytes"] is not None and r["eager_bytes"] is not None else ""]
            for r in run.rows
        ],
        right=(0, 2, 3, 4, 5, 6, 7),
    )  # fmt: skip


def _compile_training(run: Run, images: dict[str, bytes]) -> str:
    return table(
        ["module", "eager (ms)", "compiled (ms)", "compiled / eager"],
        [
            [r["module"], _ms(r["eager_s"]), _ms(r["compiled_s"]), _ratio(r["time_ratio"])]
            for r in run.rows
        ],
        right=(1, 2, 3),
    )


def _generate(run: Run, images: dict[str, bytes]) -> str:
    sdpa = {r["dtype"]: r for r in run.rows if r["impl"] == "sdpa"}
    body = table(
        ["dtype", "attention", "prefill tok/s", "/ sdpa", "decode tok/s", "/ sdpa",
         "generate tok/s", "/ sdpa", "prefill in attention", "decode in attention"],
        [
            [r["dtype"], r["impl"], f"{r['prefill_tok_s']:.0f}",
             _ratio(r["prefill_tok_s"] / sdpa[r["dtype"]]["prefill_tok_s"]),
             f"{r['decode_tok_s']:.1f}",
             _ratio(r["decode_tok_s"] / sdpa[r["dtype"]]["decode_tok_s"]),
             f"{r['generate_tok_s']:.1f}",
             _ratio(r["generate_tok_s"] / sdpa[r["dtype"]]["generate_tok_s"]),
             f"{100 * r['prefill_attention_share']:.0f}%",
             f"{100 * r['decode_attention_share']:.0f}%"]
            for r in run.rows
        ],
        right=(2, 3, 4, 5, 6, 7, 8, 9),
    )  # fmt: skip
    notes = []
    for r in run.rows:
        check = r.get("agreement")
        if check is None:
            continue
        if check["first_divergence"] is None:
            notes.append(
                f"{r['dtype']}: attnkit's greedy tokens are sdpa's at every step (largest logit "
                f"difference {check['max_logit_diff']:.1e})."
            )
        else:
            margins = ", ".join(f"{k} {v:+.3f}" for k, v in check["margins"].items())
            notes.append(
                f"{r['dtype']}: the greedy tokens first differ at step {check['first_divergence']} "
                f"(batch row {check['row']}); the largest logit difference until then is "
                f"{check['max_logit_diff']:.1e}, and at that step each run's logit of attnkit's "
                f"token minus that of sdpa's is {margins}."
            )
    return body + "".join(f"\n\n{n}" for n in notes)


def _auto_inference(run: Run, images: dict[str, bytes]) -> str:
    body = table(
        ["T", "causal", "auto (ms)", "sdpa (ms)", "chunked (ms)", "auto / faster", "auto picks",
         "why not the other"],
        [
            [r["T"], "yes" if r["causal"] else "no", _ms(r["auto_s"]), _ms(r["sdpa_s"]),
             _ms(r["chunked_s"]), _ratio(r["auto_over_best"]), r["chosen"], r["avoided_why"]]
            for r in run.rows
        ],
        right=(0, 2, 3, 4, 5),
    )  # fmt: skip
    worst = max(run.rows, key=lambda r: r["auto_over_best"])
    return (
        f"{body}\n\nLargest auto / faster: {worst['auto_over_best']:.2f} (T={worst['T']}"
        f"{', causal' if worst['causal'] else ''})."
    )


def _indices(run: Run, images: dict[str, bytes]) -> str:
    return table(
        ["pass", "gathered (s)", "dense over k (s)", "bool mask (s)", "gathered / dense over k",
         "gathered / bool mask"],
        [
            [r["pass"], _s(r["gathered_seconds"]), _s(r["dense_k_seconds"]),
             _s(r["bool_mask_seconds"]), _ratio(r["over_dense_k"]), _ratio(r["over_bool_mask"])]
            for r in run.rows
        ],
        right=(1, 2, 3, 4, 5),
    )  # fmt: skip


def _mla(run: Run, images: dict[str, bytes]) -> str:
    body = table(
        ["candidate", "ms", "multiply-adds (G)", "MB read", "GFLOP/s"],
        [
            [r["candidate"], _ms(r["seconds"]), f"{r['multiply_adds'] / 1e9:.3f}",
             f"{r['bytes_read'] / 1e6:.1f}", f"{r['flops_per_second'] / 1e9:.0f}"]
            for r in run.rows
        ],
        right=(1, 2, 3, 4),
    )  # fmt: skip
    conf = run.config
    return (
        f"{body}\n\nabsorbed / expanded time: {conf['absorbed_over_expanded']:.2f}x; the "
        f"absorbed step's rate / the matrix product's: {conf['absorbed_of_matmul']:.2f}."
    )


def _cache_memory(run: Run, images: dict[str, bytes]) -> str:
    body = table(
        ["case", "4 KiB pages (ms)", "huge pages (ms)", "huge / 4 KiB"],
        [
            [r["case"], _ms(r["plain_seconds"]), _ms(r["huge_seconds"]),
             _ratio(r["huge_seconds"] / r["plain_seconds"])]
            for r in run.rows
        ],
        right=(1, 2, 3),
    )  # fmt: skip
    ratios = "; ".join(f"{k}: {v:.2f}x" for k, v in run.config["ratios"].items())
    return f"{body}\n\n{ratios}."


SECTIONS: dict[str, tuple[Callable[[Run, dict[str, bytes]], str], Sequence[str], str]] = {
    # name: (renderer, config keys worth a line, the command that produces it)
    "backends": (
        _backends,
        ("B", "H", "D", "dtype", "pass"),
        "python benchmarks/bench_backends.py",
    ),
    "training": (_training, ("H", "D", "dtype"), "python benchmarks/bench_training.py"),
    "masks": (_masks, ("H", "D", "dtype"), "python benchmarks/bench_masks.py"),
    "native": (
        _native,
        ("H", "D", "dtype", "threads", "rounds", "load"),
        "python benchmarks/bench_native.py",
    ),
    "decode": (
        _decode,
        ("B", "H", "Hkv", "D", "T", "dtype", "threads", "rounds", "load"),
        "python benchmarks/bench_decode.py",
    ),
    "auto": (_auto, ("threads", "rounds"), "python benchmarks/bench_auto.py"),
    "floor": (_floor, ("H", "D", "threads"), "python benchmarks/bench_floor.py"),
    "compile": (
        _compile,
        ("B", "H", "D", "window", "dtype"),
        "python benchmarks/bench_compile.py",
    ),
    "compile_training": (
        _compile_training,
        ("B", "T", "d_model", "H", "mask"),
        "python benchmarks/bench_compile.py --training",
    ),
    "multihead": (
        _multihead,
        ("B", "T", "D", "H", "dtype", "causal"),
        "python benchmarks/bench_multihead.py",
    ),
    "relative": (_relative, ("D", "H", "dtype"), "python benchmarks/bench_relative.py"),
    "ring": (
        _ring,
        ("world_size", "threads", "T", "B", "H", "D", "dtype", "backward", "device"),
        "torchrun --standalone --nproc-per-node 2 benchmarks/bench_ring.py",
    ),
    "ring_cases": (
        _ring_cases,
        ("world_size", "threads", "T", "shard", "H", "D", "dtype", "backward", "device"),
        "torchrun --standalone --nproc-per-node 4 benchmarks/bench_ring.py --cases --backward",
    ),
    "scaling": (
        _scaling,
        ("world_size", "threads", "T", "shard", "H", "D", "dtype", "backward", "device"),
        "torchrun --standalone --nproc-per-node 4 benchmarks/bench_scaling.py",
    ),
    "scaling_model": (_scaling_model, (), "python benchmarks/bench_scaling.py --curves"),
    "policy": (_policy, ("threads",), "python benchmarks/bench_policy.py"),
    "sharing": (_sharing, ("B", "H", "D", "dtype", "rounds"), "python benchmarks/bench_sharing.py"),
    "long_audio": (
        _long_audio,
        ("B", "D", "H", "context", "dtype"),
        "python benchmarks/bench_long_audio.py",
    ),
    "transformers": (
        _transformers,
        ("layers", "hidden", "H", "Hkv", "dtype", "transformers"),
        "python benchmarks/bench_transformers.py",
    ),
    "generate": (
        _generate,
        ("B", "prompt", "new", "layers", "hidden", "H", "Hkv", "cache", "transformers"),
        "python benchmarks/bench_generate.py",
    ),
    "auto_inference": (
        _auto_inference,
        ("B", "H", "D", "dtype", "pass"),
        "python benchmarks/bench_backends.py --inference",
    ),
    "front_ends": (
        _front_ends,
        ("B", "H", "T", "D", "dtype", "threads", "rounds", "load"),
        "python benchmarks/bench_flex.py",
    ),
    "indices": (
        _indices,
        ("Tq", "Tk", "k", "H", "D", "dtype", "clock"),
        "python benchmarks/bench_indices.py --threads 1",
    ),
    "mla": (
        _mla,
        ("B", "H", "R", "Dr", "Tk", "dtype", "threads", "load"),
        "python benchmarks/bench_mla.py",
    ),
    "cache_memory": (
        _cache_memory,
        ("B", "Tk", "threads", "load"),
        "python benchmarks/bench_cache_memory.py",
    ),
    "gpu": (_gpu, ("B", "H", "D", "dtype"), "python benchmarks/gpu_check.py"),
    "cli": (_cli, (), "attnkit bench --json"),
}


def build(data_dir: str | Path) -> Report:
    """Every section's Markdown, and the PNGs it links to, from the JSON files in ``data_dir``."""
    runs = load(data_dir)
    sections: dict[str, str] = {}
    images: dict[str, bytes] = {}
    for name, (render, keys, command) in SECTIONS.items():
        mine = [r for r in runs if r.benchmark == name]
        if not mine:
            sections[name] = (
                f"No results yet: run `{command} --json docs/benchmarks/data/{name}.json` "
                "and rebuild the docs."
            )
            continue
        parts = []
        for run in mine:
            head = provenance(run)
            if run.config.get("modelled"):
                head = head.replace("Measured on", "Computed (a model: nothing measured) on", 1)
            conf = config_line(run, keys)
            if conf:
                head += f" Fixed sizes: {conf}."
            parts.append(f"{head}\n\n{render(run, images)}")
        sections[name] = "\n\n".join(parts)
    unknown = sorted({r.benchmark for r in runs} - set(SECTIONS))
    if unknown:
        raise ValueError(f"{data_dir}: no section for benchmark(s) {', '.join(unknown)}")
    return Report(sections, images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "data", nargs="?", default="docs/benchmarks/data", help="folder of JSON files"
    )
    parser.add_argument(
        "--out", default="benchmark-report", help="folder for benchmarks.md and plots/"
    )
    args = parser.parse_args()
    report = build(args.data)
    out = Path(args.out)
    (out / PLOTS).mkdir(parents=True, exist_ok=True)
    for name, png in report.images.items():
        (out / PLOTS / name).write_bytes(png)
    text = "\n\n".join(f"## {name}\n\n{body}" for name, body in report.sections.items())
    (out / "benchmarks.md").write_text(f"# Benchmarks\n\n{text}\n")
    print(f"wrote {out / 'benchmarks.md'} and {len(report.images)} plots in {out / PLOTS}")


if __name__ == "__main__":
    main()
