"""Contract every backend's prefill must meet, checked against the float64 oracle on small shapes.

A subclass sets `backend`; `prefill` can be overridden to test a kernel entry directly. Outputs of
Pallas interpret mode start as NaN (jax fills uninitialized float outputs with NaN there), so the
no-NaN check also proves every row was written.
"""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.backends import get_backend
from oracles import varlen_attention_np

DK, DV = 192, 128
ROPE = 64  # the split form's shared key columns (k_pe)
SCALE = DK**-0.5

# (heads, dtype, causal, query lengths, key lengths, padding rows past cu_q[-1])
CASES = {
    "causal_f32_n1": (1, jnp.float32, True, [0, 33, 7], [0, 33, 7], 5),
    "causal_f32_n4_context": (4, jnp.float32, True, [19, 30, 6], [40, 12, 6], 3),
    "noncausal_f32_n4": (4, jnp.float32, False, [19, 0, 40], [64, 5, 0], 4),
    "causal_bf16_n16": (16, jnp.bfloat16, True, [24, 9, 0], [40, 9, 3], 2),
    "noncausal_bf16_n16": (16, jnp.bfloat16, False, [7, 26], [30, 17], 0),
    "causal_bf16_n4_all_padding": (4, jnp.bfloat16, True, [0], [5], 6),
    # Packed requests of 1, 7, 128 and 300 new tokens and one of none (with context keys).
    "causal_bf16_n2_packed": (2, jnp.bfloat16, True, [1, 7, 128, 0, 300], [1, 7, 128, 16, 300], 3),
}


def cosine_diff(x, y):
  """1 - 2 sum(xy) / sum(x^2 + y^2) (SPEC section 8); 0 for two zero arrays."""
  x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
  norms = np.sum(x * x + y * y)
  return 1.0 - 2.0 * np.sum(x * y) / norms if norms > 0 else 0.0


