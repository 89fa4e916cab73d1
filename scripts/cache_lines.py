#!/usr/bin/env python3
"""Cache lines a sampled allocation misses, from callgrind runs with --cache-sim=yes.

    cache_lines.py BASE.out UNSAMPLED.out SAMPLED.out SAMPLES

BASE is the workload without the profiler, UNSAMPLED the profiler at an interval never reached,
SAMPLED the profiler at its interval with SAMPLES samples taken. The difference SAMPLED minus
UNSAMPLED in the profiler's own code (functions that do not run in BASE), divided by SAMPLES,
is the lines a sample finds cold. Prints it and the largest profiler functions.

The workload's own misses are left out: callgrind runs the threads on one simulated cache,
interleaved as timing falls, and two identical runs differ by some 5% of the workload's
misses, more than every sample's share together (the lines a sample evicts).
"""
import collections
import re
import subprocess
import sys

EVENTS = ["D1mr", "D1mw", "DLmr", "DLmw"]


def load(path):
    """Self misses per function name (the file prefix dropped, inlined parts summed)."""
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--show=" + ",".join(EVENTS),
         "--threshold=100", "--auto=no", path],
        capture_output=True, text=True, check=True).stdout
    lines = out[out.index("file:function"):].splitlines()[2:]
    num = r"([\d,]+|\.)(?:\s+\([^)]*\))?\s+"
    row = re.compile(r"\s*((?:" + num + "){%d})(.*)" % len(EVENTS))
    per = collections.defaultdict(lambda: [0] * len(EVENTS))
    for line in lines:
        m = row.match(line)
        if not m:
            continue
        vals = [0 if v == "." else int(v.replace(",", "")) for v in re.findall(num, m.group(1))]
        name = m.groups()[-1]
        name = name.split(":", 1)[1] if ":" in name else name
        name = name.split(" [")[0]
        per[name] = [a + b for a, b in zip(per[name], vals)]
    return per


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    base, unsampled, sampled = (load(p) for p in sys.argv[1:4])
    samples = int(sys.argv[4])
    if samples <= 0:
        sys.exit("no samples were taken: nothing to divide by")
    split = {"profiler": [0] * len(EVENTS)}
    prof = {}
    for name in set(unsampled) | set(sampled):
        d = [a - b for a, b in zip(sampled.get(name, [0] * 4), unsampled.get(name, [0] * 4))]
        if name in base:
            continue
        split["profiler"] = [a + b for a, b in zip(split["profiler"], d)]
        prof[name] = d

    def cells(v):
        l1, ll = v[0] + v[1], v[2] + v[3]
        return "| %.0f | %.0f |" % (l1 / samples, ll / samples)

    print("| misses per sample, in the profiler's code | first-level (32 KiB) | last-level (512 KiB) |")
    print("|---|---:|---:|")
    print("| reads and writes " + cells(split["profiler"]))
    print()
    print("Largest in the profiler's code, last-level misses per sample (reads + writes):")
    print()
    top = sorted(prof.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))[:8]
    for name, d in top:
        print("- %.1f  %s" % ((d[2] + d[3]) / samples, name[:110]))


main()
