"""The GPU smoke: every code path that only runs its real kernels on CUDA, once, in minutes.

    python -m finetune_tools.gpu_check --smoke                      # on one GPU: at most 9 minutes
    python -m finetune_tools.gpu_check --smoke --tiny               # the CPU rehearsal (make test)
    python -m finetune_tools.gpu_check --smoke --rerun-failed       # again, only what failed or did not run

Each row runs one path in a process of its own, with a timeout: the recipes' own train.py and configs
on Llama 3.1 8B's and Llama 3.3 70B's widths truncated to 2 decoder layers, 3 optimizer steps; then
``make eval`` and ``make merge`` on what two of them saved. The rows, in the order they run (the paths
most users meet first):

- ``8b-zero3-samples``: ZeRO-3, validation and sample answers generated with ``synced_gpus`` (every rank
  gathers the layers per token), the consolidated save;
- ``8b-eval-cuda``: ``make eval`` (lm-evaluation-harness) on that saved model, on the GPU;
- ``8b-packed-varlen``: packed rows through ``torch.nn.attention.varlen`` (FlashAttention's varlen kernel);
- ``8b-liger``: Liger-Kernel's fused linear cross-entropy under ZeRO-3;
- ``8b-zero3-fp8-rowwise``: torchao float8 linear layers with rowwise scales under ZeRO-3 (real ``_scaled_mm``);
- ``8b-32k-tiledmlp-offloadact``: DeepSpeed's tiled MLP, checkpoints in pinned host memory, 32K tokens;
- ``8b-fsdp2-compile-fp8``: FSDP2, decoder layers through torch.compile, float8 with tensorwise scales;
- ``70b-qlora``: the 70B recipe's 4-bit (nf4) base with LoRA, the adapter saved;
- ``70b-merge``: ``make merge`` of that adapter into the 16-bit base.

The expected total (set-up included; :data:`SETUP_SECONDS` and each row's seconds, measured on one H100) is
printed first. A row
starts only if it is expected to end within ``--time-budget`` counted from ``--started-at`` (the
command's start, so the bundle install counts): the others are rows with status ``not run``, never
half-run. Statuses: ok; failed, with the error's last line; timed out; out of memory; not applicable,
with why (an fp8 row below compute capability 8.9, Liger's CUDA kernel on a CPU, a row whose input row
failed). ``summary.json`` in ``--out`` is rewritten after every row; ``--rerun-failed`` reads it and runs
only the rows that did not pass, keeping the others' rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from finetune_kit import command_line
from finetune_tools.gpu_check import host_check, runner
from finetune_tools.gpu_check.cases import ACCELERATE_1GPU, BY_NAME, Case
from finetune_tools.gpu_check.synthetic import folder_bytes
from finetune_tools.paths import find_root
from finetune_tools.tables import text_table

LAYERS, STEPS = 2, 3
TINY_LONG = 256  # the 32K row's tokens per sequence at the tiny width on a CPU (32K would take minutes a step)
ZERO3 = Case("smoke-8b-zero3", "llama3-8b-zero3", "llama3.1-8b", "llama3", "instructions", layers=LAYERS,
             seq_len=4096, micro_batch=2, launcher=(*ACCELERATE_1GPU, "--config_file", "configs/zero3.yaml"))
FSDP2_FP8 = replace(ZERO3, name="smoke-8b-fsdp2-fp8",
                    launcher=(*ACCELERATE_1GPU, "--config_file", "configs/fsdp2-fp8.yaml"))
QLORA = replace(BY_NAME["llama3-70b-qlora"], name="smoke-70b-qlora", layers=LAYERS)
CASES = {c.name: c for c in (ZERO3, FSDP2_FP8, QLORA)}
CHUNKED = ("--loss-kernel", "chunked")  # the plain-torch loss, also where liger-kernel is installed (auto picks it)


@dataclass(frozen=True)
class Row:
    name: str
    path: str  # the code path it runs, for the table
    seconds: float  # expected on one H100, launch to exit (measured there: SETUP_SECONDS says where)
    case: str = ""  # a training row: its case in CASES
    flags: tuple[str, ...] = ()
    seq_len: int | None = None  # None: the case's
    micro_batch: int | None = None
    data: str | None = None  # the synthetic data's kind (None: the case's)
    save: bool = False  # keep the final model or adapter (a later row reads it)
    command: str = ""  # a row after training: "eval" or "merge", on the output of ``reads``
    reads: str = ""
    cpu: str = ""  # why it cannot run on a CPU ("" when it can)
    warmup: int = 1  # of the 3 steps, how many the record's medians leave out


ROWS = [
    Row("8b-zero3-samples", "ZeRO-3: validation, 4 sample answers with synced_gpus, consolidated save", 62,
        "smoke-8b-zero3", (*CHUNKED, "--eval-fraction", "0.2", "--samples", "4", "--sample-tokens", "32"), save=True),
    Row("8b-eval-cuda", "make eval (lm-evaluation-harness heldout task) on the saved model", 18,
        command="eval", reads="8b-zero3-samples"),
    Row("8b-packed-varlen", "packed rows, --attention auto: torch.nn.attention.varlen (FlashAttention)", 39,
        "smoke-8b-zero3", (*CHUNKED, "--pack"), data="short-instructions"),
    Row("8b-liger", "Liger-Kernel's fused linear cross-entropy under ZeRO-3 (--loss-kernel liger)", 41,
        "smoke-8b-zero3", ("--loss-kernel", "liger"), cpu="Liger-Kernel's fused loss is a Triton kernel for CUDA GPUs"),
    Row("8b-zero3-fp8-rowwise", "torchao float8 linears, rowwise scales, under ZeRO-3 (_scaled_mm)", 45,
        "smoke-8b-zero3", (*CHUNKED, "--fp8", "rowwise")),
    Row("8b-32k-tiledmlp-offloadact", "32K tokens: DeepSpeed's tiled MLP, checkpoints in pinned host memory", 46,
        "smoke-8b-zero3", (*CHUNKED, "--tiled-mlp", "--offload-activations", "--loss-chunks", "8"),
        seq_len=32 * 1024, micro_batch=1),
    # step 2 compiles again (19 s on the H100): its sequence length differs from step 1's, and torch.compile then
    # compiles for dynamic shapes; only step 3 is the compiled speed
    Row("8b-fsdp2-compile-fp8", "FSDP2, decoder layers through torch.compile, float8 tensorwise", 80,
        "smoke-8b-fsdp2-fp8", (*CHUNKED, "--compile", "--fp8", "tensorwise"), warmup=2),
    Row("70b-qlora", "70B QLoRA: nf4 base (bitsandbytes), LoRA and head, ZeRO-3, adapter saved", 37,
        "smoke-70b-qlora", save=True),
    Row("70b-merge", "make merge: the adapter merged into the bf16 base", 25, command="merge", reads="70b-qlora"),
]
BY_ROW = {r.name: r for r in ROWS}
# Measured on one H100 (80 GB HBM3, torch 2.11 + CUDA 13.0; results/gpu-smoke.md): the set-up, from the command's
# start (the bundle install 5 s, the two check models built in 27 s and 38 s beside the compile of DeepSpeed's
# fused Adam, the host check), and each row's seconds from launch to exit (Row.seconds).
SETUP_SECONDS = 94
TIME_BUDGET = 540  # seconds from the command's start: the smoke must fit one device command of 9 minutes
GRACE_S = 40  # a row started within the budget is stopped at most this long after it (then "timed out")
OPS = {"fused_adam": runner.OPS["fused_adam"]}  # every row's optimizer is on the GPU (no CPU Adam)
OK, NOT_RUN, NOT_APPLICABLE = "ok", "not run", "not applicable"
PASSED = (OK, NOT_APPLICABLE)


def expected_total(rows: list[Row]) -> float:
    return SETUP_SECONDS + sum(r.seconds for r in rows)


# what the launchers add after the error itself: never the line that says what went wrong
LAUNCHER_NOISE = re.compile(r"CalledProcessError|ChildFailedError|torch\.distributed\.elastic|^\s*raise |"
                            r"^\s*File \"|^Traceback|^\s*\^+\s*$|returned non-zero exit status|^\s*$|^=+$|^-+$")
ERROR_LINE = re.compile(r"^(?:[\w.]*(?:Error|Exception|Interrupt)\b.*|error: .*|.*\bError: .*|Killed)$")


def error_line(log: str) -> str:
    """The line of ``log`` that says why a process failed: its last exception or ``error:`` line that is
    not the launcher's report about the child, else its last line of text."""
    lines = [line.strip() for line in log.splitlines()]
    meaningful = [line for line in lines if line and not LAUNCHER_NOISE.search(line)]
    for line in reversed(meaningful):
        if ERROR_LINE.match(line):
            return line[:300]
    return (meaningful or ["(no output)"])[-1][:300]


