"""The KV caches, one home for every kind: the paged latent cache (`LatentCache`), DeepSeek V3.2's
`fp8_ds_mla` latent cache (`DSMLACache`) and indexer K cache (`IndexerKCache`), and a V3.2 layer's
pair of them (`DSACache`).

Every cache is a value (a pytree): writes return a new cache, so a jitted step can donate the old
one and XLA updates it in place. Every kind answers `PagedCache` (dtype name, block size, block
count, bytes per token, which attention reads it, its indexer cache, its dcp placement), and the
latent kinds `LatentCacheKind` too (`write`, `dequantize_rows`): the layer, the backends and
sharding ask the cache, not its type. The V3.2 kinds convert to and from vLLM's packed uint8
cache, bit for bit:

- `LatentCache`: `[num_blocks, block_size, L+R]` rows of `[kv_c_normed | k_pe]` in one of
  `LATENT_CACHE_DTYPES` (an fp8 cache has one per-tensor scale).
- `DSMLACache` row, 656 bytes per token (L=512, R=64; vLLM `concat_and_cache_ds_mla_kernel` in
  csrc/cache_kernels.cu): bytes [0, L) the e4m3 NoPE values (4 tiles of 128), [L, L + 4*L/128) one
  little-endian float32 scale per tile, then R little-endian bfloat16 RoPE values (not quantized).
  vLLM's tensor is [num_blocks, block_size, 656] uint8.
- `IndexerKCache`, D+4 bytes per token (vLLM `indexer_k_quant_and_cache_kernel` and
  `cp_gather_indexer_k_quant_cache_kernel`): vLLM's tensor is [num_blocks, block_size, D+4] uint8
  (`DeepseekV32IndexerBackend.get_kv_cache_shape`), but each block's BS*(D+4) bytes are block-major,
  not per token: all BS*D e4m3 values (token-major), then all BS float32 scales (little-endian).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.sharding import Sharding
from jax.typing import DTypeLike

from mla_jax.quant import (DS_MLA_SCALE_FLOOR, F8, INDEXER_K_SCALE_FLOOR, dequantize, is_fp8,
                           quantize_fp8, quantize_ue8m0, saturate)

LATENT_CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
FP8_DS_MLA = "fp8_ds_mla"  # the latent cache dtype name of `DSMLACache`
# vLLM's kv_cache_dtype names and the usual short ones.
DTYPE_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "bf16": "bfloat16",
                 "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

TILE = 128  # fp8_ds_mla NoPE tile: one scale per 128 latent values
INDEXER_DTYPES = ("float8_e4m3fn", "bfloat16")


# ----------------------------------------------------------------------------- shared helpers

def cache_dtype(dtype, supported, what):
  """`dtype` (a dtype, its name, or an alias such as "fp8") as a numpy dtype, or a ValueError
  naming the supported ones."""
  try:
    resolved = jnp.dtype(DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
  except TypeError:
    resolved = None
  if resolved is None or resolved.name not in supported:
    raise ValueError(f"{what} dtype {dtype!r} is not supported; supported: {', '.join(supported)} "
                     f"(aliases: {', '.join(f'{a}={n}' for a, n in DTYPE_ALIASES.items())})")
  return resolved


def _check_sizes(**sizes):
  for name, value in sizes.items():
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
      raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_k_scale(k_scale):
  if not (np.isfinite(k_scale) and k_scale > 0):
    raise ValueError(f"k_scale must be finite and positive, got {k_scale}")


def _check_rows(name, x, t, width):
  if x.ndim != 2 or x.shape != (t, width):
    raise ValueError(f"{name} must be [T, {width}] with T = len(slot_mapping) = {t}, got {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got {x.dtype}")


def _check_slots(slots):
  if slots.ndim != 1:
    raise ValueError(f"slots must be 1-D, got shape {slots.shape}")
  if not jnp.issubdtype(slots.dtype, jnp.integer):
    raise ValueError(f"slots must be integer, got {slots.dtype}")


def _slot_index(slots, num_slots):
  """(index, valid): invalid slots (< 0 or >= num_slots) map to num_slots, which mode='drop'
  skips on writes; reads clamp them to 0 and zero the result."""
  valid = (slots >= 0) & (slots < num_slots)
  return jnp.where(valid, slots, num_slots), valid


def _scatter(arr, rows, idx):
  """arr [NB, BS, ...] with rows [T, ...] written at flat slots idx [T] (out of range: dropped)."""
  nb, bs = arr.shape[:2]
  flat = arr.reshape(nb * bs, *arr.shape[2:]).at[idx].set(rows.astype(arr.dtype), mode="drop")
  return flat.reshape(arr.shape)


def _gather(arr, idx, valid):
  nb, bs = arr.shape[:2]
  rows = arr.reshape(nb * bs, *arr.shape[2:])[jnp.where(valid, idx, 0)]
  mask = valid.reshape(valid.shape + (1,) * (rows.ndim - 1))
  return jnp.where(mask, rows, jnp.zeros((), arr.dtype))


_UINT = {2: jnp.uint16, 4: jnp.uint32}


def _to_le_bytes(x):
  """[..., n] 16/32-bit floats -> uint8 [..., n * itemsize], each value's bytes little-endian
  (shifts, not a byte-order-dependent bitcast to uint8)."""
  width = x.dtype.itemsize
  bits = lax.bitcast_convert_type(x, _UINT[width])
  b = jnp.stack([((bits >> (8 * i)) & 0xFF).astype(jnp.uint8) for i in range(width)], axis=-1)
  return b.reshape(*x.shape[:-1], x.shape[-1] * width)


def _from_le_bytes(b, dtype):
  """uint8 [..., n * itemsize] little-endian -> dtype [..., n] (bit for bit)."""
  width = jnp.dtype(dtype).itemsize
  uint = _UINT[width]
  b = b.reshape(*b.shape[:-1], b.shape[-1] // width, width).astype(uint)
  bits = b[..., 0]
  for i in range(1, width):
    bits = bits | (b[..., i] << (8 * i))
  return lax.bitcast_convert_type(bits, dtype)


def _check_bytes(data, ndim, what):
  data = jnp.asarray(data)
  if data.dtype != jnp.uint8 or data.ndim != ndim:
    raise ValueError(f"{what} must be a {ndim}-D uint8 array, got {data.dtype} {data.shape}")
  return data



# ----------------------------------------------------------------------------- paged addressing

def positions_to_slots(positions: jax.Array, block_tables: jax.Array, block_size: int,
                       num_blocks: int) -> jax.Array:
  """Request-local positions [T, K] -> cache slots through each row's table [T, MB];
  -1, a position past the table, or a -1 / out-of-cache block gives -1."""
  mb = block_tables.shape[1]
  blk = positions // block_size
  ok = (positions >= 0) & (blk < mb)
  b = jnp.take_along_axis(block_tables, jnp.clip(blk, 0, mb - 1), axis=1)
  ok &= (b >= 0) & (b < num_blocks)
  return jnp.where(ok, b * block_size + positions % block_size, -1).astype(jnp.int32)


def write_latent_cache(kv_cache: jax.Array, kv_c_normed: jax.Array, k_pe: jax.Array,
                       slot_mapping: jax.Array, k_scale: jax.Array | float | None = None
                       ) -> jax.Array:
  """Writes `[kv_c_normed | k_pe]` rows at `slot_mapping`; slots < 0 or past the cache are dropped.

  kv_cache [NB, BS, L+R]; kv_c_normed [T, L]; k_pe [T, R]; slot_mapping [T] int32.
  """
  rows = jnp.concatenate([kv_c_normed, k_pe], axis=-1)
  rows = quantize_fp8(rows, k_scale) if is_fp8(kv_cache.dtype) else saturate(rows, kv_cache.dtype)
  idx, _ = _slot_index(slot_mapping, kv_cache.shape[0] * kv_cache.shape[1])
  return _scatter(kv_cache, rows, idx)


def gather_latent_cache(kv_cache: jax.Array, slots: jax.Array,
                        k_scale: jax.Array | float | None = None) -> jax.Array:
  """Rows at `slots` [W] dequantized to float32 [W, L+R]; invalid slots read as zeros."""
  nb, bs, d = kv_cache.shape
  valid = (slots >= 0) & (slots < nb * bs)
  rows = kv_cache.reshape(nb * bs, d)[jnp.where(valid, slots, 0)]
  return jnp.where(valid[:, None], dequantize(rows, k_scale), 0.0)


@runtime_checkable
class PagedCache(Protocol):
  """What every cache kind answers; the layer, the backends and sharding ask it, not its type."""
  dtype_name: str  # a `LATENT_CACHE_DTYPES` name, FP8_DS_MLA, or an `INDEXER_DTYPES` name
  block_size: int
  num_blocks: int
  bytes_per_token: int
  dense_attention: bool  # whether dense MLA (the decode and prefill kernels) reads it
  indexer: IndexerKCache | None  # a V3.2 layer's indexer K cache, beside its latent one

  def dcp_shardings(self, blocks: Sharding | P, replicated: Sharding | P) -> PagedCache | None:
    """The cache's placement under decode context parallelism (the same pytree with `blocks` on
    arrays split by blocks, `replicated` on the others), or None when dcp does not split it."""


class LatentCacheKind(PagedCache, Protocol):
  """A latent cache: the layer writes its rows and the backends read them."""
  row_width: int  # L+R: a dequantized row, what a query's head dim must match

  def write(self, kv_c_normed: jax.Array, k_pe: jax.Array,
            slot_mapping: jax.Array) -> LatentCacheKind: ...
  def dequantize_rows(self, slots: jax.Array) -> jax.Array: ...


# ----------------------------------------------------------------------------- latent cache

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
  """data [num_blocks, block_size, L+R]; k_scale: float32 scalar, the fp8 per-tensor scale."""
  data: jax.Array
  k_scale: jax.Array

  @classmethod
  def allocate(cls, num_blocks: int, block_size: int, latent_dim: int = 576,
               dtype: DTypeLike = "bfloat16",
               k_scale: float = 1.0) -> "LatentCache":
    dtype = cache_dtype(dtype, LATENT_CACHE_DTYPES, "latent cache")
    if num_blocks <= 0 or block_size <= 0 or latent_dim <= 0:
      raise ValueError(f"cache sizes must be positive, got num_blocks={num_blocks}, "
                       f"block_size={block_size}, latent_dim={latent_dim}")
    _check_k_scale(k_scale)
    return cls(jnp.zeros((num_blocks, block_size, latent_dim), dtype), jnp.float32(k_scale))

  @property
  def num_blocks(self) -> int:
    return self.data.shape[0]

  @property
  def block_size(self) -> int:
    return self.data.shape[1]

  @property
  def is_fp8(self) -> bool:
    return is_fp8(self.data.dtype)

  @property
  def dtype_name(self) -> str:
    return self.data.dtype.name

  @property
  def bytes_per_token(self) -> int:
    return self.data.shape[2] * self.data.dtype.itemsize

  @property
  def row_width(self) -> int:
    return self.data.shape[2]

  dense_attention = True
  indexer = None

  def dcp_shardings(self, blocks: Sharding | P, replicated: Sharding | P) -> "LatentCache":
    """Blocks split over dcp (`blocks`), the scale `replicated`."""
    return LatentCache(blocks, replicated)

  @property
  def scale_or_none(self) -> jax.Array | None:
    """The scale the kernels take: only an fp8 cache is scaled, by a finite positive scalar. Its
    value is checked where it is concrete (an eager call: a host read of one float); under jit it
    is a tracer, never read on the host, so only `allocate`'s check of the float holds there."""
    if not self.is_fp8:
      return None
    if self.k_scale is None or jnp.ndim(self.k_scale) != 0:
      got = "None" if self.k_scale is None else f"shape {jnp.shape(self.k_scale)}"
      raise ValueError(f"an fp8 latent cache needs its per-tensor k_scale, a scalar; got {got}")
    try:
      value = float(self.k_scale)
    except TypeError:  # a tracer (jax.errors.ConcretizationTypeError) or an abstract shape
      return self.k_scale
    _check_k_scale(value)
    return self.k_scale

  def dequantize_rows(self, slots: jax.Array) -> jax.Array:
    """float32 rows [W, L+R] at `slots` [W]; zeros for invalid slots."""
    return gather_latent_cache(self.data, slots, self.scale_or_none)

  def write(self, kv_c_normed: jax.Array, k_pe: jax.Array,
            slot_mapping: jax.Array) -> "LatentCache":
    """Writes one row per token at `slot_mapping` [T]; negative or out-of-range slots are
    skipped."""
    t = slot_mapping.shape[0]
    width = kv_c_normed.shape[-1] + k_pe.shape[-1]
    if kv_c_normed.shape[0] != t or k_pe.shape[0] != t or width != self.data.shape[-1]:
      raise ValueError(f"cache write: kv_c_normed {kv_c_normed.shape} and k_pe {k_pe.shape} must "
                       f"be [T, L] and [T, R] with T = {t} and L + R = {self.data.shape[-1]}")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
      raise ValueError(f"slot_mapping must be integer, got {slot_mapping.dtype}")
    return dataclasses.replace(self, data=write_latent_cache(self.data, kv_c_normed, k_pe,
                                                             slot_mapping, self.scale_or_none))


