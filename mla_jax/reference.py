"""XLA reference of every kernel: the oracle for kernel tests and the CPU backend.

All arithmetic is float32 at HIGHEST precision (no TF32 on GPUs); outputs come back in the
query's dtype, log-sum-exps in float32 (natural log, -inf for rows that see nothing).
Indices outside the cache (-1, past the end) are masked: never read, never written.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from mla_jax.quant import dequantize

HIGHEST = lax.Precision.HIGHEST


def _einsum(spec, a, b):
  return jnp.einsum(spec, a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- decode

def _masked_softmax(logits, mask):
  """(probabilities, lse) over the masked positions; rows with nothing visible give (0, -inf)."""
  logits = jnp.where(mask, logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
  return p, lse


def _paged_rows(cache, block_tables, seq_lens):
  """Each row's pages read through its table: (cache rows [T, MB*BS, ...] float32, visible mask
  [T, MB*BS]). Masked rows (past the length, -1 or out-of-cache blocks) are zeros, never the
  cache's contents: unused pages may hold NaN, and 0 * NaN would leak through a product."""
  nb, bs = cache.shape[:2]
  t, mb = block_tables.shape
  block_ok = (block_tables >= 0) & (block_tables < nb)
  rows = cache[jnp.where(block_ok, block_tables, 0)].reshape(t, mb * bs, *cache.shape[2:])
  mask = (jnp.arange(mb * bs)[None, :] < seq_lens[:, None]) & jnp.repeat(block_ok, bs, axis=1)
  mask_rows = mask.reshape(mask.shape + (1,) * (rows.ndim - 2))
  return jnp.where(mask_rows, rows.astype(jnp.float32), 0.0), mask


