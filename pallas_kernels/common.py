"""What several kernels share: softmax constants, dtype lists, the split-KV launch and merge, the
decode, prefill, sparse-attention, indexer and top-k contracts' argument checks (the backends run
them too), the tuning configs' field checks, and Mosaic GPU shared-memory helpers.

Pure arrays in and out; no dependency on the rest of the project.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Running max before any visible key: finite, so exp2(m_old - m_new) stays 0 or 1, never NaN.
M_INIT = -1e30
H200_SMS = 132
FLOAT_DTYPES = ("bfloat16", "float16", "float32")
LATENT_CACHE_DTYPES = FLOAT_DTYPES + ("float8_e4m3fn",)  # what the latent-cache kernels read
F8 = jnp.float8_e4m3fn
# Pallas-Triton (jax 0.11.2) picks 64-bit offsets only for arrays over 2**32 bytes, but offsets
# count elements: int32 offsets reach 2**31 elements, so a larger 1-byte array would be read out of
# bounds.
MAX_FP8_ELEMENTS = 2 ** 31
T = TypeVar("T")
SWIZZLE = 128  # bytes: the widest swizzle; wgmma operands and bulk copies use the same layout

# While `phase_profile` is active: the fields that make Mosaic GPU's on-device profiler record
# each phase (`in_phase`) of the kernels built with `mosaic_compiler_params`.
_PHASE_PROFILE: dict[str, object] = {}


@contextlib.contextmanager
def phase_profile(directory: str, space: int):
  """Mosaic GPU kernels traced inside record the clock at each `in_phase` scope's entry and exit,
  `space` scopes a warpgroup (in shared memory beside the kernel's; bounds-checked: a longer trace
  is cut), dumped as Perfetto JSON under `directory` after each call (`benchmarks/phase_profile.py`
  reads it). Only kernels traced inside are profiled: a jit cache keeps what it compiled."""
  _PHASE_PROFILE.update(profile_space=space, profile_dir=directory, profile_bounds_check=True)
  try:
    yield
  finally:
    _PHASE_PROFILE.clear()


def mosaic_compiler_params(**params) -> plmgpu.CompilerParams:
  """A Mosaic GPU kernel's `CompilerParams(**params)`, profiled while `phase_profile` is."""
  return plmgpu.CompilerParams(**params, **_PHASE_PROFILE)


def in_phase(name: str, fn: Callable[..., T], *args, **kwargs) -> T:
  """fn(*args, **kwargs) as the named phase of a warpgroup's step (a `jax.named_scope`: nothing
  in the compiled kernel unless `phase_profile` is active)."""
  with jax.named_scope(name):
    return fn(*args, **kwargs)


def register_pool(warpgroups: int) -> int:
  """Registers a thread of a Mosaic GPU block of `warpgroups` warpgroups holds at launch, summed
  over its warpgroups: 64K / threads rounded down to a multiple of 8, x warpgroups (3: 168 x 3 =
  504; 5: 96 x 5 = 480). `setmaxnreg.inc` past it waits forever for registers the block does not
  hold: a hang on the GPU, which the interpreter (no registers) does not show."""
  return 65536 // (128 * warpgroups) // 8 * 8 * warpgroups


HALF_ROWS = 32  # rows of a half step: the fp8 caches' bf16 slots in mosaic_decode and mosaic_sparse
# Registers of a [32, w] chunk (w a multiple of 8) that a memory warpgroup widens into a 32-row
# bf16 slot: the WGMMA layout's 8 x 8 core matrices (2 adjacent columns a thread), each warp 8
# rows instead of 16, since the WGMMA layout needs 64 rows.
HALF_ROWS_LAYOUT = plmgpu.Layout.TILED(mgpu_fa.Tiling(((HALF_ROWS, 8), (8, 8), (2,))),
                                       warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)


# Where a Mosaic GPU attention kernel's heads sit in its wgmma shapes (mosaic_decode, mosaic_sparse:
# `heads_in`). "m": 64 heads a program, the M of every Hopper wgmma. "n": heads as wgmma's N (a
# multiple of 8): N <= 16 pads to 16, else to 32.
HEADS_M_TILE = 64
HEADS_N_TILES = (16, 32)
# Cross-warp reduction scratch a step's softmax takes with heads in N: a [64, N] max or sum over
# its rows leaves N / 8 registers a thread, each reduced through 4 warps x 32 lanes x 2 float32
# (Mosaic GPU's `FragmentedArray.reduce`); this is all of them at once (no scratch reuse rounds).
REDUCTION_BYTES_PER_8_HEADS = 4 * 32 * 2 * 4


