"""Seconds from launch to the end of the first optimizer step on a long-context dataset, and what it holds.

The 8B recipe's long-context command on CPU: ``accelerate launch --config_file configs/zero3.yaml`` with
two ranks sharing each sequence (``--sequence-parallel 2``), ``--pack --max-seq-len 32768 --tiled-mlp``,
micro-batch 1, a tiny Llama 3 whose positions are raised to 64K (its rotary embedding has no learnt
positions), and long documents from the GPU check's generator (``gpu_check.synthetic.write_data``,
``long-documents``: one answer each of 1/8 to 1/2 of 32K tokens, about three per packed sequence). Two
launches: the first with an empty tokenised-data cache (tokenising and packing the whole set), the
relaunch with the cache filled; one optimizer step each, no validation split, no saves.

    python benchmarks/long_context_first_step.py [--documents 600] \
        [--out results/benchmarks/long-context-first-step.json]

Needs the stack environment on PATH and the package importable; a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import record

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/llama3-8b-zero3"
SEQ_LEN = 32768


def launch(model: Path, data: Path, output: Path, cache: Path) -> tuple[float, dict]:
    start = time.time()
    cmd = ["accelerate", "launch", "--config_file", "configs/zero3.yaml", "--num_processes", "2", "train.py",
           "--model", str(model), "--data", str(data), "--output", str(output), "--max-seq-len", str(SEQ_LEN),
           "--pack", "--sequence-parallel", "2", "--tiled-mlp", "--micro-batch-size", "1", "--grad-accum", "1",
           "--max-steps", "1", "--eval-fraction", "0", "--save-every", "0", "--no-save-model",
           "--skip-memory-check", "--data-cache", str(cache)]
    proc = subprocess.run(cmd, cwd=RECIPE, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    seconds = round((output / "metrics.jsonl").stat().st_mtime - start, 1)  # written once, at step 1
    step = json.loads((output / "metrics.jsonl").read_text().splitlines()[0])
    return seconds, step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--documents", type=int, default=600)
    p.add_argument("--out", type=Path, default=ROOT / "results/benchmarks/long-context-first-step.json")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "shared/tools"))
    from finetune_tools.gpu_check.synthetic import write_data
    from finetune_tools.tiny_models import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny("llama3", tmp / "tiny-llama3")
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2 * SEQ_LEN}))
        data = write_data("long-documents", tmp / "long.jsonl", rows=args.documents, seq_len=SEQ_LEN)
        first, step = launch(model, data, tmp / "a", tmp / "cache")
        relaunch, _ = launch(model, data, tmp / "b", tmp / "cache")
        info = json.loads((tmp / "a/run_info.json").read_text())
        size_mb = data.stat().st_size / 1e6
    rows = {"first launch (tokenise and pack)": first, "relaunch (tokenised-data cache)": relaunch}
    for label, seconds in rows.items():
        print(f"{label:34s} {seconds:7.1f} s to the end of step 1")
    record.write(args.out, __doc__.split("\n")[0], "seconds from launch to the end of optimizer step 1",
                 data={"documents": args.documents, "megabytes": round(size_mb, 1), "max_seq_len": SEQ_LEN,
                       "packed_sequences": info["train_examples"]},
                 ranks=2, sequence_parallel=2, seconds=rows,
                 first_step={k: step[k] for k in ("loss", "tokens_per_s", "step_time_s") if k in step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
