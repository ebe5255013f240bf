"""Run the GPU check: every case, its run record, and a summary table; any failure fails the command.

    python -m finetune_tools.gpu_check                      # every case on this GPU (CPU: tiny width)
    python -m finetune_tools.gpu_check --cases llama3-8b-zero3 --layers 4 --steps 8
    python -m finetune_tools.gpu_check --tiny               # the CPU version (part of make test)
    python -m finetune_tools.gpu_check --no-save --case-timeout 300   # no final saves; stop a hung case

The models are built first, each in a process of its own (nothing holds GPU memory while a case
trains), while DeepSpeed's fused and CPU Adam compile side by side in two others; ``summary.json``
is rewritten after every case, so a crashed or timed-out case keeps the others' rows. A case that
runs out of GPU memory is a row with status "out of memory": a failure of the plain check, a result
of the ablation (its long-context probe stops at the first such row). A run with ``--fp8`` on a GPU
below compute capability 8.9 is a row with status "not applicable" and is not run.

Each case's outputs go to ``--out/<case>/`` (its log in ``run.log``); its run record is copied to
``--out/records/<case>.json``, ready for ``results/runs/``; ``--out/summary.json`` and the printed
table hold tokens/s per GPU, model TFLOP/s and MFU of the model that ran, the planner's predicted
peak next to the measured one, the time each case took and the library versions used.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from finetune_kit import command_line
from finetune_kit.launch import cuda_allocator, memory_cap
from finetune_tools.gpu_check import ablation, host_check
from finetune_tools.gpu_check.cases import BY_NAME, CASES, EVERY_CASE, Case, cpu_adam, recipe_flags
from finetune_tools.gpu_check.synthetic import (
    EXAMPLES_PER_SEQUENCE,
    build_4bit_model,
    build_model,
    folder_bytes,
    write_data,
)
from finetune_tools.paths import find_root
from finetune_tools.tables import text_table

# accumulation 4: the recipes' default, and on one H100 1.6x the tokens/s of 1 (results/, lever table)
GPU_DEFAULTS = {"steps": 8, "grad_accum": 4}
TINY = {"layers": 2, "seq_len": 64, "micro_batch": 2, "steps": 4, "grad_accum": 1}
# DeepSpeed's JIT ops the cases use on a GPU, each compiled in a process of its own (side by side, beside
# the model builds; one after the other they took 84-105 s on an H100 host): fused Adam (GPU-resident
# optimizer), CPU Adam (offload)
OPS = {name: f"from deepspeed.ops.op_builder import {builder}; {builder}().load()"
       for name, builder in (("fused_adam", "FusedAdamBuilder"), ("cpu_adam", "CPUAdamBuilder"))}


def gpu_memory() -> dict | None:
    """Name, total and free memory of GPU 0 read through NVML: no CUDA context in this process."""
    from finetune_kit.launch import gpus

    info = gpus.nvml_memory_GiB(0)
    return info and {"name": info["name"], "total_GiB": round(info["total"], 2), "free_GiB": round(info["free"], 2)}


# what torch, CUDA and DeepSpeed print when GPU memory runs out (torch.OutOfMemoryError, a failed cudaMalloc)
OOM_MESSAGES = ("CUDA out of memory", "OutOfMemoryError", "CUDA error: out of memory")


def out_of_memory(log: str) -> str | None:
    """The last line of ``log`` that says GPU memory ran out, or None."""
    lines = [line.strip() for line in log.splitlines() if any(m in line for m in OOM_MESSAGES)]
    return lines[-1][:500] if lines else None


def model_folder(out: Path, arch: str, layers: int, tiny: bool, max_positions: int = 0,
                 prequantized: bool = False) -> Path:
    return out / "models" / (f"{arch}-{layers}-layers" + (f"-{max_positions}-positions" if max_positions else "")
                             + ("-bnb-4bit" if prequantized else "") + ("-tiny" if tiny else ""))


def build_models(specs: list[tuple], out: Path, *, tiny: bool) -> dict[str, Path]:
    """Every case's model, each built in a process of its own: whatever GPU memory the random init
    took goes back to the driver when that process ends, before any case trains."""
    ctx = multiprocessing.get_context("spawn")
    paths = {}
    for arch, family, layers, positions, prequantized in specs:
        folder = model_folder(out, arch, layers, tiny, positions, prequantized)
        start = time.monotonic()
        proc = ctx.Process(target=build_4bit_model if prequantized else build_model,
                           args=(arch, family, layers, folder),
                           kwargs={"tiny": tiny, **({} if prequantized else {"max_positions": positions})})
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"building the {arch} model ({layers} layers) failed with exit code {proc.exitcode}")
        print(f"model {folder.name}: {time.monotonic() - start:.0f} s", flush=True)
        paths[(arch, family, layers, positions, prequantized)] = folder
    return paths


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous (29500 may be taken)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_case(case: Case, root: Path, out: Path, model: Path, *, layers: int, steps: int, seq_len: int,
             micro_batch: int, grad_accum: int = 1, save: bool = True, timeout: float | None = None,
             extra: tuple[str, ...] = (), name: str | None = None, data: str | None = None) -> dict:
    """Write the data, run the recipe, return the summary row (status "ok", "failed", "timed out",
    "out of memory": the GPU's, named by the log line under "oom").
    ``name`` (default: the case's) names the output folder and the record; ``data`` (default: the
    case's) the kind of synthetic data."""
    name = name or case.name
    row = {"case": case.name, "recipe": case.recipe, "layers": layers, "seq_len": seq_len,
           "micro_batch": micro_batch, "grad_accum": grad_accum, "steps": steps}
    if name != case.name:
        row = {"run": name, **row}
    if extra:
        row["extra_flags"] = list(extra)
    if (cap := memory_cap.requested()) is not None:  # every rank of the case holds its GPU to it
        row["gpu_memory_cap_GiB"] = cap
    flags = [*case.flags, *extra]
    sp = int(flags[flags.index("--sequence-parallel") + 1]) if "--sequence-parallel" in flags else 1
    levers = cuda_allocator.long_context(tiled_mlp="--tiled-mlp" in flags, sequence_parallel=sp,
                                         offload_activations="--offload-activations" in flags)
    if allocator := cuda_allocator.for_launch(levers):  # what the recipe's ranks will run with
        row["cuda_alloc_conf"] = allocator
    kind = data or case.data
    if kind != case.data:
        row["data"] = kind
    suffix = "csv" if kind == "reviews" else "jsonl"
    rows = steps * micro_batch * grad_accum * 2 + 8  # enough for every step and a held-out share
    rows *= EXAMPLES_PER_SEQUENCE.get(kind, 1)  # packed: several examples per sequence
    data = write_data(kind, out / "data" / f"{kind}-{seq_len}-{rows}.{suffix}", rows=rows, seq_len=seq_len)
    output = out / name
    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    launcher = [part.format(port=free_port()) for part in case.launcher]
    cmd = [*launcher, "train.py", *recipe_flags(case, model=str(model), data=str(data), output=str(output),
                                                  steps=steps, seq_len=seq_len, micro_batch=micro_batch,
                                                  grad_accum=grad_accum, save=save),
           *extra]
    if shutil.which(cmd[0]) is None:
        print(f"-- {name}: the launcher {cmd[0]!r} is not on PATH", flush=True)
        return {**row, "status": "failed", "error": f"launcher {cmd[0]!r} not on PATH"}
    free = gpu_memory()
    if free:
        row["gpu_free_GiB_before"] = free["free_GiB"]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with (output / "run.log").open("w") as log:
        # a session of its own: a timed-out case is stopped with every process it started
        proc = subprocess.Popen(cmd, cwd=root / "recipes" / case.recipe, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    row["seconds"] = round(time.monotonic() - start, 1)
    record_path = output / "run_record.json"
    if returncode != 0 or not record_path.is_file():
        log = (output / "run.log").read_text(errors="replace")
        oom = out_of_memory(log[-50_000:]) if returncode is not None else None  # the launcher's traceback follows
        status = "timed out" if returncode is None else "out of memory" if oom else "failed"
        print(f"-- {name} {status} (exit {returncode}, {row['seconds']} s); the end of {output / 'run.log'}:\n"
              f"{log[-3000:]}", flush=True)
        return {**row, "status": status, "exit": returncode, **({"oom": oom} if oom else {})}
    lines = (output / "metrics.jsonl").read_text().splitlines()
    scaler = {k: v for k, v in json.loads(lines[-1]).items() if k in ("loss_scale", "skipped_steps")} if lines else {}
    return {**row, "status": "ok", **scaler,
            **record_summary(name, record_path, out / "records" / f"{name}.json")}


def record_summary(name: str, record_path: Path, copy_to: Path) -> dict:
    from finetune_kit.metering.run_record import RunRecord

    record = RunRecord.read(record_path).model_copy(update={"label": f"gpu check: {name}"})
    record.write(copy_to)
    m = record.measured
    error = None
    if m.predicted_gpu_GiB is not None and m.peak_gpu_reserved_GiB:
        error = 100 * (m.predicted_gpu_GiB - m.peak_gpu_reserved_GiB) / m.peak_gpu_reserved_GiB
    return {"model": record.model.architecture, "device": record.hardware.device,
            "tokens_per_s_per_device": m.tokens_per_s_per_device,
            "model_tflop_per_s_per_device": m.model_tflop_per_s_per_device, "mfu_percent": m.mfu_percent,
            "peak_gpu_allocated_GiB": m.peak_gpu_allocated_GiB, "peak_gpu_reserved_GiB": m.peak_gpu_reserved_GiB,
            "peak_gpu_device_GiB": m.peak_gpu_device_GiB, "step_time_s": m.step_time_s,
            "peak_host_rss_GiB_per_node": m.peak_host_rss_GiB_per_node, "predicted_gpu_GiB": m.predicted_gpu_GiB,
            "first_step_after_s": m.first_step_after_s,
            "predicted_minus_reserved_percent": error, "software": record.software.model_dump(),
            "record": str(copy_to)}


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def summary_table(rows: list[dict]) -> str:
    header = ["case", "status", "s", "tokens/s/GPU", "TFLOP/s/GPU", "MFU %", "peak alloc GiB", "peak reserved GiB",
              "device GiB", "predicted GiB", "pred. error %"]
    ablated = any("speedup" in r for r in rows)
    if ablated:
        header[1:1] = ["mb x ga", "speed-up"]
    body = []
    for r in rows:
        cap = f" (GPU held to {r['gpu_memory_cap_GiB']:g} GiB)" if r.get("gpu_memory_cap_GiB") else ""
        line = [r.get("run", r["case"]) + cap, r["status"], _fmt(r.get("seconds")),
                _fmt(r.get("tokens_per_s_per_device"), 0),
                _fmt(r.get("model_tflop_per_s_per_device"), 3), _fmt(r.get("mfu_percent")),
                _fmt(r.get("peak_gpu_allocated_GiB")), _fmt(r.get("peak_gpu_reserved_GiB")),
                _fmt(r.get("peak_gpu_device_GiB")), _fmt(r.get("predicted_gpu_GiB")),
                _fmt(r.get("predicted_minus_reserved_percent"))]
        if ablated:
            line[1:1] = [f"{r.get('micro_batch')} x {r.get('grad_accum')}", _fmt(r.get("speedup"), 2)]
        body.append(line)
    return text_table(header, body)


def parse_args(argv=None) -> argparse.Namespace:
    p = command_line.ArgumentParser(prog="python -m finetune_tools.gpu_check", description=__doc__.splitlines()[0],
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    p.add_argument("--tiny", action="store_true", default=None,
                   help="tiny width on CPU (the default without a GPU); --no-tiny forces the real width")
    p.add_argument("--no-tiny", dest="tiny", action="store_false")
    p.add_argument("--layers", type=int, help="decoder layers of every case (default: each case's own)")
    p.add_argument("--steps", type=int, help="optimizer steps per case (3 are warm-up; default 8, tiny 4)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: each case's own)")
    p.add_argument("--micro-batch", type=int, help="sequences per GPU per forward (default: each case's own)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 4, tiny 1)")
    p.add_argument("--ablation", action="store_true",
                   help="run the speed-lever variants (gpu_check.ablation) instead of the cases")
    p.add_argument("--variants", default=None, help="with --ablation: comma-separated variant names (default: all)")
    p.add_argument("--speedup-against", default=None,
                   help="with --ablation: a variant of the command every row's speed-up is against, unless the row "
                        "names its own baseline (default: each case's first row)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which no further case or variant starts (default: none)")
    p.add_argument("--no-save", dest="save", action="store_false",
                   help="skip each case's final model save (the save path is tested on CPU)")
    p.add_argument("--case-timeout", type=float, default=None, help="seconds before a case is stopped (default: none)")
    p.add_argument("--extra", default="", help="recipe flags added to every case (e.g. '--no-gradient-checkpointing')")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="hold every rank's GPU to this many GiB (FINETUNE_GPU_MEMORY_GIB in each case's ranks): a "
                        "smaller GPU's limits on a larger one, e.g. 80 for an 80 GB H100 on an H200; each row and "
                        "record names it")
    p.add_argument("--out", type=Path, default=Path("out/gpu-check"), help="models, data, outputs, records")
    p.add_argument("--root", type=Path, default=None, help="repository root (default: found from here)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import shlex

    import torch

    args = parse_args(argv)
    if args.gpu_memory_gib is not None:  # the cases' ranks inherit it, and apply it before anything allocates
        os.environ[memory_cap.ENV] = f"{args.gpu_memory_gib:g}"
        memory_cap.requested()  # a bad value: one line, before anything is built
    started = time.monotonic()
    gpu = torch.cuda.is_available()  # counts devices; creates no CUDA context in this process
    tiny = (not gpu) if args.tiny is None else args.tiny
    names = args.cases.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    variants = []
    if args.ablation:
        variants = [ablation.BY_NAME.get(n) or n for n in args.variants.split(",")] if args.variants \
            else ablation.VARIANTS
        unknown = [n for n in variants if isinstance(n, str)]
        names = list(dict.fromkeys(v.case for v in variants if not isinstance(v, str)))
    if unknown:
        known = list(ablation.BY_NAME) if args.ablation else list(BY_NAME)
        print(f"error: unknown {'variant' if args.ablation else 'case'}(s) {unknown}; they are {known}",
              file=sys.stderr)
        return 2
    if args.speedup_against and args.speedup_against not in [v.name for v in variants]:
        print(f"error: --speedup-against {args.speedup_against}: not a variant of this command; name one of "
              f"{[v.name for v in variants]} (--variants)", file=sys.stderr)
        return 2
    root = find_root(args.root)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = gpu_memory() if gpu else None
    held = f", each rank held to {args.gpu_memory_gib:g} GiB" if args.gpu_memory_gib else ""
    print(f"GPU check on {info['name'] if info else 'CPU'}{' (tiny width)' if tiny else ''}{held}: "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}; out {out}", flush=True)
    cases = [EVERY_CASE[n] for n in names]
    extra = tuple(shlex.split(args.extra))
    capability = host_check.gpu_capability() if gpu else None
    run_flags = [extra + v.flags for v in variants] if args.ablation else [extra]
    fp8 = any(host_check.fp8_choice(f) != "none" and not host_check.not_applicable(f, capability) for f in run_flags)
    layers_of = {c.name: args.layers or (TINY["layers"] if tiny else c.layers) for c in cases}
    runnable = [c for c in cases if not (tiny and c.gpu_only)]
    specs = sorted({(c.arch, c.family, layers_of[c.name], c.max_positions, c.prequantized) for c in runnable})
    unbuilt = [(a, n, q) for a, _, n, p, q in specs
               if not (model_folder(out, a, n, tiny, p, q) / "config.json").is_file()]
    found = host_check.problems(runnable, out, gpu=gpu and not tiny,
                               model_bytes=sum(folder_bytes(a, n, tiny, q) for a, n, q in unbuilt),
                               gpu_used_GiB=info["total_GiB"] - info["free_GiB"] if info else None, fp8=fp8)
    if found:
        print("error: this host is not ready for the GPU check; nothing was built or run:", file=sys.stderr)
        for problem in found:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    print(f"host check: {len(runnable)} case(s) ready", flush=True)
    if args.ablation:
        to_run = [v for v, f in zip(variants, run_flags, strict=True) if not host_check.not_applicable(f, capability)]
        expected = ablation.setup_seconds(to_run) + sum(ablation.expected_seconds(v, args.steps) for v in to_run)
        print(f"ablation: {len(to_run)} variant(s), expected about {expected / 60:.0f} min on one H100 "
              "(gpu_check.ablation.SECONDS_ON_H100, measured per case there; long-context and fp8 rows predicted)"
              + (f"; {len(variants) - len(to_run)} not applicable on this GPU" if len(to_run) < len(variants) else ""),
              flush=True)
    ops = None
    if gpu and not tiny:  # compile DeepSpeed's ops while the models are built
        from finetune_kit.launch.cuda_ops import jit_arch_list

        if note := jit_arch_list():  # the cases inherit the same value: their compile finds this one's build
            print(note, flush=True)
        needed = {name: code for name, code in OPS.items()
                  if name != "cpu_adam" or any(map(cpu_adam, runnable))}  # CPU Adam only for an offloaded case
        ops = {name: subprocess.Popen([sys.executable, "-c", code], stdout=(out / f"ops-{name}.log").open("w"),
                                      stderr=subprocess.STDOUT) for name, code in needed.items()}
        ops_started = time.monotonic()
    models = build_models(specs, out, tiny=tiny)
    for name, proc in (ops or {}).items():
        code = proc.wait()
        print(f"DeepSpeed op {name} {'built' if code == 0 else f'FAILED, see ops-{name}.log'} "
              f"({time.monotonic() - ops_started:.0f} s after the builds began)", flush=True)

    def settings(case: Case, micro_batch=None, grad_accum=None, seq_len=None, flags=(), data=None, steps=None) -> dict:
        return {"steps": steps or args.steps or (TINY["steps"] if tiny else GPU_DEFAULTS["steps"]),
                "seq_len": seq_len or args.seq_len or (TINY["seq_len"] if tiny else case.seq_len),
                "micro_batch": micro_batch or args.micro_batch or (TINY["micro_batch"] if tiny else case.micro_batch),
                "grad_accum": grad_accum or args.grad_accum or (TINY if tiny else GPU_DEFAULTS)["grad_accum"],
                "extra": extra + tuple(flags), "data": data}

    if args.ablation:
        runs = [(v.name, EVERY_CASE[v.case], v,
                 settings(EVERY_CASE[v.case], v.micro_batch, v.grad_accum, v.seq_len,
                          ablation.one_loss_kernel(EVERY_CASE[v.case], v.flags), v.data, v.steps)) for v in variants]
    else:
        runs = [(case.name, case, None, settings(case)) for case in cases]
    rows = []
    for name, case, variant, given in runs:
        layers = layers_of[case.name]
        about = {"lever": variant.lever, **({"note": variant.note} if variant.note else {})} if variant else {}
        named = {**({"run": name} if name != case.name else {}), "case": case.name, "recipe": case.recipe}
        not_run = {**named, "seq_len": given["seq_len"], "status": "not run", **about}
        if tiny and case.gpu_only:
            rows.append({"case": case.name, "recipe": case.recipe, "status": "skipped", "reason": case.gpu_only})
        elif why := host_check.not_applicable(given["extra"], capability):
            rows.append({**not_run, "status": "not applicable", "reason": why})
        elif args.time_budget is not None and time.monotonic() - started > args.time_budget:
            rows.append({**not_run, "reason": f"the {args.time_budget:.0f} s time budget was spent"})
        elif variant and (stopped := ablation.probe_stopped(variant, rows)):
            rows.append({**not_run, "reason": stopped})
        else:
            try:
                rows.append({**run_case(case, root, out, models[(case.arch, case.family, layers, case.max_positions,
                                                               case.prequantized)],
                                        layers=layers, save=args.save, timeout=args.case_timeout, name=name, **given),
                             **about})
            except Exception as err:  # one broken case must not lose the others' summary
                rows.append({**named, "status": "failed", "error": repr(err), **about})
        if args.ablation:
            rows = ablation.speedups(rows, args.speedup_against)
        # after every case: what finished is on disk even if the next one takes the machine down
        (out / "summary.json").write_text(json.dumps({"tiny": tiny, "gpu": info, "cases": rows}, indent=2) + "\n")
    print("\n" + summary_table(rows))
    for r in rows:
        if r["status"] in ("skipped", "not run", "not applicable"):
            print(f"{r.get('run', r['case'])}: {r['status']}, {r['reason']}")
        if "skipped_steps" in r:
            print(f"{r['case']}: fp16 loss scale {r.get('loss_scale')}, {r['skipped_steps']} overflow step(s) skipped")
    for r in rows:
        if r["status"] == "out of memory":
            print(f"{r.get('run', r['case'])}: out of memory{' (a result of the ablation)' if args.ablation else ''}:"
                  f" {r['oom']}")
    # in the ablation running out of memory is a measured result (the probe looks for it); a case must fit
    failing = ("failed", "timed out") + (() if args.ablation else ("out of memory",))
    failed = [r.get("run", r["case"]) for r in rows if r["status"] in failing]
    passed = sum(r["status"] == "ok" for r in rows)
    others = {status: sum(r["status"] == status for r in rows)
              for status in ("skipped", "not run", "not applicable") + (("out of memory",) if args.ablation else ())}
    print(f"\n{passed} of {len(rows)} passed, {len(failed)} failed"
          + "".join(f", {n} {status}" for status, n in others.items() if n) + f"; summary: {out / 'summary.json'}")
    return 1 if failed else 0
