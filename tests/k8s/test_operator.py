"""The operator end to end on a real control plane: the chart, RBAC, the example pipeline,
placement by the real scheduler, autoscaling on trainer metrics, the scale subresource, CEL
and operator-side validation, garbage collection, restarts and leader election.
Tests run in file order and share one cluster and one operator (see conftest.py)."""

import base64
import copy
import json
import pathlib
import time

import subprocess

import pytest
import yaml

from conftest import (REPO, RELEASE_NS, SA, Audit, Operator, Trainer, helm, restricted_namespace,
                      wait_until)

NS = "ml"
EXAMPLE = yaml.safe_load((REPO / "examples" / "datapipeline.yaml").read_text())
OWNED = ["deployment", "service", "poddisruptionbudget", "networkpolicy"]
# What the operator creates beside the owned objects it applies: the token, the CA, the
# workers' certificate (Secrets) and the CA for trainers (a ConfigMap).
CREDENTIALS = [("secret", "{}-token"), ("secret", "{}-tls-ca"), ("secret", "{}-tls"),
               ("configmap", "{}-ca")]


def owned_names(name: str) -> list:
    """(kind, name) of everything pipeline `name` owns."""
    return [(k, f"{name}-workers") for k in OWNED] + [(k, n.format(name)) for k, n in CREDENTIALS]


def secret_text(cluster, name: str, key: str) -> str:
    return base64.b64decode(cluster.get("secret", name, NS)["data"][key]).decode()


def pipeline(name: str, **spec) -> dict:
    """A small DataPipeline: the example's source, no autoscaling, `spec` merged on top."""
    dp = copy.deepcopy(EXAMPLE)
    dp["metadata"] = {"name": name}
    dp["spec"].pop("autoscaling")
    dp["spec"]["placement"] = {"mode": "Spread"}
    dp["spec"]["replicas"] = 1
    dp["spec"]["worker"]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
    dp["spec"].update(spec)
    return dp


def apply(cluster, obj: dict, ns: str = NS, check: bool = True):
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj), check=check)


def worker_pods(cluster, name: str, ns: str = NS) -> list:
    pods = cluster.get("pods", ns=ns, check=True)["items"]
    return [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/instance") == name
            and p["status"].get("phase") == "Running" and "deletionTimestamp" not in p["metadata"]]


def deployment_replicas(cluster, name: str) -> int:
    return cluster.get("deployment", f"{name}-workers", NS)["spec"]["replicas"]


def status(cluster, name: str) -> dict:
    return cluster.get("datapipeline", name, NS).get("status", {})


def condition(cluster, name: str, type_: str) -> dict:
    for c in status(cluster, name).get("conditions", []):
        if c["type"] == type_:
            return c
    return {}


def sample(metrics: str, series: str) -> float:
    """The value of one series (name and labels exactly as exposed) in a /metrics page."""
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return float("nan")


def events(cluster, name: str, reason: str) -> list:
    items = cluster.get("events.events.k8s.io", ns=NS)["items"]
    return [e for e in items if e.get("reason") == reason and e["regarding"]["name"] == name]


# --- the chart and least privilege ------------------------------------------------------------

def test_the_operator_runs_with_the_charts_least_privilege(cluster, operator, operator_kubeconfig):
    restricted_namespace(cluster, NS)
    cluster.kubectl("create", "secret", "generic", "someone-elses", "-n", NS,
                    "--from-literal=password=hunter2")
    as_sa = dict(kubeconfig=operator_kubeconfig, check=False)
    # Secrets: the pipeline's own by name (token, CA, certificate), never listed or watched,
    # so it reads no Secret it does not name; and never deleted.
    for verb in ("list", "watch", "delete"):
        for res in ("secrets", "configmaps"):
            r = cluster.kubectl("auth", "can-i", verb, res, "-n", NS, **as_sa)
            assert r.stdout.strip() == "no", f"{verb} {res}: {r.stdout}"
    r = cluster.kubectl("get", "secrets", "-n", NS, **as_sa)
    assert r.returncode != 0 and "Forbidden" in r.stderr, r.stderr
    for verb in ("get", "create", "patch"):
        assert cluster.kubectl("auth", "can-i", verb, "secrets", "-n", NS,
                               **as_sa).stdout.strip() == "yes", verb
    # Nothing it does not use: no deletes, no pods exec, no RBAC.
    for verb, res in [("delete", "deployments"), ("create", "pods/exec"), ("create", "roles"),
                      ("update", "datapipelines.stoker.dev")]:
        r = cluster.kubectl("auth", "can-i", verb, res, "-n", NS, **as_sa)
        assert r.stdout.strip() == "no", f"{verb} {res}"


