"""attnkit under concurrency and interrupts: Python threads calling at once, a KeyboardInterrupt
landing between any two operations of a cache's call, and real SIGINTs during long native calls.

Every thread's result equals, bit for bit, the same call made alone, and records only its own
calls. A cache whose call is interrupted anywhere is left exactly as a twin cache that never saw
the call: the next calls on both give the same outputs bit for bit, and what a rewind can reach
is the same. A SIGINT during a native call ends the process with KeyboardInterrupt once the call
returns, never a hang or a crash.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import MultiHeadAttention, PagedKVCache, StreamingKVCache, attention, masks

# --------------------------------------------------------------------------------------------------
# Threads


def _thread_call(i: int) -> tuple[list[torch.Tensor], list[tuple[str, str, str | None]], str]:
    """Call ``i`` of a mix of shapes, dtypes, masks, backends and gradients: its output (and
    gradients), what record_dispatch() recorded of it, and what explain() says of it."""
    g = torch.Generator().manual_seed(i)
    dtype = (torch.float32, torch.bfloat16, torch.float64)[i % 3]
    b, h, hkv, tq, tk, d = 1 + i % 2, 4, 2 if i % 2 else 4, 17 + 5 * i, 40 + 9 * i, 8 * (1 + i % 3)
    if i % 4 == 3:
        tq = 1  # the decode path
    q = torch.randn(b, h, tq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, tk, d, generator=g).to(dtype) for _ in "kv")
    kw: dict[str, Any] = [
        {"causal": True},
        {"mask": masks.sliding_window(7)},
        {"mask": masks.key_padding([tk // 2, tk][:b])},
        {"mask": masks.key_indices(torch.randint(0, tk, (b, h, tq, 5), generator=g))},
        {"softcap": 4.0, "score_mod": lambda s, b_, h_, qi, ki: s - 0.05 * (qi - ki).abs()},
    ][i % 5]
    backend = ("auto", "chunked", "reference")[i % 3]
    grad = i % 2 == 0
    ins = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    with attnkit.record_dispatch() as record:
        out = attention(*ins, backend=backend, **kw)
    outs = [out.detach()]
    if grad:
        outs += list(torch.autograd.grad(out.float().square().sum(), ins))
    said = str(attnkit.explain(q, k, v, backend=backend, **kw))
    return outs, [(c.chosen, c.served_by, c.kernel) for c in record], said


def test_threads_calling_at_once_get_the_results_and_records_of_their_calls_made_alone() -> None:
    calls = list(range(8))
    alone = [_thread_call(i) for i in calls]
    with attnkit.record_dispatch() as outer, ThreadPoolExecutor(8) as pool:
        together = list(pool.map(_thread_call, calls * 3))
    assert outer == []  # (a thread's calls are its own context's, never the caller's)
    for j, (outs, record, said) in enumerate(together):
        want_outs, want_record, want_said = alone[j % len(calls)]
        assert record == want_record
        assert len(record) == 1
        assert said == want_said
        for got, want in zip(outs, want_outs, strict=True):
            assert torch.equal(got, want)


def _decode(i: int) -> list[torch.Tensor]:
    """A prompt and decode steps on a cache of this call's own (paged, streaming, contiguous)."""
    g = torch.Generator().manual_seed(i)
    dtype = (torch.float32, torch.bfloat16, torch.float64)[i % 3]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    outs: list[torch.Tensor] = []
    kind = i % 3
    with torch.no_grad():
        if kind == 0:
            paged = PagedKVCache(32, 16, num_kv_heads=2, head_dim=16, max_seqs=2, dtype=dtype)
            for t in (37 + i, 1, 1, 1, 3, 1):
                k = r(2, 2, t, 16)
                outs += paged.attention(r(2, 4, t, 16), k, k, causal=True)
                paged.commit()
        elif kind == 1:
            ring = StreamingKVCache(2, 2, 16, sink_tokens=2, window=8, dtype=dtype)
            for t in (5, *[1] * 12, 3, 1):
                k = r(2, 2, t, 16)
                outs += ring.attention(r(2, 4, t, 16), k, k)
        else:
            flat = attnkit.KVCache(2, 64, 2, 16, dtype=dtype)
            for t in (9, 1, 1, 4):
                k = r(2, 2, t, 16)
                flat.update(k, k)
                outs.append(attention(r(2, 4, t, 16), flat.view(), causal=True))
    return outs


