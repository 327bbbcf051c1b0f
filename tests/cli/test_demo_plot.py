"""The demo's figures: each panel shows the weights the model really gave, with one colour bar."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnkit.cli import _demo_model, _demo_plot

figure = pytest.importorskip("matplotlib.figure")


def test_attention_figure_shows_the_captured_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _demo_model.DemoConfig(steps=1, eval_size=2, layers=2, heads=2, d_model=16, d_ff=32)
    torch.manual_seed(0)
    model = _demo_model.Seq2Seq(cfg).eval()
    batch = _demo_model.make_batch(cfg, _demo_model.eval_set(cfg)[:1])
    figures: list[object] = []
    real_savefig = figure.Figure.savefig

    def keep(fig: object, *args: object, **kwargs: object) -> None:
        figures.append(fig)
        real_savefig(fig, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(figure.Figure, "savefig", keep)
    path = tmp_path / "attention.png"
    _demo_plot.plot_attention(model, batch, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.get_images()]  # type: ignore[attr-defined]
    assert len(panels) == cfg.layers * cfg.heads
    assert len(fig.axes) == len(panels) + 1  # and one colour bar  # type: ignore[attr-defined]
    titles = [ax.get_title() for ax in panels]
    assert titles[0] == "decoder layer 0 (first), head 0"
    assert titles[-1] == f"decoder layer {cfg.layers - 1} (last), head {cfg.heads - 1}"
    # Every row of a panel is a softmax over the real source tokens: it sums to 1.
    n_src = int(batch.src_len[0])
    for ax in panels:
        weights = torch.tensor(ax.get_images()[0].get_array().data)
        assert weights.shape[1] == n_src
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.size(0)), atol=1e-5, rtol=0)


def test_token_names() -> None:
    assert _demo_plot._token_name(_demo_model.PAD) == "pad"
    assert _demo_plot._token_name(_demo_model.EOS) == "eos"
    assert _demo_plot._token_name(_demo_model.FIRST_SYMBOL + 3) == "3"
