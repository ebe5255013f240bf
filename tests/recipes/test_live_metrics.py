"""Live metrics end to end: a real Prometheus server, run with the project's own scrape
configuration (docker/monitoring/prometheus/), scrapes a 2-process run of the 8B recipe that serves
its endpoints (FINETUNE_METRICS_PORT) and reports to TensorBoard (--report-to) at the same time.

Prometheus is Debian's package (installed if missing; root on Debian, as on CI). The run is the
recipe's own train.py from a copy of its folder, as in the recipe session.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.debian import ensure_debian_packages
from tests.harness import (
    REPO,
    SAMPLE,
    accelerate_command,
    assert_finished,
    free_port,
    launch_env,
    read_metrics,
)

pytestmark = pytest.mark.recipe

RECIPE = REPO / "recipes/llama3-8b-zero3"
MONITORING = REPO / "docker/monitoring/prometheus"
STEPS = 120  # long enough for a few 5 s scrapes of both ranks after the first step
WAIT_S = 240


def api(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    answer = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """Prometheus on loopback with the shipped prometheus.yml; its trainer targets are this
    machine's two rank ports (what docker/monitoring/targets.sh writes for one node)."""
    ensure_debian_packages("prometheus", present="/usr/bin/prometheus")
    folder = tmp_path_factory.mktemp("monitoring") / "prometheus"
    shutil.copytree(MONITORING, folder)
    base = free_port()
    while True:  # two adjacent free ports: rank k serves base + k
        try:
            with socket.create_server(("127.0.0.1", base + 1)):
                break
        except OSError:
            base = free_port()
    (folder / "targets").mkdir(exist_ok=True)
    (folder / "targets/finetune.json").write_text(json.dumps(
        [{"targets": [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"], "labels": {"node": "0"}}]))
    (folder / "targets/dcgm.json").write_text("[]")  # no GPU here
    web = free_port()
    log = (folder / "prometheus.log").open("w")
    server = subprocess.Popen(["/usr/bin/prometheus", f"--config.file={folder / 'prometheus.yml'}",
                               f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
                              stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{web}/-/ready", timeout=2)
            break
        except OSError as exc:
            if server.poll() is not None or time.monotonic() > deadline:
                log_text = (folder / "prometheus.log").read_text()[-4000:]
                raise AssertionError(f"Prometheus did not start:\n{log_text}") from exc
            time.sleep(0.5)
    yield web, base
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def live_run(prometheus, recipe_copy, tiny_llama3, tmp_path_factory):
    """The run, with Prometheus polled while it trains: the first answer in which the tokens/s and
    loss series of both ranks are present, and the finished run's output folder."""
    web, base = prometheus
    output = tmp_path_factory.mktemp("live") / "out"
    cmd = accelerate_command("--model", str(tiny_llama3), "--data", str(SAMPLE), "--max-seq-len", "64",
                             "--micro-batch-size", "2", "--grad-accum", "1", "--lr", "1e-3", "--epochs", "100",
                             "--max-steps", str(STEPS), "--save-every", "0", "--output", str(output),
                             "--report-to", "tensorboard", config="configs/zero3.yaml")
    env = launch_env({"FINETUNE_METRICS_PORT": str(base), "FINETUNE_METRICS_ADDR": "127.0.0.1"})
    proc = subprocess.Popen(cmd, cwd=recipe_copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, deadline = None, time.monotonic() + WAIT_S
    while proc.poll() is None and time.monotonic() < deadline:
        answers = {name: api(web, name) for name in ("finetune_tokens_per_second", "finetune_loss",
                                                     "finetune_rank_tokens_total", 'up{job="finetune"}')}
        if all({r["metric"].get("rank") for r in answers[name]} == {"0", "1"} for name in list(answers)[:3]):
            seen = answers
            break
        time.sleep(1)
    out, _ = proc.communicate(timeout=WAIT_S)
    proc.stdout = out
    return seen, proc, output, base


def test_prometheus_scrapes_both_ranks_while_training(live_run):
    seen, proc, output, _ = live_run
    assert_finished(proc, STEPS, "live run")
    assert seen is not None, f"Prometheus never held the tokens/s and loss series of both ranks:\n{proc.stdout[-3000:]}"
    print(json.dumps(seen["finetune_tokens_per_second"], indent=1))  # shown with pytest -s
    losses = [m["loss"] for m in read_metrics(output)]
    for sample in seen["finetune_loss"]:
        assert min(losses) - 1e-6 <= float(sample["value"][1]) <= max(losses) + 1e-6  # a loss the run logged
        assert sample["metric"]["job"] == "finetune" and sample["metric"]["recipe"] == "llama3-8b-zero3"
    for sample in seen["finetune_tokens_per_second"]:
        assert 0 < float(sample["value"][1]) < 1e7
    for sample in seen["finetune_rank_tokens_total"]:
        assert float(sample["value"][1]) > 0  # each rank's own count
    assert all(sample["value"][1] == "1" for sample in seen['up{job="finetune"}'])


def test_the_endpoints_close_with_the_run(live_run):
    _, proc, _, base = live_run
    for port in (base, base + 1):
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    assert "metrics endpoint: http://" in proc.stdout  # announced once per node
    assert "(one port per local rank), listening on 127.0.0.1" in proc.stdout  # FINETUNE_METRICS_ADDR's address


def test_tensorboard_gets_the_metrics_jsonl_figures(live_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, proc, output, _ = live_run
    events = EventAccumulator(str(output / "tensorboard/llama3-8b-zero3"), size_guidance={"scalars": 0})
    events.Reload()
    records = read_metrics(output)
    numeric = {k for k, v in records[0].items() if k != "step" and isinstance(v, int | float)}
    assert numeric <= set(events.Tags()["scalars"])
    for key in ("loss", "tokens_per_s"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert [logged[r["step"]] for r in records] == pytest.approx([r[key] for r in records], rel=1e-6)

