#!/usr/bin/env bash
# The GPU checks of issue 5, one stage per call (each fits a 10-minute command), run from the
# repo root on a CUDA machine whose python3 already has torch + triton (+ flashinfer for its
# backend); the project itself is used from the checkout (PYTHONPATH=.), not installed.
#
#   tools/gpu_checks.sh tests      # tests/gpu: backends vs torch_native, CUDA graphs, HiCache streams
#   tools/gpu_checks.sh transfer   # (a) KV transfer kernels vs pinned memcpy, Llama-3-8B KV geometry
#   tools/gpu_checks.sh ttft       # (b) 8k-token TTFT: recompute / L1 / L2 / L3, Llama-3-8B-shaped
#   tools/gpu_checks.sh multiturn  # (c) multi-turn L1 vs L1+L2 vs L1+L2+L3, small device pool
#   tools/gpu_checks.sh decode     # (d) decode throughput vs transformers generate (dummy 8B)
#
# Results (JSON, PNG, logs) go to $OUT when set (the device tool's folder), else gpu_results/.
set -uo pipefail
stage=${1:?usage: tools/gpu_checks.sh tests|transfer|ttft|multiturn|decode}
out=${OUT:-gpu_results}
mkdir -p "$out"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
$py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_checks: no CUDA device visible to $py" >&2; exit 2; }
nvidia-smi -L > "$out/device.txt" 2>&1 || true
llama=(--model tools/configs/llama3-8b --load-format dummy)

case "$stage" in
  tests)
    $py -m pytest -q -rs tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" ;;
  transfer)
    $py -m tools.bench_transfer --device cuda --geometry llama3-8b --page-sizes 1,16,64 \
      --io-backends kernel,direct --json "$out/bench_transfer_gpu.json" \
      --png "$out/bench_transfer_gpu.png" 2>&1 | tee "$out/bench_transfer_gpu.log" ;;
  ttft)
    $py -m tools.bench_multiturn --only-ttft --device cuda "${llama[@]}" \
      --ttft-prompt-len 8000 --page-size 64 --layout layer_first \
      --json "$out/bench_ttft_gpu.json" --ttft-png "$out/bench_ttft_tiers_gpu.png" 2>&1 \
      | tee "$out/bench_ttft_gpu.log" ;;
  multiturn)
    $py -m tools.bench_multiturn --no-ttft --device cuda "${llama[@]}" \
      --json "$out/bench_multiturn_gpu.json" --png "$out/bench_multiturn_gpu.png" 2>&1 \
      | tee "$out/bench_multiturn_gpu.log" ;;
  decode)
    $py -m tools.bench_offline --device cuda --dtype bfloat16 "${llama[@]}" \
      --out "$out/bench_offline_llama3_8b_gpu.json" 2>&1 | tee "$out/bench_offline_gpu.log" ;;
  *)
    echo "gpu_checks: unknown stage $stage" >&2; exit 2 ;;
esac