def test_watch_namespace_confines_the_operator_to_one_namespace(cluster, release, tmp_path):
    cluster.kubectl("create", "namespace", "team-a")
    cluster.kubectl("create", "namespace", "team-b")
    helm(cluster, "install", "scoped", str(REPO / "charts" / "stoker"), "-n", "team-a",
         "--set", "watchNamespace=team-a", "--skip-crds")
    kubeconfig = cluster.token_kubeconfig("scoped-stoker", "team-a", tmp_path / "kc")
    as_sa = dict(kubeconfig=kubeconfig, check=False)
    can = lambda verb, res, ns: cluster.kubectl("auth", "can-i", verb, res, "-n", ns,
                                                 **as_sa).stdout.strip()
    assert can("patch", "deployments", "team-a") == "yes"
    assert can("list", "datapipelines.stoker.dev", "team-a") == "yes"
    for verb, res in [("patch", "deployments"), ("list", "datapipelines.stoker.dev"),
                      ("create", "secrets"), ("create", "events.events.k8s.io")]:
        assert can(verb, res, "team-b") == "no", f"{verb} {res} in team-b"
    r = cluster.kubectl("get", "datapipelines", "-A", **as_sa)
    assert r.returncode != 0 and "Forbidden" in r.stderr


# --- the example pipeline, as written -----------------------------------------------------

