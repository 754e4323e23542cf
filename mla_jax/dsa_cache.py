"""DeepSeek V3.2 (DSA) caches: the `fp8_ds_mla` latent cache and the indexer's K cache.

Both are values (pytrees) like `LatentCache`: writes return a new cache, so a jitted step can
donate the old one. Each converts to and from vLLM's packed uint8 cache, bit for bit:

- `DSMLACache` row, 656 bytes per token (L=512, R=64; vLLM `concat_and_cache_ds_mla_kernel` in
  csrc/cache_kernels.cu): bytes [0, L) the e4m3 NoPE values (4 tiles of 128), [L, L + 4*L/128) one
  little-endian float32 scale per tile, then R little-endian bfloat16 RoPE values (not quantized).
  vLLM's tensor is [num_blocks, block_size, 656] uint8.
- `IndexerKCache`, D+4 bytes per token (vLLM `indexer_k_quant_and_cache_kernel` and
  `cp_gather_indexer_k_quant_cache_kernel`): vLLM's tensor is [num_blocks, block_size, D+4] uint8
  (`DeepseekV32IndexerBackend.get_kv_cache_shape`), but each block's BS*(D+4) bytes are block-major,
  not per token: all BS*D e4m3 values (token-major), then all BS float32 scales (little-endian).

Scales are "ue8m0" (powers of two), so `x / scale` is exact and only the e4m3 rounding loses bits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mla_jax.reference import F8, F8_MAX, is_fp8, quantize_fp8

TILE = 128  # fp8_ds_mla NoPE tile: one scale per 128 latent values
# fp8_ds_mla tiles (SPEC 3; FlashMLA's reference quantizer): scale = 2**ceil(log2(max(amax/448, 1e-4))),
# so an all-zero tile gets 2**-13. (vLLM's own CUDA writer stores max(amax/448, FLT_MIN), not a
# power of two; `from_vllm_bytes` keeps whatever scale it finds, the reader only multiplies by it.)
DS_MLA_SCALE_FLOOR = 1e-4
# Indexer K, per token: vLLM's `indexer_k_quant_and_cache_kernel` clamps amax, not the ratio:
# `scale = fmaxf(amax, 1e-4) / 448.0f`, then `exp2f(ceilf(log2f(scale)))`. Division is monotone,
# so in float32 that equals clamping amax/448 at 1e-4f/448f: an all-zero token gets 2**-22.
INDEXER_K_SCALE_FLOOR = float(np.float32(1e-4) / np.float32(F8_MAX))
# Indexer q, per (token, head): vLLM's `per_token_group_quant_fp8(..., use_ue8m0=True)` clamps amax
# at its `eps=1e-10` (`max(absmax, eps) / fp8_max`), i.e. the ratio at 1e-10f/448f.
INDEXER_Q_SCALE_FLOOR = float(np.float32(1e-10) / np.float32(F8_MAX))

_F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)
INDEXER_DTYPES = ("float8_e4m3fn", "bfloat16")


# ----------------------------------------------------------------------------- ue8m0 quantization

def ue8m0_scale(amax, floor=None):
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


def quantize_ue8m0(x, group, floor=None):
  """(e4m3 of `x / scale` [..., n], float32 scales [..., n // group]): one ue8m0 scale per `group`
  consecutive elements of the last dim. Values saturate at +-448 (never NaN)."""
  x = jnp.asarray(x)
  n = x.shape[-1]
  if group <= 0 or n % group:
    raise ValueError(f"quantization group {group} must be positive and divide the last dim {n}")
  g = x.astype(jnp.float32).reshape(*x.shape[:-1], n // group, group)
  scale = ue8m0_scale(jnp.max(jnp.abs(g), axis=-1), floor)
  return quantize_fp8(g, scale[..., None]).reshape(x.shape), scale


def quantize_indexer_q(q):
  """Indexer query [T, H, D] -> (e4m3 [T, H, D], float32 scale [T, H]), one scale per (token, head)."""
  q = jnp.asarray(q)
  values, scales = quantize_ue8m0(q, q.shape[-1], INDEXER_Q_SCALE_FLOOR)
  return values, scales[..., 0]


# ----------------------------------------------------------------------------- shared helpers

def _check_sizes(**sizes):
  for name, value in sizes.items():
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
      raise ValueError(f"{name} must be a positive integer, got {value!r}")


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


# ----------------------------------------------------------------------------- fp8_ds_mla latent cache

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

  def write(self, kv_c_normed, k_pe, slot_mapping) -> "DSMLACache":
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

  def dequantize_rows(self, slots):
    """float32 [W, L+R] rows at `slots` [W]; invalid slots read as zeros."""
    slots = jnp.asarray(slots)
    _check_slots(slots)
    idx, valid = _slot_index(slots, self.num_blocks * self.block_size)
    # Gathering zeros for invalid slots (scale 0 too) makes their rows exactly 0.
    return self._dequant(_gather(self.nope, idx, valid), _gather(self.tile_scales, idx, valid),
                         _gather(self.rope, idx, valid))

  def dequantize(self):
    """The whole cache as float32 [NB, BS, L+R] (for references)."""
    return self._dequant(self.nope, self.tile_scales, self.rope)

  def to_vllm_bytes(self):
    """uint8 [NB, BS, bytes_per_token]: vLLM's packed rows (656 bytes for V3.2)."""
    return jnp.concatenate([lax.bitcast_convert_type(self.nope, jnp.uint8),
                            _to_le_bytes(self.tile_scales), _to_le_bytes(self.rope)], axis=-1)

  @classmethod
  def from_vllm_bytes(cls, data, kv_lora_rank: int = 512, rope_dim: int = 64) -> "DSMLACache":
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
               dtype="float8_e4m3fn") -> "IndexerKCache":
    _check_sizes(num_blocks=num_blocks, block_size=block_size, head_dim=head_dim)
    try:
      dtype = jnp.dtype(dtype)
    except TypeError as e:
      raise ValueError(f"unknown dtype {dtype!r}") from e
    if dtype.name not in INDEXER_DTYPES:
      raise ValueError(f"indexer cache dtype {dtype.name} is not supported; supported: {INDEXER_DTYPES}")
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

  def write(self, k, slot_mapping) -> "IndexerKCache":
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

  def gather(self, slots):
    """(values [W, D] in the cache dtype, scales [W] float32) at slots [W]; zeros where invalid."""
    slots = jnp.asarray(slots)
    _check_slots(slots)
    idx, valid = _slot_index(slots, self.num_blocks * self.block_size)
    return _gather(self.values, idx, valid), _gather(self.scales, idx, valid)

  def to_vllm_bytes(self):
    """uint8 [NB, BS, D+4], vLLM's tensor shape; each block's bytes are all BS*D values
    (token-major) followed by all BS little-endian float32 scales. fp8 caches only."""
    if not self.is_fp8:
      raise ValueError("only an fp8 indexer cache has a vLLM byte layout")
    nb, bs, d = self.values.shape
    values = lax.bitcast_convert_type(self.values, jnp.uint8).reshape(nb, bs * d)
    flat = jnp.concatenate([values, _to_le_bytes(self.scales)], axis=-1)
    return flat.reshape(nb, bs, d + 4)

  @classmethod
  def from_vllm_bytes(cls, data) -> "IndexerKCache":
    """Inverse of `to_vllm_bytes`, bit for bit: uint8 [NB, BS, D+4] -> fp8 cache with head_dim D."""
    data = _check_bytes(data, 3, "indexer cache bytes")
    nb, bs, width = data.shape
    if width <= 4:
      raise ValueError(f"an indexer cache row is head_dim + 4 bytes, got {width}")
    d = width - 4
    flat = data.reshape(nb, bs * width)
    values = lax.bitcast_convert_type(flat[:, :bs * d], F8).reshape(nb, bs, d)
    return cls(values, _from_le_bytes(flat[:, bs * d:], jnp.float32))