class PeakGPU:
    """The most GPU memory in use (NVML, device-wide: contexts and every process) while a row runs;
    ``peak`` stays None without a GPU (``active`` False) or without NVML."""

    def __init__(self, active: bool, period: float = 0.2):
        self.active, self.period, self.peak, self._stop = active, period, None, threading.Event()
        self._thread = None

    def __enter__(self):
        from finetune_kit.launch import gpus

        if not self.active:
            return self

        def poll():
            while not self._stop.is_set():
                info = gpus.nvml_memory_GiB(0)
                if info:
                    self.peak = max(self.peak or 0.0, info["used"])
                self._stop.wait(self.period)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()


def run_command(row: Row, source: Path, out: Path, *, gpu: bool, timeout: float) -> dict:
    """``make eval`` or ``make merge`` (their modules, as the Makefile runs them) on ``source``."""
    module = {"eval": "finetune_tools.harness", "merge": "finetune_tools.merge"}[row.command]
    cmd = [sys.executable, "-m", module, str(source)]
    # The folder holding finetune_tools (shared/tools in a checkout or an image) first on PYTHONPATH, as the
    # Makefile's PYTHONPATH=$(TOOLS); nothing added where the tools are installed in site-packages.
    env, tools = dict(os.environ), Path(__file__).resolve().parents[2]
    if tools != Path(sysconfig.get_paths()["purelib"]).resolve():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tools), env.get("PYTHONPATH")]))
    if row.command == "eval":
        cmd += ["--device", "cuda" if gpu else "cpu"]
    log_path = out / f"{row.name}.log"
    print(f"== {row.name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = None
    row_out = {"seconds": round(time.monotonic() - start, 1), "log": str(log_path)}
    text = log_path.read_text(errors="replace")
    if code != 0:
        oom = runner.out_of_memory(text) if code is not None else None
        print(f"-- {row.name} exit {code}; the end of {log_path}:\n{text[-2000:]}", flush=True)
        return {**row_out, "status": "timed out" if code is None else "out of memory" if oom else "failed",
                "exit": code, "error": error_line(text)}
    if row.command == "eval":
        summary = json.loads((source / "eval/summary.json").read_text())
        return {**row_out, "status": OK, "result": summary}
    merged = source / "merged"
    files = sorted(p.name for p in merged.glob("*.safetensors"))
    if not files or not (merged / "config.json").is_file():
        return {**row_out, "status": "failed", "error": f"make merge exited 0 but {merged} holds no model"}
    return {**row_out, "status": OK, "result": {"merged_files": files,
                                               "merged_GiB": sum(p.stat().st_size for p in merged.glob("*")) / 2**30}}


def result_note(row: dict) -> str:
    """What the table says of a row besides its figures: why it did not pass, or what it produced."""
    if row["status"] != OK:
        return row.get("error") or row.get("reason") or row.get("oom") or ""
    result = row.get("result") or {}
    if "merged_GiB" in result:
        return f"merged/: {len(result['merged_files'])} safetensors file(s), {result['merged_GiB']:.1f} GiB"
    heldout = (result.get("tasks") or {}).get("heldout") if isinstance(result.get("tasks"), dict) else None
    if heldout and "loss" in heldout:
        return f"heldout loss {heldout['loss']:.4f}"
    return ""


def table(rows: list[dict]) -> str:
    def fmt(value, digits=1):
        return "-" if value is None else f"{value:,.{digits}f}"

    body = [[r["name"], r["status"], fmt(r.get("tokens_per_s_per_device"), 0),
             fmt(r.get("peak_gpu_GiB")), fmt(r.get("seconds")), result_note(r)[:110]] for r in rows]
    return text_table(["row", "status", "tokens/s/GPU", "peak GPU GiB", "s", "note"], body)


def libraries() -> dict[str, str | None]:
    from importlib import metadata

    versions = {}
    for name in ("torch", "deepspeed", "transformers", "accelerate", "peft", "bitsandbytes", "torchao",
                 "liger-kernel", "lm-eval", "triton"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def parse_args(argv=None) -> argparse.Namespace:
    p = command_line.ArgumentParser(prog="python -m finetune_tools.gpu_check --smoke",
                                    description=__doc__.splitlines()[0],
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="(this mode)")
    p.add_argument("--tiny", action="store_true", default=None, help="tiny width on CPU (the default without a GPU)")
    p.add_argument("--rows", default=None, help=f"comma-separated rows (default: all): {', '.join(BY_ROW)}")
    p.add_argument("--rerun-failed", action="store_true",
                   help="run only the rows of --out/summary.json that did not pass, keeping the others")
    p.add_argument("--time-budget", type=float, default=None,
                   help=f"seconds from --started-at within which every row that starts must be expected to end "
                        f"(default {TIME_BUDGET} on a GPU, none on a CPU)")
    p.add_argument("--started-at", type=float, default=None,
                   help="the command's start, seconds since the epoch (date +%%s before the bundle install)")
    p.add_argument("--case-timeout", type=float, default=240, help="seconds before a row is stopped (default 240)")
    p.add_argument("--commit", default=None, help="the commit being run (default: git rev-parse HEAD, if a checkout)")
    p.add_argument("--out", type=Path, default=Path("out/gpu-smoke"), help="models, data, outputs, summary.json")
    p.add_argument("--root", type=Path, default=None, help="repository root (default: found from here)")
    return p.parse_args(argv)


def commit_of(root: Path, given: str | None) -> str | None:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    started = args.started_at or time.time()
    gpu = torch.cuda.is_available()
    tiny = (not gpu) if args.tiny is None else args.tiny
    budget = args.time_budget if args.time_budget is not None else (None if tiny else TIME_BUDGET)
    names = args.rows.split(",") if args.rows else list(BY_ROW)
    if unknown := [n for n in names if n not in BY_ROW]:
        print(f"error: unknown smoke row(s) {unknown}; they are {list(BY_ROW)}", file=sys.stderr)
        return 2
    root, out = find_root(args.root), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    previous = {}
    if args.rerun_failed:
        summary_path = out / "summary.json"
        if not summary_path.is_file():
            print(f"error: --rerun-failed reads {summary_path}, which does not exist: run the smoke first",
                  file=sys.stderr)
            return 2
        previous = {r["name"]: r for r in json.loads(summary_path.read_text())["rows"]}
        names = [n for n in names if previous.get(n, {}).get("status") not in PASSED]
    rows = [BY_ROW[n] for n in names]
    info = runner.gpu_memory() if gpu else None
    capability = host_check.gpu_capability() if gpu else None
    device = info["name"] if info else f"CPU ({platform.processor() or platform.machine()})"
    print(f"GPU smoke on {device}{' (tiny width)' if tiny else ''}: torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}; {len(rows)} row(s), expected {expected_total(rows) / 60:.1f} min on one H100 "
          f"with the set-up (measured there: gpu_check.smoke.SETUP_SECONDS, Row.seconds)"
          + (f"; budget {budget:.0f} s from the command's start" if budget else ""), flush=True)

    # ---- set-up: the host check, the models (each in a process of its own) beside the fused Adam build ----
    needed = sorted({r.case for r in rows if r.case} | {BY_ROW[r.reads].case for r in rows if r.reads})
    cases = [CASES[n] for n in needed]
    runnable = [c for c in cases if not (tiny and c.gpu_only)]
    fp8 = any(host_check.fp8_choice(r.flags) != "none" and not host_check.not_applicable(r.flags, capability)
              for r in rows)
    specs = sorted({(c.arch, c.family, c.layers, c.max_positions, c.prequantized) for c in runnable})
    unbuilt = [(a, n, q) for a, _, n, p, q in specs
               if not (runner.model_folder(out, a, n, tiny, p, q) / "config.json").is_file()]
    found = host_check.problems(runnable, out, gpu=gpu and not tiny,
                               model_bytes=sum(folder_bytes(a, n, tiny, q) for a, n, q in unbuilt),
                               gpu_used_GiB=info["total_GiB"] - info["free_GiB"] if info else None, fp8=fp8,
                               also=(("lm_eval",) if any(r.command == "eval" for r in rows) else ())
                               + (("liger_kernel",) if gpu and not tiny and any("liger" in r.flags for r in rows)
                                  else ()))
    if found:
        print("error: this host is not ready for the smoke; nothing was built or run:", file=sys.stderr)
        for problem in found:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    ops = {}
    if gpu and not tiny:
        from finetune_kit.launch.cuda_ops import jit_arch_list

        if note := jit_arch_list():
            print(note, flush=True)
        ops = {name: subprocess.Popen([sys.executable, "-c", code], stdout=(out / f"ops-{name}.log").open("w"),
                                      stderr=subprocess.STDOUT) for name, code in OPS.items()}
    models = runner.build_models(specs, out, tiny=tiny)
    for name, proc in ops.items():
        code = proc.wait()
        print(f"DeepSpeed op {name} {'built' if code == 0 else f'FAILED, see ops-{name}.log'}", flush=True)
    setup_s = round(time.time() - started, 1)
    print(f"set-up done {setup_s:.0f} s after the command's start", flush=True)

    # ---- the rows, each in a process of its own ----
    results = dict(previous)
    header = {"kind": "gpu-smoke", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "started_at": round(started), "device": device,
              "gpu": info, "compute_capability": ".".join(map(str, capability)) if capability else None,
              "tiny": tiny, "layers": LAYERS, "steps": STEPS, "commit": commit_of(root, args.commit),
              "cuda": torch.version.cuda, "libraries": libraries(), "budget_s": budget,
              "expected_s": expected_total(rows), "setup_s": setup_s, "rerun": bool(previous)}
    for row in rows:
        elapsed = time.time() - started
        about = {"name": row.name, "path": row.path, "expected_s": row.seconds}
        if skipped := why_not(row, results, tiny=tiny, capability=capability, elapsed=elapsed, budget=budget):
            results[row.name] = {**about, **skipped}
        else:
            # a row that overruns its expected time may end up to GRACE_S past the budget, no later
            timeout = args.case_timeout if budget is None else min(args.case_timeout, budget + GRACE_S - elapsed)
            with PeakGPU(gpu) as peak:
                results[row.name] = {**about, **run_row(row, root, out, models, tiny=tiny, gpu=gpu, timeout=timeout)}
            results[row.name]["peak_gpu_GiB"] = peak.peak
        ordered = [results[n] for n in BY_ROW if n in results]
        (out / "summary.json").write_text(json.dumps({**header, "total_s": round(time.time() - started, 1),
                                                      "rows": ordered}, indent=2) + "\n")
    ordered = [results[n] for n in BY_ROW if n in results]
    print("\n" + table(ordered))
    failed = [r["name"] for r in ordered if r["status"] not in PASSED + (NOT_RUN,)]
    print(f"\n{sum(r['status'] == OK for r in ordered)} of {len(ordered)} ok, {len(failed)} failed"
          + "".join(f", {n} {s}" for s in (NOT_APPLICABLE, NOT_RUN) if (n := sum(r['status'] == s for r in ordered)))
          + f"; {time.time() - started:.0f} s from the command's start; summary: {out / 'summary.json'}")
    return 1 if failed else 0


def why_not(row: Row, results: dict[str, dict], *, tiny: bool, capability: tuple[int, int] | None,
            elapsed: float, budget: float | None) -> dict | None:
    """Why ``row`` does not run now (``{"status", "reason"}``), or None to run it: on a CPU when it needs CUDA,
    an fp8 row below compute capability 8.9, a row whose input row did not pass (not applicable); a row expected
    to end past ``budget`` seconds, ``elapsed`` of them spent (not run)."""
    if tiny and row.cpu:
        return {"status": NOT_APPLICABLE, "reason": f"on a CPU: {row.cpu}"}
    if why := host_check.not_applicable(row.flags, capability):
        return {"status": NOT_APPLICABLE, "reason": why}
    if row.reads and results.get(row.reads, {}).get("status") != OK:
        return {"status": NOT_APPLICABLE, "reason": f"it reads the output of {row.reads}, which did not pass"}
    if budget is not None and elapsed + row.seconds > budget:
        return {"status": NOT_RUN, "reason": f"expected {row.seconds:.0f} s, {max(0, budget - elapsed):.0f} s of the "
                                             f"{budget:.0f} s budget left"}
    return None


def run_row(row: Row, root: Path, out: Path, models: dict, *, tiny: bool, gpu: bool, timeout: float) -> dict:
    """One row in its own process: the recipe (runner.run_case) or the command after it."""
    if row.command:
        return run_command(row, out / row.reads, out, gpu=gpu and not tiny, timeout=timeout)
    case = CASES[row.case]
    seq_len = (min(row.seq_len, TINY_LONG) if row.seq_len else runner.TINY["seq_len"]) if tiny \
        else row.seq_len or case.seq_len
    micro_batch = row.micro_batch or (runner.TINY["micro_batch"] if tiny else case.micro_batch)
    try:
        got = runner.run_case(case, root, out, models[(case.arch, case.family, case.layers, case.max_positions,
                                                                 case.prequantized)],
                              layers=case.layers, steps=STEPS, seq_len=seq_len, micro_batch=micro_batch, grad_accum=1,
                              save=row.save, timeout=timeout, name=row.name, data=row.data,
                              extra=("--meter-warmup-steps", str(row.warmup), *row.flags))
    except Exception as err:  # one broken row must not lose the others'
        return {"status": "failed", "error": repr(err)[:300]}
    if got["status"] != OK and got["status"] != "out of memory":
        log = (out / row.name / "run.log").read_text(errors="replace") if (out / row.name / "run.log").is_file() else ""
        got["error"] = error_line(log) if log else got.get("error", "")
    keep = ("status", "seconds", "exit", "oom", "error", "seq_len", "micro_batch", "extra_flags",
            "tokens_per_s_per_device", "model_tflop_per_s_per_device", "mfu_percent", "peak_gpu_allocated_GiB",
            "peak_gpu_reserved_GiB", "peak_gpu_device_GiB", "predicted_gpu_GiB", "step_time_s", "record")
    return {k: got[k] for k in keep if k in got}


if __name__ == "__main__":
    sys.exit(main())
