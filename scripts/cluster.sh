#!/usr/bin/env bash
# A real Kubernetes control plane on this machine, for the operator's end-to-end tests and for
# poking at the operator by hand: etcd, kube-apiserver (HTTPS, RBAC, PodSecurity admission),
# kube-controller-manager, kube-scheduler and kwok with fake nodes. Everything listens on
# 127.0.0.1 only; fake nodes and pods get loopback addresses, so nothing sends traffic
# anywhere else. Binaries come from scripts/setup-k8s-tools.sh.
#
#   scripts/cluster.sh up [--real-nodes N] start (prints the admin kubeconfig's path)
#   scripts/cluster.sh down               stop everything and remove the state
#   scripts/cluster.sh restart apiserver  stop and start one component (the tests use it)
#   scripts/cluster.sh stop-kubelet I     stop real node I's kubelet (its pods keep running)
#   scripts/cluster.sh start-kubelet I    start it again
#   scripts/cluster.sh load-image ARCHIVE import an image archive into every real node
#   scripts/cluster.sh netns              the network namespaces: the hub, then node 0, 1, ...
#   scripts/cluster.sh status             which components run
#
# Settings (environment): STOKER_CLUSTER_DIR (state; default $STOKER_CACHE/cluster),
# STOKER_CLUSTER_NODES (fake nodes, default 4), STOKER_CLUSTER_REAL_NODES (default 0, or
# --real-nodes), STOKER_CLUSTER_LINK_MBIT (each real node's link cap, default 1000),
# STOKER_CLUSTER_TRAINER_NODES (default 0: how many of the real nodes, the last ones, are for
# trainers: labelled stoker.dev/role=trainer, not workers' stoker.dev/role=worker, and with
# an uncapped link, as the trainer stands for many GPU nodes),
# STOKER_CLUSTER_PORT_BASE (default 16400: apiserver +43, etcd +79/+80).
#
# Real nodes: kubelet + containerd (runc) + kube-proxy each, in a network namespace of its own
# joined by a veth pair to a bridge in the "hub" namespace, its link capped with tbf in both
# directions (as `stoker-lab bench spread` does), so a node's NIC is a real bottleneck. With
# real nodes the control plane (etcd, apiserver, controllers, scheduler, kwok) and CoreDNS
# run in the hub at 10.77.0.1; the host reaches the apiserver at 127.0.0.1 through a relay
# (socat over a unix socket), so the kubeconfig is the same either way. Node I is 10.77.0.1I
# (I < 10) with pods in 10.78.I.0/24 (CNI bridge + host-local); namespaces are routed to
# each other only: no default route, NAT or forward leaves them, CoreDNS has no upstream and
# images come from archives (the pause image from scripts/setup-k8s-tools.sh, Stoker's from
# scripts/build-image.sh), never from a registry.
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
LINK_MBIT="${STOKER_CLUSTER_LINK_MBIT:-1000}"
TRAINER_NODES="${STOKER_CLUSTER_TRAINER_NODES:-0}"
HUB_IP=10.77.0.1
POD_CIDR=10.78.0.0/16
SERVICE_CIDR=10.96.0.0/16
HUB_NS="stk$BASE-hub"
# Real nodes: from `up --real-nodes N`, the environment, or (later commands) the state.
REAL_NODES="${STOKER_CLUSTER_REAL_NODES:-0}"
[ "${1:-}" = up ] && [ "${2:-}" = --real-nodes ] && REAL_NODES=${3:?--real-nodes N}
[ -f "$DIR/real-nodes" ] && read -r REAL_NODES TRAINER_NODES <"$DIR/real-nodes"
# The control plane's network namespace: the hub's with real nodes, else the host's.
IN_HUB=()
[ "$REAL_NODES" -gt 0 ] && IN_HUB=(ip netns exec "$HUB_NS")
node_name() { echo "real-node-$1"; }
node_ns() { echo "stk$BASE-n$1"; }
node_ip() { echo "10.77.0.1$1"; }
node_dir() { echo "$DIR/nodes/$1"; }
node_role() { if [ "$1" -ge $((REAL_NODES - TRAINER_NODES)) ]; then echo trainer; else echo worker; fi; }

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
  # 10.96.0.1 is the `kubernetes` Service (pods' in-cluster config), 10.77.0.1 the hub.
  printf 'subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:%s,DNS:localhost,DNS:kubernetes.default.svc\n' \
    "$HUB_IP" >"$p/san.ext"
  openssl x509 -req -in "$p/apiserver.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" \
    -CAcreateserial -days 30 -extfile "$p/san.ext" -out "$p/apiserver.crt" 2>/dev/null
  # The apiserver's client certificate towards kubelets (logs, exec): kubelets trust the CA.
  openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" \
    -keyout "$p/kubelet-client.key" -out "$p/kubelet-client.csr" 2>/dev/null
  openssl x509 -req -in "$p/kubelet-client.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" \
    -CAcreateserial -days 30 -out "$p/kubelet-client.crt" 2>/dev/null
  openssl genrsa -out "$p/sa.key" 2048 2>/dev/null
  openssl rsa -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>/dev/null
}

