"""The life of a training run, the same in every recipe; the loop body stays in the recipe.

An accelerate recipe's ``main()``::

    run = TrainingRun.preflight(RECIPE, args, zero_stage=3, launch=..., configs=...)  # seconds, nothing heavy
    accelerator = run.start()                          # process group (gloo on CPU), seed
    ...  data and model: the recipe's own  ...
    run.plan_steps(train_dl)                           # steps per epoch, total steps (or a clear error)
    optimizer, scheduler = run.optimizer_and_schedule(trainable_params)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    run.resume()                                       # restores the checkpoint preflight chose, if any
    for batch in run.batches(train_dl, model, scheduler):
        with accelerator.accumulate(model):            # forward, backward, step: the recipe's
            ...
        run.micro_batch_done(loss, batch)              # logs, evaluates and saves on schedule
    run.finish(model, saved_to=...)                    # run_record.json, run_info.json, summary line

The launch config picks the engine: DeepSpeed (the YAML names a DeepSpeed JSON) or, for the
full fine-tune, PyTorch FSDP2 (``distributed_type: FSDP``; :mod:`finetune_kit.launch.fsdp`). The
recipe's loop is the same for both; the differences live here (optimizer, checks, records).

What it owns: the start-of-run checks (model config and sequence length, the launched
DeepSpeed config and its batch sizes, or the FSDP settings, the memory preflight, the resume decision); the
position in the data (epoch, batch in epoch, optimizer step; exact on resume); when to log
(``--log-every``), evaluate (after each epoch, or once at the end) and save (``--save-every``
and the last step); the metering (throughput clock paused while evaluating or saving), the trackers
of ``--report-to`` and the rank's Prometheus endpoint (``FINETUNE_METRICS_PORT``); and the
end of the run: one ``run_info.json`` schema (:class:`~finetune_kit.results.record.RunInfo`), the
run record, and the summary line. The HF Trainer recipe uses the same preflight and ending
(:meth:`TrainingRun.preflight_trainer`, :meth:`metered_trainer`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from finetune_kit import outputs
from finetune_kit.errors import ConfigError
from finetune_kit.launch import checks, cuda_ops, env, fsdp, nvme
from finetune_kit.metering import prometheus, trackers
from finetune_kit.models import loading as models
from finetune_kit.models.shapes import Adapter
from finetune_kit.planning import memory
from finetune_kit.training import checkpoints
from finetune_kit.training.preemption import StopRequest, stop_line

# What the start-of-run checks call the batch and resume flags, per kind of script.
ACCELERATE_FLAGS = {"micro_batch": "--micro-batch-size", "grad_accum": "--grad-accum",
                    "gradient_checkpointing": "gradient checkpointing (the default)"}
TRAINER_FLAGS = {"micro_batch": "--per_device_train_batch_size", "grad_accum": "--gradient_accumulation_steps",
                 "gradient_checkpointing": "--activation_checkpointing true"}


@dataclass
class Position:
    """Where training is: optimizer steps taken, epoch, micro-batches consumed in the epoch.
    Saved in every checkpoint (``trainer_state.json``) and restored on resume."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0

    def as_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}


