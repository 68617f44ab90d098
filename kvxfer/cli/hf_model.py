"""The HuggingFace side of ``kvxfer demo --model llama|qwen2``: the demo's settings, the
model (built from a small config with seeded random weights), greedy generation, and the
HF cache in and out of kvxfer pools (a rank's KV heads written into its pool; every rank's
heads reassembled into one ``DynamicCache``). The ranks and the run are in ``hf``.
"""
from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

# --model name -> (config class, model class) in transformers
HF_MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
HF_INSTALL = "pip install 'kvxfer[hf]'  (or: pip install 'transformers>=4.45,<6')"


@dataclass(frozen=True, slots=True, kw_only=True)
class HFDemoConfig:
    model: str = "llama"
    transport: str = "zmq"
    prefill_tp: int = 2
    decode_tp: int = 4
    prefill_layout: str = "page_major"
    decode_layout: str = "token_major"
    requests: int = 8
    min_prompt: int = 8
    max_prompt: int = 96
    gen_len: int = 8
    page_size: int = 16
    batch: int = 4            # requests decode grants at once
    seed: int = 0
    # the model: small enough for a laptop, GQA so that heterogeneous TP splits KV heads
    layers: int = 2
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 128
    vocab: int = 256
    init_std: float = 0.1     # HF's initializer_range; its default 0.02 gives near-flat logits

    def __post_init__(self):
        if self.model not in HF_MODELS:
            raise ConfigError(f"model {self.model!r} is not one of {sorted(HF_MODELS)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(f"hidden {self.hidden}, heads {self.heads}, kv_heads {self.kv_heads}: "
                             "want hidden a multiple of heads and heads a multiple of kv_heads")
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise ConfigError(f"prompt lengths {self.min_prompt}..{self.max_prompt}: want 1 <= min <= max")
        if self.gen_len < 1:
            raise ConfigError(f"gen_len {self.gen_len}: want at least 1 (the first token comes from prefill)")
        from ..topology import heads_held
        for tp in (self.prefill_tp, self.decode_tp):
            heads_held(self.kv_heads, tp, 0)    # raises, saying why, for a TP size the heads cannot split over

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# -- the model ---------------------------------------------------------------------------

def require_transformers():
    """The transformers module, or SystemExit saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"kvxfer demo --model llama|qwen2 needs transformers: {HF_INSTALL}") from None
    transformers.logging.set_verbosity_error()
    return transformers


def build_model(cfg: HFDemoConfig):
    """The HF model of ``cfg.model`` from a small config, random weights seeded by ``cfg.seed``."""
    import torch
    tf = require_transformers()
    config_cls, model_cls = (getattr(tf, name) for name in HF_MODELS[cfg.model])
    config = config_cls(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_prompt + cfg.gen_len,
                        initializer_range=cfg.init_std, tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=None, pad_token_id=0)   # no EOS: always gen_len tokens
    torch.manual_seed(cfg.seed)
    return model_cls(config).float().eval()


def fingerprint(model) -> str:
    """sha256 of every parameter, in order: the same seed must give the same model in each process."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def cache_kwarg(model) -> str:
    """transformers 5 names the cache argument (and output field) ``cache``; 4.x ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def layer_kv(cache, layer: int):
    """K and V of ``layer`` from an HF cache, each ``[batch, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):                           # transformers >= 4.54: one object per layer
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def greedy(model, prompt: list[int], max_new_tokens: int, cache=None) -> list[int]:
    """``generate(do_sample=False)``: from scratch, or continuing ``cache`` (which holds all of
    ``prompt`` but its last token)."""
    import torch
    if max_new_tokens == 0:
        return []
    ids = torch.tensor([prompt])
    extra = {cache_kwarg(model): cache} if cache is not None else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, **extra)
    return out[0, len(prompt):].tolist()


