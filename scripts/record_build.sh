#!/usr/bin/env bash
# `ferroprof record -- make -j2` over 24 small C files (issue 41's build case): the CPU time in
# all the profiles against the children's CPU time (getrusage(RUSAGE_CHILDREN) of the process
# `record` runs, which starts make), and against the same build run without ferroprof.
#
#   scripts/record_build.sh [RUNS]        (default 3; needs a release build, gcc, make, python3)
#
# The profiles hold every CPU nanosecond of the build's processes up to the symbolizing of their
# last profile, the profiler's own threads' under [ferroprof]; the children's CPU time also has
# what follows (encoding and writing that profile, the processes' exits).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
bin=$PWD/target/release/ferroprof
[ -x "$bin" ] || { echo "build first: cargo build --release" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=$work/src
mkdir -p "$src"
for i in $(seq 1 24); do
  cat > "$src/f$i.c" <<C
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
struct s$i { int a[$((i * 3))]; double d; char name[32]; };
static int cmp$i(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }
int work$i(int n) {
    struct s$i x; memset(&x, 0, sizeof x);
    int v[64]; for (int k = 0; k < 64; k++) v[k] = (k * $i) % 17;
    qsort(v, 64, sizeof v[0], cmp$i);
    for (int k = 0; k < n; k++) x.a[k % $((i * 3))] += v[k % 64];
    snprintf(x.name, sizeof x.name, "f%d", n);
    return x.a[0] + (int)strlen(x.name);
}
C
done
printf 'OBJS := $(patsubst %%.c,%%.o,$(wildcard f*.c))\nall: $(OBJS)\n%%.o: %%.c\n\tcc -O2 -c $< -o $@\n' > "$src/Makefile"
cat > "$work/root.py" <<'PY'
import resource, subprocess, sys
subprocess.run(["make", "-s", "-j2", "-C", sys.argv[2]], check=True)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write(str(r.ru_utime + r.ru_stime))
PY
# The interpreter itself (a version manager's shim would add its own shell processes).
python=$(python3 -c "import sys; print(sys.executable)")
for r in $(seq 1 "$runs"); do
  rm -f "$src"/*.o
  "$python" "$work/root.py" "$work/plain" "$src"
  rm -f "$src"/*.o
  rm -rf "$work/prof"
  "$bin" record -o "$work/prof" -- "$python" "$work/root.py" "$work/truth" "$src" > /dev/null 2>&1
  root=$(ls "$work/prof" | sed -n 's/^python3[.0-9]*\.\([0-9]*\)\.[0-9]*\.pprof$/\1/p' | head -1)
  total=0
  for f in "$work"/prof/*.pprof; do
    case $(basename "$f") in python3*".$root."*) continue ;; esac
    ns=$("$bin" top "$f" --type cpu-time 2>/dev/null | head -1 | sed -n 's/.*total \([0-9.]*\)\(ns\|µs\|ms\|s\) .*/\1 \2/p')
    total=$(python3 -c "import sys; v,u=sys.argv[1].split() if sys.argv[1] else ('0','ns'); print($total + float(v)*{'ns':1e-9,'µs':1e-6,'ms':1e-3,'s':1}[u])" "$ns")
  done
  python3 - "$work/plain" "$work/truth" "$total" "$r" <<'PY'
import sys
plain, truth, total, r = float(open(sys.argv[1]).read()), float(open(sys.argv[2]).read()), float(sys.argv[3]), sys.argv[4]
print(f"run {r}: unprofiled build {plain:.3f} s; profiled children {truth:.3f} s; in the profiles {total:.3f} s"
      f" = {total / truth:.1%} of the children's CPU, {total / plain:.1%} of the unprofiled build's")
PY
done
