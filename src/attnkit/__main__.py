"""``python -m attnkit``: the ``attnkit`` command, where its script is not on ``PATH`` (a venv not
activated, ``pip install --user``)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
