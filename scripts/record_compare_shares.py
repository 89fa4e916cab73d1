#!/usr/bin/env python3
"""CPU shares per function from a ferroprof pprof file and from `perf script`, on common ground.

Used by scripts/record_compare.sh. The programs compared (xz, grep) are stripped: each tool
names code without a symbol its own way. So both are brought to the same identity: the leaf
address is turned into (object file, address in the object), and that into the function
containing it according to the object's .eh_frame (present in stripped objects), named after
an exported symbol starting there when there is one. Kernel samples of perf (ferroprof only sees
user stacks; its time in a system call lands on the libc wrapper) form one "[kernel]" row.

    record_compare_shares.py ferroprof PROFILE.pprof
    record_compare_shares.py perf PERF_SCRIPT_OUTPUT
    record_compare_shares.py perf-callers PERF_SCRIPT_G_OUTPUT
    record_compare_shares.py perf-kernel PERF_SCRIPT_G_OUTPUT
prints "share<TAB>function" lines, largest first. `perf-callers` reads `perf script -F ip,dso`
of a `perf record -g` run and books a sample taken in the kernel to the first user frame of
its chain, the code that entered the kernel (a system call, a page fault): what ferroprof's
CPU-time timer, whose signal arrives on the way back to user mode, charges. `perf-kernel` reads
the same output with kernel samples as one row.
    record_compare_shares.py compare A.txt B.txt [N]
prints the top-N functions of A with both shares and the difference in percentage points.
    record_compare_shares.py mean A.txt B.txt...
prints the mean share of each function over the files (0 where a file lacks it): a program's
shares move between runs (ripgrep's top function by about 5 points under perf alone).
"""
import bisect
import gzip
import os
import re
import subprocess
import sys
from collections import defaultdict

_fdes = {}
_loads = {}
_names = {}


def fdes(path):
    if path not in _fdes:
        out = subprocess.run(["readelf", "--debug-dump=frames", path],
                             capture_output=True, text=True).stdout
        spans = sorted({(int(a, 16), int(b, 16))
                        for a, b in re.findall(r"FDE cie=\w+ pc=([0-9a-f]+)\.\.([0-9a-f]+)", out)})
        _fdes[path] = spans
    return _fdes[path]


def loads(path):
    if path not in _loads:
        out = subprocess.run(["readelf", "-lW", path], capture_output=True, text=True).stdout
        segs = []
        for m in re.finditer(r"LOAD\s+0x([0-9a-f]+)\s+0x([0-9a-f]+)\s+0x[0-9a-f]+\s+0x([0-9a-f]+)", out):
            segs.append((int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)))
        _loads[path] = segs
    return _loads[path]


def names(path):
    if path not in _names:
        out = subprocess.run(["nm", "-D", "--defined-only", path],
                             capture_output=True, text=True).stdout
        d = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TtWi":
                d.setdefault(int(parts[0], 16), parts[2])
        _names[path] = d
    return _names[path]


def function_of(path, file_offset):
    vaddr = None
    for off, va, size in loads(path):
        if off <= file_offset < off + size:
            vaddr = file_offset - off + va
    # perf names objects by their real path, the loader by the name asked for (a symlink).
    base = os.path.realpath(path).rsplit("/", 1)[-1]
    if vaddr is None:
        return f"{base}:?"
    spans = fdes(path)
    i = bisect.bisect_right(spans, (vaddr, float("inf"))) - 1
    if i >= 0 and spans[i][0] <= vaddr < spans[i][1]:
        start = spans[i][0]
        name = names(path).get(start)
        return f"{base}:{name}" if name else f"{base}:fn@{start:#x}"
    return f"{base}:?"


# --- a small pprof reader (protobuf wire format) ---
def varint(b, i):
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def fields(b):
    i = 0
    while i < len(b):
        key, i = varint(b, i)
        f, wt = key >> 3, key & 7
        if wt == 0:
            v, i = varint(b, i)
        elif wt == 2:
            n, i = varint(b, i)
            v = b[i:i + n]
            i += n
        elif wt == 1:
            v = int.from_bytes(b[i:i + 8], "little")
            i += 8
        elif wt == 5:
            v = int.from_bytes(b[i:i + 4], "little")
            i += 4
        else:
            raise ValueError("wire type")
        yield f, wt, v


def ints(wt, v):
    if wt == 0:
        return [v]
    out, i = [], 0
    while i < len(v):
        x, i = varint(v, i)
        out.append(x)
    return out


def signed(x):
    return x - (1 << 64) if x >= 1 << 63 else x