def test_threads_decoding_each_on_its_own_cache_equal_their_decodes_alone() -> None:
    alone = [_decode(i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(_decode, range(6)))
    for got, want in zip(together, alone, strict=True):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# A KeyboardInterrupt between any two operations of a cache's call


class _InterruptAt(TorchDispatchMode):
    """Raises KeyboardInterrupt at the ``n``-th tensor operation run under it (what a SIGINT
    does once the operation it arrived in returns); ``ran`` counts them."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.ran = n, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ran += 1
        if self.ran == self.n:
            raise KeyboardInterrupt(f"at operation {self.n}: {func}")
        return func(*args, **(kwargs or {}))


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def _interrupt_everywhere(
    make: Callable[[], Any],
    call: Callable[[Any], object],
    after: Callable[[Any], list[object]],
    stride: int = 1,
) -> None:
    """For every ``n`` (every ``stride``-th), ``call`` on a cache from ``make()`` interrupted at
    its ``n``-th operation, then ``after`` on it, equals ``after`` on a twin never called."""
    n = 1
    while True:
        torch.manual_seed(0)
        cache, twin = make(), make()
        mode = _InterruptAt(n)
        try:
            with torch.no_grad(), mode:
                call(cache)
        except KeyboardInterrupt:
            pass
        else:
            assert n > 1  # (the call ran to its end: every operation before it was tried)
            return
        torch.manual_seed(1)
        with torch.no_grad():
            got = after(cache)
        torch.manual_seed(1)
        with torch.no_grad():
            want = after(twin)
        assert _same(got, want), f"interrupted at operation {n} of the call"
        n += 1 if n < 8 else stride


def _tokens(t: int, heads: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, heads, t, 8, generator=torch.Generator().manual_seed(seed + t))


def _paged(kv_dtype: torch.dtype | None) -> Callable[[], PagedKVCache]:
    def make() -> PagedKVCache:
        cache = PagedKVCache(8, 4, num_kv_heads=2, head_dim=8, max_seqs=2, kv_dtype=kv_dtype)
        cache.attention(_tokens(6, 4), _tokens(6), _tokens(6, seed=1), causal=True)
        cache.commit()
        return cache

    return make


def _paged_after(cache: PagedKVCache) -> list[object]:
    """What a caller sees of a paged cache, then a commit (which must hold nothing of a failed
    call) and the next step's results."""
    seen: list[object] = [cache.lengths, cache.num_free_pages, cache.block_table.clone()]
    cache.commit()
    seen += [cache.lengths, cache.num_free_pages]
    out = cache.attention(_tokens(1, 4, 5), _tokens(1, seed=6), _tokens(1, seed=7), causal=True)
    cache.commit()
    return [*seen, *out, cache.lengths, *cache.view().dense(torch.float32)]


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=str)
@pytest.mark.parametrize("new", [2, 3], ids=["step-in-a-page", "chunk-over-a-page"])
def test_an_interrupted_paged_attention_call_leaves_the_cache_as_before(kv_dtype, new) -> None:
    # PagedKVCache.attention() staged its tokens, then called attention(): when that raised the
    # tokens stayed staged, their new pages taken from the pool and named in the block table, and
    # the next commit() held the tokens of the call that failed.
    def call(cache: PagedKVCache) -> None:
        cache.attention(_tokens(new, 4, 2), _tokens(new, seed=3), _tokens(new, seed=4), causal=True)

    _interrupt_everywhere(_paged(kv_dtype), call, _paged_after, stride=3)


