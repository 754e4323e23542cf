"""Loading Hugging Face tensors ([out, in] Linear layout) into nnx parameters, checked first."""

from __future__ import annotations

from typing import Mapping, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.modules import DeepseekV2MLAAttention


class Target(NamedTuple):
  """Where one checkpoint tensor goes: its shape there and the nnx parameter it fills."""
  shape: tuple[int, ...]
  param: nnx.Variable
  transpose: bool  # a Linear weight: stored [out, in], the nnx kernel is [in, out]


def linear_target(linear: nnx.Linear) -> Target:
  return Target(linear.kernel[...].shape[::-1], linear.kernel, True)


def param_target(param: nnx.Variable) -> Target:
  return Target(param[...].shape, param, False)


def attention_targets(module: DeepseekV2MLAAttention) -> dict[str, Target]:
  """HF name (under `model.layers.{i}.self_attn.`) -> target, for this layer's configuration."""
  out = {}
  for attr in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
    if hasattr(module, attr):
      out[f"{attr}.weight"] = linear_target(getattr(module, attr))
  for attr in ("q_a_layernorm", "kv_a_layernorm"):
    if hasattr(module, attr):
      out[f"{attr}.weight"] = param_target(getattr(module, attr).scale)
  if hasattr(module, "indexer"):  # V3.2
    idx = module.indexer
    for attr in ("wq_b", "wk", "weights_proj"):
      out[f"indexer.{attr}.weight"] = linear_target(getattr(idx, attr))
    out["indexer.k_norm.weight"] = param_target(idx.k_norm.scale)
    out["indexer.k_norm.bias"] = param_target(idx.k_norm.bias)
  return out


def check_tensors(targets: Mapping[str, Target], tensors: Mapping[str, object], prefix: str,
                  what: str) -> list[tuple[Target, jnp.ndarray]]:
  """Every target's new value from `tensors[prefix + name]`, converted, nothing assigned yet.

  Every target must be present with its exact shape and finite values, and no other name under
  `prefix` may be left over. `what` names the part being loaded in the errors.
  """
  names = {k[len(prefix):]: k for k in tensors if k.startswith(prefix)}
  missing = sorted(set(targets) - set(names))
  if missing:
    raise ValueError(f"missing {what} tensors: {[prefix + m for m in missing]}")
  unexpected = sorted(set(names) - set(targets))
  if unexpected:
    raise ValueError(f"unexpected {what} tensors: {[prefix + u for u in unexpected]}; "
                     f"expected {sorted(targets)}")
  staged = []
  for name, target in targets.items():
    value = np.asarray(tensors[names[name]])
    if value.shape != target.shape:
      raise ValueError(f"tensor {prefix + name} has shape {value.shape}, expected {target.shape}")
    if not np.all(np.isfinite(value.astype(np.float32))):
      raise ValueError(f"tensor {prefix + name} holds non-finite values")
    staged.append((target, jnp.asarray(value.T if target.transpose else value,
                                       target.param[...].dtype)))
  return staged


def assign(staged: list[tuple[Target, jnp.ndarray]]) -> None:
  """Writes values that `check_tensors` accepted into their parameters."""
  for target, value in staged:
    target.param[...] = value


def load_attention_weights(module: DeepseekV2MLAAttention, tensors: Mapping[str, object],
                           prefix: str = "") -> None:
  """Fills `module` from `tensors` (names as in `model.layers.{i}.self_attn.` minus `prefix`),
  then recomputes the absorbed weights. Tensors outside `prefix` are ignored."""
  assign(check_tensors(attention_targets(module), tensors, prefix, "attention"))
  module.process_weights_after_loading()