def test_the_example_pipeline_creates_owned_objects_and_spread_admitted_pods(cluster, operator,
                                                                             tmp_path):
    cluster.kubectl("apply", "-n", NS, "-f", str(REPO / "examples" / "datapipeline.yaml"))
    dp = cluster.get("datapipeline", "qwen-sft", NS)
    uid = dp["metadata"]["uid"]
    for kind, name in owned_names("qwen-sft"):
        obj = wait_until(f"{kind} {name}", lambda: cluster.get(kind, name, NS, check=False)
                         if cluster.kubectl("get", kind, name, "-n", NS, check=False).returncode == 0
                         else None)
        owners = obj["metadata"].get("ownerReferences", [])
        assert [(o["kind"], o["uid"], o.get("controller")) for o in owners] == \
            [("DataPipeline", uid, True)], f"{kind}: {owners}"
    # The workers' metrics port is open to the pipeline's namespace and the operator's
    # --worker-metrics-from (Prometheus's), not to every namespace.
    rules = cluster.get("networkpolicy", "qwen-sft-workers", NS)["spec"]["ingress"]
    metrics = next(r for r in rules if r["ports"][0]["port"] == 9090)
    assert metrics["from"] == [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [NS, "monitoring"]}]}}]
    # TLS on by default: the workers serve a certificate of the pipeline's CA for the Service's
    # names, and trainers find that CA in the ConfigMap.
    ca = cluster.get("configmap", "qwen-sft-ca", NS)["data"]["ca.crt"]
    assert secret_text(cluster, "qwen-sft-tls-ca", "ca.crt") == ca
    assert secret_text(cluster, "qwen-sft-tls", "ca.crt") == ca
    tmp = tmp_path
    (tmp / "ca.crt").write_text(ca)
    (tmp / "tls.crt").write_text(secret_text(cluster, "qwen-sft-tls", "tls.crt"))
    for host in ["qwen-sft-workers.ml.svc", "qwen-sft-workers.ml.svc.cluster.local"]:
        subprocess.run(["openssl", "verify", "-CAfile", str(tmp / "ca.crt"), "-verify_hostname",
                        host, str(tmp / "tls.crt")], check=True, capture_output=True)
    r = subprocess.run(["openssl", "verify", "-CAfile", str(tmp / "ca.crt"), "-verify_hostname",
                        "qwen-sft-workers.other.svc", str(tmp / "tls.crt")], capture_output=True)
    assert r.returncode != 0
    # The trainer example mounts that ConfigMap and the token, and is admitted as written.
    job = yaml.safe_load((REPO / "examples" / "trainer-job.yaml").read_text())
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"] == dp["spec"]["trainerSelector"]
    assert pod["spec"]["volumes"][0]["configMap"]["name"] == "qwen-sft-ca"
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["STOKER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "qwen-sft-token"
    assert env["STOKER_TLS_CA"]["value"].startswith(
        pod["spec"]["containers"][0]["volumeMounts"][0]["mountPath"])
    cluster.kubectl("apply", "--dry-run=server", "-n", NS, "-f",
                    str(REPO / "examples" / "trainer-job.yaml"))
    deployment = cluster.get("deployment", "qwen-sft-workers", NS)
    template = deployment["spec"]["template"]
    args = " ".join(template["spec"]["containers"][0]["args"])
    assert "--tls-cert /var/run/stoker-tls/tls.crt" in args and "--insecure-plaintext" not in args
    tls = cluster.get("secret", "qwen-sft-tls", NS)
    assert template["metadata"]["annotations"]["stoker.dev/tls-not-after"] == \
        tls["metadata"]["annotations"]["stoker.dev/tls-not-after"]
    # PodSecurity `restricted` is enforced in the namespace, and the worker pods are admitted.
    pods = wait_until("2 running worker pods", lambda: len(worker_pods(cluster, "qwen-sft")) == 2
                      and worker_pods(cluster, "qwen-sft"), 90)
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == 2, f"spread placement put 2 workers on {nodes}"
    assert all(p["status"]["podIP"].startswith("127.") for p in pods)
    # The printer columns read the status.
    st = wait_until("status.readyReplicas = 2",
                    lambda: status(cluster, "qwen-sft").get("readyReplicas") == 2
                    and status(cluster, "qwen-sft"), 60)
    assert st["desiredReplicas"] == 2
    row = cluster.kubectl("get", "dp", "qwen-sft", "-n", NS).stdout.splitlines()
    assert row[0].split()[:4] == ["NAME", "READY", "DESIRED", "WAIT"], row
    assert row[1].split()[:3] == ["qwen-sft", "2", "2"], row
    # No trainer pods yet: the autoscaler holds and says why.
    assert condition(cluster, "qwen-sft", "MetricsAvailable").get("reason") == "TrainerMetricsMissing"


def test_a_secret_of_the_pipelines_name_that_it_does_not_own_is_left_alone(cluster, operator):
    """The operator writes only into what it created: a CA Secret that was there before the
    pipeline is neither read as its CA nor overwritten; the reconcile fails by name and counts
    it, the pipeline says what is in the way, and no worker starts without its certificate."""
    cluster.kubectl("create", "secret", "generic", "squatted-tls-ca", "-n", NS,
                    "--from-literal=ca.crt=not-ours")
    errors = 'stoker_operator_reconcile_errors_total{kind="not_owned",step="tls"}'
    count = lambda: sample(operator.metrics(), errors) if errors in operator.metrics() else 0
    before = count()
    apply(cluster, pipeline("squatted"))
    wait_until("a counted not_owned error", lambda: count() > before, 60)
    secret = cluster.get("secret", "squatted-tls-ca", NS)
    assert secret["data"] == {"ca.crt": base64.b64encode(b"not-ours").decode()}
    assert "ownerReferences" not in secret["metadata"]
    for kind, name in [("deployment", "squatted-workers"), ("secret", "squatted-tls")]:
        assert cluster.kubectl("get", kind, name, "-n", NS, check=False).returncode != 0, name
    ready = wait_until("Ready=False NotOwned", lambda: (
        c := condition(cluster, "squatted", "Ready")).get("reason") == "NotOwned" and c, 30)
    assert f"Secret {NS}/squatted-tls-ca: exists and is not owned by DataPipeline squatted" \
        in ready["message"], ready
    cluster.kubectl("delete", "dp", "squatted", "-n", NS)
    cluster.kubectl("delete", "secret", "squatted-tls-ca", "-n", NS)


def test_an_object_of_an_owned_name_made_by_someone_else_is_never_taken_over(cluster, operator):
    """No adoption: a Service of the workers' name that was there before the pipeline (not
    labelled as ours, so not in the operator's caches) keeps its selector and gains no owner
    (it would be garbage-collected with the pipeline); the pipeline says what is in the way
    and the error is counted."""
    theirs = {"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "squatter-workers", "namespace": NS},
              "spec": {"selector": {"app": "their-database"}, "ports": [{"port": 5432}]}}
    apply(cluster, theirs)
    errors = 'stoker_operator_reconcile_errors_total{kind="not_owned",step="apply"}'
    count = lambda: sample(operator.metrics(), errors) if errors in operator.metrics() else 0
    before = count()
    apply(cluster, pipeline("squatter"))
    wait_until("a counted not_owned error", lambda: count() > before, 60)
    ready = wait_until("Ready=False NotOwned", lambda: (
        c := condition(cluster, "squatter", "Ready")).get("reason") == "NotOwned" and c, 30)
    assert f"Service {NS}/squatter-workers: exists and is not owned by DataPipeline squatter" \
        in ready["message"], ready
    service = cluster.get("service", "squatter-workers", NS)
    assert service["spec"]["selector"] == {"app": "their-database"}
    assert "ownerReferences" not in service["metadata"]
    cluster.kubectl("delete", "dp", "squatter", "-n", NS)
    # Theirs outlives the pipeline: nothing of it was the pipeline's to collect.
    time.sleep(3)
    assert cluster.get("service", "squatter-workers", NS)["spec"]["selector"] == {
        "app": "their-database"}
    cluster.kubectl("delete", "service", "squatter-workers", "-n", NS)


def test_pack_puts_workers_together(cluster, operator):
    apply(cluster, pipeline("packed", replicas=3, placement={"mode": "Pack"}))
    pods = wait_until("3 running packed workers",
                      lambda: len(worker_pods(cluster, "packed")) == 3
                      and worker_pods(cluster, "packed"), 90)
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == 1, f"pack placement used {nodes}"


def test_a_settled_pipeline_costs_no_api_writes(cluster, operator):
    """Reconciles that find nothing changed send nothing: no apply of unchanged objects, no
    token re-created, no status patch; the pipeline's own metadata edits (no new generation)
    trigger no reconcile at all, and its status patches trigger none either."""
    apply(cluster, pipeline("quiet", replicas=2))
    wait_until("quiet's 2 workers ready in its status",
               lambda: status(cluster, "quiet").get("readyReplicas") == 2, 90)
    ours = frozenset({"quiet"} | {n for _, n in owned_names("quiet")})
    audit = Audit(cluster)
    # Let the reconciles of the pods turning ready pass, then count from here.
    time.sleep(3)
    audit.mark()
    reconciles = lambda: sample(operator.metrics(), 'stoker_operator_reconciles_total{result="ok"}')
    before = reconciles()
    # A change to an owned object that leaves its spec alone (an annotation on the PDB: its
    # generation stays) triggers a reconcile, which finds its objects as it left them. (Not
    # the Deployment: the API server counts its annotations as a new generation.)
    cluster.kubectl("annotate", "pdb", "quiet-workers", "-n", NS, "someone/touched=1")
    cluster.kubectl("annotate", "dp", "quiet", "-n", NS, "someone/touched=1")
    wait_until("a reconcile after the annotation", lambda: reconciles() > before, 30)
    time.sleep(2)
    writes = {k: v for k, v in audit.since_mark(ours).items()
              if k[0] in ("create", "patch", "update")}
    assert writes == {}, f"a reconcile that changed nothing wrote: {writes}"
    # Reads come from the caches: no GET or LIST of anything.
    reads = {k: v for k, v in audit.since_mark().items() if k[0] in ("get", "list")
             and k[1] != "leases"}
    assert reads == {}, f"reconciles read from the API server: {reads}"
    # An edit of the spec the operator owns is undone (re-applied), named by the audit log.
    cluster.kubectl("patch", "service", "quiet-workers", "-n", NS, "--type=merge",
                    "-p", '{"spec":{"publishNotReadyAddresses":true}}')
    wait_until("the Service's edit undone", lambda: cluster.get(
        "service", "quiet-workers", NS)["spec"].get("publishNotReadyAddresses") in (None, False), 30)
    assert audit.since_mark(ours)[("patch", "services")] >= 1
    cluster.kubectl("delete", "dp", "quiet", "-n", NS)


def test_max_workers_per_node_is_a_hard_cap(cluster, operator):
    # 4 nodes x 2 per node: 10 asked, 8 run, at most 2 on any node, and the status says so.
    apply(cluster, pipeline("capped", replicas=10,
                            placement={"mode": "Spread", "maxWorkersPerNode": 2}))
    wait_until("8 running capped workers", lambda: len(worker_pods(cluster, "capped")) == 8, 120)
    per_node = {}
    for p in worker_pods(cluster, "capped"):
        per_node[p["spec"]["nodeName"]] = per_node.get(p["spec"]["nodeName"], 0) + 1
    assert max(per_node.values()) <= 2, per_node
    assert deployment_replicas(cluster, "capped") == 8
    nic = wait_until("NICSaturationRisk", lambda: condition(cluster, "capped", "NICSaturationRisk"))
    assert nic["status"] == "True" and "capped at 8" in nic["message"], nic
    cluster.kubectl("delete", "dp", "capped", "-n", NS)


def test_a_nodes_bandwidth_budget_counts_every_pipelines_workers(cluster, operator):
    # 4 nodes of 20 Gb/s, workers of 8 Gb/s: 2 per node, whichever pipeline they belong to.
    budget = {"mode": "Spread", "nodeBandwidthGbps": 20, "workerEgressGbps": 8}
    apply(cluster, pipeline("first", replicas=4, placement=budget))
    wait_until("first's 4 workers", lambda: len(worker_pods(cluster, "first")) == 4, 120)
    # One of first's workers on each node leaves room for one more each: 8 asked, 4 run.
    apply(cluster, pipeline("second", replicas=8, placement=budget))
    wait_until("second's 4 workers", lambda: len(worker_pods(cluster, "second")) == 4, 120)
    assert deployment_replicas(cluster, "second") == 4
    nic = wait_until("second's NICSaturationRisk",
                     lambda: condition(cluster, "second", "NICSaturationRisk"))
    assert nic["status"] == "True", nic
    assert "capped at 4" in nic["message"] and "other pipelines' workers use bandwidth on 4" \
        in nic["message"], nic
    gbps = {}
    for name in ("first", "second"):
        for p in worker_pods(cluster, name):
            gbps[p["spec"]["nodeName"]] = gbps.get(p["spec"]["nodeName"], 0) + 8
    assert max(gbps.values()) <= 20, gbps
    cluster.kubectl("delete", "dp", "first", "second", "-n", NS)


# --- scaling ----------------------------------------------------------------------------------

def test_autoscaling_follows_the_trainers_wait_ratio(cluster, operator, trainer_net):
    trainer = Trainer(trainer_net)
    rules = {"stabilizationWindowSeconds": 4, "periodSeconds": 2, "maxPods": 4, "maxPercent": 100}
    apply(cluster, pipeline("scaler", replicas=1, autoscaling={
        "minReplicas": 1, "maxReplicas": 4, "targetWaitRatio": 0.1, "intervalSeconds": 2,
        "metrics": {"urls": [trainer.url]},
        "behavior": {"scaleUp": rules, "scaleDown": rules}}))
    # Starved trainer (wait 0.8): more workers.
    up = wait_until("a scale-up", lambda: deployment_replicas(cluster, "scaler") > 1, 90)
    wait_until("a ScaledUp event", lambda: events(cluster, "scaler", "ScaledUp"), 30)
    # The status is patched after the Deployment and the Event: wait for the decision in it.
    def scaled_status():
        st = status(cluster, "scaler")
        return st if st.get("waitRatio") and st.get("lastScaleReason") else None
    st = wait_until("the wait ratio and the scale-up in the status", scaled_status)
    assert st["waitRatio"]["worst"] > 0.5, st
    assert st["lastScaleReason"].startswith("1 -> "), st
    assert condition(cluster, "scaler", "MetricsAvailable")["status"] == "True"
    row = cluster.kubectl("get", "dp", "scaler", "-n", NS).stdout.splitlines()[1].split()
    assert float(row[3]) > 0.5, row  # WAIT column
    peak = wait_until("the scale-up to settle", lambda: deployment_replicas(cluster, "scaler")
                      if deployment_replicas(cluster, "scaler") >= up else None)
    # Fed trainer (wait 0): fewer workers after stabilization.
    trainer.wait_ratio = 0.0
    wait_until("a scale-down", lambda: deployment_replicas(cluster, "scaler") < peak, 120)
    wait_until("a ScaledDown event", lambda: events(cluster, "scaler", "ScaledDown"), 30)
    note = events(cluster, "scaler", "ScaledDown")[0]["note"]
    assert "workers" in note, note
    decisions = 'stoker_operator_scale_decisions_total{direction="%s",namespace="ml",pipeline="scaler"}'
    m = operator.metrics()
    assert sample(m, decisions % "up") >= 1 and sample(m, decisions % "down") >= 1, m
    trainer.shutdown()
    cluster.kubectl("delete", "dp", "scaler", "-n", NS)


def test_kubectl_scale_works_through_the_scale_subresource(cluster, operator):
    apply(cluster, pipeline("fixed", replicas=1))
    wait_until("1 worker", lambda: len(worker_pods(cluster, "fixed")) == 1, 90)
    cluster.kubectl("scale", "dp/fixed", "-n", NS, "--replicas=3")
    wait_until("3 workers", lambda: len(worker_pods(cluster, "fixed")) == 3, 90)
    wait_until("status.replicas = 3", lambda: status(cluster, "fixed").get("replicas") == 3)
    scale = json.loads(cluster.kubectl("get", "--raw",
                                       f"/apis/stoker.dev/v1alpha1/namespaces/{NS}/datapipelines/fixed/scale").stdout)
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3, scale


# --- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("mutate,message", [
    (lambda s: s["autoscaling"].update(minReplicas=20), "minReplicas must not exceed maxReplicas"),
    (lambda s: s.update(trainerSelector={}), "trainerSelector must name at least one label"),
    (lambda s: s.pop("trainerSelector"), "trainerSelector: Required value"),
    (lambda s: s["plan"].update(worldSize=1000), "globalBatchSize must be at least plan.worldSize"),
    (lambda s: s["source"]["s3"].update(uri="https://x"), "must look like s3://bucket/prefix"),
    (lambda s: s["placement"].update(mode="Pack", maxWorkersPerNode=2),
     "maxWorkersPerNode needs mode Spread"),
    (lambda s: s["autoscaling"].update(metrics={"urls": ["http://10.0.0.1:9400/metrics",
                                                         "http://127.0.0.1:9400/metrics"]}),
     "autoscaling.metrics.urls: a metric URL must not name a loopback, link-local"),
    (lambda s: s["autoscaling"].update(metrics={"prometheus": {"url": "http://169.254.169.254/"}}),
     "autoscaling.metrics.prometheus.url: a metric URL must not name a loopback, link-local"),
    (lambda s: s["autoscaling"].update(metrics={"urls": ["http://10.0.0.1/m HTTP/1.0\r\nX-A: 1"]}),
     "without whitespace or control characters"),
])
def test_the_api_server_rejects_invalid_pipelines_with_their_messages(cluster, release, mutate, message):
    dp = copy.deepcopy(EXAMPLE)
    dp["metadata"] = {"name": "bad"}
    mutate(dp["spec"])
    r = apply(cluster, dp, check=False)
    assert r.returncode != 0, "admitted"
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["qwen.sft", "a" * 56])
def test_the_api_server_rejects_a_name_that_cannot_name_the_workers_service(cluster, release, name):
    """A dot, or more than 55 characters, would run workers whose `<name>-workers` Service
    cannot be applied and whose NetworkPolicy never is."""
    dp = copy.deepcopy(EXAMPLE)
    dp["metadata"] = {"name": name}
    r = apply(cluster, dp, check=False)
    assert r.returncode != 0, "admitted"
    assert "must be a DNS-1035 label of at most 55" in r.stderr, r.stderr


