"""The mission on real pods: kubelet + containerd nodes in network namespaces of their own
(scripts/cluster.sh, real nodes), each worker node behind a capped link. `helm install` starts
the operator as a pod (in-cluster config, its ServiceAccount, the leader Lease); the
DataPipeline's workers run the image on distinct real nodes, spread by the real scheduler, and
read the dataset from an S3 server in the cluster's network; a trainer pod runs
`stoker.Loader("dns:sft-workers.default.svc:7700")` through CoreDNS. Its wait ratio, scraped
by the operator pod, makes the operator add a worker, the ratio falls below target and the
DataPipeline's status and Events say so; the same reading then comes through Prometheus; then
a worker pod and a node's kubelet are killed, and every epoch the trainer saw still holds
each sample exactly once.

Tests run in file order and share the cluster, the release and the trainer."""

import json

import pytest

from conftest import RELEASE_NS, REPO, helm, wait_until
from realpods import (batches, datapipeline, prometheus, ready, ready_workers, real_cluster,
                      require_real_nodes, s3_store, trainer_pod, window_wait_ratio)

NAME = "sft"
SAMPLES = 192
TARGET = 0.2
# Each worker node's link: the workers are network-bound (as on a NIC feeding many ranks),
# so a second worker on another node adds a second link's worth of batches.
LINK_MBIT = 200


@pytest.fixture(scope="module")
def real():
    require_real_nodes()
    with real_cluster(worker_nodes=2, link_mbit=LINK_MBIT) as c:
        yield c


@pytest.fixture(scope="module")
def store(real, tmp_path_factory):
    with s3_store(real, tmp_path_factory.mktemp("s3"), SAMPLES):
        yield


@pytest.fixture(scope="module")
def trainer_out(tmp_path_factory):
    return tmp_path_factory.mktemp("trainer")


def status(real) -> dict:
    return real.get("datapipeline", NAME, ns="default").get("status", {})


def test_the_operator_runs_as_a_pod_of_the_chart(real):
    helm(real, "install", "stoker", str(REPO / "charts" / "stoker"), "-n", RELEASE_NS,
         "--create-namespace", "--wait", "--timeout", "180s")
    (op,) = real.get("pods", ns=RELEASE_NS)["items"]
    assert ready(op), op["status"]
    assert real.get("node", op["spec"]["nodeName"])["metadata"]["labels"]["type"] == "real"
    assert op["spec"]["serviceAccountName"] == "stoker"
    # Leader election from inside the pod: its name holds the Lease.
    wait_until("the operator pod to hold the Lease", lambda: real.get(
        "lease", "stoker-operator", ns=RELEASE_NS)["spec"].get("holderIdentity")
        == op["metadata"]["name"], 60)


def test_a_trainer_pod_reads_through_the_service(real, store, trainer_out):
    autoscaling = {"minReplicas": 1, "maxReplicas": 2, "targetWaitRatio": TARGET,
                   "intervalSeconds": 5,
                   "metrics": {"trainerPods": {"selector": {"app": f"{NAME}-trainer"},
                                               "port": 9400}}}
    dp = datapipeline(NAME, 1, "Spread", LINK_MBIT, autoscaling)
    real.kubectl("apply", "-f", "-", input=json.dumps(dp))
    wait_until("a ready worker pod", lambda: len(ready_workers(real, NAME)) == 1, 180)
    # A 110 ms step asks for ~9 batches/s: more than one worker's link carries (~5.7/s of
    # these ~4.4 MB batches at 200 Mbit/s), less than two.
    real.kubectl("apply", "-f", "-", input=json.dumps(trainer_pod(NAME, 0.11, trainer_out)))
    rows = wait_until("the trainer's first batches",
                      lambda: len(b := batches(trainer_out)) > 20 and b, 180)
    assert rows[0]["per_epoch"] == SAMPLES // 4
    (worker,) = ready_workers(real, NAME)
    assert rows[-1]["worker"].split(":")[0] == worker["status"]["podIP"]


