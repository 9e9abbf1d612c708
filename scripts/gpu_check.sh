#!/usr/bin/env bash
# The one GPU check (a few minutes): the decode-attention kernel tests compiled for the GPU instead of
# interpreted, then the attention benchmark at the issue's target shapes. Results go to $OUT (or the
# first argument, or /tmp/rq_gpu_check): kernel_tests.txt, bench_attention.{md,json,txt}, and, when the
# pinned pip `triton` wheel is importable, kernel_report.{md,json,txt} (the deviceless compile report of
# the tests' configuration subset, to set beside what this GPU ran).
#
#     bash scripts/gpu_check.sh [OUT_DIR]
#
# Uses $PYTHON (default python3: on the device machine, the image's Python with jax[cuda]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${1:-${OUT:-/tmp/rq_gpu_check}}"
mkdir -p "$DEST"

"$PY" - <<'PYEOF'
import jax
print("jax", jax.__version__, jax.devices())
assert jax.default_backend() == "gpu", "gpu_check.sh needs a GPU"
PYEOF

has_triton=0
"$PY" -c "import triton.backends.nvidia.compiler" 2>/dev/null && has_triton=1

# 1. Kernel tests without interpret mode (the same comparisons against the references, on the GPU). The
#    deviceless compile tests need the pip triton wheel; without it they are left out here (CI runs them).
#    The image has no beartype, so pyproject's addopts (the suite's shape checker) give way to their rest.
status=0
ignore=()
[ "$has_triton" = 1 ] || ignore=(--ignore tests/kernels/test_compile.py)
RQ_PALLAS_INTERPRET=0 "$PY" -m pytest tests/kernels -o addopts="-q -p no:benchmark" -p no:cacheprovider "${ignore[@]}" 2>&1 \
  | tee "$DEST/kernel_tests.txt" || status=$?

# 2. The benchmark: Ouro and Huginn head shapes, batch 1 and 4, 1k / 16k / 32k context.
"$PY" scripts/bench_attention.py --batch 1 4 --context 1024 16384 32768 --repeats 5 --inner 10 \
  --json "$DEST/bench_attention.json" --markdown "$DEST/bench_attention.md" 2>&1 | tee "$DEST/bench_attention.txt"

# 3. The deviceless resource report of the tests' subset (registers, spills, shared memory). Informational:
#    the compile tests above gate spills.
if [ "$has_triton" = 1 ]; then
  "$PY" scripts/kernel_report.py --ci-subset \
    --json "$DEST/kernel_report.json" --markdown "$DEST/kernel_report.md" 2>&1 | tee "$DEST/kernel_report.txt" \
    || true
fi

exit "$status"
