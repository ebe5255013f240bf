"""Run the GPU check: every case, its run record, and a summary table; any failure fails the command.

    python -m finetune_kit.gpu_check                      # every case on this GPU (CPU: tiny width)
    python -m finetune_kit.gpu_check --cases llama3-8b-zero3 --layers 4 --steps 8
    python -m finetune_kit.gpu_check --tiny               # the CPU version (part of make test)

Each case's outputs go to ``--out/<case>/`` (its log in ``run.log``); its run record is copied to
``--out/records/<case>.json``, ready for ``results/runs/``; ``--out/summary.json`` and the printed
table hold tokens/s per GPU, model TFLOP/s and MFU of the model that ran, the planner's predicted
peak next to the measured one, the time each case took and the library versions used.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from finetune_kit.gpu_check.cases import BY_NAME, CASES, Case, recipe_flags
from finetune_kit.gpu_check.models import build_model, write_data
from finetune_kit.planning.cli import text_table
from finetune_kit.repo.paths import find_root

GPU_DEFAULTS = {"steps": 8}
TINY = {"layers": 2, "seq_len": 64, "micro_batch": 2, "steps": 4}


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous (29500 may be taken)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_case(case: Case, root: Path, out: Path, *, tiny: bool, layers: int, steps: int, seq_len: int,
             micro_batch: int) -> dict:
    """Build the model and data, run the recipe, return the summary row (status "ok", "failed", "skipped")."""
    row = {"case": case.name, "recipe": case.recipe, "layers": layers, "seq_len": seq_len,
           "micro_batch": micro_batch, "steps": steps}
    if tiny and case.gpu_only:
        return {**row, "status": "skipped", "reason": case.gpu_only}
    folder = f"{case.arch}-{layers}-layers" + ("-tiny" if tiny else "")
    model = build_model(case.arch, case.family, layers, out / "models" / folder, tiny=tiny)
    suffix = "csv" if case.data == "reviews" else "jsonl"
    rows = steps * micro_batch * 2 + 8  # enough for every step and a held-out share
    data = write_data(case.data, out / "data" / f"{case.data}-{seq_len}.{suffix}", rows=rows, seq_len=seq_len)
    output = out / case.name
    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    launcher = [part.format(port=free_port()) for part in case.launcher]
    cmd = [*launcher, "train.py", *recipe_flags(case, model=str(model), data=str(data), output=str(output),
                                                  steps=steps, seq_len=seq_len, micro_batch=micro_batch)]
    print(f"== {case.name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with (output / "run.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=root / "recipes" / case.recipe, stdout=log, stderr=subprocess.STDOUT)
    row["seconds"] = round(time.monotonic() - start, 1)
    record_path = output / "run_record.json"
    if proc.returncode != 0 or not record_path.is_file():
        tail = (output / "run.log").read_text()[-3000:]
        print(f"-- {case.name} failed (exit {proc.returncode}); the end of {output / 'run.log'}:\n{tail}", flush=True)
        return {**row, "status": "failed", "exit": proc.returncode}
    lines = (output / "metrics.jsonl").read_text().splitlines()
    scaler = {k: v for k, v in json.loads(lines[-1]).items() if k in ("loss_scale", "skipped_steps")} if lines else {}
    return {**row, "status": "ok", **scaler,
            **record_summary(case, record_path, out / "records" / f"{case.name}.json")}


def record_summary(case: Case, record_path: Path, copy_to: Path) -> dict:
    from finetune_kit.results.record import RunRecord

    record = RunRecord.read(record_path).model_copy(update={"label": f"gpu check: {case.name}"})
    record.write(copy_to)
    m = record.measured
    error = None
    if m.predicted_gpu_GiB is not None and m.peak_gpu_reserved_GiB:
        error = 100 * (m.predicted_gpu_GiB - m.peak_gpu_reserved_GiB) / m.peak_gpu_reserved_GiB
    return {"model": record.model.architecture, "device": record.hardware.device,
            "tokens_per_s_per_device": m.tokens_per_s_per_device,
            "model_tflop_per_s_per_device": m.model_tflop_per_s_per_device, "mfu_percent": m.mfu_percent,
            "peak_gpu_allocated_GiB": m.peak_gpu_allocated_GiB, "peak_gpu_reserved_GiB": m.peak_gpu_reserved_GiB,
            "peak_host_rss_GiB_per_node": m.peak_host_rss_GiB_per_node, "predicted_gpu_GiB": m.predicted_gpu_GiB,
            "predicted_minus_reserved_percent": error, "software": record.software.model_dump(),
            "record": str(copy_to)}


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def summary_table(rows: list[dict]) -> str:
    header = ["case", "status", "s", "tokens/s/GPU", "TFLOP/s/GPU", "MFU %", "peak alloc GiB", "peak reserved GiB",
              "predicted GiB", "pred. error %"]
    body = [[r["case"], r["status"], _fmt(r.get("seconds")), _fmt(r.get("tokens_per_s_per_device"), 0),
             _fmt(r.get("model_tflop_per_s_per_device"), 3), _fmt(r.get("mfu_percent")),
             _fmt(r.get("peak_gpu_allocated_GiB")), _fmt(r.get("peak_gpu_reserved_GiB")),
             _fmt(r.get("predicted_gpu_GiB")), _fmt(r.get("predicted_minus_reserved_percent"))] for r in rows]
    return text_table(header, body)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m finetune_kit.gpu_check", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    p.add_argument("--tiny", action="store_true", default=None,
                   help="tiny width on CPU (the default without a GPU); --no-tiny forces the real width")
    p.add_argument("--no-tiny", dest="tiny", action="store_false")
    p.add_argument("--layers", type=int, help="decoder layers of every case (default: each case's own)")
    p.add_argument("--steps", type=int, help="optimizer steps per case (3 are warm-up; default 8, tiny 4)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: each case's own)")
    p.add_argument("--micro-batch", type=int, help="sequences per GPU per step (default: each case's own)")
    p.add_argument("--out", type=Path, default=Path("out/gpu-check"), help="models, data, outputs, records")
    p.add_argument("--root", type=Path, default=None, help="repository root (default: found from here)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    tiny = (not torch.cuda.is_available()) if args.tiny is None else args.tiny
    unknown = [n for n in args.cases.split(",") if n not in BY_NAME]
    if unknown:
        print(f"error: unknown case(s) {unknown}; the cases are {list(BY_NAME)}", file=sys.stderr)
        return 2
    root = find_root(args.root)
    out = args.out.resolve()
    print(f"GPU check on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
          f"{' (tiny width)' if tiny else ''}: torch {torch.__version__}, CUDA {torch.version.cuda}; out {out}")
    rows = []
    for name in args.cases.split(","):
        case = BY_NAME[name]
        rows.append(run_case(
            case, root, out, tiny=tiny, layers=args.layers or (TINY["layers"] if tiny else case.layers),
            steps=args.steps or (TINY["steps"] if tiny else GPU_DEFAULTS["steps"]),
            seq_len=args.seq_len or (TINY["seq_len"] if tiny else case.seq_len),
            micro_batch=args.micro_batch or (TINY["micro_batch"] if tiny else case.micro_batch)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"tiny": tiny, "cases": rows}, indent=2) + "\n")
    print("\n" + summary_table(rows))
    for r in rows:
        if r["status"] == "skipped":
            print(f"{r['case']}: skipped, {r['reason']}")
        if "skipped_steps" in r:
            print(f"{r['case']}: fp16 loss scale {r.get('loss_scale')}, {r['skipped_steps']} overflow step(s) skipped")
    failed = [r["case"] for r in rows if r["status"] == "failed"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} cases passed or were skipped; summary: {out / 'summary.json'}")
    return 1 if failed else 0
