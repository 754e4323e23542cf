"""MLA layer configuration, the DeepSeek presets, and reading a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping

from mla_jax.rope import RopeScaling, yarn_get_mscale


_REQUIRED = object()


def _hf_typed(hf: Mapping[str, Any], key: str, default, within: str | None, types, what: str):
  """`hf[key]` checked against `types` (bool never passes), `default` when absent or null."""
  where = f"{within}.{key}" if within else key
  value = hf.get(key)
  if value is None:
    if default is _REQUIRED:
      raise ValueError(f"config.json lacks {where}")
    return default
  if isinstance(value, bool) or not isinstance(value, types):
    raise ValueError(f"config.json: {where} is {value!r} ({type(value).__name__}), expected {what}")
  return value


def hf_int(hf: Mapping[str, Any], key: str, default=_REQUIRED, within: str | None = None):
  """`hf[key]` (`within`: the config.json object holding it, for the error) as an int; a
  string, float or bool is refused naming the key."""
  return _hf_typed(hf, key, default, within, int, "an integer")


def hf_number(hf: Mapping[str, Any], key: str, default=_REQUIRED, within: str | None = None):
  """`hf[key]` as a float; anything but an int or a float is refused naming the key."""
  value = _hf_typed(hf, key, default, within, (int, float), "a number")
  return value if value is None else float(value)


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
    q_lora = self.q_lora_rank
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
      raise ValueError(f"MLAConfig.q_lora_rank must be None or a positive int, got {q_lora!r}")
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

  def replace(self, **changes: Any) -> "MLAConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "MLAConfig":
    """Reads a Hugging Face DeepSeek V2 / V2-Lite / V3 / V3.2 `config.json` (as a dict)."""
    required = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in required if k not in hf]
    if missing:
      raise ValueError(f"config.json lacks the MLA keys {missing}; is this a DeepSeek V2/V3 "
                       "config?")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if not isinstance(rope, Mapping):
      raise ValueError(f"config.json: {rope_key} is {rope!r}, expected an object")
    theta = hf_number(rope, "rope_theta", hf_number(hf, "rope_theta", 10000.0), rope_key)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type in ("yarn", "deepseek_yarn"):
      if "factor" not in rope:
        raise ValueError(f"{rope_type} rope scaling needs a 'factor', got {dict(rope)}")
      num = lambda key, default=None: hf_number(rope, key, default, rope_key)
      scaling = RopeScaling(
          factor=num("factor"),
          original_max_position_embeddings=hf_int(rope, "original_max_position_embeddings", 4096,
                                                  rope_key),
          beta_fast=num("beta_fast", 32.0), beta_slow=num("beta_slow", 1.0),
          mscale=num("mscale", 1.0), mscale_all_dim=num("mscale_all_dim", 0.0),
          attn_factor=num("attn_factor", 1.0),
      )
    elif rope_type != "default":
      raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, yarn, "
                       "deepseek_yarn")
    l4 = hf.get("llama_4_scaling")
    if l4 is not None and not isinstance(l4, Mapping):
      raise ValueError(f"config.json: llama_4_scaling is {l4!r}, expected an object")
    return cls(
        hidden_size=hf_int(hf, "hidden_size"),
        num_heads=hf_int(hf, "num_attention_heads"),
        q_lora_rank=hf_int(hf, "q_lora_rank", None),
        kv_lora_rank=hf_int(hf, "kv_lora_rank"),
        qk_nope_head_dim=hf_int(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=hf_int(hf, "qk_rope_head_dim"),
        v_head_dim=hf_int(hf, "v_head_dim"),
        rope_theta=theta,
        max_position_embeddings=hf_int(hf, "max_position_embeddings", 163840),
        rope_scaling=scaling,
        rms_norm_eps=hf_number(hf, "rms_norm_eps", 1e-6),
        index_n_heads=hf_int(hf, "index_n_heads", None),
        index_head_dim=hf_int(hf, "index_head_dim", None),
        index_topk=hf_int(hf, "index_topk", None),
        llama_4_scaling=None if l4 is None else Llama4Scaling(
            beta=hf_number(l4, "beta", None, "llama_4_scaling"),
            original_max_position_embeddings=hf_int(l4, "original_max_position_embeddings", None,
                                                    "llama_4_scaling")),
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
    "DeepSeek-V2-Lite": MLAConfig(hidden_size=2048, num_heads=16, q_lora_rank=None,
                                  rope_scaling=_yarn(0.707)),
    "DeepSeek-V2": MLAConfig(hidden_size=5120, num_heads=128, q_lora_rank=1536,
                             rope_scaling=_yarn(0.707)),
    "DeepSeek-V3": MLAConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536,
                             rope_scaling=_yarn(1.0)),
    "DeepSeek-V3.2": MLAConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536,
                               rope_scaling=_yarn(1.0), index_n_heads=64, index_head_dim=128,
                               index_topk=2048),
}
_PRESETS["DeepSeek-R1"] = _PRESETS["DeepSeek-V3"]
PRESETS: Mapping[str, MLAConfig] = types.MappingProxyType(_PRESETS)
