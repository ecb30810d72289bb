# Sourced by the bench scripts: on Linux, mlx's CPU build is much faster with Debian's OpenBLAS
# preloaded (float32 matmul ~36x on 2 cores); each report's machine line says whether it was.
if [ "$(uname -s)" = Linux ] && [ -z "${LD_PRELOAD:-}" ]; then
  blas=$(ldconfig -p 2>/dev/null | awk '/libopenblas\.so\.0 .*x86-64/ {print $NF; exit}')
  [ -n "$blas" ] && export LD_PRELOAD="$blas"
fi