def heads_tile(num_heads: int, heads_in: str) -> int:
  """Heads a program takes: 64 (heads_in="m", wgmma's M; any N in tiles of 64), or with
  heads_in="n" 16 or 32 (wgmma's N; N <= 32 only, a ValueError above)."""
  if heads_in == "m":
    return HEADS_M_TILE
  if num_heads > HEADS_N_TILES[-1]:
    raise ValueError(f"heads_in=\"n\" takes at most {HEADS_N_TILES[-1]} heads (one program's "
                     f"wgmma N; more run as heads_in=\"m\"), got {num_heads}")
  return next(tile for tile in HEADS_N_TILES if num_heads <= tile)


def is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def next_pow2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


def check_pow2(name: str, value: int, minimum: int = 1) -> None:
  """A tuning config's field check: `value` is a power of two >= minimum, else a ValueError."""
  if not (_is_int(value) and is_pow2(value) and value >= minimum):
    raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")


def check_at_least(name: str, value: int, minimum: int) -> None:
  """A tuning config's field check: `value` is an int >= minimum, else a ValueError."""
  if not (_is_int(value) and value >= minimum):
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_triton_config(config: object, blocks: Sequence[str]) -> None:
  """A Pallas-Triton tuning config's checks: the `blocks` fields powers of two >= 16 (Triton's
  smallest dot), num_warps a power of two, num_stages >= 1."""
  for name in blocks:
    check_pow2(name, getattr(config, name), 16)
  check_pow2("num_warps", config.num_warps)
  check_at_least("num_stages", config.num_stages, 1)


def _is_int(value: object) -> bool:
  try:
    operator.index(value)
  except TypeError:
    return False
  return not isinstance(value, bool)


def with_overrides(config: T, **knobs: object) -> T:
  """`config` (a frozen tuning dataclass) with the knobs that are not None replaced; the copy's
  `__post_init__` validates them."""
  return dataclasses.replace(config, **{k: v for k, v in knobs.items() if v is not None})


def sm_count() -> int:
  device = jax.devices()[0]
  if device.platform != "gpu":
    return H200_SMS  # interpret mode: pick what the H200 would
  return getattr(device, "core_count", None) or H200_SMS


