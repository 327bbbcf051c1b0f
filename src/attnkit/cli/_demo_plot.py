"""The pictures of ``attnkit demo``: the training curve and the decoder's cross-attention."""

from __future__ import annotations

from pathlib import Path

import torch

import attnkit

from ._demo_model import BOS, EOS, FIRST_SYMBOL, PAD, Batch, Seq2Seq, greedy_decode


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


# What a reader should look for in the last layer, per task.
_PATTERN = {
    "reverse": "output token i reads source token n-1-i: an anti-diagonal",
    "copy": "output token i reads source token i: a diagonal",
    "sort": "each output token reads the source position that holds its symbol",
}


def plot_attention(model: Seq2Seq, batch: Batch, path: Path) -> None:
    """Cross-attention heatmaps of one example: a row per decoder layer, a column per head, one
    colour bar, and a caption saying what a panel shows and what to look for."""
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
    last = len(layers) - 1
    for r, name in enumerate(layers):
        w = torch.cat(maps[name], dim=2)[0]  # steps of (1, H, 1, Ts) -> (H, steps, Ts)
        for h in range(heads):
            ax = axes[r][h]
            image = ax.imshow(w[h, : len(gen), :n_src].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_xticks(range(n_src), src, fontsize=7)
            ax.set_yticks(range(len(gen)), gen, fontsize=7)
            where = " (first)" if r == 0 and last else " (last)" if r == last else ""
            ax.set_title(f"decoder layer {r}{where}, head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel("generated token")
            if r == last:
                ax.set_xlabel("source token")
    fig.colorbar(image, ax=axes, shrink=0.7, label="attention weight (each row sums to 1)")
    fig.suptitle(
        f"Cross-attention of the trained model on one held-out example (task: {model.cfg.task})\n"
        "Each panel is one head: a row per generated token, the weight it gives each source "
        "token.\nThe first layer sees its tokens through one layer only and often spreads its "
        f"weight;\nin the last, {_PATTERN[model.cfg.task]}.",
        fontsize=9,
    )
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def _token_name(t: int) -> str:
    return {PAD: "pad", BOS: "bos", EOS: "eos"}.get(t, str(t - FIRST_SYMBOL))