def ferroprof_shares(path):
    raw = open(path, "rb").read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    strings, types, samples, mappings, locations = [], [], [], {}, {}
    for f, wt, v in fields(raw):
        if f == 6:
            strings.append(v.decode("utf-8", "replace"))
        elif f == 1:
            t = dict((g, x) for g, _, x in fields(v))
            types.append(t.get(1, 0))
        elif f == 2:
            locs, vals = [], []
            for g, w, x in fields(v):
                if g == 1:
                    locs += ints(w, x)
                elif g == 2:
                    vals += [signed(y) for y in ints(w, x)]
            samples.append((locs, vals))
        elif f == 3:
            m = dict((g, x) for g, _, x in fields(v))
            mappings[m.get(1, 0)] = m
        elif f == 4:
            m = dict((g, x) for g, _, x in fields(v) if g in (1, 2, 3))
            locations[m.get(1, 0)] = m
    idx = [strings[t] for t in types].index("cpu-time")
    by_fn = defaultdict(int)
    for locs, vals in samples:
        if not locs or vals[idx] <= 0:
            continue
        loc = locations[locs[0]]
        m = mappings.get(loc.get(2, 0))
        if not m:
            by_fn["?"] += vals[idx]
            continue
        fname = strings[m.get(5, 0)]
        # pprof addresses are leaf PCs (the sampled instruction).
        off = loc.get(3, 0) - m.get(2, 0) + m.get(4, 0)
        by_fn[function_of(fname, off)] += vals[idx]
    return by_fn


def ip_dso(line):
    """(ip, dso) of a `perf script -F ip,dso` line, or None."""
    parts = line.split(None, 1)
    if len(parts) != 2:
        return None
    try:
        return int(parts[0], 16), parts[1].strip().strip("()")
    except ValueError:
        return None


def perf_shares(path):
    maps = []  # (start, end, pgoff, file)
    by_fn = defaultdict(int)
    mm = re.compile(r"\[(0x[0-9a-f]+)\((0x[0-9a-f]+)\) @ (0x[0-9a-f]+|\d+)[^\]]*\]: \S+ (\S+)")
    for line in open(path, errors="replace"):
        if "PERF_RECORD_MMAP" in line:
            m = mm.search(line)
            if m:
                start, size = int(m.group(1), 16), int(m.group(2), 16)
                pg = m.group(3)
                pgoff = int(pg, 16) if pg.startswith("0x") else int(pg)
                maps.append((start, start + size, pgoff, m.group(4)))
            continue
        frame = ip_dso(line)
        if frame is None:
            continue
        ip, dso = frame
        if dso.startswith("[kernel") or ip >= 0xFFFF800000000000:
            by_fn["[kernel]"] += 1
            continue
        hit = None
        for start, end, pgoff, f in reversed(maps):
            if start <= ip < end:
                hit = (f, ip - start + pgoff)
                break
        by_fn[function_of(*hit) if hit else f"{dso}:?"] += 1
    return by_fn


def perf_chain_shares(path, kernel_to_caller):
    """Blocks of `perf script -F ip,dso` with call chains: one line per frame, leaf first; user
    frames are printed relative to their object (file offsets)."""
    by_fn = defaultdict(int)
    for block in open(path, errors="replace").read().split("\n\n"):
        frames = [f for f in map(ip_dso, block.splitlines()) if f is not None]
        if not frames:
            continue
        kernel = [d.startswith("[kernel") for _, d in frames]
        if kernel[0] and not kernel_to_caller:
            by_fn["[kernel]"] += 1
            continue
        user = [(ip, d) for (ip, d), k in zip(frames, kernel) if not k]
        if not user or user[0][1] == "[unknown]":
            by_fn["[kernel]" if kernel[0] else "?"] += 1
            continue
        ip, dso = user[0]
        by_fn[function_of(dso, ip)] += 1
    return by_fn


def write_shares(by_fn):
    total = sum(by_fn.values()) or 1
    for fn, v in sorted(by_fn.items(), key=lambda kv: -kv[1]):
        print(f"{100.0 * v / total:.2f}\t{fn}")


def read_shares(path):
    d = {}
    for line in open(path):
        share, fn = line.rstrip("\n").split("\t", 1)
        d[fn] = float(share)
    return d


def mean(paths):
    runs = [read_shares(p) for p in paths]
    fns = set().union(*runs)
    by_fn = {fn: sum(r.get(fn, 0.0) for r in runs) / len(runs) for fn in fns}
    for fn, v in sorted(by_fn.items(), key=lambda kv: -kv[1]):
        print(f"{v:.2f}\t{fn}")


def compare(a_path, b_path, n):
    a, b = read_shares(a_path), read_shares(b_path)
    top = sorted(a, key=lambda k: -a[k])[:n]
    worst = 0.0
    print(f"{'perf %':>8} {'ferroprof %':>12} {'diff pp':>8}  function")
    for fn in top:
        d = b.get(fn, 0.0) - a[fn]
        worst = max(worst, abs(d))
        print(f"{a[fn]:8.2f} {b.get(fn, 0.0):12.2f} {d:+8.2f}  {fn}")
    print(f"largest difference over the top {len(top)}: {worst:.2f} percentage points")


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "ferroprof":
        write_shares(ferroprof_shares(sys.argv[2]))
    elif kind == "perf":
        write_shares(perf_shares(sys.argv[2]))
    elif kind in ("perf-callers", "perf-kernel"):
        write_shares(perf_chain_shares(sys.argv[2], kind == "perf-callers"))
    elif kind == "mean":
        mean(sys.argv[2:])
    elif kind == "compare":
        compare(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 10)
    else:
        sys.exit(__doc__)
