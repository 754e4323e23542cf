"""The backend table: a backend name maps to a value of pure functions plus what they support.

Contracts (every backend, same shapes and dtypes; see `mla_jax.reference` for the semantics):
  decode(q [T,N,L+R], kv_cache [NB,BS,L+R], block_tables [T,MB], seq_lens [T], *, scale,
         kv_lora_rank, k_scale=None, num_kv_splits=None) -> (o [T,N,L], lse [T,N] f32)
  prefill(q [Tq,N,Dk], k [Tk,N,Dk], v [Tk,N,Dv], cu_seqlens_q [R+1], cu_seqlens_k [R+1], *, scale,
          causal, max_seqlen_q) -> (o [Tq,N,Dv], lse [Tq,N] f32)
  write_cache(kv_cache, kv_c_normed [T,L], k_pe [T,R], slot_mapping [T], k_scale=None) -> kv_cache
  gather_cache(kv_cache, slots [W], k_scale=None) -> rows [W, L+R] f32
  sparse_attention(q [T,N,L+R], cache (LatentCache | DSMLACache), slots [T,K], *, scale,
                   kv_lora_rank) -> (o [T,N,L], lse [T,N] f32)
  indexer_logits(q [T,H,D], weights [T,H], k_values [NB,BS,D], k_scales [NB,BS], block_tables [T,MB],
                 seq_lens [T]) -> logits [T, MB*BS] f32
  topk(logits [T,S], seq_lens [T], topk) -> positions [T, topk] int32 (-1 padded)
Selection: an explicit name, else $MLA_JAX_BACKEND, else by platform (GPU -> Pallas, else the
XLA reference).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from mla_jax import reference
from pallas_kernels import latent_decode as pallas_latent_decode
from pallas_kernels import mla_prefill as pallas_mla_prefill

ENV_VAR = "MLA_JAX_BACKEND"


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  decode: Callable
  prefill: Callable
  write_cache: Callable
  gather_cache: Callable
  sparse_attention: Callable
  indexer_logits: Callable
  topk: Callable
  cache_dtypes: frozenset[str]
  block_size_multiple: int = 1
  max_heads: int | None = None
  platforms: frozenset[str] = frozenset({"cpu", "gpu"})

  def check(self, *, cache_dtype, block_size: int, num_heads: int) -> None:
    """Raises ValueError when this backend cannot run the combination."""
    dtype_name = jnp.dtype(cache_dtype).name
    if dtype_name not in self.cache_dtypes:
      raise ValueError(f"backend {self.name!r} does not support cache dtype {dtype_name}; "
                       f"supported: {sorted(self.cache_dtypes)}")
    if block_size % self.block_size_multiple:
      raise ValueError(f"backend {self.name!r} needs a block size that is a multiple of "
                       f"{self.block_size_multiple}, got {block_size}")
    if self.max_heads is not None and num_heads > self.max_heads:
      raise ValueError(f"backend {self.name!r} supports at most {self.max_heads} heads, got {num_heads}")


_CACHE_DTYPES = frozenset({"float32", "bfloat16", "float16", "float8_e4m3fn"})


def _reference_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal, max_seqlen_q=None):
  del max_seqlen_q  # the reference walks query blocks of the packed rows, no per-request grid
  return reference.mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal)


def _reference_decode(q, kv_cache, block_tables, seq_lens, *, scale, kv_lora_rank, k_scale=None,
                      num_kv_splits=None):
  del num_kv_splits  # one pass over the whole row: equal to any split count
  return reference.latent_decode(q, kv_cache, block_tables, seq_lens, scale=scale,
                                 kv_lora_rank=kv_lora_rank, k_scale=k_scale)


def _reference_sparse_attention(q, cache, slots, *, scale, kv_lora_rank):
  return reference.sparse_attention(q, cache.dequantize_rows, slots, cache.num_blocks * cache.block_size,
                                    scale=scale, kv_lora_rank=kv_lora_rank)


REFERENCE = Backend(
    name="reference",
    decode=_reference_decode,
    prefill=_reference_prefill,
    write_cache=reference.write_latent_cache,
    gather_cache=reference.gather_latent_cache,
    sparse_attention=_reference_sparse_attention,
    indexer_logits=reference.indexer_logits,
    topk=reference.topk_positions,
    cache_dtypes=_CACHE_DTYPES,
)


def _pallas_triton_decode(q, kv_cache, block_tables, seq_lens, *, scale, kv_lora_rank,
                          k_scale=None, num_kv_splits=None):
  # Off the GPU the same kernel runs in Pallas interpret mode, so CPU tests exercise it.
  return pallas_latent_decode.latent_decode(
      q, kv_cache, block_tables, seq_lens, scale=scale, kv_lora_rank=kv_lora_rank, k_scale=k_scale,
      num_kv_splits=num_kv_splits, interpret=jax.default_backend() != "gpu")


# Measured on the H200 (benchmarks/RESULTS.md, MLA prefill): cuDNN's flash attention beats the
# Pallas kernel from 32K query-token-heads on; below that its fixed costs dominate. Its LSE comes
# back as [requests, N, Tq] f32, so many requests would cost more memory than o itself.
_CUDNN_MIN_TOKEN_HEADS = 32768
_CUDNN_MAX_REQUESTS = 64


@functools.cache
def _cudnn_mla_available() -> bool:
  """jax's cuDNN binding takes Dv != Dk (and packed sequences) from cuDNN 9.10 on Hopper on."""
  try:
    return (cudnn_attention.check_cudnn_version() >= 91000
            and cudnn_attention.check_compute_capability("9.0"))
  except RuntimeError:  # no cuDNN
    return False


