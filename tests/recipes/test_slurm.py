"""Each recipe's slurm/train.sbatch submitted, unchanged, to a real Slurm cluster (tests/slurm_cluster.py:
slurmctld and two slurmd nodes in network namespaces), with only what a CPU site would set: the tiny
model, the sample data and the processes per node in the environment, smaller sizes in TRAIN_ARGS,
and GLOO_SOCKET_IFNAME for the 70B job's two nodes. The jobs end COMPLETED with the losses of the
same runs launched directly (the recipes' golden files), and a 70B job stopped the way Slurm preempts
(``scancel --signal=USR1``) checkpoints on both nodes, requeues itself and finishes where the
uninterrupted run does. The 8B recipe's slurm/long-context.sbatch runs one sequence-parallel group across
both nodes with the losses of one rank with the whole sequences."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.harness import (
    REPO,
    SAMPLE,
    SAMPLE_REVIEWS,
    SPLIT_LOSS_ATOL,
    assert_matches_golden,
    launch_env,
    losses,
    read_metrics,
)
from tests.slurm_cluster import slurm_cluster, unavailable

pytestmark = pytest.mark.recipe


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def copy_recipe(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(REPO / "recipes" / name, dest)
    return dest


def submit(cluster, recipe: Path, **env: str) -> int:
    """``sbatch slurm/train.sbatch`` from the recipe folder, as its README says, with ``env`` exported."""
    return cluster.sbatch(["slurm/train.sbatch"], cwd=recipe, env={**launch_env(), **env})


def job_log(recipe: Path, job_id: int) -> str:
    return (recipe / f"{recipe.name}-{job_id}.out").read_text()  # the scripts' --output=%x-%j.out


def test_the_8b_job_completes_on_one_node_with_the_golden_losses(cluster, tiny_llama3, tmp_path):
    recipe, output = copy_recipe("llama3-8b-zero3", tmp_path), tmp_path / "out-8b"
    train_args = ["--max-seq-len", "128", "--micro-batch-size", "4", "--grad-accum", "2", "--lr", "1e-3",
                  "--max-steps", "8", "--save-every", "4"]
    job = submit(cluster, recipe, MODEL=str(tiny_llama3), DATA=str(SAMPLE), OUTPUT=str(output), NUM_GPUS="2",
                 TRAIN_ARGS=" ".join(train_args))
    info = cluster.wait(job, "COMPLETED")
    assert info["ExitCode"] == "0:0" and info["NumNodes"] == "1" and info["Restarts"] == "0"
    assert "done: 8 steps" in job_log(recipe, job)
    assert_matches_golden(losses(output), REPO / "tests/golden/llama3-8b-zero3.json", 8)
    assert (output / "model/model.safetensors").is_file() and (output / "checkpoints/step_000008").is_dir()
    assert json.loads((output / "run_info.json").read_text())["devices"] == 2


def test_the_13b_job_completes_on_one_node_with_the_golden_losses(cluster, tiny_llama2, tmp_path):
    recipe, output = copy_recipe("llama2-13b-zero2", tmp_path), tmp_path / "out-13b"
    train_args = ["--max_seq_len", "128", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4",
                  "--learning_rate", "1e-3", "--max_steps", "6", "--save_steps", "3"]
    job = submit(cluster, recipe, MODEL=str(tiny_llama2), DATA=str(SAMPLE), OUTPUT=str(output), NUM_GPUS="2",
                 TRAIN_ARGS=" ".join(train_args))
    info = cluster.wait(job, "COMPLETED")
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "0"
    assert_matches_golden(losses(output), REPO / "tests/golden/llama2-13b-zero2.json", 6)
    assert (output / "checkpoint-6").is_dir() and (output / "run_record.json").is_file()


def test_a_70b_job_preempted_with_usr1_checkpoints_both_nodes_requeues_and_finishes(cluster, tiny_llama3, tmp_path):
    """Two nodes (main and worker configs by SLURM_NODEID). ``scancel --signal=USR1`` after step 2
    reaches every process of the job's steps on both nodes: the launchers ignore it, the ranks stop
    after the same step with one checkpoint, srun and the script exit 0, and the script requeues
    the job. The requeued job (Restarts=1) resumes and ends COMPLETED with the uninterrupted losses."""
    recipe, output = copy_recipe("llama3-70b-qlora", tmp_path), tmp_path / "out-70b"
    train_args = ["--max-seq-len", "64", "--micro-batch-size", "4", "--grad-accum", "2", "--lr", "2e-3",
                  "--lora-rank", "8", "--lora-dropout", "0", "--max-steps", "6", "--save-every", "3",
                  "--keep-checkpoints", "0"]
    job = submit(cluster, recipe, MODEL=str(tiny_llama3), DATA=str(SAMPLE_REVIEWS), OUTPUT=str(output),
                 GPUS_PER_NODE="1", GLOO_SOCKET_IFNAME="eth0", TRAIN_ARGS=" ".join(train_args))
    deadline = time.monotonic() + 600
    while not (output / "metrics.jsonl").is_file() or len(read_metrics(output)) < 2:
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), \
            cluster.job(job)
        time.sleep(0.5)
    signalled = time.monotonic()
    cluster.command("scancel", "--signal=USR1", str(job))
    first = cluster.job(job)
    while cluster.job(job)["Restarts"] == "0":  # the script's `scontrol requeue`
        assert time.monotonic() - signalled < 300, cluster.job(job)
        time.sleep(0.5)
    stopped_at = len(read_metrics(output))
    while len(read_metrics(output)) == stopped_at:  # the requeued job's first step
        assert time.monotonic() - signalled < 600, cluster.job(job)
        time.sleep(0.5)
    print(f"{time.monotonic() - signalled:.1f} s from scancel --signal=USR1 to the requeued job's first step "
          f"(Slurm holds a requeued job for cred_expire, 10 s here)")
    info = cluster.wait(job, "COMPLETED")
    assert first["NumNodes"] == "2" and info["Restarts"] == "1" and info["ExitCode"] == "0:0"
    log = job_log(recipe, job)
    stops = re.findall(r"stopped by SIGUSR1 after step (\d+) of 6; checkpoint: (\S+)\.", log)
    assert stops and {step for step, _ in stops} == {str(stopped_at)}, log[-4000:]
    assert f"requeueing job {job}" in log and "done: 6 steps" in log
    settled = time.monotonic() + 60  # the controller sends the job's end to slurmdbd after it reports it itself
    while True:
        table = cluster.sacct(job)
        runs = [line.split() for line in table.splitlines() if line.startswith(f"{job} ")]
        if [run[2] for run in runs] != ["REQUEUED", "RUNNING"] or time.monotonic() > settled:
            break
        time.sleep(1)
    print(table)
    assert [run[2] for run in runs] == ["REQUEUED", "COMPLETED"] and all(run[4] == "node[0-1]" for run in runs)
    golden = REPO / "tests/golden/llama3-70b-qlora.json"
    assert_matches_golden(losses(output), golden, 6, atol=5e-3)  # the 70B session's tolerance
    assert (output / "adapter").is_dir()


def test_the_8b_long_context_job_spans_two_nodes_with_one_group_of_ranks(cluster, tiny_llama3, tmp_path):
    """slurm/long-context.sbatch on two nodes of one rank each: its default --sequence-parallel (every GPU of the job,
    here 2) makes one group across the nodes, with packed rows, the tiled MLP and checkpoints in host memory. The job
    ends COMPLETED with the losses of one rank with the whole sequences (the 8B recipe's packed golden, from the same
    sizes: 8 sequences per step)."""
    recipe, output = copy_recipe("llama3-8b-zero3", tmp_path), tmp_path / "out-long"
    train_args = ["--micro-batch-size", "8", "--grad-accum", "1", "--lr", "1e-3", "--samples", "0", "--max-steps", "4",
                  "--save-every", "0"]
    job = cluster.sbatch(["--nodes=2", "slurm/long-context.sbatch"], cwd=recipe,
                         env={**launch_env(), "MODEL": str(tiny_llama3), "DATA": str(SAMPLE), "OUTPUT": str(output),
                              "GPUS_PER_NODE": "1", "MAX_SEQ_LEN": "128", "GLOO_SOCKET_IFNAME": "eth0",
                              "TRAIN_ARGS": " ".join(train_args)})
    info = cluster.wait(job, "COMPLETED")
    assert info["ExitCode"] == "0:0" and info["NumNodes"] == "2" and info["Restarts"] == "0"
    log = (recipe / f"llama3-8b-long-context-{job}.out").read_text()
    assert "--sequence-parallel 2 spans 2 nodes per group" in log and "done: 4 steps" in log, log[-4000:]
    ranks = json.loads((output / "run_info.json").read_text())["ranks"]
    assert sorted(r["machine_rank"] for r in ranks) == [0, 1]
    assert_matches_golden(losses(output), REPO / "tests/golden/llama3-8b-zero3-packed.json", 4, atol=SPLIT_LOSS_ATOL)


# Job states while a job that stops itself is requeued: running, then completing its first run, then pending again.
ENDED_OR_ON_ITS_WAY_BACK = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED")


def test_an_8b_job_at_its_time_limit_is_signalled_checkpoints_and_requeues(cluster, tiny_llama3, tmp_path):
    """The script's own ``--signal=USR1@N`` at a time limit short enough to reach: ``--time=3`` and
    ``--signal=USR1@90`` on the command line (Slurm sends it up to 60 s early: 30 to 90 s into the
    job). The run stops with a checkpoint, the job requeues itself, the requeued run resumes from it. On one
    process, the script's one-GPU choice (configs/zero3-offload.yaml: the optimizer offloaded, CPU Adam), which
    trains until the signal on one core instead of two; the preempted 70B job above stops two nodes at once."""
    recipe, output = copy_recipe("llama3-8b-zero3", tmp_path), tmp_path / "out-limit"
    train_args = ["--max-seq-len", "128", "--micro-batch-size", "4", "--grad-accum", "2", "--epochs", "10000",
                  "--save-every", "0"]
    job = cluster.sbatch(["--time=3", "--signal=USR1@90", "slurm/train.sbatch"], cwd=recipe,
                         env={**launch_env(), "MODEL": str(tiny_llama3), "DATA": str(SAMPLE), "OUTPUT": str(output),
                              "NUM_GPUS": "1", "TRAIN_ARGS": " ".join(train_args)})
    deadline = time.monotonic() + 600  # the signal 30 to 90 s in, then a save, the requeue, a start-up
    while cluster.job(job)["Restarts"] == "0":  # COMPLETING: the stopped run's end, before Slurm requeues it
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in ENDED_OR_ON_ITS_WAY_BACK, \
            cluster.job(job)
        time.sleep(1)
    stopped_at = len(read_metrics(output))
    while len(read_metrics(output)) == stopped_at:  # the requeued run's first step
        assert time.monotonic() < deadline, cluster.job(job)
        time.sleep(0.5)
    cluster.command("scancel", str(job))
    log = job_log(recipe, job)
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+) of \d+; checkpoint: (\S+)\.", log)
    assert stopped and int(stopped.group(1)) == stopped_at, log[-4000:]
    assert Path(stopped.group(2)) == output / f"checkpoints/step_{stopped_at:06d}"
    assert f"requeueing job {job}" in log
    resumed = read_metrics(output)[stopped_at]
    assert resumed["step"] == stopped_at + 1  # continued from the checkpoint, not from step 1
