#!/usr/bin/env bash
# A real Kubernetes control plane on this machine, for the operator's end-to-end tests and for
# poking at the operator by hand: etcd, kube-apiserver (HTTPS, RBAC, PodSecurity admission),
# kube-controller-manager, kube-scheduler and kwok with fake nodes. Everything listens on
# 127.0.0.1 only; fake nodes and pods get loopback addresses, so nothing sends traffic
# anywhere else. Binaries come from scripts/setup-k8s-tools.sh.
#
#   scripts/cluster.sh up                 start (prints the admin kubeconfig's path)
#   scripts/cluster.sh down               stop everything and remove the state
#   scripts/cluster.sh restart apiserver  stop and start one component (the tests use it)
#   scripts/cluster.sh status             which components run
#
# Settings (environment): STOKER_CLUSTER_DIR (state; default $STOKER_CACHE/cluster),
# STOKER_CLUSTER_NODES (fake nodes, default 4), STOKER_CLUSTER_PORT_BASE (default 16400:
# apiserver +43, etcd +79/+80).
#
# The API server writes an audit log of every request made with a ServiceAccount token (the
# operator's; the admin, the controllers and kwok use the admin token and are not logged) to
# $STOKER_CLUSTER_DIR/logs/audit.log: the tests and `benches/operator_scale.py` count the
# operator's API requests from it.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BIN="$STOKER_CACHE/bin"
DIR="${STOKER_CLUSTER_DIR:-$STOKER_CACHE/cluster}"
NODES="${STOKER_CLUSTER_NODES:-4}"
BASE="${STOKER_CLUSTER_PORT_BASE:-16400}"
API_PORT=$((BASE + 43))
ETCD_PORT=$((BASE + 79))
PEER_PORT=$((BASE + 80))
KUBECONFIG_PATH="$DIR/admin.kubeconfig"
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

log() { echo "cluster: $*" >&2; }
kc() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

# Certificates: a CA, the apiserver's serving certificate (127.0.0.1, localhost), and the
# service-account signing key pair (TokenRequest tokens for the operator's ServiceAccount).
make_pki() {
  local p="$DIR/pki"
  mkdir -p "$p"
  [ -s "$p/apiserver.crt" ] && return
  command -v openssl >/dev/null || { log "no openssl: run scripts/setup-k8s-tools.sh"; exit 1; }
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=stoker-test-ca" \
    -keyout "$p/ca.key" -out "$p/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
    -keyout "$p/apiserver.key" -out "$p/apiserver.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n' >"$p/san.ext"
  openssl x509 -req -in "$p/apiserver.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" \
    -CAcreateserial -days 30 -extfile "$p/san.ext" -out "$p/apiserver.crt" 2>/dev/null
  openssl genrsa -out "$p/sa.key" 2048 2>/dev/null
  openssl rsa -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>/dev/null
}

make_kubeconfig() {
  local token
  token=$(openssl rand -hex 24)
  echo "$token,admin,admin,system:masters" >"$DIR/tokens.csv"
  cat >"$KUBECONFIG_PATH" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: stoker-test
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $DIR/pki/ca.crt
users:
- name: admin
  user:
    token: $token
contexts:
- name: stoker-test
  context: {cluster: stoker-test, user: admin}
current-context: stoker-test
EOF
}

# start NAME ARGS...: runs $BIN/NAME in its own session, logging to $DIR/logs/NAME.log.
start() {
  local name=$1
  shift
  mkdir -p "$DIR/logs" "$DIR/pids"
  setsid "$BIN/$name" "$@" >>"$DIR/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$DIR/pids/$name.pid"
}