def _ring(kv_dtype: torch.dtype | None) -> Callable[[], StreamingKVCache]:
    """A streaming cache whose ring has wrapped, its last call a chunk (whose commit keeps a copy
    of the slots it wrote over: rewind() can go back to its start)."""

    def make() -> StreamingKVCache:
        cache = StreamingKVCache(2, 2, 8, sink_tokens=2, window=4, kv_dtype=kv_dtype)
        for t in (3, 1, 1, 1, 1, 1, 1, 1):
            cache.attention(_tokens(t, 4, 10 * t), _tokens(t, seed=1), _tokens(t, seed=2))
        cache.attention(_tokens(3, 4), _tokens(3, seed=3), _tokens(3, seed=4))
        return cache

    return make


def _ring_after(cache: StreamingKVCache) -> list[object]:
    """A streaming cache's position and slots, a commit (which must hold nothing of a failed
    call), a rewind to the start of the last chunk held, and the next step's results."""
    slots = [t.clone() for t in (cache.k_cache, cache.v_cache, cache.k_scale) if t is not None]
    seen: list[object] = [cache.position, *slots]
    cache.commit()
    seen.append(cache.position)
    cache.rewind(cache.position - 3)  # (the last chunk's start: reachable only by its copy)
    out = cache.attention(_tokens(1, 4, 5), _tokens(1, seed=6), _tokens(1, seed=7))
    return [*seen, cache.position, *out, *cache.view().dense(torch.float32)]


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=str)
@pytest.mark.parametrize("new", [1, 3], ids=["step", "chunk"])
def test_an_interrupted_streaming_attention_call_leaves_the_cache_as_before(kv_dtype, new) -> None:
    # StreamingKVCache.attention() dropped its stage only when attention() raised: an interrupt
    # in its stage (after the step's write, or after the copy kept for rewind() was let go) left
    # the step staged (a later commit() held it) or the last chunk out of rewind()'s reach.
    def call(cache: StreamingKVCache) -> None:
        cache.attention(_tokens(new, 4, 2), _tokens(new, seed=3), _tokens(new, seed=4))

    _interrupt_everywhere(_ring(kv_dtype), call, _ring_after, stride=3)


def test_an_interrupted_module_call_on_a_streaming_cache_leaves_it_as_before() -> None:
    # The module committed a streaming cache's chunk after its try: an interrupt in the commit's
    # writes left the ring half written (keys of the new tokens beside values of the old ones).
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0))

    def make() -> StreamingKVCache:
        cache = StreamingKVCache(2, 2, 4, sink_tokens=2, window=4)
        with torch.no_grad():
            module(x[:, :5], cache=cache, causal=True)
            module(x[:, 5:6], cache=cache, causal=True)
        return cache

    def after(cache: StreamingKVCache) -> list[object]:
        seen: list[object] = [cache.position, cache.k_cache.clone(), cache.v_cache.clone()]
        cache.commit()
        return [*seen, cache.position, module(x[:, 8:], cache=cache, causal=True)]

    _interrupt_everywhere(make, lambda c: module(x[:, 6:8], cache=c, causal=True), after, stride=4)


# --------------------------------------------------------------------------------------------------
# Real signals

