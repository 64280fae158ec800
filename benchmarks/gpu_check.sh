#!/usr/bin/env bash
# The checks that need a GPU, as one short script (a few minutes on one GPU).
#   bash benchmarks/gpu_check.sh              # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --device cpu # dry run of the same steps on the CPU
# 1. the CUDA tests (they skip without a GPU); 2. the default MNIST run (100 rounds) on the device,
# timed, in fp32, bf16 and fp16 (--precision); 3. one round of FedProto on CIFAR-10 with ResNet18
# (20 clients) on the device, timed, in fp32 and bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE="$2"; fi
: "${FEDPROTO_DATA:=../shared/data}"
export FEDPROTO_DATA
OUT=${OUT:-/tmp/fedproto-gpu-check}
mkdir -p "$OUT"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
python -m pytest -q -p no:cacheprovider tests/training/test_devices.py tests/training/test_precision.py -rs
RUNS=("--dataset mnist" "--dataset mnist --precision bf16")
# fp16 trains on CUDA GPUs only (a CPU dry run would be refused)
if [ "$DEVICE" != cpu ]; then RUNS+=("--dataset mnist --precision fp16"); fi
RUNS+=("--dataset cifar10 --model resnet18 --rounds 1" "--dataset cifar10 --model resnet18 --rounds 1 --precision bf16")
i=0
for what in "${RUNS[@]}"; do
  i=$((i + 1))
  start=$SECONDS
  fedproto run $what --device "$DEVICE" --out-dir "$OUT" --name "check-$DEVICE-$i" -q
  echo "fedproto run $what --device $DEVICE: $((SECONDS - start)) s (summary: $OUT/check-$DEVICE-$i/summary.json)"
done
