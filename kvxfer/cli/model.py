"""The demo's tiny transformer: GQA attention with rotary embeddings, SwiGLU MLP,
tensor-parallel across a torch.distributed group, KV kept in a kvxfer pool.

Weights are random from a fixed seed. Compute is float64 and KV is stored as float32,
so a TP run and a single-process run agree token for token: the only differences are
reduction order (~1e-16), far below what could flip a greedy argmax.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..pools import KVPool


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    vocab: int = 256
    layers: int = 4
    hidden: int = 128
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 16
    ffn: int = 256
    rope_base: float = 10000.0
    seed: int = 0

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")


def init_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights, deterministic in ``cfg.seed``."""
    g = torch.Generator().manual_seed(cfg.seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5

    out = {"embed": torch.randn(cfg.vocab, cfg.hidden, generator=g, dtype=torch.float64),
           "unembed": w(cfg.hidden, cfg.vocab)}
    for i in range(cfg.layers):
        out |= {f"{i}.wq": w(cfg.hidden, cfg.heads * cfg.head_dim),
                f"{i}.wk": w(cfg.hidden, cfg.kv_heads * cfg.head_dim),
                f"{i}.wv": w(cfg.hidden, cfg.kv_heads * cfg.head_dim),
                f"{i}.wo": w(cfg.heads * cfg.head_dim, cfg.hidden),
                f"{i}.w1": w(cfg.hidden, cfg.ffn), f"{i}.w3": w(cfg.hidden, cfg.ffn),
                f"{i}.w2": w(cfg.ffn, cfg.hidden)}
    return out


def kv_heads_per_rank(cfg: ModelConfig, tp_size: int) -> int:
    """KV heads each rank holds (replicated when kv_heads < tp_size)."""
    return max(cfg.kv_heads // tp_size, 1)


def shard_weights(w: dict[str, torch.Tensor], cfg: ModelConfig, tp_size: int, tp_rank: int) -> dict:
    """Column-parallel Q/K/V/W1/W3, row-parallel O/W2; embeddings replicated."""
    if cfg.heads % tp_size:
        raise ConfigError(f"heads {cfg.heads} not divisible by TP size {tp_size}")
    hq = cfg.heads // tp_size
    hkv = kv_heads_per_rank(cfg, tp_size)
    kv0 = tp_rank * cfg.kv_heads // tp_size if cfg.kv_heads < tp_size else tp_rank * hkv
    f = cfg.ffn // tp_size
    d = cfg.head_dim
    out = {"embed": w["embed"], "unembed": w["unembed"]}
    for i in range(cfg.layers):
        out |= {f"{i}.wq": w[f"{i}.wq"][:, tp_rank * hq * d:(tp_rank + 1) * hq * d],
                f"{i}.wk": w[f"{i}.wk"][:, kv0 * d:(kv0 + hkv) * d],
                f"{i}.wv": w[f"{i}.wv"][:, kv0 * d:(kv0 + hkv) * d],
                f"{i}.wo": w[f"{i}.wo"][tp_rank * hq * d:(tp_rank + 1) * hq * d, :],
                f"{i}.w1": w[f"{i}.w1"][:, tp_rank * f:(tp_rank + 1) * f],
                f"{i}.w3": w[f"{i}.w3"][:, tp_rank * f:(tp_rank + 1) * f],
                f"{i}.w2": w[f"{i}.w2"][tp_rank * f:(tp_rank + 1) * f, :]}
    return out


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    # x: [T, heads, d]; rotate pairs (first half, second half)
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]          # [T, d/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class TPModel:
    """One rank's shard. ``forward`` runs new tokens of one sequence, writing their KV into
    ``pool`` at ``new_slots`` and attending over ``all_slots`` (prefix + new)."""

    def __init__(self, cfg: ModelConfig, weights: dict, tp_size: int = 1, group=None):
        self.cfg, self.w, self.tp_size, self.group = cfg, weights, tp_size, group
        self.hq = cfg.heads // tp_size
        self.hkv = kv_heads_per_rank(cfg, tp_size)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def forward_layer_range(self, x: torch.Tensor, positions: torch.Tensor, pool: KVPool,
                            new_slots: np.ndarray, all_slots: np.ndarray, layers: Sequence[int]) -> torch.Tensor:
        """Run ``layers`` on hidden states ``x`` [T, hidden]; returns the new hidden states."""
        cfg, d = self.cfg, self.cfg.head_dim
        T, S = x.shape[0], len(all_slots)
        # queries at positions[t] see keys at positions 0..positions[t]
        key_pos = torch.arange(S) + (int(positions[-1]) + 1 - S)
        mask = key_pos[None, :] <= positions[:, None]                 # [T, S]
        for i in layers:
            w = {k.split(".", 1)[1]: v for k, v in self.w.items() if k.startswith(f"{i}.")}
            h = _rms(x)
            q = _rope((h @ w["wq"]).view(T, self.hq, d), positions, cfg.rope_base)
            k = _rope((h @ w["wk"]).view(T, self.hkv, d), positions, cfg.rope_base)
            v = (h @ w["wv"]).view(T, self.hkv, d)
            pool.set_kv_buffer(i, new_slots, k.float(), v.float())
            K, V = (t.to(torch.float64) for t in pool.get_kv_buffer(i, all_slots))   # [S, hkv, d]
            rep = self.hq // self.hkv
            K, V = K.repeat_interleave(rep, dim=1), V.repeat_interleave(rep, dim=1)
            scores = torch.einsum("thd,shd->hts", q, K) / d ** 0.5
            scores = scores.masked_fill(~mask[None], float("-inf"))
            attn = torch.einsum("hts,shd->thd", scores.softmax(-1), V).reshape(T, self.hq * d)
            x = x + self._all_reduce(attn @ w["wo"])
            h = _rms(x)
            x = x + self._all_reduce((torch.nn.functional.silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"])
        return x

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.w["embed"][torch.as_tensor(list(tokens))]

    def next_token(self, x: torch.Tensor) -> int:
        """Greedy token after the last position."""
        return int((_rms(x[-1]) @ self.w["unembed"]).argmax())

    def forward(self, tokens: Sequence[int], start: int, pool: KVPool, slots: np.ndarray) -> int:
        """Run ``tokens`` at positions ``start..``; ``slots`` covers positions ``0..start+len``."""
        positions = torch.arange(start, start + len(tokens))
        x = self.forward_layer_range(self.embed(tokens), positions, pool, slots[start:start + len(tokens)],
                                     slots[:start + len(tokens)], range(self.cfg.layers))
        return self.next_token(x)