# kubeconfig PATH TOKEN [SERVER]: a kubeconfig authenticating with TOKEN.
kubeconfig() {
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: stoker-test
  cluster:
    server: ${3:-https://127.0.0.1:$API_PORT}
    certificate-authority: $DIR/pki/ca.crt
users:
- name: user
  user:
    token: $2
contexts:
- name: stoker-test
  context: {cluster: stoker-test, user: user}
current-context: stoker-test
EOF
}

# The admin's token, and with real nodes one per kubelet (system:node:NAME, which the Node
# authorizer and NodeRestriction confine to its own node) and kube-proxy's (system:kube-proxy,
# bound to system:node-proxier by the default RBAC).
make_kubeconfig() {
  local token i
  token=$(openssl rand -hex 24)
  echo "$token,admin,admin,system:masters" >"$DIR/tokens.csv"
  kubeconfig "$KUBECONFIG_PATH" "$token"
  for i in $(seq 0 $((REAL_NODES - 1))); do
    mkdir -p "$(node_dir "$i")"
    token=$(openssl rand -hex 24)
    echo "$token,system:node:$(node_name "$i"),node-$i,system:nodes" >>"$DIR/tokens.csv"
    kubeconfig "$(node_dir "$i")/kubelet.kubeconfig" "$token" "https://$HUB_IP:$API_PORT"
  done
  if [ "$REAL_NODES" -gt 0 ]; then
    token=$(openssl rand -hex 24)
    echo "$token,system:kube-proxy,kube-proxy" >>"$DIR/tokens.csv"
    kubeconfig "$DIR/kube-proxy.kubeconfig" "$token" "https://$HUB_IP:$API_PORT"
  fi
}

# start NAME ARGS...: runs $BIN/NAME in its own session (in the control plane's network
# namespace), logging to $DIR/logs/NAME.log.
start() {
  local name=$1
  shift
  start_as "$name" "${IN_HUB[@]}" "$BIN/$name" "$@"
}

# start_as ID COMMAND...: runs COMMAND in its own session as component ID (pid and log files).
start_as() {
  local id=$1
  shift
  mkdir -p "$DIR/logs" "$DIR/pids"
  setsid "$@" >>"$DIR/logs/$id.log" 2>&1 </dev/null &
  echo $! >"$DIR/pids/$id.pid"
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
  wait_for etcd 60 "${IN_HUB[@]}" curl -sf "http://127.0.0.1:$ETCD_PORT/health"
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
  # With real nodes the `kubernetes` Service's endpoint is the hub's address (pods' in-cluster
  # config reaches it through kube-proxy), and the apiserver reaches kubelets for logs/exec.
  local where=(--bind-address 127.0.0.1 --advertise-address 127.0.0.1 --endpoint-reconciler-type none)
  [ "$REAL_NODES" -gt 0 ] && where=(--bind-address 0.0.0.0 --advertise-address "$HUB_IP"
    --endpoint-reconciler-type lease
    --kubelet-client-certificate "$DIR/pki/kubelet-client.crt"
    --kubelet-client-key "$DIR/pki/kubelet-client.key"
    --kubelet-preferred-address-types InternalIP)
  start kube-apiserver "${where[@]}" \
    --audit-policy-file "$DIR/audit-policy.yaml" --audit-log-path "$DIR/logs/audit.log" \
    --audit-log-format json --audit-log-mode blocking \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --secure-port "$API_PORT" \
    --tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
    --client-ca-file "$DIR/pki/ca.crt" --token-auth-file "$DIR/tokens.csv" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$DIR/pki/sa.pub" \
    --service-account-signing-key-file "$DIR/pki/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --authorization-mode Node,RBAC \
    --enable-admission-plugins NodeRestriction,PodSecurity \
    --allow-privileged=false \
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
  # The heartbeat stage is kwok's "with lease" one: node status every ~10 minutes, liveness
  # by the node Lease kwok renews. Without the Lease, every fake node went NotReady 40 s after
  # each status heartbeat (the grace period above) and its pods were marked unready for good.
  start kwok --kubeconfig "$KUBECONFIG_PATH" --config "$STOKER_CACHE/kwok-stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-label-selector type=kwok \
    --node-lease-duration-seconds 40 --node-ip 127.0.0.1 --cidr 127.64.0.0/16
}

# nodes_ready SELECTOR N: at least N nodes matching SELECTOR are Ready.
nodes_ready() { [ "$(kc get nodes -l "$1" --no-headers 2>/dev/null | grep -cw Ready)" -ge "$2" ]; }

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
  wait_for "$NODES Ready nodes" 120 nodes_ready type=kwok "$NODES"
}

