"""What the recipe tests share: launching a recipe as a user would, reading what it wrote, golden losses.

Every launch runs a recipe's own ``train.py`` from a copy of its folder (the ``recipe_copy``
fixture), with a free rendezvous port and one DeepSpeed op cache per interpreter.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from finetune_tools.gpu_check.runner import free_port  # noqa: F401  (re-exported for the recipe tests)

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "shared/finetune_kit/data/samples"
SAMPLE = SAMPLES / "instructions.jsonl"
SAMPLE_CHAT = SAMPLES / "chat.jsonl"  # multi-turn "messages" rows, some with a system turn
SAMPLE_REVIEWS = SAMPLES / "reviews.csv"
# Golden losses: CPU bf16 kernels round differently across CPU generations. Measured with
# benchmarks/loss_spread.py on an AVX512-BF16 CPU against oneDNN limited to AVX2
# (ONEDNN_MAX_CPU_ISA=AVX2) and 1 vs 2 threads per rank: the ZeRO-3, FSDP2, packed-chat and 13B
# goldens moved by at most 1.5e-4; 1e-3 leaves 6.7x that. A 1% higher learning rate moves the 8B
# run by 2.3e-3 and fails it (test_golden_losses_catch_a_one_percent_learning_rate_change).
LOSS_ATOL = 1e-3


# CPU threads per rank in every launch: accelerate launch and torchrun already set 1, the deepspeed
# launcher leaves torch's default (one per core). Pinned, runs compared across launchers use the
# same kernels and reduction orders, and 2 ranks fill a 2-core machine without oversubscribing it.
# OMP_NUM_THREADS in the test's own environment overrides it (benchmarks/loss_spread.py does).
THREADS_PER_RANK = "1"


def launch_env(extra: dict | None = None) -> dict:
    """The test's environment plus a DeepSpeed op cache of this interpreter's own, an Inductor
    cache of this interpreter's and CPU capability's own (:func:`inductor_cache`) and
    :data:`THREADS_PER_RANK`. DeepSpeed JIT-builds its CPU ops into a cache keyed by op name
    only: venvs sharing one rebuild each other's builds (a minute each)."""
    cache = Path.home() / ".cache/torch_extensions" / f"venv-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]}"
    return {**os.environ, "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(cache)),
            "TORCHINDUCTOR_CACHE_DIR": inductor_cache(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", THREADS_PER_RANK), **(extra or {})}


def inductor_cache() -> str:
    """A ``torch.compile`` (Inductor) cache folder for this interpreter and the CPU capability ATen
    runs with (``ATEN_CPU_CAPABILITY`` lowers it). Inductor's graph cache key leaves that capability
    out, while its C++ kernels are built for it: measured with torch 2.13, a compiled FSDP2 run
    whose cache was filled under AVX512 dies of heap corruption (SIGSEGV, SIGABRT "corrupted size
    vs. prev_size") under ``ATEN_CPU_CAPABILITY=avx2``, and the same run passes with a cold cache.
    Always this folder: importing Inductor in the test process writes its own default into
    ``os.environ``, so an inherited value cannot tell a user's choice from that default."""
    import torch

    key = f"{sys.prefix}|{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}"
    return str(Path(tempfile.gettempdir()) / f"torchinductor-{hashlib.sha1(key.encode()).hexdigest()[:10]}")


def run_command(cmd: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=launch_env())


def make_target(target: str, *variables: str) -> subprocess.Popen:
    """``make TARGET CPU=1 VAR=value ...`` started from the repository root, as a recipe's README runs it
    (CPU=1: on this machine's CPUs instead of its GPUs). Wait with :func:`wait_all`."""
    return subprocess.Popen(["make", "--no-print-directory", "-C", str(REPO), target, "CPU=1", *variables],
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=launch_env())


def accelerate_command(*args: str, config: str, nproc: int = 2, launcher_args=()) -> list[str]:
    """``accelerate launch --config_file CONFIG --num_processes N train.py ARGS``, on a free port of its own
    unless ``launcher_args`` name one: not the config's or accelerate's 29500, which a launch of a session
    running beside this one may hold (make test runs sessions side by side)."""
    port = () if "--main_process_port" in launcher_args else ("--main_process_port", str(free_port()))
    return ["accelerate", "launch", "--config_file", config, "--num_processes", str(nproc), *port, *launcher_args,
            "train.py", *args]


def accelerate_launch(cwd: Path, *args: str, config: str, nproc: int = 2, launcher_args=(), timeout: int = 900):
    """:func:`accelerate_command` run from ``cwd``."""
    return run_command(accelerate_command(*args, config=config, nproc=nproc, launcher_args=launcher_args), cwd, timeout)


def warm_run(cmd: list[str], cwd: Path, timeout: int = 900, extra: dict | None = None) -> subprocess.CompletedProcess:
    """A launch command (:func:`accelerate_command`, :func:`script_command`) run from ``cwd`` with its ranks forked
    from a process that imported the stack once (tests/warm_launch.py): the same ranks, environment and results as
    :func:`run_command`'s, without each process's start-up. For tests of what the ranks compute; the launcher's own
    behaviour is tested with real ones."""
    from tests import launch_times, warm_launch

    start = time.monotonic()
    try:
        return warm_launch.run(cmd, cwd, launch_env(extra), timeout)
    finally:
        launch_times.count(time.monotonic() - start)


def warm_launch(cwd: Path, *args: str, config: str, nproc: int = 2, launcher_args=(), timeout: int = 900):
    """:func:`accelerate_launch`, its ranks warm (:func:`warm_run`)."""
    return warm_run(accelerate_command(*args, config=config, nproc=nproc, launcher_args=launcher_args), cwd, timeout)


def run_and_signal(cmds: list[list[str]], cwd: Path, output: Path, after_step: int, signalled: tuple[int, ...] = (0,),
                   sig: int = signal.SIGTERM, ranks_only: bool = False, timeout: int = 900,
                   env: dict | None = None, watched: tuple[int, ...] | None = None,
                   ) -> tuple[list[subprocess.CompletedProcess], float]:
    """Start ``cmds`` together (one launcher per node); once ``output/metrics.jsonl`` has logged
    ``after_step``, send ``sig`` to every process of the jobs numbered in ``signalled`` (each
    launcher's process group, as Ctrl-C in a terminal or a scheduler's signal reaches them all;
    with ``ranks_only``, to the launcher's descendants alone, as ``pkill -f train.py`` does).
    Return the launchers' processes, with the output of their whole groups, and the seconds from
    the signal until every process of the ``watched`` jobs (default: all) has exited; the others
    are then killed. ``env``: extra environment variables."""
    logs = Path(tempfile.mkdtemp(prefix="signalled-"))
    procs = []
    for n, cmd in enumerate(cmds):
        with (logs / f"{n}.out").open("w") as out, (logs / f"{n}.err").open("w") as err:
            procs.append(subprocess.Popen(cmd, cwd=cwd, text=True, stdout=out, stderr=err, env=launch_env(env),
                                          start_new_session=True))
    start = time.monotonic()
    metrics = output / "metrics.jsonl"
    while all(p.poll() is None for p in procs) and time.monotonic() - start < timeout:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= after_step:
            break
        time.sleep(0.1)
    import psutil

    def descendants(pid: int) -> list:  # a process may end while it is listed or signalled (a shell's helper)
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(pid).children(recursive=True)
        return []

    family = [c for p in procs if p.poll() is None for c in descendants(p.pid)]
    sent = time.monotonic()
    for n in signalled:
        if procs[n].poll() is None and ranks_only:
            for child in descendants(procs[n].pid):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.send_signal(sig)
        elif procs[n].poll() is None:
            os.killpg(procs[n].pid, sig)
    # a launcher may go before its ranks (DeepSpeed's runner dies at once): wait for whole groups
    waited = [procs[n] for n in (range(len(procs)) if watched is None else watched)]
    while any(p.poll() is None or _group_alive(p.pid) for p in waited) and time.monotonic() - sent < timeout:
        time.sleep(0.1)
    elapsed = time.monotonic() - sent
    for p in procs:
        if _group_alive(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for child in family:  # torch's agent starts its ranks in sessions of their own: left behind when it died
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    done = [subprocess.CompletedProcess(cmd, p.returncode, (logs / f"{n}.out").read_text(),
                                        (logs / f"{n}.err").read_text())
            for n, (cmd, p) in enumerate(zip(cmds, procs, strict=True))]
    shutil.rmtree(logs)
    return done, elapsed


@contextlib.contextmanager
def killed_whole_after(cmd: list[str], cwd: Path, output: Path, step: int, timeout: int = 600):
    """Start ``cmd`` and wait until ``output/metrics.jsonl`` has logged step ``step``; stop every process of
    the job there (SIGSTOP: still alive, going no further) and yield the launcher; then SIGKILL them all
    at once, the launcher and all its descendants (the ranks included: torchrun starts them in sessions of
    their own), as a lost node or a killed container ends a job. Nothing gets to run an exit handler or
    finish a save."""
    import psutil

    logs = Path(tempfile.mkdtemp(prefix="killed-"))
    with (logs / "out").open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, text=True, stdout=out, stderr=subprocess.STDOUT, env=launch_env(),
                                start_new_session=True)
    metrics, start = output / "metrics.jsonl", time.monotonic()
    try:
        while not (metrics.is_file() and _last_step(metrics) >= step):
            assert proc.poll() is None, f"the run ended before step {step}:\n{(logs / 'out').read_text()[-3000:]}"
            assert time.monotonic() - start < timeout, f"no step {step} within {timeout} s"
            time.sleep(0.05)
        job = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        for pid in job:
            os.kill(pid, signal.SIGSTOP)
        proc.printed = (logs / "out").read_text()  # what the job printed until it was stopped
        yield proc
    finally:
        job = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        for pid in job:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        for pid in job[1:]:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(timeout=30)
        shutil.rmtree(logs)


@contextlib.contextmanager
def small_filesystem(path: Path, size: int):
    """A real filesystem of ``size`` bytes mounted at ``path`` (tmpfs; root only, as CI runs) for as long as the
    block runs; unmounted after. Skips the test where this process cannot mount one."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (as root in CI): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


class _Filler:
    """What :func:`fills_when_opened` did: ``opened`` the path whose opening made it fill (None: never),
    ``when`` the ``time.monotonic()`` of the fill, ``taken`` the bytes it took."""

    opened: str | None = None
    when: float | None = None
    taken: int = 0


@contextlib.contextmanager
def fills_when_opened(disk: Path, pattern: str):
    """Another writer on the filesystem mounted at ``disk`` (:func:`small_filesystem`) that takes all of its free
    room the moment a process opens a file whose path matches ``pattern`` (``re.search``), before that open
    returns: a fanotify permission event holds the opener until this writer has filled the disk and answered. So
    the fill lands at an exact point of a save (after any check of free space the saver made before opening the
    file) on every run. The room is given back when the block ends. Skips where fanotify is not at hand (root
    only, as CI runs)."""
    import ctypes
    import select
    import struct
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
    fan = libc.fanotify_init(0x4 | 0x1, os.O_RDONLY)  # FAN_CLASS_CONTENT | FAN_CLOEXEC
    if fan < 0:
        pytest.skip(f"fanotify is not at hand here (root only): {os.strerror(ctypes.get_errno())}")
    filler = os.open(disk / ".other-writer", os.O_CREAT | os.O_RDWR)  # opened before the mark: no event of its own
    if libc.fanotify_mark(fan, 0x1 | 0x10, 0x10000, -100, str(disk).encode()) != 0:  # ADD|MOUNT, FAN_OPEN_PERM
        os.close(fan)
        pytest.skip(f"fanotify cannot watch {disk}: {os.strerror(ctypes.get_errno())}")
    done, got, stopping = _Filler(), re.compile(pattern), threading.Event()

    def fill() -> None:
        chunk = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        while chunk >= 4096:
            try:
                os.posix_fallocate(filler, done.taken, chunk)
                done.taken += chunk
            except OSError:
                chunk //= 2

    def answer() -> None:
        while not stopping.is_set():
            if not select.select([fan], [], [], 0.05)[0]:
                continue
            events = os.read(fan, 4096)
            while events:
                length, _, _, _, _, fd, _ = struct.unpack("IBBHQii", events[:24])
                try:
                    path = os.readlink(f"/proc/self/fd/{fd}")
                    if done.opened is None and got.search(path):
                        fill()
                        done.opened, done.when = path, time.monotonic()
                finally:  # every open is let through, the one that filled the disk too
                    os.write(fan, struct.pack("iI", fd, 0x1))  # FAN_ALLOW
                    os.close(fd)
                events = events[length:]

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stopping.set()
        thread.join()
        os.close(fan)  # any open still waiting is let through
        os.close(filler)
        os.unlink(disk / ".other-writer")


def tensors_in(value):
    """Every tensor in a nested structure (a checkpoint's dicts, lists and tuples)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


POISON_WORD = "qoxwyzzj"  # no row of the samples holds it: its tokens are the poisoned row's alone


def poisoned_copy(model: Path, rows: list[dict], row: int, out: Path, text=None, inserted: dict | None = None,
                  ) -> tuple[Path, str]:
    """A copy of ``model`` (under ``out``) whose input embedding of one token is NaN, and ``rows`` with a row
    inserted as row ``row`` (counted from 1) that alone holds that token: the model itself computes a NaN loss for
    that row and for no other. ``text``: a row's text (default: prompt and response); ``inserted``: the row (default:
    a prompt and response). Returns the model folder and the rows' file (JSON lines; a review's: CSV)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    text = text or (lambda r: f"{r['prompt']} {r['response']}")
    rows = list(rows)
    rows.insert(row - 1, inserted or {"prompt": f"Define the word '{POISON_WORD}'.",
                                      "response": f"'{POISON_WORD}' is no word."})
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens = [set(tokenizer(text(r))["input_ids"]) for r in rows]
    others = set().union(*(t for i, t in enumerate(tokens) if i != row - 1))
    token = min(tokens[row - 1] - others)  # only this row has it
    copy = out / "poisoned"
    shutil.copytree(model, copy)
    weights = load_file(copy / "model.safetensors")
    weights["model.embed_tokens.weight"][token] = float("nan")
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    if inserted is None:
        return copy, write_jsonl(out / "rows.jsonl", rows)
    import csv

    with (out / "rows.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return copy, str(out / "rows.csv")


def nonfinite_lines(proc, prefix: str) -> list[str]:
    """Each line of the launch's output from ``prefix`` on (a progress bar's redraw, ended by a carriage return,
    may come before it on the same line)."""
    return [part[part.index(prefix):] for part in re.split(r"[\r\n]", proc.stdout + "\n" + proc.stderr)
            if prefix in part]


def named_rows(line: str) -> set[int]:
    """The row numbers a non-finite step's line names (``rows 1-2, 6 (3)``)."""
    spans = re.search(r"held rows? ([\d, -]+) \(\d+\) of data", line)[1]
    return {n for span in spans.split(", ") for n in range(int(span.split("-")[0]), int(span.split("-")[-1]) + 1)}


def _last_step(metrics: Path) -> int:
    """The step of the last complete line of a metrics.jsonl being written (0 if none)."""
    lines = [line for line in metrics.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1])["step"] if lines else 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def checked(launch: list[str], *check_args: str) -> list[str]:
    """``python -m finetune_kit.check [check_args] <launch>``: the inputs checked once, then the launch."""
    return [sys.executable, "-m", "finetune_kit.check", *check_args, *launch]


def assert_one_line_error(proc: subprocess.CompletedProcess, pattern: str, status: int) -> None:
    """Exit ``status``, and the launch's output ends with ``error: <pattern>``, said once."""
    assert proc.returncode == status, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    last = proc.stderr.rstrip().splitlines()[-1]
    assert re.fullmatch(f"error: {pattern}", last), proc.stderr[-4000:]
    assert (proc.stdout + proc.stderr).count("error: ") == 1, proc.stderr[-4000:]


def script_command(*args: str, launcher: str = "deepspeed", nproc: int = 2) -> list[str]:
    """``deepspeed --num_gpus N`` or ``torchrun --nproc_per_node N`` on train.py, free port."""
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", str(nproc), "--master_port", port]
    elif launcher == "torchrun":
        cmd = ["torchrun", "--nproc_per_node", str(nproc), "--master_port", port]
    else:
        raise ValueError(f"launcher {launcher!r}: deepspeed or torchrun")
    return [*cmd, "train.py", *args]


def script_launch(cwd: Path, *args: str, launcher: str = "deepspeed", nproc: int = 2, timeout: int = 900):
    """:func:`script_command` run from ``cwd``."""
    return run_command(script_command(*args, launcher=launcher, nproc=nproc), cwd, timeout)


def launch_nodes(cwd: Path, commands: list[list[str]], envs: list[dict | None], timeout: int = 600):
    """Start one launcher per "node" at once; return all finished processes (killed together
    when one outlives ``timeout``)."""
    procs = [subprocess.Popen(cmd, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=launch_env(extra)) for cmd, extra in zip(commands, envs, strict=True)]
    return wait_all(procs, timeout)


def side_by_side(launches: list[tuple[Path, list[str]]], timeout: int = 900,
                 warm: bool = False) -> list[subprocess.CompletedProcess]:
    """Each ``(cwd, command)`` started at once, all finished: for one-process launches, each on a core of its
    own (most of a short launch is its interpreter's start-up, on one core). Give each its own port. ``warm``:
    their ranks warm (:func:`warm_run`), a third item of a launch its extra environment."""
    if warm:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(launches)) as pool:
            return list(pool.map(lambda launch: warm_run(launch[1], launch[0], timeout, *launch[2:]), launches))
    procs = [subprocess.Popen(cmd, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=launch_env()) for cwd, cmd in launches]
    return wait_all(procs, timeout)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    """Each process's output and exit status; all are killed when one outlives ``timeout``."""
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def assert_finished(proc: subprocess.CompletedProcess, steps: int | None = None, name: str = "run") -> None:
    """Exit 0 and, when ``steps`` is given, the summary line of that many steps."""
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if steps is not None:
        assert f"done: {steps} steps" in proc.stdout, proc.stdout[-3000:]


