"""The benchmark modules' entry points: `python -m benchmarks.<name> --help` from the repository
root, a help text for every option, and a clear exit on a machine without a GPU."""

import argparse
import functools
import importlib
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from benchmarks import common as bench_common

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("bench_*.py"))
PER_CALL_MS = bench_common.per_call_ms


@pytest.fixture(autouse=True)
def one_ms_a_call(monkeypatch):
  """The entry points' timings read 1 ms a call: both queued runs still run, but on the CPU the
  slope between them (calls of microseconds) can come out at or below 0."""
  def per_call_ms(run, iters):
    run(iters)
    run(2 * iters)
    return 1.0
  monkeypatch.setattr(bench_common, "per_call_ms", per_call_ms)


def test_every_benchmark_is_listed():
  assert MODULES == ["benchmarks.bench_decode", "benchmarks.bench_generate",
                     "benchmarks.bench_prefill", "benchmarks.bench_sparse", "benchmarks.bench_tp"]


@pytest.mark.parametrize("module", MODULES)
def test_help_runs_as_a_module_from_the_repository_root(module):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith(f"usage: python -m {module} ")
  assert "needs" not in done.stderr  # --help answers before looking for a GPU


@pytest.mark.parametrize("module", MODULES)
def test_help_describes_every_option_and_the_whole_module(module, capsys, monkeypatch):
  mod = importlib.import_module(module)
  with pytest.raises(SystemExit) as exit_info:
    mod.main(["--help"])
  assert exit_info.value.code == 0
  assert mod.__doc__.strip() in capsys.readouterr().out  # the whole docstring, not its first line
  parsers = []
  monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                      lambda self, argv=None: parsers.append(self) or sys.exit(0))
  with pytest.raises(SystemExit):
    mod.main([])
  (parser,) = parsers
  assert len(parser._actions) > 3
  for action in parser._actions:
    assert action.help and len(action.help) > 5, f"{module}: {action.option_strings} has no help"


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="a GPU is visible")
@pytest.mark.parametrize("module", MODULES)
def test_without_a_gpu_it_says_so_and_exits(module):
  mod = importlib.import_module(module)
  with pytest.raises(SystemExit) as exit_info:
    mod.main(["--quick"] if "--quick" in mod.__doc__ else [])
  message = str(exit_info.value.code)
  assert f"python -m {module} needs" in message and "CUDA GPU" in message, message


