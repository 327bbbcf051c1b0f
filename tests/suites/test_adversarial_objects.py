"""attnkit's objects copied, serialized and moved: masks, score terms, caches mid-generation and
modules through ``copy``, ``pickle``, ``torch.save``, ``state_dict()``, dtype and device moves.

Each test compares numbers: the object after the round trip against the original on the same
inputs (bit for bit), a float64 computation without a cache, or the module in float64.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit import KVCache, PagedKVCache, StreamingKVCache, masks
from attnkit.interop.deepseek import FrequencyRotary
from attnkit.modules.latent import LatentCache, MultiHeadLatentAttention
from attnkit.scores import DistanceBias, RelativePositionTerm

F64 = torch.float64
B, H, HKV, D = 2, 4, 2, 8
ROUND_TRIPS = ("deepcopy", "pickle", "torch.save")


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def round_trip(obj: Any, how: str) -> Any:
    """``obj`` copied by ``copy.deepcopy``, ``copy.copy``, ``pickle`` or ``torch.save``/
    ``torch.load``."""
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "copy":
        return copy.copy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# --------------------------------------------------------------------------------------------------
# Masks and score terms


def _masks() -> dict[str, masks.Mask]:
    gen = torch.Generator().manual_seed(0)
    t = 7
    picks = torch.stack([torch.randperm(t, generator=gen)[:3] for _ in range(B * H)])
    idx = picks.view(B, H, 1, 3).expand(B, H, t, 3).contiguous()
    dense = torch.rand(t, t, generator=gen) > 0.3
    return {
        "causal": masks.causal(),
        "causal_top_left": masks.causal("top_left"),
        "window": masks.sliding_window(2, 1),
        "documents": masks.documents([3, 4]),
        "document_ids": masks.documents(ids=torch.tensor([[0, 0, 1, 1, 1, 2, 2]])),
        "key_padding": masks.key_padding(torch.tensor([5, 7])),
        "key_padding_left": masks.key_padding([5, 7], side="left"),
        "key_padding_valid": masks.key_padding(valid=torch.rand(B, t, generator=gen) > 0.3),
        "dense": masks.from_tensor(dense),
        "key_indices": masks.key_indices(idx),
        "block_indices": masks.block_indices(torch.zeros(B, H, t, 1, dtype=torch.long), block=4),
        "and": masks.causal() & masks.key_padding([5, 7]),
        "or": masks.sliding_window(1) | masks.documents([3, 4]),
        "tensor_and": dense & masks.causal(),
        "indices_and": masks.key_indices(idx) & masks.causal(),
    }


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
def test_masks_and_score_terms_attend_the_same_after_a_round_trip(how: str) -> None:
    gen = torch.Generator().manual_seed(1)
    t = 7
    q, k, v = (randn(B, H, t, D, gen=gen, dtype=F64) for _ in range(3))
    for name, mask in _masks().items():
        want = attnkit.attention(q, k, v, mask=mask)  # (caches the mask's per-device copies)
        copied = round_trip(mask, how)
        torch.testing.assert_close(
            attnkit.attention(q, k, v, mask=copied), want, rtol=0, atol=0, equal_nan=True
        )
        dense = (t, t)
        assert torch.equal(
            copied.dense(*dense, batch_size=B, num_heads=H),
            mask.dense(*dense, batch_size=B, num_heads=H),
        ), name
        assert copied.describe() == mask.describe(), name
    terms = {
        "alibi": attnkit.alibi_term(attnkit.alibi_slopes(H).double(), t, t),
        "distance": DistanceBias(randn(H, 2 * t - 1, gen=gen, dtype=F64), -(t - 1)),
        "relative": RelativePositionTerm(
            randn(B, H, t, D, gen=gen, dtype=F64), randn(H, 2 * t - 1, D, gen=gen, dtype=F64), 0.3
        ),
    }
    for name, term in terms.items():
        want = attnkit.attention(q, k, v, bias=term, causal=True)
        got = attnkit.attention(q, k, v, bias=round_trip(term, how), causal=True)
        assert torch.equal(got, want), name


# --------------------------------------------------------------------------------------------------
# Caches mid-generation

F8 = torch.float8_e4m3fn
LATENT_DV = 4  # a values_in_keys cache's values: its keys' first 4 columns


class Decode:
    """A cache kind and the step that appends new tokens and attends over it."""

    def __init__(self, make: Callable[[], Any], step: Callable[..., Tensor], latent: bool):
        self.make, self.step, self.latent = make, step, latent

    def inputs(
        self, t: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``t`` new tokens' queries, keys and values (values the keys' first columns for a
        latent cache)."""
        hkv = 1 if self.latent else HKV
        q, k = randn(B, H, t, D, gen=gen, dtype=dtype), randn(B, hkv, t, D, gen=gen, dtype=dtype)
        v = k[..., :LATENT_DV].clone() if self.latent else randn(B, hkv, t, D, gen=gen, dtype=dtype)
        return q, k, v