# ---- Real nodes ----------------------------------------------------------------------------

in_ns() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

# The hub (bridge br0 at 10.77.0.1) and one namespace per real node, each joined to the
# bridge by a veth pair capped with tbf both ways; every namespace is routed to the pod
# subnets of the others and to nothing else.
net_up() {
  local i j ns cap=(tbf rate "${LINK_MBIT}mbit" burst 256kb latency 100ms)
  ip netns del "$HUB_NS" 2>/dev/null || true
  ip netns add "$HUB_NS"
  in_ns "$HUB_NS" ip link set lo up
  in_ns "$HUB_NS" ip link add br0 type bridge
  in_ns "$HUB_NS" ip addr add "$HUB_IP/24" dev br0
  in_ns "$HUB_NS" ip link set br0 up
  for i in $(seq 0 $((REAL_NODES - 1))); do
    ns=$(node_ns "$i")
    ip netns del "$ns" 2>/dev/null || true
    ip netns add "$ns"
    ip link add eth0 netns "$ns" type veth peer name "node$i" netns "$HUB_NS"
    in_ns "$ns" ip link set lo up
    in_ns "$ns" ip addr add "$(node_ip "$i")/24" dev eth0
    in_ns "$ns" ip link set eth0 up
    in_ns "$ns" sysctl -qw net.ipv4.ip_forward=1
    in_ns "$HUB_NS" ip link set "node$i" master br0 up
    if [ "$(node_role "$i")" = worker ]; then
      in_ns "$ns" tc qdisc add dev eth0 root "${cap[@]}"
      in_ns "$HUB_NS" tc qdisc add dev "node$i" root "${cap[@]}"
    fi
    in_ns "$HUB_NS" ip route add "10.78.$i.0/24" via "$(node_ip "$i")"
  done
  for i in $(seq 0 $((REAL_NODES - 1))); do
    for j in $(seq 0 $((REAL_NODES - 1))); do
      [ "$i" = "$j" ] || in_ns "$(node_ns "$i")" ip route add "10.78.$j.0/24" via "$(node_ip "$j")"
    done
  done
  # Programs started in a namespace with `ip netns exec` see this resolv.conf: cluster DNS.
  mkdir -p "/etc/netns/$HUB_NS"
  printf 'nameserver %s\nsearch default.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n' \
    "$HUB_IP" >"/etc/netns/$HUB_NS/resolv.conf"
  # The host's tools reach the apiserver (in the hub) at 127.0.0.1:$API_PORT: two socat
  # processes joined by a unix socket, which crosses namespaces where TCP would need a route.
  start_as relay-hub ip netns exec "$HUB_NS" socat "UNIX-LISTEN:$DIR/api.sock,fork,unlink-early" \
    "TCP:127.0.0.1:$API_PORT"
  start_as relay-host socat "TCP-LISTEN:$API_PORT,bind=127.0.0.1,fork,reuseaddr" \
    "UNIX-CONNECT:$DIR/api.sock"
}

