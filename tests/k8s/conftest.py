"""Fixtures for the end-to-end tests on a real control plane (scripts/cluster.sh): etcd,
kube-apiserver, kube-controller-manager, kube-scheduler and kwok's fake nodes, all on
loopback. The chart is installed with the real helm; the operator runs as a local process
with the credentials of the chart's ServiceAccount (a TokenRequest token), so its RBAC is
what the cluster enforces."""

import collections
import ctypes
import http.server
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CACHE = pathlib.Path(os.environ.get("STOKER_CACHE") or pathlib.Path.home() / ".cache" / "stoker")
BIN = CACHE / "bin"
RELEASE_NS = "stoker-system"
SA = "stoker"  # the chart's fullname for release "stoker"


def stoker_bin() -> str:
    path = os.environ.get("STOKER_BIN", str(REPO / "target" / "release" / "stoker"))
    if not os.path.exists(path):
        pytest.fail(f"no stoker binary at {path} (cargo build --release, or set STOKER_BIN)")
    return path


def require_tools() -> None:
    missing = [t for t in ("kube-apiserver", "etcd", "kwok", "kubectl", "helm") if not (BIN / t).exists()]
    if missing:
        if os.environ.get("STOKER_REQUIRE_CLUSTER"):
            pytest.fail(f"missing {missing} in {BIN}: run scripts/setup-k8s-tools.sh")
        pytest.skip(f"missing {missing} in {BIN}: run scripts/setup-k8s-tools.sh")


