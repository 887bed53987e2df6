"""Hugging Face ``transformers`` adapter: a model's KV cache <-> a kvbridge handle.

Prefill side::

    layout = layout_for_model(model, block_size=16)            # or layout_for_config(config, ...)
    sender = KVSender(KVPool.allocate(layout, num_blocks))
    cache = prefill_for_handoff(model, prompt_ids).cache        # KV of prompt[:-1]
    handle = publish_cache(sender, "req-1", cache)              # -> KVHandle; send handle.to_bytes()

Decode side::

    receiver = KVReceiver(KVPool.allocate(layout, num_blocks))
    cache = load_cache(receiver, handle_bytes, model.config)    # -> DynamicCache
    out = generate_from_cache(model, prompt_ids, cache, max_new_tokens=32, do_sample=False)

**The prompt convention.** ``model.generate(input_ids=prompt, cache=c)`` runs only
``input_ids[:, c.get_seq_length():]`` (transformers 5: ``GenerationMixin._prefill``).
The cache must therefore hold *fewer* tokens than ``input_ids``: a cache holding the
whole prompt makes that slice ``input_ids[:, -0:]``, i.e. the *whole* prompt again,
appended after itself at positions n..2n-1 -- no error, just wrong tokens.
Two correct hand-offs:

* *prefix*: prefill publishes the KV of ``prompt[:-1]`` (:func:`prefill_for_handoff`,
  the default); decode calls ``generate(prompt, cache)``, which runs the last prompt
  token and continues. Output equals ``generate(prompt)`` from scratch.
* *PD*: prefill runs the whole prompt, samples the first token ``t0`` (its TTFT),
  publishes the KV of the full prompt and sends ``t0`` beside the handle; decode
  calls ``generate(prompt + [t0], cache)``. Output ``t0, t1, ...`` equals the
  from-scratch one.

:func:`generate_from_cache` checks that the cache is shorter than the input and picks
the cache keyword of the installed transformers (``cache`` in 5.x, where
``past_key_values`` is a deprecated alias; ``past_key_values`` in 4.x).

**Layout.** HF keeps each layer's K and V as ``[batch, num_kv_heads, seq, head_dim]``,
K *after* rotary -- the same meaning as vLLM's and kvbridge's reference engine's
paged caches, so blocks are exchangeable whenever the geometry and physical order
match. The default is NHD (vLLM FlashAttention, :meth:`KVLayout.vllm_flash`), the
order of the engines an HF prefill most plausibly feeds, at no extra pass: writing
into blocks is one strided copy per layer and part either way (the seq axis must be
cut into blocks anyway; NHD only moves heads inside that same copy). ``hnd=True``
gives longer contiguous runs (block_size x head_dim instead of head_dim) for
HF-to-HF hand-offs. The handle's ``layout_hash`` includes the order from two KV heads
up, so both sides must choose the same one; a mismatch is refused with
:class:`LayoutMismatch` (with one head the two orders are the same bytes and exchange blocks).

Only attention caches that hold every token are moved (``DynamicCache`` full
attention, a ``StaticCache``'s filled prefix, or a legacy ``((k, v), ...)`` tuple).
Quantized caches, linear-attention/SSM layers and sliding-window layers that have
already dropped tokens are refused with :class:`ConfigError`. Batch rows are
published one at a time (``batch_index``); left padding is the caller's business.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from kvbridge import KVHandle, KVLayout, KVPool, KVReceiver, KVSender, Transfer
from kvbridge.errors import BadHandle, ConfigError, LayoutMismatch
from kvbridge.layout import DTYPES, KVOrder, TokenOrder

__all__ = [
    "layout_for_config", "layout_for_model", "cache_layers", "blocks_needed",
    "write_blocks", "read_blocks", "build_cache",
    "HFKVExporter", "HFKVImporter", "publish_cache", "load_cache", "aload_cache",
    "PrefillOutput", "prefill_for_handoff", "generate_from_cache", "cache_kwarg",
]

HandleLike = Union[KVHandle, bytes, bytearray, memoryview, dict]
LayerKV = tuple[torch.Tensor, torch.Tensor]


# -- layout from a transformers config ---------------------------------------------------------

def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def _geometry(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config."""
    c = _text_config(config)
    try:
        layers = int(c.num_hidden_layers)
        heads = int(c.num_attention_heads)
    except (AttributeError, TypeError):
        raise ConfigError(f"{type(c).__name__} has no num_hidden_layers/num_attention_heads; "
                          "not a decoder config kvbridge can derive a KV layout from") from None
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or int(c.hidden_size) // heads
    return layers, int(kv_heads), int(head_dim)