_CHILD = """
import sys, time, torch, attnkit
from attnkit import attention, masks
g = torch.Generator().manual_seed(0)
what = sys.argv[1]
if what == "decode":
    cache = attnkit.StreamingKVCache(1, 2, 64, sink_tokens=4, window=512)
    replay = attnkit.StreamingKVCache(1, 2, 64, sink_tokens=4, window=512)
    steps = []
    print("ready", flush=True)
    try:
        with torch.no_grad():
            while True:
                q, k = torch.randn(1, 8, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g)
                steps.append((q, k))
                cache.attention(q, k, k)
    except KeyboardInterrupt:
        with torch.no_grad():  # the cache holds exactly the steps that returned
            for q, k in steps[: cache.position]:
                replay.attention(q, k, k)
        held = cache.length  # (a dropped step's slot past them holds what it was given)
        same = torch.equal(cache.k_cache[:, :, :held], replay.k_cache[:, :, :held])
        same = same and cache.position >= len(steps) - 1
        print("consistent" if same else "INCONSISTENT", flush=True)
        raise
q = torch.randn(1, 8, int(sys.argv[2]), 64, generator=g)
print("ready", flush=True)
if what == "forward":
    attention(q, q, q, backend="chunked")
elif what == "backward":
    q.requires_grad_()
    attention(q, q, q, causal=True, backend="chunked").sum().backward()
elif what == "index":
    idx = torch.randint(0, q.size(2), (1, 8, q.size(2), 256), generator=g)
    attention(q, q, q, mask=masks.key_indices(idx), backend="chunked")
print("returned", flush=True)
time.sleep(30)  # (the SIGINT arrived during the call: Python raises once it returns)
"""


@pytest.mark.parametrize(
    ("what", "size"), [("forward", 8192), ("backward", 4096), ("index", 16384), ("decode", 0)]
)
def test_a_sigint_during_a_native_call_ends_the_process_with_keyboard_interrupt(
    what: str, size: int
) -> None:
    if not attnkit._native.load():
        pytest.skip("no native kernel")
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CHILD), what, str(size)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    child.send_signal(signal.SIGINT)
    try:
        out, err = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail(f"{what}: the process still ran 60 s after SIGINT")
    assert child.returncode in (1, -signal.SIGINT, 130), (child.returncode, err[-2000:])
    assert "KeyboardInterrupt" in err or child.returncode == -signal.SIGINT
    if what == "decode":
        assert out.split()[-1] == "consistent"


def test_native_load_racing_in_threads_of_a_fresh_process_loads_once() -> None:
    # The library and the fake kernels registered by the first thread; the others wait for it,
    # and every one's call after that runs the native kernel.
    if not attnkit._native.load():
        pytest.skip("no native kernel")
    code = textwrap.dedent("""
        import threading, torch, attnkit
        from attnkit import _native, attention
        start = threading.Barrier(4)
        got = []
        def go():
            start.wait()
            ok = _native.load()
            q = torch.ones(1, 1, 4, 8)
            with attnkit.record_dispatch() as record:
                out = attention(q, q, q, backend="chunked")
            got.append((ok, _native.ready(), record[0].kernel, float(out.sum())))
        threads = [threading.Thread(target=go) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print(sorted(set(got)))
    """)
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert ran.stdout.strip() == "[(True, True, 'native kernel', 32.0)]"
    assert "warn" not in ran.stderr.lower()


