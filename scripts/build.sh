#!/usr/bin/env bash
# The one build command of the project: scripts/demo.sh, scripts/test.sh and
# scripts/build-image.sh all call it, so they share one target directory and one feature set
# (cargo rebuilds every dependency for another selection of targets).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
./scripts/setup-build-deps.sh
cargo build --release --workspace --all-targets
