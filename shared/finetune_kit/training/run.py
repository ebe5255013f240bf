"""A recipe's own training loop under accelerate: what happens around it, the same in every recipe.

The loop body stays in the recipe's ``main()``::

    run = TrainingRun.preflight(RECIPE, args, zero_stage=3, launch=..., configs=...)  # seconds, nothing heavy
    accelerator = run.start()                          # process group (gloo on CPU), seed
    ...  data and model: the recipe's own  ...
    run.plan_steps(train_dl)                           # steps per epoch, total steps (or a clear error)
    optimizer, scheduler = run.optimizer_and_schedule(trainable_params)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    run.resume()                                       # restores the checkpoint preflight chose, if any
    for step in run.steps(train_dl, model, scheduler): # micro-batches + labelled tokens of the step (all ranks)
        for batch in step.micro_batches:
            with accelerator.accumulate(model):        # forward, backward, step: the recipe's
                loss = model(**batch, num_items_in_batch=step.labelled).loss
                accelerator.backward(loss * step.backward_scale)
                ...
            run.micro_batch_done(loss, batch)          # logs each optimizer step, validates when due
        if run.checkpoint_due():                       # --save-every, the last step, or a stop signal
            run.save_checkpoint()                      # after a stop signal the process exits 0 here
    run.finish(model, saved_to=...)                    # run_record.json, run_info.json, summary line

The launch config picks the engine: DeepSpeed (the YAML names a DeepSpeed JSON) or, for the
full fine-tune, PyTorch FSDP2 (``distributed_type: FSDP``; :mod:`finetune_kit.launch.fsdp`). The
recipe's loop is the same for both; the differences live here (optimizer, resume) and in the
preflight (:mod:`finetune_kit.training.preflight`).

What it owns: the loss's normaliser (the labelled tokens of each whole optimizer step, counted on
all ranks before its first backward: :mod:`finetune_kit.training.steps`), the position in the data
(epoch, batch in epoch, optimizer step; exact on resume,
also on another number of ranks: :mod:`finetune_kit.training.resharding`); when to log
(``--log-every``), evaluate (after each epoch, or once at the end) and save (``--save-every``, the
last step, a stop signal); the metering (throughput clock paused while evaluating or saving), the
trackers of ``--report-to`` and the rank's Prometheus endpoint (``FINETUNE_METRICS_PORT``). The
end of the run is :meth:`~finetune_kit.training.ending.RunBase.finish`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from finetune_kit import output_lock
from finetune_kit.errors import ConfigError
from finetune_kit.launch import checks, fsdp, nvme
from finetune_kit.metering import prometheus, trackers
from finetune_kit.models.shapes import Adapter
from finetune_kit.training import adam_resume, checkpoints, preflight, resharding
from finetune_kit.training.ending import Position, RunBase, trainable_parameters
from finetune_kit.training.preemption import StopRequest, stop_line
from finetune_kit.training.steps import Step, count_step


@dataclass
class TrainingRun(RunBase):
    eval_each_epoch: bool = False  # evaluate after every epoch (and the last step); else once at the end
    steps_per_epoch: int = 0
    report: object = None  # metering.step_report.StepReport, from the first batch on
    stop: StopRequest | None = None  # set by a stop signal; checked at every optimizer step
    seen_ids: list[int] = field(default_factory=list)  # source rows this rank trained on
    _lr: float = 0.0  # the learning rate of the step in progress
    _epoch_done: bool = False
    _at_step_boundary: bool = False
    _stopping: bool = False  # the ranks agreed on a stop signal at this step

    # ---- 1. before anything heavy ----

    @classmethod
    def preflight(cls, recipe: str, args, *, zero_stage: int, launch: str, configs: str, method: str = "full",
                  num_labels: int | None = None, adapter: Adapter | None = None,
                  resume_must_match: dict | None = None) -> TrainingRun:
        """Every check that needs no process group (:func:`preflight.for_accelerate`); raises a
        UserInputError naming the fix. ``args`` carries the flags of ``training.arguments.recipe_parser``."""
        return cls(preflight.for_accelerate(recipe, args, zero_stage=zero_stage, launch=launch, configs=configs,
                                            method=method, num_labels=num_labels, adapter=adapter,
                                            resume_must_match=resume_must_match), args)

    # ---- 2. the process group ----

    def start(self, **accelerator_kwargs):
        """The Accelerator the launch config describes (gloo on CPU-only machines), seeded;
        the sampler is seedable so a resumed run sees the same data order."""
        from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed

        from finetune_kit.launch.accelerator import make_accelerator

        c = self.checked
        acc = self.accelerator = make_accelerator(
            # steps() reads a step's micro-batches before the first backward: the loader's end is then
            # reached before the step's last micro-batch, so the boundary is counted, not taken from it
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=self.args.grad_accum,
                                                                    sync_with_dataloader=False),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            **trackers.accelerator_kwargs(self.args.report_to, c.output), **accelerator_kwargs)
        set_seed(self.args.seed)
        trackers.start(acc, c.recipe, c.script_args)
        self.endpoint = prometheus.open_endpoint(c.recipe)
        self.stop = StopRequest(announce=acc.is_local_main_process).install()
        if c.reshaping() and c.fsdp is None:  # another number of ranks: DeepSpeed's universal format
            acc.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
        engine = (f"ZeRO stage {checks.zero_stage(c.ds_config)}, config {c.ds_path}" if c.fsdp is None else
                  "FSDP2 (full sharding; fp32 weights, bf16 compute, fp32 gradient reduction)")
        acc.print(f"world size {acc.num_processes}, device {acc.device}, {engine}")
        return acc

    # ---- 3. the schedule ----

    def plan_steps(self, train_dl) -> int:
        """Optimizer steps per epoch and in total, from the (unprepared) training loader. An epoch is its
        whole global batches (micro-batch x accumulation x ranks sequences): the rest is left out, so that
        every split of the global batch trains on the same sequences (the loader would otherwise pad the
        last one with repeats on some splits and drop it on others)."""
        world, a = self.accelerator.num_processes, self.args
        self.steps_per_epoch = len(train_dl.dataset) // (a.micro_batch_size * a.grad_accum * world)
        if self.steps_per_epoch == 0:
            raise ConfigError(f"{len(train_dl.dataset)} training examples make no full optimizer step of "
                                     f"{a.micro_batch_size} x {a.grad_accum} x {world} processes; "
                                     "lower --micro-batch-size or --grad-accum, or add data.")
        self.total_steps = a.epochs * self.steps_per_epoch
        if a.max_steps:
            self.total_steps = min(self.total_steps, a.max_steps)
        return self.total_steps

    def optimizer_and_schedule(self, params):
        """The optimizer the DeepSpeed JSON names ("auto" values filled from --lr and
        --weight-decay) and a cosine schedule with linear warm-up over ``total_steps``. Under
        FSDP2: torch's AdamW with the shipped ZeRO configs' betas and eps (``fsdp.ADAMW``)."""
        import torch
        from accelerate.utils import DummyOptim, DummyScheduler
        from transformers import get_cosine_schedule_with_warmup

        warmup = math.ceil(self.args.warmup_ratio * self.total_steps)

        def schedule(opt):
            return get_cosine_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=self.total_steps)

        if self.checked.fsdp is not None:
            optimizer = torch.optim.AdamW(params, lr=self.args.lr, weight_decay=self.args.weight_decay, **fsdp.ADAMW)
            return optimizer, schedule(optimizer)  # counted in optimizer steps: see batches()
        optimizer = DummyOptim(params, lr=self.args.lr, weight_decay=self.args.weight_decay)
        return optimizer, DummyScheduler(optimizer, lr_scheduler_callable=schedule)

    @property
    def max_grad_norm(self) -> float:
        """The gradient clipping norm: the DeepSpeed JSON's ``gradient_clipping`` (DeepSpeed clips
        itself; ``accelerator.clip_grad_norm_`` then only returns the norm), or ``fsdp.MAX_GRAD_NORM``."""
        if self.checked.fsdp is not None:
            return fsdp.MAX_GRAD_NORM
        return float(self.checked.ds_config.get("gradient_clipping", 0.0))

    def resume(self, **load_kwargs) -> None:
        """Take the output folder's lock, then restore model, optimizer, schedule, RNG and position from the
        checkpoint chosen at preflight (``--resume``); nothing more for a fresh run. ``load_kwargs``: DeepSpeed's."""
        c, acc = self.checked, self.accelerator
        if acc.is_main_process:  # from here on the run writes to its folder: it holds it until it ends (output_lock)
            output_lock.acquire(c.output)
        if c.resume_from is None:
            return
        if c.reshaping() and c.fsdp is not None:  # torch.distributed.checkpoint reshards on load
            state = checkpoints.load_checkpoint(acc, c.resume_from, **load_kwargs)
            state = resharding.reshaped_position(state, resharding.saved_world(c.resume_from), acc.num_processes)
        elif c.reshaping():
            saved = resharding.saved_world(c.resume_from)
            if acc.is_main_process:
                print(f"{c.resume_from} was saved by {resharding.ranks(saved)}; converting it for "
                      f"{acc.num_processes} (DeepSpeed universal checkpoint, once) ...", flush=True)
                resharding.to_universal(c.resume_from)
            acc.wait_for_everyone()
            checkpoints.load_checkpoint(acc, resharding.universal_folder(c.resume_from), state=False, **load_kwargs)
            state = resharding.reshaped_position(checkpoints.read_state(c.resume_from), saved, acc.num_processes)
        else:
            state = checkpoints.load_checkpoint(acc, c.resume_from, **load_kwargs)
            if "offload_optimizer" in nvme.nvme_paths(c.ds_config):  # what DeepSpeed's NVMe load leaves out
                from finetune_kit.training.nvme_resume import restore_nvme_optimizer

                restore_nvme_optimizer(acc.deepspeed_engine_wrapped.engine, c.resume_from)
        if c.fsdp is None:  # DeepSpeed's native CPU Adam: its beta**t as the uninterrupted run has it
            adam_resume.replay_bias_correction(acc.deepspeed_engine_wrapped.engine.optimizer)
        self.position = Position(state["step"], state["epoch"], state["batch_in_epoch"])
        acc.print(f"resumed from {c.resume_from} at step {self.position.step}")

    # ---- 4. the loop ----

    def steps(self, train_dl, model, scheduler) -> Iterator[Step]:
        """The optimizer steps from the current position to the last, epoch after epoch: each one's
        micro-batches on this rank and its labelled tokens on all ranks (:mod:`.steps`), counted before
        its first backward. ``example_ids`` is taken off each batch (kept for the run record)."""
        from finetune_kit.metering.flops import FlopCounter
        from finetune_kit.metering.step_report import StepReport

        c = self.checked
        self.params_trainable = trainable_parameters(model)
        trainable = None if c.method == "full" else self.params_trainable
        self.flop_counter = FlopCounter(c.shape, num_labels=c.num_labels, trainable=trainable,
                                        head_trainable=trainable is not None and c.num_labels is not None)
        self.report = StepReport(self.accelerator, self.flop_counter, c.output, total_steps=self.total_steps,
                                 initial_step=self.position.step, log_every=self.args.log_every,
                                 endpoint=self.endpoint)
        self.meter = self.report.meter
        if c.fsdp is not None:
            # accelerate steps a prepared schedule once per rank at each optimizer step (it assumes one
            # written for a single process); DeepSpeed steps its own once. Once, as under DeepSpeed: the
            # schedule's state is then in optimizer steps, and resumes on any number of ranks.
            scheduler.split_batches = True
        self._epoch_done = False
        pos, window = self.position, []
        while pos.step < self.total_steps:
            train_dl.set_epoch(pos.epoch)
            for batch in self.accelerator.skip_first_batches(train_dl, pos.batch_in_epoch):
                for ids in batch.pop("example_ids"):
                    self.seen_ids.extend(ids if isinstance(ids, list) else [ids])
                window.append(batch)
                if len(window) < self.args.grad_accum:
                    continue
                self._lr = scheduler.get_last_lr()[0]  # the rate this step trains with
                yield count_step(window, self.accelerator)
                window = []
                if self._epoch_done or pos.step >= self.total_steps:
                    break
            self._epoch_done = False
        self.report.close()

    def micro_batch_done(self, loss, batch, grad_norm=None) -> None:
        """Account one micro-batch; at an optimizer-step boundary, log it and evaluate when due.
        Every rank calls it (the step's metrics are collectives). ``grad_norm``: what
        ``accelerator.clip_grad_norm_`` returned at the boundary (else DeepSpeed's own is read)."""
        self.report.micro_batch(loss, batch)
        pos = self.position
        pos.batch_in_epoch += 1
        self._at_step_boundary = bool(self.accelerator.sync_gradients)
        if not self._at_step_boundary:
            return
        pos.step += 1
        if grad_norm is None and self.checked.fsdp is None:  # DeepSpeed's step computed it for its clipping
            grad_norm = self.accelerator.deepspeed_engine_wrapped.get_global_grad_norm()
        self.report.optimizer_step(pos.step, pos.epoch, self._lr, grad_norm)
        self._epoch_done = pos.batch_in_epoch >= self.steps_per_epoch * self.args.grad_accum
        if self.eval_each_epoch and (self._epoch_done or pos.step == self.total_steps):
            self._evaluate(announce=True)
            self.meter.reset_clock()  # evaluation is not training time
        if self._epoch_done:
            pos.epoch += 1
            pos.batch_in_epoch = 0

    def checkpoint_due(self) -> bool:
        """After an optimizer step: every ``--save-every`` steps, at the last step, or when a stop
        signal (SIGTERM, SIGUSR1) reached any rank. Every rank calls it (the ranks agree on the signal)."""
        if not self._at_step_boundary:
            return False
        step = self.position.step
        self._stopping = step < self.total_steps and self.stop.agreed(self.accelerator)
        every = self.args.save_every
        return self._stopping or bool(every and (step % every == 0 or step == self.total_steps))

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` whole (every rank calls it). After a stop signal, leave the
        process group and exit 0 here: relaunching the same command resumes from this checkpoint."""
        acc, pos, a = self.accelerator, self.position, self.args
        state = {**pos.as_dict(), "world_size": acc.num_processes, "run": self.checked.identity,
                 "global_batch": a.micro_batch_size * a.grad_accum * acc.num_processes}
        path = checkpoints.save_checkpoint(acc, self.checked.output, pos.step, state, keep=a.keep_checkpoints,
                                           estimate=self.checked.checkpoint_estimate)
        acc.print(f"\ncheckpoint saved: {path}")
        self.meter.reset_clock()  # saving is not training time
        if self._stopping:
            self.report.close()
            acc.print(stop_line(self.stop.describe(), pos.step, self.total_steps, path))
            acc.wait_for_everyone()
            acc.end_training()
            self._close_endpoint()
            sys.exit(0)
        return path

    # ---- 5. the end: RunBase.finish ----

    def evaluated_at_the_end(self) -> bool:
        return self.evaluate is not None and not self.eval_each_epoch

    def finish(self, model, *, saved_to: Path | None, details: dict | None = None,
               training: dict | None = None) -> None:
        super().finish(model, saved_to=saved_to, seen_ids=self.seen_ids, details=details, training=training)
