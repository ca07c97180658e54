#!/usr/bin/env bash
# Installs what the tests need (idempotent, cached under ~/.cache/stoker) and runs them all:
# formatting and lints, the Rust unit and integration tests, the Python package's tests and
# the Python parity tests, Prometheus and Helm checks, the container image, and the operator
# end to end on a real control plane (scripts/cluster.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export STOKER_CACHE="${STOKER_CACHE:-$HOME/.cache/stoker}"
# Build outputs live in the cache, so a fresh clone reuses them.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$STOKER_CACHE/target}"

./scripts/setup-build-deps.sh
./scripts/setup-test-deps.sh
./scripts/setup-k8s-tools.sh

echo "== cargo fmt / clippy"
cargo fmt --all -- --check
cargo fmt --manifest-path python/Cargo.toml -- --check
cargo clippy --release --workspace --all-targets -- -D warnings
cargo clippy --release --manifest-path python/Cargo.toml -- -D warnings

echo "== cargo test"
./scripts/build.sh
cargo test --release --workspace

echo "== Python package (pip install ./python) and pytest"
# (maturin, the build backend, is in the venv; --no-build-isolation reuses it and the cache.)
PATH="$STOKER_CACHE/venv/bin:$PATH" "$STOKER_CACHE/venv/bin/pip" install -q --no-build-isolation ./python
export STOKER_BIN="$CARGO_TARGET_DIR/release/stoker"
export STOKER_TOKENIZER="$STOKER_CACHE/qwen-tokenizer"
# The checks against the model's own code (rope index, a packed forward) need torch: fail, not skip.
STOKER_REQUIRE_TORCH=1 "$STOKER_CACHE/venv/bin/python" -m pytest -q tests/parity python/tests

echo "== Prometheus: alert rules, their unit tests, the dashboard against a live pipeline"
promtool check rules charts/stoker/alerts/stoker-alerts.yaml
promtool test rules tests/prometheus/alerts_test.yaml
STOKER_REQUIRE_PROMETHEUS=1 "$STOKER_CACHE/venv/bin/python" -m pytest -q tests/observability

echo "== Helm chart: lint, template, values schema"
STOKER_HELM="$STOKER_CACHE/bin/helm" STOKER_REQUIRE_HELM=1 \
  "$STOKER_CACHE/venv/bin/python" -m pytest -q tests/chart

echo "== Image: build (podman, FROM scratch) and a worker in it serving a client outside it"
./scripts/build-image.sh
STOKER_REQUIRE_IMAGE=1 "$STOKER_CACHE/venv/bin/python" -m pytest -q tests/image

echo "== Operator end to end on a real control plane (etcd, apiserver, controllers, kwok)"
STOKER_REQUIRE_CLUSTER=1 "$STOKER_CACHE/venv/bin/python" -m pytest -q tests/k8s
