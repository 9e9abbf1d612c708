#!/usr/bin/env bash
# The one GPU check (a few minutes): the decode-attention kernel tests compiled for the GPU instead of
# interpreted, then the attention benchmark at the issue's target shapes. Results go to $OUT (or the
# first argument, or /tmp/rq_gpu_check): kernel_tests.txt, bench_attention.{md,json,txt}.
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

# 1. Kernel tests without interpret mode (the same comparisons against the references, on the GPU).
status=0
RQ_PALLAS_INTERPRET=0 "$PY" -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$DEST/kernel_tests.txt" \
  || status=$?

# 2. The benchmark: Ouro and Huginn head shapes, batch 1 and 4, 1k / 16k / 32k context.
"$PY" scripts/bench_attention.py --batch 1 4 --context 1024 16384 32768 --repeats 5 --inner 10 \
  --json "$DEST/bench_attention.json" --markdown "$DEST/bench_attention.md" 2>&1 | tee "$DEST/bench_attention.txt"

exit "$status"