def test_a_thread_interrupted_by_its_callback_leaves_the_others_unharmed() -> None:
    # A score_mod that raises KeyboardInterrupt in one thread: the other threads' calls and
    # records are as alone, and the interrupted thread's next call is too.
    def mod(s, b, h, qi, ki):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "stopped":
            raise KeyboardInterrupt
        return s + torch.where(qi >= ki, 0.0, -0.5) * torch.cos(s)

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 2, 30, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)
    want = attention(q, k, k, score_mod=mod)
    got: dict[str, object] = {}

    def work(name: str) -> None:
        try:
            with attnkit.record_dispatch() as record:
                got[name] = attention(q, k, k, score_mod=mod)
        except KeyboardInterrupt:
            got[name] = "interrupted"
        got[name + " record"] = len(record)

    threads = [threading.Thread(target=work, args=(n,), name=n) for n in ("a", "stopped", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got["stopped"] == "interrupted"
    for name in ("a", "b"):
        assert torch.equal(got[name], want)  # type: ignore[arg-type]
        assert got[name + " record"] == 1
    assert torch.equal(attention(q, k, k, score_mod=mod), want)


def test_record_dispatch_blocks_closed_out_of_order_each_stop_recording() -> None:
    # Two generations, each a generator with a record_dispatch() block open around its yield,
    # run in turns: the first closed while the second was open. The block's exit restored the
    # value it had found (the second's record), so the second, once closed, restored the first's:
    # a record of a closed block went on recording every later call of the thread.
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))

    def generation(steps: int, records: list[list[Any]]):  # type: ignore[no-untyped-def]
        with attnkit.record_dispatch() as record:
            records.append(record)
            for _ in range(steps):
                attention(q, q, q)
                yield

    records: list[list[Any]] = []
    first, second = generation(2, records), generation(3, records)
    for g in (first, second, first, second, first, second, second):
        next(g, None)
    sizes = [len(r) for r in records]
    assert sum(sizes) == 5  # every call made while a block was open, recorded once
    attention(q, q, q)
    with attnkit.record_dispatch() as later:
        attention(q, q, q)
    assert [len(r) for r in records] == sizes  # closed: nothing more
    assert len(later) == 1


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=str)
def test_a_streaming_step_staged_again_before_its_commit_is_dropped_whole(kv_dtype) -> None:
    # A second stage() of a step before the first was committed (a retried step) kept, for its
    # undo, the first stage's token rather than the one the ring held: dropping it put back the
    # retried token, and the window's oldest token was lost (rewind() one step was refused).
    def make() -> StreamingKVCache:
        cache = StreamingKVCache(2, 2, 8, sink_tokens=1, window=3, kv_dtype=kv_dtype)
        for t in range(6):
            cache.attention(_tokens(1, 4, t), _tokens(1, seed=t), _tokens(1, seed=t + 9))
        return cache

    cache, twin = make(), make()
    with torch.no_grad():
        cache.stage(_tokens(1, seed=20), _tokens(1, seed=21))
        cache.stage(_tokens(1, seed=22), _tokens(1, seed=23))
    cache.rewind(cache.position)  # (drops the stage)
    seen = []
    for c in (cache, twin):
        slots = [t.clone() for t in (c.k_cache, c.v_cache, c.k_scale) if t is not None]
        c.rewind(c.position - 1)
        out = c.attention(_tokens(1, 4, 30), _tokens(1, seed=31), _tokens(1, seed=32))
        seen.append([c.position, *slots, *out, *c.view().dense(torch.float32)])
    assert _same(seen[0], seen[1])


def _kept_kv(kv_dtype: torch.dtype | None) -> attnkit.KVCache:
    cache = attnkit.KVCache(2, 16, 2, 8, kv_dtype=kv_dtype)
    with torch.no_grad():
        cache.update(_tokens(9), _tokens(9, seed=1))
    return cache


def _kept_paged(kv_dtype: torch.dtype | None) -> PagedKVCache:
    cache = PagedKVCache(8, 4, num_kv_heads=2, head_dim=8, max_seqs=2, kv_dtype=kv_dtype)
    with torch.no_grad():
        cache.stage(_tokens(9), _tokens(9, seed=1))
    cache.commit()
    return cache


_KEPT = torch.tensor([[0, 2, 3, 7, 8], [1, 4, 5, 6, 8]])  # per key/value head


def _kv_seen(cache: attnkit.KVCache) -> list[object]:
    with torch.no_grad():
        return [cache.length, attention(_tokens(1, 4, 3), cache.view())]


