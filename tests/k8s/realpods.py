"""What the real-pod tests (test_real_pods.py) and the spread-on-real-pods benchmark
(benches/spread_pods.py) share: a cluster with real nodes (scripts/cluster.sh), an S3 server
and Prometheus in its hub namespace, a DataPipeline, a trainer pod and the batches it logs."""

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

from conftest import BIN, CACHE, REPO, Cluster

# The chart's default image, as scripts/build-image.sh tags it.
IMAGE = "ghcr.io/stoker-dev/stoker:" + yaml.safe_load(
    (REPO / "charts" / "stoker" / "Chart.yaml").read_text())["appVersion"]
EXAMPLE = REPO / "examples" / "real-nodes" / "datapipeline.yaml"
IMAGE_ARCHIVE = CACHE / "image" / "stoker.oci.tar"
HUB = "10.77.0.1"  # the hub namespace's address: the control plane, CoreDNS, S3, Prometheus
TRAINER_CODE = pathlib.Path(__file__).with_name("trainer.py")


def lab_bin() -> str:
    stoker = os.environ.get("STOKER_BIN", str(REPO / "target" / "release" / "stoker"))
    return os.environ.get("STOKER_LAB", str(pathlib.Path(stoker).with_name("stoker-lab")))


def require_real_nodes() -> None:
    if os.geteuid() != 0 or not IMAGE_ARCHIVE.exists() or not (BIN / "kubelet").exists():
        msg = ("real nodes need root, the image archive (scripts/build-image.sh) and kubelet "
               "(scripts/setup-k8s-tools.sh)")
        if os.environ.get("STOKER_REQUIRE_CLUSTER"):
            pytest.fail(msg)
        pytest.skip(msg)


@contextlib.contextmanager
def real_cluster(worker_nodes: int, link_mbit: int):
    """`worker_nodes` real nodes behind `link_mbit` links and one uncapped trainer node; no
    kwok nodes. Ports and namespaces of their own (beside the kwok tests' cluster)."""
    state = pathlib.Path(tempfile.mkdtemp(prefix="stoker-real-"))
    c = Cluster(state, port_base=40000 + os.getpid() % 20000, real_nodes=worker_nodes + 1,
                trainer_nodes=1, fake_nodes=0, link_mbit=link_mbit)
    try:
        yield c
    finally:
        c.down()
        shutil.rmtree(state, ignore_errors=True)


def in_hub(real: Cluster, args: list, log: pathlib.Path, **kw) -> subprocess.Popen:
    hub = real.script_out("netns").split()[0]
    return subprocess.Popen(["ip", "netns", "exec", hub, *args], stderr=open(log, "w"), **kw)


