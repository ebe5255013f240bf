"""Instruction fine-tuning of Llama 3 8B (full weights) with DeepSpeed ZeRO-3 and accelerate.

Hardware: one node with 8 x 80 GB GPUs (configs/zero3.yaml), or one 80 GB GPU with about
120 GB of host RAM for the offloaded optimizer (configs/zero3-offload.yaml).

Launch from this folder:

    accelerate launch --config_file configs/zero3.yaml train.py \\
        --model meta-llama/Meta-Llama-3-8B --data my_data.jsonl --output out/llama3-8b

    # one GPU, optimizer states in CPU memory:
    accelerate launch --config_file configs/zero3-offload.yaml train.py --data my_data.jsonl

Data: JSONL/CSV rows (or a hub dataset) with "prompt" and "response" fields. Outputs
under --output: checkpoints/step_N/ (resume with --resume), model/ (consolidated bf16
safetensors + tokenizer), metrics.jsonl (one line per logged step: loss, tokens/s, TFLOP/s,
MFU, memory; also TensorBoard when installed), run_record.json (throughput medians, peak
memory, hardware and library versions: what results/ collects), run_info.json.
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

from finetune_kit import architectures, checkpoints, data, launch_checks, memory, models, run_record
from finetune_kit.distributed import make_accelerator, partition_report
from finetune_kit.errors import ConfigError, UserInputError
from finetune_kit.evaluation import evaluate_loss
from finetune_kit.flops import FlopCounter
from finetune_kit.step_report import StepReport
from finetune_kit.throughput import peak_memory_all_ranks, peak_memory_gib


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Llama 3 8B instruction fine-tune with ZeRO-3.")
    p.add_argument("--model", default="meta-llama/Meta-Llama-3-8B", help="hub id or local folder")
    p.add_argument("--data", required=True, help=".jsonl/.json/.csv file or hub dataset name")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--response-field", default="response")
    p.add_argument("--output", default="out/llama3-8b-zero3", help="run folder")
    p.add_argument("--max-seq-len", type=int, default=2048, help="tokens; longer examples are truncated")
    p.add_argument("--pack", action="store_true", help="pack several examples per sequence")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per GPU per forward")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03, help="fraction of steps warming up")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of rows held out")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                   help="keep all activations (faster, much more memory)")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N optimizer steps")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="newest N kept (0: all)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the newest checkpoint in --output, or from a given folder")
    p.add_argument("--log-every", type=int, default=1, help="optimizer steps between log lines")
    p.add_argument("--meter-warmup-steps", type=int, default=3,
                   help="first optimizer steps left out of the run record's throughput medians")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--skip-memory-check", action="store_true",
                   help="launch even if the memory planner predicts the run does not fit the GPUs")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    output = Path(args.output)

    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    model_config = models.load_config(args.model)
    models.check_seq_len(args.max_seq_len, model_config, args.model)
    ds_path, ds_config = launch_checks.launched_zero_config(
        3, launch="'accelerate launch --config_file configs/zero3.yaml train.py ...'",
        configs=". Use configs/zero3.json or zero3-offload.json.")
    launch_checks.check_batch_sizes(ds_config, micro_batch_size=args.micro_batch_size,
                                    grad_accum=args.grad_accum, world=launch_checks.world_size(),
                                    source=str(ds_path))
    memory_plan = memory.preflight(model_config, ds_config, world_size=launch_checks.world_size(),
                                   micro_batch=args.micro_batch_size, seq_len=args.max_seq_len,
                                   gradient_checkpointing=args.gradient_checkpointing, skip=args.skip_memory_check)
    rows = data.load_rows(args.data, args.prompt_field, args.response_field)
    resume_from = checkpoints.resolve_resume(args.resume, output)

    # ---- 2. Distributed setup: the accelerate YAML + DeepSpeed JSON drive everything ----
    accelerator = make_accelerator(
        gradient_accumulation_steps=args.grad_accum,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # exact resume
    )
    set_seed(args.seed)
    world = accelerator.num_processes
    accelerator.print(f"world size {world}, device {accelerator.device}, ZeRO stage 3, config {ds_path}")

    # ---- 3. Data: tokenise with the prompt masked, hold out a validation split ----
    tokenizer = models.load_tokenizer(args.model)
    with accelerator.main_process_first():
        examples = data.tokenize_rows(rows, tokenizer, args.max_seq_len, args.prompt_field,
                                      args.response_field, source=args.data)
    n_eval = max(1, round(len(examples) * args.eval_fraction)) if args.eval_fraction > 0 else 0
    split = examples.train_test_split(test_size=n_eval, seed=args.seed) if n_eval else None
    train_set = split["train"] if split else examples
    if args.pack:
        train_set = data.pack(train_set, args.max_seq_len)
    collate = data.PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    train_dl = DataLoader(train_set, batch_size=args.micro_batch_size, shuffle=True, collate_fn=collate)
    eval_dl = DataLoader(split["test"], batch_size=args.micro_batch_size, collate_fn=collate) if split else None
    steps_per_epoch = math.ceil(len(train_dl) / world) // args.grad_accum
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_set)} training sequences make no full optimizer step of "
                          f"{args.micro_batch_size} x {args.grad_accum} x {world} processes; "
                          "lower --micro-batch-size or --grad-accum, or add data.")
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    # ---- 4. Model: built inside deepspeed.zero.Init, each rank holds only its shard ----
    model = models.load_causal_lm(args.model)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # only if a <pad> token had to be added
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False

    # ---- 5. Optimizer from the JSON ("auto" filled here), cosine schedule with warm-up ----
    optimizer = DummyOptim(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    warmup = math.ceil(args.warmup_ratio * total_steps)
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: get_cosine_schedule_with_warmup(
        opt, num_warmup_steps=warmup, num_training_steps=total_steps))
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0}
    if resume_from is not None:
        state = checkpoints.load_checkpoint(accelerator, resume_from)
        accelerator.print(f"resumed from {resume_from} at step {state['step']}")

    # ---- 6. Train: real tokens, model FLOPs (6N + 12LHQT per token) and memory per step ----
    arch = architectures.from_config(model_config)
    report = StepReport(accelerator, FlopCounter(arch), output, total_steps=total_steps, initial_step=state["step"],
                        grad_accum=args.grad_accum, log_every=args.log_every)
    seen_ids: list[int] = []  # rows this rank trained on, for the run record
    model.train()
    while state["step"] < total_steps:
        train_dl.set_epoch(state["epoch"])
        batches = accelerator.skip_first_batches(train_dl, state["batch_in_epoch"])
        for batch in batches:
            seen_ids.extend(i for ids in batch.pop("example_ids") for i in ids)
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
            if done_epoch:
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
            if state["step"] % args.save_every == 0 or state["step"] == total_steps:
                path = checkpoints.save_checkpoint(accelerator, output, state["step"], state,
                                                   keep=args.keep_checkpoints)
                accelerator.print(f"\ncheckpoint saved: {path}")
                report.meter.reset_clock()
            if done_epoch or state["step"] >= total_steps:
                break
    report.close()

    # ---- 7. Evaluate, save the consolidated model, write the run record ----
    eval_loss = evaluate_loss(model, eval_dl, accelerator) if eval_dl is not None else None
    model_dir = checkpoints.save_consolidated(accelerator, model, tokenizer, output / "model")
    shards = gather_object([{"rank": accelerator.process_index,
                                         "example_ids": seen_ids,
                                         "params": partition_report(model)}])
    peaks = peak_memory_all_ranks(accelerator)
    if accelerator.is_main_process:
        record = run_record.for_training_run(
            recipe="llama3-8b-zero3", model_name=args.model, arch=arch, flop_counter=report.tally.flop_counter,
            params_trainable=shards[0]["params"]["total"], ds_config=ds_config,
            script_args={k: v for k, v in vars(args).items() if k not in ("output", "resume")},
            world=world, nodes=launch_checks.num_nodes(), meter=report.meter, warmup_steps=args.meter_warmup_steps,
            peaks=peaks, where=Path(__file__).parent, predicted_gpu_GiB=memory_plan.gpu_bytes / 2**30,
            training={"method": "full", "seq_len": args.max_seq_len, "micro_batch_size": args.micro_batch_size,
                      "grad_accum": args.grad_accum, "gradient_checkpointing": args.gradient_checkpointing,
                      "packing": args.pack})
        record.write(output / "run_record.json")
        run_info = {
            "recipe": "llama3-8b-zero3", "model": args.model, "world_size": world,
            "zero_stage": model.zero_optimization_stage(), "deepspeed_config": str(ds_path),
            "steps": state["step"], "total_steps": total_steps, "resumed_from": str(resume_from or ""),
            "eval_loss": eval_loss, "train_sequences": len(train_set),
            "eval_example_ids": [i for ids in split["test"]["example_ids"] for i in ids] if split else [],
            "max_seq_len": args.max_seq_len, "micro_batch_size": args.micro_batch_size,
            "grad_accum": args.grad_accum, "model_dir": str(model_dir),
            "peak_memory_rank0": peak_memory_gib(), "memory_plan": memory_plan.to_dict(), "ranks": shards,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (output / "run_info.json").write_text(json.dumps(run_info, indent=2))
        eval_text = f"{eval_loss:.4f}" if eval_loss is not None else "n/a"
        print(f"done: {state['step']} steps, validation loss {eval_text}, "
              f"{report.meter.total_tokens:,} tokens trained in this session, model saved to {model_dir}\n"
              f"per-step loss, tokens/s and memory: {report.log.path}; run record: {output / 'run_record.json'}")
    accelerator.end_training()


if __name__ == "__main__":
    try:
        main()
    except UserInputError as err:
        sys.exit(f"error: {err}")
