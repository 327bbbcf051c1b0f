"""The ``attnkit`` command: ``attnkit demo``, ``attnkit bench``, ``attnkit explain``.

Run ``attnkit <command> --help`` for each command's options.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import attnkit

from . import bench, demo, explain


def _plain_text(doc: str | None) -> str:
    """A module docstring as ``--help`` prints it: without its reStructuredText markup
    (double backticks, bold, roles such as :func:), which a terminal would show as is."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "").replace("**", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnkit",
        description="attnkit: attention for PyTorch. One mask convention (True = may attend), a "
        "readable reference, and fast paths tested equal to it.",
    )
    parser.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    d = sub.add_parser(
        "demo",
        help="train a small Transformer on a sequence task, evaluate it, plot its attention",
        description=_plain_text(demo.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(d)
    d.set_defaults(run=demo.run)

    b = sub.add_parser(
        "bench",
        help="time attnkit against torch and hand-written attention",
        description=_plain_text(bench.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(b)
    b.set_defaults(run=bench.run)

    e = sub.add_parser(
        "explain",
        help="say which backend auto picks for a call, and why not the others",
        description=_plain_text(explain.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_arguments(e)
    e.set_defaults(run=explain.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except (ValueError, TypeError, RuntimeError, OverflowError) as err:
        # Bad values that argparse cannot see (shapes that do not fit, an unknown device, a
        # product of sizes past what torch holds...).
        parser.exit(2, f"attnkit {args.command}: error: {err}\n")
    except OSError as err:
        # A file or folder the user cannot read or write, a full disk: theirs to fix, so one
        # line, not a traceback.
        where = f": {os.fspath(err.filename)!r}" if err.filename is not None else ""
        reason = f"{err.strerror}{where}" if err.strerror else str(err)
        parser.exit(2, f"attnkit {args.command}: error: {reason}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"attnkit {args.command}: interrupted\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
