"""Property-based: random request mixes, block tables with and without shared prefixes, random bad
fields. Every case either raises ValueError (exactly when an independent check finds it invalid)
or, written into a fresh cache and attended through its metadata, matches float64 attention over
each request's own tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from mla_jax import reference  # noqa: E402
from mla_jax.cache import LatentCache  # noqa: E402
from mla_jax.metadata import RequestState, build_metadata  # noqa: E402
from oracles import attention_np  # noqa: E402

NB, MB, L, R, N = 24, 8, 8, 4, 2  # blocks, table width, latent and rope widths, heads
BAD = ["none", "numpy ints", "block past the cache", "negative block", "shared write block",
       "block twice in a table", "float length", "zero query", "short table", "float table"]


@st.composite
def steps(draw, bad):
  """(block_size, requests): a valid mix, then the field `bad` names broken (where it can be)."""
  bs = draw(st.sampled_from([2, 4]))
  free = list(draw(st.permutations(range(NB))))
  n = draw(st.integers(1, 4))
  prefix = draw(st.integers(0, 2))  # full blocks of a prefix every request shares (read only)
  shared = [free.pop() for _ in range(prefix)]
  requests = []
  for _ in range(n):
    ctx = prefix * bs + draw(st.integers(0, 2 * bs))
    q = draw(st.integers(1, 3 * bs))
    need = -(-(ctx + q) // bs) - prefix
    if need > len(free) or prefix + need > MB:
      break
    own = [free.pop() for _ in range(need)]
    spare = draw(st.lists(st.integers(-1, NB + 3), max_size=MB - prefix - need))  # never read
    requests.append(RequestState(ctx, q, shared + own + spare))
  i = draw(st.integers(0, len(requests) - 1))
  r = requests[i]
  table, needed = list(r.block_table), -(-(r.context_len + r.query_len) // bs)
  k = draw(st.integers(0, needed - 1))
  if bad == "numpy ints":
    requests[i] = RequestState(np.int64(r.context_len), np.int32(r.query_len),
                               np.asarray(table, np.int16))
  elif bad in ("block past the cache", "negative block"):
    table[k] = NB + draw(st.integers(0, 3)) if bad == "block past the cache" else -1
  elif bad == "shared write block" and len(requests) > 1:
    other = requests[(i + 1) % len(requests)]
    table[k] = other.block_table[(other.context_len + other.query_len - 1) // bs]
  elif bad == "block twice in a table" and needed > 1:
    table[k] = table[(k + 1) % needed]
  elif bad == "float length":
    requests[i] = RequestState(float(r.context_len), r.query_len, table)
  elif bad == "zero query":
    requests[i] = RequestState(r.context_len, 0, table)
  elif bad == "short table":
    table = table[:needed - 1]
  elif bad == "float table":
    table = [float(b) for b in table]
  if bad not in ("numpy ints", "float length", "zero query"):
    requests[i] = RequestState(requests[i].context_len, requests[i].query_len, table)
  return bs, requests


def independently_valid(bs, requests):
  """The rules, spelled out slot by slot: integer fields, lengths, blocks inside the cache, each
  written slot written once and read by no one as context."""
  written, read = {}, set()
  for r in requests:
    if not all(isinstance(v, (int, np.integer)) for v in (r.context_len, r.query_len)):
      return False
    table = list(r.block_table)
    if not all(isinstance(b, (int, np.integer)) for b in table):
      return False
    if r.query_len < 1 or r.context_len < 0 or len(table) > MB:
      return False
    for p in range(r.context_len + r.query_len):
      if p // bs >= len(table) or not 0 <= table[p // bs] < NB:
        return False
      slot = table[p // bs] * bs + p % bs
      if p < r.context_len:
        read.add(slot)
      elif slot in written:
        return False
      else:
        written[slot] = True
  return not read & set(written)


@jax.jit
def write_and_attend(cache, kv_c, k_pe, q, md):
  cache = cache.write(kv_c, k_pe, md.slot_mapping)
  o, lse = reference.latent_decode(q, cache.data, md.row_block_tables(), md.seq_lens, scale=0.5,
                                   kv_lora_rank=L)
  return o, lse


@pytest.mark.parametrize("bad", BAD)
def test_build_metadata_and_cache_writes(bad):
  check_step(bad)


@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def check_step(bad, data):
  bs, requests = data.draw(steps(bad))
  valid = independently_valid(bs, requests)
  hypothesis.event("valid" if valid else "invalid")
  try:
    md, layout = build_metadata(requests, block_size=bs, num_blocks=NB, max_blocks_per_seq=MB)
  except ValueError:
    assert not valid, "a valid step was refused"
    return
  assert valid, "an invalid step was accepted"
  rng = np.random.default_rng(len(requests) * 1000 + bs)
  # Earlier context sits in the cache (written slot by slot here); everything else is NaN.
  cache = np.full((NB, bs, L + R), np.nan, np.float32)
  history = []
  for r in requests:
    table = [int(b) for b in r.block_table]
    rows = rng.standard_normal((int(r.context_len) + int(r.query_len), L + R)).astype(np.float32)
    for p in range(int(r.context_len)):
      if np.isnan(cache[table[p // bs], p % bs]).all():
        cache[table[p // bs], p % bs] = rows[p]
      else:  # a shared prefix block, already written by an earlier request
        rows[p] = cache[table[p // bs], p % bs]
    history.append(rows)
  new = [rows[int(r.context_len):] for r, rows in zip(requests, history)]
  q = [rng.standard_normal((int(r.query_len), N, L + R)).astype(np.float32) for r in requests]
  o, lse = write_and_attend(LatentCache(jnp.asarray(cache), jnp.float32(1.0)),
                            jnp.asarray(layout.pack([x[:, :L] for x in new])),
                            jnp.asarray(layout.pack([x[:, L:] for x in new])),
                            jnp.asarray(layout.pack(q)), md)
  for i, (r, rows) in enumerate(zip(requests, history)):
    for j in range(int(r.query_len)):
      p = int(r.context_len) + j  # sees its request's positions 0..p
      want_o, want_lse = attention_np(q[i][j:j + 1], rows[:p + 1], rows[:p + 1, :L], 0.5)
      row = layout.rows[i][j]
      np.testing.assert_allclose(np.asarray(o[row]), want_o[0], rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(np.asarray(lse[row]), want_lse[0], rtol=1e-5, atol=1e-5)
