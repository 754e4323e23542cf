"""Registers and spills of the Mosaic GPU kernels, as ptxas counts them for sm_90a, on a CPU.

Nsight Compute tells a kernel's spills only on a GPU; this tells them here, before GPU time is
spent. It lowers one of the repo's Mosaic kernels for CUDA at a shape and config (the CPU lowering
the tests use), takes each `mosaic_gpu_v2` custom call's serialized Mosaic GPU module, and hands it
to `MosaicGpuCompile`, the entry that jax's CUDA plugin exports (jax's torch path calls it), in a
child process. That runs Mosaic GPU's whole pipeline as on the GPU machine: its MLIR passes, LLVM's
NVPTX backend to PTX, then ptxas to a cubin, with `MOSAIC_GPU_DUMP_PTXAS` making ptxas print its
counts. The compile first asks the driver for the device's compute capability, so the child loads
a stand-in libcuda (built here with `cc`, ten lines: the context's device is a 9.0, an H100/H200)
that answers that; the compile then fails after ptxas, where the host code is linked and the cubin
would be loaded onto a GPU, which is expected and ignored.

Setup, once (about 710 MB under /tmp; nothing goes into the project's .venv; the plugin's version
must be jaxlib's):
  .venv/bin/python -m pip install --no-deps --no-compile --target /tmp/mla_ptxas/site \\
      jax-cuda13-pjrt==0.11.2 'nvidia-cuda-nvcc>=13,<14' 'nvidia-nvvm>=13,<14' \\
      'nvidia-cuda-nvdisasm>=13,<14'
(nvdisasm only for --sass; `--site DIR` names another target.) The ptxas is the nvcc wheel's (13.5
when this was written); the GPU machine's jax[cuda13] install may have another, whose counts can
differ a little.

Usage (from the repo root; a kernel's jit-entry keywords with --set FIELD=VALUE, Python literals):
  PYTHONPATH=. .venv/bin/python benchmarks/ptxas_report.py prefill --tokens 8192 --requests 8
  PYTHONPATH=. .venv/bin/python benchmarks/ptxas_report.py decode --dtype fp8 --set num_kv_splits=4
  PYTHONPATH=. .venv/bin/python benchmarks/ptxas_report.py sparse --cache fp8_ds_mla --sass
  PYTHONPATH=. .venv/bin/python benchmarks/ptxas_report.py indexer --t 2048 --seq 32768 --rows 4
  PYTHONPATH=. .venv/bin/python benchmarks/ptxas_report.py figures   # the RESULTS.md table
Prints one row a kernel: its name, the registers a thread is launched with ("Used N registers":
with warpgroup register reallocation, setmaxnreg, the launch count, e.g. 168 for 3 warpgroups,
not the 232 a compute warpgroup takes), the stack frame, ptxas's spill stores and loads (bytes a
thread, static: not how often they run), and with --sass the STL / LDL instructions in the SASS,
all of them and those in step loops (sSTL / sLDL: the innermost loops that issue wgmma, which run
once per key block; the rest run once per program or per work item).
--dump DIR keeps each module's child output (ptxas's log, and the SASS with --sass).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.common import field_value

SITE = pathlib.Path("/tmp/mla_ptxas/site")
FAKE_CUDA = pathlib.Path("/tmp/mla_ptxas/fakecuda")
# The driver calls Mosaic GPU's compile makes before it would need a GPU (jax's cuda stubs look
# each one up in libcuda.so.1 and report a missing one as an error): cuCtxGetDevice and
# cuDeviceGetAttribute give the compute capability (attributes 75 and 76: major, minor).
FAKE_CUDA_SOURCE = r"""
typedef int CUresult;
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuCtxGetDevice(int *device) { *device = 0; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attribute, int device) {
  *v = attribute == 75 ? 9 : 0;
  return 0;
}
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "no GPU: stand-in libcuda"; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { *s = "CUDA_ERROR_STAND_IN"; return 0; }
"""
DK, DV, LATENT, ROPE = 192, 128, 512, 64  # prefill head sizes; the latent cache's L and R
PAGE = 64


def traced_prefill(tokens, requests, heads, causal, knobs):
  from pallas_kernels import mosaic_prefill
  q = jax.ShapeDtypeStruct((tokens, heads, DK), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((tokens, heads, DV), jnp.bfloat16)
  cu = jax.ShapeDtypeStruct((requests + 1,), jnp.int32)
  return mosaic_prefill.mla_prefill.trace(q, q, v, cu, cu, scale=DK ** -0.5, causal=causal,
                                          max_seqlen_q=tokens // requests, **knobs)


def traced_decode(batch, heads, seq, dtype, knobs):
  from pallas_kernels import mosaic_decode
  cache_dtype = jnp.float8_e4m3fn if dtype == "fp8" else jnp.bfloat16
  q = jax.ShapeDtypeStruct((batch, heads, LATENT + ROPE), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((batch * seq // PAGE, PAGE, LATENT + ROPE), cache_dtype)
  tables = jax.ShapeDtypeStruct((batch, seq // PAGE), jnp.int32)
  lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return mosaic_decode.latent_decode.trace(q, cache, tables, lens, scale=0.1,
                                           k_scale=0.05 if dtype == "fp8" else None, **knobs)


def traced_sparse(t, heads, cache, slots, tokens, knobs):
  from pallas_kernels import mosaic_sparse
  q = jax.ShapeDtypeStruct((t, heads, LATENT + ROPE), jnp.bfloat16)
  picks = jax.ShapeDtypeStruct((t, slots), jnp.int32)
  pages = tokens // PAGE
  if cache == "fp8_ds_mla":
    return mosaic_sparse.sparse_attention_fp8_ds_mla.trace(
        q, jax.ShapeDtypeStruct((pages, PAGE, LATENT), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((pages, PAGE, LATENT // 128), jnp.float32),
        jax.ShapeDtypeStruct((pages, PAGE, ROPE), jnp.bfloat16), picks, scale=0.1, **knobs)
  kv = jax.ShapeDtypeStruct((pages, PAGE, LATENT + ROPE), jnp.bfloat16)
  return mosaic_sparse.sparse_attention.trace(q, kv, picks, scale=0.1, kv_lora_rank=LATENT,
                                              **knobs)


def traced_indexer(t, rows, tokens, knobs):
  """The indexer logits: t rows, `rows` a program (4: one request's prefill rows sharing a table;
  1: decode rows of distinct requests), over `tokens` keys a row."""
  from pallas_kernels import mosaic_indexer
  heads, dim, pages = mosaic_indexer.HEADS, mosaic_indexer.HEAD_DIM, tokens // PAGE
  return mosaic_indexer.indexer_logits.trace(
      jax.ShapeDtypeStruct((t, heads, dim), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((t, heads), jnp.float32),
      jax.ShapeDtypeStruct((pages, PAGE, dim), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((pages, PAGE), jnp.float32),
      jax.ShapeDtypeStruct((t, pages), jnp.int32), jax.ShapeDtypeStruct((t,), jnp.int32),
      rows=rows, **knobs)


def mosaic_modules(traced):
  """The serialized Mosaic GPU module of each mosaic_gpu custom call in the CUDA lowering."""
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          if (inner.name == "stablehlo.custom_call"
              and "mosaic_gpu" in str(inner.attributes["call_target_name"])):
            found.append(inner.attributes["mhlo.backend_config"]["module"].value_bytes)
          walk(inner)

  walk(traced.lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo").operation)
  if not found:
    raise ValueError("the CUDA lowering holds no mosaic_gpu custom call")
  return found


def _plugin(site):
  plugin = site / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"
  ptxas = site / "nvidia" / "cu13" / "bin" / "ptxas"
  if not plugin.exists() or not ptxas.exists():
    raise SystemExit(f"no CUDA plugin or ptxas under {site}: see the setup in {__file__}")
  return plugin


def _fake_libcuda():
  lib = FAKE_CUDA / "libcuda.so.1"
  if not lib.exists():
    FAKE_CUDA.mkdir(parents=True, exist_ok=True)
    source = FAKE_CUDA / "fake_libcuda.c"
    source.write_text(FAKE_CUDA_SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
  return lib


def compile_module(module, site, sass):
  """Runs MosaicGpuCompile on one module in a child; returns the child's stdout (the dumps)."""
  plugin = _plugin(site)
  env = dict(os.environ, LD_LIBRARY_PATH=str(_fake_libcuda().parent),
             MOSAIC_GPU_CUDA_ROOT=str(site / "nvidia" / "cu13"), MOSAIC_GPU_DUMP_PTXAS="1")
  env.pop("MOSAIC_GPU_DUMP_TO", None)  # it would dump every pass's IR too (hundreds of MB)
  if sass:
    env["MOSAIC_GPU_DUMP_SASS"] = "1"
  with tempfile.NamedTemporaryFile(suffix=".mlirbc") as f:
    f.write(module)
    f.flush()
    child = subprocess.run([sys.executable, "-c", _CHILD, str(plugin), f.name], env=env,
                           capture_output=True, text=True)
  if "ptxas info" not in child.stdout:
    raise RuntimeError(f"no ptxas output; the child's stderr:\n{child.stderr[-4000:]}")
  return child.stdout


