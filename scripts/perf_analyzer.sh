#!/usr/bin/env bash
# Drive the service with Triton's perf_analyzer (pip install perf-analyzer; its binary needs glibc >= 2.38),
# through the inference protocol over HTTP or gRPC, for a short bounded run, and keep its CSV.
#
#   scripts/perf_analyzer.sh [URL] [MODEL] [SIZE] [OUT_DIR] [PROTOCOL]
#   scripts/perf_analyzer.sh localhost:8000 matmul_cublas 512 out/
#   scripts/perf_analyzer.sh localhost:8001 matmul_cublas 512 out/ grpc
#
# Each request multiplies SIZE x SIZE FP32 matrices (random data, binary tensors) at concurrency 1, 5, 9
# and 13; each level is measured in windows of 300 requests until two agree within 30%, 8 windows at most.
set -euo pipefail
url=${1:-localhost:8000}
model=${2:-matmul}
size=${3:-512}
out=${4:-perf_analyzer_out}
protocol=${5:-http}
mkdir -p "$out"
exec perf_analyzer -i "$protocol" -u "$url" -m "$model" \
  --shape "A:$size,$size" --shape "B:$size,$size" \
  --concurrency-range 1:16:4 \
  --measurement-mode count_windows --measurement-request-count 300 --max-trials 8 --stability-percentage 30 \
  -f "$out/perf_analyzer_${protocol}_${model}_${size}.csv"