def test_a_spec_the_operator_cannot_honour_gets_a_condition_and_an_event(cluster, operator):
    # A tokenizer over https: admitted by the schema, refused by the operator's validate step.
    dp = pipeline("unhonourable")
    dp["spec"]["preprocessing"]["tokenizer"] = "https://huggingface.co/Qwen/tokenizer.json"
    apply(cluster, dp)
    ready = wait_until("Ready=False/InvalidSpec",
                       lambda: condition(cluster, "unhonourable", "Ready").get("reason") == "InvalidSpec"
                       and condition(cluster, "unhonourable", "Ready"))
    assert ready["status"] == "False" and "scheme https:// is not supported" in ready["message"], ready
    ev = wait_until("an InvalidSpec event", lambda: events(cluster, "unhonourable", "InvalidSpec"))
    assert ev[0]["type"] == "Warning" and "preprocessing.tokenizer" in ev[0]["note"]
    assert cluster.kubectl("get", "deployment", "unhonourable-workers", "-n", NS,
                           check=False).returncode != 0, "nothing is applied for an invalid spec"
    assert sample(operator.metrics(), 'stoker_operator_reconcile_errors_total{kind="invalid_spec",step="validate"}') >= 1
    cluster.kubectl("delete", "dp", "unhonourable", "-n", NS)


