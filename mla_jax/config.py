"""MLA layer configuration, the DeepSeek presets, and reading a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping

from mla_jax.rope import RopeScaling, yarn_get_mscale


@dataclasses.dataclass(frozen=True)
class Llama4Scaling:
  """Position-dependent query scaling `1 + beta * log(1 + floor(pos / original_max_position))`."""
  beta: float
  original_max_position_embeddings: int

  def __post_init__(self):
    if self.original_max_position_embeddings <= 0:
      raise ValueError("llama_4_scaling.original_max_position_embeddings must be positive")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """One DeepSeek MLA attention layer (and its V3.2 indexer when `index_topk` is set)."""
  hidden_size: int
  num_heads: int
  q_lora_rank: int | None
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  rope_theta: float = 10000.0
  max_position_embeddings: int = 163840
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  index_n_heads: int | None = None
  index_head_dim: int | None = None
  index_topk: int | None = None
  llama_4_scaling: Llama4Scaling | None = None

  def __post_init__(self):
    for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"MLAConfig.{name} must be a positive int, got {value!r}")
    if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
      raise ValueError(f"MLAConfig.q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
    indexer = (self.index_n_heads, self.index_head_dim, self.index_topk)
    if any(v is not None for v in indexer):
      if not all(isinstance(v, int) and v > 0 for v in indexer):
        raise ValueError(f"index_n_heads, index_head_dim and index_topk must all be positive ints "
                         f"or all None, got {indexer}")
      if self.q_lora_rank is None:
        raise ValueError("the V3.2 indexer needs q_lora_rank (it projects the normed q latent)")
      if self.index_head_dim <= self.qk_rope_head_dim:
        raise ValueError(f"index_head_dim ({self.index_head_dim}) must exceed the rope dim "
                         f"({self.qk_rope_head_dim})")
    if self.rms_norm_eps <= 0:
      raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def latent_dim(self) -> int:
    """Width of one latent cache row: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def has_indexer(self) -> bool:
    return self.index_topk is not None

  @property
  def softmax_scale(self) -> float:
    """`qk_head_dim**-0.5`, times mscale(factor, mscale_all_dim)**2 under DeepSeek-YaRN."""
    scale = self.qk_head_dim ** -0.5
    if self.rope_scaling is not None:
      m = yarn_get_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
      scale *= m * m
    return scale

  def num_local_heads(self, tp_size: int) -> int:
    """Heads per device under `tp_size`-way tensor parallelism."""
    if tp_size <= 0 or self.num_heads % tp_size:
      raise ValueError(f"num_heads ({self.num_heads}) is not divisible by tp_size ({tp_size})")
    return self.num_heads // tp_size

  def replace(self, **changes) -> "MLAConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "MLAConfig":
    """Reads a Hugging Face DeepSeek V2 / V2-Lite / V3 / V3.2 `config.json` (as a dict)."""
    required = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in required if k not in hf]
    if missing:
      raise ValueError(f"config.json lacks the MLA keys {missing}; is this a DeepSeek V2/V3 config?")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type in ("yarn", "deepseek_yarn"):
      if "factor" not in rope:
        raise ValueError(f"{rope_type} rope scaling needs a 'factor', got {dict(rope)}")
      scaling = RopeScaling(
          factor=float(rope["factor"]),
          original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
          beta_fast=float(rope.get("beta_fast", 32)),
          beta_slow=float(rope.get("beta_slow", 1)),
          mscale=float(rope.get("mscale", 1.0)),
          mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
          attn_factor=float(rope.get("attn_factor", 1.0)),
      )
    elif rope_type != "default":
      raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, yarn, deepseek_yarn")
    l4 = hf.get("llama_4_scaling")
    return cls(
        hidden_size=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_theta=float(theta),
        max_position_embeddings=hf.get("max_position_embeddings", 163840),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        index_n_heads=hf.get("index_n_heads"),
        index_head_dim=hf.get("index_head_dim"),
        index_topk=hf.get("index_topk"),
        llama_4_scaling=None if l4 is None else Llama4Scaling(
            beta=float(l4["beta"]),
            original_max_position_embeddings=int(l4["original_max_position_embeddings"])),
    )

  @classmethod
  def preset(cls, name: str) -> "MLAConfig":
    if name not in PRESETS:
      raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def _yarn(mscale):
  return RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                     beta_slow=1.0, mscale=mscale, mscale_all_dim=mscale)


_PRESETS = {
    "DeepSeek-V2-Lite": MLAConfig(hidden_size=2048, num_heads=16, q_lora_rank=None, rope_scaling=_yarn(0.707)),
    "DeepSeek-V2": MLAConfig(hidden_size=5120, num_heads=128, q_lora_rank=1536, rope_scaling=_yarn(0.707)),
    "DeepSeek-V3": MLAConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536, rope_scaling=_yarn(1.0)),
    "DeepSeek-V3.2": MLAConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536, rope_scaling=_yarn(1.0),
                               index_n_heads=64, index_head_dim=128, index_topk=2048),
}
_PRESETS["DeepSeek-R1"] = _PRESETS["DeepSeek-V3"]
PRESETS: Mapping[str, MLAConfig] = types.MappingProxyType(_PRESETS)
