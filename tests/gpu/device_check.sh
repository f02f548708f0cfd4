#!/usr/bin/env bash
# The GPU check, run on a bare GPU machine (torch + CUDA, Python 3.12, no network) from the project
# root with the wheels of ../shared/gpu/make-wheels.sh .whl --ray beside it:
#   bash tests/gpu/device_check.sh [OUT]
# 1. tests/gpu (no Ray; test_gpu_fsdp.py needs 2 GPUs); 2. `python -m benchmarks inner` (no Ray; JSON to
# OUT); 2b. with 2+ GPUs, `python -m jobs.bench inner --gpus-per-replica 2` (k=1 vs a replica sharded over
# 2 GPUs; JSON to OUT/sharded); 3. the whole Ray path: `python -m jobs.train` with one replica on the GPU
# over nccl. Each step has its own time limit.
set -uo pipefail
out=${1:-${OUT:-/tmp/hsgd-gpu}}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:. PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== 1. tests/gpu"; timeout 180 python3 -m pytest -q tests/gpu -s -p no:cacheprovider; echo "rc=$?"
echo "== 2. benchmarks inner"
timeout 270 python3 -m benchmarks inner --out "$out" --repeats 3; echo "rc=$?"
echo "== 2b. benchmarks inner, a replica sharded over 2 GPUs (issue 34 Acceptance 5)"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 300 python3 -m jobs.bench inner --presets small --steps 10 --repeats 3 --gpus-per-replica 2 \
    --out "$out/sharded"; echo "rc=$?"
else
  echo "skipped: fewer than 2 GPUs ($(nvidia-smi -L | wc -l))"
fi
echo "== 3. the Ray path on the GPU (1 cluster x 1 replica, nccl)"
timeout 150 python3 -m jobs.train topology.clusters=1 topology.replicas_per_cluster=1 comm.backend=nccl \
  train.rounds=3 sync.outer_every=20 logging.wandb.mode=disabled run.dir="$out/run" 2>&1 | tail -15; echo "rc=$?"
cp "$out"/run/summary.json "$out"/train_summary.json 2>/dev/null; rm -rf "$out/run"
