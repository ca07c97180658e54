#!/usr/bin/env bash
# Installs what the tests need, idempotently, into a cache outside the repository:
#   - a Python venv with the reference stack (transformers, pillow, numpy, safetensors, pytest)
#     and maturin, which builds the `stoker` Python package; matplotlib for the dashboard picture;
#     torch for the checks against the model itself (run on the CPU here); accelerate, which the
#     Hugging Face Trainer needs (stoker.hf); megatron-core for stoker.megatron; deepspeed for its example;
#     pyarrow and datasets for the Parquet datasets
#   - prometheus and promtool (Debian package) for the observability tests
#   - the real Qwen tokenizer (scripts/setup-tokenizer.sh)
# Prints nothing but progress; safe to run repeatedly (a stamp file guards each step).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
VENV="$STOKER_CACHE/venv"
TOK="$STOKER_CACHE/qwen-tokenizer"
mkdir -p "$STOKER_CACHE"

# Pinned: the parity test compares against these exact versions.
PY_PKGS=(transformers==5.23.0 pillow==13.0.0 "numpy>=2,<2.5" safetensors jinja2 pytest "maturin>=1.5,<2" matplotlib)
STAMP="$VENV/.stoker-deps-v4"
if [ ! -f "$STAMP" ]; then
  echo "setup: creating Python venv at $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "${PY_PKGS[@]}"
  touch "$STAMP"
fi

# PyPI's torch (with its CUDA libraries: ~5 GB, about a minute here; cached with the venv).
TORCH=torch==2.15.0
if [ ! -f "$VENV/.stoker-$TORCH" ]; then
  echo "setup: installing $TORCH into the venv"
  "$VENV/bin/pip" install -q "$TORCH"
  touch "$VENV/.stoker-$TORCH"
fi

# Packages installed beside torch (pinned with them, so pip never moves torch), once per stamp:
# `with_torch STAMP PACKAGE...`.
with_torch() {
  local stamp="$VENV/.stoker-$1"
  shift
  if [ ! -f "$stamp" ]; then
    echo "setup: installing $* into the venv"
    "$VENV/bin/pip" install -q "$@" "$TORCH"
    touch "$stamp"
  fi
}

# The video reference: transformers' video processors resize with torchvision; PyAV decodes
# the clips the tests compare Stoker's decoded frames with.
with_torch video-v1 torchvision==0.29.2 av==18.1.0
# The Hugging Face Trainer's own dependency, for stoker.hf (tests/parity/test_hf_trainer.py).
with_torch trainer-v1 accelerate==1.16.0
# Megatron-Core (no Transformer Engine or Apex: its parallel state and types run on the CPU),
# whose own parallel state, context-parallel split and PackedSeqParams test stoker.megatron.
with_torch megatron-v1 megatron-core==0.16.1
# DeepSpeed, whose ZeRO-3 engine trains on Stoker's batches in tests/parity/test_deepspeed.py
# (on the CPU: its accelerator "cpu" and gloo; no ops prebuilt, one is compiled at first use).
DS_BUILD_OPS=0 with_torch deepspeed-v1 deepspeed==0.19.8
# Parquet datasets (tests/parity/test_parquet_dataset.py): pyarrow writes the shards, with the
# `datasets` library's own Image feature where it applies.
with_torch parquet-v1 pyarrow==26.0.1 datasets==5.2.0

./scripts/setup-tokenizer.sh
# Prometheus and promtool (Debian's package) for the dashboard, alert and exposition tests.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  echo "setup: installing prometheus (Debian package)"
  apt_install prometheus
fi
# Debian's ffmpeg makes the test clips (H.264, H.265, VP9, AV1).
if ! command -v ffmpeg >/dev/null; then
  echo "setup: installing ffmpeg (Debian package)"
  apt_install ffmpeg
fi
echo "setup: venv=$VENV tokenizer=$TOK prometheus=$(command -v prometheus)"
