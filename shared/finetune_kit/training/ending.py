"""What every run shares, whoever drives its loop, and how it ends.

:class:`RunBase` holds the :class:`~finetune_kit.training.preflight.Preflight` the launch passed,
the data split, the evaluations, the metering, and :meth:`RunBase.finish`: evaluate (when not
done per epoch), write ``run_record.json`` and ``run_info.json``
(:mod:`finetune_kit.metering.run_record`), print the summary line and leave the process group.
:class:`~finetune_kit.training.run.TrainingRun` (a recipe's own loop under accelerate) and
:class:`~finetune_kit.training.trainer_run.TrainerRun` (the HF Trainer's loop) build on it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from finetune_kit import output_lock
from finetune_kit.launch import env
from finetune_kit.training.preflight import Preflight


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
class RunBase:
    checked: Preflight
    args: object  # the recipe's parsed arguments
    evaluate: Callable[[], dict] | None = None  # set by the recipe; returns {"eval_loss": ..., ...}
    position: Position = field(default_factory=Position)
    total_steps: int = 0
    accelerator: object = None
    meter: object = None  # metering.throughput.ThroughputMeter, set when the loop starts
    flop_counter: object = None  # metering.flops.FlopCounter of this model
    params_trainable: int = 0
    evals: list[dict] = field(default_factory=list)
    train_examples: int = 0  # the split, for run_info.json
    eval_example_ids: list[int] = field(default_factory=list)
    data_counts: object = None  # DataCounts of the instruction recipes, for the run record
    endpoint: object = None  # this rank's /metrics (metering.prometheus), when FINETUNE_METRICS_PORT is set

    # What the recipes read of the preflight.
    @property
    def output(self) -> Path:
        return self.checked.output

    @property
    def model_config(self):
        return self.checked.model_config

    @property
    def ds_path(self) -> Path | None:
        return self.checked.ds_path

    @property
    def resume_from(self) -> Path | None:
        return self.checked.resume_from

    def record_split(self, train_set, eval_set, counts=None) -> None:
        """Remember the split's sizes and held-out rows (``example_ids`` or ``example_id`` columns),
        and ``counts`` (:class:`~finetune_kit.data.instructions.DataCounts`) for the run record."""
        self.train_examples = len(train_set)
        self.eval_example_ids = example_ids(eval_set) if eval_set is not None else []
        self.data_counts = counts
        if counts is not None and env.is_main_rank():
            print(counts.summary())

    def _evaluate(self, announce: bool) -> dict:
        result = {"step": self.position.step, "epoch": self.position.epoch, **self.evaluate()}
        self.evals.append(result)
        if announce:
            self.accelerator.print(f"\nvalidation after step {result['step']}: {describe_eval(result)}")
        return result

    # ---- the end ----

    def batch_shape(self) -> dict:
        """The batch and the per-step levers as this run trains: micro_batch_size, grad_accum,
        gradient_checkpointing, checkpoint_every, compiled."""
        return {"micro_batch_size": self.args.micro_batch_size, "grad_accum": self.args.grad_accum,
                "gradient_checkpointing": bool(self.args.gradient_checkpointing),
                "checkpoint_every": self.args.checkpoint_every, "compiled": bool(getattr(self.args, "compile", False))}

    def evaluated_at_the_end(self) -> bool:
        return self.evaluate is not None

    def finish(self, model, *, saved_to: Path | None, seen_ids: list[int], details: dict | None = None,
               training: dict | None = None) -> None:
        """Evaluate (when due at the end), then write ``run_record.json`` and ``run_info.json``,
        print the summary and leave the process group. Every rank calls it.

        ``model``: the prepared engine; ``saved_to``: what the run saved (model or adapter);
        ``seen_ids``: rows this rank trained on; ``details``: recipe-specific facts for
        run_info.json; ``training``: extra run-record training fields (e.g. ``packing``).
        """
        from accelerate.utils import gather_object

        from finetune_kit.metering import peak_memory
        from finetune_kit.metering import run_record as record
        from finetune_kit.models import chunked_loss
        from finetune_kit.training.partitions import rank_report

        acc, checked = self.accelerator, self.checked
        if self.evaluated_at_the_end():
            self._evaluate(announce=False)
        launch = env.view()
        ranks = gather_object([{"rank": acc.process_index, "machine_rank": launch.machine_rank,
                                "world_size": acc.num_processes, "example_ids": seen_ids, **rank_report(model)}])
        all_peaks = peak_memory.peaks_all_ranks(acc)
        shape = self.batch_shape()
        if acc.is_main_process:
            final = self.evals[-1] if self.evals else {}
            run_record = record.for_training_run(
                recipe=checked.recipe, model_name=self.args.model, arch=checked.shape, flop_counter=self.flop_counter,
                params_trainable=self.params_trainable,
                ds_config=checked.ds_config if checked.fsdp is None else checked.fsdp.as_dict(), engine=checked.engine,
                script_args=checked.script_args, world=acc.num_processes, nodes=env.num_nodes(), meter=self.meter,
                warmup_steps=self.args.meter_warmup_steps, peaks=all_peaks, where=Path(sys.argv[0]).resolve().parent,
                predicted_gpu_GiB=checked.memory_plan.gpu_bytes / 2**30,
                training={"method": checked.method, "seq_len": self.args.max_seq_len, **shape,
                          "loss_chunks": getattr(self.args, "loss_chunks", 0),
                          "loss_kernel": chunked_loss.loss_kernel(getattr(self.args, "loss_kernel", "chunked"))
                          if getattr(self.args, "loss_chunks", 0) else "none",
                          "offload_activations": bool(getattr(self.args, "offload_activations", False)),
                          **(training or {})})
            run_record.data = self.data_counts
            run_record.write(checked.output / "run_record.json")
            record.RunInfo(
                recipe=checked.recipe, model=self.args.model, devices=acc.num_processes, nodes=env.num_nodes(),
                engine=checked.engine, zero_stage=checked.zero_stage,
                precision=checked.fsdp.mixed_precision if checked.fsdp else _precision(model),
                deepspeed_config=str(checked.ds_path or ""), steps=self.position.step, total_steps=self.total_steps,
                resumed_from=str(checked.resume_from or ""), eval_loss=final.get("eval_loss"),
                eval_accuracy=final.get("eval_accuracy"), evals=self.evals, train_examples=self.train_examples,
                eval_example_ids=self.eval_example_ids, seq_len=self.args.max_seq_len,
                micro_batch_size=shape["micro_batch_size"], grad_accum=shape["grad_accum"],
                saved_to=str(saved_to or ""), peak_memory=peak_memory.peaks(),
                memory_plan=checked.memory_plan.to_dict(), ranks=ranks, details=details or {},
                finished_at=record.now(),
            ).write(checked.output / "run_info.json")
            evaluated = f"validation {describe_eval(final)}" if final else "no validation split"
            out = checked.output
            print(f"done: {self.position.step} steps, {evaluated}, {self.meter.total_tokens:,} tokens trained "
                  f"in this session, {f'{Path(saved_to).name} saved to {saved_to}' if saved_to else 'nothing saved'}\n"
                  f"per-step loss, tokens/s and memory: {out / 'metrics.jsonl'}; run record: {out / 'run_record.json'}")
        # Every rank leaves the process group together, before the interpreter exits: a rank that tears
        # down its gloo connections while another still writes can die at exit with SIGABRT.
        acc.wait_for_everyone()
        acc.end_training()
        self._close_endpoint()
        output_lock.release(checked.output)  # the main rank's hold on the output folder

    def _close_endpoint(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


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
