"""The Grafana dashboard against a real Prometheus: a local pipeline (embedded S3, worker
processes, trainer ranks through the real client, the operator's autoscaler over processes)
runs while Prometheus scrapes every /metrics endpoint; then every panel's query, every variable
and the scale annotation must return data with the labels its legend names. promtool checks
each endpoint's exposition on the way.

Needs `prometheus` and `promtool` (Debian's prometheus package; scripts/setup-test-deps.sh
installs it). With STOKER_DASHBOARD_PNG=path, also renders the key panels over the run.
"""

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts/stoker/dashboards/stoker.json"
ALERTS = REPO / "charts/stoker/alerts/stoker-alerts.yaml"
RUN_S = 40


def tool(name):
    path = shutil.which(name)
    if path is None:
        if os.environ.get("STOKER_REQUIRE_PROMETHEUS"):
            pytest.fail(f"{name} not found (scripts/setup-test-deps.sh installs it)")
        pytest.skip(f"{name} not installed")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def query(base, expr, at):
    q = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    body = json.loads(get(f"{base}/api/v1/query?{q}"))
    assert body["status"] == "success", body
    return body["data"]["result"]


def query_range(base, expr, start, end, step=1):
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    body = json.loads(get(f"{base}/api/v1/query_range?{q}"))
    assert body["status"] == "success", body
    return body["data"]["result"]


def concrete(expr):
    """The dashboard's variables as Prometheus sees them with "All" selected."""
    return (expr.replace("$__rate_interval", "15s")
                .replace("$namespace", ".*").replace("$pipeline", ".*"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    prometheus, promtool = tool("prometheus"), tool("promtool")
    stoker = os.environ.get("STOKER_BIN", str(REPO / "target/release/stoker"))
    lab = os.environ.get("STOKER_LAB", str(pathlib.Path(stoker).with_name("stoker-lab")))
    tmp = tmp_path_factory.mktemp("observability")
    targets = tmp / "targets.json"
    targets.write_text("[]")
    port = free_port()
    (tmp / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{ALERTS}"]
scrape_configs:
  - job_name: stoker
    honor_labels: true
    file_sd_configs: [{{files: ["{targets}"], refresh_interval: 1s}}]
""")
    prom = subprocess.Popen(
        [prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    demo = subprocess.Popen(
        # A 30 ms step asks ~270 samples/s: more than one worker gives, so the autoscaler acts.
        [lab, "demo", "--observe-s", str(RUN_S), "--samples", "120", "--max-workers", "3",
         "--step-ms", "30",
         "--metrics-listen", "127.0.0.1:0", "--prometheus-targets", str(targets),
         "--cache", str(tmp / "cache")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        start = time.time()
        # Mid-run: every endpoint's exposition passes promtool.
        time.sleep(RUN_S / 2 + 15)
        checked = []
        for group in json.loads(targets.read_text()):
            for addr in group["targets"]:
                text = get(f"http://{addr}/metrics")
                r = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                                   capture_output=True)
                checked.append((group["labels"]["component"], addr, r.returncode, r.stdout + r.stderr))
        out, _ = demo.communicate(timeout=300)
        assert demo.returncode == 0, out
        end = time.time() - 3
        yield {"base": base, "start": start, "end": end, "checked": checked, "out": out}
    finally:
        demo.kill()
        prom.kill()


def test_promtool_accepts_every_metrics_endpoint(run):
    components = {c for c, *_ in run["checked"]}
    assert components == {"worker", "trainer", "autoscaler"}, run["checked"]
    for component, addr, rc, out in run["checked"]:
        assert rc == 0, f"{component} {addr}: {out}"


def test_every_panel_returns_data_with_its_legend_labels(run):
    dash = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            result = query(run["base"], concrete(t["expr"]), run["end"])
            if not result:
                empty.append(f'{panel["title"]}: {t["expr"]}')
                continue
            wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"]))
            for series in result:
                missing = wanted - set(series["metric"])
                assert not missing, f'{panel["title"]}: {t["legendFormat"]} lacks {missing}'
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_variables_and_scale_annotations(run):
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        metric, label = re.match(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"]).groups()
        q = urllib.parse.urlencode({"match[]": metric, "start": run["start"], "end": run["end"]})
        values = json.loads(get(f'{run["base"]}/api/v1/label/{label}/values?{q}'))["data"]
        assert values, f"variable {var['name']} has no values"
    for ann in dash["annotations"]["list"]:
        got = query_range(run["base"], concrete(ann["expr"]), run["start"], run["end"])
        desired = query_range(run["base"], "stoker_operator_desired_workers", run["start"], run["end"])
        seen = sorted({v[1] for s in desired for v in s["values"]})
        assert got, f"annotation {ann['name']} never fired; desired workers seen: {seen}"


def test_render_the_key_panels(run):
    path = os.environ.get("STOKER_DASHBOARD_PNG")
    if not path:
        pytest.skip("set STOKER_DASHBOARD_PNG=docs/dashboard.png to render")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dash = json.loads(DASHBOARD.read_text())
    keys = [p for p in dash["panels"] if p["id"] in (1, 2, 3, 4, 6, 7)]
    fig, axes = plt.subplots(3, 2, figsize=(13, 10))
    for ax, panel in zip(axes.flat, keys):
        for t in panel["targets"]:
            for series in query_range(run["base"], concrete(t["expr"]), run["start"], run["end"]):
                xs = [float(v[0]) - run["start"] for v in series["values"]]
                ys = [float(v[1]) for v in series["values"]]
                label = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: series["metric"].get(m.group(1), ""),
                               t["legendFormat"])
                ax.plot(xs, ys, label=label)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("seconds into the run")
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle("Stoker dashboard over `stoker-lab demo --observe-s 40` (2 cores, embedded S3)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
