"""Spread vs pack on real pods: the NIC-bound experiment of `stoker-lab bench spread`, with the
workers placed by the real scheduler on real kubelet nodes whose links are capped (the real
nodes of scripts/cluster.sh), the operator as a pod of the chart, and a trainer pod on the
uncapped trainer node reading through the headless Service as fast as it can (no step time).

    benches/spread_pods.py [--nodes 3] [--workers 3] [--link-mbit 200] [--seconds 30] \
        [--json-out docs/spread-pods.json]

One DataPipeline per placement (Pack: the operator asks the scheduler to keep workers
together; Spread: a per-node bandwidth budget of one worker), the same dataset and trainer.
Measured after a warm-up: the batches the trainer received per second and what each worker
node's link carried (its veth counters in the hub). Needs root (network namespaces)."""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "k8s"))
from conftest import REPO, RELEASE_NS, helm, wait_until  # noqa: E402
from realpods import (batches, datapipeline, ready_workers, real_cluster, s3_store,  # noqa: E402
                      trainer_pod)


def link_bytes(real, nodes: int) -> list:
    """Bytes each worker node has sent, read on the hub's side of its link."""
    hub = real.script_out("netns").split()[0]
    return [int(subprocess.run(["ip", "netns", "exec", hub, "cat",
                                f"/sys/class/net/node{i}/statistics/rx_bytes"],
                               check=True, capture_output=True, text=True).stdout)
            for i in range(nodes)]


def one_run(real, mode: str, a, out: pathlib.Path) -> dict:
    name = mode.lower()
    real.kubectl("apply", "-f", "-", input=json.dumps(datapipeline(name, a.workers, mode,
                                                                   a.link_mbit)))
    wait_until(f"{a.workers} ready {name} workers",
               lambda: len(ready_workers(real, name)) == a.workers, 300)
    placed = sorted(p["spec"]["nodeName"] for p in ready_workers(real, name))
    real.kubectl("apply", "-f", "-", input=json.dumps(trainer_pod(name, 0, out)))
    wait_until("the trainer's first batches", lambda: len(batches(out)) > 10, 180)
    time.sleep(a.warmup)
    rows0, bytes0 = batches(out), link_bytes(real, a.nodes)
    time.sleep(a.seconds)
    rows1, bytes1 = batches(out), link_bytes(real, a.nodes)
    wall = rows1[-1]["t"] - rows0[-1]["t"]
    real.kubectl("delete", "pod", f"{name}-trainer", "--grace-period=1", "--timeout=120s")
    real.kubectl("delete", "datapipeline", name, "--wait=true", "--timeout=120s")
    wait_until(f"the {name} workers to go", lambda: not ready_workers(real, name), 180)
    return {
        "placement": name, "nodes_used": len(set(placed)), "placed": placed,
        "batches_per_s": (len(rows1) - len(rows0)) / wall,
        "wait_ratio": (rows1[-1]["wait_s"] - rows0[-1]["wait_s"]) / wall,
        "node_mb_per_s": [(b1 - b0) / wall / 1e6 for b0, b1 in zip(bytes0, bytes1)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3, help="worker nodes (real kubelets)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--link-mbit", type=int, default=200, help="each worker node's link cap")
    p.add_argument("--seconds", type=float, default=30, help="measured per placement")
    p.add_argument("--warmup", type=float, default=10)
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--json-out", type=pathlib.Path)
    a = p.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="stoker-spread-pods-"))
    with real_cluster(a.nodes, a.link_mbit) as real, s3_store(real, work / "s3", a.samples):
        helm(real, "install", "stoker", str(REPO / "charts" / "stoker"), "-n", RELEASE_NS,
             "--create-namespace", "--wait", "--timeout", "180s")
        results = []
        for mode in ("Pack", "Spread"):
            out = work / mode.lower()
            out.mkdir()
            results.append(one_run(real, mode, a, out))
    link = a.link_mbit / 8
    print(f"\n{a.workers} workers, {a.nodes} worker nodes with {a.link_mbit} Mbit/s links "
          f"({link:.0f} MB/s), one trainer pod asking as fast as it can, {a.seconds:.0f} s each")
    print(f"{'placement':<10} {'nodes used':>10} {'batches/s':>10} {'wait ratio':>11}  "
          f"per-node link MB/s")
    for r in results:
        links = " ".join(f"{v:5.1f}" for v in r["node_mb_per_s"])
        print(f"{r['placement']:<10} {r['nodes_used']:>10} {r['batches_per_s']:>10.1f} "
              f"{r['wait_ratio']:>11.2f}  {links}")
    pack, spread = results
    print(f"spread / pack: {spread['batches_per_s'] / pack['batches_per_s']:.2f}x batches/s")
    if a.json_out:
        a.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                          "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
