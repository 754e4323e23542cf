"""Per-loop SASS of the Pallas-Triton kernels (the top-k's), as pip Triton and ptxas emit them for
sm_90a, on a CPU.

A Triton kernel's cost per pass of its loops (a theta or select bisection pass, a threshold step)
is its instructions there; this counts them before GPU time is spent. It lowers the top-k for CUDA
at a shape and config on this CPU (the compute capability the lowering asks the device for is
given as 9.0), keeps each kernel's Triton IR and num_warps, and in a child process compiles each
with pip Triton (TTIR -> TTGIR -> PTX, the layouts included), then ptxas (registers, spills) and
nvdisasm (SASS), both shipped in Triton's wheel. A loop is a backward branch; its body's
instructions are counted by opcode. jaxlib's Triton is not pip Triton, so the GPU's SASS can
differ; the counts compare forms of a kernel, they do not time it (RESULTS.md, top-k v24-v25).

Setup, once (Triton's wheel for the machine's python3.11, outside the project's .venv):
  python3.11 -m venv /tmp/mla_triton && /tmp/mla_triton/bin/pip install triton==3.6.0

Usage (from the repo root; `topk_positions` keywords with --set FIELD=VALUE, Python literals):
  PYTHONPATH=. .venv/bin/python benchmarks/triton_sass.py --rows 128 --positions 131072 \\
      --set sectors=True --set row_resident=False
Prints, per kernel: registers, spill bytes, SASS instructions, the TTGIR's layout conversions,
then each loop: its instructions and most frequent opcodes. --dump DIR keeps the TTIR, TTGIR, PTX
and SASS.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.common import field_value

TRITON_PYTHON = "/tmp/mla_triton/bin/python"
# Run by TRITON_PYTHON in DIR: every NAME.ttir with NAME.json's num_warps -> NAME.ptx, .ttgir,
# .cubin, .sass and NAME.ptxas (ptxas -v's report).
_CHILD = r"""
import json, pathlib, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
bin_dir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
for ttir in sorted(pathlib.Path(sys.argv[1]).glob("*.ttir")):
  opts = json.loads(ttir.with_suffix(".json").read_text())
  k = triton.compile(str(ttir), target=GPUTarget("cuda", 90, 32), options=opts)
  ttir.with_suffix(".ttgir").write_text(k.asm["ttgir"])
  ptx = ttir.with_suffix(".ptx")
  ptx.write_text(k.asm["ptx"])
  cubin = ttir.with_suffix(".cubin")
  report = subprocess.run([bin_dir / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", cubin],
                          capture_output=True, text=True, check=True)
  ttir.with_suffix(".ptxas").write_text(report.stderr + report.stdout)
  sass = subprocess.run([bin_dir / "nvdisasm", "-c", cubin], capture_output=True, text=True,
                        check=True)
  ttir.with_suffix(".sass").write_text(sass.stdout)
"""


def lower_topk(rows: int, positions: int, topk: int, knobs: dict) -> dict[str, tuple[str, dict]]:
  """Each top-k kernel's (Triton IR text, {"num_warps", "num_stages"}) by kernel name, lowered for
  compute capability 9.0 on this CPU."""
  from jax._src.interpreters import mlir
  from jax._src.pallas.triton import lowering, pallas_call_registration

  from pallas_kernels import topk as pallas_topk
  gpu_info = pallas_call_registration.gpu_info_lib
  hopper = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
  texts, options = [], []
  lower, custom_call, get_info = (lowering.lower_jaxpr_to_triton_module, mlir.custom_call,
                                  gpu_info.get_gpu_info)

  def lower_and_keep(*args, **kwargs):
    result = lower(*args, **kwargs)
    texts.append(str(result.module))
    return result

  def call_and_keep(*args, backend_config=None, **kwargs):
    if isinstance(backend_config, dict) and "num_warps" in backend_config:
      options.append({k: int(backend_config[k].value) for k in ("num_warps", "num_stages")})
      options[-1]["name"] = backend_config["name"].value
    return custom_call(*args, backend_config=backend_config, **kwargs)

  gpu_info.get_gpu_info = lambda: hopper
  lowering.lower_jaxpr_to_triton_module = lower_and_keep
  pallas_call_registration.mlir.custom_call = call_and_keep
  try:
    args = [jax.ShapeDtypeStruct((rows, positions), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.int32)]
    jax.jit(lambda x, lens: pallas_topk.topk_positions(x, lens, topk, **knobs)).trace(
        *args).lower(lowering_platforms=("cuda",))
  finally:
    gpu_info.get_gpu_info = get_info
    lowering.lower_jaxpr_to_triton_module = lower
    pallas_call_registration.mlir.custom_call = custom_call
  return {opts.pop("name"): (text, opts) for text, opts in zip(texts, options, strict=True)}


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
  """Each loop of nvdisasm -c text (a branch back to an earlier label): its instruction count and
  its opcodes (predicates and modifiers dropped), in the order the branches appear."""
  instructions, labels = [], {}
  for line in sass.splitlines():
    label = re.match(r"^\s*(\.L_x_\d+):", line)
    if label:
      labels[label.group(1)] = len(instructions)
      continue
    op = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
    if op:
      instructions.append(op.group(1))
  found = []
  for i, text in enumerate(instructions):
    back = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
    if back and labels.get(back.group(1), i + 1) <= i:
      body = instructions[labels[back.group(1)]:i + 1]
      found.append((len(body), collections.Counter(
          re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)))
  return found


def report(name: str, out: pathlib.Path) -> str:
  ptxas = (out / f"{name}.ptxas").read_text()
  sass = (out / f"{name}.sass").read_text()
  regs = re.search(r"Used (\d+) registers", ptxas)
  spills = re.search(r"(\d+) bytes spill stores", ptxas)
  total = sum(bool(re.match(r"\s+/\*[0-9a-f]{4,}\*/\s", line)) for line in sass.splitlines())
  converts = (out / f"{name}.ttgir").read_text().count("ttg.convert_layout")
  lines = [f"{name}: {regs.group(1) if regs else '?'} registers, "
           f"{spills.group(1) if spills else '?'} bytes spilled, {total} SASS instructions, "
           f"{converts} layout conversions"]
  for count, ops in loops(sass):
    lines.append(f"  loop: {count} instructions; " +
                 ", ".join(f"{op} {n}" for op, n in ops.most_common(8)))
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, default=128)
  parser.add_argument("--positions", type=int, default=131072)
  parser.add_argument("--topk", type=int, default=2048)
  parser.add_argument("--set", type=field_value, nargs="+", action="extend", default=[],
                      metavar="FIELD=VALUE",
                      help="a topk_positions keyword (TopkConfig's fields)")
  parser.add_argument("--triton", default=TRITON_PYTHON, help="a Python with pip Triton")
  parser.add_argument("--dump", help="keep the TTIR, TTGIR, PTX and SASS here")
  args = parser.parse_args()
  kernels = lower_topk(args.rows, args.positions, args.topk, dict(args.set))
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(args.dump or tmp)
    out.mkdir(parents=True, exist_ok=True)
    for name, (text, opts) in kernels.items():
      (out / f"{name}.ttir").write_text(text)
      (out / f"{name}.json").write_text(json.dumps(opts))
    subprocess.run([args.triton, "-c", _CHILD, str(out)], check=True)
    for name in kernels:
      print(report(name, out))


if __name__ == "__main__":
  sys.exit(main())
