"""The Helm chart renders what it promises: `helm lint --strict`, `helm template` with each
option, values checked by values.schema.json, least-privilege RBAC, and the dashboard and
alerts shipped byte for byte. (Installing it on a real control plane comes with the cluster
harness.)"""

import json
import os
import pathlib
import shutil
import subprocess

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts/stoker"
# The control plane the cluster tests will run (a helm built from source defaults to 1.20).
KUBE_VERSION = "1.35.0"


def helm():
    path = os.environ.get("STOKER_HELM") or shutil.which("helm")
    if not path or not os.path.exists(path):
        if os.environ.get("STOKER_REQUIRE_HELM"):
            pytest.fail("helm not found (scripts/setup-k8s-tools.sh builds it)")
        pytest.skip("helm not built")
    return path


def render(*sets, ok=True):
    args = [helm(), "template", "sp", str(CHART), "--namespace", "stoker-system",
            "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True)
    if not ok:
        return r
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def test_lint_strict():
    r = subprocess.run([helm(), "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION,
                        "--set", "serviceMonitor.enabled=true,prometheusRule.enabled=true,grafanaDashboard.enabled=true"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_defaults_render_the_operator_with_least_privilege():
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    # The operator's own: ServiceAccount, roles and bindings, Deployment, Service. Its users':
    # two ClusterRoles for DataPipelines and the admission policy with its binding.
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding",
                            "ClusterRoleBinding", "Role", "RoleBinding", "Deployment", "Service",
                            "ClusterRole", "ClusterRole", "ValidatingAdmissionPolicy",
                            "ValidatingAdmissionPolicyBinding"])
    for d in docs:
        for rule in d.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            if "datapipelines-" not in d["metadata"]["name"]:
                assert "delete" not in rule["verbs"], f"the operator never deletes: {rule}"
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][0] == "operator"
    # The workers' metrics port: open to Prometheus's namespace by default, no other.
    assert "--worker-metrics-from=monitoring" in c["args"]
    assert pod["serviceAccountName"] == "sp-stoker"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    # The CRD is in crds/ (installed first, never templated or deleted by Helm).
    assert (CHART / "crds/datapipeline.yaml").read_text() == (REPO / "crds/datapipeline.yaml").read_text()


def test_one_namespace_uses_a_role():
    docs = render("watchNamespace=ml")
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"].get("namespace") == "ml"]
    assert roles, "watching one namespace grants a Role there, not a ClusterRole"
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert "--namespace=ml" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_workers_metrics_port_opens_to_the_namespaces_named():
    dep = next(d for d in render("workerMetricsFrom={monitoring,observability}")
               if d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--worker-metrics-from=monitoring,observability" in args


def test_roles_for_datapipelines_aggregate_and_grant_nothing_else():
    roles = {d["metadata"]["name"]: d for d in render() if "datapipelines-" in d["metadata"]["name"]
             and d["kind"] == "ClusterRole"}
    view, edit = roles["sp-stoker-datapipelines-view"], roles["sp-stoker-datapipelines-edit"]
    agg = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k for k in view["metadata"]["labels"] if k.startswith(agg)} == {agg + r for r in ["view", "edit", "admin"]}
    assert {k for k in edit["metadata"]["labels"] if k.startswith(agg)} == {agg + r for r in ["edit", "admin"]}
    for role in (view, edit):
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["stoker.dev"], rule
            assert all(r.startswith("datapipelines") for r in rule["resources"]), rule
    assert not any(v in rule["verbs"] for rule in view["rules"] for v in ["create", "patch", "update", "delete"])
    # Status is the operator's to write.
    assert not any("datapipelines/status" in r["resources"] and set(r["verbs"]) - {"get", "list", "watch"}
                   for r in edit["rules"])


def test_the_admission_policy_names_the_allowed_images_and_can_be_left_out():
    def policy(*sets):
        docs = render(*sets)
        return ({d["kind"]: d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")})
    vap = policy()
    images = next(v for v in vap["ValidatingAdmissionPolicy"]["spec"]["variables"] if v["name"] == "images")
    assert json.loads(images["expression"]) == ["ghcr.io/stoker-dev/stoker"]
    assert vap["ValidatingAdmissionPolicy"]["spec"]["failurePolicy"] == "Fail"
    assert vap["ValidatingAdmissionPolicyBinding"]["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in vap["ValidatingAdmissionPolicyBinding"]["spec"]
    vap = policy("admission.workerImages={registry.example/ml/,ghcr.io/stoker-dev/stoker}",
                 "watchNamespace=ml")
    images = next(v for v in vap["ValidatingAdmissionPolicy"]["spec"]["variables"] if v["name"] == "images")
    assert json.loads(images["expression"]) == ["registry.example/ml/", "ghcr.io/stoker-dev/stoker"]
    selector = vap["ValidatingAdmissionPolicyBinding"]["spec"]["matchResources"]["namespaceSelector"]
    assert selector == {"matchLabels": {"kubernetes.io/metadata.name": "ml"}}
    assert policy("admission.enabled=false") == {}


def test_monitoring_objects_ship_the_dashboard_and_alerts_verbatim():
    docs = render("serviceMonitor.enabled=true", "prometheusRule.enabled=true",
                  "grafanaDashboard.enabled=true")
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "alerts/stoker-alerts.yaml").read_text())
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["stoker.json"]) == json.loads((CHART / "dashboards/stoker.json").read_text())


def test_the_values_schema_rejects_nonsense():
    for bad in ["replicaCount=0", "image.pullPolicy=Sometimes", "metrics.port=70000", "unknownKey=1",
                "admission.workerImages={a b}", "admission.enabled=maybe"]:
        r = render(bad, ok=False)
        assert r.returncode != 0, f"{bad} was accepted"
        assert "schema" in r.stderr.lower() or "values don't meet" in r.stderr.lower(), r.stderr
