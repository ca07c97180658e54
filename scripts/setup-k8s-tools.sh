#!/usr/bin/env bash
# Builds the Kubernetes tools the tests need from the Go module proxy, once, into a cache outside
# the repository ($STOKER_CACHE/bin), and installs the container tools from Debian:
#   helm                        lint/template/install of the chart
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy
#                               k8s.io/kubernetes at the version in tools/kube/go.mod
#   etcd                        tools/etcd (a main calling etcdmain.Main)
#   kwok                        fake nodes and pods, with its Stage configs
#   coredns                     cluster DNS of the real nodes (scripts/cluster.sh --real-nodes)
#   podman, runc                the daemonless image build and run (scripts/build-image.sh)
#   containerd, socat, conntrack, iptables
#                               the real nodes' CRI runtime, the relay into the cluster's
#                               network namespace, kube-proxy's needs (Debian packages)
#   openssl                     the test cluster's certificates (scripts/cluster.sh)
#   pause image                 the pod sandbox image (a static C program, FROM scratch), as
#                               an archive for `ctr images import`
# Idempotent: a tool already built at its pinned version is kept. Cold: ~30 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BIN="$STOKER_CACHE/bin"
HELM_VERSION=v3.22.0
KUBE_VERSION=v1.35.4 # keep in step with tools/kube/go.mod
ETCD_VERSION=v3.6.8  # keep in step with tools/etcd/go.mod
KWOK_VERSION=v0.8.0
COREDNS_VERSION=v1.14.7
mkdir -p "$BIN"
# GOCACHE and GOMODCACHE, where set, are kept: one Go cache may serve several STOKER_CACHEs.
export GOPATH="$STOKER_CACHE/go" GOFLAGS=-mod=mod
export GOCACHE="${GOCACHE:-$STOKER_CACHE/go-build}" GOMODCACHE="${GOMODCACHE:-$GOPATH/pkg/mod}"

# build NAME VERSION COMMAND...: runs COMMAND (which writes $out) unless NAME-VERSION exists,
# then points NAME at it.
build() {
  local name=$1 version=$2
  shift 2
  if [ ! -x "$BIN/$name-$version" ]; then
    echo "setup: building $name $version (once)"
    out="$BIN/.tmp-$name"
    rm -rf "$out"
    "$@"
    mv "$out" "$BIN/$name-$version"
  fi
  ln -sf "$name-$version" "$BIN/$name"
}
go_install() { GOBIN="$out.d" go install "$1" && mv "$out.d/$(basename "${1%@*}")" "$out" && rmdir "$out.d"; }
# The version Kubernetes' own build stamps in (helm checks the chart's kubeVersion against it).
kube_tool() {
  local v="" pkg minor=${KUBE_VERSION#v1.}
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    v="$v -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=${minor%%.*}"
    v="$v -X $pkg.gitTreeState=clean"
  done
  (cd tools/kube && go build -trimpath -ldflags="-s $v" -o "$out" "k8s.io/kubernetes/cmd/$1")
}

build helm "$HELM_VERSION" go_install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
for tool in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
  build "$tool" "$KUBE_VERSION" kube_tool "$tool"
done
build etcd "$ETCD_VERSION" sh -c "cd tools/etcd && go build -trimpath -ldflags=-s -o \"\$0\" ." "$BIN/.tmp-etcd"
build kwok "$KWOK_VERSION" go_install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
build coredns "$COREDNS_VERSION" go_install "github.com/coredns/coredns@$COREDNS_VERSION"

# kwok's Stage configs (node initialize/heartbeat, pod ready/complete/delete) from its module.
STAGES="$STOKER_CACHE/kwok-stages-$KWOK_VERSION.yaml"
if [ ! -s "$STAGES" ]; then
  dir=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  for f in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
    pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
    cat "$dir/kustomize/stage/$f.yaml"
    echo "---"
  done >"$STAGES.tmp"
  mv "$STAGES.tmp" "$STAGES"
fi
ln -sf "$(basename "$STAGES")" "$STOKER_CACHE/kwok-stages.yaml"

# Container tools (Debian): podman runs the image as root with runc and cgroupfs; openssl
# makes the test cluster's certificates (scripts/cluster.sh).
# containerd, socat, conntrack and iptables are the real nodes' (scripts/cluster.sh --real-nodes).
need=()
for cmd in podman runc openssl containerd socat conntrack iptables; do
  command -v "$cmd" >/dev/null || need+=("$cmd")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]} (Debian packages)"
  apt_install "${need[@]}"
fi

# The pod sandbox ("pause") image: nothing can be pulled, so it is built here. Its process
# only holds the pod's namespaces, sleeping until a signal ends it.
PAUSE="$STOKER_PAUSE_ARCHIVE"
if [ ! -s "$PAUSE" ]; then
  echo "setup: building the pause image (once)"
  . scripts/podman-env.sh
  work=$(mktemp -d)
  cat >"$work/pause.c" <<'C'
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
  signal(SIGINT, quit);
  signal(SIGTERM, quit);
  signal(SIGCHLD, reap);
  for (;;) pause();
}
C
  gcc -static -Os -include sys/wait.h -o "$work/pause" "$work/pause.c"
  printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' >"$work/Containerfile"
  podman build -q --network none -t "$STOKER_PAUSE_IMAGE" "$work" >/dev/null
  mkdir -p "$(dirname "$PAUSE")"
  podman save -q --format docker-archive -o "$PAUSE.tmp" "$STOKER_PAUSE_IMAGE"
  mv "$PAUSE.tmp" "$PAUSE"
  rm -rf "$work"
fi
echo "setup: k8s tools in $BIN"