def length_splits(max_len: int, sm_count: int = H200_SMS) -> int:
  """vLLM's split count for a static length bound: `min(next_pow2(max(1, max_len // 512)), 2 *
  SMs)` (a split of at least ~512 tokens)."""
  return min(next_pow2(max(1, max_len // 512)), 2 * sm_count)


def default_num_kv_splits(num_tokens: int, num_head_blocks: int, max_len: int,
                          sm_count: int = H200_SMS) -> int:
  """The Triton decode kernels' split count: vLLM's (`length_splits`), capped so the grid holds
  about 2 programs per SM.

  vLLM's rule alone grows with the length even when tokens x head blocks already fill the GPU, and
  every extra split costs a float32 partial output write and read (measured at B=128, S=8192: N=16
  fastest at 2-4 splits and 23% slower at 32, N=128 fastest at 1-2 and 46% slower at 32).
  """
  fill = next_pow2(-(-2 * sm_count // max(1, num_tokens * num_head_blocks)))
  return max(1, min(length_splits(max_len, sm_count), fill))


def one_wave_splits(num_programs: int, sm_count: int = H200_SMS) -> int:
  """The most splits a grid of num_programs programs a split runs in one wave of one program a SM
  (the Mosaic kernels, whose shared memory holds one): splits help only while programs leave SMs
  idle, and each costs a float32 partial output and its merge."""
  return max(1, sm_count // max(1, num_programs))


# The batch-invariant decode mode's split size: every split covers this many of a row's tokens, so
# the split points depend on the row's length only, never on the batch. 2048 is the split the
# default rule picks at B=128, S=8192, N=16 (4 splits), and half the N=128 one.
BATCH_INVARIANT_SPLIT_TOKENS = 2048


def check_split_args(num_kv_splits: int | None, split_tokens: int | None, step: int) -> None:
  """ValueError unless at most one of the two split arguments is given, each valid; `step` is the
  kernel's tokens per inner step, which a fixed split must hold whole."""
  if num_kv_splits is not None and num_kv_splits < 1:
    raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
  if split_tokens is not None and num_kv_splits is not None:
    raise ValueError("give num_kv_splits or split_tokens (fixed splits, batch-invariant), not both")
  if split_tokens is not None and (split_tokens < step or split_tokens % step):
    raise ValueError(f"split_tokens must be a positive multiple of the kernel's step ({step} "
                     f"tokens), got {split_tokens}")


def num_fixed_splits(split_tokens: int, max_len: int) -> int:
  """Grid splits for splits of `split_tokens` tokens over rows of up to `max_len` tokens; a row's
  splits past its length see nothing and merge as exact no-ops."""
  return max(1, pl.cdiv(max_len, split_tokens))


def split_range(num_steps: jax.Array, split: jax.Array, num_splits: int,
                split_steps: int | None = None) -> tuple[jax.Array, jax.Array]:
  """(first step, end step) of `split` over a row of `num_steps` steps: `split_steps` each when
  fixed (batch-invariant mode), else the row's steps spread evenly over `num_splits`."""
  per_split = split_steps or pl.cdiv(num_steps, num_splits)
  first = split * per_split
  return first, jnp.minimum(first + per_split, num_steps)


def split_kv_call(kernel: Callable[..., None], q: jax.Array, others: Sequence[jax.Array], *,
                  block_h: int, splits: int, lora: int, num_warps: int, num_stages: int,
                  interpret: bool, name: str,
                  fixed_order: bool = False) -> tuple[jax.Array, jax.Array]:
  """Stage 1 over the grid (head blocks, splits, tokens), then stage 2; shared by the split-KV
  kernels.

  kernel(q_ref [block_h, D], *refs of `others` whole, o_ref [block_h, lora], lse_ref [block_h]);
  q [T, Np, D] with Np a multiple of block_h. Returns o [T, Np, lora] in q.dtype and lse [T, Np].
  fixed_order: always float32 partials, merged in split order (`merge_splits`).
  """
  t, np_, d = q.shape
  out_dtype = partials_dtype(q.dtype, splits, fixed_order)
  whole = lambda x: pl.BlockSpec(x.shape, lambda h, s, i: (0,) * x.ndim)
  # Head blocks vary fastest so the programs reading the same cache rows run together and share L2.
  o_parts, lse_parts = pl.pallas_call(
      kernel,
      grid=(np_ // block_h, splits, t),
      in_specs=[pl.BlockSpec((None, block_h, d), lambda h, s, i: (i, h, 0))]
               + [whole(x) for x in others],
      out_specs=[pl.BlockSpec((None, None, block_h, lora), lambda h, s, i: (i, s, h, 0)),
                 pl.BlockSpec((None, None, block_h), lambda h, s, i: (i, s, h))],
      out_shape=[jax.ShapeDtypeStruct((t, splits, np_, lora), out_dtype),
                 jax.ShapeDtypeStruct((t, splits, np_), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )(q, *others)
  if splits == 1 and not fixed_order:
    return o_parts[:, 0], lse_parts[:, 0]
  return merge_splits(o_parts, lse_parts, q.dtype, fixed_order=fixed_order)


def partials_dtype(dtype: jnp.dtype, splits: int, fixed_order: bool) -> jnp.dtype:
  """Stage 1's output dtype: the final one when a single split writes the result itself."""
  return dtype if splits == 1 and not fixed_order else jnp.float32


def merge_splits(o_parts: jax.Array, lse_parts: jax.Array, out_dtype: jnp.dtype, *,
                 fixed_order: bool = False) -> tuple[jax.Array, jax.Array]:
  """Stage 2: o_parts [T, S, N, L] f32, lse_parts [T, S, N] -> (o [T, N, L], lse [T, N]).

  Plain XLA, which fuses it into one reduction reading each partial once (a Pallas merge was not
  timed against it). A split or row that saw nothing (lse -inf) gets weight 0.
  fixed_order: the splits are added one at a time in split order (elementwise, so no reduction
  whose order could follow the batch shape); a split that saw nothing adds exact zeros, so
  trailing empty splits (a wider table) leave the result's bits unchanged.
  """
  m = lse_parts.max(axis=1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse_parts - m[:, None])
  if fixed_order:
    total, o = w[:, 0], w[:, 0, :, None] * o_parts[:, 0]
    for s in range(1, w.shape[1]):
      total, o = total + w[:, s], o + w[:, s, :, None] * o_parts[:, s]
  else:
    total, o = w.sum(axis=1), (w[..., None] * o_parts).sum(axis=1)
  safe = jnp.where(total > 0, total, 1.0)
  o = o / safe[..., None]
  return o.astype(out_dtype), jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)


def check_decode_args(q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array,
                      seq_lens: jax.Array, kv_lora_rank: int) -> tuple[int, int, int]:
  """The decode contract's shapes and index dtypes, shared by every decode kernel and backend;
  returns (T, D, page)."""
  if q.ndim != 3 or kv_cache.ndim != 3 or block_tables.ndim != 2 or seq_lens.ndim != 1:
    raise ValueError(f"want q [T, N, D], kv_cache [num_blocks, page, D], block_tables "
                     f"[T, max_blocks], seq_lens [T]; got {q.shape}, {kv_cache.shape}, "
                     f"{block_tables.shape}, {seq_lens.shape}")
  t, _, d = q.shape
  if block_tables.shape[0] != t or seq_lens.shape[0] != t:
    raise ValueError(f"block_tables and seq_lens need one row per query token ({t}); got "
                     f"{block_tables.shape[0]} and {seq_lens.shape[0]}")
  if kv_cache.shape[2] != d:
    raise ValueError(f"q head dim {d} != cache row width {kv_cache.shape[2]}")
  if not 0 < kv_lora_rank < d:
    raise ValueError(f"kv_lora_rank must be in [1, {d}) (q's head dim {d} is kv_lora_rank + the "
                     f"rope dim), got {kv_lora_rank}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q dtype must be floating point, got {q.dtype.name}")
  if block_tables.dtype != jnp.int32 or seq_lens.dtype != jnp.int32:
    raise ValueError(f"block_tables and seq_lens must be int32, got {block_tables.dtype.name} and "
                     f"{seq_lens.dtype.name}")
  return t, d, kv_cache.shape[1]


def check_sparse_args(q: jax.Array, slots: jax.Array, num_splits: int | None = None) -> None:
  """The sparse-attention contract's q [T, N, D] and slots [T, K] int32, shared by every sparse
  kernel and backend."""
  if q.ndim != 3 or slots.ndim != 2 or slots.shape[0] != q.shape[0]:
    raise ValueError(f"want q [T, N, L+R] and slots [T, K] with the same T; got {q.shape} and "
                     f"{slots.shape}")
  if slots.dtype != jnp.int32:
    raise ValueError(f"slots must be int32, got {slots.dtype.name}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q dtype must be floating point, got {q.dtype.name}")
  if num_splits is not None and num_splits < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def check_topk_args(logits: jax.Array, seq_lens: jax.Array, topk: int,
                    block_tables: jax.Array | None = None, block_size: int | None = None,
                    num_blocks: int | None = None) -> None:
  """The top-k contract's logits [T, S] float32, seq_lens [T] int32 and a positive int topk (which
  may exceed S: the rest is -1), shared by every top-k kernel and backend; with block_tables (the
  selection mapped to cache slots too), block_tables [T, MB] int32 and positive int block_size and
  num_blocks."""
  if logits.ndim != 2 or seq_lens.shape != logits.shape[:1]:
    raise ValueError(f"want logits [T, S] and seq_lens [T]; got {logits.shape} and "
                     f"{seq_lens.shape}")
  if logits.dtype != jnp.float32 or seq_lens.dtype != jnp.int32:
    raise ValueError(f"logits must be float32 and seq_lens int32; got {logits.dtype.name} and "
                     f"{seq_lens.dtype.name}")
  if not (_is_int(topk) and topk >= 1):
    raise ValueError(f"topk must be a positive int, got {topk!r}")
  if block_tables is None:
    if block_size is not None or num_blocks is not None:
      raise ValueError("block_size and num_blocks map the selection to slots: pass block_tables "
                       "too")
    return
  if block_tables.ndim != 2 or block_tables.shape[0] != logits.shape[0]:
    raise ValueError(f"want block_tables [T, MB] with T = {logits.shape[0]} (the logits' rows), "
                     f"got {block_tables.shape}")
  if block_tables.dtype != jnp.int32:
    raise ValueError(f"block_tables must be int32, got {block_tables.dtype.name}")
  for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
    if not (_is_int(value) and value >= 1):
      raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_prefill_args(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                       cu_seqlens_k: jax.Array, max_seqlen_q: int,
                       dtypes: Sequence[str], k_pe: jax.Array | None = None) -> None:
  """The prefill contract's shapes and dtypes, shared by every prefill kernel; with k_pe, the
  split form's (`check_k_pe`)."""
  if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
    raise ValueError(f"q, k, v must be [T, N, D]; got {q.shape}, {k.shape}, {v.shape}")
  if not (q.dtype == k.dtype == v.dtype) or q.dtype.name not in dtypes:
    raise ValueError(f"q, k, v must share one dtype of {dtypes}; got {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  if k_pe is not None:
    check_k_pe(q, k, k_pe)
  key_dim = k.shape[2] + (0 if k_pe is None else k_pe.shape[1])
  if k.shape[:2] != v.shape[:2] or q.shape[1] != k.shape[1] or q.shape[2] != key_dim:
    raise ValueError(f"need q [Tq,N,Dk], k [Tk,N,Dk], v [Tk,N,Dv]; got {q.shape}, {k.shape}, "
                     f"{v.shape}")
  for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
    if cu.ndim != 1 or cu.shape[0] < 1 or cu.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32 [R+1]; got {cu.dtype} {cu.shape}")
  if cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise ValueError(f"cu_seqlens_q and cu_seqlens_k differ in length: {cu_seqlens_q.shape} vs "
                     f"{cu_seqlens_k.shape}")
  if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
    raise ValueError(f"max_seqlen_q must be a static int >= 0; got {max_seqlen_q!r}")
  if max(q.size, k.size, v.size) >= 2**31:
    raise ValueError("arrays of 2**31 or more elements overflow the kernel's int32 offsets; split "
                     "the call")


def check_k_pe(q: jax.Array, k: jax.Array, k_pe: jax.Array) -> None:
  """The prefill contract's split keys: k [Tk, N, Dk - R] (each head's own columns) and k_pe
  [Tk, R] (the last R columns of every head's keys, one copy for all heads), in q's dtype."""
  if k_pe.ndim != 2 or k.ndim != 3 or q.ndim != 3 or k_pe.shape[0] != k.shape[0]:
    raise ValueError(f"k_pe must be [Tk, R] beside k [Tk, N, Dk-R]; got k_pe {k_pe.shape}, k "
                     f"{k.shape}")
  if not 0 < k_pe.shape[1] < q.shape[2] or k.shape[2] + k_pe.shape[1] != q.shape[2]:
    raise ValueError(f"k's columns and k_pe's must add up to q's Dk ({q.shape[2]}), both > 0; got "
                     f"{k.shape[2]} + {k_pe.shape[1]}")
  if k_pe.dtype != q.dtype:
    raise ValueError(f"k_pe must have q's dtype {q.dtype}; got {k_pe.dtype}")


def join_k_pe(k: jax.Array, k_pe: jax.Array | None) -> jax.Array:
  """The split form's keys whole: [k | k_pe broadcast to every head] [Tk, N, Dk] (a copy; k as it
  is without k_pe)."""
  if k_pe is None:
    return k
  shape = k.shape[:2] + k_pe.shape[-1:]
  return jnp.concatenate([k, jnp.broadcast_to(k_pe[:, None, :], shape)], axis=-1)


def swizzled(shape: tuple[int, ...], dtype: jnp.dtype, swizzle: int = SWIZZLE) -> pl.MemoryRef:
  """A shared-memory buffer in the tiled, swizzled layout that wgmma reads (128 bytes unless a
  product needs a narrower one: wgmma's K must be a multiple of the swizzle's width)."""
  elems = swizzle // jnp.dtype(dtype).itemsize
  return plmgpu.SMEM(shape, dtype, transforms=(plmgpu.TilingTransform((8, elems)),
                                               plmgpu.SwizzleTransform(swizzle)))


def row_broadcast(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return lax.broadcast_in_dim(x, shape, [0])


# The split-KV Mosaic GPU attention kernels (mosaic_decode, mosaic_sparse) share their consumers'
# protocol: warpgroup 0 computes the scores and the online softmax and hands P and the rows'
# rescale factors to warpgroup 1 through p_smem / row_smem (barriers p_ready, p_free); each holds
# half of the output columns.


# FlashAttention-4's slack: P <= 2^8 (bf16 holds it at full relative precision).
RESCALE_SLACK = 8.0


def check_rescale_slack(slack: object) -> None:
  """rescale_slack (the Mosaic attention kernels' lazy rescale): None, or a finite float >= 0 in
  log2 units (`softmax_step`)."""
  if slack is None:
    return
  if (isinstance(slack, bool) or not isinstance(slack, (int, float))
      or not 0 <= slack < float("inf")):
    raise ValueError(f"rescale_slack must be None or a finite float >= 0 (log2 units: P <= "
                     f"2^slack), got {slack!r}")


def check_softmax_scale(scale: object) -> None:
  """The Mosaic attention kernels' softmax scale: a finite positive float (`softmax_step` takes a
  row's maximum score before scaling it)."""
  if (isinstance(scale, bool) or not isinstance(scale, (int, float))
      or not 0 < scale < float("inf")):
    raise ValueError(f"scale must be a finite positive float (the kernel takes a row's maximum "
                     f"score before scaling it), got {scale!r}")


def softmax_step(s, m, l, heads_axis=0, slack=None, scale=None):
  """One step of the base-2 online softmax: s [64, K] scores already times log2(e) (-inf where
  masked), m and l the rows' running max and sum. Returns (m_new, alpha, p, l_new).
  scale (> 0: a scalar, or one a row of m's shape): s holds the raw products and the step scales
  them inside exp2's argument (an FFMA an element, where a multiply before the step was one more
  instruction an element on the path from S to P; FlashMLA's order): a row's maximum is taken
  before scaling, which a positive scale keeps. m, alpha and p are the same base-2 values.
  heads_axis=1 (mosaic_sparse's heads_in="n"): s is S^T [K, heads], reduced over axis 0 (across
  the warpgroup's warps, through the kernel's reduction scratch), m and l one per column. l of
  s's shape holds partial sums, each element its own key's (rescaled like the others), summed
  over the keys once after the last step (`run_scores`' partial_sums).
  slack (the kernels' rescale_slack, a float >= 0): a row's m moves only to a step maximum above
  m + slack, so p <= 2^slack and alpha is exactly 1 for rows that keep theirs (what the lazy
  rescale, `mosaic_lanes.rows_rescaled`, skips; FlashAttention-4's conditional rescaling). The
  sums are the same softmax at any m; P in bf16 keeps its relative precision at any scale. 0 is
  today's maximum."""
  keys = 1 - heads_axis
  along_rows = lambda x: x if jnp.ndim(x) == 0 else lax.broadcast_in_dim(x, s.shape, [heads_axis])
  step_max = s.max(axis=keys)
  if scale is not None:
    step_max = step_max * scale
    s = s * along_rows(scale)
  if slack is None:
    m_new = jnp.maximum(m, step_max)
  else:
    m_new = jnp.where(step_max > m + slack, step_max, m)
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s - along_rows(m_new))
  if l.shape == s.shape:
    return m_new, alpha, p, l * along_rows(alpha) + p
  return m_new, alpha, p, l * alpha + p.sum(axis=keys)


def hand_over_p(i, p, alpha, p_smem, row_smem, p_ready, p_free):
  """Warpgroup 0's hand-off of step i's P and rescale factors (once warpgroup 1 is done with the
  previous ones; p_free None: the caller has waited for that); returns P in p_smem's dtype."""
  if p_free is not None:
    @pl.when(i > 0)
    def _():
      plmgpu.barrier_wait(p_free)

  p16 = p.astype(p_smem.dtype)
  p_smem[...] = p16
  row_smem[...] = alpha
  plmgpu.commit_smem()
  plmgpu.barrier_arrive(p_ready)
  return p16


SWIZZLE_ROWS = 8  # rows of one swizzle period: a bulk copy into part of a tile takes whole periods


def padded_heads(n: int, tile: int) -> int:
  """Heads a kernel's query and output arrays hold for n heads in tiles of `tile` rows: n where it
  is whole tiles, or fewer than a tile in whole swizzle periods (the tile then copies in and stores
  only those rows, with no pad before the kernel and no slice after); else whole tiles (the zero
  heads added give finite scores and are sliced off)."""
  if n % tile == 0 or (n < tile and n % SWIZZLE_ROWS == 0):
    return n
  return -(-n // tile) * tile


def leading_rows(smem, gmem):
  """smem's first rows, as many as gmem has (a query or output of fewer heads than the tile):
  the shared-memory side of a bulk copy to or from gmem."""
  return smem if gmem.shape[0] == smem.shape[0] else smem.at[pl.ds(0, gmem.shape[0])]


def step_variant(smem, i):
  """smem (a wgmma operand every step of a loop reads, e.g. the query tile) at a row offset that is
  0 for every step index 0 <= i < 2^30, but that LLVM cannot prove constant. Read as it is, its
  descriptors (a 64-bit one per wgmma k-step: 36 for K = 576) are loop-invariant, LLVM hoists
  them out of the step loop, and ptxas spills them and reloads them every step before the first
  product (mosaic_decode at 64 heads a tile: 20 spill loads a step, on warpgroup 0's path from the
  page's arrival to S; shared memory leaves L1 ~29 KB, so they come from L2; mosaic_sparse with
  fp8_ds_mla: 2-14). Offset by i >> 30 rows, they are recomputed each step in uniform registers
  beside each HGMMA, and nothing spills (ptxas 13.5, sm_90a: `benchmarks/ptxas_report.py decode`,
  `sparse`). The same instructions otherwise: the results are bit for bit the same (H200, session
  20: decode 1.05-1.08x at 64 and 128 heads, fp8_ds_mla sparse 1.04-1.08x; session 21:
  mosaic_prefill's two query tiles, 1.055x at 16K tokens)."""
  rows = smem.shape[0]
  return smem.at[pl.ds(pl.multiple_of(lax.shift_right_logical(i, 30) * rows, rows), rows)]


def _store_output(acc, l, o_smem, o_gmem, out_scale, heads_axis=0, store=None):
  """acc (column tiles [64, w] f32 of one warpgroup's output) * out_scale / l, rows that saw
  nothing 0, staged in o_smem [64, cols] and copied to o_gmem (its rows: the first 64 or fewer).
  store: store(tiles) writes the scaled tiles (a list, o_smem's dtype) into o_smem itself, in its
  own order, instead of the stores below (mosaic_decode's wide_values).
  heads_axis=1: the tiles are O^T [w, heads], stored transposed into o_smem [heads, cols], so
  o_gmem keeps the [heads, cols] layout; or, where o_smem is [cols, heads] (told apart by its
  shape: heads <= 32 < cols), stored as they are, o_gmem [cols, heads] (mosaic_decode's float32
  partials: Mosaic GPU, jax 0.11.2, lowers a transposed store of bf16 but not of float32)."""
  inv = out_scale / jnp.where(l > 0, l, 1.0)
  cols_first = heads_axis == 1 and o_smem.shape[-1] == acc[0].shape[1]
  col, tiles = 0, []
  for part in acc:
    width = part.shape[1 - heads_axis]
    scaled = (part * lax.broadcast_in_dim(inv, part.shape, [heads_axis])).astype(o_smem.dtype)
    if store is not None:
      tiles.append(scaled)
    elif heads_axis == 0:
      o_smem[:, pl.ds(col, width)] = scaled
    elif cols_first:
      o_smem[pl.ds(col, width), :] = scaled
    else:
      o_smem.at[:, pl.ds(col, width)].transpose((1, 0))[...] = scaled
    col += width
  if store is not None:
    store(tiles)
  plmgpu.commit_smem()
  plmgpu.copy_smem_to_gmem(leading_rows(o_smem, o_gmem), o_gmem)


def run_scores(n, step, acc, *, row_smem, p_ready, p_free, lse_smem, lse_gmem, o_smem=None,
               o_gmem=None, out_scale=1.0, heads_axis=0, partial_sums=None):
  """Warpgroup 0's n steps, (m, l, acc) = step(i, (m, l, acc)) from an empty softmax over 64 rows,
  and its end: once warpgroup 1 has read the last P (every step of both is done, so the step
  buffers are free for the output staging), hands it l, stores its output columns and the rows'
  log-sum-exps (natural log; -inf where nothing was seen). heads_axis=1: the heads are acc's
  columns (tiles of O^T, `softmax_step`). acc empty (no output columns: mosaic_decode's
  register_a, whose warpgroup 1 holds them all): no o_smem, o_gmem, only the log-sum-exps.
  partial_sums (a step's score shape, heads_axis=1 only): l is carried as partial sums of that
  shape and summed over the keys after the last step, so no step sums P across the warps.
  """
  rows_layout = plmgpu.Layout.WGMMA.reduce(1 - heads_axis)
  rows = row_smem.shape[0]
  l_shape = (rows,) if partial_sums is None else partial_sums
  init = (plmgpu.layout_cast(jnp.full((rows,), M_INIT, jnp.float32), rows_layout),
          plmgpu.layout_cast(jnp.zeros(l_shape, jnp.float32),
                             rows_layout if partial_sums is None else plmgpu.Layout.WGMMA), acc)
  m, l, acc = lax.fori_loop(0, n, step, init)
  if partial_sums is not None:
    l = l.sum(axis=1 - heads_axis)

  @pl.when(n > 0)
  def _():
    plmgpu.barrier_wait(p_free)

  row_smem[...] = l
  plmgpu.commit_smem()
  plmgpu.barrier_arrive(p_ready)
  if acc:
    _store_output(acc, l, o_smem, o_gmem, out_scale, heads_axis)
  seen = l > 0
  lse_smem[...] = jnp.where(seen, m * LN2 + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
  plmgpu.commit_smem()
  plmgpu.copy_smem_to_gmem(leading_rows(lse_smem, lse_gmem), lse_gmem)
  plmgpu.wait_smem_to_gmem(0)


def run_values(n, num_slots, accumulate, acc, *, ready, consumed, row_smem, p_ready, p_free,
               o_smem, o_gmem, out_scale=1.0, widen=None, heads_axis=0, pages=1, store=None):
  """Warpgroup 1's n steps and end: per step, once the slot's rows and warpgroup 0's P and rescale
  factors are in, acc = accumulate(acc, alpha, slot) (acc * alpha + P V over its columns); then it
  takes l from warpgroup 0 and stores its output columns.

  pages > 1 (mosaic_decode's pages_per_step; no widen): step i reads pages pages * i + k, page p
  in slot p % num_slots, and acc = accumulate(acc, alpha, slots, release) with the step's slots;
  accumulate calls release(k) once it has last read page k's slot (its consumed arrival), so a
  page's slot is refilled while the step's later pages are still read.

  widen (the fp8 half-row pipelines' "shared_widening", mosaic_decode and mosaic_sparse): widen(k)
  widens warpgroup 1's own value columns of consumer step k into slot k % num_slots and arrives on
  its ready barrier (the memory warpgroup widens the other columns: ready takes both); or any work
  that refills slot k % num_slots for step k (mosaic_sparse's gather_by="values": its gather).
  Steps 0 to num_slots - 1 are widened before the loop, and step k + num_slots right after the P V
  of step k (once both value warpgroups are done with its slot), while warpgroup 0 computes the
  next step's scores and softmax from the other slot. heads_axis: `run_scores`'. store: what
  stages the output in o_smem (`_store_output`)."""
  rows_layout = plmgpu.Layout.WGMMA.reduce(1 - heads_axis)
  if widen is not None:
    for k in range(num_slots):  # the first steps' slots, before any was used
      pl.when(k < n)(functools.partial(widen, k))

  def pages_step(i, acc):
    slots = tuple(lax.rem(pages * i + k, num_slots) for k in range(pages))
    for slot in slots:  # (as `step`'s wait)
      plmgpu.barrier_wait(ready.at[slot])
    plmgpu.barrier_wait(p_ready)
    acc = accumulate(acc, plmgpu.load(row_smem, layout=rows_layout), slots,
                     lambda k: plmgpu.barrier_arrive(consumed.at[slots[k]]))
    plmgpu.barrier_arrive(p_free)
    return acc

  def step(i, acc):
    slot = lax.rem(i, num_slots)
    # p_ready already comes after warpgroup 0 saw the slot land; waiting on the slot's own barrier
    # as well is the documented way for its bytes to be visible to this warpgroup's wgmma.
    plmgpu.barrier_wait(ready.at[slot])
    in_phase("wg1_p_wait", plmgpu.barrier_wait, p_ready)
    acc = in_phase("wg1_values", accumulate, acc, plmgpu.load(row_smem, layout=rows_layout), slot)
    plmgpu.barrier_arrive(p_free)
    plmgpu.barrier_arrive(consumed.at[slot])
    if widen is not None:
      @pl.when(i + num_slots < n)
      def _():
        plmgpu.barrier_wait(consumed.at[slot])
        widen(i + num_slots)
    return acc

  assert pages == 1 or widen is None
  acc = lax.fori_loop(0, n, step if pages == 1 else pages_step, acc)
  plmgpu.barrier_wait(p_ready)
  l = plmgpu.load(row_smem, layout=rows_layout)
  _store_output(acc, l, o_smem, o_gmem, out_scale, heads_axis, store)
  plmgpu.wait_smem_to_gmem(0)
  if widen is not None:
    # The phases of consumed the loop did not wait on (a warpgroup that waits on some phases of a
    # barrier waits on all of them).
    @pl.loop(jnp.maximum(n - num_slots, 0), n)
    def _(k):
      plmgpu.barrier_wait(consumed.at[lax.rem(k, num_slots)])


DS_MLA_TILE = 128  # fp8_ds_mla: one scale per 128 latent values
def feed_ring(n, stages, consumed, fetch):
  """A memory warpgroup's loop: fetch(i, slot) for steps i < n into a ring of `stages` slots, a
  slot refilled once its consumers arrive on consumed[slot]."""
  for i in range(stages):
    pl.when(i < n)(functools.partial(fetch, i, i))

  @pl.loop(stages, n)
  def _(i):
    slot = lax.rem(i, stages)
    in_phase("memory_slot_wait", plmgpu.barrier_wait, consumed.at[slot])
    in_phase("memory_copy", fetch, i, slot)

  # Sees the last uses of the slots out too: a warpgroup that waits on some phases of a barrier
  # waits on all of them (the interpreter checks this when the barriers are freed).
  @pl.loop(jnp.maximum(n - stages, 0), n)
  def _(i):
    plmgpu.barrier_wait(consumed.at[lax.rem(i, stages)])

def check_indexer_args(q, weights, k_values, k_scales, block_tables, seq_lens):
  """ValueError unless the shapes agree and weights, k_scales are float32 and block_tables,
  seq_lens int32 (what every indexer kernel takes)."""
  if (q.ndim != 3 or weights.shape != q.shape[:2] or k_values.ndim != 3
      or k_scales.shape != k_values.shape[:2] or block_tables.ndim != 2
      or block_tables.shape[0] != q.shape[0] or seq_lens.shape != q.shape[:1]
      or k_values.shape[2] != q.shape[2]):
    raise ValueError(f"want q [T, H, D], weights [T, H], k_values [NB, BS, D], k_scales [NB, BS], "
                     f"block_tables [T, MB], seq_lens [T]; got {q.shape}, {weights.shape}, "
                     f"{k_values.shape}, {k_scales.shape}, {block_tables.shape}, {seq_lens.shape}")
  if (weights.dtype != jnp.float32 or k_scales.dtype != jnp.float32
      or block_tables.dtype != jnp.int32 or seq_lens.dtype != jnp.int32):
    raise ValueError(f"weights and k_scales must be float32, block_tables and seq_lens int32; got "
                     f"{weights.dtype.name}, {k_scales.dtype.name}, {block_tables.dtype.name}, "
                     f"{seq_lens.dtype.name}")


HOPPER_SMEM_BYTES = 227 * 1024  # shared memory one Hopper block may have (opt-in maximum)


def smem_bytes(scratch, reduction_bytes=0):
  """Bytes of shared memory Pallas Mosaic GPU (jax 0.11.2) allocates for these scratch types and a
  kernel that reduces across warps with `CompilerParams(reduction_scratch_bytes=reduction_bytes)`:
  each buffer, and each buffer of a `RefUnion` member, starts 1024-byte aligned; a union takes
  its largest member; a barrier takes 8 bytes; the reduction scratch, 1024-byte aligned, comes on
  top. The sparse kernels refuse a launch past HOPPER_SMEM_BYTES."""
  align = lambda x: -(-x // 1024) * 1024

  def size(ref):
    if isinstance(ref, plmgpu.RefUnion):
      return max(functools.reduce(lambda acc, r: align(acc) + size(r), jax.tree.leaves(m), 0)
                 for m in ref.refs)
    if isinstance(ref, plmgpu.Barrier):
      return 0
    return math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize

  buffers = sum(align(size(ref)) for ref in scratch)
  barriers = sum(math.prod(ref.num_barriers) for ref in scratch
                 if isinstance(ref, plmgpu.Barrier))
  return buffers + 8 * barriers + -(-reduction_bytes // 1024) * 1024
