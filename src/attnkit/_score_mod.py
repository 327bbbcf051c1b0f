"""Score modifications: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's form.

A score_mod is any function of a score tile and broadcastable index tensors; a backend that
accepts one applies it to the scaled scores (after softcap and ``bias``, before the mask), tile by
tile. Its gradients reach q and k through the scores, and the tensors it captures through the
autograd inputs this module finds for it (:func:`captured_tensors`).

Which captured tensors are seen: tensors (and the parameters and buffers of ``nn.Module`` objects)
held in the function's closure cells, in its default arguments, in the globals its code names,
and in the attributes of a callable object or the ``self`` of a bound method. A score_mod that
reaches a tensor needing gradients some other way (through another function it calls, say) is
refused by :func:`check_captured`, which follows the autograd graph of a probe call: such a tensor
would otherwise silently get no gradient from the kernel's backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ._checks import shape_str

__all__ = ["ScoreMod", "captured_tensors", "check_captured", "check_score_mod", "index_tensors"]

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def check_score_mod(score_mod: object) -> ScoreMod | None:
    """``score_mod`` if it is callable (or None)."""
    if score_mod is None:
        return None
    if not callable(score_mod):
        raise TypeError(
            "score_mod must be a function score_mod(score, b, h, q_idx, kv_idx) -> score, or "
            f"None; got {type(score_mod).__name__}"
        )
    return score_mod


def describe(score_mod: ScoreMod) -> str:
    """``score_mod=<name>`` for a call's one-line description."""
    name = getattr(score_mod, "__name__", None) or type(score_mod).__name__
    return f"score_mod={name}"


def _tensors_in(obj: object, depth: int = 0) -> Iterator[Tensor]:
    """Tensors held by ``obj``: itself, a module's parameters and buffers, the items of a list,
    tuple or dict (one level deep), a partial's arguments."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif depth == 0 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item, 1)
    elif depth == 0 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, 1)


def captured_tensors(score_mod: ScoreMod) -> tuple[Tensor, ...]:
    """The tensors ``score_mod`` captures that need gradients (see the module docstring for what is
    seen), each once, in a stable order."""
    found: list[Tensor] = []
    seen: set[int] = set()

    def add(obj: object) -> None:
        for t in _tensors_in(obj):
            if t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                found.append(t)

    fn: object = score_mod
    while isinstance(fn, functools.partial):
        for a in (*fn.args, *fn.keywords.values()):
            add(a)
        fn = fn.func
    if hasattr(fn, "__self__"):  # a bound method: the object's tensors
        add(fn.__self__)
        add(getattr(fn.__self__, "__dict__", {}))
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object: its attributes
        add(fn)
        add(getattr(fn, "__dict__", {}))
        call = type(fn).__call__
        code = getattr(call, "__code__", None)
        fn = call
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            add(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    add(list(getattr(fn, "__defaults__", None) or ()))
    add(dict(getattr(fn, "__kwdefaults__", None) or {}))
    if code is not None:
        module_globals = getattr(fn, "__globals__", {})
        for name in code.co_names:
            if name in module_globals:
                add(module_globals[name])
    return tuple(found)


def index_tensors(
    batch: int, heads: int, qs: int, qe: int, ks: int, ke: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The broadcastable int64 indices of a tile: ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``,
    ``q_idx (1, 1, rows, 1)``, ``kv_idx (1, 1, 1, keys)``."""
    return (
        torch.arange(batch, device=device).view(-1, 1, 1, 1),
        torch.arange(heads, device=device).view(1, -1, 1, 1),
        torch.arange(qs, qe, device=device).view(1, 1, -1, 1),
        torch.arange(ks, ke, device=device).view(1, 1, 1, -1),
    )


def apply(score_mod: ScoreMod, s: Tensor, idx: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """``score_mod`` on a ``(B, H, rows, keys)`` tile, its result checked and broadcast to it."""
    out = score_mod(s, *idx)
    if not isinstance(out, Tensor) or not out.is_floating_point():
        got = str(out.dtype) if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(
            f"score_mod must return a float tensor (the modified scores), got {got} for a score "
            f"tile {shape_str(s.shape)}"
        )
    if tuple(out.shape) != tuple(s.shape):
        try:
            out = out.expand(s.shape)
        except RuntimeError:
            raise ValueError(
                f"score_mod returned shape {shape_str(out.shape)}, which does not broadcast to "
                f"the score tile {shape_str(s.shape)} (index tensors b, h, q_idx, kv_idx of "
                f"shapes {', '.join(shape_str(i.shape) for i in idx)})"
            ) from None
    return out if out.dtype == s.dtype else out.to(s.dtype)


def _leaves(t: Tensor, stops: set[int]) -> list[Tensor]:
    """The leaf tensors needing gradients that ``t``'s autograd graph reaches without passing
    through a tensor in ``stops`` (ids of the tensors themselves or of their grad_fn nodes)."""
    found: list[Tensor] = []
    todo = [t.grad_fn]
    visited: set[int] = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in visited or id(node) in stops:
            continue
        visited.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(variable, Tensor):
            if id(variable) not in stops:
                found.append(variable)
            continue
        todo.extend(n for n, _ in node.next_functions)
    return found


def check_captured(
    score_mod: ScoreMod, captured: tuple[Tensor, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse a score_mod whose probe call (one score, indices 0) depends on a tensor needing
    gradients that :func:`captured_tensors` did not find."""
    score = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device, requires_grad=True)
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device)
    with torch.enable_grad():
        out = score_mod(score, zero, zero, zero, zero)
    if not isinstance(out, Tensor) or out.grad_fn is None:
        return
    stops = {id(score)}
    for t in captured:
        stops.add(id(t))
        if t.grad_fn is not None:
            stops.add(id(t.grad_fn))
    hidden = _leaves(out, stops)
    if hidden:
        shapes = ", ".join(shape_str(t.shape) for t in hidden)
        raise ValueError(
            f"score_mod uses tensors that require grad which attnkit cannot see (shapes {shapes}): "
            "it finds captured tensors in the function's closure, default arguments, the globals "
            "it names and the attributes of its object; reach them from there (for example "
            "def mod(score, b, h, q_idx, kv_idx, bias=bias)), or detach them"
        )