def _cudnn_causal_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale):
  """Causal prefill of requests with len_q == len_k through cuDNN's packed-sequence attention.

  Uses jax's private cuDNN binding: the public jax.nn.dot_product_attention refuses Dv != Dk and
  rounds the LSE to the output dtype. cuDNN's causal mask is top-left aligned, which is the
  contract's bottom-right one only when every request has as many keys as queries.
  """
  tq = q.shape[0]
  packed = cu_seqlens_q.shape[0] > 2  # one request: a batch of one, its length as padding
  lens = lambda cu: jnp.diff(cu)[None] if packed else jnp.diff(cu)
  o, stats = cudnn_attention.dot_product_attention(
      q[None], k[None], v[None], q_seqlen=lens(cu_seqlens_q), kv_seqlen=lens(cu_seqlens_k),
      q_offsets=cu_seqlens_q[None] if packed else None,
      kv_offsets=cu_seqlens_k[None] if packed else None, scale=scale,
      mask_type=cudnn_attention.MaskType.PADDING_CAUSAL, return_residual=True)
  seg = reference.segment_ids(cu_seqlens_q, tq)
  valid, seg = seg >= 0, jnp.maximum(seg, 0)
  lse = stats[seg, :, jnp.arange(tq) - cu_seqlens_q[seg]]  # stats [R, N, Tq]: request-local rows
  return jnp.where(valid[:, None, None], o[0], 0), jnp.where(valid[:, None], lse, -jnp.inf)


def _pallas_triton_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal, max_seqlen_q):
  pallas = functools.partial(pallas_mla_prefill.mla_prefill, scale=scale, causal=causal,
                             max_seqlen_q=max_seqlen_q, interpret=jax.default_backend() != "gpu")
  use_cudnn = (causal and jax.default_backend() == "gpu" and q.dtype.itemsize == 2
               and q.shape[0] * q.shape[1] >= _CUDNN_MIN_TOKEN_HEADS
               and cu_seqlens_q.shape[0] - 1 <= _CUDNN_MAX_REQUESTS and _cudnn_mla_available())
  if not use_cudnn:
    return pallas(q, k, v, cu_seqlens_q, cu_seqlens_k)
  # The new-token call always has cu_q == cu_k; anything else takes the kernel, at run time.
  same = jnp.all(cu_seqlens_q == cu_seqlens_k) & (cu_seqlens_q[0] == 0)
  return lax.cond(same, functools.partial(_cudnn_causal_prefill, scale=scale), pallas,
                  q, k, v, cu_seqlens_q, cu_seqlens_k)


PALLAS_TRITON = Backend(
    name="pallas_triton",
    decode=_pallas_triton_decode,
    prefill=_pallas_triton_prefill,
    write_cache=reference.write_latent_cache,
    gather_cache=reference.gather_latent_cache,
    # The DSA kernels (sparse attention, indexer logits, top-k) replace these references.
    sparse_attention=_reference_sparse_attention,
    indexer_logits=reference.indexer_logits,
    topk=reference.topk_positions,
    cache_dtypes=_CACHE_DTYPES,
    block_size_multiple=16,
)

BACKENDS: types.MappingProxyType[str, Backend] = types.MappingProxyType({
    REFERENCE.name: REFERENCE,
    PALLAS_TRITON.name: PALLAS_TRITON,
})


def default_backend_name(platform: str | None = None) -> str:
  platform = platform or jax.default_backend()
  for name in ("pallas_triton",):
    if name in BACKENDS and platform == "gpu":
      return name
  return REFERENCE.name


def get_backend(name: str | None = None) -> Backend:
  """The backend called `name`, else $MLA_JAX_BACKEND, else the platform's default."""
  name = name or os.environ.get(ENV_VAR) or default_backend_name()
  if name not in BACKENDS:
    raise ValueError(f"unknown MLA backend {name!r}; supported: {sorted(BACKENDS)}")
  return BACKENDS[name]
