"""A launch whose ranks are forked from a process that has already imported the stack.

A tiny model's launch is mostly interpreter start-up. Measured on a 2-core AMD EPYC, an 8-step, 2-rank launch of
the 8B recipe took 41.7 CPU seconds, 12.5 of them training steps: each rank spends about 11 importing torch,
transformers, DeepSpeed, accelerate and datasets, and the launcher about 8. The same ranks forked from a process
that had imported them took 16.4 CPU seconds and gave the same losses, bit for bit.

:func:`run` runs a launch command (``accelerate launch``, ``deepspeed`` or ``torchrun`` on a script) that way, for
the tests that compare what ranks compute (losses, saved models, records). One server process per test process
(``python -m tests.warm_launch SOCKET``) imports the stack once, in the launch environment
(:func:`tests.harness.launch_env`), then forks once per launch:

1. the launcher's own entry point runs the command with this module as its script, in a fork: it sets each rank's
   environment and arguments as it would for the real script (accelerate's and torch's elastic agent, or
   DeepSpeed's ``--local_rank``), and each rank, a plain interpreter that imports nothing heavy, writes them down;
2. one fork per rank then runs the script (``runpy``, as ``python -u SCRIPT ARGS`` would: ``__main__``, the
   script's folder first on ``sys.path``, the interpreter's exit) in that environment, less the elastic agent's
   error file; where the agent would serve its ranks a rendezvous store, a process forked for it does;
3. when a rank fails, the others are stopped (SIGTERM, then SIGKILL after 10 s), as the launchers do.

The launchers' own behaviour (exit statuses, signals, the input check before them, the README's commands) is tested
with real launches, and the 8B recipe's tests check that a warm launch trains the model a real one trains, byte for
byte. What differs from a real launch: the ranks share the server's hash seed (``random`` and NumPy's global
generator are reseeded from the OS in each rank, as a fresh interpreter's are), and a library read the server's
environment at import, so a launch whose environment differs from it (beyond :data:`PER_LAUNCH`) is refused.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# imported by the server before it forks: what every rank of a recipe imports (measured: nearly all of its start-up)
STACK = ("torch", "torch.distributed", "torch.distributed.run", "transformers", "transformers.modeling_utils",
         "transformers.generation", "transformers.trainer", "datasets", "deepspeed", "deepspeed.launcher.runner",
         "accelerate", "accelerate.commands.launch", "peft", "finetune_kit.training", "finetune_kit.data",
         "finetune_kit.models")
# set by torch's elastic agent for a rank: the error file it reads (none here) and whether the rank joins the
# agent's rendezvous store, which the launch's supervisor then serves (:func:`serve_agent_store`)
AGENT_ERROR_FILE, AGENT_STORE = "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"
LAUNCHERS = ("accelerate", "deepspeed", "torchrun")
# may differ from the server's environment: read when a run starts, not at import. ACCELERATE_*: what accelerate's
# launcher sets for each rank (and accelerate's state into the test's own process, for a run there); and
# KMP_DUPLICATE_LIB_OK, set by scikit-learn's import in the test's process and read by Intel's OpenMP runtime as it
# loads, which torch's CPU wheel does not use
PER_LAUNCH = ("PYTEST_CURRENT_TEST", "FINETUNE_METRICS_PORT", "FINETUNE_METRICS_ADDR", "KMP_DUPLICATE_LIB_OK",
              "ACCELERATE_")
DUMP = "WARM_LAUNCH_ENVIRONMENTS"  # where a launched rank of this module writes its environment
STOP_GRACE_S = 10


# ---- the test's side ----

class Server:
    """The forking server of this test process, started at its first launch."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.folder = Path(tempfile.mkdtemp(prefix="warm-launch-"))
        self.socket = self.folder / "socket"
        self.log = self.folder / "server.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm_launch", str(self.socket)], env=self.env,
                                         cwd=Path(__file__).resolve().parents[1], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm launch server did not start:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_server: Server | None = None
_starting = threading.Lock()  # launches started side by side, from threads, share one server


