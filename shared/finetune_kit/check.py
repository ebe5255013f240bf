"""Check a recipe's inputs once, before any rank starts; then launch it. Bad input ends in one line.

    python -m finetune_kit.check accelerate launch --config_file configs/zero3.yaml train.py --data my.jsonl ...
    python -m finetune_kit.check deepspeed --num_gpus 8 train.py --deepspeed configs/zero2.json --data my.jsonl ...
    python -m finetune_kit.check --check-only torchrun --nproc_per_node 8 train.py ...

Every rank of a launch checks its inputs first (a recipe's ``check_inputs``: step 1 of its train.py), so a
plain launch stops on a bad one too; but then the launcher (torch.distributed.run) reports the failed
ranks in a ``ChildFailedError`` traceback of some 40 lines, under which the one line that matters
gets lost. Here the launch command is read (:mod:`finetune_kit.launch.command`: the environment its
ranks would see, computed by the launchers' own code), the recipe's train.py imported and its
``check_inputs`` run once, in this process: a bad input ends with ``error: <message>`` alone and exit
status 2, and no launcher starts (``--check-only``: what the checks printed, such as the memory plan,
and nothing launched). Otherwise the launch command runs unchanged, its output streaming
through, with ``FINETUNE_ERROR_FILE`` naming a file for a bad input the ranks find later (too little
data for one optimizer step, a node that disagrees with the others): when the launch fails, that
message is the last line of the output. The exit status is the launcher's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from finetune_kit import command_line
from finetune_kit.errors import ConfigError, UserInputError
from finetune_kit.launch import command
from finetune_kit.launch.failures import ERROR_FILE_VAR

# What a job is stopped with: the ranks take SIGTERM, SIGINT and SIGUSR1 to checkpoint and stop
# (training.stop), torchrun also SIGHUP and SIGQUIT.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def check_launch(launch: command.Launch) -> str:
    """Run the launched train.py's ``check_inputs`` here, in the environment its first rank would have;
    raise UserInputError for bad input. Return what it printed (on a launch its ranks print it)."""
    script = Path(launch.script)
    if not script.is_file():
        raise ConfigError(f"training script '{launch.script}' does not exist in {Path.cwd()}: run the launch "
                          "command from the recipe's folder (the one holding train.py and configs/).")
    folder, printed, argv = str(script.parent.resolve()), io.StringIO(), sys.argv
    sys.path.insert(0, folder)  # as `python train.py` has them
    sys.argv = [launch.script, *launch.script_args]
    try:
        with launch.environment(), _quiet(printed):
            spec = importlib.util.spec_from_file_location(f"{Path(folder).name}_train", script)
            recipe = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = recipe  # its dataclasses resolve their fields' types through it
            spec.loader.exec_module(recipe)
            if not callable(getattr(recipe, "check_inputs", None)):
                raise ConfigError(f"{script} has no check_inputs() to check its inputs with: this check runs the "
                                  "recipes' train.py (recipes/*/train.py); launch other scripts directly.")
            recipe.check_inputs(list(launch.script_args))
    except UserInputError:
        raise
    except BaseException:  # --help, a flag the script does not take (argparse exits), a bug: shown as is
        sys.stderr.write(printed.getvalue())
        raise
    finally:
        sys.path.remove(folder)
        sys.argv = argv
    return printed.getvalue()


@contextlib.contextmanager
def _quiet(printed: io.StringIO) -> Iterator[None]:
    """What the checks print, kept (shown only when they pass: on bad input the error is the one
    line); their library warnings and log lines dropped (the ranks repeat them)."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def run(launch_command: Sequence[str]) -> int:
    """Run the launch command, output streaming through; its exit status (128 + N after signal N).
    A failed launch whose ranks left a message in FINETUNE_ERROR_FILE ends with ``error: <message>``."""
    with tempfile.TemporaryDirectory(prefix="finetune-check-") as folder:
        error_file = Path(folder) / "error.txt"
        try:
            proc = subprocess.Popen(list(launch_command), env={**os.environ, ERROR_FILE_VAR: str(error_file)})
        except FileNotFoundError:
            print(f"error: '{launch_command[0]}' is not on PATH: install the pinned stack (docker/requirements.txt) "
                  "in the environment you launch from, or activate it.", file=sys.stderr)
            return 127
        with _stop_signals_go_to(proc):
            status = proc.wait()
        message = error_file.read_text().strip() if error_file.is_file() else ""
    if status != 0 and message:
        sys.stdout.flush()
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 128 - status if status < 0 else status


@contextlib.contextmanager
def _stop_signals_go_to(proc: subprocess.Popen) -> Iterator[None]:
    """While the launcher runs. A terminal's Ctrl-C, a signal to the process group and Slurm's
    signals reach the launcher as they reach this process: here they are ignored, since passing
    them on would signal the launcher twice, and a second SIGTERM cuts torchrun's shutdown short,
    before the ranks have saved their checkpoint. As PID 1 of a container (``docker stop``,
    Kubernetes) a signal reaches this process alone: it is passed on. A signal ignored when this
    process started stays ignored (Slurm scripts' ``trap "" USR1``: only the ranks take it)."""
    forward = os.getpid() == 1
    previous = {}
    for sig in (getattr(signal, name) for name in STOP_SIGNALS):
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, (lambda signum, _: proc.send_signal(signum)) if forward else signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = command_line.ArgumentParser(
        prog="python -m finetune_kit.check", description="Check a recipe's inputs once, then run its launch command.")
    parser.add_argument("--check-only", action="store_true", help="check the inputs and launch nothing")
    parser.add_argument("launch", nargs=argparse.REMAINDER,
                        help="the launch command, as in the recipe's README: accelerate launch ..., deepspeed ..., "
                             "torchrun ...")
    opts = parser.parse_args(argv)
    try:
        launch = command.parse(opts.launch)
        printed = check_launch(launch)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    if opts.check_only:
        print(f"{printed}inputs checked: {launch.describe()}; nothing launched (--check-only)", end="\n")
        return 0
    print(f"inputs checked: {launch.describe()}; launching", flush=True)  # its ranks print the checks' lines
    return run(launch.command)


if __name__ == "__main__":
    sys.exit(main())
