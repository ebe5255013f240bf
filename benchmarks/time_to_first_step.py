"""Seconds from launch to the end of the first optimizer step, with and without the tokenised-data cache.

The 8B recipe's own command (``accelerate launch --config_file configs/zero3.yaml train.py``), two CPU
ranks, a tiny Llama 3, and 200,000 multi-turn conversations made by the sample generator
(``data/samples/generate_formats.py``: 2-3 exchanges each, a third with a system turn). Four launches,
each pair with a fresh ``datasets`` cache (``HF_DATASETS_CACHE``: the JSON's Arrow copy and ``datasets``'
own cache of ``map`` results), so a first launch pays what a first launch pays:

- ``before, first launch`` and ``before, relaunch``: ``--data-cache none --data-workers 1`` (what the
  recipes did before the tokenised-data cache);
- ``after, first launch`` (an empty cache, tokenising processes by default: one per CPU) and
  ``after, relaunch`` (the cache holds the data), the second with a new output folder.

Each launch runs one optimizer step (``--max-steps 1``) with no validation split and no saves; the
first step's end is when ``metrics.jsonl`` was written (its one line, at step 1).

    python benchmarks/time_to_first_step.py [--conversations 200000] [--out results/benchmarks/time-to-first-step.json]

Needs the stack environment on PATH and the package importable; about ten minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import record

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/llama3-8b-zero3"


def conversations(path: Path, n: int) -> Path:
    sys.path.insert(0, str(ROOT / "shared/tools"))
    from finetune_tools.samples.formats import conversation, pairs

    rng, pool = random.Random(0), pairs()
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": conversation(rng, pool, rng.choice((2, 3)), i % 3 == 0)}) + "\n")
    return path


def launch(model: Path, data: Path, output: Path, hf_cache: Path, *flags: str) -> float:
    start = time.time()
    cmd = ["accelerate", "launch", "--config_file", "configs/zero3.yaml", "--num_processes", "2", "train.py",
           "--model", str(model), "--data", str(data), "--output", str(output), "--max-seq-len", "256",
           "--micro-batch-size", "2", "--grad-accum", "1", "--max-steps", "1", "--eval-fraction", "0",
           "--save-every", "0", "--no-save-model", "--skip-memory-check", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(hf_cache)}
    proc = subprocess.run(cmd, cwd=RECIPE, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return round((output / "metrics.jsonl").stat().st_mtime - start, 1)  # written once, at step 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=200_000)
    p.add_argument("--out", type=Path, default=ROOT / "results/benchmarks/time-to-first-step.json")
    args = p.parse_args()
    from finetune_tools.tiny_models import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny("llama3", tmp / "tiny-llama3")
        data = conversations(tmp / "chat.jsonl", args.conversations)
        cache, off = tmp / "cache", ("--data-cache", "none", "--data-workers", "1")
        rows = {
            "before, first launch": launch(model, data, tmp / "a", tmp / "hf-before", *off),
            "before, relaunch": launch(model, data, tmp / "b", tmp / "hf-before", *off),
            "after, first launch": launch(model, data, tmp / "c", tmp / "hf-after", "--data-cache", str(cache)),
            "after, relaunch": launch(model, data, tmp / "d", tmp / "hf-after", "--data-cache", str(cache)),
        }
        size_mb = data.stat().st_size / 1e6
    for label, seconds in rows.items():
        print(f"{label:24s} {seconds:7.1f} s to the end of step 1")
    record.write(args.out, __doc__.split("\n")[0], "seconds from launch to the end of optimizer step 1",
                 data={"conversations": args.conversations, "megabytes": round(size_mb, 1), "max_seq_len": 256},
                 ranks=2, seconds=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