def test_the_wait_ratio_adds_a_worker_on_another_node(real, trainer_out):
    wait_until("the operator to add a worker", lambda: status(real).get("readyReplicas") == 2, 240)
    nodes = {p["spec"]["nodeName"] for p in ready_workers(real, NAME)}
    assert len(nodes) == 2, nodes
    events = json.loads(real.kubectl(
        "get", "events", "-n", "default", "--field-selector",
        f"involvedObject.name={NAME},reason=ScaledUp", "-o", "json").stdout)["items"]
    assert events, "no ScaledUp event"

    def below_target():
        rows = batches(trainer_out)
        return len({r["worker"] for r in rows[-40:]}) == 2 and window_wait_ratio(rows, 10) < TARGET
    wait_until("the trainer's wait ratio below target", below_target, 120)
    wait_until("the status's wait ratio below target",
               lambda: (w := status(real).get("waitRatio")) and w["worst"] < TARGET, 60)


def test_the_same_reading_comes_through_prometheus(real, trainer_out):
    trainer = real.get("pod", f"{NAME}-trainer", ns="default")
    with prometheus(real, trainer_out.parent, f"{trainer['status']['podIP']}:9400") as url:
        patch = {"spec": {"autoscaling": {"metrics": {"trainerPods": None,
                                                      "prometheus": {"url": url}}}}}
        real.kubectl("patch", "datapipeline", NAME, "--type", "merge", "-p", json.dumps(patch))
        generation = real.get("datapipeline", NAME, ns="default")["metadata"]["generation"]

        def read_from_prometheus():
            s = status(real)
            cond = {c["type"]: c for c in s.get("conditions", [])}.get("MetricsAvailable", {})
            return (cond.get("observedGeneration") == generation and cond.get("status") == "True"
                    and s.get("waitRatio", {}).get("worst", 1) < TARGET and s)
        wait_until("the operator to read the wait ratio from Prometheus", read_from_prometheus, 90)
        assert status(real)["readyReplicas"] == 2


def test_a_killed_worker_pod_and_kubelet_lose_nothing(real, trainer_out):
    first, second = sorted(ready_workers(real, NAME), key=lambda p: p["metadata"]["name"])
    real.kubectl("delete", "pod", "-n", "default", first["metadata"]["name"],
                 "--grace-period", "0", "--force")

    def replaced():
        names = {p["metadata"]["name"] for p in ready_workers(real, NAME)}
        return len(names) == 2 and first["metadata"]["name"] not in names
    wait_until("a replacement worker", replaced, 180)
    node = second["spec"]["nodeName"]
    index = node.rsplit("-", 1)[1]
    real.script_out("stop-kubelet", index)

    def node_ready(want: str) -> bool:
        conds = real.get("node", node)["status"]["conditions"]
        return any(c["type"] == "Ready" and c["status"] == want for c in conds)
    wait_until(f"{node} NotReady", lambda: node_ready("Unknown"), 120)
    # The worker's containers outlive their kubelet: batches keep coming.
    seen = len(batches(trainer_out))
    wait_until("batches with the kubelet down", lambda: len(batches(trainer_out)) > seen + 20, 60)
    real.script_out("start-kubelet", index)
    wait_until(f"{node} Ready again", lambda: node_ready("True"), 120)
    # Finish the epoch under way, then check every epoch.
    (trainer_out / "stop").touch()
    pod = f"{NAME}-trainer"
    phase = wait_until("the trainer to finish", lambda: (p := real.get("pod", pod, ns="default")[
        "status"]["phase"]) in ("Succeeded", "Failed") and p, 300)
    logs = real.kubectl("logs", "-n", "default", pod, check=False)
    assert phase == "Succeeded", logs.stdout[-2000:] + logs.stderr[-2000:]
    rows = batches(trainer_out)
    epochs = {}
    for r in rows:
        epochs.setdefault(r["epoch"], []).extend(r["ids"] + r["skipped"])
    assert len(epochs) >= 2
    for epoch, ids in epochs.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: lost or duplicated samples"
    assert not any(r["skipped"] for r in rows)
