"""Stopping cleanly when the job is told to: SIGTERM (a preempted node, Kubernetes, ``scancel``),
SIGINT (Ctrl-C) and SIGUSR1 (Slurm's ``--signal=USR1@<seconds>`` warning before a time limit).

A signal only sets a flag. At every optimizer-step boundary the loop asks :meth:`StopSignal.agreed`:
the ranks add up their flags (one all-reduce of a single number), so all of them stop after the same
step -- whichever rank was signalled; the loop then writes a checkpoint, breaks, and each rank ends
with exit status 0, the first one with a line naming the checkpoint (:func:`stop_line`). Relaunching
the same command resumes from it (``--resume auto``).

Repeated signals change nothing: launchers forward the signal they get to ranks that already
had it (DeepSpeed's does so rank by rank, 30 s apart at most), so a repeat cannot mean "stop
now". To stop at once, send SIGKILL: checkpoints are written whole or not at all.

The launchers give their ranks 30 s after forwarding a signal before they kill them, and exit
non-zero themselves. Signalling only the training processes (``pkill -TERM -f train.py`` on
each node) leaves the launcher waiting: it exits 0 once the ranks have saved, however long that
takes.
"""

from __future__ import annotations

import signal
import sys

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class StopSignal:
    """Catches the stop signals (from construction on) and tells the loop when the ranks agree to stop."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.received: str | None = None
        self.announce = accelerator.is_local_main_process  # say so on stderr (one rank per node is enough)
        for name in SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            if self.announce:
                print(f"{name} received: stopping after this optimizer step, with a checkpoint "
                      "(SIGKILL stops at once)", file=sys.stderr, flush=True)

    def agreed(self) -> bool:
        """True on every rank when any rank was signalled (a collective: every rank calls it, once a step)."""
        import torch

        acc = self.accelerator
        flag = torch.tensor([0.0 if self.received is None else 1.0], device=acc.device)
        if acc.num_processes > 1:
            flag = acc.reduce(flag, "sum")
        return flag.item() > 0

    def describe(self) -> str:
        return self.received or "a stop signal to another rank"


def stop_line(reason: str, step: int, total: int, checkpoint) -> str:
    return (f"stopped by {reason} after step {step} of {total}; checkpoint: {checkpoint}. "
            "Run the same command again to continue from it.")
