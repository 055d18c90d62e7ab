"""A parallel block drafter in the style of P-EAGLE / DFlash (vLLM's method "dflash"): one forward pass drafts a
whole block of K tokens, so drafting costs (almost) the same at every K.

Like the EAGLE head (eagle.py) it reads the target's own last hidden state f_t and the token x_{t+1} that followed,
and it reuses the target's embeddings and LM head (restricted to a draft vocabulary). Instead of feeding its own
predictions back step by step, it appends K learned mask embeddings, one per future position, to a short block:

    [e(x_{t+2-W}) .. e(x_t)]  [c = f_t W_f + e(x_{t+1}) W_e]  [c + m_1 .. c + m_K]
     the last W-1 tokens       the conditioning token          K query slots

and runs a few small transformer layers over it (causal attention, no RoPE: positions are learned embeddings);
slot k's output is mapped into the target's feature space and scored by the target's LM head, giving the draft
for x_{t+1+k}. Causal attention makes the first k slots independent of how many follow, so drafting K tokens is
the first K of drafting `block_size`. No KV cache of its own: rejected drafts leave nothing to undo.

Losslessness does not depend on the drafter: slot k's token is drawn from its own distribution q_k (independently
of the other slots), which is what rejection sampling needs (spectune/engine/speculative.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spectune.engine.model import Llama, rms_normalize
from spectune.errors import SpectuneError

ARCHITECTURE = "SpectuneDFlashHead"
_FIELDS = ("hidden_size", "head_size", "intermediate_size", "num_layers", "num_heads", "block_size", "context_tokens",
           "draft_vocab_size", "rms_norm_eps")


@dataclass(slots=True, frozen=True)
class DFlashConfig:
    hidden_size: int  # the target's
    head_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    block_size: int  # most draft positions one pass predicts
    context_tokens: int  # W: recent tokens in the block, x_{t+1} included
    draft_vocab_size: int
    rms_norm_eps: float

    @classmethod
    def from_dir(cls, path: Path) -> DFlashConfig:
        file = path / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpectuneError(f"{file}: cannot read the dflash head's config ({exc}); point `model` at a head made by "
                                "`python -m spectune.engine.train --dflash-only`") from None
        if not isinstance(raw, dict) or raw.get("architectures") != [ARCHITECTURE]:
            raise SpectuneError(f"{file}: architectures must be [{ARCHITECTURE!r}]; method dflash runs spectune's own heads")
        missing = [name for name in _FIELDS if name not in raw]
        if missing:
            raise SpectuneError(f"{file}: missing {', '.join(missing)}; remake the head with `python -m spectune.engine.train --dflash-only`")
        config = cls(**{name: raw[name] for name in _FIELDS})
        if config.head_size % config.num_heads or min(config.block_size, config.context_tokens, config.num_layers) < 1:
            raise SpectuneError(f"{file}: head_size must divide by num_heads and block_size, context_tokens, num_layers be >= 1")
        return config

    def to_json(self) -> str:
        return json.dumps({"architectures": [ARCHITECTURE], **{name: getattr(self, name) for name in _FIELDS}}, indent=2) + "\n"

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor in model.safetensors and its shape (the trainer's state_dict names)."""
        d, h, i = self.hidden_size, self.head_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "w_in.weight": (h, 2 * d),
            "context_in.weight": (h, d),
            "context_pos": (self.context_tokens - 1, h),
            "slot_embed": (self.block_size, h),
            "w_out.weight": (d, h),
            "draft_vocab": (self.draft_vocab_size,),
        }
        for n in range(self.num_layers):
            shapes |= {f"layers.{n}.qkv.weight": (3 * h, h), f"layers.{n}.o.weight": (h, h),
                       f"layers.{n}.gate_up.weight": (2 * i, h), f"layers.{n}.down.weight": (h, i)}
        return shapes


@dataclass(slots=True)
class _Layer:
    qkv: torch.Tensor  # [H, 3H]
    o: torch.Tensor  # [H, H]
    gate_up: torch.Tensor  # [H, 2I]
    down: torch.Tensor  # [I, H]


