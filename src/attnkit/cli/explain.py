"""``attnkit explain``: which backend ``auto`` picks for a call described on the command line.

The call's tensors are one value each, expanded to the call's shapes, so q, k, v and masks of any
size allocate nothing (on a real device, explain() reads a bias through to check its values).
By default they are on ``meta``, a device without data: the report then leaves out what the
chunked backend can only tell on a real device (its block plan, and whether its native kernel
runs), and says so; ``--device cpu`` tells it. A dense mask given as ``--mask`` lets every query
see every key there: the command knows its shape, not its content.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

import attnkit

from .._base.checks import int_arg

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
# Dense bool masks, by shape.
DENSE_MASKS = ("none", "padding", "full", "query")
# Structured masks (never written out): NAME or NAME:N.
STRUCTURED_MASKS = ("window:N", "documents:N", "key-padding:N")
BIASES = ("none", "heads", "full")


def _size(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (its message names the option)."""

    def parse(text: str) -> int:
        value = int_arg(text)  # argparse's error for a non-integer or one past int64
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "size"  # argparse names the type in some messages
    return parse


def _mask_spec(text: str) -> str:
    name, _, n = text.partition(":")
    if text in DENSE_MASKS or (name in ("window", "documents", "key-padding") and n):
        if n:
            # window:0 is the diagonal alone, key-padding:0 a row of padding only; documents
            # need one at least.
            count = int_arg(n)
            least = 1 if name == "documents" else 0
            if count < least:
                raise argparse.ArgumentTypeError(
                    f"invalid mask {text!r}: N must be at least {least}, got {count}"
                )
        return text
    raise argparse.ArgumentTypeError(
        f"invalid mask {text!r}: one of {', '.join(DENSE_MASKS)} (a dense bool tensor), or "
        f"{', '.join(STRUCTURED_MASKS)} (a structured mask)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    shape = p.add_argument_group("shapes")
    # Sizes of 0 are calls attention() serves (Tk = 0: every query sees nothing and gets 0);
    # heads are at least 1, as attention() requires.
    one, zero = _size(1), _size(0)
    shape.add_argument("-b", "--batch", type=zero, default=1, help="batch size B (default 1)")
    shape.add_argument("--heads", type=one, default=8, help="query heads H (default 8)")
    shape.add_argument("--kv-heads", type=one, help="key/value heads Hkv (default: H)")
    shape.add_argument("-t", "--q-len", type=zero, default=1024, help="queries Tq (default 1024)")
    shape.add_argument("--kv-len", type=zero, default=None, help="keys Tk (default: Tq)")
    shape.add_argument("-d", "--head-dim", type=zero, default=64, help="Dk (default 64)")
    shape.add_argument("--v-dim", type=zero, default=None, help="Dv (default: Dk)")
    opts = p.add_argument_group("options")
    opts.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    opts.add_argument(
        "--device",
        default="meta",
        help="device the call would run on: cpu, cuda... (default meta, a device without data: "
        "the report then leaves out the chunked backend's block plan and whether its native "
        "kernel runs, and says so)",
    )
    opts.add_argument(
        "--mask",
        type=_mask_spec,
        default="none",
        metavar="MASK",
        help="a dense bool mask, taken as letting every query see every key: none; padding "
        "(B,1,1,Tk); full (B,H,Tq,Tk); query (Tq,Tk). Or a structured mask: window:N (each "
        "query sees itself and the N keys before it), documents:N (N packed documents of equal "
        "length), key-padding:N (every row N real keys). Default none",
    )
    opts.add_argument("--causal", action="store_true", help="bottom-right causal masking")
    opts.add_argument(
        "--bias",
        choices=BIASES,
        default="none",
        help="none; heads (H,Tq,Tk), e.g. ALiBi or relative positions; full (B,H,Tq,Tk)",
    )
    opts.add_argument("--bias-grad", action="store_true", help="the bias requires grad")
    opts.add_argument("--dropout", type=float, default=0.0, metavar="P", help="dropout_p")
    opts.add_argument("--weights", action="store_true", help="return_weights=True")
    opts.add_argument(
        "--backend",
        default="auto",
        help=f"auto or one of {', '.join(attnkit.available_backends())}",
    )


_MOST_ELEMENTS = 2**63 - 1  # a tensor's element count is an int64


def run(args: argparse.Namespace) -> int:
    try:
        device = torch.device(args.device)
    except RuntimeError as err:  # torch's message lists its device types, naming no option
        raise ValueError(
            f"--device {args.device!r}: not a device (cpu, cuda, cuda:1, meta...): {err}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (--device meta describes any call)")
    dtype = DTYPES[args.dtype]
    b, h, tq, dk = args.batch, args.heads, args.q_len, args.head_dim
    hkv = h if args.kv_heads is None else args.kv_heads
    tk = tq if args.kv_len is None else args.kv_len
    dv = dk if args.v_dim is None else args.v_dim

    def empty(*shape: int, grad: bool = False) -> torch.Tensor:
        if math.prod(shape) > _MOST_ELEMENTS:  # torch's own error names no option
            raise ValueError(
                f"a tensor of shape {shape} has {math.prod(shape)} elements, more than torch "
                f"holds ({_MOST_ELEMENTS}): lower -b/--batch, --heads, -t/--q-len, --kv-len "
                "or -d/--head-dim"
            )
        return _expanded(0.0, shape, dtype, device, grad)

    mask = _mask(args.mask, b, h, tq, tk, device)
    bias = None
    if args.bias != "none":
        shape = (h, tq, tk) if args.bias == "heads" else (b, h, tq, tk)
        bias = empty(*shape, grad=args.bias_grad)
    report = attnkit.explain(
        empty(b, h, tq, dk),
        empty(b, hkv, tk, dk),
        empty(b, hkv, tk, dv),
        mask=mask,
        bias=bias,
        causal=args.causal,
        dropout_p=args.dropout,
        return_weights=args.weights,
        backend=args.backend,
    )
    print(report)
    if device.type == "meta" and report.chosen == "chunked":
        # chunked's notes come from the mask's blocks and the kernel's build for the device,
        # which meta has neither of: say what is missing rather than print a shorter report.
        masked = args.mask != "none" or args.causal  # the block plan is told for masks only
        print(
            "left out on meta, a device without data: "
            + (
                "the chunked backend's block plan and whether its native kernel would run "
                "(--device cpu tells them)"
                if masked
                else "whether the chunked backend's native kernel would run (--device cpu tells it)"
            )
        )
    return 0 if report.chosen is not None else 1


def _expanded(
    value: float | bool,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    grad: bool = False,
) -> torch.Tensor:
    """One ``value`` seen as a tensor of ``shape``: nothing is allocated, whatever the sizes, and
    what explain() reads on a real device is defined (zeros are finite; a True mask hides no
    key), where ``torch.empty`` would hand it whatever the memory held."""
    one = torch.full((), value, dtype=dtype, device=device, requires_grad=grad)
    return one.expand(shape)


def _mask(
    spec: str, b: int, h: int, tq: int, tk: int, device: torch.device
) -> torch.Tensor | attnkit.masks.Mask | None:
    """The ``mask=`` of the call that ``--mask spec`` describes."""
    if spec == "none":
        return None
    dense = {"padding": (b, 1, 1, tk), "full": (b, h, tq, tk), "query": (tq, tk)}
    if spec in dense:
        return _expanded(True, dense[spec], torch.bool, device)
    name, _, count = spec.partition(":")
    n = int(count)
    if name == "window":
        return attnkit.masks.sliding_window(n)
    if name == "key-padding":
        if n > tk:
            raise ValueError(f"--mask {spec}: {n} real keys of Tk = {tk}")
        return attnkit.masks.key_padding([n] * b)
    if n > tk:
        raise ValueError(f"--mask {spec}: {n} documents in Tk = {tk} keys")
    lengths = [tk // n + (1 if i < tk % n else 0) for i in range(n)]
    return attnkit.masks.documents(lengths)
