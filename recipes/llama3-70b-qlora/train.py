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

Data: CSV files with a star ``rating`` (1-5) and the review ``text``; 1-2 stars -> negative,
4-5 -> positive, 3 -> dropped (see finetune_kit.reviews). Outputs under --output:
checkpoints/step_N/ (resume with --resume), adapter/ (LoRA + head, for PeftModel.from_pretrained),
merged/ (with --merge), metrics.jsonl (one line per logged step: loss, tokens/s, TFLOP/s, MFU,
memory), run_record.json (throughput medians, peak memory next to the planner's prediction,
hardware and library versions: what results/ collects), run_info.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from accelerate.utils import DataLoaderConfiguration, DummyOptim, DummyScheduler, gather_object, set_seed
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

from finetune_kit import (
    architectures,
    checkpoints,
    launch_checks,
    memory,
    models,
    multinode,
    qlora,
    reviews,
    run_record,
)
from finetune_kit.distributed import make_accelerator, on_cpu_only, partition_report
from finetune_kit.errors import ConfigError, UserInputError
from finetune_kit.flops import FlopCounter
from finetune_kit.step_report import StepReport
from finetune_kit.throughput import peak_memory_all_ranks, peak_memory_gib


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Llama 3.3 70B QLoRA review-sentiment classifier, ZeRO-3.")
    p.add_argument("--model", default="meta-llama/Llama-3.3-70B-Instruct", help="hub id or local folder")
    p.add_argument("--data", nargs="+", required=True, help="one or more review CSV files")
    p.add_argument("--rating-column", default="rating")
    p.add_argument("--text-column", default="text")
    p.add_argument("--output", default="out/llama3-70b-qlora", help="run folder (shared by both nodes)")
    p.add_argument("--max-seq-len", type=int, default=512, help="tokens; longer reviews are truncated")
    p.add_argument("--micro-batch-size", type=int, default=4, help="reviews per GPU per forward")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03, help="fraction of steps warming up")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="share of reviews held out")
    p.add_argument("--lora-rank", type=int, default=16, help="adapter rank r (memory grows linearly)")
    p.add_argument("--lora-alpha", type=int, default=32, help="adapter scale is alpha / r")
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--lora-targets", default="all-linear",
                   help="'all-linear' or comma-separated module names, e.g. q_proj,v_proj")
    p.add_argument("--dtype", default="bfloat16", help="compute and model dtype")
    p.add_argument("--quant-storage", default="bfloat16", help="container dtype of 4-bit weights (= --dtype)")
    p.add_argument("--device-map", default=None, help="not allowed under ZeRO-3 (checked)")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                   help="keep all activations (faster, much more memory)")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N optimizer steps")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="newest N kept (0: all)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the newest checkpoint in --output, or from a given folder")
    p.add_argument("--merge", action="store_true",
                   help="also write merged/: base + adapter in --dtype (rank 0, ~2 bytes/param of host RAM)")
    p.add_argument("--rendezvous-timeout", type=float, default=300,
                   help="seconds to wait for the other node's ranks before failing")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="launch even if the memory planner predicts the run does not fit the GPUs")
    p.add_argument("--log-every", type=int, default=1, help="optimizer steps between log lines")
    p.add_argument("--meter-warmup-steps", type=int, default=3,
                   help="first optimizer steps left out of the run record's throughput medians")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    output = Path(args.output)

    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    model_config = models.load_config(args.model)
    models.check_seq_len(args.max_seq_len, model_config, args.model)
    ds_path, ds_config = launch_checks.launched_zero_config(
        3, launch="'accelerate launch --config_file configs/zero3-main.yaml train.py ...' "
        "(configs/zero3-worker.yaml on the worker)", configs=": use configs/zero3.json.")
    qlora.check_zero3_settings(zero3=True, dtype=args.dtype, quant_storage=args.quant_storage,
                               device_map=args.device_map)
    launch_checks.check_batch_sizes(ds_config, micro_batch_size=args.micro_batch_size,
                                    grad_accum=args.grad_accum, world=launch_checks.world_size(),
                                    source=str(ds_path))
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    memory_plan = memory.preflight(
        model_config, ds_config, world_size=launch_checks.world_size(), micro_batch=args.micro_batch_size,
        seq_len=args.max_seq_len, gradient_checkpointing=args.gradient_checkpointing, num_labels=len(reviews.LABELS),
        adapter=memory.Adapter(rank=args.lora_rank, targets=targets if targets == "all-linear" else tuple(targets)),
        skip=args.skip_memory_check)
    rows, counts = reviews.load_reviews(args.data, args.rating_column, args.text_column)
    resume_from = checkpoints.resolve_resume(args.resume, output)

    # ---- 2. Distributed setup: the nodes agree on the job's shape, then the YAML + JSON drive everything ----
    launch = multinode.handshake(args.rendezvous_timeout)
    accelerator = make_accelerator(
        gradient_accumulation_steps=args.grad_accum,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # exact resume
    )
    set_seed(args.seed)
    world = accelerator.num_processes
    accelerator.print(f"world size {world}, device {accelerator.device}, ZeRO stage 3, config {ds_path}")
    accelerator.print(f"reviews: {counts}")

    # ---- 3. Data: tokenise with truncation, pad per batch, hold out a validation split ----
    tokenizer = models.load_tokenizer(args.model)
    if len(tokenizer) > model_config.vocab_size:
        raise ConfigError(f"tokenizer of '{args.model}' has no pad token to reuse; a 4-bit base cannot grow "
                          "its embeddings. Use a Llama 3.1+ tokenizer (it has <|finetune_right_pad_id|>).")
    examples = reviews.tokenize(rows, tokenizer, args.max_seq_len)
    split = examples.train_test_split(test_size=args.eval_fraction, seed=args.seed)
    train_set, eval_set = split["train"], split["test"]
    collate = reviews.ReviewCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    train_dl = DataLoader(train_set, batch_size=args.micro_batch_size, shuffle=True, collate_fn=collate)
    eval_dl = DataLoader(eval_set, batch_size=args.micro_batch_size, collate_fn=collate)
    steps_per_epoch = math.ceil(len(train_dl) / world) // args.grad_accum
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_set)} training reviews make no full optimizer step of "
                          f"{args.micro_batch_size} x {args.grad_accum} x {world} processes; "
                          "lower --micro-batch-size or --grad-accum, or add data.")
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    # ---- 4. Model: nf4 base loaded shard by shard (zero.Init), LoRA + head trainable ----
    dtype = qlora.parse_dtype(args.dtype, "--dtype")
    model = qlora.load_quantized_classifier(args.model, pad_token_id=tokenizer.pad_token_id, dtype=dtype,
                                            quant_storage=qlora.parse_dtype(args.quant_storage, "--quant-storage"))
    model = qlora.add_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                           target_modules=targets, gradient_checkpointing=args.gradient_checkpointing)
    if on_cpu_only():
        qlora.keep_cpu_weights_unpacked(model)  # CPU test runs only: see the function's docstring
    param_classes = qlora.parameter_classes(model)
    accelerator.print(f"parameters: {param_classes}")

    # ---- 5. Optimizer from the JSON ("auto" filled here) over LoRA + head, cosine schedule ----
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = DummyOptim(trainable, lr=args.lr, weight_decay=args.weight_decay)
    warmup = math.ceil(args.warmup_ratio * total_steps)
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: get_cosine_schedule_with_warmup(
        opt, num_warmup_steps=warmup, num_training_steps=total_steps))
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0}
    if resume_from is not None:
        # Not strict: the frozen 4-bit base is rebuilt from --model, not stored in the
        # checkpoint; LoRA and head come back from the ZeRO-3 optimizer partitions.
        state = checkpoints.load_checkpoint(accelerator, resume_from, load_module_strict=False)
        accelerator.print(f"resumed from {resume_from} at step {state['step']}")

    # ---- 6. Train (frozen-base model FLOPs: 4N + 6N_trainable + 12LHQT); validation after each epoch ----
    arch = architectures.from_config(model_config)
    n_trainable = param_classes["lora_trainable"] + param_classes["head_trainable"]
    flop_counter = FlopCounter(arch, num_labels=len(reviews.LABELS), trainable=n_trainable, head_trainable=True)
    report = StepReport(accelerator, flop_counter, output, total_steps=total_steps, initial_step=state["step"],
                        grad_accum=args.grad_accum, log_every=args.log_every)
    seen_ids: list[int] = []  # reviews this rank trained on, for the run record
    evals: list[dict] = []
    model.train()
    while state["step"] < total_steps:
        train_dl.set_epoch(state["epoch"])
        batches = accelerator.skip_first_batches(train_dl, state["batch_in_epoch"])
        for batch in batches:
            seen_ids.extend(batch.pop("example_ids"))
            lr = scheduler.get_last_lr()[0]  # the rate this step trains with
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)  # DeepSpeed steps optimizer + schedule at the boundary
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            report.micro_batch(loss, batch["attention_mask"])
            state["batch_in_epoch"] += 1
            if not accelerator.sync_gradients:
                continue
            state["step"] += 1
            report.optimizer_step(state["step"], state["epoch"], lr)
            done_epoch = state["batch_in_epoch"] >= steps_per_epoch * args.grad_accum
            if done_epoch or state["step"] == total_steps:
                result = {"step": state["step"], "epoch": state["epoch"],
                          **reviews.evaluate_classifier(model, eval_dl, accelerator)}
                evals.append(result)
                accelerator.print(f"\nvalidation after step {state['step']}: loss {result['eval_loss']:.4f}, "
                                  f"accuracy {result['eval_accuracy']:.3f} ({result['eval_reviews']} reviews)")
            if done_epoch:
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
            if state["step"] % args.save_every == 0 or state["step"] == total_steps:
                path = checkpoints.save_checkpoint(accelerator, output, state["step"], state,
                                                   keep=args.keep_checkpoints)
                accelerator.print(f"\ncheckpoint saved: {path}")
            report.meter.reset_clock()  # evaluation and saving are not training time
            if done_epoch or state["step"] >= total_steps:
                break
    report.close()

    # ---- 7. Save the adapter (gathered from the ZeRO-3 shards), write the run record ----
    adapter_dir = qlora.save_adapter(accelerator, model, tokenizer, output / "adapter")
    shards = gather_object([{"rank": accelerator.process_index, "machine_rank": launch["machine_rank"],
                             "world_size": accelerator.num_processes, "example_ids": seen_ids,
                             "params": partition_report(model)}])
    peaks = peak_memory_all_ranks(accelerator)
    if accelerator.is_main_process:
        record = run_record.for_training_run(
            recipe="llama3-70b-qlora", model_name=args.model, arch=arch, flop_counter=flop_counter,
            params_trainable=n_trainable, ds_config=ds_config,
            script_args={k: v for k, v in vars(args).items() if k not in ("output", "resume")},
            world=world, nodes=launch["num_machines"], meter=report.meter, warmup_steps=args.meter_warmup_steps,
            peaks=peaks, where=Path(__file__).parent, predicted_gpu_GiB=memory_plan.gpu_bytes / 2**30,
            training={"method": "qlora", "seq_len": args.max_seq_len, "micro_batch_size": args.micro_batch_size,
                      "grad_accum": args.grad_accum, "gradient_checkpointing": args.gradient_checkpointing})
        record.write(output / "run_record.json")
        final = evals[-1] if evals else {}
        run_info = {
            "recipe": "llama3-70b-qlora", "model": args.model, "world_size": world,
            "zero_stage": model.zero_optimization_stage(), "deepspeed_config": str(ds_path),
            "steps": state["step"], "total_steps": total_steps, "resumed_from": str(resume_from or ""),
            "eval_loss": final.get("eval_loss"), "eval_accuracy": final.get("eval_accuracy"), "evals": evals,
            "data_counts": counts, "train_reviews": len(train_set), "eval_example_ids": list(eval_set["example_id"]),
            "max_seq_len": args.max_seq_len, "micro_batch_size": args.micro_batch_size,
            "grad_accum": args.grad_accum, "lora": {"rank": args.lora_rank, "alpha": args.lora_alpha,
                                                    "dropout": args.lora_dropout, "targets": args.lora_targets},
            "parameter_classes": param_classes, "adapter_dir": str(adapter_dir),
            "peak_memory_rank0": peak_memory_gib(), "memory_plan": memory_plan.to_dict(), "ranks": shards,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (output / "run_info.json").write_text(json.dumps(run_info, indent=2))
        print(f"done: {state['step']} steps, validation loss {final.get('eval_loss', float('nan')):.4f}, "
              f"accuracy {final.get('eval_accuracy', float('nan')):.3f}, "
              f"{report.meter.total_tokens:,} tokens trained in this session, adapter saved to {adapter_dir}\n"
              f"per-step loss, tokens/s and memory: {report.log.path}; run record: {output / 'run_record.json'}")
    accelerator.end_training()

    # ---- 8. Optional: merged export (one process, outside ZeRO-3) ----
    if args.merge and accelerator.is_main_process:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # a plain load on rank 0, not a partitioned one
        merged = qlora.merge_adapter(args.model, adapter_dir, output / "merged", dtype=dtype)
        print(f"merged model saved to {merged}")


if __name__ == "__main__":
    try:
        main()
    except UserInputError as err:
        sys.exit(f"error: {err}")