def _config_dtype(config: Any) -> Optional[torch.dtype]:
    """The KV dtype a model config names (``dtype``, ``torch_dtype`` in 4.x), or None (none, or "auto")."""
    c = _text_config(config)
    d = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None)
    return None if d is None or d == "auto" else DTYPES[_dtype_name(d)]


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, torch.dtype):
        for k, v in DTYPES.items():
            if v == dtype:
                return k
        raise ConfigError(f"unsupported KV dtype {dtype}")
    s = str(dtype).replace("torch.", "")
    if s not in DTYPES:
        raise ConfigError(f"unsupported KV dtype {dtype!r}; one of {sorted(DTYPES)}")
    return s


def layout_for_config(config: Any, block_size: int = 16, dtype: Any = None, *, hnd: bool = False,
                      kv_order: Union[KVOrder, str] = KVOrder.KV_FIRST, **kw: Any) -> KVLayout:
    """The KVLayout of a transformers decoder config (``PretrainedConfig``; multimodal: its text config).

    ``dtype``: the KV dtype; default the config's ``dtype`` (``torch_dtype`` in 4.x), else
    float32 -- prefer :func:`layout_for_model` for a live model, whose parameters say for sure.
    ``kv_order``: KV_FIRST (vLLM FlashAttention, default), BLOCK_FIRST (FlashInfer) or SPLIT
    (SGLang). ``kw``: ``tp_rank``/``tp_size``.
    """
    layers, kv_heads, head_dim = _geometry(config)
    if dtype is None:
        dtype = _config_dtype(config) or torch.float32
    order = KVOrder(kv_order)
    if order is KVOrder.LATENT:
        raise ConfigError("transformers caches hold decompressed K and V; use a K/V layout, not LATENT")
    return KVLayout(layers, kv_heads, head_dim, block_size, _dtype_name(dtype), order,
                    TokenOrder.HND if hnd else TokenOrder.NHD, **kw)


def layout_for_model(model: Any, block_size: int = 16, dtype: Any = None, **kw: Any) -> KVLayout:
    """:func:`layout_for_config` of ``model.config`` with the model's own dtype by default."""
    return layout_for_config(model.config, block_size, dtype if dtype is not None else model.dtype, **kw)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _check_geometry(layout: KVLayout, config: Any, what: str) -> None:
    want = _geometry(config)
    have = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
    if want != have:
        raise LayoutMismatch(
            f"{what}: model config has (layers, kv heads, head_dim) = {want}, the pool layout {have}",
            hint="build the pool with layout_for_config(model.config, ...)")


# -- cache <-> tensors ------------------------------------------------------------------------

def cache_layers(cache: Any) -> list[LayerKV]:
    """Per-layer (K, V), each ``[batch, kv_heads, seq, head_dim]``, of a transformers cache.

    Accepts a 5.x ``Cache`` (``.layers``), a 4.x ``DynamicCache`` (``key_cache``/``value_cache``)
    or a legacy ``((k, v), ...)`` tuple. Raises :class:`ConfigError` for layers that are not
    plain attention K/V (quantized, linear attention, empty).
    """
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out: list[LayerKV] = []
        for i, layer in enumerate(layers):
            name = type(layer).__name__
            if "Quantized" in name or "LinearAttention" in name:
                raise ConfigError(f"cache layer {i} is a {name}; kvbridge moves plain attention K/V only")
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
                raise ConfigError(f"cache layer {i} ({name}) holds no K/V tensors (uninitialized or not attention)")
            cum = getattr(layer, "cumulative_length", None)
            if getattr(layer, "is_sliding", False) and isinstance(cum, int) and cum > k.shape[-2]:
                raise ConfigError(f"cache layer {i} is a sliding window that dropped {cum - k.shape[-2]} of "
                                  f"{cum} tokens; kvbridge moves caches that hold every token")
            out.append((k, v))
        return out
    kc, vc = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if kc is not None and vc is not None:
        return list(zip(kc, vc))
    if isinstance(cache, (tuple, list)) and all(isinstance(x, (tuple, list)) and len(x) >= 2 for x in cache):
        return [(x[0], x[1]) for x in cache]
    raise ConfigError(f"not a transformers KV cache: {type(cache).__name__}")