def server(env: dict[str, str]) -> Server:
    global _server
    with _starting:
        if _server is None or _server.proc.poll() is not None:
            import atexit

            _server = Server(env)
            atexit.register(_server.stop)
    return _server


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    """``command`` (``accelerate launch``, ``deepspeed`` or ``torchrun`` on a script, with its arguments) run from
    ``cwd`` in ``env`` with its ranks forked warm; stdout and stderr are the ranks', in rank order. Raises
    :class:`subprocess.TimeoutExpired` (the ranks killed) after ``timeout`` seconds, and ValueError for another
    command or an ``env`` that differs from the server's in a variable the stack may have read at import."""
    split_command(command)
    srv = server(env)
    differ = sorted(k for k in set(env) | set(srv.env) if env.get(k) != srv.env.get(k) and not k.startswith(PER_LAUNCH))
    if differ:
        raise ValueError(f"a warm launch needs the environment its server imported the stack in; {differ} differ "
                         "(launch this one with tests.harness.run_command instead)")
    logs = Path(tempfile.mkdtemp(prefix="ranks-", dir=srv.folder))
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(srv.socket))
        request = {"cwd": str(cwd), "command": command, "env": env, "logs": str(logs)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        reader, pids, code = conn.makefile("r"), [], None
        while code is None:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                line = reader.readline()
            except TimeoutError:
                for pid in pids:
                    with _gone():
                        os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout, *_outputs(logs)) from None
            if not line:
                launcher = logs / "launcher.log"
                raise RuntimeError(f"the warm launch server dropped {command}:\n{srv.log.read_text()[-3000:]}\n"
                                   + (launcher.read_text(errors="replace")[-3000:] if launcher.is_file() else ""))
            reply = json.loads(line)
            pids, code = reply.get("pids", pids), reply.get("returncode")
    done = subprocess.CompletedProcess(command, code, *_outputs(logs))
    shutil.rmtree(logs, ignore_errors=True)
    return done


def _outputs(logs: Path) -> tuple[str, str]:
    def read(suffix: str) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"*{suffix}")))

    return read(".out"), read(".err")


class _gone:  # a process may have ended by the time it is signalled, or none may be left to reap
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, (ProcessLookupError, ChildProcessError))


# ---- the server's side ----