@contextlib.contextmanager
def s3_store(real: Cluster, root: pathlib.Path, samples: int):
    """A synthetic dataset at s3://datasets/sft and the tokenizer at
    s3://datasets/tok/tokenizer.json, served from the hub at 10.77.0.1:9000."""
    subprocess.run([lab_bin(), "synth", "--out", str(root / "datasets" / "sft"), "--samples",
                    str(samples), "--samples-per-shard", "32", "--min-side", "256",
                    "--max-side", "640"], check=True, capture_output=True)
    (root / "datasets" / "tok").mkdir()
    tok = pathlib.Path(os.environ.get("STOKER_TOKENIZER", CACHE / "qwen-tokenizer"))
    shutil.copy(tok / "tokenizer.json", root / "datasets" / "tok" / "tokenizer.json")
    proc = in_hub(real, [lab_bin(), "bench", "s3-server", "--root", str(root), "--listen",
                         f"{HUB}:9000"], root.parent / "s3.log", stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("listening"), "the S3 server did not start"
        real.kubectl("create", "secret", "generic", "s3-credentials",
                     "--from-literal=AWS_ACCESS_KEY_ID=stoker-embedded",
                     "--from-literal=AWS_SECRET_ACCESS_KEY=stoker-embedded-secret")
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def prometheus(real: Cluster, work: pathlib.Path, target: str):
    """Prometheus in the hub at 10.77.0.1:9090, scraping one trainer's /metrics every 2 s
    (with the namespace label Kubernetes service discovery would add)."""
    cfg = work / "prometheus.yml"
    cfg.write_text(json.dumps({
        "global": {"scrape_interval": "2s"},
        "scrape_configs": [{"job_name": "trainers", "static_configs": [
            {"targets": [target], "labels": {"namespace": "default"}}]}],
    }))
    proc = in_hub(real, ["prometheus", f"--config.file={cfg}",
                         f"--storage.tsdb.path={work / 'tsdb'}",
                         f"--web.listen-address={HUB}:9090"], work / "prometheus.log")
    try:
        yield f"http://{HUB}:9090"
    finally:
        proc.kill()
        proc.wait()


def datapipeline(name: str, replicas: int, mode: str, link_mbit: int, autoscaling=None) -> dict:
    """The walk-through's pipeline (examples/real-nodes/datapipeline.yaml: the store and
    tokenizer of s3_store, workers on the worker nodes) under `name`, with its own trainer
    label, worker count, placement (Spread: a whole link per worker, so one per node) and
    autoscaling (none when None)."""
    dp = yaml.safe_load(EXAMPLE.read_text())
    dp["metadata"]["name"] = name
    spec = dp["spec"]
    spec.update(replicas=replicas, trainerSelector={"app": f"{name}-trainer"},
                placement={"mode": mode})
    if mode == "Spread":
        spec["placement"].update(nodeBandwidthGbps=link_mbit / 1000,
                                 workerEgressGbps=link_mbit / 1000)
    spec.pop("autoscaling")
    if autoscaling:
        spec["autoscaling"] = autoscaling
    return dp


def trainer_pod(name: str, step_s: float, out: pathlib.Path) -> dict:
    """A pod on the trainer node running trainer.py with this machine's Python and the
    installed `stoker` package, mounted read-only from the host (the image holds only the
    `stoker` binary), trusting the pipeline's CA from its ConfigMap; it logs its batches to
    `out`/batches.jsonl."""
    venv, base = pathlib.Path(sys.prefix), pathlib.Path(sys.base_prefix)
    mounts = {"usr": "/usr", "venv": str(venv), "code": str(TRAINER_CODE.parent), "out": str(out)}
    if not base.is_relative_to("/usr"):  # a Python of its own (pyenv), not Debian's
        mounts["python"] = str(base)
    out.chmod(0o777)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-trainer", "labels": {"app": f"{name}-trainer"}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"stoker.dev/role": "trainer"},
            "containers": [{
                "name": "trainer", "image": IMAGE, "imagePullPolicy": "Never",
                "command": [str(venv / "bin" / "python"), str(TRAINER_CODE),
                            f"dns:{name}-workers.default.svc:7700", f"{out}/batches.jsonl",
                            str(step_s), name, f"{out}/stop"],
                "env": [{"name": "STOKER_TOKEN", "valueFrom": {"secretKeyRef": {
                    "name": f"{name}-token", "key": "token"}}},
                        {"name": "STOKER_TLS_CA", "value": "/var/run/stoker-ca/ca.crt"}],
                "ports": [{"name": "metrics", "containerPort": 9400}],
                "securityContext": {"runAsUser": 0},
                "volumeMounts": [{"name": k, "mountPath": v, "readOnly": k != "out"}
                                 for k, v in mounts.items()]
                + [{"name": "ca", "mountPath": "/var/run/stoker-ca", "readOnly": True}],
            }],
            "volumes": [{"name": k, "hostPath": {"path": v}} for k, v in mounts.items()]
            + [{"name": "ca", "configMap": {"name": f"{name}-ca"}}],
        },
    }


def batches(out: pathlib.Path) -> list:
    """The trainer's log: one dict per batch received."""
    path = out / "batches.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a line being written
    return rows


def window_wait_ratio(rows: list, seconds: float) -> float:
    """The trainer's wait ratio over its last `seconds` (blocked time / wall time)."""
    last = rows[-1]
    first = next(r for r in rows if r["t"] >= last["t"] - seconds)
    wall = last["t"] - first["t"]
    return (last["wait_s"] - first["wait_s"]) / wall if wall > 0 else 1.0


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


def ready_workers(real: Cluster, name: str) -> list:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/name=stoker-worker"
    pods = json.loads(real.kubectl("get", "pods", "-n", "default", "-l", selector,
                                   "-o", "json").stdout)["items"]
    return [p for p in pods if ready(p) and not p["metadata"].get("deletionTimestamp")]
