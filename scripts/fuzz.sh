#!/usr/bin/env bash
# Fuzzes the wire decoder with libFuzzer: scripts/fuzz.sh [SECONDS] (default 60).
# Needs a nightly toolchain; installs cargo-fuzz on first use.
set -euo pipefail
cd "$(dirname "$0")/../wire"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install --locked cargo-fuzz
cargo +nightly fuzz run decode_frame -- -max_total_time="${1:-60}" -rss_limit_mb=1024
