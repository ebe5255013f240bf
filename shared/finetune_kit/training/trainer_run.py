"""A run whose loop is the HF Trainer's: the same preflight, metering and ending as the accelerate recipes.

The Trainer recipe's ``main()``::

    run = TrainerRun.preflight(RECIPE, recipe_args, trainer_kwargs, zero_stage=2, configs=...)  # seconds
    args = run.training_arguments(**fixed)             # TrainingArguments; the process group starts here
    ...  data and model: the recipe's own  ...
    run.check_enough_data(len(train_set))
    trainer = run.trainer(model=model, train_dataset=..., data_collator=..., processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=...)          # checkpoints by --save_steps; a stop signal saves, exits 0
    run.finish(trainer.model_wrapped, saved_to=..., seen_ids=...)
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune_kit import output_lock
from finetune_kit.errors import ConfigError
from finetune_kit.launch import checks
from finetune_kit.metering import prometheus
from finetune_kit.training import preflight
from finetune_kit.training.ending import RunBase, trainable_parameters


@dataclass
class TrainerRun(RunBase):
    trainer_kwargs: dict = None  # TrainingArguments' fields as parsed (bf16/fp16 filled from the JSON)
    training_args: object = None  # the TrainingArguments built from them
    _trainer: object = None

    @classmethod
    def preflight(cls, recipe: str, recipe_args, trainer_kwargs: dict, *, zero_stage: int,
                  configs: str) -> TrainerRun:
        """Every check that needs no process group (:func:`preflight.for_trainer`): ``recipe_args``
        (model, max_seq_len, skip_memory_check) and TrainingArguments' fields as parsed."""
        checked = preflight.for_trainer(recipe, recipe_args, trainer_kwargs, zero_stage=zero_stage, configs=configs)
        return cls(checked, recipe_args, trainer_kwargs=trainer_kwargs)

    def training_arguments(self, **fixed):
        """``TrainingArguments`` from the parsed flags and ``fixed`` (what the recipe's code relies on).
        ``ddp_timeout`` left as None becomes FINETUNE_COLLECTIVE_TIMEOUT_S (600 s by default). On a
        CPU-only machine the DeepSpeed state is set up first (``launch.accelerator.trainer_cpu_overrides``).
        Raises now what transformers noted and would raise only inside ``trainer.train()``."""
        from transformers import TrainingArguments

        from finetune_kit.launch.accelerator import trainer_cpu_overrides
        from finetune_kit.launch.env import collective_timeout_s

        kwargs = {**self.trainer_kwargs, **fixed}
        if kwargs.get("ddp_timeout") is None:
            kwargs["ddp_timeout"] = collective_timeout_s()
        self.training_args = TrainingArguments(**{**kwargs, **trainer_cpu_overrides()})
        checks.check_trainer_mismatches(self.training_args, source=str(self.checked.ds_path))
        return self.training_args

    def check_enough_data(self, train_examples: int) -> None:
        """At least one optimizer step, before the model loads."""
        a = self.training_args
        if train_examples < a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size:
            raise ConfigError(f"{train_examples} training sequences make no full optimizer step of "
                              f"{a.per_device_train_batch_size} x {a.gradient_accumulation_steps} x {a.world_size} "
                              "processes; lower --per_device_train_batch_size or --gradient_accumulation_steps, "
                              "or add data.")

    def trainer(self, **trainer_kwargs):
        """A :class:`~finetune_kit.training.trainer.MeteredTrainer` on :meth:`training_arguments`
        (metered like the accelerate loops), which checkpoints before a stop signal ends the
        process and checks the disk before each save."""
        from finetune_kit.metering.flops import FlopCounter
        from finetune_kit.training.preemption import StopRequest
        from finetune_kit.training.trainer import MeteredTrainer, ResumeCallback, RoomToSaveCallback, StopCallback

        c = self.checked
        if self.training_args.process_index == 0:  # from here on the run writes to its folder, until it ends
            output_lock.acquire(c.output)
        self.flop_counter = FlopCounter(c.shape, num_labels=c.num_labels)
        self.endpoint = prometheus.open_endpoint(c.recipe)
        trainer = MeteredTrainer(args=self.training_args, flop_counter=self.flop_counter, metrics_dir=c.output,
                                 endpoint=self.endpoint,
                                 offload_activations=getattr(self.args, "offload_activations", False), **trainer_kwargs)
        stop = StopRequest(announce=trainer.args.local_process_index == 0).install()
        trainer.add_callback(StopCallback(trainer, stop))
        trainer.add_callback(ResumeCallback(trainer))
        trainer.add_callback(RoomToSaveCallback(trainer, c.checkpoint_estimate))  # sees the final should_save
        self.accelerator, self.meter, self._trainer = trainer.accelerator, trainer.meter, trainer
        self.params_trainable = trainable_parameters(trainer.model)
        return trainer

    def batch_shape(self) -> dict:
        a = self._trainer.args
        return {"micro_batch_size": a.per_device_train_batch_size, "grad_accum": a.gradient_accumulation_steps,
                "gradient_checkpointing": bool(a.activation_checkpointing),
                "checkpoint_every": preflight.checkpoint_every(a.activation_checkpointing_kwargs),
                "compiled": a.torch_compile}

    def finish(self, model, *, saved_to, seen_ids: list[int], details: dict | None = None,
               training: dict | None = None) -> None:
        state = self._trainer.state
        self.position.step, self.total_steps = state.global_step, state.max_steps
        super().finish(model, saved_to=saved_to, seen_ids=seen_ids, details=details, training=training)