def serve(path: str) -> None:
    import importlib

    for name in STACK:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the name: it appears once the server accepts
    print(f"warm launch server {os.getpid()}: stack imported, serving {path}", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    parent = os.getppid()
    while os.getppid() == parent:  # the test process gone (even killed outright): so is the server
        if selector.select(timeout=1.0):
            conn, _ = listener.accept()
            if os.fork() == 0:  # the launch's supervisor, which forks its ranks and reports their exit
                listener.close()
                supervise(conn)  # never returns in a rank; returns in the supervisor, which then exits
                os._exit(0)
            conn.close()
        with _gone():
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def supervise(conn: socket.socket) -> None:
    request = json.loads(conn.makefile("r").readline())
    cwd, logs = Path(request["cwd"]), Path(request["logs"])
    launcher, script, args = split_command(request["command"])
    os.environ.clear()
    os.environ.update(request["env"])
    ranks = rank_environments(cwd, launcher, logs)
    store = serve_agent_store(ranks[0][0], logs) if ranks[0][0].get(AGENT_STORE) == "True" else None
    pids = []
    for rank, (env, before) in enumerate(ranks):
        pid = os.fork()
        if pid == 0:
            conn.close()
            run_rank(cwd, env, script, [*before, *args], logs / f"rank{rank}")  # exits
        pids.append(pid)
    conn.sendall(json.dumps({"pids": pids}).encode() + b"\n")
    codes = wait_ranks(pids)
    if store is not None:
        with _gone():
            os.kill(store, signal.SIGKILL)
            os.waitpid(store, 0)
    failed = [code for code in codes if code != 0]
    conn.sendall(json.dumps({"returncode": failed[0] if failed else 0, "codes": codes}).encode() + b"\n")
    conn.close()


def split_command(command: list[str]) -> tuple[list[str], str, list[str]]:
    """``(launcher, script, args)`` of a launch command: the script is its first ``.py`` argument."""
    at = next((i for i, arg in enumerate(command) if arg.endswith(".py")), None)
    if at is None or command[0] not in LAUNCHERS:
        raise ValueError(f"a warm launch runs one of {sorted(LAUNCHERS)} on a .py script, not {command}")
    return command[:at], command[at], command[at + 1:]


def start_launcher(launcher: list[str]) -> None:
    """The launcher's own entry point, in this process, with ``launcher``'s options."""
    name, options = launcher[0], launcher[1:]
    if name == "accelerate":
        from accelerate.commands.launch import launch_command, launch_command_parser

        launch_command(launch_command_parser().parse_args(options[1:]))  # after "launch"
    elif name == "deepspeed":
        from deepspeed.launcher.runner import main

        main(options)
    else:
        from torch.distributed.run import main

        main(options)


def rank_environments(cwd: Path, launcher: list[str], logs: Path) -> list[tuple[dict[str, str], list[str]]]:
    """Each rank's environment and the arguments the launcher puts before the script's (DeepSpeed's
    ``--local_rank=N``), found by running the launcher with this module as the script, in a fork (the launcher's
    module is imported already); its ranks are plain interpreters that import nothing heavy."""
    dumps = logs / "environments"
    dumps.mkdir()
    pid = os.fork()
    if pid == 0:
        _output_to(logs / "launcher.log")
        os.chdir(cwd)
        os.environ[DUMP] = str(dumps)
        code = 0
        try:
            start_launcher([*launcher, __file__])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except BaseException as err:  # noqa: BLE001  (reported through the exit status and the log)
            print(f"launcher failed: {err!r}", flush=True)
            code = 1
        sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    found = sorted(dumps.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if os.waitstatus_to_exitcode(status) != 0 or not found:
        raise RuntimeError(f"{' '.join(launcher)} set no rank environment:\n"
                           + (logs / "launcher.log").read_text(errors="replace")[-4000:])
    ranks = []
    for path in found:
        dumped = json.loads(path.read_text())
        env = dumped["env"]
        for name in (AGENT_ERROR_FILE, DUMP):
            env.pop(name, None)
        ranks.append((env, dumped["args"]))
    return ranks


def serve_agent_store(env: dict[str, str], logs: Path) -> int | None:
    """On the first node (``GROUP_RANK`` 0), the rendezvous store torch's elastic agent serves its ranks at
    ``MASTER_ADDR:MASTER_PORT``, from a process of its own (this one stays single-threaded: it forks the ranks);
    returns its pid (None on another node, whose ranks join the first node's)."""
    if env.get("GROUP_RANK") != "0":
        return None
    pid = os.fork()
    if pid == 0:
        _output_to(logs / "store.log")
        from datetime import timedelta

        import torch.distributed as dist

        _served = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=True,
                                timeout=timedelta(seconds=900), wait_for_workers=False)
        while True:  # served from the store's own thread until the supervisor kills this process
            signal.pause()
    return pid


def run_rank(cwd: Path, env: dict[str, str], script: str, args: list[str], log: Path) -> None:
    """The rank: ``python -u SCRIPT ARGS`` from ``cwd`` in ``env``, its output in ``log.out`` and ``log.err``;
    exits with the script's status (an exception: its traceback and 1, as the interpreter does)."""
    _output_to(Path(f"{log}.out"), Path(f"{log}.err"))
    sys.stdout.reconfigure(write_through=True)  # -u
    sys.stderr.reconfigure(write_through=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    random.seed()  # a fresh interpreter's generators start from the OS's entropy
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    path = (cwd / script).resolve()
    sys.argv = [script, *args]
    sys.path[0] = str(path.parent)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001  (printed as the interpreter prints an uncaught exception)
        import traceback

        traceback.print_exc()
        code = 1
    else:
        code = 0
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    import atexit
    import threading

    threading._shutdown()  # what the interpreter does at exit: wait for threads, run atexit, flush
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _output_to(out: Path, err: Path | None = None) -> None:
    """This process's stdout into ``out``, its stderr into ``err`` (or ``out`` too)."""
    for fd, path in ((1, out), (2, err or out)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)


def wait_ranks(pids: list[int]) -> list[int]:
    """Exit codes of ``pids`` (negative: killed by that signal); after the first failure the rest are stopped."""
    codes: dict[int, int] = {}
    stopping_since = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stopping_since is not None and time.monotonic() - stopping_since > STOP_GRACE_S:
                for other in set(pids) - set(codes):
                    with _gone():
                        os.kill(other, signal.SIGKILL)
            time.sleep(0.1)
            continue
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and stopping_since is None:
            stopping_since = time.monotonic()
            for other in set(pids) - set(codes):
                with _gone():
                    os.kill(other, signal.SIGTERM)
    return [codes[pid] for pid in pids]


def dump_environment() -> None:
    """As the launched script, in a plain interpreter: this rank's environment and arguments."""
    record = {"env": dict(os.environ), "args": sys.argv[1:]}
    Path(os.environ[DUMP], f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    if DUMP in os.environ:
        dump_environment()
    else:
        serve(sys.argv[1])
