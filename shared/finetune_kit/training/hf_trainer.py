"""The HF Trainer recipe's loop: the Trainer's own, metered, checked and ended like the accelerate recipes'.

    args = training_arguments(checked, trainer_kwargs, **fixed)  # TrainingArguments; the process group starts
    ...  data and model: the recipe's own  ...
    check_enough_data(args, len(train_set))
    trainer = metered_trainer(checked, recipe_args, args, model=..., train_dataset=..., data_collator=...)
    trainer.train(resume_from_checkpoint=...)  # checkpoints by --save_steps; a stop signal saves one and ends it
    if trainer.stopped_by: return              # the same command resumes
    records.finish(trainer.accelerator, checked, recipe_args, trainer.model_wrapped, trainer, ...)

:class:`MeteredTrainer` feeds each micro-batch to a :class:`StepTally` (real tokens, padded slots,
model FLOPs by :mod:`finetune_kit.metering.flops`); at each optimizer step the totals over all ranks
become a :class:`StepRate`. Logged steps go to ``metrics.jsonl`` (and to the trackers of
``--report_to``) with the same names as the accelerate recipes: step, epoch, loss, lr, grad_norm,
tokens, padding_fraction, tokens_per_s, tokens_per_s_per_device, model_tflop_per_s_per_device,
mfu_percent (GPUs with a known peak), step_time_s and the ``metering.peak_memory.peaks()`` keys. The loss
is the Trainer's: token-weighted over the whole optimizer step, all ranks (``num_items_in_batch``,
``average_tokens_across_devices``). Every step also goes to the rank's Prometheus endpoint when the run
has one (:mod:`finetune_kit.metering.prometheus`).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from finetune_kit.data.batching import ROWS
from finetune_kit.errors import ConfigError
from finetune_kit.metering import keys, peak_memory
from finetune_kit.metering.flops import FlopCounter, device_name
from finetune_kit.metering.metrics_log import MetricsLog
from finetune_kit.metering.throughput import StepTally, ThroughputMeter
from finetune_kit.models.activation_offload import offload_activations
from finetune_kit.planning import hardware
from finetune_kit.training.checkpointing import checkpoints
from finetune_kit.training.checkpointing.adam_resume import replay_bias_correction
from finetune_kit.training.nonfinite import Guard
from finetune_kit.training.stop import StopSignal, stop_line


class MeteredTrainer(Trainer):
    """``Trainer(...)`` plus ``flop_counter``, ``metrics_dir`` (where metrics.jsonl goes) and the
    rank's Prometheus ``endpoint`` (or None). Like a step meter (:func:`records.finish` reads it):
    ``rates`` holds every step's rate, for the run record's medians; ``seen_ids`` the rows this rank
    trained on (its collator's, a ``data.RowRecorder``). ``stopped_by``: the stop signal that ended
    ``train()`` with a checkpoint, or None."""

    def __init__(self, *args, flop_counter: FlopCounter, metrics_dir: str | Path, endpoint=None,
                 offload_activations: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.offload_activations = offload_activations
        self.flop_counter, self.endpoint, self.stopped_by = flop_counter, endpoint, None
        self.tally = StepTally(flop_counter)
        self.step_loss, self.step_rows = torch.zeros(()), []  # this rank's, over the step's micro-batches
        self.rates = ThroughputMeter(self.args.world_size, peak_tflops=hardware.peak_bf16_tflops(device_name()))
        metering = MeteringCallback(self, MetricsLog(metrics_dir, enabled=self.is_world_process_zero()), endpoint)
        # First, so the figures it adds to a logged step reach the --report_to trackers' callbacks.
        self.callback_handler.callbacks.insert(0, metering)

    @property
    def seen_ids(self) -> list[int]:
        return list(getattr(self.data_collator, "seen", []))

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.step_rows.extend(inputs.pop(ROWS, []))  # this micro-batch's source rows (a data.RowRecorder's)
        self.tally.add(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_loss = self.step_loss.to(loss.device) + loss.detach().float()  # no wait for the device here
        return loss

    def prediction_step(self, model, inputs, *args, **kwargs):
        inputs.pop(ROWS, None)  # an evaluation through the Trainer: the model must not see the rows either
        return super().prediction_step(model, inputs, *args, **kwargs)

    def compute_loss_context_manager(self):
        """The forward and loss (not the backward) with the activations offloaded when asked."""
        stack = ExitStack()
        stack.enter_context(super().compute_loss_context_manager())
        stack.enter_context(offload_activations(self.offload_activations))
        return stack


class MeteringCallback(TrainerCallback):
    """Closes each optimizer step's tally (a collective: every rank runs it) and writes the
    logged steps. Also puts tokens/s and peak memory on the Trainer's own log line."""

    def __init__(self, trainer: MeteredTrainer, log: MetricsLog, endpoint=None):
        self.trainer = trainer
        self.log = log
        self.endpoint = endpoint
        self.rate = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.rates.reset_clock()

    def on_step_end(self, args, state, control, **kwargs):
        own_tokens = self.trainer.tally.tokens
        self.rate = self.trainer.rates.step(**self.trainer.tally.reduce(self.trainer.accelerator))
        if self.endpoint is not None:
            self.endpoint.update({keys.STEP.key: state.global_step, keys.EPOCH.key: state.epoch,
                                  **self.rate.as_metrics(), **keys.loss_scaling(getattr(self.trainer, "model_wrapped",
                                                                                       None))})
            self.endpoint.rank_tokens(own_tokens)

    def on_save(self, args, state, control, **kwargs):
        self.trainer.rates.reset_clock()  # a checkpoint write is not training time

    def on_evaluate(self, args, state, control, **kwargs):
        self.trainer.rates.reset_clock()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs or self.rate is None:  # e.g. the end-of-training summary
            return
        record = {keys.STEP.key: state.global_step, keys.EPOCH.key: state.epoch, keys.LOSS.key: logs["loss"],
                  keys.LR.key: logs.get("learning_rate"),
                  **({keys.GRAD_NORM.key: float(logs["grad_norm"])} if logs.get("grad_norm") is not None else {}),
                  **keys.preference(logs), **self.rate.as_metrics(), **peak_memory.peaks(),
                  **keys.loss_scaling(getattr(self.trainer, "model_wrapped", None))}
        if self.endpoint is not None:
            self.endpoint.update(record)
        if _reporting(args):  # the trackers log every figure under metrics.jsonl's names
            logs.update({k: v for k, v in record.items() if k not in (keys.STEP.key, keys.EPOCH.key)})
        else:  # the console line: throughput, the memory headline and (fp16) the loss scaler's state
            logs[keys.TOKENS_PER_S.key] = round(self.rate.tokens_per_s, 1)
            metric, value = keys.memory_headline(record)
            logs[metric.key] = round(value, 2)
            logs.update({k: record[k] for k in (keys.LOSS_SCALE.key, keys.SKIPPED_STEPS.key) if k in record})
        self.log.write(record)

    def on_train_end(self, args, state, control, **kwargs):
        self.log.close()


def _reporting(args) -> bool:
    report_to = getattr(args, "report_to", None) or []
    return any(name != "none" for name in ([report_to] if isinstance(report_to, str) else report_to))


class ResumeCallback(TrainerCallback):
    """After the Trainer loaded a DeepSpeed checkpoint (before its first step): DeepSpeed's native CPU
    Adam gets the beta**t state the uninterrupted run had (:mod:`finetune_kit.training.checkpointing.adam_resume`)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0 and self.trainer.is_deepspeed_enabled:
            replay_bias_correction(self.trainer.model_wrapped.optimizer)


class StopCallback(TrainerCallback):
    """Preemption for the Trainer (:mod:`finetune_kit.training.stop`): at each step's end the ranks
    agree on the stop flag; when set, the Trainer saves a checkpoint and stops; at the end of
    ``train()`` the line that says how to continue, and every rank leaves the process group. The
    recipe sees ``trainer.stopped_by`` and ends (exit status 0) instead of saving the final model."""

    def __init__(self, trainer: MeteredTrainer):
        self.trainer, self.stop = trainer, StopSignal(trainer.accelerator)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < state.max_steps and self.stop.agreed():
            control.should_save = control.should_training_stop = True
            self.trainer.stopped_by = self.stop.describe()

    def on_train_end(self, args, state, control, **kwargs):
        if not self.trainer.stopped_by:
            return
        if state.is_world_process_zero:
            print(stop_line(self.trainer.stopped_by, state.global_step, state.max_steps,
                            Path(args.output_dir) / f"checkpoint-{state.global_step}"), flush=True)
        self.trainer.close()
        self.trainer.accelerator.wait_for_everyone()
        self.trainer.accelerator.end_training()


class NonfiniteCallback(TrainerCallback):
    """At each step's end, before the Trainer saves: the step's loss (one all-reduce) and DeepSpeed's gradient norm
    go to a :class:`~finetune_kit.training.nonfinite.Guard`. DeepSpeed has discarded a non-finite update itself;
    the guard stops the run there in one line naming the step and its rows (``--on-nonfinite stop``) or logs it."""

    def __init__(self, trainer: MeteredTrainer, policy, data: str):
        self.trainer, self.guard = trainer, Guard(trainer.accelerator, policy, data)

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        loss = t.accelerator.reduce(t.step_loss.to(t.accelerator.device), "sum").item() / t.accelerator.num_processes
        rows, t.step_loss, t.step_rows = t.step_rows, torch.zeros(()), []
        engine = getattr(t, "model_wrapped", None)
        norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
        self.guard.judge(state.global_step, rows, loss, norm)


class RoomToSaveCallback(TrainerCallback):
    """Before every checkpoint the Trainer is about to write, the disk must hold it: the newest
    checkpoint's size, or ``estimate`` bytes for the first (:func:`checkpoints.free_space_problem`).
    Otherwise every rank stops with the numbers, before anything is written."""

    def __init__(self, trainer: Trainer, estimate: int):
        self.trainer, self.estimate = trainer, estimate

    def on_step_end(self, args, state, control, **kwargs):
        if not control.should_save:
            return
        output, layout, acc = Path(args.output_dir), checkpoints.TRAINER_LAYOUT, self.trainer.accelerator
        problem = None
        if acc.is_main_process:
            problem = checkpoints.free_space_problem(output, checkpoints.predicted_bytes(output, self.estimate, layout),
                                                     layout)
        problem = checkpoints.same_on_every_rank(acc, problem)
        if problem:
            newest = checkpoints.list_checkpoints(output, layout)
            kept = f"the newest checkpoint is {newest[-1]}" if newest else "no checkpoint was saved yet"
            raise ConfigError(f"not saving the step-{state.global_step} checkpoint: {problem}; {kept}. Relaunch "
                              "the same command once there is room: it resumes from the newest checkpoint.")


# ---- the Trainer of a recipe ----

def training_arguments(checked, trainer_kwargs: dict, arguments: type | None = None, **fixed):
    """``arguments`` (``TrainingArguments``, or a subclass such as TRL's ``DPOConfig``) from the parsed flags
    (``trainer_kwargs``, bf16/fp16 filled from the JSON by the checks) and ``fixed`` (what the recipe's code relies
    on). ``ddp_timeout`` left as None becomes
    FINETUNE_COLLECTIVE_TIMEOUT_S (600 s by default). On a CPU-only machine the DeepSpeed state is set
    up first (``launch.accelerator.trainer_cpu_overrides``). Raises now what transformers noted and would
    raise only inside ``trainer.train()``."""
    from transformers import TrainingArguments

    from finetune_kit.launch import config_checks, env, memory_cap
    from finetune_kit.launch.accelerator import trainer_cpu_overrides
    from finetune_kit.launch.env import collective_timeout_s

    if (capped := memory_cap.apply(checked.plan.memory_cap_GiB)) and env.is_main_rank():  # before the model loads
        print(capped, file=sys.stderr)
    kwargs = {**trainer_kwargs, **fixed}
    if kwargs.get("ddp_timeout") is None:
        kwargs["ddp_timeout"] = collective_timeout_s()
    args = (arguments or TrainingArguments)(**{**kwargs, **trainer_cpu_overrides()})
    config_checks.check_trainer_mismatches(args, source=str(checked.ds_path))
    return args


def check_enough_data(args, train_examples: int) -> None:
    """At least one optimizer step, before the model loads."""
    if train_examples < args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size:
        raise ConfigError(f"{train_examples} training sequences make no full optimizer step of "
                          f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} x "
                          f"{args.world_size} processes; lower --per_device_train_batch_size or "
                          "--gradient_accumulation_steps, or add data.")


def metered_trainer(checked, recipe_args, args, trainer: type = MeteredTrainer, flop_counter: FlopCounter | None = None,
                    **trainer_kwargs) -> MeteredTrainer:
    """A :class:`MeteredTrainer` (or its subclass ``trainer``) on ``args``, metered like the accelerate loops
    (``flop_counter``: the model's FLOPs per token, by default its shape's), which checkpoints before a stop signal
    ends it, checks the disk before each save and resumes DeepSpeed's CPU Adam exactly. The recipe holds the output
    folder around it (``training.hold_output``)."""
    from finetune_kit.launch.startup import import_muon_uncompiled
    from finetune_kit.metering import prometheus

    import_muon_uncompiled(checked.ds_config)  # DeepSpeed's ZeRO check would import it with torch.compile's set-up
    flop_counter = flop_counter or FlopCounter(checked.shape, num_labels=checked.num_labels)
    trainer = trainer(args=args, flop_counter=flop_counter, metrics_dir=checked.output,
                      endpoint=prometheus.open_endpoint(checked.recipe),
                      offload_activations=getattr(recipe_args, "offload_activations", False), **trainer_kwargs)
    trainer.add_callback(NonfiniteCallback(trainer, checked.nonfinite, getattr(recipe_args, "data", "")))
    trainer.add_callback(StopCallback(trainer))
    trainer.add_callback(ResumeCallback(trainer))
    trainer.add_callback(RoomToSaveCallback(trainer, checked.checkpoint_estimate))  # sees the final should_save
    return trainer


def batch_shape(args) -> dict:
    """The Trainer's batch and per-step levers, as :func:`records.finish` records them."""
    from finetune_kit.training.input_checks import recompute_every

    return {"micro_batch_size": args.per_device_train_batch_size, "grad_accum": args.gradient_accumulation_steps,
            "gradient_checkpointing": bool(args.activation_checkpointing),
            "recompute_every": recompute_every(args.activation_checkpointing_kwargs), "compiled": args.torch_compile}
