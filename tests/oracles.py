"""float64 numpy oracles, written as directly from the formulas as possible (loops over rows)."""

import numpy as np


def attention_np(q, k, v, scale, mask=None):
  """q [Q, N, D], k [K, D] or [K, N, D], v [K, V] or [K, N, V] -> (o [Q, N, V], lse [Q, N])."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  if k.ndim == 2:
    k = np.broadcast_to(k[:, None], (k.shape[0], q.shape[1], k.shape[1]))
    v = np.broadcast_to(v[:, None], (v.shape[0], q.shape[1], v.shape[1]))
  s = np.einsum("qnd,knd->nqk", q, k) * scale
  if mask is not None:
    s = np.where(np.asarray(mask)[None], s, -np.inf)
  m = s.max(-1, keepdims=True, initial=-np.inf)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(s - m)
  l = p.sum(-1)
  o = np.einsum("nqk,knv->qnv", p, v) / np.where(l > 0, l, 1.0).T[..., None]
  lse = np.where(l > 0, np.log(np.where(l > 0, l, 1.0)) + m[..., 0], -np.inf).T
  return o, lse


def latent_decode_np(q, kv_cache, block_tables, seq_lens, scale, kv_lora_rank, k_scale=1.0):
  """One row at a time: the row's first seq_len tokens read through its block table."""
  q = np.asarray(q, np.float64)
  cache = np.asarray(kv_cache.astype(np.float32), np.float64) * k_scale
  t, n, _ = q.shape
  bs = cache.shape[1]
  o = np.zeros((t, n, kv_lora_rank))
  lse = np.full((t, n), -np.inf)
  for i in range(t):
    length = int(seq_lens[i])
    if length == 0:
      continue
    rows = np.stack([cache[block_tables[i, p // bs], p % bs] for p in range(length)])
    o[i], lse[i] = (a[0] for a in attention_np(q[i:i + 1], rows, rows[:, :kv_lora_rank], scale))
  return o, lse


def varlen_attention_np(q, k, v, cu_q, cu_k, scale, causal):
  """Per request: rows cu_q[r]:cu_q[r+1] against keys cu_k[r]:cu_k[r+1], bottom-right causal."""
  o = np.zeros(q.shape[:2] + (v.shape[-1],))
  lse = np.full(q.shape[:2], -np.inf)
  for r in range(len(cu_q) - 1):
    qs, qe, ks, ke = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
    if qe == qs:
      continue
    mask = None
    if causal:
      i, j = np.arange(qe - qs)[:, None], np.arange(ke - ks)[None, :]
      mask = j <= i + (ke - ks) - (qe - qs)
    o[qs:qe], lse[qs:qe] = attention_np(q[qs:qe], k[ks:ke], v[ks:ke], scale, mask)
  return o, lse
