"""The operator at cluster size: API requests per minute and resident memory with many
DataPipelines, on the real control plane of scripts/cluster.sh (kwok nodes and pods).

    benches/operator_scale.py --binary target/release/stoker [--baseline OLD_BINARY] \
        [--pipelines 100] [--nodes 20] [--window 700] [--ranks 2]

Each binary in turn runs as the chart's ServiceAccount against the same cluster and the same
pipelines: half with a fixed count, half autoscaled on live trainers (`--ranks` stand-ins of
trainer ranks each, serving /metrics from a network namespace of the bench's own, their wait
ratio 0.02 +- 0.01 and rate 100 +- 3 % samples/s per rank drawn afresh for every reading, as a
real trainer's readings wobble, below the 0.05 target: the autoscaler holds at its minimum),
every one with a per-node bandwidth budget. Counted from the API server's audit log (every
request made with the ServiceAccount's token): the requests to converge (from start until
every pipeline's status shows all its workers ready) and the requests per minute afterwards,
while nothing but the trainers' readings changes, by verb and resource; the operator's RSS at
the end of the window and its peak. The default window, 700 s, is past any 10-minute timer.
One table, the binaries side by side."""

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "k8s"))
from conftest import (RELEASE_NS, SA, Audit, Cluster, Operator, Trainer, TrainerNet,  # noqa: E402
                      helm, wait_until)

REPO = pathlib.Path(__file__).resolve().parents[1]


