"""A run's checkpointer: it resumes the checkpoint the launch's checks chose and saves one when it is due.

The loop holds one (:class:`Checkpointer`) and calls ``save`` after every optimizer step; the
checkpointer decides: every ``--save-every`` steps, at the schedule's last step, or when the job is
told to stop; never a step whose loss or gradient norm is not finite
(:mod:`finetune_kit.training.nonfinite`). What a checkpoint holds and how it is written whole is
:mod:`.checkpoints`; resuming on another number of ranks, :mod:`.resharding`; what DeepSpeed's load
leaves out, :mod:`.adam_resume` and :mod:`.nvme_resume`.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune_kit.launch import nvme
from finetune_kit.training.arguments import global_batch
from finetune_kit.training.checkpointing import adam_resume, resharding
from finetune_kit.training.checkpointing.checkpoints import (
    FINISHED,
    MANIFEST,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from finetune_kit.training.loop import Position
from finetune_kit.training.nonfinite import Guard


class Checkpointer:
    """A run's checkpoints: it resumes the one the launch's checks chose, and saves ``step_N`` when it is due.

    Every rank makes one and calls its methods (a save is collective)."""

    def __init__(self, accelerator, checked, args):
        self.accelerator, self.checked = accelerator, checked
        self.every, self.keep = args.save_every, args.keep_checkpoints
        self.global_batch = global_batch(args, checked.data_ranks)
        # what the data position counts in: micro-batches of this size per rank reading its own rows
        self.data_ranks, self.micro_batch = checked.data_ranks, args.micro_batch_size
        self.guard = Guard(accelerator, checked.nonfinite, args.data)  # --on-nonfinite stop|skip

    def resume(self, **load_kwargs):
        """Restore model, optimizer, schedule, RNG and data position from the checkpoint the checks chose
        (``--resume``); return the :class:`~finetune_kit.training.loop.Position` to start from (step 0
        for a fresh run). ``load_kwargs``: DeepSpeed's ``load_checkpoint``'s."""
        c, acc = self.checked, self.accelerator
        if c.resume_from is None:
            return Position()
        if c.reshaping() and c.fsdp is not None:  # torch.distributed.checkpoint reshards on load
            state = load_checkpoint(acc, c.resume_from, **load_kwargs)
        elif c.reshaping():
            saved = resharding.saved_world(c.resume_from)
            if acc.is_main_process:
                print(f"{c.resume_from} was saved by {resharding.ranks(saved)}; converting it for "
                      f"{acc.num_processes} (DeepSpeed universal checkpoint, once) ...", flush=True)
                resharding.to_universal(c.resume_from)
            acc.wait_for_everyone()
            load_checkpoint(acc, resharding.universal_folder(c.resume_from), state=False, **load_kwargs)
            state = read_state(c.resume_from)
        else:
            state = load_checkpoint(acc, c.resume_from, **load_kwargs)
            if "offload_optimizer" in nvme.nvme_paths(c.ds_config):  # what DeepSpeed's NVMe load leaves out
                from finetune_kit.training.checkpointing.nvme_resume import restore_nvme_optimizer

                restore_nvme_optimizer(acc.deepspeed_engine_wrapped.engine, c.resume_from)
        if c.fsdp is None:  # DeepSpeed's native CPU Adam: its beta**t as the uninterrupted run has it
            adam_resume.replay_bias_correction(acc.deepspeed_engine_wrapped.engine.optimizer)
        # another number of data ranks (ranks, or the sequence-parallel size) or micro-batch counts the position anew
        state = resharding.reshaped_position(state, data_ranks=self.data_ranks, micro_batch=self.micro_batch)
        position = Position(state["step"], state["epoch"], state["batch_in_epoch"],
                            finished=(c.output / FINISHED).is_file())
        acc.print(f"resumed from {c.resume_from} at step {position.step}", flush=True)
        return position

    def save(self, step, record: dict, *, stopping: bool = False) -> Path | None:
        """After optimizer step ``step`` (a :class:`~finetune_kit.training.loop.Step`) and its ``record`` (the step
        meter's: loss, gradient norm): write ``checkpoints/step_N`` when due -- every ``--save-every`` steps, at the
        last, or when the job stops -- and return it; otherwise None. Every rank calls it. A step whose loss or
        gradient norm is NaN or Inf is never saved: ``--on-nonfinite stop`` stops the run here in one line naming
        its rows (:class:`~finetune_kit.training.nonfinite.Guard`); with ``skip``, its update was not applied and
        the weights saved are the step before's. A step ``taken`` by an earlier launch is not saved again."""
        if step.taken:
            return None
        self.guard.check(step, record)
        if not (stopping or (self.every and (step.number % self.every == 0 or step.last))):
            return None
        acc = self.accelerator
        state = {**step.after.as_dict(), "world_size": acc.num_processes, "run": self.checked.identity,
                 "global_batch": self.global_batch, "data_ranks": self.data_ranks, "micro_batch": self.micro_batch}
        path = save_checkpoint(acc, self.checked.output, step.number, state, keep=self.keep,
                               estimate=self.checked.checkpoint_estimate)
        if acc.is_main_process:
            manifest = json.loads((path / MANIFEST).read_text())
            print(f"\ncheckpoint saved: {path} ({manifest['bytes'] / 2**20:,.1f} MiB written in "
                  f"{manifest['save_seconds']:.2f} s, checksummed in {manifest['checksum_seconds']:.2f} s)", flush=True)
        return path