# ---------------------------------------------------------------------- fp8_ds_mla latent cache

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSMLACache:
  """fp8_ds_mla latent cache, kept as three arrays with the same bytes per token as vLLM's row.

  nope [NB, BS, L] float8_e4m3fn; tile_scales [NB, BS, L/128] float32; rope [NB, BS, R] bfloat16.
  A row dequantizes to `[nope * tile scale | rope]` (576 wide for V3.2).
  """
  nope: jax.Array
  tile_scales: jax.Array
  rope: jax.Array

  @classmethod
  def allocate(cls, num_blocks: int, block_size: int, kv_lora_rank: int = 512,
               rope_dim: int = 64) -> "DSMLACache":
    _check_sizes(num_blocks=num_blocks, block_size=block_size, kv_lora_rank=kv_lora_rank,
                 rope_dim=rope_dim)
    if kv_lora_rank % TILE:
      raise ValueError(f"kv_lora_rank {kv_lora_rank} must be a multiple of the {TILE}-wide tile")
    # Zeros, like a zero-filled vLLM cache: the packed bytes of a fresh cache are all 0.
    return cls(jnp.zeros((num_blocks, block_size, kv_lora_rank), F8),
               jnp.zeros((num_blocks, block_size, kv_lora_rank // TILE), jnp.float32),
               jnp.zeros((num_blocks, block_size, rope_dim), jnp.bfloat16))

  @property
  def num_blocks(self) -> int:
    return self.nope.shape[0]

  @property
  def block_size(self) -> int:
    return self.nope.shape[1]

  @property
  def kv_lora_rank(self) -> int:
    return self.nope.shape[2]

  @property
  def rope_dim(self) -> int:
    return self.rope.shape[2]

  @property
  def bytes_per_token(self) -> int:
    return self.kv_lora_rank + 4 * (self.kv_lora_rank // TILE) + 2 * self.rope_dim

  @property
  def row_width(self) -> int:
    return self.kv_lora_rank + self.rope_dim

  dtype_name = FP8_DS_MLA
  dense_attention = False  # only sparse attention reads the tiled layout
  indexer = None

  def dcp_shardings(self, blocks: Sharding | P, replicated: Sharding | P) -> "DSMLACache":
    """Every array's blocks split over dcp (`blocks`)."""
    del replicated
    return DSMLACache(blocks, blocks, blocks)

  def write(self, kv_c_normed: jax.Array, k_pe: jax.Array,
            slot_mapping: jax.Array) -> "DSMLACache":
    """Quantizes and writes one token per slot; negative or out-of-range slots are skipped.

    kv_c_normed [T, L], k_pe [T, R] (rope applied), slot_mapping [T] integer.
    """
    kv_c_normed, k_pe, slot_mapping = map(jnp.asarray, (kv_c_normed, k_pe, slot_mapping))
    _check_slots(slot_mapping)
    t = slot_mapping.shape[0]
    _check_rows("kv_c_normed", kv_c_normed, t, self.kv_lora_rank)
    _check_rows("k_pe", k_pe, t, self.rope_dim)
    nope, scales = quantize_ue8m0(kv_c_normed, TILE, DS_MLA_SCALE_FLOOR)
    idx, _ = _slot_index(slot_mapping, self.num_blocks * self.block_size)
    return DSMLACache(_scatter(self.nope, nope, idx), _scatter(self.tile_scales, scales, idx),
                      _scatter(self.rope, k_pe.astype(jnp.bfloat16), idx))

  def _dequant(self, nope, scales, rope):
    tiles = nope.astype(jnp.float32).reshape(*nope.shape[:-1], -1, TILE) * scales[..., None]
    return jnp.concatenate([tiles.reshape(nope.shape), rope.astype(jnp.float32)], axis=-1)

  def dequantize_rows(self, slots: jax.Array) -> jax.Array:
    """float32 [W, L+R] rows at `slots` [W]; invalid slots read as zeros."""
    slots = jnp.asarray(slots)
    _check_slots(slots)
    idx, valid = _slot_index(slots, self.num_blocks * self.block_size)
    # Gathering zeros for invalid slots (scale 0 too) makes their rows exactly 0.
    return self._dequant(_gather(self.nope, idx, valid), _gather(self.tile_scales, idx, valid),
                         _gather(self.rope, idx, valid))

  def dequantize(self) -> jax.Array:
    """The whole cache as float32 [NB, BS, L+R] (for references)."""
    return self._dequant(self.nope, self.tile_scales, self.rope)

  def to_vllm_bytes(self) -> jax.Array:
    """uint8 [NB, BS, bytes_per_token]: vLLM's packed rows (656 bytes for V3.2)."""
    return jnp.concatenate([lax.bitcast_convert_type(self.nope, jnp.uint8),
                            _to_le_bytes(self.tile_scales), _to_le_bytes(self.rope)], axis=-1)

  @classmethod
  def from_vllm_bytes(cls, data: jax.Array | np.ndarray, kv_lora_rank: int = 512,
                      rope_dim: int = 64) -> "DSMLACache":
    """Inverse of `to_vllm_bytes`, bit for bit (any float32 tile scale is kept as stored)."""
    data = _check_bytes(data, 3, "fp8_ds_mla cache bytes")
    _check_sizes(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    if kv_lora_rank % TILE:
      raise ValueError(f"kv_lora_rank {kv_lora_rank} must be a multiple of the {TILE}-wide tile")
    n_scale = 4 * (kv_lora_rank // TILE)
    if data.shape[-1] != kv_lora_rank + n_scale + 2 * rope_dim:
      raise ValueError(f"a row of kv_lora_rank={kv_lora_rank}, rope_dim={rope_dim} is "
                       f"{kv_lora_rank + n_scale + 2 * rope_dim} bytes, got {data.shape[-1]}")
    return cls(lax.bitcast_convert_type(data[..., :kv_lora_rank], F8),
               _from_le_bytes(data[..., kv_lora_rank:kv_lora_rank + n_scale], jnp.float32),
               _from_le_bytes(data[..., kv_lora_rank + n_scale:], jnp.bfloat16))


# ----------------------------------------------------------------------------- indexer K cache

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexerKCache:
  """Indexer keys: values [NB, BS, D] float8_e4m3fn (or bfloat16), scales [NB, BS] float32
  (one ue8m0 scale per token; all ones for bfloat16). A key is `values * scale`."""
  values: jax.Array
  scales: jax.Array

  @classmethod
  def allocate(cls, num_blocks: int, block_size: int, head_dim: int = 128,
               dtype: DTypeLike = "float8_e4m3fn") -> "IndexerKCache":
    _check_sizes(num_blocks=num_blocks, block_size=block_size, head_dim=head_dim)
    dtype = cache_dtype(dtype, INDEXER_DTYPES, "indexer cache")
    scales = (jnp.zeros if is_fp8(dtype) else jnp.ones)((num_blocks, block_size), jnp.float32)
    return cls(jnp.zeros((num_blocks, block_size, head_dim), dtype), scales)

  @property
  def num_blocks(self) -> int:
    return self.values.shape[0]

  @property
  def block_size(self) -> int:
    return self.values.shape[1]

  @property
  def head_dim(self) -> int:
    return self.values.shape[2]

  @property
  def is_fp8(self) -> bool:
    return is_fp8(self.values.dtype)

  @property
  def dtype_name(self) -> str:
    return self.values.dtype.name

  @property
  def bytes_per_token(self) -> int:
    return self.head_dim * self.values.dtype.itemsize + 4  # the keys and one float32 scale

  dense_attention = False
  indexer = None

  def dcp_shardings(self, blocks: Sharding | P, replicated: Sharding | P) -> "IndexerKCache":
    """Values and scales split over dcp by blocks (`blocks`)."""
    del replicated
    return IndexerKCache(blocks, blocks)

  def write(self, k: jax.Array, slot_mapping: jax.Array) -> "IndexerKCache":
    """Writes k [T, D] at slot_mapping [T]; negative or out-of-range slots are skipped.
    fp8: per-token ue8m0 quantization (vLLM's amax floor); bfloat16: stored as is, scale 1."""
    k, slot_mapping = jnp.asarray(k), jnp.asarray(slot_mapping)
    _check_slots(slot_mapping)
    _check_rows("k", k, slot_mapping.shape[0], self.head_dim)
    if self.is_fp8:
      values, scales = quantize_ue8m0(k, self.head_dim, INDEXER_K_SCALE_FLOOR)
      scales = scales[:, 0]
    else:
      values, scales = k, jnp.ones(k.shape[:1], jnp.float32)
    idx, _ = _slot_index(slot_mapping, self.num_blocks * self.block_size)
    return IndexerKCache(_scatter(self.values, values, idx), _scatter(self.scales, scales, idx))

  def gather(self, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(values [W, D] in the cache dtype, scales [W] float32) at slots [W]; zeros where invalid."""
    slots = jnp.asarray(slots)
    _check_slots(slots)
    idx, valid = _slot_index(slots, self.num_blocks * self.block_size)
    return _gather(self.values, idx, valid), _gather(self.scales, idx, valid)

  def to_vllm_bytes(self) -> jax.Array:
    """uint8 [NB, BS, D+4], vLLM's tensor shape; each block's bytes are all BS*D values
    (token-major) followed by all BS little-endian float32 scales. fp8 caches only."""
    if not self.is_fp8:
      raise ValueError("only an fp8 indexer cache has a vLLM byte layout")
    nb, bs, d = self.values.shape
    values = lax.bitcast_convert_type(self.values, jnp.uint8).reshape(nb, bs * d)
    flat = jnp.concatenate([values, _to_le_bytes(self.scales)], axis=-1)
    return flat.reshape(nb, bs, d + 4)

  @classmethod
  def from_vllm_bytes(cls, data: jax.Array | np.ndarray) -> "IndexerKCache":
    """Inverse of `to_vllm_bytes`, bit for bit: uint8 [NB, BS, D+4] -> fp8 cache with head_dim D."""
    data = _check_bytes(data, 3, "indexer cache bytes")
    nb, bs, width = data.shape
    if width <= 4:
      raise ValueError(f"an indexer cache row is head_dim + 4 bytes, got {width}")
    d = width - 4
    flat = data.reshape(nb, bs * width)
    values = lax.bitcast_convert_type(flat[:, :bs * d], F8).reshape(nb, bs, d)
    return cls(values, _from_le_bytes(flat[:, bs * d:], jnp.float32))


# ----------------------------------------------------------------------- a V3.2 layer's caches

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSACache:
  """A V3.2 layer's caches: the latent cache (bf16/fp8 `LatentCache`, or `fp8_ds_mla`) and the
  indexer's K cache, sharing one block table."""
  latent: LatentCache | DSMLACache
  indexer: IndexerKCache

  @property
  def dtype_name(self) -> str:
    """The latent part's kind: what metadata built for this cache records."""
    return self.latent.dtype_name

  @property
  def block_size(self) -> int:
    return self.latent.block_size

  @property
  def num_blocks(self) -> int:
    return self.latent.num_blocks

  @property
  def bytes_per_token(self) -> int:
    return self.latent.bytes_per_token + self.indexer.bytes_per_token

  dense_attention = False  # the layer picks the latent part for its dense path

  def dcp_shardings(self, blocks: Sharding | P, replicated: Sharding | P) -> "DSACache":
    """Both caches split over dcp by blocks (they share one block table)."""
    return DSACache(self.latent.dcp_shardings(blocks, replicated),
                    self.indexer.dcp_shardings(blocks, replicated))


def allocate_latent_cache(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
                          dtype: DTypeLike, k_scale: float = 1.0) -> LatentCache | DSMLACache:
  """A latent cache of a `LATENT_CACHE_DTYPES` dtype (or an alias; fp8 with the per-tensor
  `k_scale`), or FP8_DS_MLA's tiled one."""
  if isinstance(dtype, str) and dtype == FP8_DS_MLA:
    return DSMLACache.allocate(num_blocks, block_size, kv_lora_rank, rope_dim)
  return LatentCache.allocate(num_blocks, block_size, kv_lora_rank + rope_dim, dtype, k_scale)
