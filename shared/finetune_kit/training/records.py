"""What a run writes about itself: the step meter it logs with (:func:`step_meter`), its validations
(:func:`validation`), and at its end ``run_record.json`` and ``run_info.json``
(:mod:`finetune_kit.metering.run_record`) with the summary line (:func:`finish`), or the line of a run
stopped by a signal (:func:`stopped`). Both ends leave the process group with every rank (the recipe's
``training.hold_output`` block then gives the output folder back). The HF Trainer recipe ends through
:func:`finish` too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune_kit import outputs
from finetune_kit.data.formats import Conversation
from finetune_kit.launch import cuda_allocator, env


@dataclass(frozen=True)
class DataSplit:
    """The training and held-out split, for run_info.json and the run record."""

    train_examples: int
    eval_example_ids: list[int] = field(default_factory=list)  # the held-out source rows
    counts: object = None  # data.instructions.DataCounts of the instruction recipes
    heldout: list = field(default_factory=list)  # the held-out rows as read: Conversations, or reviews' dicts

    @classmethod
    def of(cls, train_set, eval_set=None, counts=None, rows=None) -> DataSplit:
        """From the two datasets (rows carry ``example_ids`` or ``example_id``); prints ``counts``' summary, with
        the source's splits where it has several. ``rows``: the source rows (``instructions.load_rows``' or
        ``reviews.load_reviews``'), whose held-out ones are kept for the sample answers and the evaluation harness."""
        if counts is not None and env.is_main_rank():
            splits = getattr(rows, "splits", None)
            print(counts.summary() + (splits.note(held_out=eval_set is not None) if splits else ""))
        ids = example_ids(eval_set) if eval_set is not None else []
        return cls(len(train_set), ids, counts, _heldout(rows, ids) if rows is not None else [])

    @classmethod
    def of_pairs(cls, train_set, held: list) -> DataSplit:
        """A preference run's split: the training pairs' dataset and the held-out :class:`~finetune_kit.data.
        preferences.Pair` list, each kept as its prompt with the chosen answer (the sample answers' reference)."""
        return cls(len(train_set), [p.example_id for p in held],
                   heldout=[Conversation(p.prompt + p.chosen, example_id=p.example_id) for p in held])

    def heldout_lines(self) -> list[dict]:
        """``heldout.jsonl``'s lines."""
        return [row.record() if isinstance(row, Conversation) else row for row in self.heldout]


def _heldout(rows, ids: list[int]) -> list:
    from finetune_kit.data import instructions, reviews

    if isinstance(rows, instructions.InstructionRows):  # conversations
        return instructions.heldout_rows(rows, ids)
    return reviews.heldout_rows(rows, ids)  # the reviews' dataset


def step_meter(accelerator, checked, model, args, total_steps: int, start):
    """The :class:`~finetune_kit.metering.step_meter.StepMeter` of this run: model FLOPs of the whole model, or
    of a frozen base plus what trains (LoRA, a head), from step ``start.step`` on."""
    from finetune_kit.metering.flops import FlopCounter, device_name
    from finetune_kit.metering.step_meter import StepMeter
    from finetune_kit.planning import hardware

    if getattr(args, "fp8", "none") != "none":  # accelerate converted the layers in prepare: say how many
        from finetune_kit.models.fp8 import converted, speed_note

        accelerator.print(f"fp8 ({args.fp8} scaling): {converted(model)} linear layers compute in float8; the LM head "
                          "and any layer not 16-aligned in bf16")
        accelerator.print(speed_note(args.fp8, bool(getattr(args, "compile", False))))
    trainable = None if checked.method == "full" else trainable_parameters(model)
    flops = FlopCounter(checked.shape, num_labels=checked.num_labels, trainable=trainable,
                        head_trainable=trainable is not None and checked.num_labels is not None)
    return StepMeter(accelerator, flops, checked.output, total_steps=total_steps, initial_step=start.step,
                     log_every=args.log_every, recipe=checked.recipe,
                     peak_tflops=hardware.peak_bf16_tflops(device_name()))


def validation(step, result: dict, accelerator=None) -> dict:
    """``result`` ({"eval_loss": ..., ...}) of the validation after ``step``, said on rank 0 when an
    ``accelerator`` is given."""
    out = {"step": step.number, "epoch": step.epoch, **result}
    if accelerator is not None:
        accelerator.print(f"\nvalidation after step {step.number}: {describe_eval(out)}")
    return out