def _kv_step(cache: KVCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    view = cache.stage_call(q, k, None if cache.values_in_keys else v)
    out = attnkit.attention(q, view, causal=True)
    cache.commit()
    return out


def _paged_step(cache: PagedKVCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    out, _ = cache.attention(q, k, None if cache.values_in_keys else v, causal=True)
    cache.commit()
    return out


def _streaming_step(cache: StreamingKVCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return cache.attention(q, k, v)[0]


def _latent_step(cache: LatentCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    keys = cache.stage(k)
    cache.commit()
    return attnkit.attention(q, keys, cache.values(keys), causal=True)


def _decodes() -> dict[str, Decode]:
    out = {}
    for kv_dtype in (None, torch.int8, F8):
        tag = "float" if kv_dtype is None else str(kv_dtype).split(".")[-1]
        for latent in (False, True):
            hkv, dv = (1, LATENT_DV) if latent else (HKV, D)
            kw = {"kv_dtype": kv_dtype, "values_in_keys": latent}
            name = f"{tag}{'-latent' if latent else ''}"
            out[f"kv-{name}"] = Decode(
                lambda hkv=hkv, dv=dv, kw=kw: KVCache(B, 32, hkv, D, dv, **kw), _kv_step, latent
            )
            out[f"paged-{name}"] = Decode(
                lambda hkv=hkv, dv=dv, kw=kw: PagedKVCache(16, 4, hkv, D, dv, max_seqs=B, **kw),
                _paged_step,
                latent,
            )
        out[f"streaming-{tag}"] = Decode(
            lambda kv_dtype=kv_dtype: StreamingKVCache(
                B, HKV, D, sink_tokens=2, window=3, kv_dtype=kv_dtype
            ),
            _streaming_step,
            False,
        )
    out["latent"] = Decode(lambda: LatentCache(B, 32, LATENT_DV, D - LATENT_DV), _latent_step, True)
    return out


DECODES = _decodes()


@pytest.mark.parametrize("how", ROUND_TRIPS)
@pytest.mark.parametrize("kind", DECODES)
def test_a_cache_copied_mid_generation_decodes_as_the_original_and_on_its_own(
    kind: str, how: str
) -> None:
    # pickle broke two kinds. A values_in_keys cache (a latent one: values that are a view of
    # its keys) came back with its values a copy beside the keys, so that the next tokens'
    # values were never written where the keys were and the copy attended stale values. A
    # float8 cache could not be loaded at all: torch's unpickler fails on float8 tensors
    # (AttributeError: 'UntypedStorage' has no attribute 'dtype').
    decode = DECODES[kind]
    gen = torch.Generator().manual_seed(0)
    original, twin = decode.make(), decode.make()
    with torch.no_grad():
        for t in (5, 1):  # a prompt, then a step
            x = decode.inputs(t, gen)
            decode.step(original, *x)
            decode.step(twin, *x)
        copied = round_trip(original, how)
        # The copy decodes as the original would ...
        for t in (1, 2, 1):
            x = decode.inputs(t, gen)
            torch.testing.assert_close(
                decode.step(copied, *x), decode.step(twin, *x), rtol=0, atol=0
            )
        # ... and on its own: what it wrote is nowhere in the original.
        x = decode.inputs(1, gen)
        assert torch.equal(decode.step(original, *x), _replay(decode, x))


@pytest.mark.parametrize("kind", DECODES)
def test_a_cache_on_the_meta_device_refuses_keys_of_another_dtype_as_on_the_cpu(kind: str) -> None:
    # The refusal asks whether autocast is on for the keys' device, to say why they may come in
    # another dtype: asked about "meta", torch raised a RuntimeError ("unknown device type for
    # autocast") in place of the TypeError a cache on the CPU gives.
    decode = DECODES[kind]
    gen = torch.Generator().manual_seed(0)
    errors = []
    for device in ("cpu", "meta"):
        cache = decode.make().to(device=device)
        with torch.no_grad():
            decode.step(cache, *(t.to(device) for t in decode.inputs(3, gen)))
            wrong = tuple(t.to(device) for t in decode.inputs(1, gen, F64))
            with pytest.raises(TypeError) as refused:
                decode.step(cache, *wrong)
        errors.append(str(refused.value).replace(device, "DEVICE"))
    assert errors[0] == errors[1]


def _replay(decode: Decode, last: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """What a fresh cache given the test's prompt and first step, then ``last``, gives for
    ``last``: the original's output, if its copy changed nothing in it."""
    gen = torch.Generator().manual_seed(0)
    cache = decode.make()
    for t in (5, 1):
        decode.step(cache, *decode.inputs(t, gen))
    return decode.step(cache, *last)


# --------------------------------------------------------------------------------------------------
# Modules

WIDTH = 16
#: a model's rotary frequencies, on the host (under torch.device("meta") too)
FREQUENCIES = torch.tensor([1.0, 0.03], dtype=F64)


def _module(name: str, **kw: Any) -> nn.Module:
    """A small module of each kind attnkit has, with ``kw`` (``device``, ``dtype``)."""
    if name == "mha":
        return attnkit.MultiHeadAttention(WIDTH, 4, num_kv_heads=2, **kw)
    if name == "mha-cross":
        return attnkit.MultiHeadAttention(
            WIDTH, 4, kdim=12, vdim=10, add_bias_kv=True, add_zero_attn=True, **kw
        )
    if name == "mha-rotary":
        return attnkit.MultiHeadAttention(WIDTH, 4, rotary=attnkit.RotaryEmbedding(4), **kw)
    if name == "mha-frequencies":  # a rotary of a model's own frequencies, a buffer
        rotary = FrequencyRotary(FREQUENCIES, scaling=1.1)
        return attnkit.MultiHeadAttention(WIDTH, 4, rotary=rotary, **kw)
    if name == "mla":
        return MultiHeadLatentAttention(
            WIDTH, 2, kv_lora_rank=8, q_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4,
            v_head_dim=4, proj_bias=True, **kw,
        )  # fmt: skip
    if name == "relative":
        return attnkit.RelativeMultiHeadAttention(WIDTH, 4, **kw)
    if name == "relative-espnet":
        return attnkit.RelativeMultiHeadAttention(
            WIDTH, 4, legacy="espnet", legacy_max_len=32, **kw
        )
    if name == "conformer":
        return attnkit.ConformerLayer(WIDTH, 4, kernel_size=3, dropout=0.0, **kw)
    if name == "encoder":
        return attnkit.TransformerEncoderLayer(WIDTH, 4, dropout=0.0, **kw)
    if name == "decoder":
        return attnkit.TransformerDecoderLayer(WIDTH, 4, dropout=0.0, **kw)
    if name == "transformer":
        return attnkit.Transformer(
            WIDTH, 4, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0, **kw
        )
    return attnkit.RelativePositionEmbedding(WIDTH, **kw)


MODULES = (
    "mha", "mha-cross", "mha-rotary", "mha-frequencies", "mla", "relative", "relative-espnet",
    "conformer", "encoder", "decoder", "transformer", "relative-position",
)  # fmt: skip


def _inputs(
    name: str, dtype: torch.dtype = F64, device: str = "cpu"
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a call of the module ``name``, the same every time (in ``dtype`` on
    ``device``)."""
    gen = torch.Generator().manual_seed(1)

    def x(*shape: int) -> Tensor:
        return randn(*shape, gen=gen).to(dtype=dtype, device=device)

    inputs = x(2, 6, WIDTH)
    if name == "mha-cross":
        return (inputs, x(2, 5, 12), x(2, 5, 10)), {}
    if name in ("mha", "mha-rotary", "mha-frequencies", "mla", "encoder"):
        return (inputs,), {"causal": True}
    if name == "decoder":
        return (inputs, x(2, 4, WIDTH)), {}
    if name == "transformer":
        return (x(2, 4, WIDTH), inputs), {}
    if name == "relative-position":
        return (5, -5), {}
    return (inputs,), {}


def _run(name: str, m: nn.Module, dtype: torch.dtype = F64, device: str = "cpu") -> Tensor:
    """``m``'s output on :func:`_inputs`."""
    args, kwargs = _inputs(name, dtype, device)
    out: Tensor = m(*args, **kwargs)
    return out


@pytest.mark.parametrize("name", MODULES)
def test_a_module_copied_saved_or_reloaded_gives_the_same_outputs(name: str) -> None:
    torch.manual_seed(0)
    m = _module(name, dtype=F64).eval()
    with torch.no_grad():
        want = _run(name, m)
        for how in ROUND_TRIPS:
            assert torch.equal(_run(name, round_trip(m, how)), want), how
        fresh = _module(name, dtype=F64).eval()
        fresh.load_state_dict(m.state_dict(), strict=True)
        assert torch.equal(_run(name, fresh), want)
        # A checkpoint of the state only loads with weights_only=True.
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
        buf.seek(0)
        fresh = _module(name, dtype=F64).eval()
        fresh.load_state_dict(torch.load(buf, weights_only=True), strict=True)
        assert torch.equal(_run(name, fresh), want)
        # On the meta device, where a call without gradients gives the output's shape and
        # dtype (the relative position embedding asked torch whether autocast is on for "meta",
        # a device torch's autocast does not know: RuntimeError), then materialised and loaded.
        moved = copy.deepcopy(m).to("meta")
        shape = _run(name, moved, device="meta")
        assert (shape.device.type, shape.shape, shape.dtype) == ("meta", want.shape, want.dtype)
        if name == "relative-position":  # a table long enough to be mirrored, with gradients
            assert moved(40, -40).shape == m(40, -40).shape
        moved = moved.to_empty(device="cpu")
        moved.load_state_dict(m.state_dict(), strict=True)
        with torch.device("meta"):
            built = _module(name, dtype=F64)
        built = built.to_empty(device="cpu").eval()
        built.load_state_dict(m.state_dict(), strict=True)
        assert torch.equal(_run(name, moved), want)
        assert torch.equal(_run(name, built), want)
        with torch.device("meta"):  # built there, given the checkpoint's tensors themselves
            assigned = _module(name, dtype=F64)
        assigned.load_state_dict(m.state_dict(), strict=True, assign=True)
        assert torch.equal(_run(name, assigned.eval()), want)
        # Other parameters through torch.func.functional_call, and the module's own after.
        other = _module(name, dtype=F64).eval()
        replaced = torch.func.functional_call(m, other.state_dict(), *_inputs(name))
        torch.testing.assert_close(replaced, _run(name, other))
        assert torch.equal(_run(name, m), want)
    frozen = copy.deepcopy(m).requires_grad_(False)
    torch.testing.assert_close(_run(name, frozen), want)


@pytest.mark.parametrize("name", MODULES)
def test_a_module_built_on_meta_is_initialised_by_reset_parameters(name: str) -> None:
    # Deferred initialisation (FSDP's): build on the meta device, to_empty(), then
    # reset_parameters() on every module that has one. RelativeMultiHeadAttention and
    # RelativePositionEmbedding had none, and their pos_bias_u, pos_bias_v and position
    # projection (a ConformerLayer's too) kept whatever memory to_empty() gave them; a
    # FrequencyRotary's frequencies, a buffer outside state_dict(), were lost the same way, and
    # load_state_dict() has none to give back.
    with torch.device("meta"):
        m = _module(name, dtype=F64)
    m = m.to_empty(device="cpu").eval()
    with torch.no_grad():
        for t in (*m.parameters(), *m.buffers()):
            if t.is_floating_point():
                t.fill_(float("nan"))  # (what to_empty() left: any bits)
    for module in m.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    state = m.state_dict()
    held = [*m.named_parameters(), *m.named_buffers()]  # (buffers outside state_dict() too)
    assert [k for k, t in held if t.is_floating_point() and t.isnan().any()] == []
    if not name.startswith("relative"):
        return
    # The relative modules' reset_parameters() draws what their constructor draws, in the same
    # order (MultiHeadAttention's constructor draws more: nn.Linear's own initialisation of
    # out_proj, before its reset_parameters() call).
    torch.manual_seed(3)
    m.reset_parameters()
    torch.manual_seed(3)
    built = _module(name, dtype=F64).eval()
    for key, t in built.state_dict().items():
        assert torch.equal(state[key], t), key
    with torch.no_grad():
        assert torch.equal(_run(name, m), _run(name, built))


class _Halved(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        return w * 0.5


@pytest.mark.parametrize("name", ["mha", "mha-cross", "mla", "relative", "conformer"])
def test_parametrized_and_spectral_normed_modules_compute_with_the_weights_they_make(
    name: str,
) -> None:
    torch.manual_seed(0)
    m = _module(name, dtype=F64).eval()
    plain = copy.deepcopy(m)
    for key, _ in list(m.named_parameters()):
        *path, leaf = key.split(".")
        owner, twin = m, plain
        for part in path:
            owner, twin = getattr(owner, part), getattr(twin, part)
        nn.utils.parametrize.register_parametrization(owner, leaf, _Halved())
        with torch.no_grad():
            getattr(twin, leaf).mul_(0.5)
    with torch.no_grad():
        want = _run(name, plain)
        # (torch pickles a parametrized module through its state_dict() only)
        for got in (_run(name, m), _run(name, copy.deepcopy(m))):
            torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(_run(name, m), _run(name, plain), rtol=1e-14, atol=1e-14)
    # torch's hook-based spectral norm on the output projection: computed with the weight it
    # sets, W / sigma, which the plain module takes as its own.
    normed = copy.deepcopy(plain)
    out_proj = normed.out_proj if name != "conformer" else normed.attn.out_proj
    nn.utils.spectral_norm(out_proj)
    with torch.no_grad():
        got = _run(name, normed)  # (in eval: the weight its last power iteration set)
        target = plain.out_proj if name != "conformer" else plain.attn.out_proj
        target.weight.copy_(out_proj.weight)
        torch.testing.assert_close(got, _run(name, plain), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(_run(name, round_trip(normed, "deepcopy")), got)


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_module_converted_or_loaded_across_dtypes_computes_on_its_rounded_parameters(
    name: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    m32 = _module(name).eval()
    converted = copy.deepcopy(m32).to(dtype)
    loaded = _module(name, dtype=dtype).eval()  # float32 weights loaded into a dtype module
    loaded.load_state_dict(m32.state_dict(), strict=True)
    exact = copy.deepcopy(converted).double()  # float64 on the rounded parameters
    tol = {torch.float16: 2e-2, torch.bfloat16: 8e-2, torch.float32: 1e-5}[dtype]
    with torch.no_grad():
        got = _run(name, converted, dtype)
        assert torch.equal(_run(name, loaded, dtype), got)
        torch.testing.assert_close(got.double(), _run(name, exact), rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------------
# Caches and modules moved mid-generation


def _uncached(kind: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The float64 attention of the last queries ``q`` over every token so far ``k``, ``v``
    without a cache: causal, or a streaming cache's sinks and window."""
    mask: masks.Mask = masks.causal()
    if kind.startswith("streaming"):
        mask = masks.sliding_window(3 - 1) | (masks.causal() & masks.key_padding([2] * B))
    return attnkit.attention(q.double(), k.double(), v.double(), mask=mask)


@pytest.mark.parametrize("kind", DECODES)
def test_a_cache_moved_to_another_dtype_or_to_meta_mid_generation_decodes_on(kind: str) -> None:
    decode = DECODES[kind]
    quantized = "int8" in kind or "float8" in kind
    gen = torch.Generator().manual_seed(0)
    moved, kept, meta = decode.make(), decode.make(), decode.make()
    ks, vs = [], []
    with torch.no_grad():
        for t in (5, 1):  # in float32
            x = decode.inputs(t, gen)
            for cache in (moved, kept, meta):
                decode.step(cache, *x)
            ks.append(x[1])
            vs.append(x[2])
        moved.to(dtype=F64)
        meta.to(device="meta")
        for t in (1, 2, 1):  # in float64 (float32 numbers), on meta in float32
            q, k, v = decode.inputs(t, gen)
            got = decode.step(moved, q.double(), k.double(), v.double())
            ks.append(k)
            vs.append(v)
            if quantized:  # what the cache holds is its own numbers: the float32 cache's
                want = decode.step(kept, q, k, v).double()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                want = _uncached(kind, q, torch.cat(ks, 2), torch.cat(vs, 2))
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            on_meta = decode.step(meta, q.to("meta"), k.to("meta"), v.to("meta"))
            assert (on_meta.device.type, on_meta.shape) == ("meta", got.shape)


class _Decoder(nn.Module):
    """A module that holds its paged cache: ``module.double()`` moves the pages with it."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = attnkit.MultiHeadAttention(WIDTH, 4, num_kv_heads=2)
        self.cache = self.attn.make_paged_cache(8, 4, max_seqs=2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.attn(x, causal=True, cache=self.cache)
        return out


def test_modules_converted_to_float64_mid_generation_decode_as_float64_without_a_cache() -> None:
    torch.manual_seed(0)
    x = randn(2, 9, WIDTH, gen=torch.Generator().manual_seed(1))
    holder = _Decoder().eval()
    mla = _module("mla").eval()
    caches = {
        "latent": lambda: mla.make_cache(2, 16),
        "kv": lambda: mla.make_kv_cache(2, 16),
        "paged": lambda: mla.make_paged_cache(8, 4, max_seqs=2),
    }
    with torch.no_grad():
        holder(x[:, :5])  # a float32 prompt, then float64 steps
        holder.double()
        steps = torch.cat([holder(x[:, i : i + 1].double()) for i in range(5, 9)], 1)
        want = copy.deepcopy(holder.attn)(x.double(), causal=True)[:, 5:]
        torch.testing.assert_close(steps, want, rtol=1e-5, atol=1e-6)  # (a float32 prompt)
        for name, make in caches.items():
            m, cache = copy.deepcopy(mla), make()
            m(x[:, :5], causal=True, cache=cache)
            m.double()
            cache.to(dtype=F64)
            steps = torch.cat(
                [m(x[:, i : i + 1].double(), causal=True, cache=cache) for i in range(5, 9)], 1
            )
            want = m(x.double(), causal=True)[:, 5:]
            torch.testing.assert_close(steps, want, rtol=1e-5, atol=1e-6, msg=name)


def test_a_latent_cache_refuses_a_dtype_it_cannot_hold_latents_in() -> None:
    # LatentCache.to(dtype=torch.int64) (or bool, or a float8 dtype) converted the latents held
    # and went on: the next tokens were refused for their dtype, and the cache's tokens were
    # already truncated to integers.
    gen = torch.Generator().manual_seed(0)
    decode = DECODES["latent"]
    cache, twin = decode.make(), decode.make()
    with torch.no_grad():
        x = decode.inputs(5, gen)
        decode.step(cache, *x)
        decode.step(twin, *x)
        for dtype in (torch.int64, torch.bool, torch.float8_e4m3fn):
            with pytest.raises(TypeError, match="dtype must be"):
                cache.to(dtype=dtype)
            with pytest.raises(TypeError, match="dtype must be"):
                LatentCache(B, 8, LATENT_DV, D - LATENT_DV, dtype=dtype)
        x = decode.inputs(1, gen)
        assert torch.equal(decode.step(cache, *x), decode.step(twin, *x))


@pytest.mark.parametrize("how", ROUND_TRIPS)
@pytest.mark.parametrize(
    "kind", ["mha-int8", "mha-paged-float8", "mha-streaming", "decoder", "mla-kv-float8",
             "mla-paged", "mla-latent"],
)  # fmt: skip
def test_a_module_and_its_cache_copied_mid_generation_decode_as_the_originals(
    kind: str, how: str
) -> None:
    torch.manual_seed(0)
    x = randn(2, 9, WIDTH, gen=torch.Generator().manual_seed(1))
    memory = randn(2, 4, WIDTH, gen=torch.Generator().manual_seed(2))
    m: nn.Module
    if kind.startswith("mla"):
        m = _module("mla").eval()
        make = {
            "mla-kv-float8": lambda: m.make_kv_cache(2, 16, kv_dtype=F8),
            "mla-paged": lambda: m.make_paged_cache(8, 4, max_seqs=2),
            "mla-latent": lambda: m.make_cache(2, 16),
        }[kind]
    elif kind == "decoder":
        m = attnkit.TransformerDecoderLayer(
            WIDTH, 4, dropout=0.0, rotary=attnkit.RotaryEmbedding(4)
        )
        make = lambda: KVCache(2, 16, 4, 4)  # noqa: E731
    else:
        m = _module("mha-rotary").eval()
        make = {
            "mha-int8": lambda: m.make_cache(2, 16, kv_dtype=torch.int8),
            "mha-paged-float8": lambda: m.make_paged_cache(8, 4, max_seqs=2, kv_dtype=F8),
            "mha-streaming": lambda: StreamingKVCache(2, 4, 4, sink_tokens=2, window=3),
        }[kind]
    m.eval()

    def call(module: nn.Module, cache: Any, tokens: Tensor) -> Tensor:
        if kind == "decoder":
            return module(tokens, memory, cache=cache)
        return module(tokens, causal=True, cache=cache)

    with torch.no_grad():
        cache = make()
        call(m, cache, x[:, :5])
        m2, cache2 = round_trip((m, cache), how)
        for i in range(5, 9):
            token = x[:, i : i + 1]
            assert torch.equal(call(m2, cache2, token), call(m, cache, token)), i


@pytest.mark.parametrize("layout", ["flash", "vllm"])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, F8])
def test_a_paged_cache_materialised_off_the_meta_device_is_an_empty_pool(
    kv_dtype: torch.dtype | None, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A model built on the meta device and materialised with to_empty() takes its paged cache
    # along: the block table and a float8 pool's page scales kept whatever memory to_empty()
    # gave (here 7s), where a new pool holds -1 past each row's pages and scales of 1; vLLM's
    # write() into a page no sequence holds then quantized with that scale.
    full_like = torch.full_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: full_like(t, 7, **kw))
    kw: dict[str, Any] = {"max_seqs": B, "kv_dtype": kv_dtype, "layout": layout}
    with torch.device("meta"):
        built = PagedKVCache(8, 4, HKV, D, **kw)
    built.to_empty(device="cpu")
    moved = PagedKVCache(8, 4, HKV, D, **kw).to("meta").to_empty(device="cpu")
    monkeypatch.undo()
    new = PagedKVCache(8, 4, HKV, D, **kw)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (5, 1):
            q, k, v = (randn(B, h, t, D, gen=gen) for h in (H, HKV, HKV))
            want = new.attention(q, k, v, causal=True)[0]
            for cache in (built, moved):
                assert torch.equal(cache.attention(q, k, v, causal=True)[0], want)
                cache.commit()
            new.commit()
        k, v = (randn(2, HKV, D, gen=gen) for _ in "kv")
        slots = torch.tensor([7 * 4, 7 * 4 + 1])  # page 7: no sequence holds it
        new.write(k, v, slots)
        for cache in (built, moved):
            cache.write(k, v, slots)
            assert torch.equal(cache.block_table, new.block_table)
            for got, want in zip(cache.token_major(), new.token_major(), strict=True):
                stored = (got[7, :2], want[7, :2])
                if kv_dtype is not None:
                    stored = tuple(s.view(torch.uint8) for s in stored)  # type: ignore[assignment]
                assert torch.equal(*stored)
            if kv_dtype is not None:
                assert torch.equal(cache.k_scales[7], new.k_scales[7])


@pytest.mark.parametrize("name", ["relative", "relative-espnet", "conformer", "relative-position"])
def test_torch_func_transforms_through_a_module_leave_nothing_of_theirs_in_it(name: str) -> None:
    # The relative position embedding keeps its tables of encodings (and, without gradients,
    # its last projection) between calls. Made inside torch.func.grad or vmap, they were the
    # transform's wrapper tensors, kept after it returned: copy.deepcopy and pickle of the module
    # then failed ("Cannot access storage of TensorWrapper"). A table of 32 distances or more,
    # made by an autograd.Function without torch.func's rules, was refused by every transform.
    torch.manual_seed(0)
    m = _module(name, dtype=F64).eval()
    with torch.no_grad():
        want = _run(name, copy.deepcopy(m))
    params = {k: p.detach() for k, p in m.named_parameters()}
    args, kwargs = _inputs(name)

    def loss(p: dict[str, Tensor]) -> Tensor:
        return torch.func.functional_call(m, p, args, kwargs).square().sum()

    grads = torch.func.grad(loss)(params)
    loss(dict(m.named_parameters())).backward()
    for key, p in m.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[key], p.grad, rtol=1e-12, atol=1e-12, msg=key)
    if name == "relative-position":  # distances enough for the mirrored table, too
        table = torch.func.grad(
            lambda p: torch.func.functional_call(m, p, (40, -40)).square().sum()
        )(params)
        m.zero_grad()
        m(40, -40).square().sum().backward()
        torch.testing.assert_close(table["weight"], m.weight.grad, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        if name == "relative-position":  # (the attention modules' score term reads values)
            stacked = {k: torch.stack([p, 2 * p]) for k, p in params.items()}
            twice = torch.func.vmap(lambda p: torch.func.functional_call(m, p, args))(stacked)
            torch.testing.assert_close(twice[1], 2 * want, rtol=1e-12, atol=1e-12)
        for how in ROUND_TRIPS:
            assert torch.equal(_run(name, round_trip(m, how)), want), how
        assert torch.equal(_run(name, m), want)


def test_a_mask_copied_or_pickled_carries_none_of_what_calls_made_of_it() -> None:
    # A mask keeps copies of its tensors per device it served (and an index mask its sorted
    # keys): a mask used on a GPU and pickled would name that device and fail to load without
    # it. Copies and pickles start those empty, and attend as the original.
    lengths, idx = torch.tensor([5, 3]), torch.randint(0, 6, (2, 1, 6, 3))
    padding, selected = masks.key_padding(lengths), masks.key_indices(idx)
    q = torch.randn(2, 2, 6, 8, dtype=torch.float64)
    meta = q.to("meta")
    want = {}
    for name, mask in (("padding", padding), ("selected", selected)):
        attnkit.attention(meta, meta, meta, mask=mask, backend="reference")
        want[name] = attnkit.attention(q, q, q, mask=mask, backend="chunked")
    assert padding._devices  # (what the calls made)
    assert selected._kept
    for name, mask in (("padding", padding), ("selected", selected)):
        for other in (pickle.loads(pickle.dumps(mask)), copy.deepcopy(mask)):
            assert getattr(other, "_devices", {}) == {}
            assert getattr(other, "_kept", {}) == {}
            got = attnkit.attention(q, q, q, mask=other, backend="chunked")
            torch.testing.assert_close(got, want[name], rtol=0, atol=0)
