"""How a recipe process ends: one line that says what to do on failure, not a traceback.

``run_main(main)`` is the last line of every recipe:

- success: a rank of a multi-process run exits 0 without the interpreter's finalisation (see
  :func:`run_main`);
- bad input (:class:`~finetune_kit.errors.UserInputError`): the first rank of each node (global rank
  0 on one node) says ``error: <the message>`` and every rank exits 1; the other ranks, which found
  the same, stay silent (see :func:`report_bad_input`). Under ``python -m finetune_kit.check``
  (``FINETUNE_ERROR_FILE`` set) that rank writes the message to the file instead, and the check
  prints it as the launch's last line;
- another rank gone: a collective failed because a peer closed its connection (its process died:
  an OOM, a kill, a node that went away) or did not answer within the collective timeout
  (``FINETUNE_COLLECTIVE_TIMEOUT_S``). This rank says so in one line and exits 1 at once, without
  waiting on the process group it can no longer use; relaunching the same command resumes from
  the newest complete checkpoint.

Anything else keeps its traceback: it is a bug to report, not an input to fix.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from finetune_kit.errors import UserInputError
from finetune_kit.launch import env

ERROR_FILE_VAR = "FINETUNE_ERROR_FILE"  # where a bad input's message goes (set by finetune_kit.check)
# How much later than the reporting rank the others leave on a bad input. A node's launcher stops all
# its ranks as soon as one fails: the reporting rank must fail first, or it is killed before it has said
# what was wrong.
SILENT_RANK_DELAY_S = 2.0

# What torch's gloo and NCCL backends say when a peer is gone or silent. gloo's pair can say it alone, naming
# neither backend: "Application timeout caused pair closure" (a frozen peer, seen under ZeRO-3's all-gather).
BACKEND = re.compile(r"gloo|nccl|pair closure", re.IGNORECASE)
PEER_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|timed out|timeout|"
                       r"error|aborted", re.IGNORECASE)


def peer_failure(err: BaseException) -> str | None:
    """The one-line explanation when ``err`` is a collective that lost a peer, else None."""
    import torch.distributed as dist

    text = str(err)
    if not (isinstance(err, dist.DistError) or
            (isinstance(err, RuntimeError) and BACKEND.search(text) and PEER_GONE.search(text))):
        return None
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    view = env.view()
    silent = re.search(r"timed out|timeout", str(err), re.IGNORECASE)
    what = (f"no answer from another rank within {env.collective_timeout_s()} s ({env.COLLECTIVE_TIMEOUT_VAR})"
            if silent else "another rank closed its connection: its process died or its node went away")
    return (f"rank {view.rank} of {view.world_size} (node {view.machine_rank}) stops: {what}. Look for the first "
            f"error in the other ranks' logs (an out-of-memory, a killed process, a lost node); then relaunch the "
            f"same command on every node: it resumes from the newest complete checkpoint.\n  ({first})")


def report_bad_input(err: UserInputError) -> None:
    """Say ``err`` once per node (each node's launcher has its own log; on one node, once for the
    job): local rank 0 writes it to ``FINETUNE_ERROR_FILE`` when the check set one, else prints
    ``error: ...`` on stderr; the other ranks say nothing and wait ``SILENT_RANK_DELAY_S`` before they
    exit."""
    if env.view().local_rank != 0:
        time.sleep(SILENT_RANK_DELAY_S)
        return
    path = os.environ.get(ERROR_FILE_VAR)
    if path:
        try:
            Path(path).write_text(f"{err}\n")
            return
        except OSError:
            pass  # no file to write after all: say it here
    print(f"{_fresh_line()}error: {err}", file=sys.stderr, flush=True)


def _fresh_line() -> str:
    """A newline where a progress bar (tqdm's, which ends no line while it runs) holds the line, else nothing: the
    error starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    return "\n" if tqdm is not None and getattr(getattr(tqdm, "tqdm", None), "_instances", None) else ""


def _process_group_up() -> bool:
    """Whether this process is in a torch.distributed process group (torch imported only if it is)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist and dist.is_available() and dist.is_initialized())


def run_main(main: Callable[[], None]) -> None:
    """Run a recipe's ``main()``; end bad input and a lost peer with one clear line and exit status 1
    (bad input: one line per node, see :func:`report_bad_input`).

    A rank of a multi-process run that finished leaves with ``os._exit(0)`` once its output is
    flushed: the run has left its process group (``end_training``), but gloo's worker threads can
    still hold Python objects, and their teardown during interpreter finalisation sometimes aborts
    the process ("terminate called without an active exception", exit -6) after a complete run,
    which the launcher then reports as a failure (pytorch/pytorch#179291)."""
    try:
        main()
    except SystemExit as stop:  # a clean stop on a signal ends here too
        if stop.code not in (0, None):
            raise
    except UserInputError as err:
        report_bad_input(err)
        if _process_group_up():  # found after the ranks met (too little data for a step): leave as below
            sys.stdout.flush()
            os._exit(1)
        sys.exit(1)
    except Exception as err:
        message = peer_failure(err)
        if message is None:
            raise
        print(f"{_fresh_line()}error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # the process group is broken: tearing it down could wait on the dead peer
        return
    if env.world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