# --- lifecycle ----------------------------------------------------------------------------

def test_deleting_a_pipeline_collects_what_it_owned_and_its_autoscaler_state(cluster, operator,
                                                                             trainer_net):
    trainer = Trainer(trainer_net)
    apply(cluster, pipeline("doomed", autoscaling={
        "minReplicas": 1, "maxReplicas": 2, "intervalSeconds": 2,
        "metrics": {"urls": [trainer.url]}}))
    series = 'stoker_operator_desired_workers{namespace="ml",pipeline="doomed"}'
    wait_until("the pipeline's series", lambda: series in operator.metrics(), 60)
    wait_until("its Deployment", lambda: cluster.kubectl(
        "get", "deployment", "doomed-workers", "-n", NS, check=False).returncode == 0)
    wait_until("its CA ConfigMap", lambda: cluster.kubectl(
        "get", "configmap", "doomed-ca", "-n", NS, check=False).returncode == 0)
    cluster.kubectl("delete", "dp", "doomed", "-n", NS)
    for kind, name in owned_names("doomed"):
        wait_until(f"{kind} {name} to be collected", lambda: cluster.kubectl(
            "get", kind, name, "-n", NS, check=False).returncode != 0, 90)
    wait_until("the operator to forget the pipeline", lambda: series not in operator.metrics(), 60)
    trainer.shutdown()


