"""One matmul of the demo chat model's shape (576x576 @ 576x1536, float32) on mlx's CPU backend,
side by side in one run: the BLAS the mlx[cpu] wheel bundles (the reference one) against
OpenBLAS, loaded as the test process loads it (``tests/support/paths.py::use_openblas``).
Each in a fresh process; prints ms per matmul and the ratio (docs/ci.md).

    PYTHONPATH=$PWD python bench/blas_matmul.py [--reps 50]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

TIMED = """
import sys, time
if sys.argv[1] != "-":
    import ctypes, os
    ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)   # before mlx: its BLAS calls resolve here
import mlx.core as mx
a, b = mx.random.normal((576, 576)), mx.random.normal((576, 1536))
mx.eval(a @ b)
start = time.perf_counter()
for _ in range(int(sys.argv[2])):
    mx.eval(a @ b)
print((time.perf_counter() - start) / int(sys.argv[2]) * 1e3)
"""


def main() -> None:
    from tests.support.paths import openblas

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    reps = str(parser.parse_args().reps)
    blas = openblas()
    if blas is None:
        sys.exit("no OpenBLAS installed here (Debian: libopenblas0-pthread)")
    ms = {name: float(subprocess.run([sys.executable, "-c", TIMED, lib, reps], check=True,
                                     capture_output=True, text=True).stdout)
          for name, lib in (("bundled reference BLAS", "-"), (f"OpenBLAS ({blas})", blas))}
    for name, value in ms.items():
        print(f"{name}: {value:.1f} ms per matmul")
    reference, fast = ms.values()
    print(f"ratio: {reference / fast:.0f}x")


if __name__ == "__main__":
    main()
