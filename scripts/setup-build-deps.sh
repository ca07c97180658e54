#!/usr/bin/env bash
# System packages the Rust build needs: nasm and cmake build the vendored libjpeg-turbo
# (with its SIMD), the C compiler builds Oniguruma for the tokenizer. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
missing=()
for tool in nasm cmake cc pkg-config; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
pkgs=()
for tool in "${missing[@]}"; do
  case "$tool" in
    cc) pkgs+=(gcc) ;;
    *) pkgs+=("$tool") ;;
  esac
done
echo "setup: installing ${pkgs[*]}"
apt_install "${pkgs[@]}"