def owned_counts(cluster, name: str) -> dict:
    counts = {}
    for kind in OWNED + ["secret", "configmap"]:
        items = cluster.get(kind, ns=NS)["items"]
        counts[kind] = sum(1 for i in items if any(
            o["name"] == name for o in i["metadata"].get("ownerReferences", [])))
    return counts


def test_restarting_the_operator_and_the_api_server_loses_and_duplicates_nothing(
        cluster, operator, operator_kubeconfig, logs):
    token = cluster.get("secret", "qwen-sft-token", NS)["data"]["token"]
    certificates = {n: cluster.get("secret", n, NS)["data"] for n in ("qwen-sft-tls-ca",
                                                                      "qwen-sft-tls")}
    before = owned_counts(cluster, "qwen-sft")
    assert before == dict({k: 1 for k in OWNED}, secret=3, configmap=1), before
    # The API server goes away and comes back while the operator runs. Gone past the renew
    # deadline (10 s), the leader steps down (exits) rather than risk acting beside a new
    # leader, and its Deployment starts it again: here the test does.
    cluster.restart_apiserver()
    cluster.kubectl("scale", "dp/fixed", "-n", NS, "--replicas=2")
    scaled = lambda: deployment_replicas(cluster, "fixed") == 2
    stepped_down = lambda: operator.proc.poll() is not None
    wait_until("the operator to reconcile or step down after the API server restart",
               lambda: stepped_down() or scaled(), 120)
    if stepped_down():
        assert "stepping down: the Lease was not renewed within 10s" in operator.log.read_text()
        again = Operator(operator_kubeconfig, "op-main", logs)
        operator.proc, operator.port, operator.log = again.proc, again.port, again.log
    wait_until("the operator to reconcile after the API server restart", scaled, 120)
    # The operator itself restarts (a new process, the same identity takes its Lease back).
    operator.kill()
    second = Operator(operator_kubeconfig, "op-main", logs)
    try:
        wait_until("the restarted operator to lead", second.is_leader, 60)
        cluster.kubectl("scale", "dp/fixed", "-n", NS, "--replicas=1")
        wait_until("the restarted operator to reconcile",
                   lambda: deployment_replicas(cluster, "fixed") == 1, 90)
        assert owned_counts(cluster, "qwen-sft") == before
        assert cluster.get("secret", "qwen-sft-token", NS)["data"]["token"] == token
        # The same CA and certificate: nothing issued again, no worker rolled.
        for n, data in certificates.items():
            assert cluster.get("secret", n, NS)["data"] == data, n
        names = [d["metadata"]["name"] for d in cluster.get("deployments", ns=NS)["items"]]
        assert len(names) == len(set(names))
    finally:
        operator.proc, operator.port = second.proc, second.port


def test_two_replicas_elect_one_leader_and_the_standby_takes_over(
        cluster, operator, operator_kubeconfig, logs):
    standby = Operator(operator_kubeconfig, "op-standby", logs)
    try:
        time.sleep(6)  # a renew period: the standby has tried and must not lead
        assert operator.is_leader() and not standby.is_leader()
        lease = cluster.get("lease", "stoker-operator", RELEASE_NS)
        assert lease["spec"]["holderIdentity"] == "op-main"
        operator.kill()  # SIGKILL: no goodbye, the Lease must expire
        wait_until("the standby to take over", standby.is_leader, 60)
        lease = cluster.get("lease", "stoker-operator", RELEASE_NS)
        assert lease["spec"]["holderIdentity"] == "op-standby"
        assert lease["spec"]["leaseTransitions"] >= 1
        cluster.kubectl("scale", "dp/fixed", "-n", NS, "--replicas=2")
        wait_until("the new leader to reconcile",
                   lambda: deployment_replicas(cluster, "fixed") == 2, 90)
    finally:
        standby.kill()
