"""The mission on real pods: kubelet + containerd nodes in network namespaces of their own
(scripts/cluster.sh up with STOKER_CLUSTER_REAL_NODES), each worker node behind a capped link.
`helm install` starts the operator as a pod (in-cluster config, its ServiceAccount, the leader
Lease); the DataPipeline's workers run the image on distinct real nodes, spread by the real
scheduler, and read the dataset from an S3 server in the cluster's network; a trainer pod
runs `stoker.Loader("dns:sft-workers.default.svc:7700")` through CoreDNS. Its wait ratio,
scraped by the operator pod, makes the operator add a worker, the ratio falls below target
and the DataPipeline's status and Events say so; then a worker pod and a node's kubelet are
killed, and every epoch the trainer saw still holds each sample exactly once.

Tests run in file order and share the cluster, the release and the trainer."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import BIN, CACHE, REPO, RELEASE_NS, Cluster, helm, wait_until

IMAGE_ARCHIVE = CACHE / "image" / "stoker.oci.tar"
HUB = "10.77.0.1"
NAME = "sft"
SAMPLES = 192
TARGET = 0.2
# Each worker node's link: the workers are network-bound (as on a real NIC feeding many ranks),
# so a second worker on another node adds a second link's worth of batches.
LINK_MBIT = 200


def lab_bin() -> str:
    stoker = os.environ.get("STOKER_BIN", str(REPO / "target" / "release" / "stoker"))
    return os.environ.get("STOKER_LAB", str(pathlib.Path(stoker).with_name("stoker-lab")))


@pytest.fixture(scope="module")
def real():
    """Two worker nodes and one trainer node (uncapped), no kwok nodes."""
    if os.geteuid() != 0 or not IMAGE_ARCHIVE.exists() or not (BIN / "kubelet").exists():
        msg = ("real nodes need root, the image archive (scripts/build-image.sh) and kubelet "
               "(scripts/setup-k8s-tools.sh)")
        if os.environ.get("STOKER_REQUIRE_CLUSTER"):
            pytest.fail(msg)
        pytest.skip(msg)
    state = pathlib.Path(tempfile.mkdtemp(prefix="stoker-real-"))
    c = Cluster(state, port_base=40000 + os.getpid() % 20000, real_nodes=3, trainer_nodes=1,
                fake_nodes=0, link_mbit=LINK_MBIT)
    try:
        yield c
    finally:
        c.down()
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def store(real, tmp_path_factory):
    """The dataset and the tokenizer in an S3 server in the cluster's hub namespace (the pods
    reach it at 10.77.0.1:9000, as they would a store beside the cluster)."""
    root = tmp_path_factory.mktemp("s3")
    subprocess.run([lab_bin(), "synth", "--out", str(root / "datasets" / "sft"), "--samples",
                    str(SAMPLES), "--samples-per-shard", "32", "--min-side", "256",
                    "--max-side", "640"], check=True, capture_output=True)
    (root / "datasets" / "tok").mkdir()
    tok = pathlib.Path(os.environ.get("STOKER_TOKENIZER", CACHE / "qwen-tokenizer"))
    shutil.copy(tok / "tokenizer.json", root / "datasets" / "tok" / "tokenizer.json")
    hub = real.script_out("netns").split()[0]
    log = open(root.parent / "s3.log", "w")
    proc = subprocess.Popen(["ip", "netns", "exec", hub, lab_bin(), "bench", "s3-server",
                             "--root", str(root), "--listen", f"{HUB}:9000"],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout.readline().startswith("listening"), "the S3 server did not start"
    yield
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def trainer_dir(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("trainer")
    d.chmod(0o777)
    return d


def pods(real: Cluster, selector: str) -> list:
    return json.loads(real.kubectl("get", "pods", "-n", "default", "-l", selector,
                                   "-o", "json").stdout)["items"]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


WORKERS = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/name=stoker-worker"


def ready_workers(real: Cluster) -> list:
    return [p for p in pods(real, WORKERS) if ready(p) and not p["metadata"].get("deletionTimestamp")]


def test_the_operator_runs_as_a_pod_of_the_chart(real):
    helm(real, "install", "stoker", str(REPO / "charts" / "stoker"), "-n", RELEASE_NS,
         "--create-namespace", "--wait", "--timeout", "180s")
    (op,) = real.get("pods", ns=RELEASE_NS)["items"]
    assert ready(op), op["status"]
    node = real.get("node", op["spec"]["nodeName"])
    assert node["metadata"]["labels"]["type"] == "real"
    assert op["spec"]["serviceAccountName"] == "stoker"
    # Leader election from inside the pod: its name holds the Lease.
    wait_until("the operator pod to hold the Lease", lambda: real.get(
        "lease", "stoker-operator", ns=RELEASE_NS)["spec"].get("holderIdentity")
        == op["metadata"]["name"], 60)


def trainer_pod(step_s: float, log: str) -> dict:
    """A pod on the trainer node running tests/k8s/trainer.py with this machine's Python and
    the installed `stoker` package (mounted read-only from the host: the image holds only the
    `stoker` binary)."""
    venv, base = pathlib.Path(sys.prefix), pathlib.Path(sys.base_prefix)
    mounts = {"usr": "/usr", "python": str(base), "venv": str(venv),
              "code": str(pathlib.Path(__file__).parent)}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{NAME}-trainer", "labels": {"app": f"{NAME}-trainer"}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"stoker.dev/role": "trainer"},
            "containers": [{
                "name": "trainer", "image": "ghcr.io/stoker-dev/stoker:0.1.0",
                "imagePullPolicy": "Never",
                "command": [str(venv / "bin" / "python"), f"{mounts['code']}/trainer.py",
                            f"dns:{NAME}-workers.default.svc:7700", f"/out/{log}", str(step_s),
                            NAME, "/out/stop"],
                "env": [{"name": "STOKER_TOKEN", "valueFrom": {"secretKeyRef": {
                    "name": f"{NAME}-token", "key": "token"}}}],
                "ports": [{"name": "metrics", "containerPort": 9400}],
                "securityContext": {"runAsUser": 0},
                "volumeMounts": [{"name": k, "mountPath": v, "readOnly": True}
                                 for k, v in mounts.items()]
                + [{"name": "out", "mountPath": "/out"}],
            }],
            "volumes": [{"name": k, "hostPath": {"path": v}} for k, v in mounts.items()]
            + [{"name": "out", "hostPath": {"path": "TRAINER_DIR"}}],
        },
    }


def datapipeline() -> dict:
    return {
        "apiVersion": "stoker.dev/v1alpha1", "kind": "DataPipeline",
        "metadata": {"name": NAME},
        "spec": {
            "source": {"s3": {"uri": "s3://datasets/sft", "endpoint": f"http://{HUB}:9000",
                              "region": "us-east-1", "pathStyle": True,
                              "credentialsSecret": "s3-credentials"}},
            "preprocessing": {"preset": "qwen2-vl", "maxPixels": 200704,
                              "tokenizer": "s3://datasets/tok/tokenizer.json"},
            "plan": {"seed": 7, "globalBatchSize": 4, "worldSize": 1},
            "worker": {"nodeSelector": {"stoker.dev/role": "worker"},
                       "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                                     "limits": {"cpu": "500m", "memory": "1Gi"}}},
            # One worker per node: each node's link is one worker's worth.
            "placement": {"mode": "Spread", "nodeBandwidthGbps": LINK_MBIT / 1000,
                          "workerEgressGbps": LINK_MBIT / 1000},
            "replicas": 1,
            "trainerSelector": {"app": f"{NAME}-trainer"},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "targetWaitRatio": TARGET,
                            "intervalSeconds": 5,
                            "metrics": {"trainerPods": {"selector": {"app": f"{NAME}-trainer"},
                                                        "port": 9400}}},
        },
    }


def batches(trainer_dir: pathlib.Path, log: str) -> list:
    path = trainer_dir / log
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line being written
    return out


def window_wait_ratio(rows: list, seconds: float) -> float:
    """The trainer's wait ratio over its last `seconds` (blocked time / wall time)."""
    last = rows[-1]
    first = next(r for r in rows if r["t"] >= last["t"] - seconds)
    wall = last["t"] - first["t"]
    return (last["wait_s"] - first["wait_s"]) / wall if wall > 0 else 1.0