def _seq_len(cache: Any, layers: Sequence[LayerKV]) -> int:
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        return int(get())
    return int(layers[0][0].shape[-2]) if layers else 0


def _blocked(t: torch.Tensor, nfull: int, bs: int, hnd: bool) -> torch.Tensor:
    """View the first ``nfull*bs`` tokens of ``t`` ([H, S, D]) as ``[nfull, *part_shape]``."""
    v = t[:, :nfull * bs].unflatten(1, (nfull, bs))            # [H, nfull, bs, D]
    return v.permute(1, 0, 2, 3) if hnd else v.permute(1, 2, 0, 3)


def _run(ids: Sequence[int]) -> Optional[slice]:
    """``ids`` as a slice if they are one ascending run."""
    if ids and all(b == ids[0] + i for i, b in enumerate(ids)):
        return slice(ids[0], ids[0] + len(ids))
    return None


@torch.no_grad()
def write_blocks(pool: KVPool, block_ids: Sequence[int], layers: Sequence[LayerKV], num_tokens: int,
                 batch_index: int = 0) -> None:
    """Copy the first ``num_tokens`` tokens of ``layers`` (row ``batch_index``) into ``block_ids``.

    One strided copy per layer and part (plus one for a partial last block, whose unused
    tail is zeroed). Casts to the pool's dtype and device.
    """
    L = pool.layout
    bs, hnd = L.block_size, L.token_order is TokenOrder.HND
    nfull, rem = divmod(num_tokens, bs)
    if len(block_ids) != blocks_needed(num_tokens, bs):
        raise ConfigError(f"{num_tokens} tokens need {blocks_needed(num_tokens, bs)} blocks, got {len(block_ids)}")
    full = list(block_ids[:nfull])
    run = _run(full)
    idx = None if run is not None else torch.tensor(full, dtype=torch.long, device=pool.device)
    for layer, kv in enumerate(layers):
        for part, dst in zip(kv, pool.layer_kv(layer)):
            src = part[batch_index, :, :num_tokens]               # [H, n, D]
            if nfull:
                view = _blocked(src, nfull, bs, hnd).to(device=dst.device, dtype=dst.dtype)
                if run is not None:
                    dst[run].copy_(view)
                else:
                    dst.index_copy_(0, idx, view)
            if rem:
                last = dst[block_ids[nfull]]                       # part_shape
                tail = src[:, nfull * bs:]                         # [H, rem, D]
                if hnd:
                    last[:, :rem].copy_(tail)
                    last[:, rem:].zero_()
                else:
                    last[:rem].copy_(tail.transpose(0, 1))
                    last[rem:].zero_()


