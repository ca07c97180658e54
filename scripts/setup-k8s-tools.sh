#!/usr/bin/env bash
# Builds the Kubernetes tools the tests need from the Go module proxy, once, into a cache
# outside the repository ($STOKER_CACHE/bin): helm for now (lint and template of the chart).
# Idempotent: a tool already built at the pinned version is kept.
set -euo pipefail
CACHE="${STOKER_CACHE:-$HOME/.cache/stoker}"
BIN="$CACHE/bin"
HELM_VERSION=v3.22.0
mkdir -p "$BIN"
export GOPATH="$CACHE/go" GOCACHE="$CACHE/go-build" GOFLAGS=-mod=mod
if [ ! -x "$BIN/helm-$HELM_VERSION" ]; then
  echo "setup: building helm $HELM_VERSION (go install, once)"
  GOBIN="$BIN/tmp-helm" go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mv "$BIN/tmp-helm/helm" "$BIN/helm-$HELM_VERSION"
  rmdir "$BIN/tmp-helm"
fi
ln -sf "helm-$HELM_VERSION" "$BIN/helm"
echo "setup: helm=$BIN/helm"