# The child (a fresh interpreter without jax: the loader reads LD_LIBRARY_PATH at start-up, and
# the plugin's LLVM stays out of this process). Its compile fails after ptxas (host code to link,
# no GPU to load the cubin onto): by then the dumps are out.
_CHILD = """
import ctypes, pathlib, sys
data = pathlib.Path(sys.argv[2]).read_bytes()
compile_fn = ctypes.CDLL(sys.argv[1]).MosaicGpuCompile
compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
compile_fn(data, len(data))
"""


_SASS_LINE = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+([^;]*);")
_SASS_LABEL = re.compile(r"\s*\.(L_x_\d+):\s*$")
_SPILL = re.compile(r"(?:@!?U?P\w+\s+)?(STL|LDL)\b")
# A conditional branch back to a label: a loop's latch. (Unconditional ones come back from the
# out-of-line retry blocks of barrier waits, which ptxas puts after the kernel's end.)
_LATCH = re.compile(r"@!?U?P\w+\s+BRA\b.*?`\(\.(L_x_\d+)\)")


def sass_spills(sass):
  """(STL, LDL, STL in step loops, LDL in step loops) in one kernel's SASS. A step loop is an
  innermost loop that issues wgmma (HGMMA): one that holds no other such loop (a persistent
  kernel's item loop holds its step loops, so its spills count once per item, not per step)."""
  labels, code, pending = {}, [], []
  for line in sass.splitlines():
    if m := _SASS_LABEL.match(line):
      pending.append(m.group(1))
    elif m := _SASS_LINE.match(line):
      address = int(m.group(1), 16)
      code.append((address, m.group(2).strip()))
      labels.update((name, address) for name in pending)
      pending = []
  loops = [(labels[m.group(1)], address) for address, text in code
           if (m := _LATCH.match(text)) and labels.get(m.group(1), address + 1) <= address]
  mma = [address for address, text in code if text.startswith("HGMMA")]
  mma_loops = [(a, b) for a, b in loops if any(a <= x <= b for x in mma)]
  step_loops = [(a, b) for a, b in mma_loops
                if not any((a, b) != (c, d) and a <= c and d <= b for c, d in mma_loops)]
  spills = [(m.group(1), address) for address, text in code if (m := _SPILL.match(text))]
  in_steps = [kind for kind, x in spills if any(a <= x <= b for a, b in step_loops)]
  kinds = [kind for kind, _ in spills]
  return (kinds.count("STL"), kinds.count("LDL"), in_steps.count("STL"), in_steps.count("LDL"))


