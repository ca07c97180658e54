#!/usr/bin/env bash
# System packages the Rust build needs: nasm and cmake build the vendored libjpeg-turbo
# (with its SIMD), the C compiler builds Oniguruma for the tokenizer, FFmpeg's libav* (Debian's
# 5.1, with their headers) decode video and clang's libclang lets ffmpeg-sys-next bind them.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
missing=()
for tool in nasm cmake cc pkg-config; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
pkgs=()
if ! pkg-config --exists libavcodec libavformat libavutil libswscale 2>/dev/null; then
  pkgs+=(libavcodec-dev libavformat-dev libavutil-dev libswscale-dev)
fi
# libclang itself (bindgen loads libclang.so or libclang-N.so): libclang-cpp, which other
# packages bring, is not it. Any one of the places will do.
have_libclang() {
  local f
  for f in /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang-[0-9]*.so* \
    /usr/lib/x86_64-linux-gnu/libclang.so*; do
    [ -e "$f" ] && return 0
  done
  return 1
}
have_libclang || pkgs+=(libclang-dev clang)
[ ${#missing[@]} -eq 0 ] && [ ${#pkgs[@]} -eq 0 ] && exit 0
for tool in "${missing[@]}"; do
  case "$tool" in
    cc) pkgs+=(gcc) ;;
    *) pkgs+=("$tool") ;;
  esac
done
echo "setup: installing ${pkgs[*]}"
apt_install "${pkgs[@]}"
