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
4-5 -> positive, 3 -> dropped (see finetune_kit.data.reviews). Outputs under --output:
checkpoints/step_N/ (resume with --resume), adapter/ (LoRA + head, for PeftModel.from_pretrained),
merged/ (with --merge), metrics.jsonl (one line per logged step: loss, tokens/s, TFLOP/s, MFU,
memory), run_record.json (throughput medians, peak memory next to the planner's prediction,
hardware and library versions: what results/ collects), run_info.json (data split, per-rank
shards, every validation, LoRA settings, the memory plan).
"""

from __future__ import annotations

# First: the package quiets a bitsandbytes warning that importing peft would print
from finetune_kit import TrainingRun, recipe_parser, run_main, save_adapter

# isort: split
from peft import LoraConfig
from torch.nn import functional as F
from torch.utils.data import DataLoader
from transformers import BitsAndBytesConfig

from finetune_kit import models
from finetune_kit.data import reviews
from finetune_kit.launch import multinode
from finetune_kit.models import qlora

RECIPE = "llama3-70b-qlora"
LAUNCH = ("'accelerate launch --config_file configs/zero3-main.yaml train.py ...' "
          "(configs/zero3-worker.yaml on the worker)")


def parse_args(argv=None):
    p = recipe_parser("Llama 3.3 70B QLoRA review-sentiment classifier, ZeRO-3.", examples="reviews",
                      model="meta-llama/Llama-3.3-70B-Instruct", output="out/llama3-70b-qlora", max_seq_len=512,
                      lr=1e-4, epochs=1, eval_fraction=0.1)
    p.add_argument("--data", nargs="+", required=True, help="one or more review CSV files")
    p.add_argument("--rating-column", default="rating")
    p.add_argument("--text-column", default="text")
    p.add_argument("--lora-rank", type=int, default=16, help="adapter rank r (memory grows linearly)")
    p.add_argument("--lora-alpha", type=int, default=32, help="adapter scale is alpha / r")
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--lora-targets", default="all-linear",
                   help="'all-linear' or comma-separated module names, e.g. q_proj,v_proj")
    p.add_argument("--dtype", default="bfloat16", help="compute and model dtype")
    p.add_argument("--quant-storage", default="bfloat16", help="container dtype of 4-bit weights (= --dtype)")
    p.add_argument("--device-map", default=None, help="not allowed under ZeRO-3 (checked)")
    p.add_argument("--merge", action="store_true",
                   help="also write merged/: base + adapter in --dtype (rank 0, ~2 bytes/param of host RAM)")
    p.add_argument("--rendezvous-timeout", type=float, default=300,
                   help="seconds to wait for the other node's ranks before failing")
    return p.parse_args(argv)


def preflight(argv=None):
    """Step 1: every check that needs no process group (seconds); raises UserInputError. Each rank
    runs it first; `python -m finetune_kit.check` runs it once before the launcher starts any."""
    args = parse_args(argv)
    qlora.check_zero3_settings(dtype=args.dtype, quant_storage=args.quant_storage, device_map=args.device_map)
    targets = qlora.parse_targets(args.lora_targets)
    run = TrainingRun.preflight(RECIPE, args, zero_stage=3, launch=LAUNCH, configs=": use configs/zero3.json.",
                                method="qlora", num_labels=len(reviews.LABELS),
                                adapter=qlora.adapter_plan(args.lora_rank, targets),
                                resume_must_match={"model": args.model,  # the 4-bit base is rebuilt from it
                                                   "lora": f"r {args.lora_rank}, alpha {args.lora_alpha}, "
                                                           f"targets {args.lora_targets}"})
    rows, counts = reviews.load_reviews(args.data, args.rating_column, args.text_column)
    return args, targets, run, rows, counts


def main(argv=None) -> None:
    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    args, targets, run, rows, counts = preflight(argv)

    # ---- 2. Distributed setup: the nodes agree on the job's shape, then the YAML + JSON drive everything ----
    multinode.handshake(args.rendezvous_timeout)
    accelerator = run.start()
    accelerator.print(f"reviews: {counts}")

    # ---- 3. Data: tokenise with truncation, pad per batch, hold out a validation split ----
    tokenizer = models.load_tokenizer(args.model)
    qlora.check_pad_token_fits(tokenizer, run.model_config, args.model)
    examples = reviews.tokenize(rows, tokenizer, args.max_seq_len)
    split = examples.train_test_split(test_size=args.eval_fraction, seed=args.seed)
    run.record_split(split["train"], split["test"])
    collate = reviews.ReviewCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    train_dl = DataLoader(split["train"], batch_size=args.micro_batch_size, shuffle=True, collate_fn=collate)
    eval_dl = DataLoader(split["test"], batch_size=args.micro_batch_size, collate_fn=collate)
    run.plan_steps(train_dl)

    # ---- 4. Model: nf4 base loaded shard by shard (zero.Init), LoRA + head trainable ----
    dtype = qlora.parse_dtype(args.dtype, "--dtype")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4",  # normal-float 4-bit: fits normally distributed weights
        bnb_4bit_use_double_quant=True,  # quantise the quantisation constants too: ~0.4 bit/param saved
        bnb_4bit_compute_dtype=dtype,  # matmuls run in this dtype after dequantising
        bnb_4bit_quant_storage=qlora.parse_dtype(args.quant_storage, "--quant-storage"))  # ZeRO-3: = --dtype
    model = qlora.load_quantized_classifier(args.model, quantization, pad_token_id=tokenizer.pad_token_id,
                                            dtype=dtype)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=targets, task_type="SEQ_CLS", bias="none",
                      modules_to_save=[qlora.HEAD])  # the new classification head trains in full
    model = qlora.add_lora(model, lora, gradient_checkpointing=args.gradient_checkpointing,
                           checkpoint_every=args.checkpoint_every)
    param_classes = qlora.parameter_classes(model)
    accelerator.print(f"parameters: {param_classes}")

    # ---- 5. Optimizer from the JSON ("auto" filled here) over LoRA + head, cosine schedule ----
    optimizer, scheduler = run.optimizer_and_schedule([p for p in model.parameters() if p.requires_grad])
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler)
    run.evaluate = lambda: reviews.evaluate_classifier(model, eval_dl, accelerator)
    run.eval_each_epoch = True
    # Not strict: the frozen 4-bit base is rebuilt from --model, not stored in the checkpoint;
    # LoRA and head come back from the ZeRO-3 optimizer partitions.
    run.resume(load_module_strict=False)

    # ---- 6. Train (frozen-base model FLOPs: 4N + 6N_trainable + 12LHQT); validation after each epoch ----
    model.train()
    for step in run.steps(train_dl, model, scheduler):  # one optimizer step: this rank's micro-batches, counted
        for batch in step.micro_batches:
            with accelerator.accumulate(model):
                labels = batch.pop("labels")
                with models.offload_activations(args.offload_activations):  # saved for backward: host RAM if asked
                    logits = model(**batch).logits
                # the reviews' losses, summed, over the labelled reviews of the whole step on all ranks: a short
                # last micro-batch weighs no more than a full one
                loss = F.cross_entropy(logits.float(), labels, reduction="sum") / step.labelled
                accelerator.backward(loss * step.backward_scale)  # undoes the mean over accumulation and ranks
                optimizer.step()  # DeepSpeed steps optimizer + schedule at the step's last micro-batch
                scheduler.step()
                optimizer.zero_grad()
            run.micro_batch_done(loss, batch)  # logs each optimizer step; validates after each epoch
        if run.checkpoint_due():  # every --save-every steps, the last step, or a stop signal (SIGTERM, SIGUSR1)
            run.save_checkpoint()  # checkpoints/step_N; after a stop signal the process exits 0 here

    # ---- 7. Save the adapter (gathered from the ZeRO-3 shards), write the run record ----
    adapter_dir = save_adapter(accelerator, model, tokenizer, run.output / "adapter") if args.save_model else None
    run.finish(model, saved_to=adapter_dir, details={
        "data_counts": counts, "parameter_classes": param_classes,
        "lora": {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                 "targets": args.lora_targets}})

    # ---- 8. Optional: merged export (one process, outside ZeRO-3) ----
    if args.merge and adapter_dir and accelerator.is_main_process:
        merged = qlora.merge_adapter(args.model, adapter_dir, run.output / "merged", dtype=dtype)
        print(f"merged model saved to {merged}")


if __name__ == "__main__":
    run_main(main)  # bad input or a lost rank: one line saying what to do, exit status 1