@torch.no_grad()
def read_blocks(pool: KVPool, block_ids: Sequence[int], num_tokens: int,
                device: Union[str, torch.device, None] = None,
                dtype: Optional[torch.dtype] = None) -> list[LayerKV]:
    """Per-layer (K, V) ``[1, kv_heads, num_tokens, head_dim]`` tensors from ``block_ids`` (copies)."""
    L = pool.layout
    bs, hnd = L.block_size, L.token_order is TokenOrder.HND
    nfull, rem = divmod(num_tokens, bs)
    if len(block_ids) != blocks_needed(num_tokens, bs):
        raise ConfigError(f"{num_tokens} tokens need {blocks_needed(num_tokens, bs)} blocks, got {len(block_ids)}")
    device = torch.device(device) if device is not None else pool.device
    dtype = dtype or L.torch_dtype
    full = list(block_ids[:nfull])
    run = _run(full)
    idx = None if run is not None else torch.tensor(full, dtype=torch.long, device=pool.device)
    out: list[LayerKV] = []
    for layer in range(L.num_layers):
        pair = []
        for src in pool.layer_kv(layer):
            t = torch.empty(1, L.num_kv_heads, num_tokens, L.head_dim, dtype=dtype, device=device)
            if nfull:
                blocks = src[run] if run is not None else src.index_select(0, idx)
                _blocked(t[0], nfull, bs, hnd).copy_(blocks)
            if rem:
                last = src[block_ids[nfull]]
                t[0, :, nfull * bs:].copy_(last[:, :rem] if hnd else last[:rem].transpose(0, 1))
            pair.append(t)
        out.append((pair[0], pair[1]))
    return out


def build_cache(layers: Sequence[LayerKV], config: Any = None) -> Any:
    """A ``transformers.DynamicCache`` holding ``layers`` (with ``config``'s layer types, if given)."""
    from transformers import DynamicCache

    data = [(k, v) for k, v in layers]
    params = inspect.signature(DynamicCache.__init__).parameters
    if "config" in params:
        return DynamicCache(data, config=config)                # transformers >= 4.56 / 5.x
    if hasattr(DynamicCache, "from_legacy_cache"):              # older 4.x
        return DynamicCache.from_legacy_cache(tuple(data))
    return DynamicCache(data)


# -- prefill side -----------------------------------------------------------------------------

class HFKVExporter:
    """Publish transformers caches through ``sender`` (its pool's layout must fit the model)."""

    def __init__(self, sender: KVSender, model_config: Any = None) -> None:
        self.sender = sender
        self.layout = sender.pool.layout
        if self.layout.latent:
            raise ConfigError("the sender's pool has an MLA latent layout; HF caches hold K and V")
        if model_config is not None:
            _check_geometry(self.layout, model_config, "exporter")

    def publish(self, request_id: str, cache: Any, num_tokens: Optional[int] = None, *,
                batch_index: int = 0, ttl: Optional[float] = None, codec: Optional[str] = None) -> KVHandle:
        """Copy the first ``num_tokens`` (default: all) tokens of ``cache`` into fresh blocks of
        the sender's pool and publish them. The sender owns (and eventually frees) the blocks.
        ``codec``: the sender's (default ``raw``) unless given; a lossy one (``int8``, ``fp8``,
        ``int4``...) makes generation differ from the model's own, token-exact holds for lossless
        codecs only."""
        layers = cache_layers(cache)
        L = self.layout
        if len(layers) != L.num_layers:
            raise LayoutMismatch(f"cache has {len(layers)} layers, the sender's layout {L.num_layers}")
        have = _seq_len(cache, layers)
        n = have if num_tokens is None else int(num_tokens)
        if not 0 < n <= have:
            raise ConfigError(f"num_tokens {n} must be in [1, {have}] (tokens in the cache)")
        for i, (k, v) in enumerate(layers):
            want = (L.num_kv_heads, L.head_dim)
            for name, t in (("K", k), ("V", v)):
                if t.dim() != 4 or (t.shape[1], t.shape[3]) != want:
                    raise LayoutMismatch(f"layer {i} {name} has shape {tuple(t.shape)}; the sender's layout "
                                         f"wants [batch, {L.num_kv_heads}, seq, {L.head_dim}]")
                if t.shape[2] < n:
                    raise ConfigError(f"layer {i} {name} holds {t.shape[2]} tokens, fewer than {n}")
                if not 0 <= batch_index < t.shape[0]:
                    raise ConfigError(f"batch_index {batch_index} outside batch of {t.shape[0]}")
        pool = self.sender.pool
        ids = pool.alloc(blocks_needed(n, L.block_size))
        pool.ref(ids)          # our own hold while publishing: no one can free and reuse them under us
        try:
            write_blocks(pool, ids, layers, n, batch_index)
            h = self.sender.publish(request_id, ids, n, ttl=ttl, codec=codec)   # None: the sender's codec
        except BaseException:
            # a refused publish (one that close() overtook too) leaves the blocks ours: both
            # references go, the alloc's and the hold's
            pool.free(ids)
            pool.free(ids)
            raise
        pool.free(ids)         # the sender owns them now
        return h