class DFlashHead:
    """Plain fp32 tensors, projections stored [in, out] (see model._Layer)."""

    def __init__(self, config: DFlashConfig, weights: dict[str, torch.Tensor], target: Llama):
        if config.hidden_size != target.config.hidden_size:
            raise SpectuneError(f"dflash head: hidden_size {config.hidden_size} != the target's {target.config.hidden_size}; "
                                "the head must be trained on this target")
        w = {name: t.float() for name, t in weights.items()}
        self.config = config
        d = config.hidden_size
        w_in = w["w_in.weight"].t()  # [2D, H]: feature rows, then token-embedding rows
        self.feature_in = w_in[:d].contiguous()  # [D, H]
        # Token inputs projected once for the whole vocabulary: the block reads rows of them.
        self.token_in = (target.embed @ w_in[d:]).contiguous()  # [V, H]
        self.context_in = (target.embed @ w["context_in.weight"].t()).contiguous()  # [V, H]
        self.context_pos = w["context_pos"]  # [W - 1, H], oldest first
        self.slot_embed = w["slot_embed"]  # [block, H]
        self.layers = [
            _Layer(*(w[f"layers.{n}.{name}.weight"].t().contiguous() for name in ("qkv", "o", "gate_up", "down")))
            for n in range(config.num_layers)
        ]
        self.w_out = w["w_out.weight"].t().contiguous()  # [H, D]
        self.vocab = weights["draft_vocab"].long()  # [Vd] target token ids
        self.vocab_size = target.config.vocab_size
        self.lm_head = target.lm_head[:, self.vocab].contiguous()  # [D, Vd]

    def draft(self, feature: torch.Tensor, tokens: torch.Tensor, num_slots: int) -> torch.Tensor:
        """feature [B, D], tokens [B, W] (the last W tokens, x_{t+1} last) -> logits [B, K, Vd] for x_{t+2} .. x_{t+1+K}."""
        c = self.config
        bsz, eps, heads = feature.shape[0], c.rms_norm_eps, c.num_heads
        cond = feature @ self.feature_in + self.token_in[tokens[:, -1]]  # [B, H]
        parts = [self.context_in[tokens[:, :-1]] + self.context_pos] if c.context_tokens > 1 else []  # [B, W-1, H]
        x = torch.cat([*parts, cond[:, None], cond[:, None] + self.slot_embed[:num_slots]], dim=1)  # [B, S, H]
        seq = x.shape[1]
        # The last layer computes only the K slot rows (queries), reading keys and values of the whole block.
        last_mask = torch.ones(num_slots, seq, dtype=torch.bool).tril(seq - num_slots)  # slot i sees rows <= S - K + i
        for n, layer in enumerate(self.layers):
            q, k, v = (rms_normalize(x, eps) @ layer.qkv).view(bsz, seq, 3, heads, -1).permute(2, 0, 3, 1, 4)  # 3 x [B, h, S, Dh]
            if n == len(self.layers) - 1:
                x, q = x[:, -num_slots:], q[:, :, -num_slots:]
                attn = F.scaled_dot_product_attention(q, k, v, attn_mask=last_mask)  # [B, h, K, Dh]
            else:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, h, S, Dh]
            x = x + attn.transpose(1, 2).reshape(bsz, x.shape[1], -1) @ layer.o
            gate, up = (rms_normalize(x, eps) @ layer.gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down
        slots = rms_normalize(rms_normalize(x, eps) @ self.w_out, eps)  # [B, K, D] in the target's feature space
        return slots @ self.lm_head


def load_dflash(path: Path, target: Llama) -> DFlashHead:
    """Load and check a head dir (config.json + model.safetensors); every problem is one line naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = DFlashConfig.from_dir(path)
    file = path / "model.safetensors"
    if not file.is_file():
        raise SpectuneError(f"{file}: missing; the dflash head dir needs config.json and model.safetensors")
    try:
        weights = load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise SpectuneError(f"{file}: not a readable safetensors file ({exc}); remake it with `python -m spectune.engine.train --dflash-only`") from None
    for name, shape in config.weight_shapes().items():
        if name not in weights:
            raise SpectuneError(f"{file}: tensor {name!r} is missing; the file does not match {path / 'config.json'}")
        if tuple(weights[name].shape) != shape:
            raise SpectuneError(f"{file}: tensor {name!r} has shape {tuple(weights[name].shape)}, config.json implies {shape}")
    if int(weights["draft_vocab"].max()) >= target.config.vocab_size or int(weights["draft_vocab"].min()) < 0:
        raise SpectuneError(f"{file}: draft vocabulary has ids outside the target's vocab_size {target.config.vocab_size}")
    return DFlashHead(config, weights, target)