def prefill(model, prompt: list[int]):
    """One forward over ``prompt``: its HF ``DynamicCache`` and the greedy first token. The cache
    is passed in: transformers 4.x returns a legacy tuple for a cache it made itself."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, **{cache_kwarg(model): cache})
    return cache, int(out.logits[0, -1].argmax())


def make_requests(cfg: HFDemoConfig) -> list[tuple[int, list[int]]]:
    rng = np.random.default_rng(cfg.seed)
    return [(room, rng.integers(0, cfg.vocab, int(rng.integers(cfg.min_prompt, cfg.max_prompt + 1))).tolist())
            for room in range(1, cfg.requests + 1)]


def make_pool(cfg: HFDemoConfig, tp: int, rank: int, layout: str, num_tokens: int, num_requests: int):
    from ..pools import MHAPool
    from ..topology import heads_held
    pages = -(-num_tokens // cfg.page_size) + num_requests + 2
    return MHAPool(layers=cfg.layers, heads=len(heads_held(cfg.kv_heads, tp, rank)), head_dim=cfg.head_dim,
                   dtype="float32", num_pages=pages, page_size=cfg.page_size, layout=layout)


def agree_on_model(model, group=None) -> str:
    """Every rank of the group built the same weights (all-gather of the fingerprints over gloo)."""
    import torch.distributed as dist
    fp = fingerprint(model)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, fp, group=group)
    if len(set(every)) != 1:
        raise RuntimeError(f"ranks built different models from the same seed: {every}")
    return fp


def write_prefill_kv(cache, pool, slots: np.ndarray, heads: range) -> None:
    """This rank's ``heads`` of every layer of an HF cache (batch 1) into ``pool`` at ``slots``."""
    for layer in range(num_layers(cache)):
        k, v = layer_kv(cache, layer)                          # [1, kv_heads, tokens, head_dim]
        pool.set_kv_buffer(layer, slots, k[0, heads.start:heads.stop].transpose(0, 1).contiguous(),
                           v[0, heads.start:heads.stop].transpose(0, 1).contiguous())   # [tokens, heads, head_dim]


def num_layers(cache) -> int:
    return len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)


# -- the cache from a TP group's pools ----------------------------------------------------

def gather_cache(cfg: HFDemoConfig, pool, slots: np.ndarray, group):
    """The whole group's KV heads of ``slots`` as one HF cache, on every rank of ``group``:
    one all-gather over gloo per request of each rank's ``[layers, 2, tokens, heads, head_dim]``."""
    import torch
    import torch.distributed as dist
    mine = torch.stack([torch.stack(pool.get_kv_buffer(layer, slots)) for layer in range(cfg.layers)])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return cache_from_parts(cfg, parts)


def cache_from_parts(cfg: HFDemoConfig, parts: list):
    """An HF ``DynamicCache`` from the blocks ``[layers, 2, tokens, heads, head_dim]`` of every rank
    of a TP group, in rank order; rank r holds ``heads_held(kv_heads, len(parts), r)``."""
    import torch
    from transformers import DynamicCache

    from ..topology import heads_held
    n = parts[0].shape[2]
    full = torch.empty(cfg.layers, 2, n, cfg.kv_heads, cfg.head_dim, dtype=parts[0].dtype)
    for r, part in enumerate(parts):       # heads_held covers every head; replicas write the same values
        h = heads_held(cfg.kv_heads, len(parts), r)
        full[:, :, :, h.start:h.stop] = part
    cache = DynamicCache()
    for layer in range(cfg.layers):
        k, v = full[layer].permute(0, 2, 1, 3).unsqueeze(1)    # [1, kv_heads, tokens, head_dim] each
        cache.update(k.contiguous(), v.contiguous(), layer)
    return cache


__all__ = ["HF_MODELS", "HF_INSTALL", "HFDemoConfig", "require_transformers", "build_model", "fingerprint",
           "cache_kwarg", "layer_kv", "greedy", "prefill", "make_requests", "make_pool", "agree_on_model",
           "write_prefill_kv", "num_layers", "gather_cache", "cache_from_parts"]
