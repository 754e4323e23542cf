"""Paged latent KV cache: `[num_blocks, block_size, L+R]` rows of `[kv_c_normed | k_pe]`.

The cache is a value (a pytree): writes return a new cache, so a jitted step can donate the old
one and XLA updates it in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mla_jax import reference
from mla_jax.dsa_cache import DSMLACache, IndexerKCache

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
  """data [num_blocks, block_size, L+R]; k_scale: float32 scalar, the fp8 per-tensor scale."""
  data: jax.Array
  k_scale: jax.Array

  @classmethod
  def allocate(cls, num_blocks: int, block_size: int, latent_dim: int = 576, dtype="bfloat16",
               k_scale: float = 1.0) -> "LatentCache":
    dtype = jnp.dtype(dtype)
    if dtype.name not in SUPPORTED_DTYPES:
      raise ValueError(f"latent cache dtype {dtype.name} is not supported; supported: {SUPPORTED_DTYPES}")
    if num_blocks <= 0 or block_size <= 0 or latent_dim <= 0:
      raise ValueError(f"cache sizes must be positive, got num_blocks={num_blocks}, "
                       f"block_size={block_size}, latent_dim={latent_dim}")
    if not k_scale > 0:
      raise ValueError(f"k_scale must be positive, got {k_scale}")
    return cls(jnp.zeros((num_blocks, block_size, latent_dim), dtype), jnp.float32(k_scale))

  @property
  def num_blocks(self) -> int:
    return self.data.shape[0]

  @property
  def block_size(self) -> int:
    return self.data.shape[1]

  @property
  def is_fp8(self) -> bool:
    return reference.is_fp8(self.data.dtype)

  @property
  def scale_or_none(self):
    """The scale the kernels take: only an fp8 cache is scaled."""
    return self.k_scale if self.is_fp8 else None

  def dequantize_rows(self, slots):
    """float32 rows [W, L+R] at `slots` [W]; zeros for invalid slots."""
    return reference.gather_latent_cache(self.data, slots, self.scale_or_none)

  def write(self, kv_c_normed, k_pe, slot_mapping, write_fn=reference.write_latent_cache) -> "LatentCache":
    """Writes one row per token at `slot_mapping` [T]; negative or out-of-range slots are skipped."""
    t = slot_mapping.shape[0]
    width = kv_c_normed.shape[-1] + k_pe.shape[-1]
    if kv_c_normed.shape[0] != t or k_pe.shape[0] != t or width != self.data.shape[-1]:
      raise ValueError(f"cache write: kv_c_normed {kv_c_normed.shape} and k_pe {k_pe.shape} must be "
                       f"[T, L] and [T, R] with T = {t} and L + R = {self.data.shape[-1]}")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
      raise ValueError(f"slot_mapping must be integer, got {slot_mapping.dtype}")
    return dataclasses.replace(self, data=write_fn(self.data, kv_c_normed, k_pe, slot_mapping,
                                                   self.scale_or_none))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSACache:
  """A V3.2 layer's caches: the latent cache (bf16/fp8 `LatentCache`, or `fp8_ds_mla`) and the
  indexer's K cache, sharing one block table."""
  latent: LatentCache | DSMLACache
  indexer: IndexerKCache