def stopped(accelerator, checked, stop, step, total_steps: int, checkpoint: Path, meter) -> None:
    """The end of a run a stop signal ended after ``step``, with ``checkpoint``: the line that says how to
    continue, then every rank leaves the process group. The process then ends with status 0."""
    from finetune_kit.training.stop import stop_line

    meter.close()
    accelerator.print(stop_line(stop.describe(), step.number, total_steps, checkpoint))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def finish(accelerator, checked, args, model, meter, *, steps: int, total_steps: int, split: DataSplit,
           evals: list[dict], saved_to: Path | None, batch: dict, details: dict | None = None,
           training: dict | None = None, samples: list[dict] | None = None) -> None:
    """Close the ``meter``, write ``run_record.json`` and ``run_info.json``, print the summary, leave the
    process group. Every rank calls it.

    ``model``: the prepared engine; ``meter``: the run's step meter (its ``rates``, ``flop_counter`` and
    ``seen_ids``: the rows this rank trained on); ``steps``/``total_steps``: optimizer steps taken and
    planned; ``evals``: every validation (:func:`validation`); ``saved_to``: what the run saved (model or
    adapter); ``batch``: micro_batch_size, grad_accum, gradient_checkpointing, recompute_every, compiled
    (:func:`batch_shape`); ``details``: recipe-specific facts for run_info.json; ``training``: more
    run-record training fields (e.g. ``packing``); ``samples``: the sample answers (training.samples.report), of
    which the record keeps the figures alone (their text stays in samples.jsonl).
    Rank 0 also writes ``heldout.jsonl`` (the held-out rows) and the model card of what was saved."""
    from accelerate.utils import gather_object

    from finetune_kit import losses, model_card
    from finetune_kit.metering import peak_memory
    from finetune_kit.metering import run_record as record
    from finetune_kit.training.checkpointing.partitions import rank_report
    from finetune_kit.training.samples import figures as sample_figures

    acc, rates, seen_ids = accelerator, meter.rates, meter.seen_ids
    meter.close()
    launch = env.view()
    ranks = gather_object([{"rank": acc.process_index, "machine_rank": launch.machine_rank,
                            "world_size": acc.num_processes, "example_ids": seen_ids, **rank_report(model)}])
    all_peaks = peak_memory.peaks_all_ranks(acc)
    if acc.is_main_process:
        final = evals[-1] if evals else {}
        chunks = getattr(args, "loss_chunks", 0)
        run_record = record.for_training_run(
            recipe=checked.recipe, model_name=args.model, arch=checked.shape, flop_counter=meter.flop_counter,
            params_trainable=trainable_parameters(model),
            ds_config=checked.ds_config if checked.fsdp is None else checked.fsdp.as_dict(), engine=checked.engine,
            script_args=checked.script_args, world=acc.num_processes, nodes=env.num_nodes(), meter=rates,
            warmup_steps=args.meter_warmup_steps, peaks=all_peaks, where=Path(sys.argv[0]).resolve().parent,
            predicted_gpu_GiB=checked.plan.memory.gpu_bytes / 2**30, memory_cap_GiB=checked.plan.memory_cap_GiB,
            first_step_after_s=getattr(meter, "first_step_after_s", None),  # the HF Trainer paths: not measured
            training={"method": checked.method, "seq_len": args.max_seq_len, **batch,
                      **({"levers": checked.plan.levers} if checked.plan.levers else {}), "loss_chunks": chunks,
                      "loss_kernel": losses.loss_kernel(getattr(args, "loss_kernel", "chunked"))
                      if chunks else "none",
                      "offload_activations": bool(getattr(args, "offload_activations", False)), **(training or {})})
        run_record.data = split.counts
        run_record.samples = record.SampleFigures(**sample_figures(samples)) if samples else None
        run_record.write(checked.output / "run_record.json")
        if split.heldout:
            outputs.write_text_whole(checked.output / "heldout.jsonl", outputs.jsonl(split.heldout_lines()))
        record.RunInfo(
            recipe=checked.recipe, model=args.model, devices=acc.num_processes, nodes=env.num_nodes(),
            engine=checked.engine, zero_stage=checked.zero_stage,
            precision=checked.fsdp.mixed_precision if checked.fsdp else _precision(model),
            deepspeed_config=str(checked.ds_path or ""), steps=steps, total_steps=total_steps,
            resumed_from=str(checked.resume_from or ""), eval_loss=final.get("eval_loss"),
            eval_accuracy=final.get("eval_accuracy"), evals=evals, train_examples=split.train_examples,
            eval_example_ids=split.eval_example_ids, seq_len=args.max_seq_len,
            micro_batch_size=batch["micro_batch_size"], grad_accum=batch["grad_accum"],
            saved_to=str(saved_to or ""), peak_memory=peak_memory.peaks(),
            memory_plan=checked.plan.memory.to_dict(), ranks=ranks,
            details={**({"lora": checked.tuning.record()} if checked.tuning.adapted else {}), **(details or {})},
            settings={k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
                      for k, v in checked.script_args.items()},
            finished_at=record.now(),
        ).write(checked.output / "run_info.json")
        cards = model_card.write(checked.output)
        evaluated = f"validation {describe_eval(final)}" if final else "no validation split"
        out = checked.output
        print(f"done: {steps} steps, {evaluated}, {rates.total_tokens:,} tokens trained "
              f"in this session, {f'{Path(saved_to).name} saved to {saved_to}' if saved_to else 'nothing saved'}\n"
              f"per-step loss, tokens/s and memory: {out / 'metrics.jsonl'}; run record: {out / 'run_record.json'}"
              + "".join(f"\nmodel card: {card}" for card in cards))
    # Every rank leaves the process group together, before the interpreter exits: a rank that tears
    # down its gloo connections while another still writes can die at exit with SIGABRT.
    acc.wait_for_everyone()
    acc.end_training()


def batch_shape(args) -> dict:
    """An accelerate recipe's batch and per-step levers, as :func:`finish` records them."""
    return {"micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum,
            "gradient_checkpointing": bool(args.gradient_checkpointing), "recompute_every": args.recompute_every,
            "compiled": bool(getattr(args, "compile", False)),
            **({"sequence_parallel": args.sequence_parallel} if getattr(args, "sequence_parallel", 1) > 1 else {}),
            **({"tiled_mlp": True} if getattr(args, "tiled_mlp", False) else {}),
            **({"fp8": args.fp8} if getattr(args, "fp8", "none") != "none" else {}),
            **({"cuda_alloc_conf": allocator} if (allocator := cuda_allocator.setting()) else {})}


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
