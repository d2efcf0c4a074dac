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
# Each level runs in a perf_analyzer of its own: perf_analyzer keeps a copy of every request's inputs and outputs
# until it exits (3 MiB a request at 512^2), which at the 8 HTTP workers' rate filled 121 GiB before the last level.
set -euo pipefail
url=${1:-localhost:8000}
model=${2:-matmul}
size=${3:-512}
out=${4:-perf_analyzer_out}
protocol=${5:-http}
mkdir -p "$out"
csv="$out/perf_analyzer_${protocol}_${model}_${size}.csv"
rm -f "$csv"
for concurrency in 1 5 9 13; do
  perf_analyzer -i "$protocol" -u "$url" -m "$model" \
    --shape "A:$size,$size" --shape "B:$size,$size" \
    --concurrency-range "$concurrency:$concurrency" \
    --measurement-mode count_windows --measurement-request-count 300 --max-trials 8 --stability-percentage 30 \
    -f "$out/level.csv"
  if [ -f "$csv" ]; then tail -n +2 "$out/level.csv" >> "$csv"; else cp "$out/level.csv" "$csv"; fi
done
rm -f "$out/level.csv"