def _paged_seen(cache: PagedKVCache) -> list[object]:
    seen: list[object] = [cache.lengths, cache.num_free_pages, cache.block_table.clone()]
    with torch.no_grad():
        out = cache.attention(_tokens(1, 4, 3), _tokens(1, seed=5), _tokens(1, seed=6))
    return [*seen, *out]


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=str)
@pytest.mark.parametrize("kind", ["KVCache", "PagedKVCache"])
def test_an_interrupted_eviction_leaves_the_cache_as_before_or_as_after(kind, kv_dtype) -> None:
    # keep() moved the keys, then the values (then an int8 cache's scales), then set the length:
    # an interrupt between two moves left the keys of the kept tokens beside the values of the
    # old ones, at the old length, and attention read that mix.
    if kind == "KVCache":
        make, seen = _kept_kv, _kv_seen
        keep: Callable[[Any], None] = lambda c: c.keep(_KEPT.expand(2, 2, 5))  # noqa: E731
    else:
        make, seen = _kept_paged, _paged_seen  # type: ignore[assignment]
        keep = lambda c: c.keep(1, _KEPT)  # noqa: E731
    before = seen(make(kv_dtype))
    done = make(kv_dtype)
    keep(done)
    after = seen(done)
    n = 1
    while True:
        cache = make(kv_dtype)
        try:
            with _InterruptAt(n):
                keep(cache)
        except KeyboardInterrupt:
            got = seen(cache)
            assert _same(got, before) or _same(got, after), f"interrupted at operation {n}"
            n += 1
            continue
        break
    assert n > 10


_FORK_CHILD = """
import fcntl, os, signal, sys, threading, time
from attnkit._native import build
name = build.build_name(build.capability())
folder = build.cache_dir() / name
folder.mkdir(parents=True)
holder = open(folder / "build.lock", "a")  # another builder's lock: load() waits for it
fcntl.flock(holder, fcntl.LOCK_EX)
loading = threading.Thread(target=build.load)
loading.start()
while not build._LOCK.locked():  # the thread is inside load(), holding its lock
    time.sleep(0.01)
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    print("child", build.load(), build.state().why.split(" s ")[0], flush=True)
    os._exit(0)
loading.join()
_, status = os.waitpid(pid, 0)
print("status", status, flush=True)
"""


def test_a_process_forked_while_a_thread_loads_the_kernel_can_load_it(tmp_path) -> None:
    # A thread loading (or building, a minute) the native kernel held the loader's lock when
    # the main thread forked (a DataLoader's workers): the child's first call waited for a lock
    # no thread of its own would ever release.
    from attnkit._native.build import compiler

    if compiler() is None or not hasattr(os, "fork"):
        pytest.skip("no C++ compiler (load() then returns before it waits) or no fork()")
    env = {
        **os.environ,
        "ATTNKIT_CACHE_DIR": str(tmp_path),
        "ATTNKIT_BUILD_TIMEOUT": "1",
        "ATTNKIT_NATIVE": "1",
    }
    ran = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(_FORK_CHILD)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    lines = ran.stdout.split("\n")
    assert "child False waited 1" in lines, ran.stdout + ran.stderr
    assert "status 0" in lines, ran.stdout + ran.stderr


def test_calls_in_threads_sharing_one_record_each_get_their_own_kernel() -> None:
    # asyncio.to_thread() runs a function in a copy of the caller's context, the open record
    # with it: the kernel a call noted went to the record's last entry, which another thread's
    # call had appended meanwhile (a reference call recorded as served by the native kernel).
    import asyncio

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 300, 32, generator=g)
    p = torch.randn(1, 2, 64, 32, generator=g)

    def chunked() -> torch.Tensor:
        return attention(q, q, q, softcap=5.0)

    def reference() -> torch.Tensor:
        return attention(p, p, p, backend="reference")

    assert attnkit.explain(q, q, q, softcap=5.0).chosen == "chunked"
    with attnkit.record_dispatch() as record:
        alone = chunked()
        kernel = record[0].kernel

        async def together() -> list[torch.Tensor]:
            runs = [asyncio.to_thread(f) for f in (chunked, reference) * 20]
            return list(await asyncio.gather(*runs))

        outs = asyncio.run(together())
    assert kernel is not None
    assert len(record) == 41
    for d in record:
        assert (d.chosen, d.kernel) in (("chunked", kernel), ("reference", None))
    for out in outs[::2]:
        assert torch.equal(out, alone)
