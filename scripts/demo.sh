#!/usr/bin/env bash
# The README's first command: installs what the build and the demo need (idempotent: the build's
# system packages and the real tokenizer, not the test venv), then runs `stoker-lab demo`
# (arguments are passed on). It builds into the same target directory as
# scripts/test.sh ($STOKER_CACHE/target), so the two commands share one build.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
./scripts/build.sh
./scripts/setup-tokenizer.sh
exec "$CARGO_TARGET_DIR/release/stoker-lab" demo "$@"
