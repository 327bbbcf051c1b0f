"""attnkit's ``nn.Module`` layers: multi-head, relative and latent attention, the feed-forward,
the Conformer and Transformer layers, positional encodings, and saving their weights."""