@dataclass
class TrainingRun:
    recipe: str
    args: object  # the recipe's parsed arguments (common names: see training.arguments)
    output: Path
    model_config: object
    ds_path: Path | None  # the launched DeepSpeed JSON; None under FSDP2
    ds_config: dict  # its settings; {} under FSDP2
    memory_plan: memory.Plan
    resume_from: Path | None
    method: str = "full"  # "full" | "lora" | "qlora": picks the FLOP formula and labels the record
    num_labels: int | None = None  # a classification head instead of the LM head
    evaluate: Callable[[], dict] | None = None  # set by the recipe; returns {"eval_loss": ..., ...}
    eval_each_epoch: bool = False  # evaluate after every epoch (and the last step); else once at the end
    position: Position = field(default_factory=Position)
    accelerator: object = None
    report: object = None  # metering.step_report.StepReport, from the first batch on
    meter: object = None  # metering.throughput.ThroughputMeter
    flop_counter: object = None
    seen_ids: list[int] = field(default_factory=list)  # source rows this rank trained on
    evals: list[dict] = field(default_factory=list)
    steps_per_epoch: int = 0
    total_steps: int = 0
    params_trainable: int = 0
    train_examples: int = 0  # the split, for run_info.json
    eval_example_ids: list[int] = field(default_factory=list)
    data_counts: object = None  # DataCounts of the instruction recipes, for the run record
    stop: StopRequest | None = None  # set by a stop signal; checked at every optimizer step
    script_args: dict = field(default_factory=dict)  # what configures the run, for the record's config hash
    identity: dict = field(default_factory=dict)  # what a resumed checkpoint must share with this launch
    checkpoint_estimate: int = 0  # bytes of the first checkpoint, before one exists to measure
    fsdp: fsdp.FsdpLaunch | None = None  # the FSDP2 settings, when the launch config selects FSDP
    endpoint: prometheus.MetricsEndpoint | None = None  # this rank's /metrics, when FINETUNE_METRICS_PORT is set
    _lr: float = 0.0  # the learning rate of the step in progress
    _epoch_done: bool = False
    _trainer: object = None  # the HF Trainer, when it runs the loop

    # ---- 1. before anything heavy ----

    @classmethod
    def preflight(cls, recipe: str, args, *, zero_stage: int, launch: str, configs: str, method: str = "full",
                  num_labels: int | None = None, adapter: Adapter | None = None,
                  resume_must_match: dict | None = None) -> TrainingRun:
        """Check the model, the launched DeepSpeed config, the batch sizes, the memory and the
        output folder (writable, room for a checkpoint, a resumable checkpoint of the same run), in
        seconds; raise a UserInputError naming the fix. For accelerate recipes: ``args`` carries the
        flags of ``training.arguments.recipe_parser``; ``resume_must_match``: the recipe's settings
        a checkpoint must have been saved with (besides the model's architecture and the method)."""
        model_config = _checked_model_config(args.model, args.max_seq_len)
        fsdp_launch = fsdp.read() if fsdp.launched() else None
        if fsdp_launch is not None:  # the same full sharding as ZeRO-3, by PyTorch
            if method != "full" or zero_stage != 3:
                raise ConfigError(f"{recipe} runs under DeepSpeed ZeRO-{zero_stage}; FSDP2 launch configs are "
                                  f"supported for full fine-tuning with ZeRO-3's sharding. Launch with {launch}.")
            fsdp.check(fsdp_launch, model_config=model_config, gradient_checkpointing=args.gradient_checkpointing)
            ds_path, ds_config = None, {}
        else:
            ds_path, ds_config = checks.launched_zero_config(zero_stage, launch=launch, configs=configs)
            checks.check_batch_sizes(ds_config, micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum,
                                     world=env.world_size(), source=str(ds_path))
        plan = memory.preflight(model_config, ds_config if fsdp_launch is None else None, world_size=env.world_size(),
                                micro_batch=args.micro_batch_size, seq_len=args.max_seq_len,
                                gradient_checkpointing=args.gradient_checkpointing, num_labels=num_labels,
                                adapter=adapter, skip=args.skip_memory_check)
        if fsdp_launch is None:
            cuda_ops.check(ds_config, quantized=method == "qlora")
            nvme.check(ds_config, str(ds_path))
            nvme.check_param_buffers(ds_config, model_config, env.world_size(), str(ds_path))
        prometheus.requested_port()
        trackers.check(args.report_to)
        output = Path(args.output)
        outputs.check_writable(output)
        if env.is_main_rank():
            for path in checkpoints.clean_partial(output):
                print(f"removed {path}: a checkpoint save that never completed (not resumable)")
        resume_from = checkpoints.resolve_resume(args.resume, output)
        identity = {"architecture": architecture(model_config), "method": method, "num_labels": num_labels,
                    "engine": fsdp.ENGINE if fsdp_launch else "deepspeed", **(resume_must_match or {})}
        if resume_from is not None:
            checkpoints.check_same_run(resume_from, identity)
            _check_reshape(resume_from, args, zero_stage, ds_config)
        estimate = checkpoints.estimate_bytes(plan.total_params, plan.trainable_params, zero_stage)
        if args.save_every:
            problem = checkpoints.free_space_problem(output, checkpoints.predicted_bytes(output, estimate))
            if problem:
                raise ConfigError(f"{problem}; or pass --save-every 0 to train without checkpoints.")
        return cls(recipe, args, output, model_config, ds_path, ds_config, plan, resume_from, method=method,
                   num_labels=num_labels, identity=identity, checkpoint_estimate=estimate, fsdp=fsdp_launch,
                   script_args={k: v for k, v in vars(args).items() if k not in ("output", "resume", "report_to")})

    @classmethod
    def preflight_trainer(cls, recipe: str, recipe_args, trainer_kwargs: dict, *, zero_stage: int,
                          configs: str) -> TrainingRun:
        """The same checks for an HF Trainer recipe: ``recipe_args`` (model, max_seq_len,
        skip_memory_check) and TrainingArguments' fields as parsed, before they are built."""
        ds_path = trainer_kwargs["deepspeed"]
        if not ds_path:
            raise ConfigError(f"no DeepSpeed config: pass --deepspeed {configs}.")
        ds_config = checks.load_deepspeed_config(ds_path)
        if checks.zero_stage(ds_config) != zero_stage:
            raise ConfigError(f"{ds_path} sets ZeRO stage {checks.zero_stage(ds_config)}; this recipe is "
                              f"ZeRO-{zero_stage}. Use {configs}.")
        for key, from_json in checks.precision_flags(ds_config).items():
            if trainer_kwargs[key] is None:  # --bf16/--fp16 not given: the JSON decides
                trainer_kwargs[key] = from_json
        checks.check_trainer_agreement(ds_config, trainer_kwargs, world=env.world_size(), source=ds_path)
        model_config = _checked_model_config(recipe_args.model, recipe_args.max_seq_len)
        plan = memory.preflight(
            model_config, ds_config, world_size=env.world_size(),
            micro_batch=trainer_kwargs["per_device_train_batch_size"], seq_len=recipe_args.max_seq_len,
            gradient_checkpointing=trainer_kwargs["activation_checkpointing"], skip=recipe_args.skip_memory_check,
            skip_flag="--skip_memory_check", flags=TRAINER_FLAGS)
        cuda_ops.check(ds_config)
        nvme.check(ds_config, str(ds_path))
        prometheus.requested_port()
        trackers.check(trainer_kwargs.get("report_to"), flag="--report_to")
        output = Path(trainer_kwargs["output_dir"])
        outputs.check_writable(output)
        if env.is_main_rank():
            for path in checkpoints.clean_partial(output, checkpoints.TRAINER_LAYOUT):
                print(f"removed {path}: a checkpoint save that never completed (no trainer_state.json)")
        resume_from = checkpoints.resolve_resume(trainer_kwargs["resume_from_checkpoint"], output,
                                                 checkpoints.TRAINER_LAYOUT)
        saved = resume_from and checkpoints.trainer_saved_world(resume_from)
        if saved and saved != env.world_size():
            raise ConfigError(f"checkpoint '{resume_from}' was saved by {_ranks(saved)}, this launch has "
                              f"{env.world_size()}: the Trainer's ZeRO-2 checkpoints resume on the same number of "
                              f"ranks. Launch {_ranks(saved)}, or start a new --output_dir from the consolidated model "
                              "(the accelerate recipes' ZeRO-3 checkpoints resume on any number).")
        if resume_from is not None and (resume_from / "config.json").is_file():  # the Trainer saves the model's
            saved = architecture(models.load_config(str(resume_from)))
            if saved != architecture(model_config):
                raise ConfigError(f"checkpoint '{resume_from}' belongs to a different model: {saved} in the "
                                  f"checkpoint, {architecture(model_config)} now (--model {recipe_args.model}). "
                                  "Relaunch with the checkpoint's model to continue it, or pass a new --output_dir "
                                  "to start over; nothing was overwritten.")
        estimate = checkpoints.estimate_bytes(plan.total_params, plan.trainable_params, zero_stage, model_copy=True)
        if trainer_kwargs["save_strategy"] != "no":
            problem = checkpoints.free_space_problem(
                output, checkpoints.predicted_bytes(output, estimate, checkpoints.TRAINER_LAYOUT),
                checkpoints.TRAINER_LAYOUT)
            if problem:
                raise ConfigError(f"{problem}; or pass --save_strategy no to train without checkpoints.")
        script_args = {**vars(recipe_args), **{k: v for k, v in trainer_kwargs.items()
                                               if k not in ("output_dir", "resume_from_checkpoint", "report_to")}}
        return cls(recipe, recipe_args, output, model_config, Path(ds_path), ds_config, plan, resume_from,
                   script_args=script_args, checkpoint_estimate=estimate)

    def check_trainer_arguments(self, training_args) -> None:
        """Raise now what transformers noted while building TrainingArguments and would raise
        only inside ``trainer.train()``, after the model has loaded."""
        checks.check_trainer_mismatches(training_args, source=str(self.ds_path))

    def check_enough_data(self, train_examples: int, training_args) -> None:
        """The Trainer's counterpart of :meth:`plan_steps`' check: at least one optimizer step."""
        a = training_args
        if train_examples < a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size:
            raise ConfigError(f"{train_examples} training sequences make no full optimizer step of "
                              f"{a.per_device_train_batch_size} x {a.gradient_accumulation_steps} x {a.world_size} "
                              "processes; lower --per_device_train_batch_size or --gradient_accumulation_steps, "
                              "or add data.")

    # ---- 2. the process group ----

    def start(self, **accelerator_kwargs):
        """The Accelerator the launch config describes (gloo on CPU-only machines), seeded;
        the sampler is seedable so a resumed run sees the same data order."""
        from accelerate.utils import DataLoaderConfiguration, set_seed

        from finetune_kit.launch.accelerator import make_accelerator

        self.accelerator = make_accelerator(
            gradient_accumulation_steps=self.args.grad_accum,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            **trackers.accelerator_kwargs(self.args.report_to, self.output), **accelerator_kwargs)
        set_seed(self.args.seed)
        acc = self.accelerator
        trackers.start(acc, self.recipe, self.script_args)
        self.endpoint = prometheus.open_endpoint(self.recipe)
        self.stop = StopRequest(announce=acc.is_local_main_process).install()
        if self._reshaping() and self.fsdp is None:  # another number of ranks: DeepSpeed's universal format
            acc.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
        engine = (f"ZeRO stage {checks.zero_stage(self.ds_config)}, config {self.ds_path}" if self.fsdp is None else
                  "FSDP2 (full sharding; fp32 weights, bf16 compute, fp32 gradient reduction)")
        acc.print(f"world size {acc.num_processes}, device {acc.device}, {engine}")
        return acc

    # ---- 3. the schedule ----

    def plan_steps(self, train_dl) -> int:
        """Optimizer steps per epoch and in total, from the (unprepared) training loader."""
        world = self.accelerator.num_processes
        self.steps_per_epoch = math.ceil(len(train_dl) / world) // self.args.grad_accum
        if self.steps_per_epoch == 0:
            raise ConfigError(f"{len(train_dl.dataset)} training examples make no full optimizer step of "
                              f"{self.args.micro_batch_size} x {self.args.grad_accum} x {world} processes; "
                              "lower --micro-batch-size or --grad-accum, or add data.")
        self.total_steps = self.args.epochs * self.steps_per_epoch
        if self.args.max_steps:
            self.total_steps = min(self.total_steps, self.args.max_steps)
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

        if self.fsdp is not None:
            optimizer = torch.optim.AdamW(params, lr=self.args.lr, weight_decay=self.args.weight_decay, **fsdp.ADAMW)
            return optimizer, schedule(optimizer)  # counted in optimizer steps: see batches()
        optimizer = DummyOptim(params, lr=self.args.lr, weight_decay=self.args.weight_decay)
        return optimizer, DummyScheduler(optimizer, lr_scheduler_callable=schedule)

    @property
    def max_grad_norm(self) -> float:
        """The gradient clipping norm: the DeepSpeed JSON's ``gradient_clipping`` (DeepSpeed clips
        itself; ``accelerator.clip_grad_norm_`` then only returns the norm), or ``fsdp.MAX_GRAD_NORM``."""
        if self.fsdp is not None:
            return fsdp.MAX_GRAD_NORM
        return float(self.ds_config.get("gradient_clipping", 0.0))

    def resume(self, **load_kwargs) -> None:
        """Restore model, optimizer, schedule, RNG and position from the checkpoint chosen at
        preflight (``--resume``); nothing for a fresh run. ``load_kwargs``: DeepSpeed's."""
        if self.resume_from is None:
            return
        acc = self.accelerator
        if self._reshaping() and self.fsdp is not None:  # torch.distributed.checkpoint reshards on load
            state = checkpoints.load_checkpoint(acc, self.resume_from, **load_kwargs)
            state = checkpoints.reshaped_position(state, checkpoints.saved_world(self.resume_from), acc.num_processes)
        elif self._reshaping():
            saved = checkpoints.saved_world(self.resume_from)
            if acc.is_main_process:
                print(f"{self.resume_from} was saved by {_ranks(saved)}; converting it for {acc.num_processes} "
                      f"(DeepSpeed universal checkpoint, once) ...", flush=True)
                checkpoints.to_universal(self.resume_from)
            acc.wait_for_everyone()
            checkpoints.load_checkpoint(acc, checkpoints.universal_folder(self.resume_from), state=False,
                                        **load_kwargs)
            state = checkpoints.reshaped_position(checkpoints.read_state(self.resume_from), saved, acc.num_processes)
        else:
            state = checkpoints.load_checkpoint(acc, self.resume_from, **load_kwargs)
            if "offload_optimizer" in nvme.nvme_paths(self.ds_config):  # what DeepSpeed's NVMe load leaves out
                checkpoints.restore_nvme_optimizer(acc.deepspeed_engine_wrapped.engine, self.resume_from)
        self.position = Position(state["step"], state["epoch"], state["batch_in_epoch"])
        acc.print(f"resumed from {self.resume_from} at step {self.position.step}")

    def _reshaping(self) -> bool:
        saved = self.resume_from and checkpoints.saved_world(self.resume_from)
        return bool(saved) and saved != env.world_size()

    # ---- 4. the loop ----

    def batches(self, train_dl, model, scheduler) -> Iterator[dict]:
        """The training micro-batches, epoch after epoch, from the current position, until the
        last step. ``example_ids`` is taken off each batch (kept for the run record)."""
        from finetune_kit.metering.flops import FlopCounter
        from finetune_kit.metering.step_report import StepReport
        from finetune_kit.models.shapes import from_config

        self.params_trainable = trainable_parameters(model)
        trainable = None if self.method == "full" else self.params_trainable
        self.flop_counter = FlopCounter(from_config(self.model_config), num_labels=self.num_labels,
                                        trainable=trainable, head_trainable=trainable is not None and
                                        self.num_labels is not None)
        self.report = StepReport(self.accelerator, self.flop_counter, self.output, total_steps=self.total_steps,
                                 initial_step=self.position.step, grad_accum=self.args.grad_accum,
                                 log_every=self.args.log_every, endpoint=self.endpoint)
        self.meter = self.report.meter
        if self.fsdp is not None:
            # accelerate steps a prepared schedule once per rank at each optimizer step (it assumes one
            # written for a single process); DeepSpeed steps its own once. Once, as under DeepSpeed: the
            # schedule's state is then in optimizer steps, and resumes on any number of ranks.
            scheduler.split_batches = True
        self._epoch_done = False
        pos = self.position
        while pos.step < self.total_steps:
            train_dl.set_epoch(pos.epoch)
            for batch in self.accelerator.skip_first_batches(train_dl, pos.batch_in_epoch):
                for ids in batch.pop("example_ids"):
                    self.seen_ids.extend(ids if isinstance(ids, list) else [ids])
                self._lr = scheduler.get_last_lr()[0]  # the rate this step trains with
                yield batch
                if self._epoch_done or pos.step >= self.total_steps:
                    break
            self._epoch_done = False
        self.report.close()

    def micro_batch_done(self, loss, batch) -> None:
        """Account one micro-batch; at an optimizer-step boundary, log, evaluate and save as due.
        Every rank calls it (the step's metrics and a checkpoint are collectives)."""
        self.report.micro_batch(loss, batch)
        pos = self.position
        pos.batch_in_epoch += 1
        if not self.accelerator.sync_gradients:
            return
        pos.step += 1
        self.report.optimizer_step(pos.step, pos.epoch, self._lr)
        self._epoch_done = pos.batch_in_epoch >= self.steps_per_epoch * self.args.grad_accum
        paused = False
        if self.eval_each_epoch and (self._epoch_done or pos.step == self.total_steps):
            self._evaluate(announce=True)
            paused = True
        if self._epoch_done:
            pos.epoch += 1
            pos.batch_in_epoch = 0
        stopping = pos.step < self.total_steps and self.stop.agreed(self.accelerator)  # signalled: save now
        due = self.args.save_every and (pos.step % self.args.save_every == 0 or pos.step == self.total_steps)
        if stopping or due:
            path = checkpoints.save_checkpoint(self.accelerator, self.output, pos.step,
                                               {**pos.as_dict(), "world_size": self.accelerator.num_processes,
                                                "global_batch": self.args.micro_batch_size * self.args.grad_accum
                                                * self.accelerator.num_processes, "run": self.identity},
                                               keep=self.args.keep_checkpoints, estimate=self.checkpoint_estimate)
            self.accelerator.print(f"\ncheckpoint saved: {path}")
            paused = True
            if stopping:
                self._stop_here(path)
        if paused:
            self.meter.reset_clock()  # evaluation and saving are not training time

    def _stop_here(self, path: Path) -> None:
        """Signalled, and this step checkpointed: leave the process group and exit 0."""
        acc, pos = self.accelerator, self.position
        self.report.close()
        acc.print(stop_line(self.stop.describe(), pos.step, self.total_steps, path))
        acc.wait_for_everyone()
        acc.end_training()
        self._close_endpoint()
        sys.exit(0)

    def _evaluate(self, announce: bool) -> dict:
        result = {"step": self.position.step, "epoch": self.position.epoch, **self.evaluate()}
        self.evals.append(result)
        if announce:
            self.accelerator.print(f"\nvalidation after step {result['step']}: {describe_eval(result)}")
        return result

    # ---- the HF Trainer's loop instead ----

    def metered_trainer(self, **trainer_kwargs):
        """A :class:`~finetune_kit.training.trainer.MeteredTrainer` (the Trainer, metered like the
        loops above) whose accelerator, meter and progress this run reads at the end."""
        from finetune_kit.metering.flops import FlopCounter
        from finetune_kit.models.shapes import from_config
        from finetune_kit.training.trainer import MeteredTrainer, RoomToSaveCallback, StopCallback

        self.flop_counter = FlopCounter(from_config(self.model_config), num_labels=self.num_labels)
        self.endpoint = prometheus.open_endpoint(self.recipe)
        trainer = MeteredTrainer(flop_counter=self.flop_counter, metrics_dir=self.output, endpoint=self.endpoint,
                                 **trainer_kwargs)
        stop = StopRequest(announce=trainer.args.local_process_index == 0).install()
        trainer.add_callback(StopCallback(trainer, stop))
        trainer.add_callback(RoomToSaveCallback(trainer, self.checkpoint_estimate))  # sees the final should_save
        self.accelerator, self.meter, self._trainer = trainer.accelerator, trainer.meter, trainer
        self.params_trainable = trainable_parameters(trainer.model)
        return trainer

    def save_trainer_model(self, trainer) -> Path:
        """The Trainer's consolidated model in ``<output>/model``, put in place only once complete
        (all ranks call it; the Trainer writes on rank 0)."""
        from finetune_kit.outputs import written_whole

        model_dir = self.output / "model"
        with written_whole(model_dir, writer=trainer.args.should_save) as folder:
            trainer.save_model(str(folder))
        return model_dir

    # ---- 5. the end ----

    def finish(self, model, *, saved_to: Path | None, seen_ids: list[int] | None = None, details: dict | None = None,
               training: dict | None = None) -> None:
        """Evaluate (when not done per epoch), then write ``run_record.json`` and ``run_info.json``
        and print the summary; leave the process group. Every rank calls it.

        ``model``: the prepared engine; ``saved_to``: what the run saved (model or adapter);
        ``seen_ids``: rows this rank trained on when the loop was not :meth:`batches`;
        ``details``: recipe-specific facts for run_info.json; ``training``: extra run-record
        training fields (e.g. ``packing``).
        """
        from accelerate.utils import gather_object

        from finetune_kit.metering import memory as peaks
        from finetune_kit.models.shapes import from_config
        from finetune_kit.results import record
        from finetune_kit.training.partitions import rank_report

        acc, args = self.accelerator, self.args
        trainer = self._trainer
        if trainer is not None:
            self.position.step, self.total_steps = trainer.state.global_step, trainer.state.max_steps
        if self.evaluate is not None and not self.eval_each_epoch:
            self._evaluate(announce=False)
        launch = env.view()
        ranks = gather_object([{"rank": acc.process_index, "machine_rank": launch.machine_rank,
                                "world_size": acc.num_processes,
                                "example_ids": self.seen_ids if seen_ids is None else seen_ids,
                                **rank_report(model)}])
        all_peaks = peaks.peaks_all_ranks(acc)
        micro, accum = _batch_shape(args, trainer)
        if acc.is_main_process:
            final = self.evals[-1] if self.evals else {}
            run_record = record.for_training_run(
                recipe=self.recipe, model_name=args.model, arch=from_config(self.model_config),
                flop_counter=self.flop_counter, params_trainable=self.params_trainable,
                ds_config=self.ds_config if self.fsdp is None else self.fsdp.as_dict(), engine=self.engine,
                script_args=self.script_args, world=acc.num_processes, nodes=env.num_nodes(), meter=self.meter,
                warmup_steps=args.meter_warmup_steps, peaks=all_peaks, where=Path(sys.argv[0]).resolve().parent,
                predicted_gpu_GiB=self.memory_plan.gpu_bytes / 2**30,
                training={"method": self.method, "seq_len": args.max_seq_len, "micro_batch_size": micro,
                          "grad_accum": accum, "gradient_checkpointing": _checkpointing(args, trainer),
                          **(training or {})})
            run_record.data = self.data_counts
            run_record.write(self.output / "run_record.json")
            record.RunInfo(
                recipe=self.recipe, model=args.model, world_size=acc.num_processes, nodes=env.num_nodes(),
                engine=self.engine, zero_stage=3 if self.fsdp else model.zero_optimization_stage(),
                precision=self.fsdp.mixed_precision if self.fsdp else _precision(model),
                deepspeed_config=str(self.ds_path or ""), steps=self.position.step, total_steps=self.total_steps,
                resumed_from=str(self.resume_from or ""), eval_loss=final.get("eval_loss"),
                eval_accuracy=final.get("eval_accuracy"), evals=self.evals,
                train_examples=self.train_examples, eval_example_ids=self.eval_example_ids,
                max_seq_len=args.max_seq_len, micro_batch_size=micro, grad_accum=accum, saved_to=str(saved_to or ""),
                peak_memory=peaks.peaks(), memory_plan=self.memory_plan.to_dict(), ranks=ranks,
                details=details or {}, finished_at=record.now(),
            ).write(self.output / "run_info.json")
            evaluated = f"validation {describe_eval(final)}" if final else "no validation split"
            print(f"done: {self.position.step} steps, {evaluated}, {self.meter.total_tokens:,} tokens trained "
                  f"in this session, {f'{Path(saved_to).name} saved to {saved_to}' if saved_to else 'nothing saved'}\n"
                  f"per-step loss, tokens/s and memory: {self.output / 'metrics.jsonl'}; "
                  f"run record: {self.output / 'run_record.json'}")
        # Every rank leaves the process group together, before the interpreter exits: a rank that tears
        # down its gloo connections while another still writes can die at exit with SIGABRT.
        acc.wait_for_everyone()
        acc.end_training()
        self._close_endpoint()

    def _close_endpoint(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    @property
    def engine(self) -> str:
        """``"deepspeed"`` or ``"fsdp2"``: what shards the model in this run."""
        return "deepspeed" if self.fsdp is None else fsdp.ENGINE

    def record_split(self, train_set, eval_set, counts=None) -> None:
        """Remember the split's sizes and held-out rows (``example_ids`` or ``example_id`` columns),
        and ``counts`` (:class:`~finetune_kit.data.instructions.DataCounts`) for the run record."""
        self.train_examples = len(train_set)
        self.eval_example_ids = example_ids(eval_set) if eval_set is not None else []
        self.data_counts = counts
        if counts is not None and env.is_main_rank():
            print(counts.summary())


# ---- helpers ----

def _check_reshape(checkpoint: Path, args, zero_stage: int, ds_config: dict | None = None) -> None:
    """A checkpoint of another number of ranks resumes exactly only with the same global batch, and
    not at all when it offloads to NVMe (its swap files are per rank)."""
    state = checkpoints.read_state(checkpoint)
    saved, world = state.get("world_size"), env.world_size()
    if not saved or saved == world:
        return
    if nvme.nvme_paths(ds_config or {}):
        raise ConfigError(f"checkpoint '{checkpoint}' was saved by {_ranks(saved)}, this launch has {world}: "
                          "a run that offloads to NVMe resumes on the same number of ranks (its swap files are "
                          f"per rank). Launch {_ranks(saved)}.")
    if zero_stage != 3:
        raise ConfigError(f"checkpoint '{checkpoint}' was saved by {_ranks(saved)}, this launch has {world}: "
                          f"resuming on another number of ranks is supported under ZeRO-3. Launch {_ranks(saved)}.")
    given = args.micro_batch_size * args.grad_accum * world
    if given != state["global_batch"]:
        accum = state["global_batch"] / (args.micro_batch_size * world)
        fix = (f"pass --grad-accum {accum:g}" if accum.is_integer() else
               f"choose --micro-batch-size and --grad-accum whose product is {state['global_batch'] / world:g}")
        raise ConfigError(
            f"checkpoint '{checkpoint}' was saved by {_ranks(saved)} with {state['global_batch']} sequences per "
            f"optimizer step; this launch's {world} ranks take {args.micro_batch_size} x {args.grad_accum} x {world} "
            f"= {given}. Keep the global batch so that the schedule and the data position carry over: {fix}.")


def _ranks(n: int) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def architecture(config) -> str:
    """The model's shape in one line (``llama: hidden 4096, 32 layers, ...``): what a checkpoint must match."""
    from finetune_kit.models.shapes import ModelShape

    s = ModelShape.from_config(config)
    return (f"{getattr(config, 'model_type', 'model')}: hidden {s.hidden_size}, {s.num_hidden_layers} layers, "
            f"{s.num_attention_heads}/{s.num_key_value_heads} heads, ffn {s.intermediate_size}, vocab {s.vocab_size}")


def _checked_model_config(model: str, max_seq_len: int):
    config = models.load_config(model)
    models.check_seq_len(max_seq_len, config, model)
    return config


def example_ids(dataset) -> list[int]:
    """Source row ids of a dataset whose rows carry ``example_ids`` (lists) or ``example_id``."""
    if "example_ids" in dataset.column_names:
        return [i for ids in dataset["example_ids"] for i in ids]
    return list(dataset["example_id"])


def trainable_parameters(model) -> int:
    """Elements of the parameters that train (full sizes, also under ZeRO-3's partitioning)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def describe_eval(result: dict) -> str:
    """``loss 0.6931, accuracy 0.750`` from an evaluation's ``eval_*`` values."""
    parts = [f"loss {result['eval_loss']:.4f}"]
    if result.get("eval_accuracy") is not None:
        parts.append(f"accuracy {result['eval_accuracy']:.3f}")
    return ", ".join(parts)


def _precision(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def _batch_shape(args, trainer) -> tuple[int, int]:
    if trainer is not None:
        return trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    return args.micro_batch_size, args.grad_accum


def _checkpointing(args, trainer) -> bool:
    if trainer is not None:
        return bool(trainer.args.activation_checkpointing)
    return bool(args.gradient_checkpointing)