net_down() {
  local i
  for i in $(seq 0 $((REAL_NODES - 1))); do ip netns del "$(node_ns "$i")" 2>/dev/null || true; done
  ip netns del "$HUB_NS" 2>/dev/null || true
  rm -rf "/etc/netns/$HUB_NS"
}

# Cluster DNS for the pods (kubelets' clusterDNS) and the hub: the kubernetes plugin only, so
# a name outside cluster.local is refused rather than forwarded anywhere.
start_coredns() {
  cat >"$DIR/Corefile" <<EOF
cluster.local:53 {
    bind $HUB_IP
    errors
    kubernetes cluster.local {
        kubeconfig $KUBECONFIG_PATH stoker-test
        ttl 5
    }
}
EOF
  start coredns -conf "$DIR/Corefile"
}

# start_on_node I ID COMMAND...: start_as ID-I, in node I's network namespace only (nsenter):
# `ip netns exec` also mounts a fresh /sys, which hides the cgroup mounts kubelet and runc need.
start_on_node() {
  local i=$1 id=$2
  shift 2
  start_as "$id-$i" nsenter --net="/run/netns/$(node_ns "$i")" "$@"
}

ctr_in() { ctr --address "$(node_dir "$1")/containerd.sock" -n k8s.io "${@:2}"; }