def assert_close(out, ref, dtype, magnitude=None):
  """f32: 1e-5 relative. 16-bit (SPEC section 8): per element abs 8e-4 + rel 2/128, and cosine
  difference < 1e-5. The relative part is taken of `magnitude` (default |ref|): for an attention
  output, the same weighted sum over |v|. Flash kernels round the probabilities to 16 bits before
  the p @ v product, an error relative to the summed terms, not to their possibly cancelled sum;
  with the few keys of small tests (and the first rows of any causal request) |ref| alone is too
  tight for any such kernel."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert not np.isnan(out).any()
  finite = np.isfinite(ref)
  np.testing.assert_array_equal(out[~finite], ref[~finite])  # -inf lse pattern exact
  magnitude = np.abs(ref if magnitude is None else np.asarray(magnitude, np.float64))[finite]
  out, ref = out[finite], ref[finite]
  if jnp.dtype(dtype) == jnp.float32:
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    return
  err = np.abs(out - ref)
  bad = err > 8e-4 + 2 / 128 * magnitude
  assert not bad.any(), f"{bad.sum()} elements off, worst {err.max():.3g}"
  assert cosine_diff(out, ref) < 1e-5


def cumulative(lengths):
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


class PrefillContract:
  backend = None

  def prefill(self, *args, **kwargs):
    return get_backend(self.backend).prefill(*args, **kwargs)

  @pytest.fixture
  def rng(self, request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

  @pytest.mark.parametrize("case", sorted(CASES))
  def test_matches_oracle(self, case, rng):
    n, dtype, causal, len_q, len_k, pad = CASES[case]
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    tq, tk = int(cu_q[-1]) + pad, int(cu_k[-1]) + 1  # one stray key row past the last request
    # Sharper-than-unit logits so that the softmax is not near uniform.
    q = jnp.asarray(2 * rng.standard_normal((tq, n, DK)), dtype)
    k = jnp.asarray(rng.standard_normal((tk, n, DK)), dtype)
    v = jnp.asarray(rng.standard_normal((tk, n, DV)), dtype)
    o, lse = self.prefill(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), scale=SCALE,
                          causal=causal, max_seqlen_q=max(len_q, default=0))
    assert o.shape == (tq, n, DV) and o.dtype == dtype
    assert lse.shape == (tq, n) and lse.dtype == jnp.float32
    # The oracle sees the inputs as rounded to `dtype`, so only the kernel's own error remains.
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    ref_o, ref_lse = varlen_attention_np(f32(q), f32(k), f32(v), cu_q, cu_k, SCALE, causal)
    magnitude, _ = varlen_attention_np(f32(q), f32(k), np.abs(f32(v)), cu_q, cu_k, SCALE, causal)
    assert_close(o.astype(jnp.float32), ref_o, dtype, magnitude)
    assert_close(lse, ref_lse, dtype)
    tail = int(cu_q[-1])
    assert (np.asarray(o[tail:], np.float32) == 0).all()
    assert (np.asarray(lse[tail:]) == -np.inf).all()

  # The split form: k [Tk, N, Dk - R] and k_pe [Tk, R], the keys' last R columns shared by every
  # head (MLA's rope keys). Rows no query reads hold NaN: the stray key row past the last request
  # (k, k_pe and v) and the query rows past cu_q[-1]. The output must be the joined form's, bit for
  # bit (the same keys), and the oracle's.
  @pytest.mark.parametrize("case", ["causal_f32_n4_context", "noncausal_bf16_n16",
                                    "causal_bf16_n2_packed"])
  def test_split_keys_match_oracle_and_joined_keys(self, case, rng):
    n, dtype, causal, len_q, len_k, pad = CASES[case]
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    tq, tk = int(cu_q[-1]) + pad, int(cu_k[-1]) + 1
    q = 2 * rng.standard_normal((tq, n, DK))
    k_nope, v = rng.standard_normal((tk, n, DK - ROPE)), rng.standard_normal((tk, n, DV))
    k_pe = rng.standard_normal((tk, ROPE))
    q[int(cu_q[-1]):], k_nope[-1], k_pe[-1], v[-1] = np.nan, np.nan, np.nan, np.nan
    q, k_nope, k_pe, v = (jnp.asarray(x, dtype) for x in (q, k_nope, k_pe, v))
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, None], (tk, n, ROPE))], axis=-1)
    args = (jnp.asarray(cu_q), jnp.asarray(cu_k))
    kw = dict(scale=SCALE, causal=causal, max_seqlen_q=max(len_q))
    o, lse = self.prefill(q, k_nope, v, *args, **kw, k_pe=k_pe)
    want_o, want_lse = self.prefill(q, k, v, *args, **kw)
    np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)),
                                  np.asarray(want_o.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    ref_o, ref_lse = varlen_attention_np(f32(q), f32(k), f32(v), cu_q, cu_k, SCALE, causal)
    magnitude, _ = varlen_attention_np(f32(q), f32(k), np.abs(f32(v)), cu_q, cu_k, SCALE, causal)
    assert_close(f32(o), ref_o, dtype, magnitude)
    assert_close(lse, ref_lse, dtype)

  @pytest.mark.parametrize("change, message", [
      (dict(k_pe=jnp.zeros((8, 1, ROPE), jnp.bfloat16)), r"k_pe must be \[Tk, R\]"),
      (dict(k_pe=jnp.zeros((7, ROPE), jnp.bfloat16)), r"k_pe must be \[Tk, R\]"),
      (dict(k_pe=jnp.zeros((8, 32), jnp.bfloat16)), "must add up to q's Dk"),
      (dict(k=jnp.zeros((8, 2, DK), jnp.bfloat16)), "must add up to q's Dk"),
      (dict(k_pe=jnp.zeros((8, ROPE), jnp.float32)), "k_pe must have q's dtype"),
      (dict(q=jnp.zeros((8, DK), jnp.bfloat16)), r"must be \[T, N, D\]"),
      (dict(v=jnp.zeros((9, 2, DV), jnp.bfloat16)), r"need q \[Tq,N,Dk\]"),
      (dict(q=jnp.zeros((8, 4, DK), jnp.bfloat16)), r"need q \[Tq,N,Dk\]"),
      (dict(q=jnp.zeros((8, 2, DK), jnp.int8)), "share one dtype"),
      (dict(cu_seqlens_q=jnp.array([0.0, 8.0])), "int32"),
      (dict(cu_seqlens_k=jnp.array([0, 4, 8], jnp.int32)), "differ in length"),
      (dict(max_seqlen_q=-1), "max_seqlen_q must be a static int"),
  ])
  def test_bad_backend_input_raises(self, change, message):
    # The split form's arguments changed one at a time: a ValueError before any kernel is traced.
    args = dict(q=jnp.zeros((8, 2, DK), jnp.bfloat16), k=jnp.zeros((8, 2, DK - ROPE), jnp.bfloat16),
                v=jnp.zeros((8, 2, DV), jnp.bfloat16), cu_seqlens_q=jnp.array([0, 8], jnp.int32),
                cu_seqlens_k=jnp.array([0, 8], jnp.int32), k_pe=jnp.zeros((8, ROPE), jnp.bfloat16),
                max_seqlen_q=8)
    args.update(change)
    with pytest.raises(ValueError, match=message):
      self.prefill(**args, scale=SCALE, causal=True)

  # Request 1's queries, keys and values hold NaN, inf and -inf. (a) Query and key blocks of any
  # size straddle it and its neighbours (37 and 30 rows are no multiple of a block); its keys
  # outnumber its queries: a causal diagonal past the block edges. (b) A 5-row request at the
  # arrays' end after it: a block read there reaches back over request 1.
  # split: the same keys in the split form (one head, so k_pe is its last ROPE columns).
  @pytest.mark.parametrize("split", [False, True])
  @pytest.mark.parametrize("len_q, len_k", [([37, 21, 30], [37, 29, 30]),
                                            ([150, 100, 5], [150, 100, 5])])
  def test_a_poisoned_request_leaves_the_others_exact(self, rng, len_q, len_k, split):
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    q = 2 * rng.standard_normal((int(cu_q[-1]), 1, DK))
    k = rng.standard_normal((int(cu_k[-1]), 1, DK))
    v = rng.standard_normal((int(cu_k[-1]), 1, DV))
    for x, (lo, hi) in ((q, cu_q[1:3]), (k, cu_k[1:3]), (v, cu_k[1:3])):
      x[lo:hi:3], x[lo + 1:hi:3], x[lo + 2:hi:3] = np.nan, np.inf, -np.inf
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    keys = (k[..., :DK - ROPE], dict(k_pe=k[:, 0, DK - ROPE:])) if split else (k, {})
    o, lse = self.prefill(q, keys[0], v, jnp.asarray(cu_q), jnp.asarray(cu_k), scale=SCALE,
                          causal=True, max_seqlen_q=max(len_q), **keys[1])
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    ref_o, ref_lse = varlen_attention_np(f32(q), f32(k), f32(v), cu_q, cu_k, SCALE, True)
    magnitude, _ = varlen_attention_np(f32(q), f32(k), np.abs(f32(v)), cu_q, cu_k, SCALE, True)
    others = np.r_[0:cu_q[1], cu_q[2]:cu_q[3]]
    assert_close(f32(o)[others], ref_o[others], jnp.bfloat16, magnitude[others])
    assert_close(np.asarray(lse)[others], ref_lse[others], jnp.bfloat16)
