"""An EAGLE-style draft head: it drafts from the target's own last hidden state, so it needs no layers of its own
to read the context, and it reuses the target's embeddings and LM head.

One draft step maps (the target's feature f_t at position t, the token x_{t+1} that followed) to a predicted
feature f_{t+1}, then to logits for x_{t+2}; the next step feeds the predicted feature back (EAGLE's feature-level
autoregression). It is a residual SwiGLU MLP, no attention and so no KV cache: rolling back rejected drafts costs
nothing. Its LM head is the target's restricted to the draft vocabulary, the K tokens most frequent in training
(FR-Spec, EAGLE-3's d2t): a draft confined to them is still lossless, the target decides.

Features are the target's final hidden states normalized without the final norm's weight (model.py folds that
weight into lm_head), so logits = feature @ lm_head exactly as for the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from spectune.engine.model import Llama, rms_normalize
from spectune.errors import SpectuneError

ARCHITECTURE = "SpectuneEagleHead"


@dataclass(slots=True, frozen=True)
class EagleConfig:
    hidden_size: int  # the target's
    head_size: int
    intermediate_size: int
    draft_vocab_size: int
    rms_norm_eps: float

    @classmethod
    def from_dir(cls, path: Path) -> EagleConfig:
        file = path / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpectuneError(f"{file}: cannot read the EAGLE head's config ({exc}); point `model` at a head made by "
                                "`python -m spectune.engine.train`") from None
        if raw.get("architectures") != [ARCHITECTURE]:
            raise SpectuneError(f"{file}: architectures must be [{ARCHITECTURE!r}]; method eagle runs spectune's own heads")
        return cls(raw["hidden_size"], raw["head_size"], raw["intermediate_size"], raw["draft_vocab_size"], raw["rms_norm_eps"])

    def to_json(self) -> str:
        return json.dumps({"architectures": [ARCHITECTURE], "hidden_size": self.hidden_size, "head_size": self.head_size,
                           "intermediate_size": self.intermediate_size, "draft_vocab_size": self.draft_vocab_size,
                           "rms_norm_eps": self.rms_norm_eps}, indent=2) + "\n"


class EagleHead:
    """Plain fp32 tensors, projections stored [in, out] (see model._Layer)."""

    def __init__(self, config: EagleConfig, weights: dict[str, torch.Tensor], target: Llama):
        if config.hidden_size != target.config.hidden_size:
            raise SpectuneError(f"EAGLE head: hidden_size {config.hidden_size} != the target's {target.config.hidden_size}; "
                                "the head must be trained on this target")
        w = {name: t.float() for name, t in weights.items()}
        self.config = config
        w_in = w["w_in.weight"].t()  # [2D, H]: feature rows, then token-embedding rows
        d = config.hidden_size
        self.feature_in = w_in[:d].contiguous()  # [D, H]
        # The token's half of the input projection, done once for the whole vocabulary: a step reads one row
        # of it instead of an embedding row and a [D, H] matrix.
        self.token_in = (target.embed @ w_in[d:]).contiguous()  # [V, H]
        self.gate_up = w["gate_up.weight"].t().contiguous()  # [H, 2I]
        self.down = w["down.weight"].t().contiguous()  # [I, H]
        self.w_out = w["w_out.weight"].t().contiguous()  # [H, D]
        self.vocab = weights["draft_vocab"].long()  # [K] target token ids
        self.vocab_size = target.config.vocab_size
        self.lm_head = target.lm_head[:, self.vocab].contiguous()  # [D, K]

    def step(self, feature: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feature [B, D], tokens [B] -> (next feature [B, D], logits over the draft vocabulary [B, K])."""
        eps = self.config.rms_norm_eps
        x = feature @ self.feature_in + self.token_in[tokens]
        gate, up = (rms_normalize(x, eps) @ self.gate_up).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ self.down
        feature = rms_normalize(rms_normalize(x, eps) @ self.w_out, eps)
        return feature, feature @ self.lm_head


def load_eagle(path: Path, target: Llama) -> EagleHead:
    from safetensors.torch import load_file

    config = EagleConfig.from_dir(path)
    file = path / "model.safetensors"
    if not file.is_file():
        raise SpectuneError(f"{file}: missing; the EAGLE head dir needs config.json and model.safetensors")
    weights = load_file(str(file))
    if int(weights["draft_vocab"].max()) >= target.config.vocab_size:
        raise SpectuneError(f"{path}: draft vocabulary has ids beyond the target's vocab_size {target.config.vocab_size}")
    return EagleHead(config, weights, target)