def test_bench_tp_reads_device_busy_time_from_trace_events():
  from benchmarks.bench_tp import busy_from_events
  meta = lambda pid, name, tid=None: {"ph": "M", "pid": pid, "tid": tid,
                                      "name": "thread_name" if tid else "process_name",
                                      "args": {"name": name}}
  x = lambda pid, tid, ts, dur, name: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                                       "name": name}
  events = [meta(1, "/host:CPU"), meta(2, "/device:GPU:0"), meta(3, "/device:GPU:1"),
            meta(2, "Stream #7(Compute)", 70), meta(2, "XLA Ops", 71), meta(3, "Stream #7", 70),
            x(1, 5, 0, 1000, "PjitFunction(step)"),  # host: not a device
            x(2, 71, 0, 900, "fusion.1"),  # an op line spanning kernels: not counted
            x(2, 70, 0, 100, "latent_decode_kernel"), x(2, 70, 50, 100, "nvjet_gemm_bf16"),
            x(2, 70, 300, 50, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
            x(2, 70, 400, 10, "loop_add_fusion"), x(3, 70, 0, 40, "triton_sparse")]
  busy = busy_from_events(events, steps=2)
  assert set(busy) == {"GPU:0", "GPU:1"}
  # GPU:0: [0, 150) union + 50 + 10 = 210 us over 2 steps.
  assert busy["GPU:0"] == {"busy": 0.105, "pallas": 0.05, "matmul": 0.05, "collective": 0.025,
                           "other": 0.005}
  assert busy["GPU:1"]["busy"] == 0.02 and busy["GPU:1"]["pallas"] == 0.02
  assert busy_from_events(events[:1] + events[6:7], steps=1) is None  # a CPU-only trace


def test_bench_tp_runs_on_host_devices():
  """The whole benchmark (layers on meshes, equality check, timing, trace) in its smoke form on
  8 host CPU devices: 1 GPU and dcp=2 x tp=2 under two dcp merges."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  done = subprocess.run([sys.executable, "-m", "benchmarks.bench_tp", "--quick", "--on-cpu",
                         "--skip-check1", "--layouts", "dcp=2 x tp=2", "--dcp-merge",
                         "all_reduce", "o_proj", "--out",
                         str(ROOT / "benchmarks" / "out" / "cpu_smoke")], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  for merge in ("all_reduce", "o_proj"):
    assert f"| dcp=2 x tp=2 ({merge}) | 4 | 256 | 2 |" in done.stdout, done.stdout[-3000:]
  assert "all checks passed" in done.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_mosaic_configs_times_what_changes_the_program(dtype):
  # A bf16 cache ignores fp8_pipeline: timing its SWEEP rows would spend device time on the
  # default program again (and heads_in="n" with either pipeline is one bf16 program).
  from benchmarks import bench_decode
  cache = jax.numpy.zeros((1, 64, 8), dtype)
  named = []

  def kernel_fn(module, **knobs):
    named.append(knobs)
    return lambda *a: (jax.numpy.zeros(4),)

  row = bench_decode.mosaic_configs({}, kernel_fn, 1, 1, [(None, cache)], 1, 1)
  assert "mosaic ms" in row and not any(k.endswith("error") for k in row)
  # Every program built is timed (in turn with the others).
  assert sum(k.endswith(" ms") for k in row) == len(named)
  assert named[0] == {}
  if dtype == "float8_e4m3fn":
    assert named[1:] == [{"rescale_slack": None}, {"fp8_pipeline": "half_pages"},
                         {"fp8_pipeline": "half_pages", "rescale_slack": None},
                         {"fp8_pipeline": "serial"},
                         {"fp8_pipeline": "shared_widening"},
                         {"wide_widening": False},
                         {"heads_in": "n"}, {"fp8_pipeline": "serial", "heads_in": "n"},
                         {"fp8_pipeline": "register_a", "heads_in": "n"},
                         {"fp8_pipeline": "register_a", "heads_in": "n", "wide_values": False},
                         {"fp8_pipeline": "register_a", "heads_in": "n", "e4m3_promote_cols": 576},
                         {"fp8_pipeline": "register_a", "heads_in": "n", "e4m3_scores": False},
                         {"fp8_pipeline": "register_a", "heads_in": "n", "e4m3_scores": False,
                          "wide_keys": False},
                         {"fp8_pipeline": "register_a", "heads_in": "n", "pages_per_step": 1}]
  else:  # rescale_slack is both caches' knob, auto_barriers bf16's only
    assert named[1:] == [{"rescale_slack": None}, {"auto_barriers": True}, {"heads_in": "n"}]


def test_time_interleaved_takes_the_repeats_in_turn(monkeypatch):
  # Repeat r of every entry before repeat r + 1 of any, each after its own warmup; a repeat times
  # `iters` then 2 `iters` queued calls, one sync each, and takes the slope: on a fake clock where
  # a call costs a (3 s) or b (5 s) and a sync 100 s, the figures are 3000 and 5000 ms exactly
  # (the old per-repeat mean would read 53000 and 55000).
  import types
  clock, log = [0.0], []
  monkeypatch.setattr(bench_common, "per_call_ms", PER_CALL_MS)
  monkeypatch.setattr(bench_common, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

  def call(name, cost):
    def launch(i):
      log.append((name, i))
      clock[0] += cost

    def sync():
      log.append((name, "sync"))
      clock[0] += 100.0
    return launch, sync
  calls = {"a": call("a", 3.0), "b": call("b", 5.0)}
  ms = bench_common.time_interleaved(calls, warmup=1, iters=2, repeats=2)
  timed = lambda name: ([(name, 0), (name, 1), (name, "sync")]
                        + [(name, 0), (name, 1), (name, 2), (name, 3), (name, "sync")])
  assert log == [("a", 0), ("a", "sync"), ("b", 0), ("b", "sync")] + 2 * (timed("a") + timed("b"))
  assert ms == {"a": 3000.0, "b": 5000.0}


def test_fp8_vs_bf16_times_both_caches_of_one_shape(monkeypatch):
  # The issue-15 ratio: the Mosaic default with each cache on the same shape, in one timing.
  import argparse
  from benchmarks import bench_decode
  seen = set()

  def latent_decode(q, cache, tables, lens, *, scale, k_scale):
    seen.add((str(cache.dtype), k_scale is not None, cache.shape[1:], q.shape))
    return (q,)

  monkeypatch.setattr(bench_decode.mosaic, "latent_decode", latent_decode)
  args = argparse.Namespace(page=64, iters=1, repeats=1)
  [row] = bench_decode.fp8_vs_bf16(args, 2, 16, 128)
  assert seen == {("float8_e4m3fn", True, (64, 576), (2, 16, 576)),
                  ("bfloat16", False, (64, 576), (2, 16, 576))}
  assert row["fp8/bf16"] == row["fp8 ms"] / row["bf16 ms"]
  assert row["fp8 GB/s"] > 0 and row["bf16 GB/s"] > 0


def test_caches_in_turn_times_both_layouts_on_the_same_rows(monkeypatch):
  # Issue 13's fp8_ds_mla / bf16 ratio: the same q and slots over each cache, in one timing.
  import argparse
  import types
  from benchmarks import bench_sparse
  seen = set()

  def sparse_attention(q, cache, slots, *, scale, kv_lora_rank):
    seen.add((cache.shape, q.shape, slots.shape))
    return q

  monkeypatch.setattr(bench_sparse, "get_backend",
                      lambda name: types.SimpleNamespace(sparse_attention=sparse_attention))
  args = argparse.Namespace(iters=1, repeats=1)
  caches = {"bf16": jax.numpy.zeros(1), "fp8_ds_mla": jax.numpy.zeros(2)}
  [row] = bench_sparse.caches_in_turn(args, 4, 16, caches, valid=100)
  assert seen == {((1,), (4, 16, 576), (4, 2048)), ((2,), (4, 16, 576), (4, 2048))}
  assert row["fp8_ds_mla/bf16"] == row["fp8_ds_mla ms"] / row["bf16 ms"]
  assert row["valid"] == 100 and row["bf16 TFLOP/s"] > 0
  # Both layouts read the same rows: the input sets do not depend on the cache.
  same = [bench_sparse.sparse_sets(4, 16, cache, 100) for cache in caches.values()]
  assert all((a[0] == b[0]).all() and (a[2] == b[2]).all() for a, b in zip(*same))


def test_bench_sparse_times_a_cases_rows_in_turn(monkeypatch):
  # A case's rows are timed in turn (repeat r of each before repeat r + 1 of any); one that does
  # not build records its error and the others are still timed; the first entry's reference is
  # timed once and gives every timed row its speedup (none with reference=False).
  import argparse
  import types
  from benchmarks import bench_sparse
  log = []

  def backend(name):
    return types.SimpleNamespace(name=name)

  def fn(tag):
    def build(be):
      if tag == "broken":
        raise ValueError("does not fit")
      return lambda x: log.append((tag, be.name)) or x
    return build

  monkeypatch.setattr(bench_sparse, "get_backend", backend)
  monkeypatch.setattr(bench_sparse, "REFERENCE", backend("reference"))
  args = argparse.Namespace(iters=2, repeats=2, no_ref=False)
  entries = [({"case": tag}, fn(tag), "pallas_triton") for tag in ("a", "broken", "b")]
  rows = bench_sparse.timed_rows(args, entries, [(jax.numpy.zeros(3),)], 1000, None)
  assert [r["case"] for r in rows] == ["a", "broken", "b"]
  assert "does not fit" in rows[1]["error"] and "ms" not in rows[1]
  assert all(r["ms"] > 0 and r["speedup"] > 0 and r["xla ms"] == rows[0]["xla ms"]
             for r in (rows[0], rows[2]))
  timed = [tag for tag, name in log if name == "pallas_triton"]
  # Built and checked once each, warmed up (3 calls) in turn, then repeats (2 and 4 calls) in turn.
  assert timed == ["a", "b"] + ["a"] * 3 + ["b"] * 3 + (["a"] * 6 + ["b"] * 6) * 2
  assert {name for _, name in log} == {"pallas_triton", "reference"}
  log.clear()
  rows = bench_sparse.timed_rows(args, [({"case": "a"}, fn("a"), "pallas_triton")],
                                 [(jax.numpy.zeros(3),)], 1000, None, reference=False)
  assert "xla ms" not in rows[0] and {name for _, name in log} == {"pallas_triton"}


def test_module_at_revision_imports_that_revisions_file_beside_todays(tmp_path):
  # `--against-rev`'s import, in a repository of its own: the file as the first commit holds it,
  # a module of its own (its dataclass too), beside the second commit's; a revision or path git
  # does not know raises.
  from benchmarks.common import module_at_revision
  git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],
                                  cwd=tmp_path, capture_output=True, text=True, check=True).stdout
  (tmp_path / "pkg").mkdir()
  source = ('"""Version {v}."""\nimport dataclasses\n\n\n@dataclasses.dataclass\nclass Config:\n'
            '  x: int = {v}\n\n\ndef version():\n  return {v}\n')
  git("init", "-q")
  for v in (1, 2):
    (tmp_path / "pkg" / "mod.py").write_text(source.format(v=v))
    git("add", "-A")
    git("commit", "-q", "-m", f"v{v}")
  first = git("rev-list", "--max-parents=0", "HEAD").strip()
  old = module_at_revision("pkg.mod", first, root=tmp_path)
  now = module_at_revision("pkg.mod", "HEAD", root=tmp_path)
  assert old.version() == 1 and old.Config().x == 1 and old.__doc__ == "Version 1."
  assert now.version() == 2 and old is not now and sys.modules[old.__name__] is old
  assert old.__name__ == f"pkg.mod_at_{first}" and old.Config.__module__ == old.__name__
  assert old.__file__ == f"{first}:pkg/mod.py" and old.__package__ == "pkg"
  with pytest.raises(ValueError, match="git show no-such-rev"):
    module_at_revision("pkg.mod", "no-such-rev", root=tmp_path)
  with pytest.raises(ValueError, match="pkg/other.py"):
    module_at_revision("pkg.other", "HEAD", root=tmp_path)


def test_against_revision_times_both_revisions_in_turn(monkeypatch):
  # bench_decode --against-rev: the same inputs through that revision's kernel and today's, in
  # one timing; the ratio, today's rates and the largest output difference.
  import argparse
  import types
  from benchmarks import bench_decode
  seen = []

  def fake(tag, offset):
    def latent_decode(q, cache, tables, lens, *, scale, k_scale):
      seen.append((tag, str(cache.dtype), k_scale is not None))
      return (q.astype(jax.numpy.float32) + offset,)
    return latent_decode

  monkeypatch.setattr(bench_decode.mosaic, "latent_decode", fake("now", 0.0))
  old = types.SimpleNamespace(latent_decode=fake("old", 0.5))
  args = argparse.Namespace(page=64, iters=1, repeats=1, against_rev="abc123")
  [row] = bench_decode.against_revision(args, 2, 16, 128, "fp8", old)
  assert {("old", "float8_e4m3fn", True), ("now", "float8_e4m3fn", True)} == set(seen)
  assert row["abc123/now"] == row["abc123 ms"] / row["now ms"]
  assert row["max diff"] == 0.5 and row["now TFLOP/s"] > 0 and "now GB/s" in row
  assert row["cache"] == "fp8 Mosaic, abc123 vs now (in turn)"


def test_bench_sparse_mosaic_default_takes_either_layout():
  # bench_sparse --against-rev's rows: a module's default entry for each cache layout.
  import types
  from benchmarks import bench_sparse
  from mla_jax.cache import DSMLACache, LatentCache
  calls = []
  module = types.SimpleNamespace(
      sparse_attention=lambda q, data, slots, **kw: calls.append(("bf16", data.shape, kw)),
      sparse_attention_fp8_ds_mla=lambda q, nope, scales, rope, slots, **kw: calls.append(
          ("fp8_ds_mla", (nope.shape, scales.shape, rope.shape), kw)))
  call = bench_sparse.mosaic_default(module)
  call(None, LatentCache.allocate(2, 64), None)
  call(None, DSMLACache.allocate(2, 64), None)
  assert calls == [("bf16", (2, 64, 576), {"scale": bench_sparse.SCALE, "kv_lora_rank": 512}),
                   ("fp8_ds_mla", ((2, 64, 512), (2, 64, 4), (2, 64, 64)),
                    {"scale": bench_sparse.SCALE})]


def test_bench_sparse_topk_revision_rows_call_each_module(monkeypatch):
  # bench_sparse --against-rev's top-k rows: that revision's module's default and today's, in
  # that order, each called on (logits, lens) with k = 2048 (the tables unused).
  import types
  from benchmarks import bench_sparse
  calls = []
  fake = lambda tag: types.SimpleNamespace(
      topk_positions=lambda x, lens, k: calls.append((tag, x.shape, k)) or x)
  monkeypatch.setattr(bench_sparse, "pallas_topk", fake("now"))
  entries = bench_sparse.revision_rows(2, 64, "abc123", fake("old"))
  assert [row["cache"] for row, _, _ in entries] == ["topk at abc123", "topk now"]
  for _, fn, backend in entries:
    assert backend == "pallas_triton"
    fn(None)(jax.numpy.zeros((2, 64)), jax.numpy.zeros((2,), jax.numpy.int32), None)
  assert calls == [("old", (2, 64), bench_sparse.TOPK), ("now", (2, 64), bench_sparse.TOPK)]


def test_bench_sparse_topk_shapes_parse_rows_by_positions():
  from benchmarks import bench_sparse
  assert bench_sparse._rows_by_positions("128x8192") == (128, 8192)
  for bad in ("128", "128x", "0x8192", "x8192", "128x-1", "128*8192"):
    with pytest.raises(argparse.ArgumentTypeError, match="ROWSxPOSITIONS"):
      bench_sparse._rows_by_positions(bad)


def test_kernel_times_splits_an_ncu_log_at_its_markers():
  from benchmarks import kernel_times
  log = "\n".join([
      "==PROF== Connected to process 1", '"ID","Kernel Name","gpu__time_duration.sum"',
      '"","","ns"', '"0","void at::vectorized_elementwise_kernel<4>(int)","1,000"',
      '"1","loop_pad_fusion","7,400"', '"2","mosaic_sparse_bf16_mosaic_gpu_kernel","93,196"',
      '"3","void at::vectorized_elementwise_kernel<4>(int)","900"', '"4","sparse_latent","95,600"'])
  got = kernel_times.calls(log)
  assert [[name for name, _ in call] for call in got] == [
      ["loop_pad_fusion", "mosaic_sparse_bf16_mosaic_gpu_kernel"], ["sparse_latent"]]
  assert [[t for _, t in call] for call in got] == [[pytest.approx(7.4), pytest.approx(93.196)],
                                                    [pytest.approx(95.6)]]
  assert "call 0: 100.6 us in 2 kernels" in kernel_times.format_calls(got)
  with pytest.raises(ValueError, match="no ncu CSV rows"):
    kernel_times.calls("==PROF== Disconnected")


def test_kernel_times_profiles_each_in_turn_entry_once(monkeypatch):
  # The benchmarks time most rows in turn (`time_interleaved`): the stand-in profiles each entry's
  # call once, after its warm calls and the marker, in the entries' order.
  import types
  from benchmarks import kernel_times
  log = []
  cuda = types.SimpleNamespace(
      synchronize=lambda: None,
      profiler=types.SimpleNamespace(start=lambda: log.append("start"),
                                     stop=lambda: log.append("stop")))
  marker = types.SimpleNamespace(add_=lambda x: log.append("marker"))
  monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
      cuda=cuda, zeros=lambda *a, **k: marker))
  calls = {name: (lambda i, name=name: log.append((name, i)),
                  lambda name=name: log.append((name, "sync"))) for name in ("a", "b")}
  assert kernel_times.profiled_in_turn(calls, iters=20, repeats=5) == {"a": 1.0, "b": 1.0}
  one = lambda n: [(n, 0), (n, 1), (n, 2), (n, "sync"), "start", "marker", (n, 0), (n, "sync"),
                   "stop"]
  assert log == one("a") + one("b")


def test_kernel_times_help_and_its_wrong_use(capsys):
  from benchmarks import kernel_times
  with pytest.raises(SystemExit) as exit_info:
    kernel_times.main(["--help"])
  assert exit_info.value.code == 0
  assert kernel_times.__doc__.strip() in capsys.readouterr().out
  with pytest.raises(SystemExit) as exit_info:
    kernel_times.main([])  # neither a benchmark nor --table
  assert exit_info.value.code == 2
  assert "name a benchmark, or give --table" in capsys.readouterr().err


def test_ncu_stalls_sums_an_ncu_source_page(tmp_path, capsys):
  from benchmarks import ncu_stalls
  head = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')
  page = "\n".join([
      '"Kernel Name","mosaic_latent_decode_bf16_p64_s1_mosaic_gpu_kernel",', head,
      '"0x10","HGMMA.64x64x16.F32.BF16 R152, gdesc[UR28], R152","10","1,024","0","10","0"',
      '"0x20","WARPGROUP.DEPBAR.LE gsb0, 0x0","30","1,024","30","0","0"',
      '"0x30","@!P1  BRA 0x40","60","1,024","0","60","0"'])
  got = ncu_stalls.summary(ncu_stalls.launches(page)[0][1], top=2, windows=(0, 3, 2))
  assert got.splitlines()[:3] == ["100 samples", "  long_sb                     70  70.0%",
                                  "  barrier                     30  30.0%"]
  assert "  BRA                    1024  60.0%" in got  # the guard is not the opcode
  assert "HGMMA" not in got.split("most samples")[1].split("windows")[0]  # only the top 2
  assert "      0  40.0%         2048" in got and "      2  60.0%         1024" in got
  with pytest.raises(ValueError, match="no 'Warp Stall Sampling"):
    ncu_stalls.launches('"Kernel Name","k",\n"Address","Source"')
  (tmp_path / "src.csv").write_text(page)
  ncu_stalls.main([str(tmp_path / "src.csv"), "--top", "1"])
  assert "@!P1  BRA 0x40" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    ncu_stalls.main([str(tmp_path / "src.csv"), "--windows", "5:1:2"])
  # Two launches in one export (--launch-count 2): each summed on its own, under its name.
  second = page.replace("mosaic_latent_decode_bf16_p64_s1_mosaic_gpu_kernel", "topk_theta")
  (tmp_path / "two.csv").write_text(page + "\n" + second.replace('"60","1,024","0","60"',
                                                                   '"6","1,024","0","6"'))
  assert [name for name, _ in ncu_stalls.launches(page + "\n" + second)] == [
      "mosaic_latent_decode_bf16_p64_s1_mosaic_gpu_kernel", "topk_theta"]
  ncu_stalls.main([str(tmp_path / "two.csv"), "--top", "1"])
  out = capsys.readouterr().out
  assert "== launch 1: topk_theta" in out and out.count("100 samples") == 1, out
  assert out.split("== launch 1")[1].splitlines()[1] == "46 samples", out


def test_ptxas_report_reads_ptxas_and_finds_the_step_loops_spills():
  # A ptxas -v log and SASS as Mosaic GPU dumps them (shapes of the real prefill dump): one spill
  # reload in the item loop, one in the step loop (the innermost that issues wgmma), and one in
  # an out-of-line retry block whose unconditional branch back is no loop.
  from benchmarks import ptxas_report
  out = "\n".join([
      "ptxas info    : Function properties for k_mosaic_gpu_kernel",
      "    48 bytes stack frame, 48 bytes spill stores, 72 bytes spill loads",
      "ptxas info    : Used 168 registers, used 16 barriers, 48 bytes cumulative stack size",
      "        /*0000*/                   STL [R1], R4 ;",
      ".L_x_1:",
      "        /*0010*/                   LDL R2, [R1] ;",
      ".L_x_2:",
      "        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;",
      "        /*0030*/                   LDL.64 R4, [R1+0x8] ;",
      "        /*0040*/              @P0  BRA `(.L_x_2) ;",
      "        /*0050*/              @!P1 BRA `(.L_x_1) ;",
      "        /*0060*/                   EXIT ;",
      ".L_x_3:",
      "        /*0070*/                   LDL R5, [R1] ;",
      "        /*0080*/                   BRA `(.L_x_1) ;"])
  assert ptxas_report.parse(out, sass=True) == dict(
      kernel="k_mosaic_gpu_kernel", registers=168, frame=48, spill_stores=48, spill_loads=72,
      sass=(1, 3, 0, 1))
  with pytest.raises(RuntimeError, match="could not read"):
    ptxas_report.parse("ptxas info    : Compile time = 1 ms", sass=False)


def test_ptxas_report_takes_the_mosaic_module_from_the_cuda_lowering():
  from benchmarks import ptxas_report
  for traced in (ptxas_report.traced_prefill(256, 2, 16, True, {}),
                 ptxas_report.traced_indexer(8, 4, 512, {})):
    modules = ptxas_report.mosaic_modules(traced)
    assert len(modules) == 1 and modules[0].startswith(b"ML\xefR")  # MLIR bytecode


def test_field_value_reads_a_keyword_argument():
  # --set FIELD=VALUE of ptxas_report and triton_sass: a Python literal, else the bare word.
  assert bench_common.field_value("sectors=True") == ("sectors", True)
  assert bench_common.field_value("chunk=1024") == ("chunk", 1024)
  assert bench_common.field_value("fp8_pipeline=half_rows") == ("fp8_pipeline", "half_rows")
  for bad in ("sectors", "=True", "sectors="):
    with pytest.raises(argparse.ArgumentTypeError, match="FIELD=VALUE"):
      bench_common.field_value(bad)


def test_bench_prefill_config_field_takes_only_config_fields():
  # --mosaic-variant FIELD=VALUE: `field_value`'s parse, the field checked against
  # MosaicPrefillConfig's.
  from benchmarks import bench_prefill
  assert bench_prefill.config_field("block_k=64") == ("block_k", 64)
  assert bench_prefill.config_field("ping_pong=True") == ("ping_pong", True)
  for bad in ("blockk=64", "block_k", "block_k="):
    with pytest.raises(argparse.ArgumentTypeError, match="FIELD=VALUE"):
      bench_prefill.config_field(bad)


def test_triton_sass_counts_each_loop():
  # nvdisasm -c text: a loop of 4 instructions (a predicated branch back to its label, counted)
  # holding an inner loop of 2, then a forward branch (no loop); predicates and modifiers drop
  # from opcodes.
  from benchmarks import triton_sass
  sass = "\n".join([
      "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
      ".L_x_0:",
      "        /*0010*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;",
      ".L_x_1:",
      "        /*0020*/              @!P0 SEL R4, RZ, 0x1, !P0 ;",
      "        /*0030*/              @P1  BRA `(.L_x_1) ;",
      "        /*0040*/              @P0  BRA `(.L_x_0) ;",
      "        /*0050*/                   BRA `(.L_x_2) ;",
      ".L_x_2:",
      "        /*0060*/                   EXIT ;"])
  assert triton_sass.loops(sass) == [
      (2, {"SEL": 1, "BRA": 1}), (4, {"ISETP": 1, "SEL": 1, "BRA": 2})]


def test_triton_sass_lowers_each_topk_kernel_with_its_warps():
  # The four-kernel top-k at [128, 131072] with sectors: each kernel's Triton IR for sm_90 and
  # the warps its pallas_call gives it, by name, as triton_sass compiles them.
  from benchmarks import triton_sass
  kernels = triton_sass.lower_topk(128, 131072, 2048, {"sectors": True, "row_resident": False})
  assert {name: opts["num_warps"] for name, (_, opts) in kernels.items()} == {
      "topk_sector_maxima": 4, "topk_theta": 8, "topk_sector_threshold": 4, "topk_select": 8}
  assert all(text.startswith("module") and "tt.func" in text for text, _ in kernels.values())


def test_sparse_direct_probe_lowers_one_mosaic_module():
  # The probe's stand-in kernel (v16's memory warpgroup: lane-level loads, widening, swizzled
  # stores) lowers for CUDA on the CPU, as ptxas_report compiles it; a Mosaic GPU or MLIR API
  # change breaks it here first.
  from benchmarks import ptxas_report, sparse_direct_probe
  modules = ptxas_report.mosaic_modules(sparse_direct_probe.traced(120))
  assert len(modules) == 1 and modules[0].startswith(b"ML\xefR")


def test_phase_table_reads_a_profilers_trace():
  # Two warpgroup traces (tids), clocks as Mosaic GPU dumps them (ts = clocks / 1e3); each trace's
  # first `skip` occurrences of a phase are left out, and the step period is warpgroup 0's scores
  # from one start to the next.
  from benchmarks.phase_profile import phase_table
  events = []
  for tid, base in ((1, 0), (2, 7)):
    for step, start in enumerate(range(base, base + 40, 10)):
      dur = 5 if step else 50  # step 0: the pipeline filling
      events += [{"name": "wg0_scores", "ph": "B", "ts": start / 1e3, "tid": tid},
                 {"name": "wg0_scores", "ph": "E", "ts": (start + dur) / 1e3, "tid": tid}]
  table, period = phase_table(events, skip=1)
  assert list(table) == ["wg0_scores"]
  n, median, p25, p75 = table["wg0_scores"]
  assert n == 6 and np.allclose([median, p25, p75], 5)
  assert period[0] == 4 and np.allclose(period[1:], 10)


def test_phase_profile_takes_the_scopes_that_fit():
  # The profiled decode kernel at 128 heads, lowered for CUDA here: 64 scopes a warpgroup do not
  # fit beside its 224 KB (so the profile fields reach the kernel), the count found does, one
  # more does not.
  from benchmarks.phase_profile import fit_space
  from pallas_kernels import mosaic_decode
  fn = functools.partial(mosaic_decode.latent_decode, scale=0.1)
  args = (jax.ShapeDtypeStruct((128, 128, 576), jax.numpy.bfloat16),
          jax.ShapeDtypeStruct((128 * 128, 64, 576), jax.numpy.bfloat16),
          jax.ShapeDtypeStruct((128, 128), jax.numpy.int32),
          jax.ShapeDtypeStruct((128,), jax.numpy.int32))
  space = fit_space(fn, args, 64, platform="cuda")
  assert 0 < space < 64
  assert fit_space(fn, args, space + 1, platform="cuda") == space
  with pytest.raises(ValueError, match="space must be at least 1"):
    fit_space(fn, args, 0, platform="cuda")


def test_phase_profile_help_and_no_gpu(capsys):
  from benchmarks import phase_profile
  with pytest.raises(SystemExit) as exit_info:
    phase_profile.main(["--help"])
  assert exit_info.value.code == 0
  assert phase_profile.__doc__.strip() in capsys.readouterr().out
  if jax.default_backend() != "gpu":
    with pytest.raises(SystemExit) as exit_info:
      phase_profile.main(["decode"])
    said = capsys.readouterr()
    assert "needs a CUDA GPU" in said.out + said.err + str(exit_info.value.code)


def _smi_time(seconds):
  import datetime
  return datetime.datetime.fromtimestamp(seconds).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_power_summarizes_the_samples_within_the_load():
  from benchmarks import power
  t0 = 1_800_000_000.0
  samples = "\n".join([f"{_smi_time(t0 - 0.1)}, 1980, 118.10, 0x0000000000000000",  # before
                        f"{_smi_time(t0 + 0.02)}, 1455, 699.50, 0x0000000000000004",
                        f"{_smi_time(t0 + 0.04)}, 1440, 701.20, 0x0000000000000004",
                        f"{_smi_time(t0 + 0.06)}, [N/A], 650, 0x0", "garbage",
                        f"{_smi_time(t0 + 0.08)}, 1500, 690.00, 0x0000000000000001",
                        f"{_smi_time(t0 + 0.50)}, 1980, 90.00, 0x0"])  # after
  got = power.sample_summary(samples, t0, t0 + 0.1)
  assert got["MHz"] == 1455
  assert got["W"] == pytest.approx((699.5 + 701.2 + 690.0) / 3)
  assert got["power capped"] == pytest.approx(2 / 3)
  assert got["samples"] == 3
  with pytest.raises(ValueError, match="no power samples"):
    power.sample_summary(samples, t0 + 1, t0 + 2)


def test_power_under_load_runs_the_calls_within_the_samples(monkeypatch):
  # A fake clock (1 ms a launch): n = seconds / (ms a call) calls run while nvidia-smi samples;
  # W is the samples' mean and mJ a call W x ms.
  import types
  from benchmarks import power
  epoch, now, launched = 1_800_000_000.0, [0.0], []
  monkeypatch.setattr(power.time, "perf_counter", lambda: now[0])
  monkeypatch.setattr(power.time, "time", lambda: epoch + now[0])
  monkeypatch.setattr(power.time, "sleep", lambda s: None)
  t0 = epoch + 0.013  # after the warm-up and calibration
  samples = f"{_smi_time(t0 + 0.1)}, 1455, 690.0, 0x4\n{_smi_time(t0 + 0.3)}, 1470, 710.0, 0x4\n"
  sampler = types.SimpleNamespace(terminate=lambda: None, communicate=lambda: (samples, None))
  monkeypatch.setattr(power.subprocess, "Popen", lambda *a, **k: sampler)

  def launch(i):
    launched.append(i)
    now[0] += 1e-3
  got = power.under_load(launch, lambda: None, seconds=0.5)
  assert len(launched) == 3 + 10 + 500  # warm-up, calibration, the load
  assert got["ms"] == pytest.approx(1.0)
  assert got["W"] == pytest.approx(700.0)
  assert got["mJ"] == pytest.approx(700.0)
  assert got["power capped"] == 1.0
  assert power.format_line("x", got).startswith("x: 1.0000 ms, 700.0 mJ a call, 700 W")


def test_power_help_and_its_wrong_use(capsys):
  from benchmarks import power
  with pytest.raises(SystemExit) as exit_info:
    power.main(["--help"])
  assert exit_info.value.code == 0
  assert power.__doc__.strip() in capsys.readouterr().out
  for bad in ([], ["generate"], ["decode", "--seconds", "0"], ["matmul", "--batch", "8"],
              ["matmul", "--size", "0"], ["read", "--gb", "-1"], ["read", "--batch", "8"],
              ["decode", "--size", "64"], ["matmul", "--gb", "1"], ["read", "--size", "64"]):
    with pytest.raises(SystemExit) as exit_info:
      power.main(bad)
    assert exit_info.value.code == 2


def test_power_matmul_and_read_count_their_work(monkeypatch):
  from benchmarks import power
  seen = []

  def fake_under_load(launch, sync, seconds):
    launch(0)
    launch(1)
    sync()
    seen.append(seconds)
    return {"ms": 2.0}
  monkeypatch.setattr(power, "under_load", fake_under_load)
  got = power.matmul_under_load(16, 0.5)
  assert seen == [0.5]
  assert got["TFLOP/s"] == pytest.approx(2 * 16**3 / 2e9)
  got = power.read_under_load(2 * 8192 * 3 / 1e9, 0.25)  # 3 rows of 8192 bf16
  assert seen == [0.5, 0.25]
  assert got["GB/s"] == pytest.approx(3 * 8192 * 2 / 2e6)


def test_run_with_timers_replaces_both_timers_of_a_timed_benchmark(monkeypatch):
  # kernel_times and power run a benchmark module through it: its main sees the given timers
  # under the names it calls, and a module that does not time through them is refused.
  from benchmarks import bench_decode, common as bench_common
  seen = []

  def fake_main(argv):
    seen.append((argv, bench_decode.time_ms, bench_decode.time_interleaved))
  monkeypatch.setattr(bench_decode, "main", fake_main)
  monkeypatch.setattr(bench_decode, "time_ms", bench_decode.time_ms)  # restored after the test
  monkeypatch.setattr(bench_decode, "time_interleaved", bench_decode.time_interleaved)
  one, turn = object(), object()
  bench_common.run_with_timers("decode", ["--quick"], time_ms=one, time_interleaved=turn)
  assert seen == [(["--quick"], one, turn)]
  with pytest.raises(ValueError, match="one of"):
    bench_common.run_with_timers("generate", [], time_ms=one, time_interleaved=turn)


def test_run_measuring_each_entry_measures_every_entry_in_turn(monkeypatch, capsys):
  # power and flushed: both timers of the module become `measure` per entry, its "ms" returned.
  from benchmarks import bench_decode, common as bench_common
  got = {}

  def fake_main(argv):
    got["one"] = bench_decode.time_ms(lambda v: v, [[1], [2]], iters=5)
    got["turn"] = bench_decode.time_interleaved({"a": ("la", "sa"), "b": ("lb", "sb")})
  monkeypatch.setattr(bench_decode, "main", fake_main)
  monkeypatch.setattr(bench_decode, "time_ms", bench_decode.time_ms)
  monkeypatch.setattr(bench_decode, "time_interleaved", bench_decode.time_interleaved)
  measured = []

  def measure(launch, sync):
    measured.append(launch)
    return {"ms": float(len(measured))}
  bench_common.run_measuring_each_entry("decode", [], measure, lambda name, m: f"<{name} {m}>")
  assert got == {"one": 1.0, "turn": {"a": 2.0, "b": 3.0}}
  assert measured[1:] == ["la", "lb"]
  assert capsys.readouterr().out.splitlines() == ["< {'ms': 1.0}>", "<a {'ms': 2.0}>",
                                                  "<b {'ms': 3.0}>"]


def test_flushed_splits_the_trace_into_calls_at_the_flushes():
  from benchmarks import flushed
  f = flushed.FLUSH_MODULE
  events = [(0, 90, f), (100, 130, "jit_step"), (135, 400, ""), (420, 500, f),  # call 0: 300 ns
            (510, 530, "jit_step"), (600, 700, f)]  # call 1: 20 ns; call 2: none
  assert flushed.call_spans(events[::-1]) == pytest.approx([300e-6, 20e-6])
  assert flushed.call_spans([(0, 5, "jit_step")]) == []  # before any flush: not a timed call


def test_flushed_reads_a_trace_and_times_the_last_calls(monkeypatch, tmp_path):
  import jax
  import jax.numpy as jnp
  from benchmarks import common as bench_common, flushed
  # device_kernels on a real (CPU) trace: the host's XLA thunks carry their modules.
  step = jax.jit(lambda x: jnp.sin(x) @ x)
  x = jnp.ones((64, 64))
  with jax.profiler.trace(str(tmp_path)):
    step(x).block_until_ready()
  (xspace,) = tmp_path.glob("**/*.xplane.pb")
  got = flushed.device_kernels(str(xspace), device="/host:CPU", line_prefix="tf_XLA")
  assert any(module == "jit__lambda" and end >= start for start, end, module in got)
  with pytest.raises(RuntimeError, match="no /device:GPU:0 plane"):
    flushed.device_kernels(str(xspace))
  # flushed_ms: each queued call after a flush; the trace's spans (here given) timed, the last
  # `calls` of them if a warm-up call's leaked in; too few is an error.
  f = flushed.FLUSH_MODULE
  ms = 10**6  # ns
  trace = [(0, 1, f), (2, 9 * ms + 2, "w"),
           (10 * ms, 10 * ms + 1, f), (10 * ms + 2, 11 * ms + 2, "a"),
           (20 * ms, 20 * ms + 1, f), (20 * ms + 2, 23 * ms + 2, "a")]
  monkeypatch.setattr(flushed, "L2_FLUSH_BYTES", 1024)
  monkeypatch.setattr(flushed, "device_kernels", lambda path, **_: trace)
  launched = []
  got = flushed.flushed_ms(*bench_common.jax_calls(lambda v: launched.append(v) or v, [[x]]), 2)
  assert len(launched) == 3 + 2  # warm-up, then the flushed calls
  assert got == {"ms": pytest.approx(2.0), "min": pytest.approx(1.0), "max": pytest.approx(3.0)}
  with pytest.raises(RuntimeError, match="holds 3 calls after a flush, 4 were queued"):
    flushed.flushed_ms(*bench_common.jax_calls(lambda v: v, [[x]]), 4)


def test_flushed_help_and_its_wrong_use(capsys):
  from benchmarks import flushed
  with pytest.raises(SystemExit) as exit_info:
    flushed.main(["--help"])
  assert exit_info.value.code == 0
  assert flushed.__doc__.strip() in capsys.readouterr().out
  for bad in ([], ["matmul"], ["decode", "--calls", "0"]):
    with pytest.raises(SystemExit) as exit_info:
      flushed.main(bad)
    assert exit_info.value.code == 2


def test_launch_kernels_one_by_one_turns_command_buffers_off_and_keeps_other_flags(monkeypatch):
  from benchmarks import common as bench_common
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  bench_common.launch_kernels_one_by_one()
  assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2",
                                             "--xla_gpu_enable_command_buffer="]
  monkeypatch.delenv("XLA_FLAGS")
  bench_common.launch_kernels_one_by_one()
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer="