def parse(out, sass):
  """ptxas's counts for the entry function in one module's output (Mosaic GPU makes one a
  module), and with sass the STL / LDL instructions of its SASS (sass_spills)."""
  props = re.findall(r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes "
                     r"spill stores, (\d+) bytes spill loads", out)
  registers = re.findall(r"Used (\d+) registers", out)
  if len(props) != 1 or len(registers) != 1:
    raise RuntimeError(f"could not read ptxas's output:\n{out[-4000:]}")
  (name, frame, stores, loads), = props
  row = dict(kernel=name, registers=int(registers[0]), frame=int(frame),
             spill_stores=int(stores), spill_loads=int(loads))
  if sass:
    row["sass"] = sass_spills(out)
  return row


def report(label, traced, args):
  for i, module in enumerate(mosaic_modules(traced)):
    out = compile_module(module, pathlib.Path(args.site), args.sass)
    if args.dump:
      pathlib.Path(args.dump).mkdir(parents=True, exist_ok=True)
      (pathlib.Path(args.dump) / f"{re.sub(r'\W+', '_', label)}_{i}.txt").write_text(out)
    row = parse(out, args.sass)
    spills = f"{row['spill_stores']:>6} {row['spill_loads']:>6}"
    extra = "".join(f" {n:>4}" for n in row["sass"]) if args.sass else ""
    print(f"{label:<34} {row['registers']:>4} {row['frame']:>6} {spills}{extra}  {row['kernel']}",
          flush=True)