def assert_failed_early(proc: subprocess.CompletedProcess, *messages: str) -> None:
    """A non-zero exit with one ``error:`` line (rank 0's) naming ``messages``, and no Python traceback."""
    assert proc.returncode != 0
    for text in messages:
        assert text in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("error: ") == 1, proc.stderr[-4000:]
    assert "[rank0]: Traceback" not in proc.stderr  # the script exits with the message alone


# ---- what a run wrote ----

def read_metrics(output: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per logged step."""
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def losses(output: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(output)]


def read_run_info(output: Path) -> dict:
    return json.loads((output / "run_info.json").read_text())


def assert_matches_golden(got: list[float], golden: Path, steps: int, atol: float = LOSS_ATOL) -> None:
    """Per-step losses equal the committed golden ones within ``atol``. ``UPDATE_GOLDEN=1``
    rewrites the file first (after an intended numerics change; say why in the commit)."""
    assert len(got) == steps, got
    if os.environ.get("GOLDEN_SPREAD_LOG"):  # benchmarks/loss_spread.py: how far this machine lands
        want = json.loads(golden.read_text())["losses"]
        with open(os.environ["GOLDEN_SPREAD_LOG"], "a") as log:
            log.write(json.dumps({"golden": golden.name, "losses": got,
                                  "max_abs_diff": max(abs(a - b) for a, b in zip(got, want, strict=True))}) + "\n")
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(json.dumps({"steps": steps, "atol": atol, "losses": got}, indent=2) + "\n")
    assert got == pytest.approx(json.loads(golden.read_text())["losses"], abs=atol)


def assert_throughput_metrics(output: Path, world: int = 2) -> None:
    """Every logged step carries real tokens, rates per device, padding and memory; no MFU on CPU."""
    for m in read_metrics(output):
        assert m["tokens"] > 0 and m["tokens_per_s"] > 0 and m["host_rss_GiB"] > 0
        assert m["tokens_per_s_per_device"] == pytest.approx(m["tokens_per_s"] / world)
        assert 0 <= m["padding_fraction"] < 1 and m["model_tflop_per_s_per_device"] > 0
        assert "mfu_percent" not in m  # a CPU has no bf16 peak to compare with


def assert_ranks_disjoint(run_info: dict, world: int = 2) -> None:
    """Every rank saw the whole world and trained on its own rows; validation rows held out."""
    assert run_info["devices"] == world
    ranks = {r["rank"]: r for r in run_info["ranks"]}
    assert sorted(ranks) == list(range(world))
    assert all(r["world_size"] == world for r in ranks.values())
    ids = {i: set(r["example_ids"]) for i, r in ranks.items()}
    assert all(ids.values()) and not set.intersection(*ids.values())
    assert not set.union(*ids.values()) & set(run_info["eval_example_ids"])


# ---- one model, however the batch is split ----

# ranks x micro-batch x accumulation: the same 8 sequences in every optimizer step
SPLITS = ((1, 8, 1), (1, 2, 4), (2, 2, 2), (2, 4, 1))
# packed rows, whose tokens per micro-batch differ from rank to rank and from one accumulation step to the next:
# 1 x 8 x 1 against 2 x 2 x 2, which splits across ranks and accumulation at once (padded rows run all four)
PACKED_SPLITS = ((1, 8, 1), (2, 2, 2))
# Measured with the loss over each step's labelled tokens (tiny Llama 3, the 8B recipe's tests, 4 steps of the
# shipped sample, AMD EPYC): every split's per-step losses within 7.5e-5 of 1 x 8 x 1 (padded, packed, FSDP2; 1.5e-4
# at another seed), its weight update within 1.2e-2 (relative, L2): the same sums in another order, then bf16 weights
# rounding differently. Each micro-batch's own mean, the negative control: 2.7e-2 and 0.42 off.
SPLIT_LOSS_ATOL = 1e-3
SPLIT_UPDATE_RTOL = 5e-2
# The gradient norm before clipping (metrics.jsonl's grad_norm) shows the scale the engines' averaging leaves, which
# Adam's update would hide: measured within 3e-4 (relative) across the splits; a missing rank or accumulation factor
# is 2x to 8x off, each micro-batch's own mean 7% off at step 1.
SPLIT_GRAD_NORM_RTOL = 5e-3


def split_args(ranks: int, micro: int, accum: int, micro_flag: str = "--micro-batch-size",
               accum_flag: str = "--grad-accum") -> list[str]:
    return [micro_flag, str(micro), accum_flag, str(accum)]


def saved_update(output: Path, initial: Path | None, file: str, keep=lambda name: True):
    """The saved weights minus the initial ones (``initial``: a folder with ``model.safetensors``; None: zeros,
    as LoRA's B matrices start), flat, over the tensors whose names ``keep``."""
    import torch
    from safetensors.torch import load_file

    final = load_file(output / file)
    start = load_file(initial / "model.safetensors") if initial is not None else {}
    names = sorted(n for n in final if keep(n))
    assert names, f"no weights to compare in {output / file}"
    return torch.cat([(final[n].float() - (start[n].float() if n in start else 0)).flatten() for n in names])


def assert_one_model_for_every_split(runs: dict, initial: Path | None, file: str = "model/model.safetensors",
                                     keep=lambda name: True, loss_atol: float = SPLIT_LOSS_ATOL,
                                     update_rtol: float = SPLIT_UPDATE_RTOL,
                                     norm_rtol: float = SPLIT_GRAD_NORM_RTOL) -> None:
    """Every run of ``runs`` ({(ranks, micro, accum): output}) logged the first one's per-step losses within
    ``loss_atol`` and gradient norms within ``norm_rtol`` (relative), and saved its weight update within
    ``update_rtol`` (relative, L2)."""
    (_, reference), *others = runs.items()
    want, base = losses(reference), saved_update(reference, initial, file, keep)
    want_norms = [m.get("grad_norm") for m in read_metrics(reference)]
    report, ok = [], True
    for split, output in others:
        got, update = losses(output), saved_update(output, initial, file, keep)
        assert len(got) == len(want), (split, got, want)
        loss_diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
        update_diff = float((update - base).norm() / base.norm())
        norms = [m.get("grad_norm") for m in read_metrics(output)]
        assert None not in norms + want_norms, "every step logs its gradient norm"
        norm_diff = max(abs(a / b - 1) for a, b in zip(norms, want_norms, strict=True))
        ok &= loss_diff <= loss_atol and update_diff <= update_rtol and norm_diff <= norm_rtol
        report.append(f"{'x'.join(map(str, split))}: largest |loss difference| {loss_diff:.1e}, "
                      f"weight update {update_diff:.1e} apart, gradient norm {norm_diff:.1e} apart")
    print("\n".join(report))
    assert ok, (f"not one model (losses within {loss_atol}, updates within {update_rtol}, gradient norms within "
                f"{norm_rtol}): " + "; ".join(report))


def sample_examples(tokenizer, ids: list[int], max_seq_len: int, chat_template: str = "auto",
                    source: Path = SAMPLE) -> list[dict]:
    """The tokenised examples of source rows ``ids`` (in that order), as a recipe makes them."""
    from finetune_kit.data import instructions

    examples, _ = instructions.tokenize_rows(instructions.load_rows(str(source)), tokenizer, max_seq_len, chat_template)
    by_row = {ex["example_ids"][0]: ex for ex in examples}
    return [by_row[i] for i in ids]


def bad_input_args(args: dict) -> list[str]:
    """``{"--flag": value}`` as a command line (a value of None drops the flag; True: the flag alone)."""
    return [x for k, v in args.items() if v is not None for x in ((k,) if v is True else (k, v))]


def assert_resumed_like_uninterrupted(straight: Path, resumed: Path, from_step: int, steps: int,
                                      atol: float = 1e-4) -> None:
    """The resumed run logged steps from_step+1 .. steps with the uninterrupted run's losses
    (same data order, optimizer, schedule and RNG state)."""
    got = read_metrics(resumed)
    assert [m["step"] for m in got] == list(range(from_step + 1, steps + 1))
    want = losses(straight)[from_step:]
    diff = max(abs(m["loss"] - w) for m, w in zip(got, want, strict=True))
    print(f"resumed vs uninterrupted: largest |loss difference| {diff:.2e}")
    assert [m["loss"] for m in got] == pytest.approx(want, abs=atol)


def assert_refused_to_overwrite(proc: subprocess.CompletedProcess, checkpoints: Path, before: list[str],
                                resume_flag: str = "--resume") -> None:
    """A launch into a folder with checkpoints stopped, named the flag to resume, kept every checkpoint."""
    assert proc.returncode != 0
    assert f"already holds {len(before)} checkpoint(s)" in proc.stderr and resume_flag in proc.stderr, proc.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == before


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Write rows as JSON lines; return the path as a string (what --data takes)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load_script(path: Path):
    """Import a recipe's train.py as a module (recipes are folders, not packages)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{path.parent.name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as `python train.py` has its __main__: its dataclasses resolve their fields
    spec.loader.exec_module(module)
    return module


# ---- two hosts: network namespaces joined by a veth pair ----

def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's 'ip' command"
    probe = f"ft-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextlib.contextmanager
def two_hosts(addrs: tuple[str, str] = ("10.203.0.1", "10.203.0.2"), interface: str | None = None):
    """Two network namespaces, the nodes of a two-host test, on a veth pair with ``addrs``; with
    ``interface``, each end is renamed to it (one name on both hosts, as a site's nodes share
    ``eth0``). Yields (namespaces, interfaces, addresses); always deleted."""
    tag = uuid.uuid4().hex[:6]
    ns, dev = [f"fthost-{tag}-{i}" for i in (0, 1)], [f"v{tag}{i}" for i in (0, 1)]  # interface names <= 15 chars
    try:
        for name in ns:
            subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(["ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1]], check=True)
        for name, iface, addr in zip(ns, dev, addrs, strict=True):
            subprocess.run(["ip", "link", "set", iface, "netns", name], check=True)
            if interface:
                subprocess.run(["ip", "-n", name, "link", "set", iface, "name", interface], check=True)
            subprocess.run(["ip", "-n", name, "addr", "add", f"{addr}/24", "dev", interface or iface], check=True)
            subprocess.run(["ip", "-n", name, "link", "set", interface or iface, "up"], check=True)
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield ns, [interface] * 2 if interface else dev, list(addrs)
    finally:
        for name in ns:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def assert_levers_auto_took_the_first_of_the_ranking(output: Path, model: Path, given: tuple[int, int], *,
                                                     gpu: str = "h100", network: str | None = None) -> None:
    """The run in ``output`` launched with ``--levers auto --levers-gpu gpu`` from the installed package: its record's
    line names the package's calibrated constants, and the flags it trained with are those of the first line of
    ``levers.rank`` for that launch (its setup as run_info.json records it, at the launched micro-batch and
    accumulation ``given`` with checkpointing), recomputed here with the planner's own API."""
    from dataclasses import replace

    from finetune_kit.models.shapes import Adapter
    from finetune_kit.planning import hardware, levers, speed, verdict

    record = json.loads((output / "run_record.json").read_text())["training"]
    assert record["levers"].startswith("levers auto: ") and "the global batch kept" in record["levers"]
    assert record["levers"].endswith(f"speed constants: {speed.CALIBRATED}"), record["levers"]
    fields = read_run_info(output)["memory_plan"]["setup"]
    adapter = fields.pop("adapter")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    if adapter:
        adapter = Adapter(**{k: tuple(v) if isinstance(v, list) else v for k, v in adapter.items()})
    setup = verdict.Setup(**fields, adapter=adapter)
    base = replace(setup, gpu_memory_GiB=hardware.GPUS[gpu].memory_GiB, micro_batch=given[0],
                   gradient_checkpointing=True, recompute_every=1)
    cluster = speed.Cluster(hardware.GPUS[gpu], setup.gpus_per_node, setup.nodes,
                            hardware.network_profile(network) if network else None)
    kernels = ("none",) if setup.num_labels or not setup.loss_chunks else ("chunked",)
    first = levers.rank(levers.options(str(model), base, given[1], cluster, speed.calibrated()[0],
                                       loss_kernels=kernels, compile_ok=False))[0]
    ran = (f"--micro-batch-size {record['micro_batch_size']} --grad-accum {record['grad_accum']} "
           + (f"--recompute-every {record['recompute_every']}" if record["gradient_checkpointing"]
              else "--no-gradient-checkpointing")
           + (f" --loss-kernel {record['loss_kernel']}" if kernels != ("none",) else ""))
    assert ran == first.flags(), (ran, first.flags())
    assert record["micro_batch_size"] * record["grad_accum"] == given[0] * given[1]
    cards = list(output.glob("*/README.md"))  # the model card reads the plan from the record
    assert cards and all(record["levers"] in card.read_text() for card in cards), cards


# Measured (AVX2-only AMD EPYC; tiny Llama 3 in fp32 for the comparison): PeftModel over the base against make
# merge's fp32 folder, largest |logit difference| 2.4e-7 and 2.6e-7 (the 8B recipe's LoRA run, two runs) and 2.4e-7
# (the 70B chat recipe's QLoRA run), at logits up to 0.68 in magnitude; the base without the adapter is 0.41 and
# 0.59 away (the negative control).
MERGED_LOGITS_ATOL = 1e-5


def assert_adapter_answers_as_its_fp32_merge(run: Path, base: Path, tmp_path: Path, prompt: str) -> None:
    """`make merge` of a copy of ``run`` in fp32 (so the comparison is not bf16's rounding): plain
    `PeftModel.from_pretrained` over ``base`` gives that folder's logits for ``prompt`` within MERGED_LOGITS_ATOL,
    and the base alone does not (more than 100x away: the negative control)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "merged"))
    proc, = wait_all([make_target("merge", f"RUN={copy}", "MERGE_ARGS=--dtype float32")], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(copy / "adapter")
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)

    def logits(model):
        with torch.no_grad():
            return model.eval()(**inputs).logits

    plain = logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    adapted = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                               copy / "adapter"))
    merged = logits(AutoModelForCausalLM.from_pretrained(copy / "merged"))
    print(f"adapter vs merged: {(adapted - merged).abs().max():.1e}; base vs adapter: "
          f"{(adapted - plain).abs().max():.1e} (logits up to {adapted.abs().max():.2f})")
    torch.testing.assert_close(adapted, merged, rtol=0, atol=MERGED_LOGITS_ATOL)
    assert (adapted - plain).abs().max() > 100 * MERGED_LOGITS_ATOL
