"""The launch plan (finetune_kit.training.launch_plan): decided once by the checks, compared by the ranks before the
first collective. Two ranks that decided different plans (here: --levers auto ranked for two GPU profiles, standing
in for two kinds of device) stop in one line each, in seconds, instead of training different schedules and hanging.
The control: every two-rank launch of the recipe suites handshakes with one plan and trains."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

from tests.harness import REPO

RECIPE = REPO / "recipes/llama3-8b-zero3"
SAMPLE = REPO / "shared/finetune_kit/data/samples/instructions.jsonl"
RANK = """
import sys
sys.path.insert(0, ".")
import train
args, checked, _ = train.check_inputs(sys.argv[1:])
checked.plan.handshake(30)
print("agreed", checked.plan.digest())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_with_different_plans_refuse_in_one_line(tiny_llama3, tmp_path):
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))  # the agent's store
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_DEEPSPEED_CONFIG_FILE": "configs/zero3.json"}
    flags = ["--model", str(tiny_llama3), "--data", str(SAMPLE), "--max-seq-len", "128", "--micro-batch-size", "4",
             "--grad-accum", "2", "--output", str(tmp_path / "out"), "--levers", "auto"]
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, *flags, "--levers-gpu", gpu], cwd=RECIPE, text=True,
                              env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
             for rank, gpu in enumerate(("h100", "h200"))]
    results = [p.communicate(timeout=120) for p in procs]
    elapsed = time.monotonic() - start
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode != 0 and "agreed" not in out
        lines = [line for line in err.splitlines() if "the ranks decided different launch plans" in line]
        assert len(lines) == 1, err[-3000:]
        assert "H100 SXM 80 GB" in lines[0] and "H200 SXM 141 GB" in lines[0] and "--levers-gpu" in lines[0]
    assert elapsed < 90  # two interpreters' imports and checks; the handshake itself waits for nothing
    del store
