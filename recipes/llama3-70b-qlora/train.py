"""Sentiment classification of product reviews with Llama 3.3 70B: QLoRA on two nodes.

4-bit nf4 base (bitsandbytes, frozen) + LoRA adapters and a classification head (PEFT),
DeepSpeed ZeRO-3 over 2 nodes x 4 GPUs (80 GB H100), orchestrated by accelerate.

Launch from this folder on both nodes at the same time (shared model/data paths, e.g. NFS):

    # main node (10.0.0.1)
    accelerate launch --config_file configs/zero3-main.yaml --main_process_ip 10.0.0.1 train.py \\
        --model /nfs/models/Llama-3.3-70B-Instruct --data /nfs/data/reviews.csv --output /nfs/runs/70b
    # worker node
    accelerate launch --config_file configs/zero3-worker.yaml --main_process_ip 10.0.0.1 train.py \\
        --model /nfs/models/Llama-3.3-70B-Instruct --data /nfs/data/reviews.csv --output /nfs/runs/70b

Data: CSV files with a star ``rating`` (1-5) and the review ``text``; 1-2 stars -> negative, 4-5 -> positive,
3 -> dropped (finetune_kit.data.reviews). Outputs under --output: checkpoints/step_N/, adapter/ (LoRA + head,
for PeftModel), merged/ (--merge: base + adapter in 16-bit, for transformers or vLLM), each with its model card,
heldout.jsonl (for `make eval`), metrics.jsonl (per step: loss, tokens/s, MFU, memory), run_record.json (what
results/ collects), run_info.json (data split, shards, validations, LoRA settings, the memory plan).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# First: the package quiets a bitsandbytes warning that importing peft would print
from finetune_kit import losses, models, run_main, training

# isort: split
from torch.utils.data import DataLoader

from finetune_kit.data import reviews
from finetune_kit.models import adapters, qlora

RECIPE = "llama3-70b-qlora"
LAUNCH = "'accelerate launch --config_file configs/zero3-main.yaml train.py ...' (zero3-worker.yaml on the worker)"
flag = training.flag


@dataclass
class Arguments(training.ModelArguments, training.Adapters, training.LoopArguments):
    """The shared families (training/arguments.py: the adapters' too) and this recipe's own: reviews, dtype, nodes."""

    data: list[str] = flag(None, "one or more review CSV files", nargs="+")
    rating_column: str = flag("rating", "the CSV column of the 1-5 star rating")
    text_column: str = flag("text", "the CSV column of the review text")
    eval_fraction: float = flag(0.1, "share of the reviews held out for validation")
    offload_activations: bool = flag(False, "the tensors saved for backward in pinned host memory: less GPU memory")
    dtype: str = flag("bfloat16", "compute and model dtype")
    device_map: str = flag(None, "not allowed under ZeRO-3 (checked)")
    rendezvous_timeout: float = flag(300, "seconds to wait for the other node's ranks before failing")


def parse_args(argv=None) -> Arguments:
    return training.parse(Arguments, argv, description="Llama 3.3 70B QLoRA review-sentiment classifier, ZeRO-3.",
                          model="meta-llama/Llama-3.3-70B-Instruct", output="out/llama3-70b-qlora", max_seq_len=512,
                          lr=1e-4, epochs=1, peft="qlora")


def check_inputs(argv=None):
    """Step 1: every check that needs no process group (seconds); raises UserInputError. Each rank
    runs it first; `python -m finetune_kit.check` runs it once before the launcher starts any."""
    args = parse_args(argv)
    qlora.check_zero3_settings(dtype=args.dtype, device_map=args.device_map)
    # --peft qlora (nf4, double quantization, --dtype compute and storage) or lora: the flags, checked, decided once
    tuning = adapters.decide(args, recipe=RECIPE, dtype=args.dtype, allowed=("lora", "qlora"))
    checked = training.for_accelerate(RECIPE, args, zero_stage=3, launch=LAUNCH, configs=": use configs/zero3.json.",
                                      tuning=tuning, num_labels=len(reviews.LABELS),  # a 4-bit folder: its settings
                                      resume_must_match={"model": args.model})  # the frozen base is rebuilt from it
    args = replace(args, **checked.plan.flags)  # the split and levers as decided (--levers auto: its pick)
    rows, counts = reviews.load_reviews(args.data, args.rating_column, args.text_column)
    return args, checked, rows, counts


def quantized_classifier_with_lora(args, checked, tokenizer):
    """What trains: the base (4-bit, quantized as it loads or a 4-bit folder as saved; --peft lora: 16-bit), LoRA,
    and a new head trained in full."""
    model = qlora.load_quantized_classifier(args.model, checked.quantization, pad_token_id=tokenizer.pad_token_id,
                                            dtype=args.dtype)
    if args.gradient_checkpointing:  # non-reentrant: works with frozen inputs and ZeRO-3's parameter hooks
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=args.recompute_every)
    return adapters.wrap(model, checked.tuning, task_type="SEQ_CLS", modules_to_save=[qlora.HEAD])


def main(argv=None) -> None:
    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    args, checked, rows, counts = check_inputs(argv)

    # ---- 2. Distributed setup: the nodes agree on the job's shape and launch plan, then the YAML + JSON drive it ----
    accelerator = training.start(checked, args, rendezvous_timeout=args.rendezvous_timeout)
    stop = training.StopSignal(accelerator)  # SIGTERM, SIGINT, Slurm's SIGUSR1: stop after the step, with a checkpoint
    accelerator.print(f"reviews: {counts}")

    # ---- 3. Data: tokenise with truncation, pad per batch, hold out a validation split ----
    tokenizer = models.load_tokenizer(args.model)
    qlora.check_pad_token_fits(tokenizer, checked.model_config, args.model)
    examples = reviews.tokenize(rows, tokenizer, args.max_seq_len)
    held_out = examples.train_test_split(test_size=args.eval_fraction, seed=args.seed)
    split = training.DataSplit.of(held_out["train"], held_out["test"], rows=rows)  # sizes, and the held-out rows
    collate = reviews.ReviewCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    train_dl = DataLoader(held_out["train"], batch_size=args.micro_batch_size, shuffle=True, collate_fn=collate)
    eval_dl = DataLoader(held_out["test"], batch_size=args.micro_batch_size, collate_fn=collate)
    schedule = training.Schedule.plan(len(held_out["train"]), args, checked.data_ranks)

    # ---- 4. Model: nf4 base loaded shard by shard (zero.Init), LoRA + head trainable ----
    model = quantized_classifier_with_lora(args, checked, tokenizer)
    param_classes = qlora.parameter_classes(model)
    accelerator.print(f"parameters: {param_classes}")

    # ---- 5. Optimizer from the JSON ("auto" filled here) over LoRA + head, cosine schedule ----
    optimizer, scheduler = training.optimizer_and_schedule(model.parameters(), checked, args, schedule.total_steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)
    with training.hold_output(checked.output, accelerator.is_main_process):  # --output is this run's to its end
        checkpointer = training.Checkpointer(accelerator, checked, args)  # resumes; saves finite steps when due
        # Not strict: the frozen 4-bit base is rebuilt from --model, not stored in the checkpoint;
        # LoRA and head come back from the ZeRO-3 optimizer partitions.
        start = checkpointer.resume(load_module_strict=False)
        meter = training.step_meter(accelerator, checked, model, args, schedule.total_steps, start)

        # ---- 6. Train (frozen-base model FLOPs: 4N_frozen + 6N_trainable + 12LHQT); validation after each epoch ----
        model.train()
        evals = []
        for step in training.steps(accelerator, train_dl, scheduler, schedule, start):  # micro-batches, counted
            for batch in step.micro_batches:
                with accelerator.accumulate(model):
                    labels = batch.pop("labels")
                    with models.offload_activations(args.offload_activations):  # saved for backward: host RAM if asked
                        logits = model(**batch).logits
                    # summed over these reviews / the labelled reviews of the whole step on all ranks (short ones too)
                    loss = losses.classifier_loss(logits, labels, step.labelled)
                    accelerator.backward(loss * step.backward_scale)  # undoes the mean over accumulation and ranks
                    optimizer.step()  # DeepSpeed steps optimizer + schedule at the step's last micro-batch (a NaN/Inf
                    scheduler.step()  # gradient it discards itself: training/nonfinite.py)
                    optimizer.zero_grad()
                meter.micro_batch(loss, batch)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), training.max_grad_norm(checked))  # DeepSpeed's
            record = meter.step(step, grad_norm)  # metrics.jsonl every --log-every steps: loss, grad norm, tokens/s
            if step.ends_epoch or step.last:  # validation: loss and accuracy on the held-out reviews
                evals.append(training.validation(step, reviews.evaluate_classifier(model, eval_dl, accelerator),
                                                 accelerator))
            stopping = stop.agreed()  # did a stop signal reach any rank?
            saved = checkpointer.save(step, record, stopping=stopping)  # when due; never a NaN/Inf step's
            if stopping:
                return training.stopped(accelerator, checked, stop, step, schedule.total_steps, saved, meter)

        # ---- 7. Save the adapter (gathered from the ZeRO-3 shards), write the run record ----
        adapter_dir = training.save_adapter(accelerator, model, tokenizer, checked.output / "adapter") \
            if args.save_model else None
        training.finish(accelerator, checked, args, model, meter, steps=step.number, total_steps=schedule.total_steps,
                        split=split, evals=evals, saved_to=adapter_dir, batch=training.batch_shape(args),
                        details={"data_counts": counts, "parameter_classes": param_classes})

    # ---- 8. Optional: merged export (one process, outside ZeRO-3): the base in --dtype, the adapter merged in ----
    if args.merge and accelerator.is_main_process:
        training.save_merged(checked, adapter_dir, dtype=args.dtype, labels=reviews.LABELS)


if __name__ == "__main__":
    run_main(main)  # bad input or a lost rank: one line saying what to do, exit status 1
