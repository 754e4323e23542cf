"""fp8 (e4m3fn) numerics: the one home of the e4m3 range, per-tensor and ue8m0 (power-of-two)
quantization, the scale floors each writer uses, and dequantization.

Scales are "ue8m0" (powers of two) where vLLM uses them, so `x / scale` is exact and only the
e4m3 rounding loses bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

F8 = jnp.float8_e4m3fn
F8_MAX = 448.0  # e4m3fn's largest finite value
# fp8_ds_mla tiles (SPEC 3; FlashMLA's reference quantizer): scale = 2**ceil(log2(max(amax/448,
# 1e-4))), so an all-zero tile gets 2**-13. (vLLM's own CUDA writer stores max(amax/448, FLT_MIN),
# not a power of two; `from_vllm_bytes` keeps whatever scale it finds, the reader only multiplies.)
DS_MLA_SCALE_FLOOR = 1e-4
# Indexer K, per token: vLLM's `indexer_k_quant_and_cache_kernel` clamps amax, not the ratio:
# `scale = fmaxf(amax, 1e-4) / 448.0f`, then `exp2f(ceilf(log2f(scale)))`. Division is monotone,
# so in float32 that equals clamping amax/448 at 1e-4f/448f: an all-zero token gets 2**-22.
INDEXER_K_SCALE_FLOOR = float(np.float32(1e-4) / np.float32(F8_MAX))
# Indexer q, per (token, head): vLLM's `per_token_group_quant_fp8(..., use_ue8m0=True)` clamps amax
# at its `eps=1e-10` (`max(absmax, eps) / fp8_max`), i.e. the ratio at 1e-10f/448f.
INDEXER_Q_SCALE_FLOOR = float(np.float32(1e-10) / np.float32(F8_MAX))
# Checkpoint weight blocks: an all-zero block keeps a positive scale.
WEIGHT_BLOCK_AMAX_FLOOR = 1e-12

_F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)


def is_fp8(dtype: DTypeLike) -> bool:
  return jnp.dtype(dtype) == jnp.dtype(F8)


def quantize_fp8(x: jax.Array, scale: jax.Array | float) -> jax.Array:
  """e4m3 of `x / scale`, saturated to +-448 (e4m3fn has no infinity: overflow would be NaN).
  Behind an optimization barrier: XLA's GPU compiler otherwise folds a later e4m3 -> float32
  convert into this one and drops the rounding (H200, jax 0.11.2: every bf16 value came back
  unrounded), so a dequantized value in the same jit would not be the stored one."""
  return lax.optimization_barrier(
      jnp.clip(x.astype(jnp.float32) / scale, -F8_MAX, F8_MAX).astype(F8))


def saturate(x: jax.Array, dtype: DTypeLike) -> jax.Array:
  """`x` in the float `dtype`, values past its largest finite one clipped to it (float16's
  65504), as `quantize_fp8` saturates: an inf cache row would make every row that sees it NaN."""
  if jnp.dtype(dtype) == jnp.float16:
    big = float(jnp.finfo(jnp.float16).max)
    x = jnp.clip(x.astype(jnp.float32), -big, big)
  return x.astype(dtype)


def dequantize(x: jax.Array, scale: jax.Array | float | None = None) -> jax.Array:
  """x in float32, times `scale` when given (an unscaled cache passes None)."""
  x = x.astype(jnp.float32)
  return x if scale is None else x * scale


def ue8m0_scale(amax: jax.Array, floor: float | None = None) -> jax.Array:
  """float32 `2**ceil(log2(max(amax / 448, floor)))`, computed exactly from the float's bits.

  `jnp.log2` is not exact at powers of two (XLA gives log2(2**-13) = -12.999999, whose ceil is one
  power too big), so the exponent is read off the bits: a normal float r = 1.m * 2**e has
  ceil(log2 r) = e, plus 1 unless the mantissa is zero. The ratio is also kept >= the smallest
  normal float: XLA flushes subnormals to zero, and a zero scale would make `x / scale` NaN (so with
  no floor an all-zero group gets 2**-126). Non-finite amax gives a non-finite scale.
  """
  if floor is not None and not floor > 0:
    raise ValueError(f"ue8m0 floor must be positive, got {floor}")
  r = jnp.asarray(amax, jnp.float32) / F8_MAX
  if floor is not None:
    r = jnp.maximum(r, floor)
  r = jnp.maximum(r, _F32_MIN_NORMAL)
  bits = lax.bitcast_convert_type(r, jnp.uint32)
  exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
  scale = lax.bitcast_convert_type(exponent << 23, jnp.float32)
  return jnp.where(jnp.isfinite(r), scale, r)


def quantize_ue8m0(x: jax.Array, group: int,
                   floor: float | None = None) -> tuple[jax.Array, jax.Array]:
  """(e4m3 of `x / scale` [..., n], float32 scales [..., n // group]): one ue8m0 scale per `group`
  consecutive elements of the last dim. Values saturate at +-448 (never NaN)."""
  x = jnp.asarray(x)
  n = x.shape[-1]
  if group <= 0 or n % group:
    raise ValueError(f"quantization group {group} must be positive and divide the last dim {n}")
  g = x.astype(jnp.float32).reshape(*x.shape[:-1], n // group, group)
  scale = ue8m0_scale(jnp.max(jnp.abs(g), axis=-1), floor)
  return quantize_fp8(g, scale[..., None]).reshape(x.shape), scale


def quantize_indexer_q(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Indexer query [T, H, D] -> (e4m3 [T, H, D], float32 scale [T, H]), one scale per (token,
  head)."""
  q = jnp.asarray(q)
  values, scales = quantize_ue8m0(q, q.shape[-1], INDEXER_Q_SCALE_FLOOR)
  return values, scales[..., 0]


def block_grid(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
  """Block scales per dim for `shape` in `block`s (the last blocks may be ragged)."""
  return tuple(-(-d // b) for d, b in zip(shape, block))


def expand_block_scales(scale: np.ndarray, block: Sequence[int],
                        shape: Sequence[int]) -> np.ndarray:
  """Block scales [g0, g1] -> one per element [shape] (the last blocks may be ragged)."""
  return np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[:shape[0], :shape[1]]


def quantize_fp8_blocks(w: np.ndarray, block: tuple[int, int] = (128, 128)
                        ) -> tuple[np.ndarray, np.ndarray]:
  """float32 [out, in] -> (e4m3 weight, float32 scale_inv [ceil(out/b0), ceil(in/b1)]), each
  block scaled so that its largest magnitude lands on e4m3's largest finite value."""
  grid = block_grid(w.shape, block)
  padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
  padded[:w.shape[0], :w.shape[1]] = np.abs(w)
  amax = padded.reshape(grid[0], block[0], grid[1], block[1]).max(axis=(1, 3))
  scale = np.maximum(amax, WEIGHT_BLOCK_AMAX_FLOOR).astype(np.float32) / F8_MAX
  return (w / expand_block_scales(scale, block, w.shape)).astype(F8), scale
