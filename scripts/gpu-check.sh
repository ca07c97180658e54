#!/usr/bin/env bash
# The checks that need a GPU (run on a machine with torch and CUDA; CI has neither):
# the rank-side normalization on the GPU and its host→device benchmark, then a real training
# step (benches/train_step.py, a Qwen2-VL-2B-shaped model) fed by Stoker, by a DataLoader
# running transformers' processor and serially, with GPU utilisation from NVML.
# Expects .dev/stoker.xz and .dev/stoker-lab.xz (the stripped release binaries: the product and
# the lab's synthetic data), .dev/tok.tar.xz (the Qwen tokenizer
# directory `tok/`) and .dev/stoker-*.whl (the client wheel for this machine's Python).
set -euo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
xz -dkf .dev/stoker.xz .dev/stoker-lab.xz && chmod +x .dev/stoker .dev/stoker-lab
tar -C .dev -xJf .dev/tok.tar.xz
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/stoker-*.whl
cp python/stoker/*.py /tmp/site/stoker/  # the tree's Python over the wheel's (same native module)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 AWS_EC2_METADATA_DISABLED=true
export STOKER_BIN=$PWD/.dev/stoker STOKER_TOKENIZER=$PWD/.dev/tok
nvidia-smi -L
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
python3 -m pytest -q -rs -s tests/parity/test_rank_normalization.py -k torch 2>&1 | tee "$out/parity.log" || true
ds=/tmp/gpu-ds
.dev/stoker-lab synth --out $ds --samples 64 --seed 5 --max-side 1600 > /dev/null
"$STOKER_BIN" worker --data $ds --listen 127.0.0.1:7711 --metrics-listen 127.0.0.1:0 --no-auth --insecure-plaintext \
  --global-batch-size 16 --tokenizer "$STOKER_TOKENIZER" --pixel-dtype u8 > /tmp/worker.log 2>&1 &
worker=$!
trap 'kill $worker' EXIT
until grep -q '^listening' /tmp/worker.log; do sleep 0.2; done
python3 benches/rank_normalize.py gpu 127.0.0.1:7711 --batches 4 2>&1 | tee "$out/bench.log"
kill $worker; trap - EXIT
python3 benches/rank_normalize.py kernel 2>&1 | tee "$out/kernel.log"
# The workers on this machine's cores, the model on its GPU, 256 synthetic samples (up to 1000 px).
train=/tmp/gpu-train
.dev/stoker-lab synth --out $train --samples 256 --seed 6 --max-side 1000 > /dev/null
python3 benches/train_step.py --data $train --model 2b --batch 8 --steps 24 --warmup 2 \
  --loader-workers 12 --json "$out/train.json" 2>&1 | tee "$out/train.log"
