"""Pictures for the executed pages: attention maps and mask matrices as inline PNG images.

The tutorial and the masks page call these from their (hidden) code blocks while the site is
built. Each function returns an ``<img>`` element holding a PNG; a block run with markdown-exec's
``html="1"`` prints it, which puts the picture in the page without writing a file.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap

# Blocked (False) cells light, visible (True) cells dark, as in the drawn docstring matrices.
_MASK_COLOURS = ListedColormap(["#eceff1", "#3f51b5"])


def _emit(fig: plt.Figure, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{alt}" src="data:image/png;base64,{data}">'


def _grid(n: int, size: float, layout: str | None = None) -> tuple[plt.Figure, list[plt.Axes]]:
    fig, axes = plt.subplots(1, n, figsize=(size * n, size), squeeze=False, layout=layout)
    return fig, list(axes[0])


def _label(
    ax: plt.Axes, rows: int, cols: int, ylabels: Sequence[str] | None, xlabels: Sequence[str] | None
) -> None:
    ax.set_xticks(range(cols), xlabels if xlabels is not None else range(cols))
    ax.set_yticks(range(rows), ylabels if ylabels is not None else range(rows))
    ax.tick_params(length=0, labelsize=8)
    if xlabels is not None and max(map(len, xlabels), default=0) > 2:
        ax.tick_params(axis="x", labelrotation=90)
    ax.set_xlabel("key j", fontsize=8)
    ax.set_ylabel("query i", fontsize=8)


def heatmaps(
    *maps: torch.Tensor,
    titles: Sequence[str] = (),
    labels: Sequence[str] | None = None,
    cmap: str = "viridis",
    size: float = 2.8,
    values: bool = False,
    shared_scale: bool = False,
) -> str:
    """One ``<img>`` with a heat map of each ``(Tq, Tk)`` matrix, side by side.

    ``-inf`` entries (masked scores) are drawn in grey; ``labels`` name the rows and columns
    (tokens); ``values`` writes each entry in its cell. ``shared_scale`` draws every map on one
    colour scale, shown by one colour bar, so that maps differing only in size look different
    (by default each map spans the whole colour map).
    """
    mats = [torch.as_tensor(m).detach().double().cpu() for m in maps]
    vmin = vmax = None
    if shared_scale:
        finite = torch.cat([m[m.isfinite()] for m in mats])
        vmin, vmax = float(finite.min()), float(finite.max())
    fig, axes = _grid(len(mats), size, layout="constrained" if shared_scale else None)
    for ax, m, title in zip(axes, mats, list(titles) + [""] * len(mats), strict=False):
        shown = m.masked_fill(~m.isfinite(), float("nan")).numpy()
        colours = plt.get_cmap(cmap).copy()
        colours.set_bad("#cfd8dc")
        image = ax.imshow(shown, cmap=colours, vmin=vmin, vmax=vmax)
        ax.set_title(title, fontsize=9)
        _label(ax, m.shape[0], m.shape[1], labels, labels)
        if values:
            for (i, j), x in zip(
                torch.cartesian_prod(*(torch.arange(s) for s in m.shape)), m.flatten(), strict=True
            ):
                text = "-inf" if x == float("-inf") else f"{x:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=6, color="white")
    if shared_scale:
        fig.colorbar(image, ax=axes, shrink=0.8, pad=0.02)
    else:
        fig.tight_layout()
    return _emit(fig, ", ".join(titles) or "attention map")


def masks(
    *matrices: torch.Tensor,
    titles: Sequence[str] = (),
    size: float = 2.4,
) -> str:
    """One ``<img>`` drawing each bool ``(Tq, Tk)`` mask as a grid of cells, side by side:
    dark = this query may attend this key."""
    fig, axes = _grid(len(matrices), size)
    for ax, m, title in zip(axes, matrices, list(titles) + [""] * len(matrices), strict=False):
        m = torch.as_tensor(m).bool().cpu()
        rows, cols = m.shape
        ax.imshow(m.int().numpy(), cmap=_MASK_COLOURS, vmin=0, vmax=1)
        ax.set_xticks([x - 0.5 for x in range(1, cols)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, rows)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        ax.set_title(title, fontsize=9)
        _label(ax, rows, cols, None, None)
    fig.tight_layout()
    return _emit(fig, ", ".join(titles) or "mask")