def pipeline(i: int, ns: str, trainers: dict) -> dict:
    spec = {
        "source": {"s3": {"uri": f"s3://datasets/set-{i}", "endpoint": "http://minio:9000"}},
        "preprocessing": {"preset": "qwen2-vl"},
        "plan": {"seed": i, "globalBatchSize": 64, "worldSize": 8},
        "worker": {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
        "placement": {"mode": "Spread", "nodeBandwidthGbps": 20, "workerEgressGbps": 4},
        "replicas": 2,
        "trainerSelector": {"app": f"trainer-{i}"},
    }
    if i % 2:
        spec["autoscaling"] = {
            "minReplicas": 2, "maxReplicas": 8, "targetWaitRatio": 0.05, "intervalSeconds": 15,
            "metrics": {"urls": [t.url for t in trainers[i]]}}
    return {"apiVersion": "stoker.dev/v1alpha1", "kind": "DataPipeline",
            "metadata": {"name": f"p{i:03d}", "namespace": ns}, "spec": spec}


def rss_mib(pid: int) -> tuple:
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.strip()
    kib = lambda k: int(fields[k].split()[0]) / 1024
    return kib("VmRSS"), kib("VmHWM")


def converged(cluster: Cluster, ns: str) -> int:
    """Pipelines whose status shows all their workers ready, for their current spec."""
    items = cluster.get("datapipelines", ns=ns)["items"]
    done = [d for d in items
            if d.get("status", {}).get("readyReplicas", -1) == d.get("status", {}).get("desiredReplicas")
            and d["status"].get("observedGeneration") == d["metadata"]["generation"]]
    return len(done)


def start_trainers(net: TrainerNet, n: int, ranks: int) -> dict:
    """The autoscaled pipelines' trainers: `ranks` stand-ins each, as `trainers[i]`."""
    trainers = {}
    for i in range(1, n, 2):
        trainers[i] = [Trainer(net, pipeline=f"p{i:03d}", rank=r, wait_jitter=0.01,
                               rate_jitter=0.03, seed=i * 1000 + r) for r in range(ranks)]
        for t in trainers[i]:
            t.wait_ratio, t.rate = 0.02, 100.0
    return trainers


def measure(cluster, kubeconfig, binary, n, window, logs, audit, converge_limit,
            trainers) -> dict:
    """One binary on a namespace of its own: `n` new pipelines, converged and then steady;
    the namespace (and everything the pipelines own) is deleted afterwards."""
    import os
    os.environ["STOKER_BIN"] = binary
    ns = f"bench-{len(list(logs.iterdir()))}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(pipeline(i, ns, trainers))
                                                            for i in range(n)))
    op = Operator(kubeconfig, ns, logs)
    wait_until("the operator to lead", op.is_leader, 60)
    audit.mark()
    t0 = time.monotonic()
    # Until every pipeline converged, or the limit: how many did is part of the result.
    done = 0
    while done < n and time.monotonic() - t0 < converge_limit:
        time.sleep(2)
        try:
            done = converged(cluster, ns)
        except AssertionError:  # kubectl timed out on a loaded machine: ask again
            pass
    converge_s = time.monotonic() - t0
    converge = audit.since_mark()
    # Settle: events of the convergence itself (pods turning ready) pass.
    time.sleep(20)
    audit.mark()
    time.sleep(window)
    steady = audit.since_mark()
    rss, peak = rss_mib(op.proc.pid)
    op.kill()
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    wait_until(f"namespace {ns} to go", lambda: cluster.kubectl(
        "get", "namespace", ns, check=False).returncode != 0, 600, every=5)
    return {"converge_s": converge_s, "converged": done, "converge": converge, "steady": steady,
            "rss": rss, "peak": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", required=True)
    ap.add_argument("--baseline")
    ap.add_argument("--pipelines", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--window", type=int, default=700, help="seconds of steady state counted")
    ap.add_argument("--ranks", type=int, default=2, help="trainer ranks per autoscaled pipeline")
    ap.add_argument("--converge-limit", type=int, default=600,
                    help="seconds to wait for every pipeline to converge")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    import os
    os.environ["STOKER_CLUSTER_NODES"] = str(args.nodes)
    state = pathlib.Path(tempfile.mkdtemp(prefix="stoker-bench-cluster-"))
    cluster = Cluster(state)
    net = TrainerNet()
    try:
        trainers = start_trainers(net, args.pipelines, args.ranks)
        helm(cluster, "install", "stoker", str(REPO / "charts" / "stoker"), "-n", RELEASE_NS,
             "--create-namespace", "--wait", "--timeout", "120s")
        kubeconfig = cluster.token_kubeconfig(SA, RELEASE_NS, state / "sa.kubeconfig")
        logs = state / "operator-logs"
        logs.mkdir()
        audit = Audit(cluster)
        runs = []
        for label, binary in [("baseline", args.baseline), ("this", args.binary)]:
            if binary:
                r = measure(cluster, kubeconfig, binary, args.pipelines, args.window, logs, audit,
                            args.converge_limit, trainers)
                runs.append((label, r))
                print(f"{label}: {r['converged']} converged in {r['converge_s']:.0f} s",
                      file=sys.stderr)
        report(runs, args)
    finally:
        cluster.down()
        net.close()


def report(runs, args) -> None:
    per_min = lambda c: sum(c.values()) * 60 / args.window
    print(f"\n{args.pipelines} DataPipelines, {args.nodes} kwok nodes, "
          f"{args.window} s steady window\n")
    head = "| | " + " | ".join(label for label, _ in runs) + " |"
    print(head)
    print("|---" * (len(runs) + 1) + "|")
    rows = [
        ("requests to converge", lambda r: f"{sum(r['converge'].values())}"),
        ("pipelines converged", lambda r: f"{r['converged']} of {args.pipelines}"),
        ("seconds to converge", lambda r: f"{r['converge_s']:.0f}"),
        ("requests/min, steady", lambda r: f"{per_min(r['steady']):.0f}"),
        ("RSS MiB (peak)", lambda r: f"{r['rss']:.0f} ({r['peak']:.0f})"),
    ]
    for name, cell in rows:
        print(f"| {name} | " + " | ".join(cell(r) for _, r in runs) + " |")
    kinds = sorted({k for _, r in runs for k in r["steady"]} | {k for _, r in runs for k in r["converge"]})
    print("\nsteady requests/min (to converge) by verb and resource\n")
    print(head)
    print("|---" * (len(runs) + 1) + "|")
    for k in kinds:
        cells = [f"{r['steady'][k] * 60 / args.window:.1f} ({r['converge'][k]})" for _, r in runs]
        print(f"| {k[0]} {k[1]} | " + " | ".join(cells) + " |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {label: {**r, "converge": {" ".join(k): v for k, v in r["converge"].items()},
                     "steady": {" ".join(k): v for k, v in r["steady"].items()}}
             for label, r in runs}, indent=1))


if __name__ == "__main__":
    main()
