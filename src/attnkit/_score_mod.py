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

Which score_mods are recognised as softcap (:func:`softcap_of`): a plain function (a ``def`` or a
lambda) computing exactly ``c * tanh(score / c)`` for one constant ``c > 0``, in any spelling of
the three operations (``c * torch.tanh(score / c)``, ``torch.tanh(score / c) * c``,
``score.div(c).tanh().mul(c)``, ...), with ``c`` a Python number or a 0-d tensor that needs no
gradient, read from its closure, its default arguments or the globals it names. A backend may
then run the call as ``softcap=c``, the same function of the scores.

Which are recognised as a bias by distance (:func:`distance_bias_of`): a plain function whose
result is ``score + x`` or ``score - x`` (``x`` computed without the score) where ``x`` reads
``q_idx`` and ``kv_idx`` only through their difference (``q_idx - kv_idx`` or ``kv_idx - q_idx``,
any number of times) and may read ``b``, ``h`` and any tensors: a learned relative bias
``table[h, q_idx - kv_idx + c]``, ALiBi's ``slope[h] * (kv_idx - q_idx)``, T5's buckets of the
distance. Its values are then a table over the call's distances, which the function computes
itself at the call's own indices, so the table has its gradients; a backend may run the call with
that table as a :class:`~attnkit.scores.DistanceBias`.
"""

from __future__ import annotations

import functools
import math
import operator
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ._base.checks import one_or, shape_str
from .scores import DistanceBias, ScoreShape

__all__ = [
    "ScoreMod",
    "captured_tensors",
    "check_captured",
    "check_elementwise",
    "check_score_mod",
    "distance_bias_of",
    "index_tensors",
    "softcap_of",
]

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


def _attribute(fn: object, name: str) -> Any:
    """``fn``'s attribute ``name``, or None. torch.compile cannot read some attributes of a
    function made inside the compiled region (``__closure__``, ``__kwdefaults__``,
    ``__globals__``) and raises AttributeError there even under ``getattr``'s default; what
    such a function captures is in the graph torch traces, which differentiates it itself."""
    try:
        return getattr(fn, name)
    except AttributeError:
        return None


def captured_tensors(score_mod: Callable[..., Tensor]) -> tuple[Tensor, ...]:
    """The tensors ``score_mod`` (or a ``mask_mod``) captures that need gradients (see the module
    docstring for what is seen), each once, in a stable order."""
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
    for cell in _attribute(fn, "__closure__") or ():
        try:
            add(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    add(list(_attribute(fn, "__defaults__") or ()))
    add(dict(_attribute(fn, "__kwdefaults__") or {}))
    if code is not None:
        module_globals = _attribute(fn, "__globals__") or {}
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


#: What every refusal of a score_mod that is not elementwise says.
ELEMENTWISE = (
    "FlexAttention requires a score_mod to map each score to one score, a function of that "
    "score and of its own b, h, q_idx and kv_idx only (elementwise: torch calls it on one "
    "score at a time); attnkit calls it on tiles of scores, where a sum, mean or maximum over "
    "the tile, a slice (score[..., :1]), a reordering (flip, roll, cumsum) or a product with "
    "other scores (a matmul) would depend on the tile"
)


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same_elements(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements in the same places: the same shape, start
    and strides (but for dimensions of size 1, whose strides are never used)."""
    return (
        a.shape == b.shape
        and a.data_ptr() == b.data_ptr()
        and all(n == 1 or i == j for n, i, j in zip(a.shape, a.stride(), b.stride(), strict=True))
    )