stop() {
  local pidfile="$DIR/pids/$1.pid"
  [ -f "$pidfile" ] || return 0
  local pid
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

# wait_for WHAT SECONDS COMMAND...: retries COMMAND until it succeeds.
wait_for() {
  local what=$1 secs=$2
  shift 2
  for _ in $(seq $((secs * 2))); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  log "$what did not come up in ${secs}s; last log lines:"
  tail -n 20 "$DIR/logs/"*.log >&2 || true
  return 1
}

start_etcd() {
  start etcd --name default --data-dir "$DIR/etcd" --unsafe-no-fsync \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$PEER_PORT" \
    --initial-cluster "default=http://127.0.0.1:$PEER_PORT" \
    --listen-metrics-urls "" --log-level warn
  wait_for etcd 60 curl -sf "http://127.0.0.1:$ETCD_PORT/health"
}

# One JSON line per request from a ServiceAccount, at its end (a watch: also when it starts).
audit_policy() {
  cat >"$DIR/audit-policy.yaml" <<EOF
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts"]
- level: None
EOF
}

start_apiserver() {
  audit_policy
  start kube-apiserver \
    --audit-policy-file "$DIR/audit-policy.yaml" --audit-log-path "$DIR/logs/audit.log" \
    --audit-log-format json --audit-log-mode blocking \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
    --tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
    --client-ca-file "$DIR/pki/ca.crt" --token-auth-file "$DIR/tokens.csv" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$DIR/pki/sa.pub" \
    --service-account-signing-key-file "$DIR/pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --authorization-mode Node,RBAC \
    --enable-admission-plugins NodeRestriction,PodSecurity \
    --endpoint-reconciler-type none --allow-privileged=false \
    --profiling=false --v 1
  wait_for kube-apiserver 120 kc get --raw /readyz
}

start_controllers() {
  start kube-controller-manager --kubeconfig "$KUBECONFIG_PATH" \
    --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false \
    --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
    --use-service-account-credentials=false --allocate-node-cidrs=false \
    --node-monitor-grace-period 40s --profiling=false --v 1
  start kube-scheduler --kubeconfig "$KUBECONFIG_PATH" \
    --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false --profiling=false --v 1
  start kwok --kubeconfig "$KUBECONFIG_PATH" --config "$STOKER_CACHE/kwok-stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-label-selector type=kwok \
    --node-ip 127.0.0.1 --cidr 127.64.0.0/16
}

# Fake nodes: hostname and zone labels (placement spreads over them), no taints.
create_nodes() {
  local i zone
  for i in $(seq 0 $((NODES - 1))); do
    zone="zone-$((i % 2))"
    cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-$i
  annotations: {node.alpha.kubernetes.io/ttl: "0", kwok.x-k8s.io/node: fake}
  labels:
    type: kwok
    kubernetes.io/hostname: kwok-node-$i
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    topology.kubernetes.io/zone: $zone
status:
  allocatable: {cpu: "32", memory: 256Gi, pods: "110"}
  capacity: {cpu: "32", memory: 256Gi, pods: "110"}
---
EOF
  done | kc apply -f - >/dev/null
  nodes_ready() { [ "$(kc get nodes --no-headers 2>/dev/null | grep -cw Ready)" -ge "$NODES" ]; }
  wait_for "$NODES Ready nodes" 120 nodes_ready
}

up() {
  for b in "${COMPONENTS[@]}" kubectl; do
    [ -x "$BIN/$b" ] || { log "$BIN/$b missing: run scripts/setup-k8s-tools.sh"; exit 1; }
  done
  if [ -f "$DIR/pids/kube-apiserver.pid" ]; then
    log "already up (scripts/cluster.sh down first)"
    echo "$KUBECONFIG_PATH"
    return
  fi
  mkdir -p "$DIR"
  make_pki
  make_kubeconfig
  start_etcd
  start_apiserver
  start_controllers
  create_nodes
  log "up: $NODES nodes; export KUBECONFIG=$KUBECONFIG_PATH"
  echo "$KUBECONFIG_PATH"
}

down() {
  local c
  for c in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$c"; done
  rm -rf "$DIR"
  log "down"
}

restart() {
  local c=${1:?component}
  [ "$c" = apiserver ] && c=kube-apiserver
  stop "$c"
  case "$c" in
    etcd) start_etcd ;;
    kube-apiserver) start_apiserver ;;
    *) log "restart: $c is not restartable here"; exit 2 ;;
  esac
}

status() {
  local c
  for c in "${COMPONENTS[@]}"; do
    if [ -f "$DIR/pids/$c.pid" ] && kill -0 "$(cat "$DIR/pids/$c.pid")" 2>/dev/null; then
      echo "$c running"
    else
      echo "$c stopped"
    fi
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  restart) restart "${2:-}" ;;
  status) status ;;
  *) echo "usage: $0 up|down|restart apiserver|status" >&2; exit 2 ;;
esac
