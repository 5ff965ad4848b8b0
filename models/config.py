"""KimiK3Config: the text config of Kimi K3, with Hugging Face field names.

Every choice that ../shared/K3_MODEL.md marks UNCONFIRMED is a field here (see `UNCONFIRMED`), so it can be
changed in one place.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


def _default_linear_attn_config() -> dict[str, Any]:
    # 1-based layer numbers as in the HF config: MLA at 0-based 3, 7, ..., 91 and 92.
    full = [l + 1 for l in range(3, 92, 4)] + [93]
    kda = [l for l in range(1, 94) if l not in full]
    return {"kda_layers": kda, "full_attn_layers": full, "num_heads": 96, "head_dim": 128,
            "short_conv_kernel_size": 4}


# The knobs K3_MODEL.md could not confirm against a source; each is a KimiK3Config field.
UNCONFIRMED = {
    "conv_newest_tap_last": "causal conv: tap K-1 multiplies the newest token (PyTorch conv1d convention)",
    "mla_lora_norm_eps": "MLA q_a / kv_a RMSNorm eps 1e-6 (vLLM passes 1e-5)",
    "attn_res_mix_fp32_norm": "AttnRes mix kept in fp32 into the RMSNorm (vLLM) instead of cast to bf16 (HF)",
}


@dataclass
class KimiK3Config:
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    linear_attn_config: dict = field(default_factory=_default_linear_attn_config)
    kda_gate_lower_bound: float = -5.0
    # MLA
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_lora_norm_eps: float = 1e-6
    # MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    # Attention Residuals
    attn_res_block_size: int = 12
    attn_res_eps: float = 1e-5
    # SiTU-GLU
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # UNCONFIRMED choices (see UNCONFIRMED above)
    conv_newest_tap_last: bool = True
    attn_res_mix_fp32_norm: bool = True

    def __post_init__(self):
        lac = dict(_default_linear_attn_config())
        lac.update(self.linear_attn_config or {})
        self.linear_attn_config = lac
        L = self.num_hidden_layers
        kda = {int(i) for i in lac["kda_layers"]}
        full = {int(i) for i in lac["full_attn_layers"]}
        if kda & full:
            raise ValueError(f"layers listed as both KDA and full attention: {sorted(kda & full)}")
        if kda | full != set(range(1, L + 1)):
            missing = sorted(set(range(1, L + 1)) - (kda | full))
            extra = sorted((kda | full) - set(range(1, L + 1)))
            raise ValueError(f"linear_attn_config must list every layer 1..{L} exactly once "
                             f"(missing {missing}, out of range {extra})")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError("num_experts_per_token > num_experts")
        if self.attn_res_block_size < 1:
            raise ValueError("attn_res_block_size must be >= 1")

    # ---- derived ----
    @property
    def num_kda_heads(self) -> int:
        return int(self.linear_attn_config["num_heads"])

    @property
    def kda_head_dim(self) -> int:
        return int(self.linear_attn_config["head_dim"])

    @property
    def conv_kernel_size(self) -> int:
        return int(self.linear_attn_config["short_conv_kernel_size"])

    @property
    def kda_proj_size(self) -> int:
        return self.num_kda_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def num_attn_res_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    def layer_kind(self, layer: int) -> str:
        """'kda' or 'mla' for a 0-based layer index."""
        return "kda" if (layer + 1) in set(self.linear_attn_config["kda_layers"]) else "mla"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    # ---- construction ----
    @classmethod
    def from_dict(cls, d: dict) -> "KimiK3Config":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown KimiK3Config fields: {unknown}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def preset(cls, name: str) -> "KimiK3Config":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict(PRESETS[name])


PRESETS: dict[str, dict] = {
    "k3": {},
    # Every structural feature at small widths: 6 layers, block size 4 (a block boundary at layer 4), KDA and
    # MLA layers (MLA at 0-based 3 and 5), dense layer 0, latent MoE with shared experts, top-3 of 8.
    "tiny": {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6], "num_heads": 4,
                               "head_dim": 16, "short_conv_kernel_size": 4},
        "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_experts": 8, "num_experts_per_token": 3, "num_shared_experts": 2, "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 48, "intermediate_size": 128, "attn_res_block_size": 4,
    },
}
# K3's layer structure (93 layers, its KDA / MLA pattern, AttnRes blocks of 12, dense layer 0) at tiny's widths:
# the whole K3 graph, small enough to compile and run on a CPU.
PRESETS["k3-layout"] = {**{k: v for k, v in PRESETS["tiny"].items() if k not in ("num_hidden_layers",
                                                                                  "attn_res_block_size")},
                        "linear_attn_config": {k: v for k, v in PRESETS["tiny"]["linear_attn_config"].items()
                                               if k not in ("kda_layers", "full_attn_layers")}}