def wait_until(what: str, check, timeout: float = 60.0, every: float = 0.5):
    """Polls `check` until it returns something truthy; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - a failed poll is retried
            last = e
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """scripts/cluster.sh up: `real_nodes` with kubelets (the last `trainer_nodes` of them for
    trainers), besides `fake_nodes` kwok nodes (the script's default when None)."""

    def __init__(self, state_dir: pathlib.Path, port_base: int = 0, real_nodes: int = 0,
                 trainer_nodes: int = 0, fake_nodes=None, link_mbit: int = 1000) -> None:
        self.env = dict(os.environ, STOKER_CLUSTER_DIR=str(state_dir),
                        STOKER_CLUSTER_PORT_BASE=str(port_base or 20000 + os.getpid() % 20000),
                        STOKER_CLUSTER_REAL_NODES=str(real_nodes),
                        STOKER_CLUSTER_TRAINER_NODES=str(trainer_nodes),
                        STOKER_CLUSTER_LINK_MBIT=str(link_mbit))
        if fake_nodes is not None:
            self.env["STOKER_CLUSTER_NODES"] = str(fake_nodes)
        self.script = str(REPO / "scripts" / "cluster.sh")
        try:
            out = subprocess.run([self.script, "up"], env=self.env, check=True,
                                 capture_output=True, text=True, timeout=600)
        except subprocess.CalledProcessError as e:
            self.down()
            pytest.fail(f"cluster.sh up failed: {e.stderr[-3000:]}")
        self.kubeconfig = out.stdout.strip().splitlines()[-1]

    def script_out(self, *args: str) -> str:
        """Another scripts/cluster.sh command on this cluster (stop-kubelet, netns, ...)."""
        return subprocess.run([self.script, *args], env=self.env, check=True,
                              capture_output=True, text=True, timeout=300).stdout

    @property
    def audit_log(self) -> pathlib.Path:
        """The API server's log of every ServiceAccount request (scripts/cluster.sh)."""
        return pathlib.Path(self.env["STOKER_CLUSTER_DIR"]) / "logs" / "audit.log"

    def down(self) -> None:
        subprocess.run([self.script, "down"], env=self.env, capture_output=True, timeout=120)

    def restart_apiserver(self) -> None:
        subprocess.run([self.script, "restart", "apiserver"], env=self.env, check=True,
                       capture_output=True, timeout=300)

    def kubectl(self, *args: str, kubeconfig: str = "", check: bool = True,
                input: str = "") -> subprocess.CompletedProcess:
        cmd = [str(BIN / "kubectl"), "--kubeconfig", kubeconfig or self.kubeconfig, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, input=input or None, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {r.stderr.strip()}")
        return r

    def get(self, kind: str, name: str = "", ns: str = "", **kw) -> dict:
        args = ["get", kind] + ([name] if name else []) + (["-n", ns] if ns else []) + ["-o", "json"]
        return json.loads(self.kubectl(*args, **kw).stdout)

    def token_kubeconfig(self, sa: str, ns: str, path: pathlib.Path) -> str:
        """A kubeconfig holding a TokenRequest token of ServiceAccount ns/sa."""
        token = self.kubectl("create", "token", sa, "-n", ns, "--duration", "2h").stdout.strip()
        admin = self.kubectl("config", "view", "--raw", "-o", "json").stdout
        cluster = json.loads(admin)["clusters"][0]["cluster"]
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": cluster}],
            "users": [{"name": sa, "user": {"token": token}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": sa}}],
            "current-context": "c",
        }))
        return str(path)


class Audit:
    """The operator's API requests (made with the chart's ServiceAccount token), from the API
    server's audit log, from a mark on."""

    USER = f"system:serviceaccount:{RELEASE_NS}:{SA}"

    def __init__(self, cluster: Cluster) -> None:
        self.path = cluster.audit_log
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def since_mark(self, names: frozenset = frozenset()) -> collections.Counter:
        """Requests by (verb, resource[/subresource]); only those on objects of `names`, if
        given."""
        counts = collections.Counter()
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if e.get("user", {}).get("username") != self.USER:
                    continue
                # One event per request: at its end, or a watch when it starts.
                watch = e.get("verb") == "watch"
                if e.get("stage") != ("ResponseStarted" if watch else "ResponseComplete"):
                    continue
                ref = e.get("objectRef", {})
                if names and ref.get("name") not in names:
                    continue
                resource = ref.get("resource", "?") + ("/" + ref["subresource"]
                                                       if ref.get("subresource") else "")
                counts[(e["verb"], resource)] += 1
        return counts


@pytest.fixture(scope="session")
def cluster():
    require_tools()
    state = pathlib.Path(tempfile.mkdtemp(prefix="stoker-cluster-"))
    c = None
    try:
        c = Cluster(state)
        yield c
    finally:
        if c is not None:
            c.down()
        else:  # a failed `up` leaves processes: the same script stops them
            subprocess.run([str(REPO / "scripts" / "cluster.sh"), "down"],
                           env=dict(os.environ, STOKER_CLUSTER_DIR=str(state)), capture_output=True)
        shutil.rmtree(state, ignore_errors=True)


def helm(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "helm"), "--kubeconfig", cluster.kubeconfig, *args],
                          check=True, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def release(cluster):
    """`helm install stoker charts/stoker`: the CRD from crds/, RBAC, the operator's
    ServiceAccount and Deployment (a fake pod on kwok: the real operator runs below)."""
    helm(cluster, "install", "stoker", str(REPO / "charts" / "stoker"),
         "-n", RELEASE_NS, "--create-namespace", "--wait", "--timeout", "120s")
    wait_until("the CRD to be established", lambda: "True" in cluster.kubectl(
        "get", "crd", "datapipelines.stoker.dev", "-o",
        "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout)
    return "stoker"


class Operator:
    """`stoker operator` as a local process with the ServiceAccount's token."""

    def __init__(self, kubeconfig: str, identity: str, log_dir: pathlib.Path) -> None:
        self.port = free_port()
        self.identity = identity
        self.log = log_dir / f"operator-{identity}-{len(list(log_dir.iterdir()))}.log"
        env = dict(os.environ, KUBECONFIG=kubeconfig, RUST_LOG="info,stoker_operator=debug")
        self.proc = subprocess.Popen(
            [stoker_bin(), "operator", "--metrics-listen", f"127.0.0.1:{self.port}",
             "--lease-namespace", RELEASE_NS, "--identity", identity,
             "--worker-metrics-from", "monitoring"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        wait_until(f"operator {identity}'s /metrics", lambda: self.metrics() is not None, 30)

    def metrics(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator {self.identity} exited: {self.log.read_text()[-2000:]}")
            return None

    def is_leader(self) -> bool:
        # A slow answer on a loaded machine is not a "no": read the page, then decide.
        m = wait_until(f"operator {self.identity}'s /metrics", self.metrics, 30)
        # The sample line itself (its HELP text starts with "1 while ...").
        return "stoker_operator_leader 1" in m.splitlines()

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster, release, tmp_path_factory) -> str:
    return cluster.token_kubeconfig(SA, RELEASE_NS, tmp_path_factory.mktemp("sa") / "kubeconfig")


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def operator(cluster, operator_kubeconfig, logs):
    op = Operator(operator_kubeconfig, "op-main", logs)
    wait_until("the operator to lead", op.is_leader, 60)
    yield op
    op.kill(signal.SIGTERM)


class TrainerNet:
    """A network namespace of the test's own, joined to this one by a veth pair (no other
    route), for stand-ins of trainer ranks: the operator refuses to scrape loopback, so they
    listen at an address in it, as trainer pods do on their pod network."""

    NAME, LINK, HOST_IP, ADDRESS = "stoker-trainers", "stk-trainers", "10.79.0.1", "10.79.0.2"

    def __init__(self) -> None:
        self.close()
        for cmd in [["netns", "add", self.NAME],
                    ["link", "add", self.LINK, "type", "veth", "peer", "name", "eth0",
                     "netns", self.NAME],
                    ["addr", "add", f"{self.HOST_IP}/30", "dev", self.LINK],
                    ["link", "set", self.LINK, "up"],
                    ["-n", self.NAME, "addr", "add", f"{self.ADDRESS}/30", "dev", "eth0"],
                    ["-n", self.NAME, "link", "set", "eth0", "up"],
                    ["-n", self.NAME, "link", "set", "lo", "up"]]:
            subprocess.run(["ip", *cmd], check=True, capture_output=True)

    def listening_socket(self) -> socket.socket:
        """A TCP socket listening at ADDRESS on a free port. Made by a thread that joined
        the namespace (setns moves only the calling thread; the socket stays in it)."""
        made = []

        def make() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/run/netns/{self.NAME}") as ns:
                if libc.setns(ns.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), "setns")
            s = socket.socket()
            s.bind((self.ADDRESS, 0))
            s.listen(64)
            made.append(s)

        t = threading.Thread(target=make)
        t.start()
        t.join()
        assert made, "no socket in the trainers' namespace"
        return made[0]

    def close(self) -> None:
        # Deleting the namespace deletes its end of the veth pair, and so the pair.
        subprocess.run(["ip", "netns", "del", self.NAME], capture_output=True)


class Trainer(http.server.ThreadingHTTPServer):
    """A simulated trainer rank's /metrics in the test's own network namespace (the operator
    scrapes no loopback address): counters that integrate a wait ratio the test sets, as
    stoker's client exports them. With jitter, each scrape's interval gets the wait ratio
    ± `wait_jitter` and the rate ± `rate_jitter` of itself, drawn uniformly: the noise of a
    real trainer's readings."""

    def __init__(self, net: TrainerNet, pipeline: str = "scaler", rank: int = 0,
                 wait_jitter: float = 0.0, rate_jitter: float = 0.0, seed: int = 0) -> None:
        self.wait_ratio, self.rate = 0.8, 20.0
        self.wait_jitter, self.rate_jitter = wait_jitter, rate_jitter
        self.rng = random.Random(seed)
        self.labels = f'{{pipeline="{pipeline}",rank="{rank}"}}'
        self.counters = [0.0, 0.0, 0.0]
        self.t = time.monotonic()
        self.lock = threading.Lock()
        trainer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = trainer.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        super().__init__((net.ADDRESS, 0), Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = net.listening_socket()
        self.server_address = self.socket.getsockname()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def render(self) -> str:
        with self.lock:
            now = time.monotonic()
            dt, self.t = now - self.t, now
            u = lambda: self.rng.uniform(-1.0, 1.0)
            wait = min(max(self.wait_ratio + self.wait_jitter * u(), 0.0), 1.0)
            self.counters[0] += wait * dt
            self.counters[1] += (1 - wait) * dt
            self.counters[2] += self.rate * (1 + self.rate_jitter * u()) * dt
            w, s, n = self.counters
        return (f"stoker_trainer_wait_seconds_total{self.labels} {w}\n"
                f"stoker_trainer_step_seconds_total{self.labels} {s}\n"
                f"stoker_trainer_samples_total{self.labels} {n}\n")

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}/metrics"


@pytest.fixture(scope="session")
def trainer_net():
    net = TrainerNet()
    yield net
    net.close()


def restricted_namespace(cluster: Cluster, ns: str) -> None:
    """A namespace that enforces the PodSecurity `restricted` level."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": ns, "labels": {
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest"}}}))