def apply(score_mod: ScoreMod, s: Tensor, idx: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """``score_mod`` on a ``(B, H, rows, keys)`` tile, its result checked and broadcast to it.

    The result must broadcast to the tile. One that shares the tile's memory must be the tile
    itself (the function returned its input, a view of all of it such as ``score[...]``, or its
    input written in place): any other view of it (``score[..., :1]``, a transpose) puts other
    scores in a score's place. Whether the function is elementwise otherwise is
    :func:`check_elementwise`'s question, asked once per call.
    """
    out = score_mod(s, *idx)
    if not isinstance(out, Tensor) or not out.is_floating_point():
        got = str(out.dtype) if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(
            f"score_mod must return a float tensor (the modified scores), got {got} for a score "
            f"tile {shape_str(s.shape)}"
        )
    # Under torch.compile the tensors are fake and have no memory to compare.
    if not torch.compiler.is_compiling() and _shares_memory(out, s) and not _same_elements(out, s):
        raise ValueError(
            f"score_mod returned a view of other scores of its score tile {shape_str(s.shape)} "
            f"(shape {shape_str(out.shape)}, strides {shape_str(out.stride())}, against the "
            f"tile's {shape_str(s.stride())}): {ELEMENTWISE}"
        )
    if tuple(out.shape) != tuple(s.shape):
        try:
            out = out.expand(s.shape)
        except RuntimeError:
            raise ValueError(
                f"score_mod returned shape {shape_str(out.shape)}, which does not broadcast to "
                f"the score tile {shape_str(s.shape)} (index tensors b, h, q_idx, kv_idx of "
                f"shapes {', '.join(shape_str(i.shape) for i in idx)}): {ELEMENTWISE}"
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
        # A copy, not the leaf: a score_mod may write to its input (score.mul_(2)).
        out = score_mod(score.clone(), zero, zero, zero, zero)
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


# ------------------------------------------------------------------------------------------------
# Recognising a score_mod that is exactly a softcap

# The spellings of the three operations as torch.fx records them: call_function targets, and the
# names of call_method targets (a Tensor method on the score, or on a tensor constant).
_FUNCTIONS: dict[object, str] = {
    operator.truediv: "div",
    torch.div: "div",
    torch.true_divide: "div",
    torch.divide: "div",
    torch.Tensor.div: "div",
    torch.tanh: "tanh",
    torch.Tensor.tanh: "tanh",
    operator.mul: "mul",
    torch.mul: "mul",
    torch.multiply: "mul",
    torch.Tensor.mul: "mul",
    operator.add: "add",
    torch.add: "add",
    torch.Tensor.add: "add",
    operator.sub: "sub",
    torch.sub: "sub",
    torch.subtract: "sub",
    torch.Tensor.sub: "sub",
}
_METHODS = {
    "div": "div",
    "true_divide": "div",
    "divide": "div",
    "tanh": "tanh",
    "mul": "mul",
    "multiply": "mul",
    "add": "add",
    "sub": "sub",
    "subtract": "sub",
}


def _op(node: object) -> str | None:
    """``"div"``, ``"tanh"``, ``"mul"``, ``"add"`` or ``"sub"`` for an fx node computing that
    without keywords."""
    if not isinstance(node, torch.fx.Node) or node.kwargs:
        return None
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method" and isinstance(node.target, str):
        return _METHODS.get(node.target)
    return None


def _constant(arg: object, root: torch.nn.Module) -> float | None:
    """The value of a Python number, or of a 0-d real tensor needing no gradient (an fx
    get_attr node), else None."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if not isinstance(arg, torch.fx.Node) or arg.op != "get_attr":
        return None
    if not isinstance(arg.target, str):
        return None
    t = getattr(root, arg.target, None)
    if not isinstance(t, Tensor) or t.ndim or t.requires_grad or t.device.type == "meta":
        return None
    if t.dtype == torch.bool or t.is_complex():
        return None
    return float(t.item())


def _only_arg(node: torch.fx.Node, op: str, count: int) -> tuple[object, ...] | None:
    """The arguments of ``node`` if it computes ``op`` with ``count`` of them and only one node
    uses its result."""
    if _op(node) != op or len(node.args) != count or len(node.users) != 1:
        return None
    return tuple(node.args)


def _graph_softcap(graph: torch.fx.Graph, root: torch.nn.Module) -> float | None:
    """``c`` when ``graph`` (traced from ``(score, b, h, q_idx, kv_idx)``) is exactly
    ``mul(tanh(div(score, c)), c)``, mul's operands in either order, and nothing else."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    out = nodes[-1]
    if len(placeholders) != 5 or len(calls) != 3 or out.op != "output" or len(out.args) != 1:
        return None
    score, *indices = placeholders
    if any(i.users for i in indices) or len(score.users) != 1:  # b, h, q_idx or kv_idx used
        return None
    result = out.args[0]
    mul = _only_arg(result, "mul", 2) if isinstance(result, torch.fx.Node) else None
    if mul is None:
        return None
    tanh, c2 = mul if _op(mul[0]) == "tanh" else mul[::-1]
    tanh_args = _only_arg(tanh, "tanh", 1) if isinstance(tanh, torch.fx.Node) else None
    if tanh_args is None or not isinstance(tanh_args[0], torch.fx.Node):
        return None
    div = _only_arg(tanh_args[0], "div", 2)
    if div is None or div[0] is not score:
        return None
    c1 = _constant(div[1], root)
    if c1 is None or c1 != _constant(c2, root) or not 0.0 < c1 < math.inf:
        return None
    return c1


class _Absent:
    """A name a function's code reads that its globals do not hold, or an empty closure cell."""


_ABSENT = _Absent()


def _stable_token(value: object) -> object | None:
    """A hashable token for a value a score_mod reads that cannot change without the token
    changing (numbers by type and value, a 0-d tensor by identity and version, torch's modules
    and functions by identity); None for anything else."""
    if value is None or value is _ABSENT:
        return ("const", value)
    if isinstance(value, (int, float, complex, str)):
        return ("number", type(value), value)
    if isinstance(value, Tensor):
        # A tensor needing gradients must reach the kernel's backward, and a tensor of more than
        # one value is no softcap constant: neither is recognised.
        if value.ndim or value.requires_grad:
            return None
        # Its identity, and what changes with its values: in-place writes bump the version,
        # ``t.data = ...`` moves its storage.
        return ("tensor", id(value), value._version, value.data_ptr(), value.dtype)
    if isinstance(value, types.ModuleType):
        name = value.__name__
        ok = name in ("math", "operator", "torch") or name.startswith("torch.")
        return ("module", value) if ok else None
    if isinstance(value, types.BuiltinFunctionType):
        owner = getattr(value, "__self__", None)
        ok = owner is None or isinstance(owner, (types.ModuleType, type))
        return ("builtin", value) if ok else None
    if isinstance(value, types.FunctionType) and value.__module__.startswith("torch."):
        return ("function", value)
    if value is torch.Tensor:
        return ("class", value)
    return None


def _reads(
    fn: types.FunctionType, token: Callable[[object], object | None] = _stable_token
) -> tuple[tuple[object, ...], list[Tensor]] | None:
    """What ``fn`` may read besides its arguments, as a hashable key (its code, then ``token``
    of its closure cells, its defaults and the globals its code names), and the tensors among
    them; None when any of it could change unseen (a list, an object, another Python function)."""
    code = fn.__code__
    if any(isinstance(c, types.CodeType) for c in code.co_consts):  # nested functions
        return None
    values: list[object] = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            values.append(_ABSENT)
    values.extend(fn.__defaults__ or ())
    kwdefaults = fn.__kwdefaults__ or {}
    values.extend(kwdefaults.values())
    module_globals = fn.__globals__
    values.extend(module_globals.get(name, _ABSENT) for name in code.co_names)
    key: list[object] = [code, *kwdefaults]
    tensors: list[Tensor] = []
    for v in values:
        got = token(v)
        if got is None:
            return None
        if isinstance(v, Tensor):
            tensors.append(v)
        key.append(got)
    return tuple(key), tensors


# (code, what it reads) -> (the cap or None, the tensors read, kept alive so that their ids in
# the key stay theirs)
_SOFTCAPS: dict[tuple[object, ...], tuple[float | None, list[Tensor]]] = {}
_MAX_CACHED = 256


def _trace_softcap(fn: types.FunctionType) -> float | None:
    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return fn(score, b, h, q_idx, kv_idx)  # type: ignore[no-any-return]

    tracer = torch.fx.Tracer()
    try:
        graph = tracer.trace(score_mod)
    except Exception:  # any function fx cannot trace is simply not recognised
        return None
    return _graph_softcap(graph, tracer.root)


def softcap_of(score_mod: ScoreMod) -> float | None:
    """``c`` when ``score_mod`` is exactly the softcap ``c * tanh(score / c)`` (see the module
    docstring for what is recognised), else None.

    The function is traced once with torch.fx (symbolically: no tensor is computed, and one that
    branches on a score's value cannot be traced, so it is not recognised) and the result kept
    for its code and the current values of everything it reads, so a later call costs a lookup,
    and rebinding a name it reads (or changing a 0-d tensor it reads in place) traces it again.

    >>> softcap_of(lambda s, b, h, q_idx, kv_idx: 30.0 * torch.tanh(s / 30.0))
    30.0
    >>> softcap_of(lambda s, b, h, q_idx, kv_idx: 30.0 * torch.tanh(s / 20.0)) is None
    True
    """
    # Every spelling of tanh in the function's own code names it (torch.tanh, score.tanh(), ...):
    # a score_mod that does not is no softcap, and costs no trace.
    if type(score_mod) is not types.FunctionType or "tanh" not in score_mod.__code__.co_names:
        return None
    reads = _reads(score_mod)
    if reads is None:
        return None
    key, tensors = reads
    hit = _SOFTCAPS.get(key)
    if hit is not None:
        return hit[0]
    cap = _trace_softcap(score_mod)
    if len(_SOFTCAPS) >= _MAX_CACHED:
        _SOFTCAPS.clear()
    _SOFTCAPS[key] = (cap, tensors)
    return cap


# ------------------------------------------------------------------------------------------------
# Recognising a score_mod that adds a bias by distance


def _add_op(node: object) -> str | None:
    """``"add"`` or ``"sub"`` for an fx node computing that of two operands, without keywords."""
    op = _op(node)
    if op not in ("add", "sub") or not isinstance(node, torch.fx.Node) or len(node.args) != 2:
        return None
    return op


def _metadata(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads a tensor's dtype or device (``score.dtype``), not its values."""
    return (
        node.op == "call_function"
        and node.target is getattr
        and len(node.args) == 2
        and node.args[1] in ("dtype", "device")
    )


def _graph_by_distance(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` (traced from ``(score, b, h, q_idx, kv_idx)``) returns ``score + x`` or
    ``score - x`` with ``x`` free of the score and reading ``q_idx`` and ``kv_idx`` only through
    their difference."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out = nodes[-1]
    if len(placeholders) != 5 or out.op != "output" or len(out.args) != 1:
        return False
    score, _, _, q_idx, kv_idx = placeholders
    # From the score to the result, a chain of adds and subtractions of terms that do not read
    # it ((s + h) - b, say): each link's only user is the next, which uses it once (and as what
    # is subtracted from, in a subtraction).
    node, result = score, out.args[0]
    while node is not result:
        users = [u for u in node.users if not _metadata(u)]  # score.dtype reads no value
        if len(users) != 1:
            return False
        (link,) = users
        op = _add_op(link)
        if op is None or (link.args[0] is node) == (link.args[1] is node):
            return False
        if op == "sub" and link.args[0] is not node:
            return False
        node = link
    if node is score:  # the score itself: no bias at all
        return False
    pairs = ((q_idx, kv_idx), (kv_idx, q_idx))
    return all(
        _add_op(user) == "sub" and tuple(user.args) in pairs
        for index in (q_idx, kv_idx)
        for user in index.users
    )


def _shape_token(value: object) -> object | None:
    """A hashable token of what a value may change in a trace's structure: a tensor's shape and
    dtype (not its values: a score_mod computes, it does not branch on a tensor's values), else as
    :func:`_stable_token`."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return _stable_token(value)


# (code, what it reads) -> whether the function adds a bias by distance
_BY_DISTANCE: dict[tuple[object, ...], bool] = {}


def _by_distance(score_mod: ScoreMod) -> bool:
    """Whether ``score_mod`` is a plain function of the form :func:`distance_bias_of` takes
    (traced once per code and shapes of what it reads, as :func:`softcap_of` does)."""
    if type(score_mod) is not types.FunctionType:
        return False
    reads = _reads(score_mod, _shape_token)
    if reads is None:
        return False
    key = reads[0]
    hit = _BY_DISTANCE.get(key)
    if hit is not None:
        return hit

    def traced(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score_mod(score, b, h, q_idx, kv_idx)  # type: ignore[no-any-return]

    try:
        found = _graph_by_distance(torch.fx.Tracer().trace(traced))
    except Exception:  # any function fx cannot trace is simply not recognised
        found = False
    if len(_BY_DISTANCE) >= _MAX_CACHED:
        _BY_DISTANCE.clear()
    _BY_DISTANCE[key] = found
    return found


@functools.lru_cache(maxsize=16)
def _distance_indices(
    n: int, heads: int, tq: int, tk: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The arguments of :func:`distance_bias_of`'s two evaluations: a 0 score, ``b``, ``h``,
    queries ``0..Tq-1``, the index 0, keys ``1..Tk-1`` (None for one key)."""
    zero = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device)
    at0 = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device)
    b = torch.arange(n, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    queries = torch.arange(tq, device=device).view(1, 1, -1, 1)
    keys = torch.arange(1, tk, device=device).view(1, 1, 1, -1) if tk > 1 else None
    return zero, b, h, queries, at0, keys


def distance_bias_of(
    score_mod: ScoreMod, shape: ScoreShape, dtype: torch.dtype
) -> DistanceBias | None:
    """The call's ``score_mod`` as a :class:`~attnkit.scores.DistanceBias` (see the module
    docstring for which are), or None.

    The table is ``score_mod(0, b, h, q_idx, kv_idx)`` at the call's own indices: queries
    ``0..Tq-1`` against key 0 (distances ``q_idx - kv_idx >= 0``), and query 0 against keys
    ``1..Tk-1`` (the negative ones), under the caller's grad mode, so tensors the function reads
    get their gradients through it. ``shape``: the call (queries and keys at flex's indices,
    ``0..Tq-1`` and ``0..Tk-1``); ``dtype``: the scores'. A function whose results do not have the
    shapes of those two evaluations, or that raises, is not taken (the call then applies it tile
    by tile, as any other).
    """
    n, heads, tq, tk = shape.batch, shape.heads, shape.q_len, shape.kv_len
    if not tq or not tk or not _by_distance(score_mod):
        return None
    zero, b, h, queries, at0, keys = _distance_indices(n, heads, tq, tk, shape.device, dtype)
    try:
        ahead = score_mod(zero, b, h, queries, at0)
        behind = None if keys is None else score_mod(zero, b, h, at0, keys)
    except (IndexError, RuntimeError, TypeError, ValueError):
        return None
    parts = [(ahead, (n, heads, tq, 1))]
    if behind is not None:
        parts.append((behind, (n, heads, 1, tk - 1)))
    rows = []
    for t, want in parts:
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.ndim > 4:
            return None
        t4 = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
        if any(not one_or(s, w) for s, w in zip(t4.shape, want, strict=True)):
            return None
        rows.append(t4.expand(*t4.shape[:2], *want[2:]).reshape(*t4.shape[:2], -1))
    lead = tuple(max(r.size(d) for r in rows) for d in (0, 1))
    # Distances kv_idx - q_idx from -(Tk - 1) up: queries Tq-1 .. 0 against key 0 (the table's
    # distance k_pos - q_pos is that minus Tk - Tq), then query 0 against keys 1 .. Tk-1.
    ahead2 = rows[0].expand(*lead, tq).flip(-1)
    table = ahead2 if len(rows) == 1 else torch.cat([ahead2, rows[1].expand(*lead, tk - 1)], -1)
    return DistanceBias(table.to(dtype), first=-(tk - 1))


# ------------------------------------------------------------------------------------------------
# Checking that a score_mod is elementwise

# The probe's tile: at most 2 batch rows, 2 heads, 3 queries and 4 keys (rows and keys unequal,
# so a product of the scores with their transpose has the wrong shape).
_PROBE = (2, 2, 3, 4)
# code and shapes of what it reads, the probe's tile, dtype, device type -> elementwise
_ELEMENTWISE_SEEN: dict[tuple[object, ...], bool] = {}


def _probe_tolerance(dtype: torch.dtype) -> float:
    """How far the same elementwise function may land on the same inputs in two tiles (vector
    and scalar code paths round differently); a function that is not elementwise lands much
    further: the probe moves scores by 10."""
    return 1e-10 if dtype == torch.float64 else 1e-4


def check_elementwise(score_mod: ScoreMod, shape: ScoreShape) -> None:
    """Refuse a score_mod that is not elementwise (see :data:`ELEMENTWISE`) with a ValueError.

    FlexAttention calls a score_mod on one score at a time; attnkit calls it on tiles of the
    scores, which gives the same result exactly when the function is elementwise. The probe: the
    function on a tile of the call's first (up to) 2 batch rows, 2 heads, 3 queries and 4 keys,
    with random scores, and on that tile without its first batch row, head, query and key (where
    it has more than one), with about half the scores moved by 10; the two results must agree
    where the scores and indices do. A result that broadcasts to the tile is taken as the tile's
    (a constant such as ``torch.tensor(0.0)``, a function of the indices alone): such a function
    is elementwise, and passes. ``shape``: the call (queries and keys at FlexAttention's indices
    ``0..Q_LEN-1`` and ``0..KV_LEN-1``; ``shape.dtype``, the dtype the scores are computed in).

    A call on one score passes whatever the function; a function that raises on the probe
    raises here (its indices are the call's own). A plain function that passes is not probed
    again for the same code, shapes of what it reads, and tile (as :func:`distance_bias_of`
    keeps its answers), so a call costs a lookup.
    """
    dims = tuple(
        min(n, p)
        for n, p in zip((shape.batch, shape.heads, shape.q_len, shape.kv_len), _PROBE, strict=True)
    )
    if math.prod(dims) <= 1 or shape.device.type == "meta" or torch.compiler.is_compiling():
        return
    dtype = shape.dtype
    key = None
    if type(score_mod) is types.FunctionType:
        reads = _reads(score_mod, _shape_token)
        if reads is not None:
            key = (reads[0], dims, dtype, shape.device.type)
            if key in _ELEMENTWISE_SEEN:
                return
    device = shape.device
    g = torch.Generator().manual_seed(0)  # not the global generator: a probe draws nothing
    s = torch.randn(dims, generator=g, dtype=torch.float64).to(device, dtype)
    idx = index_tensors(dims[0], dims[1], 0, dims[2], 0, dims[3], device)
    # The sub-tile: without the first batch row, head, query and key where there are two or more.
    starts = tuple(1 if n > 1 else 0 for n in dims)
    cut = tuple(slice(o, None) for o in starts)
    sub = s[cut]
    moved = torch.rand(sub.shape, generator=g) < 0.5
    if sub.numel() > 1:  # at least one score moved and one kept
        moved.view(-1)[0], moved.view(-1)[-1] = False, True
    else:
        moved.zero_()
    step = torch.where(torch.rand(sub.shape, generator=g) < 0.5, 10.0, -10.0)
    s2 = sub + (moved * step).to(device, dtype)
    idx2 = tuple(i.narrow(d, starts[d], dims[d] - starts[d]) for d, i in enumerate(idx))
    with torch.no_grad():  # copies: a score_mod may write to its input
        full = apply(score_mod, s.clone(), idx)[cut]
        part = apply(score_mod, s2.clone(), idx2)  # type: ignore[arg-type]
    kept = ~moved.to(device)
    want, got = full[kept].double(), part[kept].double()
    finite = want[torch.isfinite(want)]
    scale = 1.0 + (float(finite.abs().max()) if finite.numel() else 0.0)
    tol = _probe_tolerance(dtype)
    close = torch.isclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True)
    if not bool(close.all()):
        at = int((~close).nonzero()[0, 0])
        where = [int(i.expand(part.shape)[kept][at]) for i in idx2]
        raise ValueError(
            f"score_mod is not elementwise: on a probe tile {shape_str(dims)} and on its "
            f"sub-tile {shape_str(part.shape)} with some other scores changed, it returned "
            f"{float(want[at]):.6g} and {float(got[at]):.6g} for the same score "
            f"{float(s2[kept][at]):.6g} at b={where[0]}, h={where[1]}, q_idx={where[2]}, "
            f"kv_idx={where[3]}. {ELEMENTWISE}"
        )
    if key is not None:
        if len(_ELEMENTWISE_SEEN) >= _MAX_CACHED:
            _ELEMENTWISE_SEEN.clear()
        _ELEMENTWISE_SEEN[key] = True