start_containerd() {
  local i=$1 d
  d=$(node_dir "$i")
  mkdir -p "$d/cni" "$d/ipam"
  cat >"$d/cni/10-stoker.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "stoker-pods", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$d/ipam",
            "ranges": [[{"subnet": "10.78.$i.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}}]}
EOF
  cat >"$d/containerd.toml" <<EOF
version = 2
root = "$d/containerd/root"
state = "$d/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$d/containerd.sock"
[debug]
  level = "warn"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$STOKER_PAUSE_IMAGE"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$d/cni"
EOF
  start_on_node "$i" containerd containerd --config "$d/containerd.toml"
  wait_for "containerd on node $i" 60 ctr_in "$i" version
}

# import_image ARCHIVE: into every real node's containerd (nothing is ever pulled).
import_image() {
  local i
  for i in $(seq 0 $((REAL_NODES - 1))); do
    ctr_in "$i" images import "$1" >/dev/null
  done
}

start_kubelet() {
  local i=$1 d
  d=$(node_dir "$i")
  mkdir -p "$d/kubelet" "$d/pod-logs"
  : >"$d/resolv.conf" # pods get cluster DNS only: no host nameserver is copied in
  cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine: cgroup v1, cgroupfs, swap on.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
address: $(node_ip "$i")
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
containerRuntimeEndpoint: unix://$d/containerd.sock
clusterDNS: [$HUB_IP]
clusterDomain: cluster.local
resolvConf: $d/resolv.conf
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization: {mode: Webhook}
podLogsDir: $d/pod-logs
# Images cannot be pulled again: never collect them; evict only when the disk is really full.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 50Mi, nodefs.available: 2%, imagefs.available: 2%}
nodeStatusUpdateFrequency: 4s
EOF
  start_on_node "$i" kubelet "$BIN/kubelet" --config "$d/kubelet.yaml" \
    --kubeconfig "$d/kubelet.kubeconfig" --root-dir "$d/kubelet" --cert-dir "$d/pki" \
    --hostname-override "$(node_name "$i")" --node-ip "$(node_ip "$i")" \
    --node-labels "type=real,stoker.dev/role=$(node_role "$i"),topology.kubernetes.io/zone=zone-$((i % 2))" \
    --v 1
}

start_kube_proxy() {
  local i=$1 d
  d=$(node_dir "$i")
  cat >"$d/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $DIR/kube-proxy.kubeconfig}
hostnameOverride: $(node_name "$i")
bindAddress: $(node_ip "$i")
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
mode: iptables
clusterCIDR: $POD_CIDR
# Leave the (machine-wide) conntrack table settings alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  start_on_node "$i" kube-proxy "$BIN/kube-proxy" --config "$d/kube-proxy.yaml" --v 1
}

real_nodes_up() {
  local i stoker_image="$STOKER_CACHE/image/stoker.oci.tar"
  start_coredns
  for i in $(seq 0 $((REAL_NODES - 1))); do start_containerd "$i"; done
  import_image "$STOKER_PAUSE_ARCHIVE"
  [ -s "$stoker_image" ] && import_image "$stoker_image"
  for i in $(seq 0 $((REAL_NODES - 1))); do
    start_kubelet "$i"
    start_kube_proxy "$i"
  done
  wait_for "$REAL_NODES Ready real nodes" 180 nodes_ready type=real "$REAL_NODES"
}

# Pods first (their kubelet tears each sandbox's network down), then the node processes; a
# container left over is killed through its containerd, and mounts under the state go.
real_nodes_down() {
  local i t
  # (The controllers are stopped by now: nothing recreates them.)
  if [ -f "$DIR/pids/kube-apiserver.pid" ]; then
    kc delete pods --all -A --grace-period 1 --wait=false >/dev/null 2>&1 || true
    no_pods() { [ -z "$(kc get pods -A --no-headers 2>/dev/null)" ]; }
    wait_for "the pods to go" 60 no_pods 2>/dev/null || true
  fi
  for i in $(seq 0 $((REAL_NODES - 1))); do
    stop "kube-proxy-$i"
    stop "kubelet-$i"
    for t in $(ctr_in "$i" tasks ls -q 2>/dev/null); do
      ctr_in "$i" tasks kill -s KILL "$t" >/dev/null 2>&1 || true
      ctr_in "$i" tasks delete -f "$t" >/dev/null 2>&1 || true
    done
    stop "containerd-$i"
  done
  stop coredns
  stop relay-host
  stop relay-hub
  { grep -o " $DIR/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  net_down
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
  if [ "$REAL_NODES" -gt 0 ]; then
    for b in kubelet kube-proxy coredns; do
      [ -x "$BIN/$b" ] || { log "$BIN/$b missing: run scripts/setup-k8s-tools.sh"; exit 1; }
    done
    [ "$REAL_NODES" -le 10 ] || { log "at most 10 real nodes"; exit 2; }
    [ "$(id -u)" = 0 ] || { log "real nodes need root (network namespaces, containers)"; exit 1; }
  fi
  mkdir -p "$DIR"
  echo "$REAL_NODES $TRAINER_NODES" >"$DIR/real-nodes"
  make_pki
  make_kubeconfig
  [ "$REAL_NODES" -gt 0 ] && net_up
  start_etcd
  start_apiserver
  start_controllers
  [ "$NODES" -gt 0 ] && create_nodes
  [ "$REAL_NODES" -gt 0 ] && real_nodes_up
  log "up: $NODES fake nodes, $REAL_NODES real nodes; export KUBECONFIG=$KUBECONFIG_PATH"
  echo "$KUBECONFIG_PATH"
}

down() {
  local c
  for c in kube-controller-manager kwok kube-scheduler; do stop "$c"; done
  [ "$REAL_NODES" -gt 0 ] && real_nodes_down
  for c in kube-apiserver etcd; do stop "$c"; done
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
  local c f
  for c in "${COMPONENTS[@]}"; do [ -f "$DIR/pids/$c.pid" ] || echo "$c stopped"; done
  for f in "$DIR"/pids/*.pid; do
    [ -f "$f" ] || continue
    c=$(basename "$f" .pid)
    if kill -0 "$(cat "$f")" 2>/dev/null; then echo "$c running"; else echo "$c stopped"; fi
  done
}

netns() {
  local i
  echo "$HUB_NS"
  for i in $(seq 0 $((REAL_NODES - 1))); do node_ns "$i"; done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  restart) restart "${2:-}" ;;
  stop-kubelet) stop "kubelet-${2:?node index}" ;;
  start-kubelet) start_kubelet "${2:?node index}" ;;
  load-image) import_image "${2:?archive}" ;;
  netns) netns ;;
  status) status ;;
  *) echo "usage: $0 up [--real-nodes N]|down|restart apiserver|stop-kubelet I|start-kubelet I|load-image ARCHIVE|netns|status" >&2; exit 2 ;;
esac
