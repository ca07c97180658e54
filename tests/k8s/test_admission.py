"""Who may write a DataPipeline, on the real control plane: the chart's
ValidatingAdmissionPolicy admits one only if its author may get every Secret it names (its
workers read them with the operator's rights) and only with an allowed worker image; the
chart's roles for DataPipelines aggregate into the built-in view, edit and admin roles."""

import copy
import json

import yaml

from conftest import REPO, wait_until

NS = "authors"
EXAMPLE = yaml.safe_load((REPO / "examples" / "datapipeline.yaml").read_text())
# The release "stoker" of the chart "stoker" (tests/k8s/conftest.py): its full name is "stoker".
EDIT_ROLE = "stoker-datapipelines-edit"


def kubectl_as(cluster, user: str, *args: str, obj=None):
    """kubectl as `user` (the admin impersonates them: admission sees their name and RBAC)."""
    return cluster.kubectl("--as", user, *args, check=False,
                           input=json.dumps(obj) if obj is not None else "")


def can(cluster, user: str, verb: str, what: str) -> bool:
    """Whether `user` may `verb` `what` (a resource, `resource/name` or `resource:subresource`)."""
    resource, _, sub = what.partition(":")
    args = ["--subresource", sub] if sub else []
    return kubectl_as(cluster, user, "auth", "can-i", verb, resource, *args,
                      "-n", NS).stdout.strip() == "yes"


def pipeline(name: str, secret_at: str, secret: str, image: str = "") -> dict:
    """The example under `name`, its workers handed `secret` the way `secret_at` says."""
    dp = copy.deepcopy(EXAMPLE)
    dp["metadata"] = {"name": name, "namespace": NS}
    spec = dp["spec"]
    spec["source"]["s3"].pop("credentialsSecret", None)
    if secret_at == "env":
        spec["worker"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": secret, "key": "token"}}}]
    elif secret_at == "tokenSecret":
        spec["tokenSecret"] = secret
    elif secret_at == "credentialsSecret":
        spec["source"]["s3"]["credentialsSecret"] = secret
    if image:
        spec["worker"]["image"] = image
    return dp


def setup_namespace(cluster) -> None:
    objects = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        *[{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": n, "namespace": NS},
           "stringData": {"token": f"{n}-value"}} for n in ("hf-token", "other")],
        *[{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
           "metadata": {"name": f"{user}-{role}", "namespace": NS},
           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
           "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}
          for user, role in [("alice", EDIT_ROLE), ("bob", EDIT_ROLE), ("carol", "view"),
                             ("dave", "edit")]],
    ]
    for obj in objects:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


def test_an_author_cannot_hand_workers_a_secret_they_may_not_get(cluster, release):
    setup_namespace(cluster)
    assert can(cluster, "alice", "create", "datapipelines.stoker.dev")
    assert not can(cluster, "alice", "get", "secret/hf-token")
    refusals = {
        "env": "worker.env reads Secrets hf-token in authors, and alice may not get every one of them",
        "tokenSecret": "tokenSecret hf-token is a Secret in authors that alice may not get",
        "credentialsSecret": "source.s3.credentialsSecret hf-token is a Secret in authors that alice "
                             "may not get (the workers would read it for them)",
    }
    for at, refusal in refusals.items():
        name = f"via-{at.lower()}"
        r = kubectl_as(cluster, "alice", "apply", "-f", "-", obj=pipeline(name, at, "hf-token"))
        assert r.returncode != 0, f"admitted with the Secret in {at}"
        assert f"DataPipeline {name}: {refusal}" in r.stderr, r.stderr
    # The same author, allowed to get that one Secret: admitted; still not with another one.
    cluster.kubectl("create", "role", "get-hf-token", "-n", NS, "--verb=get",
                    "--resource=secrets", "--resource-name=hf-token")
    cluster.kubectl("create", "rolebinding", "alice-get-hf-token", "-n", NS,
                    "--role=get-hf-token", "--user=alice")
    wait_until("alice to get hf-token", lambda: can(cluster, "alice", "get", "secret/hf-token"))
    r = kubectl_as(cluster, "alice", "apply", "-f", "-", obj=pipeline("hers", "env", "hf-token"))
    assert r.returncode == 0, r.stderr
    stored = cluster.get("dp", "hers", NS)["spec"]["worker"]["env"][0]
    assert stored["valueFrom"]["secretKeyRef"]["name"] == "hf-token", stored
    r = kubectl_as(cluster, "alice", "apply", "-f", "-", obj=pipeline("hers", "tokenSecret", "other"))
    assert r.returncode != 0 and "tokenSecret other is a Secret in authors that alice may not get" in r.stderr, r.stderr
    # Someone else may scale her pipeline (a subresource), not edit it: a new image or
    # command would run with her Secret.
    r = kubectl_as(cluster, "bob", "scale", "dp/hers", "-n", NS, "--replicas=2")
    assert r.returncode == 0, r.stderr
    r = kubectl_as(cluster, "bob", "label", "dp/hers", "-n", NS, "team=b")
    assert r.returncode != 0 and "worker.env reads Secrets hf-token in authors, and bob may not get" in r.stderr, r.stderr
    cluster.kubectl("delete", "dp", "hers", "-n", NS)


def test_only_allowed_worker_images_are_admitted(cluster, release):
    setup_namespace(cluster)
    for image in ["registry.example/miner:1", "ghcr.io/stoker-dev/stoker-evil:1",
                  "ghcr.io/stoker-dev/stokerx"]:
        r = kubectl_as(cluster, "dave", "apply", "--dry-run=server", "-f", "-",
                       obj=pipeline("img", "", "", image))
        assert r.returncode != 0, f"{image} admitted"
        assert (f"worker.image {image} is not among the images the cluster allows "
                "(ghcr.io/stoker-dev/stoker)") in r.stderr, r.stderr
    for image in ["ghcr.io/stoker-dev/stoker", "ghcr.io/stoker-dev/stoker:0.1.0",
                  "ghcr.io/stoker-dev/stoker@sha256:" + "0" * 64]:
        r = kubectl_as(cluster, "dave", "apply", "--dry-run=server", "-f", "-",
                       obj=pipeline("img", "", "", image))
        assert r.returncode == 0, f"{image}: {r.stderr}"


def test_the_roles_for_datapipelines_aggregate_into_view_and_edit(cluster, release):
    setup_namespace(cluster)
    # The built-in roles gain the chart's rules when the controller manager aggregates them.
    wait_until("edit to cover DataPipelines",
               lambda: can(cluster, "dave", "create", "datapipelines.stoker.dev"))
    assert can(cluster, "dave", "delete", "datapipelines.stoker.dev")
    assert can(cluster, "carol", "list", "datapipelines.stoker.dev")
    assert can(cluster, "carol", "get", "datapipelines.stoker.dev:scale")
    assert not can(cluster, "carol", "create", "datapipelines.stoker.dev")
    assert not can(cluster, "carol", "patch", "datapipelines.stoker.dev:scale")
    assert can(cluster, "alice", "patch", "datapipelines.stoker.dev:scale")
    assert not can(cluster, "alice", "patch", "datapipelines.stoker.dev:status")
