"""Cost of the KV disk tier's model fingerprint (``kv_fingerprint``), side by side in one run:

    python bench/kv_fingerprint.py [--model DIR] [--synthetic-gib 2] [--repeat 3]

For a model folder (default: the demo chat model, SmolLM2-135M-Instruct float32, if it is in
the cache folder) and a synthetic weight folder of ``--synthetic-gib`` GiB of random bytes:

  sampled       what the tier did before: config.json, and per weight file its header-sized
                start, middle and end (3 x 1 MiB) -- it missed in-place changes elsewhere
  read only     every byte read, nothing hashed (what the storage costs)
  full, cold    every byte read and hashed (xxh3_128): the first start after a change
  full, memo    the memo's stat check only: every later start

The files are in the page cache after the first read (the machine's memory holds them), so
"read only" is memory bandwidth, not a disk's: on a cold NVMe read the full hash runs at the
disk's speed instead (the figures in docs/reliability.md say which). Medians of ``--repeat``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_adapter.mlx_engine.kv.fingerprint import (  # noqa: E402
    CHUNK_BYTES,
    folder_fingerprint,
    weight_files,
)


def sampled(folder: Path, sample_bytes: int = 1 << 20) -> str:
    """The previous fingerprint: three samples per weight file."""
    h = xxhash.xxh3_128()
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for weights in weight_files(folder):
        size = weights.stat().st_size
        with open(weights, "rb") as fh:
            for at in (0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)):
                fh.seek(at)
                h.update(fh.read(sample_bytes))
    return h.hexdigest()


def read_only(folder: Path) -> int:
    total = 0
    for weights in weight_files(folder):
        with open(weights, "rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                total += len(chunk)
    return total


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, folder: Path, repeat: int, work: Path) -> None:
    size = sum(w.stat().st_size for w in weight_files(folder))
    gib = size / (1 << 30)
    memo = work / f"{name}.memo.json"

    def cold() -> None:
        memo.unlink(missing_ok=True)
        folder_fingerprint(folder, memo)

    read_only(folder)   # into the page cache, as every row then sees it
    rows = [("sampled (before)", median_s(lambda: sampled(folder), repeat)),
            ("read only", median_s(lambda: read_only(folder), repeat)),
            ("full, cold (memo miss)", median_s(cold, repeat))]
    folder_fingerprint(folder, memo)
    rows.append(("full, memo hit", median_s(lambda: folder_fingerprint(folder, memo), repeat)))
    print(f"\n{name}: {gib:.2f} GiB of weights")
    print("| fingerprint | seconds | GiB/s | 30 GiB at this rate |")
    print("|---|---:|---:|---:|")
    for label, s in rows:
        rate = gib / s if s > 0 else float("inf")
        eta = f"{30 / rate:.1f} s" if label.startswith(("read", "full, cold")) else "-"
        print(f"| {label} | {s:.4f} | {rate:,.1f} | {eta} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from prefix_cache.model_folders.demo import cache_home

    parser.add_argument("--model", type=Path,
                        default=cache_home() / "smollm2-135m-instruct")
    parser.add_argument("--synthetic-gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="kv-fingerprint-") as tmp:
        work = Path(tmp)
        if any(weight_files(args.model)):
            measure(args.model.name, args.model, args.repeat, work)
        synthetic = work / "synthetic"
        synthetic.mkdir()
        with open(synthetic / "model.safetensors", "wb") as fh:
            block = os.urandom(64 << 20)
            for _ in range(int(args.synthetic_gib * 16)):
                fh.write(block)
        measure(f"synthetic {args.synthetic_gib:g} GiB", synthetic, args.repeat, work)


if __name__ == "__main__":
    main()
