"""build_metadata: decode-first layout, slots, decode tables, buckets, context chunks,
validation."""

import jax
import numpy as np
import pytest

from mla_jax.metadata import RequestState, build_metadata

BS, NB, MB = 4, 64, 16

# Original order mixes decodes and prefills; decode_threshold=4 makes request 3 (q=3) a decode.
MIXED = [
    RequestState(context_len=5, query_len=5, block_table=[10, 3, 40]),
    # -1 past the length is fine
    RequestState(context_len=10, query_len=1, block_table=[7, 8, 9, -1]),
    RequestState(context_len=0, query_len=5, block_table=[50, 51]),
    RequestState(context_len=6, query_len=3, block_table=[60, 61, 2]),
    RequestState(context_len=20, query_len=5, block_table=[11, 12, 13, 14, 15, 16, 17]),
]
# Decode rows 0..3 (bucket 8), prefill rows from 8 (15 tokens, bucket 16): 24 rows.
MIXED_ROWS = {1: [0], 3: [1, 2, 3], 0: list(range(8, 13)), 2: list(range(13, 18)),
              4: list(range(18, 23))}


def _slot(table, pos):
  return table[pos // BS] * BS + pos % BS


def _build(requests, **kw):
  kw = {"block_size": BS, "num_blocks": NB, "max_blocks_per_seq": MB, "decode_threshold": 4, **kw}
  return build_metadata(requests, **kw)


def test_mixed_batch_rows_positions_slots():
  md, layout = _build(MIXED)
  assert list(layout.order) == [1, 3, 0, 2, 4] and layout.num_decode_requests == 2
  assert md.num_rows == 24 and md.num_decode_rows == 8 and md.num_prefill_rows == 16
  want_pos = np.zeros(24, np.int32)
  want_slot = np.full(24, -1, np.int32)
  for i, rows in MIXED_ROWS.items():
    r = MIXED[i]
    assert list(layout.rows[i]) == rows
    for j, row in enumerate(rows):
      want_pos[row] = r.context_len + j
      want_slot[row] = _slot(r.block_table, r.context_len + j)
  np.testing.assert_array_equal(np.asarray(md.positions), want_pos)
  np.testing.assert_array_equal(np.asarray(md.slot_mapping), want_slot)
  # spot values written out by hand: request 0's first token (pos 5) is block 3 offset 1 -> 13
  assert int(md.slot_mapping[8]) == 13 and int(md.slot_mapping[0]) == 9 * 4 + 2
  for a in (md.positions, md.slot_mapping, md.seq_lens, md.row_request, md.block_tables,
            md.prefill_query_start_loc, md.context_slots, md.context_cu_seqlens):
    assert isinstance(a, jax.Array) and a.dtype == np.int32


def test_mixed_batch_tables_rows_and_lens():
  md, _ = _build(MIXED)
  tables = np.asarray(md.block_tables)
  assert tables.shape == (8, MB)  # 5 requests, bucket 8 (min_bucket), decode-first
  want = np.full((8, MB), -1, np.int32)
  for k, i in enumerate([1, 3, 0, 2, 4]):
    want[k, :len(MIXED[i].block_table)] = MIXED[i].block_table
  np.testing.assert_array_equal(tables, want)
  want_req = np.full(24, -1)
  want_req[[0, 1, 2, 3]] = [0, 1, 1, 1]
  for k, i in enumerate([0, 2, 4]):
    want_req[MIXED_ROWS[i]] = 2 + k
  np.testing.assert_array_equal(np.asarray(md.row_request), want_req)
  dec = np.asarray(md.row_block_tables(0, md.num_decode_rows))
  np.testing.assert_array_equal(dec[:4], want[[0, 1, 1, 1]])
  # multi-token decode: row j of a request with q_len 3 and context 6 sees 6 + j + 1 tokens
  np.testing.assert_array_equal(np.asarray(md.seq_lens)[:8], [11, 7, 8, 9, 0, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(md.seq_lens)[8:13], np.arange(6, 11))  # prefill rows
  assert not md.within_topk  # no index_topk given: a dense model
  assert _build(MIXED, index_topk=25)[0].within_topk  # longest row sees 25 tokens
  assert not _build(MIXED, index_topk=24)[0].within_topk


def test_mixed_batch_prefill_start_loc():
  md, _ = _build(MIXED)
  # three prefill requests padded to 4 (the padding request is empty); rows counted from Td
  np.testing.assert_array_equal(np.asarray(md.prefill_query_start_loc), [0, 5, 10, 15, 15])
  assert md.max_prefill_query_len == 16


def test_threshold_one_makes_multi_token_request_a_prefill():
  md, layout = _build(MIXED, decode_threshold=1)
  assert list(layout.order) == [1, 0, 2, 3, 4]
  assert md.num_decode_rows == 8 and int(md.seq_lens[0]) == 11
  assert int(np.asarray(md.seq_lens)[1:8].max()) == 0
  np.testing.assert_array_equal(np.asarray(md.prefill_query_start_loc)[:5], [0, 5, 10, 13, 18])


def _chunks_per_request(md, num_prefill):
  slots, cu = np.asarray(md.context_slots), np.asarray(md.context_cu_seqlens)
  return [np.concatenate([slots[c, cu[c, p]:cu[c, p + 1]] for c in range(len(slots))])
          for p in range(num_prefill)]


@pytest.mark.parametrize("workspace, want_shape", [(6, (8, 6)), (8, (4, 8)), (8192, (1, 32))])
def test_context_chunks(workspace, want_shape):
  md, _ = _build(MIXED, context_workspace=workspace)
  slots, cu = np.asarray(md.context_slots), np.asarray(md.context_cu_seqlens)
  assert slots.shape == want_shape and cu.shape == (want_shape[0], 5)
  # prefill requests in decode-first order: 0 (context 5), 2 (none), 4 (context 20)
  want = [[_slot(MIXED[i].block_table, p) for p in range(MIXED[i].context_len)] for i in (0, 2, 4)]
  got = _chunks_per_request(md, 3)
  for g, w in zip(got, want):
    assert list(g) == w
  assert cu[:, -1].sum() == 25
  for c in range(len(slots)):
    assert cu[c, 0] == 0 and np.all(np.diff(cu[c]) >= 0) and cu[c, 3] == cu[c, 4]  # padding request
    assert cu[c, -1] <= workspace
    assert np.all(slots[c, cu[c, -1]:] == -1)  # unused workspace rows are padding
  # chunks fill up in order: every chunk before the last non-empty one is full
  used = cu[:, -1]
  last = np.flatnonzero(used)[-1]
  assert np.all(used[:last] == slots.shape[1])


@pytest.mark.parametrize("floor, want", [(1, 4), (8, 8), (1024, 16)])
def test_context_query_rows(floor, want):
  # Chunks of 10: request 0's 10 context tokens (3 new rows), then request 2's 12 (2 new rows);
  # request 1 has no context. A chunk's window is its requests' rows, bucketed from the floor, at
  # most the 16 prefill rows.
  md, _ = _build([RequestState(10, 3, [0, 1, 2, 3]), RequestState(0, 5, [4, 5]),
                  RequestState(12, 2, [6, 7, 8, 9, 10])], decode_threshold=1,
                 context_workspace=10, context_min_query_rows=floor)
  assert md.num_prefill_rows == 16 and md.context_slots.shape == (4, 10)
  assert md.context_query_rows == want


def test_no_context_gives_no_chunks():
  md, _ = _build([RequestState(0, 9, [1, 2, 3]), RequestState(0, 1, [4])])
  assert md.context_slots.shape[0] == 0 and md.context_cu_seqlens.shape[0] == 0


def _batch_b():
  # different real sizes than MIXED (6 decode tokens, 16 prefill tokens, context 32) but the same
  # buckets: Td 8, Tp 16, 4 prefill slots, 8 chunks of 6, max_q bucket 16
  return [
      RequestState(30, 5, list(range(20, 29))),
      RequestState(3, 1, [30]),
      RequestState(0, 2, [31]),
      RequestState(2, 5, [32, 33]),
      RequestState(9, 3, [34, 35, 36]),
      RequestState(0, 6, [37, 38]),
  ]


def test_same_buckets_same_shapes_and_structure():
  md_a, _ = _build(MIXED, context_workspace=6)
  md_b, layout_b = _build(_batch_b(), context_workspace=6)
  assert layout_b.num_decode_requests == 3  # really a different batch
  assert jax.tree.structure(md_a) == jax.tree.structure(md_b)
  shapes = lambda md: jax.tree.map(lambda a: (a.shape, a.dtype), md)
  assert jax.tree.leaves(shapes(md_a)) == jax.tree.leaves(shapes(md_b))
  traces = []

  @jax.jit
  def f(md):
    traces.append(1)
    return md.positions.sum() + md.context_slots.sum()

  f(md_a), f(md_b)
  assert len(traces) == 1  # one compiled program for both steps


def test_different_buckets_different_shapes():
  md_a, _ = _build(MIXED)
  # 9 decode -> bucket 16
  md_c, _ = _build(MIXED + [RequestState(0, 1, [20 + k]) for k in range(5)])
  assert md_c.num_decode_rows == 16 and md_a.num_decode_rows == 8


def test_pack_unpack_round_trip():
  md, layout = _build(MIXED)
  per_request = [np.stack([np.arange(r.query_len) + 100 * i, np.full(r.query_len, i)], -1)
                 for i, r in enumerate(MIXED)]
  packed = layout.pack(per_request, fill=-5)
  assert packed.shape == (24, 2)
  for i, rows in MIXED_ROWS.items():
    np.testing.assert_array_equal(packed[rows], per_request[i])
  pad = sorted(set(range(24)) - {r for rows in MIXED_ROWS.values() for r in rows})
  assert pad == [4, 5, 6, 7, 23] and np.all(packed[pad] == -5)
  for got, want in zip(layout.unpack(packed), per_request):
    np.testing.assert_array_equal(got, want)
  # packing the request-local positions reproduces md.positions on the real rows
  pos = layout.pack([r.context_len + np.arange(r.query_len, dtype=np.int32) for r in MIXED])
  np.testing.assert_array_equal(pos, np.asarray(md.positions))


@pytest.mark.parametrize("requests, match", [
    ([], "at least one request"),
    ([RequestState(4, 0, [1, 2])], "query_len"),
    ([RequestState(-1, 2, [1, 2])], "context_len"),
    ([RequestState(0, 1, list(range(MB + 1)))], "max_blocks_per_seq"),
    ([RequestState(10, 3, [1, 2, 3])], "past its block table"),  # 13 tokens need 4 blocks
    ([RequestState(0, 2, [1]), RequestState(5, 1, [2, NB])], "request 1: block index 64"),
    ([RequestState(5, 1, [-1, 2])], "block index -1"),
], ids=["empty", "q0", "ctx-neg", "table-long", "past-table", "block-too-big", "block-neg"])
def test_validation_errors(requests, match):
  with pytest.raises(ValueError, match=match):
    _build(requests)


def test_bad_blocks_past_the_length_are_allowed():
  # only the blocks the request's tokens occupy are checked
  md, _ = _build([RequestState(3, 1, [5, -1, NB + 7])])
  assert int(md.slot_mapping[0]) == 5 * BS + 3


@pytest.mark.parametrize("requests, match", [
    ([RequestState(0, 2, [1]), RequestState(1, 1, [1])],
     "requests 0 and 1 both write cache slot 5"),
    ([RequestState(0, 1, [3]), RequestState(0, 1, [3])],
     "requests 0 and 1 both write cache slot 12"),
    ([RequestState(0, 8, [6, 6])], "request 0 writes twice to cache slot 2[4-7]"),
    ([RequestState(6, 1, [2, 9]), RequestState(0, 2, [9])], "request 1 writes cache slot 36, which "
     "request 0 reads"),
    ([RequestState(5, 1, [7, 7])], "request 0 writes cache slot 29, which request 0 reads"),
], ids=["across", "same-slot", "within", "write-into-read", "own-context"])
def test_conflicting_writes_are_refused(requests, match):
  with pytest.raises(ValueError, match=match):
    _build(requests)


def test_blocks_shared_for_reading_are_allowed():
  prefix = [30, 31]  # 8 tokens of a common prefix, read by both requests
  md, layout = _build([RequestState(8, 3, prefix + [40]), RequestState(8, 1, prefix + [41])])
  assert sorted(np.asarray(md.slot_mapping)[np.asarray(md.slot_mapping) >= 0]) == [
      40 * BS, 40 * BS + 1, 40 * BS + 2, 41 * BS]


@pytest.mark.parametrize("kw, request_, match", [
    ({"block_size": 4.0}, None, "block_size must be an integer, got 4.0"),
    ({"num_blocks": "64"}, None, "num_blocks must be an integer, got '64'"),
    ({"max_blocks_per_seq": True}, None, "max_blocks_per_seq must be an integer"),
    ({"index_topk": 2.5}, None, "index_topk must be an integer"),
    ({"context_min_query_rows": 8.0}, None, "context_min_query_rows must be an integer"),
    ({"context_min_query_rows": 0}, None, "context_min_query_rows must be positive"),
    ({}, RequestState(1.0, 1, [1]), "request 0: context_len must be an integer, got 1.0"),
    ({}, RequestState(0, "2", [1]), "request 0: query_len must be an integer"),
    ({}, RequestState(0, 2, [1.0]), "request 0: block_table holds float64"),
    ({}, (0, 2, [1]), "request 0 is a tuple"),
])
def test_non_integer_fields_are_refused_by_name(kw, request_, match):
  with pytest.raises(ValueError, match=match):
    _build([request_ or RequestState(0, 2, [1])], **kw)


def test_numpy_integers_are_accepted_everywhere():
  want, _ = _build(MIXED, index_topk=8)
  np_requests = [RequestState(np.int64(r.context_len), np.int32(r.query_len),
                              np.asarray(r.block_table, np.int16)) for r in MIXED]
  got, _ = _build(np_requests, block_size=np.int64(BS), num_blocks=np.uint32(NB),
                  max_blocks_per_seq=np.int8(MB), decode_threshold=np.int64(4),
                  index_topk=np.int32(8))
  jax.tree.map(np.testing.assert_array_equal, got, want)
