"""The Kimi K3 reference: config and decode model (the graph k3fuse compiles)."""
from .config import PRESETS, UNCONFIRMED, KimiK3Config
from .modeling_kimi_k3 import KimiK3Cache, KimiK3ForCausalLM, situ_glu

__all__ = ["KimiK3Config", "KimiK3ForCausalLM", "KimiK3Cache", "PRESETS", "UNCONFIRMED", "situ_glu"]
