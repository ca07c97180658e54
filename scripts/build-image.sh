#!/usr/bin/env bash
# Builds the Stoker image without a Docker engine or a base image: a root filesystem of the
# release `stoker` binary (stripped), the shared libraries it links (from ldd), the dynamic
# loader, CA certificates and a non-root user (65532), put in an image FROM scratch by podman
# and saved as an OCI archive. Prints the archive's path and the image's size.
#
#   scripts/build-image.sh [TAG]     default TAG: ghcr.io/stoker-dev/stoker:<crate version>
#
# Output: $STOKER_CACHE/image/stoker.oci.tar (load it with `podman load -i`, push it with
# `skopeo copy oci-archive:… docker://REGISTRY/…`, or `kind load image-archive`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
TAG="${1:-ghcr.io/stoker-dev/stoker:$VERSION}"
OUT="$STOKER_CACHE/image"
. scripts/podman-env.sh

./scripts/build.sh
BINARY="$CARGO_TARGET_DIR/release/stoker"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
ROOT="$WORK/rootfs"
mkdir -p "$ROOT/usr/local/bin" "$ROOT/etc/ssl/certs" "$ROOT/tmp"
chmod 1777 "$ROOT/tmp"
strip -o "$ROOT/usr/local/bin/stoker" "$BINARY"
# Every shared library the binary loads, at the path the loader looks for it.
for lib in $(ldd "$BINARY" | grep -o '/[^ ]*'); do
  mkdir -p "$ROOT$(dirname "$lib")"
  cp -L "$lib" "$ROOT$lib"
done
cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/"
echo 'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$ROOT/etc/passwd"
echo 'nonroot:x:65532:' >"$ROOT/etc/group"
cat >"$WORK/Containerfile" <<'CF'
FROM scratch
COPY . /
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/stoker"]
CF
podman build -q --network none -f "$WORK/Containerfile" -t "$TAG" "$ROOT" >/dev/null
mkdir -p "$OUT"
rm -f "$OUT/stoker.oci.tar"
podman save -q --format oci-archive -o "$OUT/stoker.oci.tar" "$TAG"
size=$(podman image inspect --format '{{.Size}}' "$TAG")
echo "image: $TAG, $((size / 1024 / 1024)) MiB uncompressed, archive $(du -m "$OUT/stoker.oci.tar" | cut -f1) MiB at $OUT/stoker.oci.tar"
