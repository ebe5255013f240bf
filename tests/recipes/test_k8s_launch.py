"""The Kubernetes manifests' own commands (recipes/*/k8s/*.yaml), run as their pods would run them, on CPU.

The container command is taken out of the YAML and run on each "node" under ``ip netns exec`` (a
host of its own on a veth pair, 10.203.0.1 and .2, whose ends are both named eth0) and ``unshare
--pid`` (the shell is PID 1, as in a container), with the manifest's ``env`` and the variables its
controller injects (``controller_env``) for the same manifest with 1 process per node (2 on the 8B
recipe's one node). Node 0's name (a TrainJob pod's DNS name, a PyTorchJob Master's Service)
resolves to its address through each host's /etc/hosts, as the cluster's DNS would. Only these
change against the manifest: MODEL, DATA, OUTPUT and TRAIN_ARGS (a tiny model, the shipped sample,
sizes and step counts) and HF_HOME (a temporary folder).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import (
    REPO,
    SAMPLE,
    SAMPLE_REVIEWS,
    assert_finished,
    launch_env,
    netns_unavailable,
    read_metrics,
    read_run_info,
    two_hosts,
    wait_all,
)
from tests.unit.repo.test_k8s_manifests import (
    RETRYABLE_EXIT,
    command,
    controller_env,
    load,
    main_host,
    manifest_env,
    nodes_and_procs,
    with_procs_per_node,
)

pytestmark = pytest.mark.recipe

RECIPE = REPO / "recipes/llama3-70b-qlora"
# the 70B recipe test's sizes (tests/recipes/test_llama3_70b_qlora.py), one rank per node
SIZES = "--max-seq-len 64 --micro-batch-size 4 --grad-accum 2 --lr 2e-3 --lora-rank 8 --lora-dropout 0"
TIMEOUT = 600


@contextlib.contextmanager
def hosts_entries(namespaces: list[str], entries: dict[str, str]):
    """``entries`` (name -> address) added to /etc/hosts inside each namespace: ``ip netns exec``
    bind-mounts /etc/netns/<namespace>/hosts over /etc/hosts. Removed afterwards."""
    made = not Path("/etc/netns").exists()
    lines = Path("/etc/hosts").read_text() + "".join(f"{addr} {name}\n" for name, addr in entries.items())
    try:
        for ns in namespaces:
            (Path("/etc/netns") / ns).mkdir(parents=True)
            (Path("/etc/netns") / ns / "hosts").write_text(lines)
        yield
    finally:
        for ns in namespaces:
            with contextlib.suppress(FileNotFoundError):
                (Path("/etc/netns") / ns / "hosts").unlink()
                (Path("/etc/netns") / ns).rmdir()
        if made:
            with contextlib.suppress(OSError):
                Path("/etc/netns").rmdir()


def pod_envs(doc: dict, nodes: int, overrides: dict[str, str]) -> list[dict[str, str]]:
    """Each node's environment: the manifest's, its controller's, the test's overrides."""
    return [{**manifest_env(doc), **controller_env(doc, rank), **overrides} for rank in range(nodes)]


def start_pods(doc: dict, cwd: Path, namespaces: list[str], envs: list[dict]) -> list[subprocess.Popen]:
    """The manifest's command once per node, each in its network namespace as PID 1 of a PID namespace."""
    cmd = command(doc)
    assert cmd[:2] == ["bash", "-c"], cmd
    return [subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                              *cmd], cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=launch_env(env)) for ns, env in zip(namespaces, envs, strict=True)]