def test_a_trainer_pod_reads_through_the_service(real, store, trainer_dir):
    real.kubectl("create", "secret", "generic", "s3-credentials",
            "--from-literal=AWS_ACCESS_KEY_ID=stoker-embedded",
            "--from-literal=AWS_SECRET_ACCESS_KEY=stoker-embedded-secret")
    real.kubectl("apply", "-f", "-", input=json.dumps(datapipeline()))
    wait_until("a ready worker pod", lambda: len(ready_workers(real)) == 1, 180)
    # A 110 ms step asks for ~9 batches/s: more than one worker's link carries (~5.7/s of
    # these ~4.4 MB batches at 200 Mbit/s), less than two.
    pod = json.dumps(trainer_pod(0.11, "batches.jsonl")).replace("TRAINER_DIR", str(trainer_dir))
    real.kubectl("apply", "-f", "-", input=pod)
    rows = wait_until("the trainer's first batches",
                      lambda: len(b := batches(trainer_dir, "batches.jsonl")) > 20 and b, 180)
    assert rows[0]["per_epoch"] == SAMPLES // 4
    (worker,) = ready_workers(real)
    assert rows[-1]["worker"].split(":")[0] == worker["status"]["podIP"]


def test_the_wait_ratio_adds_a_worker_on_another_node(real, trainer_dir):
    def scaled():
        dp = real.get("datapipeline", NAME, ns="default")
        return dp.get("status", {}).get("readyReplicas") == 2 and dp
    wait_until("the operator to add a worker", scaled, 240)
    nodes = {p["spec"]["nodeName"] for p in ready_workers(real)}
    assert len(nodes) == 2, nodes
    events = json.loads(real.kubectl("get", "events", "-n", "default", "--field-selector",
                                f"involvedObject.name={NAME},reason=ScaledUp",
                                "-o", "json").stdout)["items"]
    assert events, "no ScaledUp event"
    # Once both workers serve, the trainer waits less than the target.
    def below_target():
        rows = batches(trainer_dir, "batches.jsonl")
        return len({r["worker"] for r in rows[-40:]}) == 2 and window_wait_ratio(rows, 10) < TARGET
    wait_until("the trainer's wait ratio below target", below_target, 120)
    def status_below():
        w = real.get("datapipeline", NAME, ns="default").get("status", {}).get("waitRatio")
        return w and w["worst"] < TARGET and w
    wait_until("the status's wait ratio below target", status_below, 60)