FIGURES = (  # (label, kind, arguments): the shapes of benchmarks/RESULTS.md's session 12 table
    ("prefill 8x1024 N=128 causal", "prefill", dict(tokens=8192, requests=8, heads=128)),
    ("prefill 1x16384 N=128 causal", "prefill", dict(tokens=16384, requests=1, heads=128)),
    ("decode B=128 N=128 S=8192 bf16", "decode", dict(batch=128, heads=128, dtype="bf16")),
    ("decode B=128 N=128 S=8192 fp8", "decode", dict(batch=128, heads=128, dtype="fp8")),
    ("sparse T=128 N=128 bf16", "sparse", dict(t=128, heads=128, cache="bf16")),
    ("sparse T=128 N=128 fp8_ds_mla", "sparse", dict(t=128, heads=128, cache="fp8_ds_mla")),
)


def traced_for(kind, a, knobs):
  if kind == "prefill":
    return traced_prefill(a["tokens"], a["requests"], a["heads"], a.get("causal", True), knobs)
  if kind == "decode":
    return traced_decode(a["batch"], a["heads"], a.get("seq", 8192), a["dtype"], knobs)
  if kind == "indexer":
    return traced_indexer(a["t"], a["rows"], a.get("seq", 32768), knobs)
  return traced_sparse(a["t"], a["heads"], a["cache"], a.get("slots", 2048),
                       a.get("cache_tokens", 1 << 20), knobs)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("kind", choices=["prefill", "decode", "sparse", "indexer", "figures"])
  parser.add_argument("--tokens", type=int, default=8192, help="prefill: query rows in all")
  parser.add_argument("--requests", type=int, default=8, help="prefill: equal requests")
  parser.add_argument("--no-causal", dest="causal", action="store_false", help="prefill")
  parser.add_argument("--heads", type=int, default=128, help="query heads N")
  parser.add_argument("--batch", type=int, default=128, help="decode: requests B")
  parser.add_argument("--seq", type=int, default=8192,
                      help="decode: context a request; indexer: keys a row")
  parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="decode cache")
  parser.add_argument("--t", type=int, default=128, help="sparse, indexer: query rows T")
  parser.add_argument("--rows", type=int, default=4, choices=[1, 4],
                      help="indexer: rows a program (4: a prefill's, 1: decode rows')")
  parser.add_argument("--cache", choices=["bf16", "fp8_ds_mla"], default="bf16", help="sparse")
  parser.add_argument("--slots", type=int, default=2048, help="sparse: slots a row")
  parser.add_argument("--cache-tokens", type=int, default=1 << 20, help="sparse: cache size")
  parser.add_argument("--set", type=field_value, nargs="+", action="extend", default=[],
                      metavar="FIELD=VALUE",
                      help="keywords of the kernel's jit entry (config fields)")
  parser.add_argument("--sass", action="store_true", help="also count STL / LDL (nvdisasm)")
  parser.add_argument("--dump", help="directory for each module's ptxas log (and SASS)")
  parser.add_argument("--site", default=str(SITE), help="the pip --target of the setup")
  args = parser.parse_args(argv)
  knobs = dict(args.set)
  print(f"{'case':<34} {'regs':>4} {'frame':>6} {'st B':>6} {'ld B':>6}"
        + (f" {'STL':>4} {'LDL':>4} {'sSTL':>4} {'sLDL':>4}" if args.sass else "") + "  kernel")
  if args.kind == "figures":
    for label, kind, a in FIGURES:
      report(label, traced_for(kind, a, knobs), args)
    return
  a = vars(args)
  label = {"prefill": f"prefill {args.requests}x{args.tokens // args.requests} N={args.heads}"
                      + (" causal" if args.causal else ""),
           "decode": f"decode B={args.batch} N={args.heads} S={args.seq} {args.dtype}",
           "sparse": f"sparse T={args.t} N={args.heads} {args.cache}",
           "indexer": f"indexer T={args.t} S={args.seq} rows={args.rows}"}[args.kind]
  report(label, traced_for(args.kind, a, knobs), args)


if __name__ == "__main__":
  main()
