"""Loading one attention layer's weights from Hugging Face tensor names ([out, in] layout)."""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np

from mla_jax.modules import DeepseekV2MLAAttention


def _expected_shapes(module: DeepseekV2MLAAttention) -> dict[str, tuple[tuple[int, ...], object]]:
  """HF name -> (HF shape, the nnx parameter it fills); Linear kernels are stored [in, out]."""
  out = {}
  for attr in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
    if hasattr(module, attr):
      kernel = getattr(module, attr).kernel
      out[f"{attr}.weight"] = (kernel[...].shape[::-1], kernel)
  for attr in ("q_a_layernorm", "kv_a_layernorm"):
    if hasattr(module, attr):
      scale = getattr(module, attr).scale
      out[f"{attr}.weight"] = (scale[...].shape, scale)
  if hasattr(module, "indexer"):  # V3.2
    idx = module.indexer
    for attr in ("wq_b", "wk", "weights_proj"):
      kernel = getattr(idx, attr).kernel
      out[f"indexer.{attr}.weight"] = (kernel[...].shape[::-1], kernel)
    out["indexer.k_norm.weight"] = (idx.k_norm.scale[...].shape, idx.k_norm.scale)
    out["indexer.k_norm.bias"] = (idx.k_norm.bias[...].shape, idx.k_norm.bias)
  return out


def load_attention_weights(module: DeepseekV2MLAAttention, tensors: Mapping[str, object],
                           prefix: str = "") -> None:
  """Fills `module` from `tensors` (names as in `model.layers.{i}.self_attn.` minus `prefix`).

  Every expected name must be present with its exact shape, and no other name under `prefix` may
  be left over; then the absorbed weights are recomputed.
  """
  expected = _expected_shapes(module)
  names = {k[len(prefix):]: k for k in tensors if k.startswith(prefix)}
  missing = sorted(set(expected) - set(names))
  if missing:
    raise ValueError(f"missing attention tensors: {[prefix + m for m in missing]}")
  unexpected = sorted(set(names) - set(expected))
  if unexpected:
    raise ValueError(f"unexpected tensors for this attention layer: {[prefix + u for u in unexpected]}; "
                     f"expected {sorted(expected)}")
  values = {}
  for name, (shape, _) in expected.items():  # check everything before changing anything
    value = np.asarray(tensors[names[name]])
    if value.shape != shape:
      raise ValueError(f"tensor {prefix + name} has shape {value.shape}, expected {shape}")
    if not np.all(np.isfinite(value.astype(np.float32))):
      raise ValueError(f"tensor {prefix + name} holds non-finite values")
    values[name] = value
  for name, (_, param) in expected.items():
    value = values[name]
    param[...] = jnp.asarray(value.T if value.ndim == 2 else value, param[...].dtype)
  module.process_weights_after_loading()
