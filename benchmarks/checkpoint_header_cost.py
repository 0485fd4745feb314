"""CPU time and peak memory of reading a checkpoint with a 150k-entry header: fp8ref's reader
(``checkpoint._Reader`` and every tensor, what ``load_fp8_dynamic`` reads) against safetensors'
``load_file`` (memory-mapped) and ``load`` (from bytes).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/checkpoint_header_cost.py [entries] [rounds]

Each measurement runs in a fresh interpreter, the three readers alternating round by round. CPU
time is ``time.process_time`` around the read; ``rss`` is the rise of the peak resident set
(``VmHWM``) over the resident set before the read; ``py`` is tracemalloc's peak (Python's own
allocations only: torch storage is not traced), in a separate run so its cost stays out of the
time. On a shared machine compare the CPU time ratios of one run, not absolute figures.
"""

import json
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import sys, time, tracemalloc
mode, reader, path = sys.argv[1:4]
import torch, safetensors, safetensors.torch
from fp8ref import checkpoint

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

def read():
    if reader == "fp8ref":
        with checkpoint._Reader(checkpoint.Path(path)) as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    if reader == "load_file":
        return safetensors.torch.load_file(path)
    with open(path, "rb") as fh:
        return safetensors.torch.load(fh.read())

if mode == "py":
    tracemalloc.start()
    out = read()
    print(tracemalloc.get_traced_memory()[1])
else:
    rss0 = status("VmRSS")
    t = time.process_time()
    out = read()
    cpu = time.process_time() - t
    print(cpu, status("VmHWM") - rss0)
assert len(out) > 0
"""


def make(path: Path, entries: int) -> None:
    header = {f"model.layers.{i // 7}.mlp.proj{i % 7}.weight": {"dtype": "F32", "shape": [1],
                                                              "data_offsets": [4 * i, 4 * i + 4]}
              for i in range(entries)}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * entries))


def main() -> None:
    entries = int(sys.argv[1]) if len(sys.argv) > 1 else 150_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    readers = ("fp8ref", "load_file", "load")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.safetensors"
        make(path, entries)
        cpu = {r: [] for r in readers}
        rss = {r: [] for r in readers}
        py = {r: [] for r in readers}
        for _ in range(rounds):
            for r in readers:
                out = subprocess.run([sys.executable, "-c", CHILD, "time", r, str(path)], check=True,
                                     capture_output=True, text=True).stdout.split()
                cpu[r].append(float(out[0]))
                rss[r].append(int(out[1]))
                out = subprocess.run([sys.executable, "-c", CHILD, "py", r, str(path)], check=True,
                                     capture_output=True, text=True).stdout.split()
                py[r].append(int(out[0]))
        print(f"{entries} entries, header {path.stat().st_size / 2**20:.1f} MiB, {rounds} rounds (medians)")
        base = "load_file"
        for r in readers:
            c, m, p = (statistics.median(v[r]) for v in (cpu, rss, py))
            cb, mb, pb = (statistics.median(v[base]) for v in (cpu, rss, py))
            print(f"{r:10} cpu {c:.3f} s ({c / cb:.2f}x)  rss +{m / 2**20:.0f} MiB ({m / mb:.2f}x)  "
                  f"py peak {p / 2**20:.0f} MiB ({p / pb:.2f}x)")


if __name__ == "__main__":
    main()
