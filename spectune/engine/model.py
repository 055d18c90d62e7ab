"""A compact Llama decoder (RMSNorm, RoPE, GQA, SwiGLU) over a slot-based KV cache, loaded from an HF checkpoint dir.

Plain tensors and functional ops, no nn.Module per layer: a batch-1 decode step is a handful of matmuls per layer.
Weights are computed in fp32 whatever the checkpoint dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spectune.errors import SpectuneError


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        file = path / "config.json"
        if not file.is_file():
            raise SpectuneError(f"{file}: missing; --model/--speculative-config model must be an HF checkpoint dir with config.json")
        raw = json.loads(file.read_text())
        if raw.get("model_type", "llama") != "llama" or raw.get("attention_bias") or raw.get("mlp_bias"):
            raise SpectuneError(f"{file}: only plain Llama checkpoints (no biases) are supported; convert the model or use another engine")
        # transformers 5 writes rope_parameters; 4.x writes rope_theta + rope_scaling.
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default" or scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise SpectuneError(f"{file}: RoPE scaling is not supported; use rope_type 'default'")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )


class KVCache:
    """Preallocated keys and values per slot: kv [layers, slots + 1, 2 * kv_heads, max_len, head_dim], keys first.

    The extra last slot is scratch: padded (not real) tokens of a ragged batch write there, so they never touch
    a live sequence. `lengths[slot]` is how many positions of that slot are valid; rolling back rejected tokens
    is just lowering it.
    """

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int):
        self.kv = torch.zeros(config.num_layers, num_slots + 1, 2 * config.num_kv_heads, max_len, config.head_dim)
        self.max_len = max_len
        self.scratch_slot = num_slots
        self.lengths = [0] * num_slots


@dataclass(slots=True)
class _Layer:
    """Projection weights stored transposed ([in, out]): x @ w beats F.linear's x @ w.T on CPU for the few-row
    inputs of decode and verify (measured 1.4-1.7x at 4-8 rows). Each RMSNorm's weight is folded into the rows
    of the projection after it, leaving the norm a bare normalization (fewer small ops per layer)."""

    qkv: torch.Tensor  # [D, (H + 2 * KV) * Dh], input norm folded in
    o: torch.Tensor  # [H * Dh, D]
    gate_up: torch.Tensor  # [D, 2 * I], post-attention norm folded in
    down: torch.Tensor  # [I, D]


class Llama:
    """Forward passes that append tokens to KV-cache slots; weights as plain fp32 tensors."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_len: int):
        self.config = config
        w = {name: t.float() for name, t in weights.items()}
        self.embed = w["model.embed_tokens.weight"]  # [V, D]
        head = self.embed if config.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self.lm_head = (w["model.norm.weight"][:, None] * head.t()).contiguous()  # [D, V], final norm folded in
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(_Layer(
                qkv=_fold(w[p + "input_layernorm.weight"], torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])),
                o=w[p + "self_attn.o_proj.weight"].t().contiguous(),
                gate_up=_fold(w[p + "post_attention_layernorm.weight"], torch.cat([w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])),
                down=w[p + "mlp.down_proj.weight"].t().contiguous(),
            ))
        # RoPE tables as HF computes them: angle = pos * theta^(-2i/Dh), duplicated over both halves.
        dh = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))
        angles = torch.outer(torch.arange(max_len).float(), inv_freq)
        self.cos = torch.cat([angles.cos(), angles.cos()], dim=-1)  # [max_len, Dh]
        # rotate_half(x) * sin == roll(x, Dh/2) * [-sin, sin]: one roll instead of slice, negate and cat
        self.sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
        self.max_len = max_len

    def new_cache(self, num_slots: int) -> KVCache:
        return KVCache(self.config, num_slots, self.max_len)

    def forward(self, tokens: torch.Tensor, slots: list[int], cache: KVCache, num_new: list[int] | None = None) -> torch.Tensor:
        """Append tokens to each row's slot and return hidden states.

        tokens: [B, T] long; row b continues slot slots[b] from cache.lengths[slot]; only its first num_new[b]
        tokens are real (default all T), the rest is padding whose output is garbage. Returns the final normalized
        hidden states [B, T, D] (the final norm's weight lives in lm_head) and advances cache.lengths by num_new.
        """
        c = self.config
        bsz, seqlen = tokens.shape
        starts = [cache.lengths[s] for s in slots]
        counts = num_new if num_new is not None else [seqlen] * bsz
        ends = [s + n for s, n in zip(starts, counts)]
        if max(ends) > cache.max_len:
            raise ValueError(f"KV cache overflow: {max(ends)} > {cache.max_len} positions")
        kv_len = max(max(ends), 1)
        offsets = torch.arange(seqlen)
        positions = torch.tensor(starts)[:, None] + offsets  # [B, T]
        ragged = any(n != seqlen for n in counts)
        if ragged:
            valid = offsets[None, :] < torch.tensor(counts)[:, None]  # [B, T]
            positions = torch.where(valid, positions, 0)
        # Rows reading a contiguous run of slots use a view of the cache instead of a gather.
        slot_view = slice(slots[0], slots[0] + bsz) if slots == list(range(slots[0], slots[0] + bsz)) else None
        if bsz == 1 and not ragged:
            write = (slots[0], slice(None), slice(starts[0], ends[0]))
        else:
            slot_ids = torch.tensor(slots)[:, None].expand(bsz, seqlen)
            if ragged:
                slot_ids = torch.where(valid, slot_ids, cache.scratch_slot)
            write = (slot_ids, slice(None), positions)
        # Causal mask with per-row offsets: query at position p sees keys 0..p of its own slot. Queries are grouped
        # per KV head ([B, KV, T * G, Dh], G = heads per KV head), so the mask repeats over G: [B, 1, T * G, kv_len].
        nh, nkv, dh = c.num_heads, c.num_kv_heads, c.head_dim
        group = nh // nkv
        mask = None
        if seqlen > 1 or bsz > 1:
            mask = torch.arange(kv_len)[None, None, :] <= positions[:, :, None]  # [B, T, kv_len]
            mask = mask[:, None, :, None, :].expand(bsz, 1, seqlen, group, kv_len).reshape(bsz, 1, seqlen * group, kv_len)
        # RoPE for the q and k heads; v heads pass through (cos 1, sin 0), so one op rotates the whole qkv.
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # [B, T, 1, Dh]
        cos = torch.cat([cos.expand(-1, -1, nh + nkv, -1), torch.ones(bsz, seqlen, nkv, dh)], dim=2)  # [B, T, H + 2KV, Dh]
        sin = torch.cat([sin.expand(-1, -1, nh + nkv, -1), torch.zeros(bsz, seqlen, nkv, dh)], dim=2)

        x = F.embedding(tokens, self.embed)  # [B, T, D]
        for i, layer in enumerate(self.layers):
            h = rms_normalize(x, c.rms_norm_eps)
            qkv = _rope((h @ layer.qkv).view(bsz, seqlen, nh + 2 * nkv, dh), cos, sin)
            q, kv = qkv[:, :, :nh], qkv[:, :, nh:]  # [B, T, H, Dh], [B, T, 2KV, Dh]
            layer_cache = cache.kv[i]  # [S + 1, 2KV, max_len, Dh]
            if isinstance(write[0], int):
                layer_cache[write] = kv[0].transpose(0, 1)
            else:
                layer_cache[write] = kv  # advanced index [B, T] around a slice: value [B, T, 2KV, Dh]
            cached = layer_cache[slot_view, :, :kv_len] if slot_view is not None else layer_cache[slots, :, :kv_len]
            keys, values = cached[:, :nkv], cached[:, nkv:]  # [B, KV, kv_len, Dh] each
            q = q.reshape(bsz, seqlen, nkv, group * dh).transpose(1, 2).reshape(bsz, nkv, seqlen * group, dh)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, KV, T * G, Dh]
            attn = attn.view(bsz, nkv, seqlen, group * dh).transpose(1, 2).reshape(bsz, seqlen, nh * dh)
            x = x + attn @ layer.o
            h = rms_normalize(x, c.rms_norm_eps)
            gate, up = (h @ layer.gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down
        for s, e in zip(slots, ends):
            cache.lengths[s] = e
        return rms_normalize(x, c.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., D] -> logits [..., V]."""
        return hidden @ self.lm_head


def _fold(norm_weight: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HF weight [out, in] after an RMSNorm with weight [in] -> [in, out] with the norm weight folded into its rows."""
    return (norm_weight[:, None] * weight.t()).contiguous()


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    # RMSNorm without its weight (folded into the next projection)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, Dh]; HF Llama's rotate_half convention (dim i pairs with i + Dh/2); sin carries the sign.
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def load_model(path: Path, max_len: int | None = None) -> Llama:
    """Load an HF Llama checkpoint dir (config.json + *.safetensors). max_len defaults to max_position_embeddings."""
    from safetensors.torch import load_file

    config = ModelConfig.from_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpectuneError(f"{path}: no *.safetensors weights; save the model with save_pretrained(safe_serialization=True)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    try:
        return Llama(config, weights, max_len or config.max_position_embeddings)
    except KeyError as exc:
        raise SpectuneError(f"{path}: weight {exc.args[0]} is missing; is this a LlamaForCausalLM checkpoint?") from None
