"""Rotary embeddings: DeepSeek-YaRN frequencies, interleaved (GPT-J) and NeoX (half-split)
styles."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """DeepSeek-YaRN scaling (`rope_scaling` / `rope_parameters` of the Hugging Face config)."""
  factor: float
  original_max_position_embeddings: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0
  attn_factor: float = 1.0

  def __post_init__(self):
    if not self.factor >= 1.0:
      raise ValueError(f"rope scaling factor must be >= 1, got {self.factor}")
    if self.original_max_position_embeddings <= 0:
      raise ValueError("original_max_position_embeddings must be positive, got "
                       f"{self.original_max_position_embeddings}")
    if not self.beta_fast > self.beta_slow > 0:
      raise ValueError(f"need beta_fast > beta_slow > 0, got {self.beta_fast}, {self.beta_slow}")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's attention-magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when scale <= 1)."""
  return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations, dim, base, max_pos):
  return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(rotary_dim: int, base: float, scaling: RopeScaling) -> np.ndarray:
  """DeepSeek-YaRN inverse frequencies [rotary_dim // 2] (float64).

  High-frequency dims keep the original (extrapolated) frequency, low-frequency dims are divided
  by the factor (interpolated), with a linear ramp between the beta_fast and beta_slow dims.
  """
  extrap = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
  interp = extrap / scaling.factor
  orig = scaling.original_max_position_embeddings
  low = max(math.floor(_correction_dim(scaling.beta_fast, rotary_dim, base, orig)), 0)
  high = min(math.ceil(_correction_dim(scaling.beta_slow, rotary_dim, base, orig)), rotary_dim - 1)
  if low == high:
    high += 0.001  # avoids a zero-width ramp
  ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  extrap_mask = 1.0 - ramp
  return interp * (1.0 - extrap_mask) + extrap * extrap_mask


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
  """cos/sin of `positions * inv_freq`, applied to the last `rotary_dim` dims given to it.

  `neox=False` rotates interleaved pairs (2i, 2i+1) as DeepSeek's MLA does; `neox=True` rotates
  the halves (i, i + dim/2) as the V3.2 indexer does.
  """
  rotary_dim: int
  base: float = 10000.0
  scaling: RopeScaling | None = None
  neox: bool = False

  def __post_init__(self):
    if self.rotary_dim <= 0 or self.rotary_dim % 2:
      raise ValueError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")

  @property
  def inv_freq(self) -> np.ndarray:
    if self.scaling is None:
      return self.base ** (-np.arange(0, self.rotary_dim, 2, dtype=np.float64) / self.rotary_dim)
    return yarn_inv_freq(self.rotary_dim, self.base, self.scaling)

  @property
  def cos_sin_scale(self) -> float:
    """YaRN scales cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    s = self.scaling
    if s is None:
      return 1.0
    return (yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim)
            * s.attn_factor)

  def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [T] -> cos, sin [T, rotary_dim // 2] float32."""
    inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles) * self.cos_sin_scale, jnp.sin(angles) * self.cos_sin_scale

  def __call__(self, positions: jax.Array, x: jax.Array) -> jax.Array:
    """Rotates x [T, ..., rotary_dim] (any head dims between) at `positions` [T]; keeps x.dtype."""
    if x.shape[-1] != self.rotary_dim:
      raise ValueError(f"rope expects a last dim of {self.rotary_dim}, got shape {x.shape}")
    cos, sin = self.cos_sin(positions)
    extra = (1,) * (x.ndim - 2)
    cos = cos.reshape(cos.shape[:1] + extra + cos.shape[1:])
    sin = sin.reshape(sin.shape[:1] + extra + sin.shape[1:])
    xf = x.astype(jnp.float32)
    if self.neox:
      x1, x2 = jnp.split(xf, 2, axis=-1)
      out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
      x1, x2 = xf[..., 0::2], xf[..., 1::2]
      out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)
