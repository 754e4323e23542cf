"""Where a kernel's warps wait, from Nsight Compute's per-instruction stall samples.

Profile one kernel with source counters, then export its SASS page as CSV:

    ncu --clock-control none --set full --import-source yes -k regex:mosaic_latent_decode \\
        --launch-count 1 -o prof python3 -m benchmarks.bench_decode ... --iters 1 --repeats 1
    ncu --import prof.ncu-rep --page source --csv --print-source sass > prof_src.csv
    python3 -m benchmarks.ncu_stalls prof_src.csv --top 30 --windows 1000:2100:40

A report of several launches (`--launch-count 2`) is summed launch by launch. For each it prints
the stall reasons summed over the kernel, the executed warp instructions and sampled share of
each opcode, the instructions that hold the most samples (with their top three reasons),
and optionally windows of consecutive instructions (a loop's body shows as windows whose executed
count per iteration is steady). A barrier wait shows as the branch after its try-wait, stalled on
long_sb; a wgmma wait as `WARPGROUP.DEPBAR`. Every sampled warp counts, so a warpgroup that waits
holds its share of the samples; benchmarks/RESULTS.md (session 19) reads decode and sparse
profiles this way.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def launches(text: str) -> list[tuple[str, list[dict[str, str]]]]:
  """ncu's source-page CSV -> (kernel name, one dict per instruction) for each profiled launch:
  a report of several (`--launch-count 2`) repeats a kernel-name line and the header for each."""
  table = [r for r in csv.reader(io.StringIO(text)) if r]
  starts = [i for i, r in enumerate(table) if SAMPLES in r and "Source" in r]
  if not starts:
    raise ValueError(f"no {SAMPLES!r} column: export with ncu --import REPORT --page source --csv "
                     "--print-source sass (profiled with --set full --import-source yes)")
  found = []
  for start, stop in zip(starts, starts[1:] + [len(table)]):
    header, above = table[start], table[start - 1] if start else []
    name = above[1] if len(above) > 1 and above[0] == "Kernel Name" else "?"
    found.append((name, [dict(zip(header, r)) for r in table[start + 1:stop]
                         if len(r) == len(header)]))
  return found


def _num(text: str) -> float:
  return float(text.replace(",", "") or 0)


def _opcode(source: str) -> str:
  words = source.split()
  if words and words[0].startswith("@"):  # a predicate guard
    words = words[1:]
  return words[0].split(".")[0] if words else ""


def summary(instrs: list[dict[str, str]], top: int = 30,
            windows: tuple[int, int, int] | None = None) -> str:
  """The report described in the module docstring, as text."""
  reasons = [k for k in instrs[0] if k.startswith("stall_") and "Not Issued" not in k]
  total = sum(_num(d[SAMPLES]) for d in instrs) or 1.0
  pct = lambda v: f"{100 * v / total:5.1f}%"
  by_reason = collections.Counter()
  for d in instrs:
    for r in reasons:
      by_reason[r] += _num(d[r])
  lines = [f"{total:.0f} samples"]
  lines += [f"  {r[6:]:20s} {v:9.0f} {pct(v)}" for r, v in by_reason.most_common() if v]
  executed, sampled = collections.Counter(), collections.Counter()
  for d in instrs:
    op = _opcode(d["Source"])
    executed[op] += _num(d[EXECUTED])
    sampled[op] += _num(d[SAMPLES])
  lines.append("opcode: warp instructions executed, share of samples")
  lines += [f"  {op:14s} {n:12.0f} {pct(sampled[op])}" for op, n in executed.most_common(25)]
  lines.append("instructions holding the most samples: index, share, executed, SASS, top reasons")
  heavy = sorted(range(len(instrs)), key=lambda i: -_num(instrs[i][SAMPLES]))[:top]
  for i in sorted(heavy):
    d = instrs[i]
    why = sorted(((_num(d[r]), r[6:]) for r in reasons), reverse=True)[:3]
    lines.append(f"  {i:5d} {pct(_num(d[SAMPLES]))} {_num(d[EXECUTED]):10.0f}  "
                 f"{d['Source'][:56]:56s} " + ", ".join(f"{r} {v:.0f}" for v, r in why if v))
  if windows:
    first, stop, width = windows
    lines.append(f"windows of {width} instructions: share of samples, executed, commonest opcodes")
    for a in range(first, min(stop, len(instrs)), width):
      part = instrs[a:a + width]
      ops = collections.Counter(_opcode(d["Source"]) for d in part).most_common(3)
      lines.append(f"  {a:5d} {pct(sum(_num(d[SAMPLES]) for d in part))} "
                   f"{sum(_num(d[EXECUTED]) for d in part):12.0f}  {ops}")
  return "\n".join(lines)


def _windows(text: str) -> tuple[int, int, int]:
  try:
    first, stop, width = (int(x) for x in text.split(":"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"want FIRST:STOP:WIDTH, got {text!r}") from None
  if width <= 0 or stop <= first:
    raise argparse.ArgumentTypeError(f"want FIRST < STOP and WIDTH > 0, got {text!r}")
  return first, stop, width


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.ncu_stalls", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
  parser.add_argument("--top", type=int, default=30, help="instructions listed")
  parser.add_argument("--windows", type=_windows, metavar="FIRST:STOP:WIDTH",
                      help="also sum instructions FIRST..STOP in windows of WIDTH")
  args = parser.parse_args(argv)
  with open(args.csv) as f:
    found = launches(f.read())
  for i, (name, instrs) in enumerate(found):
    if len(found) > 1:
      print(f"== launch {i}: {name}")
    print(summary(instrs, args.top, args.windows))


if __name__ == "__main__":
  sys.exit(main())