def test_a_killed_worker_pod_and_kubelet_lose_nothing(real, trainer_dir):
    first, second = sorted(ready_workers(real), key=lambda p: p["metadata"]["name"])
    real.kubectl("delete", "pod", "-n", "default", first["metadata"]["name"],
            "--grace-period", "0", "--force")
    wait_until("a replacement worker", lambda: len(ready_workers(real)) == 2 and first[
        "metadata"]["name"] not in {p["metadata"]["name"] for p in ready_workers(real)}, 180)
    node = second["spec"]["nodeName"]
    index = node.rsplit("-", 1)[1]
    real.script_out("stop-kubelet", index)

    def node_ready(want: str):
        conds = real.get("node", node)["status"]["conditions"]
        return any(c["type"] == "Ready" and c["status"] == want for c in conds)
    wait_until(f"{node} NotReady", lambda: node_ready("Unknown"), 120)
    # The worker's containers outlive their kubelet: batches keep coming.
    seen = len(batches(trainer_dir, "batches.jsonl"))
    wait_until("batches with the kubelet down",
               lambda: len(batches(trainer_dir, "batches.jsonl")) > seen + 20, 60)
    real.script_out("start-kubelet", index)
    wait_until(f"{node} Ready again", lambda: node_ready("True"), 120)
    # Finish the epoch under way and check every epoch.
    (trainer_dir / "stop").touch()
    wait_until("the trainer to finish", lambda: real.get(
        "pod", f"{NAME}-trainer", ns="default")["status"]["phase"] in ("Succeeded", "Failed"),
        300)
    phase = real.get("pod", f"{NAME}-trainer", ns="default")["status"]["phase"]
    logs = real.kubectl("logs", "-n", "default", f"{NAME}-trainer", check=False)
    assert phase == "Succeeded", logs.stdout[-2000:] + logs.stderr[-2000:]
    rows = batches(trainer_dir, "batches.jsonl")
    epochs = {}
    for r in rows:
        epochs.setdefault(r["epoch"], []).extend(r["ids"] + r["skipped"])
    assert len(epochs) >= 2
    for epoch, ids in epochs.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: lost or duplicated samples"
    assert not any(r["skipped"] for r in rows)
