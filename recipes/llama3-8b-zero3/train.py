"""Instruction fine-tuning of Llama 3 8B (full weights) with DeepSpeed ZeRO-3 and accelerate.

Hardware: one node with 8 x 80 GB GPUs (configs/zero3.yaml), or one 80 GB GPU with about
120 GB of host RAM for the offloaded optimizer (configs/zero3-offload.yaml).

Launch from this folder:

    accelerate launch --config_file configs/zero3.yaml train.py \\
        --model meta-llama/Meta-Llama-3-8B --data my_data.jsonl --output out/llama3-8b

    # one GPU, optimizer states in CPU memory:
    accelerate launch --config_file configs/zero3-offload.yaml train.py --data my_data.jsonl

    # the same script under PyTorch FSDP2 instead of DeepSpeed (README: "ZeRO-3 or FSDP2?"):
    accelerate launch --config_file configs/fsdp2.yaml train.py --data my_data.jsonl

Data: JSONL/CSV rows (or a hub dataset) in any of the formats the README lists: chat "messages",
ShareGPT, Alpaca, prompt/completion, prompt/response; the loss is on the assistant's turns. Outputs
under --output: checkpoints/step_N/ (resume with --resume), model/ (consolidated bf16
safetensors + tokenizer), metrics.jsonl (one line per logged step: loss, tokens/s, TFLOP/s,
MFU, memory; also to TensorBoard, W&B or MLflow with --report-to), run_record.json (throughput medians, peak
memory, hardware and library versions: what results/ collects), run_info.json (data split,
per-rank shards, validation, the memory plan). FINETUNE_METRICS_PORT=9450 in the environment
serves live Prometheus metrics from every rank (port 9450 + local rank).
"""

from __future__ import annotations

from torch.utils.data import DataLoader

from finetune_kit import TrainingRun, data, evaluate_loss, models, recipe_parser, run_main, save_consolidated

RECIPE = "llama3-8b-zero3"
LAUNCH = "'accelerate launch --config_file configs/zero3.yaml train.py ...'"


def parse_args(argv=None):
    p = recipe_parser("Llama 3 8B instruction fine-tune with ZeRO-3.", model="meta-llama/Meta-Llama-3-8B",
                      output="out/llama3-8b-zero3", max_seq_len=2048, lr=2e-5, epochs=3, eval_fraction=0.05,
                      instruction_data=True)
    return p.parse_args(argv)


def preflight(argv=None):
    """Step 1: every check that needs no process group (seconds); raises UserInputError. Each rank
    runs it first; `python -m finetune_kit.check` runs it once before the launcher starts any."""
    args = parse_args(argv)
    run = TrainingRun.preflight(RECIPE, args, zero_stage=3, launch=LAUNCH,
                                configs=". Use configs/zero3.json or zero3-offload.json (or configs/fsdp2.yaml).")
    rows = data.load_rows(args.data, args.data_format, args.prompt_field, args.response_field)
    return args, run, rows


def main(argv=None) -> None:
    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    args, run, rows = preflight(argv)

    # ---- 2. Distributed setup: the accelerate YAML (+ DeepSpeed JSON, or FSDP2) drives everything ----
    accelerator = run.start()

    # ---- 3. Data: chat template, loss on the assistant's turns, a held-out validation split ----
    tokenizer = models.load_tokenizer(args.model)
    with accelerator.local_main_process_first():  # one process per node tokenises, or reads --data-cache
        examples, counts = data.tokenize_rows(rows, tokenizer, args.max_seq_len, args.chat_template,
                                              cache=args.data_cache, workers=args.data_workers)
    train_set, eval_set = data.holdout_split(examples, args.eval_fraction, args.seed)
    if args.pack:  # whole examples per sequence, attention kept inside each
        train_set = data.pack(train_set, args.max_seq_len)
    run.record_split(train_set, eval_set, counts)
    pad = data.PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    train_dl = DataLoader(train_set, batch_size=args.micro_batch_size, shuffle=True,
                          collate_fn=data.PackedCollator() if args.pack else pad)
    eval_dl = DataLoader(eval_set, batch_size=args.micro_batch_size, collate_fn=pad) if eval_set else None
    run.plan_steps(train_dl)

    # ---- 4. Model: ZeRO-3 builds it inside deepspeed.zero.Init (FSDP2: loaded on rank 0 only) ----
    model = models.load_causal_lm(args.model, models.attention_for(args.attention, packed=args.pack))
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # only if a <pad> token had to be added
    model.config.use_cache = False  # no KV cache in training (packed sequences need its absence)
    models.use_chunked_loss(model, args.loss_chunks, args.loss_kernel)  # --loss-chunks pieces: no full logits
    if args.gradient_checkpointing:  # recompute every --checkpoint-every-th layer in the backward
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=args.checkpoint_every)
    models.compile_layers(model, args.compile)  # --compile: each decoder layer through torch.compile

    # ---- 5. Optimizer from the JSON ("auto" filled here; FSDP2: AdamW), cosine schedule with warm-up ----
    optimizer, scheduler = run.optimizer_and_schedule(model.parameters())
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)
        run.evaluate = lambda: {"eval_loss": evaluate_loss(model, eval_dl, accelerator)}  # once, at the end
    run.resume()

    # ---- 6. Train: real tokens, model FLOPs (6N + 12LHQT per token) and memory per step ----
    model.train()
    for step in run.steps(train_dl, model, scheduler):  # one optimizer step: this rank's micro-batches, counted
        grad_norm = None
        for batch in step.micro_batches:
            with accelerator.accumulate(model):
                with models.offload_activations(args.offload_activations):  # saved for backward: host RAM if asked
                    # the token losses of this micro-batch, summed, over the labelled tokens of the whole step on
                    # all ranks: the step's loss is their token mean, however the batch is split
                    loss = model(**batch, num_items_in_batch=step.labelled).loss
                accelerator.backward(loss * step.backward_scale)  # undoes the mean over accumulation and ranks
                if accelerator.sync_gradients:  # FSDP2 clips here; DeepSpeed clipped per its JSON: both give the norm
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), run.max_grad_norm)
                optimizer.step()  # DeepSpeed steps optimizer + schedule at the step's last micro-batch
                scheduler.step()
                optimizer.zero_grad()
            run.micro_batch_done(loss, batch, grad_norm)  # logs each optimizer step
        if run.checkpoint_due():  # every --save-every steps, the last step, or a stop signal (SIGTERM, SIGUSR1)
            run.save_checkpoint()  # checkpoints/step_N; after a stop signal the process exits 0 here

    # ---- 7. Save the consolidated model; validation, run record and run info ----
    model_dir = save_consolidated(accelerator, model, tokenizer, run.output / "model") if args.save_model else None
    run.finish(model, saved_to=model_dir, training={"packing": args.pack})


if __name__ == "__main__":
    run_main(main)  # bad input or a lost rank: one line saying what to do, exit status 1
