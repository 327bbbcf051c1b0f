"""What every room of attnkit stands on: argument checks, shape annotations, hints for torch's
conventions, the environment variables, finiteness, and torch.func's transforms."""
