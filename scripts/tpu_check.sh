#!/usr/bin/env bash
# The one TPU check, for a machine with a TPU (as scripts/gpu_check.sh is for a GPU): the TPU kernel tests
# (attention and the decode token's store) run compiled on the chip instead of interpreted, the decode benchmark timed on it at Ouro-1.4B and
# Huginn-0125 shapes (the Mosaic kernels through the decode-attention op's "auto"), and the compile report
# of the TPU test subset for this generation. Results go to $OUT (or the first argument, or /tmp/rq_tpu_check):
# kernel_tests.txt, bench_decode.{md,json,txt}, kernel_report.{md,json,txt}.
#
#     bash scripts/tpu_check.sh [OUT_DIR]
#
# Uses $PYTHON (default python3, with jax[tpu] installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${1:-${OUT:-/tmp/rq_tpu_check}}"
mkdir -p "$DEST"

GEN=$("$PY" - <<'PYEOF'
import jax
print("jax", jax.__version__, jax.devices(), file=__import__("sys").stderr)
assert jax.default_backend() == "tpu", "tpu_check.sh needs a TPU"
kind = jax.devices()[0].device_kind.lower()  # e.g. "tpu v5 lite", "tpu v6 lite", "tpu v5p", "tpu v4"
print({"tpu v5 lite": "v5e", "tpu v6 lite": "v6e", "tpu v5p": "v5p", "tpu v5": "v5p", "tpu v4": "v4"}.get(kind, "v5e"))
PYEOF
)

# 1. The TPU kernels against their references, compiled (RQ_PALLAS_INTERPRET=0), and the op's dispatch.
status=0
RQ_PALLAS_INTERPRET=0 "$PY" -m pytest tests/kernels/test_tpu_attention.py tests/kernels/test_tpu_residual_attention.py \
  tests/kernels/test_tpu_write.py tests/cache/test_attention_op.py -p no:cacheprovider 2>&1 | tee "$DEST/kernel_tests.txt" || status=$?

# 2. The decode benchmark, timed: both models as released, 4k and 16k, batch 1 and the largest in the chip's HBM,
#    and the serving engine's decode and 256-token prompt programs over a pool holding that batch (compiled).
HBM=$("$PY" -c "from pallas_kernels.tpu_deviceless import HBM_GIB; print(HBM_GIB['$GEN'])")
"$PY" scripts/bench_decode.py --models ouro-1.4b huginn-0125 --context 4096 16384 --batch 1 --memory-gb "$HBM" \
  --engine-chunk 256 --out "$DEST/bench_decode" 2>&1 | tee "$DEST/bench_decode.txt" || status=$?

# 3. The compile report of the TPU subset for this chip's generation (VMEM, code size; informational).
"$PY" scripts/kernel_report.py --tpu "$GEN" --ci-subset \
  --json "$DEST/kernel_report.json" --markdown "$DEST/kernel_report.md" 2>&1 | tee "$DEST/kernel_report.txt" || true

exit "$status"