def latent_decode(q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array,
                  *, scale: float, kv_lora_rank: int = 512,
                  k_scale: jax.Array | float | None = None,
                  split_tokens: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Absorbed MQA decode over the paged latent cache, one query row per token.

  q [T, N, D]; kv_cache [NB, BS, D]; block_tables [T, MB] int32 (the row's request's table);
  seq_lens [T] int32 (tokens this row sees). Returns o [T, N, L] (q.dtype), lse [T, N] float32.
  Values are the first `kv_lora_rank` columns of each cache row. split_tokens: the batch-invariant
  form (`_latent_decode_in_splits`).
  """
  if split_tokens is not None:
    return _latent_decode_in_splits(q, kv_cache, block_tables, seq_lens, scale=scale,
                                    kv_lora_rank=kv_lora_rank, k_scale=k_scale,
                                    split_tokens=split_tokens)
  k, mask = _paged_rows(kv_cache, block_tables, seq_lens)
  k = dequantize(k, k_scale)
  logits = _einsum("TND,TSD->TNS", q.astype(jnp.float32), k) * scale
  p, lse = _masked_softmax(logits, mask[:, None, :])
  o = _einsum("TNS,TSL->TNL", p, k[..., :kv_lora_rank])
  return o.astype(q.dtype), lse


def _latent_decode_in_splits(q, kv_cache, block_tables, seq_lens, *, scale, kv_lora_rank, k_scale,
                             split_tokens):
  """`latent_decode` with each row's bits independent of the batch and of the table's width.

  Rows run one at a time (`lax.map`: the products' shapes, hence their summation order, never
  follow T), each over its tokens in splits of `split_tokens`, folded in split order with an
  online softmax. A split past the row's length is an exact no-op of the fold (its scores are
  -inf: the max and the sums do not move), so a wider table changes nothing either.
  """
  if split_tokens < 1:
    raise ValueError(f"split_tokens must be >= 1, got {split_tokens}")
  nb, bs = kv_cache.shape[:2]
  mb = block_tables.shape[1]
  num_splits = -(-mb * bs // split_tokens)
  pos = jnp.arange(num_splits * split_tokens).reshape(num_splits, split_tokens)

  def one_row(args):
    q_row, table, length = args  # [N, D], [MB], []
    page = jnp.minimum(pos // bs, mb - 1)
    block = table[page]
    visible = (pos < jnp.minimum(length, mb * bs)) & (block >= 0) & (block < nb)

    def split(carry, xs):
      m, l, acc = carry
      block, visible, pos = xs  # [split_tokens] each
      k = kv_cache[jnp.where(visible, block, 0), pos % bs]
      k = dequantize(jnp.where(visible[:, None], k.astype(jnp.float32), 0.0), k_scale)
      logits = jnp.where(visible[None], _einsum("ND,SD->NS", q_row, k) * scale, -jnp.inf)
      m_new = jnp.maximum(m, logits.max(axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      alpha, p = jnp.exp(m - m_safe), jnp.exp(logits - m_safe[:, None])
      acc = acc * alpha[:, None] + _einsum("NS,SL->NL", p, k[:, :kv_lora_rank])
      return (m_new, l * alpha + p.sum(axis=-1), acc), None

    n = q_row.shape[0]
    init = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n, kv_lora_rank)))
    (m, l, acc), _ = lax.scan(split, init, (block, visible, pos))
    seen = l > 0
    o = acc / jnp.where(seen, l, 1.0)[:, None]
    return o, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)

  o, lse = lax.map(one_row, (q.astype(jnp.float32), block_tables, seq_lens))
  return o.astype(q.dtype), lse


# ----------------------------------------------------------------------------- prefill

def segment_ids(cu_seqlens: jax.Array, total: int) -> jax.Array:
  """Per-row request index [total] from cumulative lengths [R+1]; rows past the end get -1."""
  rows = jnp.arange(total, dtype=jnp.int32)
  seg = jnp.searchsorted(cu_seqlens, rows, side="right").astype(jnp.int32) - 1
  return jnp.where(rows < cu_seqlens[-1], seg, -1)


def _pad_rows(x, multiple):
  pad = -x.shape[0] % multiple
  return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x


def _masked_pv(p, v, mask):
  """sum_k p[n, q, k] v[k, n, :] over the keys each row sees (mask [q, k]), exactly: a hidden key
  contributes nothing even when its value is NaN or inf (p = 0 there, but 0 * NaN is NaN).

  One matmul over the keys any row sees, once those values are finite; otherwise (a non-finite
  value some rows of the block see and others do not: another request's, or a causally later
  one) the rare slow way, each row's own keys selected before its product.
  """
  v_seen = jnp.where(mask.any(0)[:, None, None], v, 0.0)
  one_row = lambda args: _einsum("nk,knd->nd", args[0], jnp.where(args[1][:, None, None], v, 0.0))
  per_row = lambda: lax.map(one_row, (p.transpose(1, 0, 2), mask)).transpose(1, 0, 2)
  return lax.cond(jnp.isfinite(v_seen).all(), lambda: _einsum("nqk,knd->nqd", p, v_seen), per_row)


def mha_prefill(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                cu_seqlens_k: jax.Array, *, scale: float, causal: bool, block_q: int = 128,
                block_k: int = 256) -> tuple[jax.Array, jax.Array]:
  """Variable-length multi-head attention, flash style: query blocks with a running LSE.

  q [Tq, N, Dk]; k [Tk, N, Dk]; v [Tk, N, Dv]; cu_seqlens_q / cu_seqlens_k [R+1] int32 (request r's
  queries are rows cu_q[r]:cu_q[r+1], its keys rows cu_k[r]:cu_k[r+1]). Causal masking is aligned
  bottom-right (query i of a request sees keys j <= i + len_k - len_q). Memory is
  O(block_q * block_k * N); each query block walks only the key blocks its requests can see.
  Returns o [Tq, N, Dv] (q.dtype) and lse [Tq, N] float32; rows past cu_q[-1] give (0, -inf).
  """
  tq, n, _ = q.shape
  tk, dv = k.shape[0], v.shape[-1]
  cu_seqlens_q, cu_seqlens_k = jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k)
  block_q, block_k = min(block_q, tq), min(block_k, max(tk, 1))
  seg_q, seg_k = segment_ids(cu_seqlens_q, tq), segment_ids(cu_seqlens_k, tk)
  len_q, len_k = jnp.diff(cu_seqlens_q), jnp.diff(cu_seqlens_k)
  pos_q = jnp.arange(tq) - cu_seqlens_q[jnp.maximum(seg_q, 0)]
  pos_k = jnp.arange(tk) - cu_seqlens_k[jnp.maximum(seg_k, 0)]
  # Last key position (request-local) each query row may see.
  limit = jnp.where(causal, pos_q + len_k[jnp.maximum(seg_q, 0)] - len_q[jnp.maximum(seg_q, 0)],
                    jnp.iinfo(jnp.int32).max)
  qs = _pad_rows(q.astype(jnp.float32), block_q)
  seg_qs, limit_s = _pad_rows(seg_q + 1, block_q) - 1, _pad_rows(limit, block_q)
  ks = _pad_rows(k.astype(jnp.float32), block_k)
  vs = _pad_rows(v.astype(jnp.float32), block_k)
  seg_ks, pos_ks = _pad_rows(seg_k + 1, block_k) - 1, _pad_rows(pos_k, block_k)
  num_q_blocks = qs.shape[0] // block_q

  def one_query_block(i):
    start = i * block_q
    qb = lax.dynamic_slice_in_dim(qs, start, block_q)
    sq = lax.dynamic_slice_in_dim(seg_qs, start, block_q)
    lim = lax.dynamic_slice_in_dim(limit_s, start, block_q)
    valid = sq >= 0
    first_seg = jnp.min(jnp.where(valid, sq, jnp.int32(2**30)))
    last_seg = jnp.max(jnp.where(valid, sq, -1))
    k_lo = cu_seqlens_k[jnp.clip(first_seg, 0, len_k.shape[0])]
    k_hi_seg = cu_seqlens_k[jnp.clip(last_seg + 1, 0, len_k.shape[0])]
    k_hi_causal = jnp.max(jnp.where(valid, cu_seqlens_k[jnp.maximum(sq, 0)] + lim + 1, 0))
    k_hi = jnp.where(causal, jnp.minimum(k_hi_seg, k_hi_causal), k_hi_seg)
    k_hi = jnp.where(last_seg >= 0, k_hi, k_lo)

    def body(j, carry):
      m, l, acc = carry
      kb = lax.dynamic_slice_in_dim(ks, j * block_k, block_k)
      vb = lax.dynamic_slice_in_dim(vs, j * block_k, block_k)
      sk = lax.dynamic_slice_in_dim(seg_ks, j * block_k, block_k)
      pk = lax.dynamic_slice_in_dim(pos_ks, j * block_k, block_k)
      mask = (sq[:, None] == sk[None, :]) & valid[:, None] & (pk[None, :] <= lim[:, None])
      s = jnp.where(mask[None], _einsum("qnd,knd->nqk", qb, kb) * scale, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      corr = jnp.exp(m - m_safe)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + _masked_pv(p, vb, mask)

    init = (jnp.full((n, block_q), -jnp.inf), jnp.zeros((n, block_q)), jnp.zeros((n, block_q, dv)))
    m, l, acc = lax.fori_loop(k_lo // block_k, -(-k_hi // block_k), body, init)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o.transpose(1, 0, 2), lse.T

  o, lse = lax.map(one_query_block, jnp.arange(num_q_blocks))
  o = o.reshape(-1, n, dv)[:tq]
  return o.astype(q.dtype), lse.reshape(-1, n)[:tq]


# ----------------------------------------------------------------------------- DSA (V3.2)

def indexer_logits(q: jax.Array, weights: jax.Array, k_values: jax.Array, k_scales: jax.Array,
                   block_tables: jax.Array, seq_lens: jax.Array) -> jax.Array:
  """Lightning-indexer scores `I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])` over the paged K
  cache.

  q [T, H, D] (e4m3 or floating; fp8 q scales belong in `weights`); weights [T, H] float32;
  k_values [NB, BS, D] (e4m3 or floating); k_scales [NB, BS] float32 (per-token dequant scale);
  block_tables [T, MB]; seq_lens [T] (causal window: row t sees positions s < seq_lens[t]).
  Returns logits [T, MB*BS] float32, -inf outside the window and on unreadable blocks.
  """
  k, mask = _paged_rows(k_values, block_tables, seq_lens)
  k = k * _paged_rows(k_scales, block_tables, seq_lens)[0][..., None]
  scores = jax.nn.relu(_einsum("THD,TSD->THS", q.astype(jnp.float32), k))
  logits = _einsum("TH,THS->TS", weights.astype(jnp.float32), scores)
  return jnp.where(mask, logits, -jnp.inf)


def topk_positions(logits: jax.Array, seq_lens: jax.Array, topk: int) -> jax.Array:
  """Top-`topk` positions of each row of `logits` [T, S] within its window (s < seq_lens[t]),
  int32 [T, topk], padded with -1 when fewer are visible. Order is unspecified."""
  t, s = logits.shape
  masked = jnp.where(jnp.arange(s)[None, :] < seq_lens[:, None], logits, -jnp.inf)
  vals, idx = lax.top_k(masked, min(topk, s))
  idx = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
  return jnp.pad(idx, ((0, 0), (0, topk - idx.shape[1])), constant_values=-1)


def sparse_attention(q: jax.Array, gather_rows: Callable[[jax.Array], jax.Array], slots: jax.Array,
                     num_slots: int, *, scale: float, kv_lora_rank: int,
                     rows_per_chunk: int = 16) -> tuple[jax.Array, jax.Array]:
  """Absorbed MQA per row over its selected cache slots only.

  q [T, N, D]; gather_rows(flat_slots [W]) -> float32 [W, D] rows (zeros for invalid slots);
  slots [T, K] int32 (-1 or >= num_slots: skipped). Returns o [T, N, L] (q.dtype) and
  lse [T, N] float32; a row with no valid slot gives (0, -inf). Rows are processed
  `rows_per_chunk` at a time so the gathered [chunk, K, D] block bounds the memory.
  """
  t, n, d = q.shape
  k_sel = slots.shape[1]
  if t == 0 or n == 0:  # nothing to chunk
    return jnp.zeros((t, n, kv_lora_rank), q.dtype), jnp.zeros((t, n), jnp.float32)
  chunk = min(rows_per_chunk, t)
  pad = -t % chunk
  qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
  sp = jnp.pad(slots, ((0, pad), (0, 0)), constant_values=-1)

  def one_chunk(args):
    qc, sc = args
    valid = (sc >= 0) & (sc < num_slots)
    rows = gather_rows(jnp.where(valid, sc, -1).reshape(-1)).reshape(chunk, k_sel, d)
    rows = jnp.where(valid[..., None], rows, 0.0)
    logits = _einsum("TND,TKD->TNK", qc.astype(jnp.float32), rows) * scale
    p, lse = _masked_softmax(logits, valid[:, None, :])
    return _einsum("TNK,TKL->TNL", p, rows[..., :kv_lora_rank]), lse

  o, lse = lax.map(one_chunk, (qp.reshape(-1, chunk, n, d), sp.reshape(-1, chunk, k_sel)))
  return o.reshape(-1, n, kv_lora_rank)[:t].astype(q.dtype), lse.reshape(-1, n)[:t]