def finish(pods: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    return wait_all(pods, TIMEOUT)


def pid_one(pod: subprocess.Popen) -> int:
    """The host's pid of the pod's PID 1 (the manifest's shell): unshare's forked child."""
    import psutil

    deadline = time.monotonic() + 30
    while not (children := psutil.Process(pod.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    (shell,) = children
    return shell.pid


def run_manifest(path: Path, cwd: Path, overrides: dict[str, str], stop_node: int | None = None,
                 after_step: int = 1) -> list[subprocess.CompletedProcess]:
    """Run the manifest's command on its nodes (1 process each); with ``stop_node``, SIGTERM that node's
    PID 1 once the run has logged ``after_step`` steps, as the kubelet does to a pod it stops."""
    doc = with_procs_per_node(load(path), 1)
    nodes, _ = nodes_and_procs(doc)
    with two_hosts(interface="eth0") as (ns, _, addrs), hosts_entries(ns[:nodes], {main_host(doc): addrs[0]}):
        pods = start_pods(doc, cwd, ns[:nodes], pod_envs(doc, nodes, overrides))
        try:
            if stop_node is not None:
                metrics = Path(overrides["OUTPUT"]) / "metrics.jsonl"
                start = time.monotonic()
                while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= after_step):
                    assert all(p.poll() is None for p in pods), "a node exited before the step it was to stop after"
                    assert time.monotonic() - start < TIMEOUT, f"no step {after_step} in {TIMEOUT} s"
                    time.sleep(0.1)
                os.kill(pid_one(pods[stop_node]), signal.SIGTERM)
            return finish(pods)
        finally:  # unshare's --kill-child takes its PID 1, and with it the whole PID namespace
            for pod in pods:
                if pod.poll() is None:
                    pod.kill()


def overrides_70b(tiny_llama3: Path, output: Path, steps: int) -> dict[str, str]:
    return {"MODEL": str(tiny_llama3), "DATA": str(SAMPLE_REVIEWS), "OUTPUT": str(output),
            "TRAIN_ARGS": f"{SIZES} --max-steps {steps} --save-every 100 --log-every 1",
            "HF_HOME": str(output.parent / "hf-home")}


def assert_one_world_of_two_nodes(output: Path, steps: int) -> dict:
    info = read_run_info(output)
    assert info["devices"] == 2 and info["steps"] == steps
    assert sorted(r["machine_rank"] for r in info["ranks"]) == [0, 1]
    assert all(r["world_size"] == 2 for r in info["ranks"])
    assert (output / "run_record.json").is_file()
    return info


@pytest.fixture
def hosts():
    """Skip where two hosts cannot be made: network namespaces need root, a PID namespace unshare."""
    reason = netns_unavailable() or (None if shutil.which("unshare") else "needs util-linux's 'unshare' command")
    if reason:
        pytest.skip(reason)


def test_the_trainjob_command_runs_as_two_hosts(hosts, recipe_copy, tiny_llama3, tmp_path):
    """The TrainJob's command with the torch-distributed runtime's PET_* variables: node 0 takes
    configs/zero3-main.yaml, node 1 configs/zero3-worker.yaml, and they meet at node 0's DNS name."""
    output = tmp_path / "trainjob"
    nodes = run_manifest(RECIPE / "k8s/trainjob.yaml", recipe_copy, overrides_70b(tiny_llama3, output, steps=2))
    for name, node in zip(("node 0", "node 1"), nodes, strict=True):
        assert_finished(node, steps=2 if name == "node 0" else None, name=name)
    assert_one_world_of_two_nodes(output, steps=2)


def test_a_stopped_pytorchjob_pod_checkpoints_exits_143_and_its_restart_resumes(hosts, recipe_copy, tiny_llama3,
                                                                               tmp_path):
    """The PyTorchJob's command with the operator's MASTER_ADDR, RANK, WORLD_SIZE: SIGTERM to the
    Worker pod's PID 1 (the kubelet stopping it) stops both nodes after the same step with a
    checkpoint, and both exit 143, which restartPolicy OnFailure restarts; the same command then
    resumes and finishes, run_record.json written, exit 0."""
    output, steps = tmp_path / "pytorchjob", 4
    manifest = RECIPE / "k8s/pytorchjob.yaml"
    overrides = overrides_70b(tiny_llama3, output, steps)
    stopped = run_manifest(manifest, recipe_copy, overrides, stop_node=1, after_step=1)
    logs = "\n".join(f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}" for p in stopped)
    assert [p.returncode for p in stopped] == [RETRYABLE_EXIT] * 2, logs
    assert "SIGUSR1 received" in stopped[1].stderr, logs  # the shell passed SIGTERM on as SIGUSR1
    step = int(re.search(rf"after step (\d+) of {steps}; checkpoint: ", stopped[0].stdout).group(1))
    assert 1 <= step < steps and not (output / "run_record.json").exists()
    assert all("exit 143, the restarted pod resumes" in p.stdout for p in stopped)

    restarted = run_manifest(manifest, recipe_copy, overrides)
    for name, node in zip(("Master", "Worker"), restarted, strict=True):
        assert_finished(node, name=name)
    info = assert_one_world_of_two_nodes(output, steps)
    assert info["resumed_from"] and f"step_{step:06d}" in str(info["resumed_from"])
    assert [m["step"] for m in read_metrics(output)] == list(range(1, steps + 1))


def test_the_one_node_trainjob_command_of_the_8b_recipe_runs(hosts, tiny_llama3, tmp_path):
    """One node, 2 processes: the launcher takes the runtime's PET_MASTER_ADDR (the pod's own DNS name)
    as its rendezvous address, since torch reads PET_* as the defaults of its flags."""
    recipe = shutil.copytree(REPO / "recipes/llama3-8b-zero3", tmp_path / "llama3-8b-zero3")
    output = tmp_path / "trainjob-8b"
    doc = with_procs_per_node(load(recipe / "k8s/trainjob.yaml"), 2)
    overrides = {"MODEL": str(tiny_llama3), "DATA": str(SAMPLE), "OUTPUT": str(output), "HF_HOME": str(tmp_path / "hf"),
                 "TRAIN_ARGS": "--max-seq-len 128 --micro-batch-size 4 --grad-accum 2 --lr 1e-3 --max-steps 2"}
    with two_hosts(interface="eth0") as (ns, _, addrs), hosts_entries(ns[:1], {main_host(doc): addrs[0]}):
        (pod,) = finish(start_pods(doc, recipe, ns[:1], pod_envs(doc, 1, overrides)))
    assert_finished(pod, steps=2)
    info = read_run_info(output)
    assert info["devices"] == 2 and sorted(r["rank"] for r in info["ranks"]) == [0, 1]
    assert (output / "run_record.json").is_file()
