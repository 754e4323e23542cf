"""Per-step attention metadata and its host-side builder.

The builder orders requests decode-first (as vLLM does), lays their tokens out in rows, and pads
every array to power-of-two buckets so that steps with the same buckets reuse one compiled step.
All index validation happens here, on the host, before anything is traced.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestState:
  """What the scheduler knows of one request for this step."""
  context_len: int  # tokens already in the cache
  query_len: int  # new tokens this step
  block_table: Sequence[int]  # cache blocks holding the request's tokens, in order


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
  """Device arrays for one step. Rows are decode tokens (Td of them) then prefill tokens."""
  positions: jax.Array  # [T] int32, request-local position of each row
  slot_mapping: jax.Array  # [T] int32, cache slot each row writes (-1: padding)
  seq_lens: jax.Array  # [T] int32, cache tokens each row sees: position + 1 (0: padding)
  row_request: jax.Array  # [T] int32, the row's request in block_tables (-1: padding)
  block_tables: jax.Array  # [Rb, MB] int32, requests decode-first (-1 padded)
  prefill_query_start_loc: jax.Array  # [Rp+1] int32, prefill requests' rows, from row Td
  context_slots: jax.Array  # [C, W] int32, earlier-context cache slots per workspace chunk
  context_cu_seqlens: jax.Array  # [C, Rp+1] int32, each prefill request's rows in each chunk
  # Decode context parallelism over dcp devices (None without): each device's view of the cache
  # blocks it owns (`dcp_block_tables`), built on the host, and the tokens each row sees there.
  dcp_block_tables: jax.Array | None = None  # [dcp, Rb, MB] int32, local ids packed, -1 padded
  dcp_seq_lens: jax.Array | None = None  # [dcp, T] int32
  num_decode_rows: int = dataclasses.field(metadata=dict(static=True), default=0)
  max_prefill_query_len: int = dataclasses.field(metadata=dict(static=True), default=0)
  # Query rows a context chunk's attention takes: from the first row of the first request with
  # keys in the chunk, enough for every such request's rows (the most over chunks, bucketed); the
  # others see no key there. None (metadata made by hand): all prefill rows.
  context_query_rows: int | None = dataclasses.field(metadata=dict(static=True), default=None)
  # V3.2: every row sees at most index_topk tokens, so top-k selection would keep them all.
  within_topk: bool = dataclasses.field(metadata=dict(static=True), default=False)
  # What the step was built for (None: not recorded, e.g. metadata made by hand); the layers check
  # them against their cache and config at trace time (`check_cache`, `check_topk`).
  block_size: int | None = dataclasses.field(metadata=dict(static=True), default=None)
  num_blocks: int | None = dataclasses.field(metadata=dict(static=True), default=None)
  index_topk: int | None = dataclasses.field(metadata=dict(static=True), default=None)
  # The latent cache kind's `dtype_name` (e.g. "bfloat16", "fp8_ds_mla"): a scheduler keeps one
  # metadata per cache pool, and a pool of another kind is another model's or layer group's.
  cache_kind: str | None = dataclasses.field(metadata=dict(static=True), default=None)

  @property
  def num_rows(self) -> int:
    return self.positions.shape[0]

  def row_block_tables(self, start: int = 0, stop: int | None = None) -> jax.Array:
    """[stop - start, MB] block table of each row's request (padding rows read request 0's,
    harmless since they see no tokens)."""
    return self.block_tables[jnp.maximum(self.row_request[start:stop], 0)]

  @property
  def dcp_size(self) -> int:
    """The decode-context-parallel size the metadata was built for (1: none)."""
    return 1 if self.dcp_block_tables is None else self.dcp_block_tables.shape[0]

  def check_dcp(self, dcp: int, where: str) -> None:
    """The metadata must carry the dcp tables of `where`'s `dcp` devices (none for 1)."""
    if self.dcp_size != dcp:
      raise ValueError(f"metadata built for dcp={self.dcp_size}, but {where} has dcp={dcp}: "
                       f"build_metadata(..., dcp={dcp})")

  def dcp_row_views(self, start: int = 0,
                    stop: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Each dcp device's view of rows start:stop: (block tables [dcp, rows, MB] of the blocks it
    owns, local ids packed to the front; tokens [dcp, rows] of the row's window held there)."""
    rows = jnp.maximum(self.row_request[start:stop], 0)
    return self.dcp_block_tables[:, rows], self.dcp_seq_lens[:, start:stop]

  @property
  def num_prefill_rows(self) -> int:
    return self.num_rows - self.num_decode_rows

  def check_cache(self, what: str, block_size: int, num_blocks: int,
                  kind: str | None = None) -> None:
    """Trace time: the cache `what` must have the block size, block count and (for the latent
    cache) kind the metadata was built for (its slots and block ids mean nothing in another
    cache)."""
    checks = [("block_size", self.block_size, block_size),
              ("num_blocks", self.num_blocks, num_blocks)]
    if kind is not None:  # the indexer's K cache shares the block table, not the latent kind
      checks.append(("cache kind", self.cache_kind, kind))
    for name, built, got in checks:
      if built is not None and built != got:
        raise ValueError(f"metadata built for {name}={built}, but the {what} has {name}={got}")

  def check_topk(self, index_topk: int | None) -> None:
    """Trace time: metadata built for a top-k (whose `within_topk` says whether every window fits
    in it) must meet a V3.2 layer with that top-k. Metadata built without one fits any layer: it
    never takes the V3.2 dense shortcut."""
    if self.index_topk is not None and self.index_topk != index_topk:
      layer = "a V2/V3 layer" if index_topk is None else f"a layer with index_topk={index_topk}"
      raise ValueError(f"metadata built for index_topk={self.index_topk} is used by {layer}")


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """Where each request's tokens sit in the step's padded rows (host side)."""
  order: np.ndarray  # [R] original request indices, decode-first
  rows: tuple[np.ndarray, ...]  # rows[i]: the rows of request i's tokens (original order)
  num_rows: int
  num_decode_requests: int

  def pack(self, per_request: Sequence[np.ndarray], fill: float = 0) -> np.ndarray:
    """Lays per-request arrays [q_len_i, ...] (original order) into padded rows [T, ...]."""
    first = np.asarray(per_request[0])
    out = np.full((self.num_rows,) + first.shape[1:], fill, first.dtype)
    for rows, values in zip(self.rows, per_request):
      out[rows] = values
    return out

  def unpack(self, packed: np.ndarray | jax.Array) -> list[np.ndarray]:
    """The inverse of `pack`: per-request arrays, original order."""
    packed = np.asarray(packed)
    return [packed[rows] for rows in self.rows]


# build_metadata pads row and request counts to powers of two from this one up.
MIN_BUCKET = 8
# A context chunk's attention takes at least this many query rows (or all prefill rows): the
# `pallas` backend runs prefill on its Mosaic kernel from this many rows, on Triton below, so a
# narrower window would change a chunk's kernel (and its rounding), for no measured gain.
CONTEXT_MIN_QUERY_ROWS = 1024


def bucket(n: int, minimum: int) -> int:
  """0 for 0, else the next power of two >= max(n, minimum)."""
  return 0 if n == 0 else 1 << (max(n, minimum) - 1).bit_length()


def _integer(value, name: str) -> int:
  """`value` as a Python int: any Python or numpy integer (not a bool); anything else refused."""
  if not isinstance(value, (bool, np.bool_)):
    try:
      return operator.index(value)
    except TypeError:
      pass
  raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")


def _checked_request(i: int, r, block_size: int, num_blocks: int,
                     max_blocks_per_seq: int) -> RequestState:
  """Request `i` with Python int lengths and an int64 block table, or a ValueError naming it."""
  if not isinstance(r, RequestState):
    raise ValueError(f"request {i} is a {type(r).__name__}, expected a RequestState")
  context_len = _integer(r.context_len, f"request {i}: context_len")
  query_len = _integer(r.query_len, f"request {i}: query_len")
  table = np.asarray(r.block_table)
  if table.size and table.dtype.kind not in "iu":
    raise ValueError(f"request {i}: block_table holds {table.dtype} entries, expected integer "
                     f"block ids")
  table = table.astype(np.int64)
  if query_len < 1 or context_len < 0:
    raise ValueError(f"request {i}: need query_len >= 1 and context_len >= 0, got "
                     f"{query_len} and {context_len}")
  if table.ndim != 1 or len(table) > max_blocks_per_seq:
    raise ValueError(f"request {i}: block table has {len(table)} entries, at most "
                     f"max_blocks_per_seq={max_blocks_per_seq} allowed")
  needed = -(-(context_len + query_len) // block_size)
  if needed > len(table):
    raise ValueError(f"request {i}: length {context_len + query_len} is past its block table "
                     f"({len(table)} blocks of {block_size} tokens)")
  bad = table[:needed][(table[:needed] < 0) | (table[:needed] >= num_blocks)]
  if bad.size:
    raise ValueError(f"request {i}: block index {int(bad[0])} is outside the cache "
                     f"(num_blocks={num_blocks})")
  return RequestState(context_len, query_len, table)


def _check_writes(requests: Sequence[RequestState], block_size: int) -> None:
  """Every new token's cache slot must be written once, and by no request read as earlier
  context in the same step: two writers would leave one's row for the other to read. Blocks
  shared only for reading (a common prefix) are fine."""
  slots, owner = [], []
  for i, r in enumerate(requests):
    pos = r.context_len + np.arange(r.query_len)
    slots.append(r.block_table[pos // block_size] * block_size + pos % block_size)
    owner.append(np.full(r.query_len, i))
  slots, owner = np.concatenate(slots), np.concatenate(owner)
  order = np.argsort(slots, kind="stable")
  same = np.flatnonzero(np.diff(slots[order]) == 0)
  if same.size:
    a, b = owner[order[same[0]]], owner[order[same[0] + 1]]
    slot = slots[order[same[0]]]
    who = f"requests {a} and {b} both write" if a != b else f"request {a} writes twice to"
    raise ValueError(f"{who} cache slot {slot} (block {slot // block_size}); a block written in a "
                     f"step must belong to one request and appear once in its table")
  written_blocks = np.unique(slots // block_size)
  for j, r in enumerate(requests):
    read = r.block_table[:-(-r.context_len // block_size)]
    for k in np.flatnonzero(np.isin(read, written_blocks)):
      readable = min(block_size, r.context_len - k * block_size)  # offsets holding its context
      hit = (slots // block_size == read[k]) & (slots % block_size < readable)
      if hit.any():
        w = int(np.argmax(hit))
        raise ValueError(f"request {owner[w]} writes cache slot {slots[w]}, which request {j} "
                         f"reads as context (block {read[k]}): shared blocks must be read-only")


def build_metadata(requests: Sequence[RequestState], *, block_size: int, num_blocks: int,
                   max_blocks_per_seq: int, decode_threshold: int = 1,
                   context_workspace: int = 8192, min_bucket: int = MIN_BUCKET,
                   context_min_query_rows: int = CONTEXT_MIN_QUERY_ROWS,
                   index_topk: int | None = None,
                   cache_kind: str | None = None,
                   dcp: int = 1) -> tuple[AttentionMetadata, BatchLayout]:
  """Builds one step's metadata. A request is a decode when query_len <= decode_threshold.

  `block_size`, `num_blocks`, `index_topk` and `cache_kind` (the latent cache's `dtype_name`,
  optional) are recorded and checked against the cache and the layer at trace time.

  `index_topk` (V3.2 models) sets `within_topk` when no row sees more tokens than top-k keeps.
  Earlier context of prefill requests is read back from the cache in chunks of at most
  `context_workspace` tokens (the workspace bound of the prefill path); a chunk's attention takes
  the query rows of the requests in it, as at least `context_min_query_rows` rows (power-of-two
  buckets) or all prefill rows. `dcp` > 1: for a cache
  whose blocks are split over that many devices (`sharding.shard_cache`), each device's block
  tables and row lengths (`dcp_block_tables`, `dcp_seq_lens`).
  """
  if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence) or not requests:
    raise ValueError("build_metadata needs at least one request")
  (block_size, num_blocks, max_blocks_per_seq, decode_threshold, context_workspace, min_bucket,
   context_min_query_rows) = (
      _integer(v, name) for v, name in (
          (block_size, "block_size"), (num_blocks, "num_blocks"),
          (max_blocks_per_seq, "max_blocks_per_seq"), (decode_threshold, "decode_threshold"),
          (context_workspace, "context_workspace"), (min_bucket, "min_bucket"),
          (context_min_query_rows, "context_min_query_rows")))
  index_topk = None if index_topk is None else _integer(index_topk, "index_topk")
  if cache_kind is not None and not isinstance(cache_kind, str):
    raise ValueError(f"cache_kind must be a cache's dtype_name (a str), got {cache_kind!r}")
  dcp = _integer(dcp, "dcp")
  if dcp < 1 or num_blocks % dcp:
    raise ValueError(f"dcp={dcp} must be >= 1 and divide num_blocks={num_blocks}")
  if (block_size <= 0 or num_blocks <= 0 or max_blocks_per_seq <= 0 or context_workspace <= 0
      or context_min_query_rows <= 0):
    raise ValueError("block_size, num_blocks, max_blocks_per_seq, context_workspace and "
                     "context_min_query_rows must be positive")
  requests = [_checked_request(i, r, block_size, num_blocks, max_blocks_per_seq)
              for i, r in enumerate(requests)]
  _check_writes(requests, block_size)

  is_decode = [r.query_len <= decode_threshold for r in requests]
  order = np.array([i for i in range(len(requests)) if is_decode[i]] +
                   [i for i in range(len(requests)) if not is_decode[i]], np.int64)
  num_dec_req = sum(is_decode)
  dec_tokens = sum(requests[i].query_len for i in order[:num_dec_req])
  pre_tokens = sum(requests[i].query_len for i in order[num_dec_req:])
  td, tp = bucket(dec_tokens, min_bucket), bucket(pre_tokens, min_bucket)
  rp = bucket(len(requests) - num_dec_req, 1)

  positions = np.zeros(td + tp, np.int32)
  slots = np.full(td + tp, -1, np.int32)
  seq_lens = np.zeros(td + tp, np.int32)
  row_request = np.full(td + tp, -1, np.int32)
  tables = np.full((bucket(len(requests), min_bucket), max_blocks_per_seq), -1, np.int32)
  cu_q = np.zeros(rp + 1, np.int32)
  rows: list[np.ndarray] = [np.empty(0, np.int64)] * len(requests)
  ctx_slots, ctx_req = [], []

  row = 0
  for k, i in enumerate(order):
    r = requests[i]
    table = r.block_table
    pos = r.context_len + np.arange(r.query_len)
    start = row if k < num_dec_req else td + row - dec_tokens
    rows[i] = start + np.arange(r.query_len)
    positions[rows[i]] = pos
    slots[rows[i]] = table[pos // block_size] * block_size + pos % block_size
    seq_lens[rows[i]] = pos + 1
    row_request[rows[i]] = k
    tables[k, :len(table)] = table
    if k >= num_dec_req:
      p = k - num_dec_req
      cu_q[p + 1:] = rows[i][-1] + 1 - td
      ctx = np.arange(r.context_len)
      ctx_slots.append(table[ctx // block_size] * block_size + ctx % block_size)
      ctx_req.append(np.full(r.context_len, p))
    row += r.query_len

  # Context rows, request after request, cut into chunks of the workspace size.
  all_ctx = np.concatenate(ctx_slots) if ctx_slots else np.empty(0, np.int64)
  all_req = np.concatenate(ctx_req) if ctx_req else np.empty(0, np.int64)
  w = min(context_workspace, bucket(len(all_ctx), min_bucket))
  chunks = bucket(-(-len(all_ctx) // w) if w else 0, 1)
  context_slots = np.full((chunks, w), -1, np.int32)
  context_cu = np.zeros((chunks, rp + 1), np.int32)
  for c in range(chunks):
    sl, rq = all_ctx[c * w:(c + 1) * w], all_req[c * w:(c + 1) * w]
    context_slots[c, :len(sl)] = sl
    context_cu[c, 1:] = np.cumsum(np.bincount(rq, minlength=rp))[:rp]
  # A chunk holds the context of a run of consecutive requests, whose query rows are consecutive.
  window = 0
  for c in range(chunks):
    present = np.flatnonzero(np.diff(context_cu[c]))
    if len(present):
      window = max(window, int(cu_q[present[-1] + 1] - cu_q[present[0]]))

  max_q = max([requests[i].query_len for i in order[num_dec_req:]], default=0)
  md = AttentionMetadata(
      positions=positions, slot_mapping=slots, seq_lens=seq_lens, row_request=row_request,
      block_tables=tables, prefill_query_start_loc=cu_q, context_slots=context_slots,
      context_cu_seqlens=context_cu,
      dcp_block_tables=None if dcp == 1 else dcp_tables(tables, num_blocks, dcp),
      dcp_seq_lens=None if dcp == 1 else dcp_seq_lens(
          tables[np.maximum(row_request, 0)], seq_lens, dcp=dcp, num_blocks=num_blocks,
          block_size=block_size),
      num_decode_rows=td, max_prefill_query_len=bucket(max_q, 16),
      context_query_rows=min(bucket(window, context_min_query_rows), tp),
      within_topk=index_topk is not None and int(seq_lens.max()) <= index_topk,
      block_size=block_size, num_blocks=num_blocks, index_topk=index_topk, cache_kind=cache_kind)
  md = jax.tree.map(jax.numpy.asarray, md)
  return md, BatchLayout(order=order, rows=tuple(rows), num_rows=td + tp,
                         num_decode_requests=num_dec_req)


def dcp_tables(block_tables: np.ndarray, num_blocks: int, dcp: int) -> np.ndarray:
  """Block tables [R, MB] (global ids, -1 padded) as each of `dcp` devices sees them, device d
  owning global blocks [d*nb, (d+1)*nb) with nb = num_blocks / dcp (the split
  `sharding.shard_cache` makes): [dcp, R, MB] int32, its own entries renumbered into its shard and
  packed to the front in table order, -1 after. Host-side (numpy), once per step or request.

  Only a row's last visible block can be partial, and it comes last among its owner's, so a row's
  visible tokens on each device are a prefix of that device's packed table: the decode kernel runs
  on it unchanged with the length `dcp_seq_lens` gives, and the devices' partial results over these
  disjoint token sets merge into the full one by their LSEs.
  """
  tables = np.asarray(block_tables, np.int64)
  nb = num_blocks // dcp
  owner = np.where(tables >= 0, tables // nb, -1)
  out = np.full((dcp,) + tables.shape, -1, np.int32)
  for d in range(dcp):
    owned = owner == d
    order = np.argsort(~owned, axis=1, kind="stable")  # owned entries first, in table order
    local = np.take_along_axis(np.where(owned, tables - d * nb, -1), order, axis=1)
    out[d] = local
  return out


def dcp_seq_lens(row_block_tables: jax.Array | np.ndarray, seq_lens: jax.Array | np.ndarray, *,
                 dcp: int, num_blocks: int, block_size: int) -> jax.Array | np.ndarray:
  """[dcp, T] int32: the tokens of each row's window [0, seq_lens) held by each device, for rows'
  global block tables [T, MB] (host or device arrays; elementwise, traceable: the on-device decode
  loop advances it)."""
  xp = np if isinstance(seq_lens, np.ndarray) else jnp
  mb = row_block_tables.shape[1]
  visible = xp.clip(seq_lens[:, None] - xp.arange(mb) * block_size, 0, block_size)
  owner = xp.where(row_block_tables >= 0, row_block_tables // (num_blocks // dcp), -1)
  held = xp.where(owner[None] == xp.arange(dcp)[:, None, None], visible[None], 0)
  return held.sum(axis=2).astype(xp.int32)