def publish_cache(sender: KVSender, request_id: str, past_key_values: Any, num_tokens: Optional[int] = None,
                  **kw: Any) -> KVHandle:
    """Publish the KV of a transformers cache as a kvbridge handle; see :meth:`HFKVExporter.publish`."""
    return HFKVExporter(sender).publish(request_id, past_key_values, num_tokens, **kw)


@dataclass
class PrefillOutput:
    cache: Any                              # the DynamicCache to publish
    num_tokens: int                         # tokens of KV in it
    next_token_logits: Optional[torch.Tensor]  # [vocab] after the full prompt (include_last=True only)


@torch.no_grad()
def prefill_for_handoff(model: Any, input_ids: Union[torch.Tensor, Sequence[int]], *,
                        include_last: bool = False) -> PrefillOutput:
    """Run a one-sequence prompt through ``model`` to get the cache to publish.

    ``include_last=False`` (prefix convention): the KV of ``prompt[:-1]``; decode passes the
    whole prompt to ``generate``. ``include_last=True`` (PD convention): the KV of the whole
    prompt plus the next-token logits; decode passes ``prompt + [first_token]``.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[0] != 1:
        raise ConfigError("prefill_for_handoff takes one sequence")
    run = ids if include_last else ids[:, :-1]
    if run.shape[1] == 0:
        raise ConfigError("a one-token prompt has no KV to hand off under the prefix convention; "
                          "use include_last=True or let decode run it")
    run = run.to(model.device)
    out = model(input_ids=run, attention_mask=torch.ones_like(run), use_cache=True)
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = out.past_key_values
    logits = out.logits[0, -1].float() if include_last else None
    return PrefillOutput(cache, int(run.shape[1]), logits)


# -- decode side ------------------------------------------------------------------------------

class HFKVImporter:
    """Fetch handles through ``receiver`` into transformers caches.

    ``model_config``: checked against the receiver's pool geometry and used for the
    cache's layer types. ``device``/``dtype``: of the cache tensors (default: the pool's).
    """

    def __init__(self, receiver: KVReceiver, model_config: Any = None, *,
                 device: Union[str, torch.device, None] = None, dtype: Optional[torch.dtype] = None) -> None:
        self.receiver = receiver
        self.pool = receiver.pool
        self.model_config = model_config
        self.device = device
        # the cache's tensors in the model's own dtype where its config says it (a float32 pool
        # read for a bfloat16 model made generate fail in attention: query and key dtypes differ)
        self.dtype = dtype if dtype is not None or model_config is None else _config_dtype(model_config)
        if self.pool.layout.latent:
            raise ConfigError("the receiver's pool has an MLA latent layout; HF caches hold K and V")
        if model_config is not None:
            _check_geometry(self.pool.layout, model_config, "importer")

    def _parse(self, handle: HandleLike) -> KVHandle:
        secret = self.receiver.secret
        if isinstance(handle, (bytes, bytearray, memoryview)):
            h = KVHandle.from_bytes(handle, secret)
        elif isinstance(handle, dict):
            h = KVHandle.from_dict(handle, secret)
        elif isinstance(handle, KVHandle):
            h = handle
        else:
            raise BadHandle(f"a handle is a KVHandle, its bytes or its dict, not {type(handle).__name__}")
        if h.layout_hash != self.pool.layout.compat_hash:   # refuse before taking any blocks
            raise LayoutMismatch(
                f"handle {h.id} of request {h.request_id!r} has layout {h.layout_hash}; this receiver's pool "
                f"is {self.pool.layout.compat_hash} ({self.pool.layout.compat_key()})",
                hint="both sides need the same model geometry, block size, dtype and token order")
        return h

    def _finish(self, h: KVHandle, dst: list[int], res: Any) -> Any:
        res.raise_for_error()
        layers = read_blocks(self.pool, dst, h.num_tokens, self.device, self.dtype)
        return build_cache(layers, self.model_config)

    def load(self, handle: HandleLike) -> Any:
        """Fetch ``handle`` (claim, read, verify, release) and return a ``DynamicCache`` of its tokens.

        Raises the fetch's error (:class:`KVBridgeError`; its ``action`` says retry, refetch or
        re-prefill). The receiver's blocks are used only as landing space and freed before return.
        """
        h = self._parse(handle)
        dst = self.pool.alloc(h.num_blocks)
        try:
            return self._finish(h, dst, self.receiver.fetch(h, dst))
        finally:
            self.pool.free(dst)

    async def aload(self, handle: HandleLike) -> Any:
        """Awaitable :meth:`load` (the transfer runs on the event loop where the transport allows)."""
        h = self._parse(handle)
        dst = self.pool.alloc(h.num_blocks)
        try:
            t = self.receiver.start_fetch(h, dst)
        except BaseException:
            self.pool.free(dst)
            raise
        try:
            res = await t
        except BaseException:
            # cancelled (e.g. asyncio.wait_for): stop the transfer, and give its landing blocks
            # back only once it has ended -- until then it may still write them
            t.cancel(timeout=0)

            def give_back(_: Transfer) -> None:
                self.pool.free(dst)
            t.add_done_callback(give_back)
            raise
        try:
            return self._finish(h, dst, res)
        finally:
            self.pool.free(dst)


def load_cache(receiver: KVReceiver, handle: HandleLike, model_config: Any = None, **kw: Any) -> Any:
    """Fetch a handle into a ``transformers.DynamicCache``; see :meth:`HFKVImporter.load`."""
    return HFKVImporter(receiver, model_config, **kw).load(handle)


async def aload_cache(receiver: KVReceiver, handle: HandleLike, model_config: Any = None, **kw: Any) -> Any:
    """Awaitable :func:`load_cache`."""
    return await HFKVImporter(receiver, model_config, **kw).aload(handle)


def cache_kwarg(model: Any) -> str:
    """The keyword ``model.forward``/``generate`` takes a cache under: ``cache`` (5.x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def generate_from_cache(model: Any, input_ids: Union[torch.Tensor, Sequence[int]], cache: Any,
                        **generate_kwargs: Any) -> torch.Tensor:
    """``model.generate`` continuing from ``cache``, which must hold the KV of a strict prefix of
    ``input_ids`` (see the module doc: a cache as long as the input is silently re-run).

    Returns what ``generate`` returns (prompt + new tokens). ``cache`` is extended in place.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    ids = ids.to(model.device)
    if ids.shape[0] != 1:
        raise ConfigError(f"generate_from_cache continues one prompt from its cache; input_ids has {ids.shape[0]} rows")
    have = cache.get_seq_length()
    if not 0 < have < ids.shape[1]:
        raise ConfigError(
            f"the cache holds {have} tokens but input_ids has {ids.shape[1]}: generate continues from a cache "
            "of a strict prefix of input_ids (publish prompt[:-1], or pass prompt + [first_token])")
    generate_kwargs.setdefault("attention_mask", torch.ones_like(ids))
    gc = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = int(generate_kwargs.get("num_beams", getattr(gc, "num_beams", 1) or 1))
    seqs = int(generate_kwargs.get("num_return_sequences", getattr(gc, "num_return_sequences", 1) or 1))
    rows = beams if beams > 1 else seqs     # the rows generate expands the prompt to; the cache must match
    if rows > 1:
        if getattr(cache, "batch_repeat_interleave", None) is None:
            raise ConfigError("this cache cannot be expanded for beam search or several sequences")
        cache.batch_repeat_interleave(rows)
    generate_kwargs[cache_kwarg(model)] = cache
    return model.generate(input_ids=ids, **generate_kwargs)
