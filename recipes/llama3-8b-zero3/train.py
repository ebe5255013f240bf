"""Instruction fine-tuning of Llama 3 8B (full weights) with DeepSpeed ZeRO-3 and accelerate.

Hardware: one node with 8 x 80 GB GPUs (configs/zero3.yaml), or one 80 GB GPU with about
120 GB of host RAM for the offloaded optimizer (configs/zero3-offload.yaml).

Launch from this folder:

    accelerate launch --config_file configs/zero3.yaml train.py \\
        --model meta-llama/Meta-Llama-3-8B --data my_data.jsonl --output out/llama3-8b

    # one GPU, optimizer states in CPU memory:
    accelerate launch --config_file configs/zero3-offload.yaml train.py --data my_data.jsonl

    # long context (README: "Long context"): 8 GPUs share each 128K-token sequence (Ulysses, ALST)
    accelerate launch --config_file configs/zero3-ulysses.yaml train.py --data long.jsonl --pack \
        --model meta-llama/Llama-3.1-8B --max-seq-len 131072 --sequence-parallel 8 --tiled-mlp \
        --offload-activations --micro-batch-size 1

    # the same script under PyTorch FSDP2 instead of DeepSpeed (README: "ZeRO-3 or FSDP2?"):
    accelerate launch --config_file configs/fsdp2.yaml train.py --data my_data.jsonl

    # LoRA adapters over the frozen bf16 base (--peft qlora: over its 4-bit copy), one 24-48 GB GPU (README: "Method"):
    accelerate launch --config_file configs/zero3.yaml --num_processes 1 train.py --data my_data.jsonl --peft lora

Data: JSONL/CSV/Parquet rows (or a hub dataset) in any of the formats the README lists: chat "messages",
ShareGPT, Alpaca, prompt/completion, prompt/response; the loss is on the assistant's turns. Outputs
under --output: checkpoints/step_N/ (resume with --resume), model/ (consolidated bf16
safetensors + tokenizer with the chat template, generation_config.json stopping at its end of turn, README.md:
the model card; with --peft lora|qlora: adapter/ instead, for PeftModel over the base, and merged/ with --merge),
samples.jsonl (held-out prompts answered by the final model; --sample-before: also before
training), heldout.jsonl (the held-out rows, for `make eval`), metrics.jsonl (one line per logged step: loss,
tokens/s, TFLOP/s, MFU, memory; also to TensorBoard, W&B or MLflow with --report-to), run_record.json
(throughput medians, peak memory, hardware and library versions: what results/ collects), run_info.json (data
split, per-rank shards, validation, the memory plan). FINETUNE_METRICS_PORT=9450 in the environment serves live
Prometheus metrics from every rank (port 9450 + local rank).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch.utils.data import DataLoader

from finetune_kit import data, losses, models, run_main, training
from finetune_kit.models import adapters

RECIPE = "llama3-8b-zero3"
LAUNCH = "'accelerate launch --config_file configs/zero3.yaml train.py ...'"


@dataclass
class Arguments(training.ModelArguments, training.InstructionData, training.Adapters, training.Samples,
                training.Kernels, training.LongContext, training.LoopArguments):
    """Every flag this recipe takes: the shared families (training/arguments.py), nothing of its own."""


def parse_args(argv=None) -> Arguments:
    return training.parse(Arguments, argv, description="Llama 3 8B instruction fine-tune with ZeRO-3.",
                          model="meta-llama/Meta-Llama-3-8B", output="out/llama3-8b-zero3", max_seq_len=2048,
                          lr=2e-5, epochs=3)


def check_inputs(argv=None):
    """Step 1: every check that needs no process group (seconds); raises UserInputError. Each rank
    runs it first; `python -m finetune_kit.check` runs it once before the launcher starts any."""
    args = parse_args(argv)
    tuning = adapters.decide(args, recipe=RECIPE)  # --peft: every weight, or LoRA over a 16-bit or 4-bit frozen base
    checked = training.for_accelerate(RECIPE, args, zero_stage=3, launch=LAUNCH, tuning=tuning,
                                      configs=". Use configs/zero3.json or zero3-offload.json (or configs/fsdp2.yaml).")
    args = replace(args, **checked.plan.flags)  # the split and levers as decided (--levers auto: its pick)
    rows = data.load_rows(args.data, args.data_format, args.prompt_field, args.response_field, split=args.data_split,
                          chat_template=args.chat_template, model=args.model)  # tool calls: the template is proven
    return args, checked, rows


def main(argv=None) -> None:
    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    args, checked, rows = check_inputs(argv)

    # ---- 2. Distributed setup: the ranks agree on the launch plan; the YAML (+ JSON, or FSDP2) drives it ----
    accelerator = training.start(checked, args)
    stop = training.StopSignal(accelerator)  # SIGTERM, SIGINT, Slurm's SIGUSR1: stop after the step, with a checkpoint
    sp = training.sequence_groups(accelerator, args.sequence_parallel)  # --sequence-parallel N ranks share a sequence

    # ---- 3. Data: chat template, loss on the assistant's turns, a held-out validation split ----
    tokenizer = models.load_tokenizer(args.model)
    template = data.chat_template(args.chat_template, tokenizer)  # renders every conversation; saved with the model
    with accelerator.local_main_process_first():  # one process per node tokenises, or reads --data-cache
        examples, counts = data.tokenize_rows(rows, tokenizer, args.max_seq_len, template,
                                              cache=args.data_cache, workers=args.data_workers)
    train_set, eval_set = data.holdout_split(examples, args.eval_fraction, args.seed, rows)
    train_set = data.pack(train_set, args.max_seq_len) if args.pack else train_set  # --pack: whole examples a row
    split = training.DataSplit.of(train_set, eval_set, counts, rows)  # sizes, and the held-out rows
    prompts = training.sample_prompts(args, split.heldout, tokenizer, template)  # --samples: answered at the end
    pad = data.PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    collate = training.shard_sequences(data.PackedCollator() if args.pack else pad, sp, tokenizer.pad_token_id)
    train_dl = training.shard_loader(accelerator, DataLoader(train_set, batch_size=args.micro_batch_size, shuffle=True,
                                                             collate_fn=collate), sp)  # one slice per rank of a group
    schedule = training.Schedule.plan(len(train_set), args, checked.data_ranks)  # steps per epoch, in all

    # ---- 4. Model: ZeRO-3 builds it inside deepspeed.zero.Init (FSDP2: on rank 0 only); qlora: 4-bit linears ----
    attention = models.attention_for(args.attention, packed=args.pack)
    model = models.load_causal_lm(args.model, attention, checked.quantization, tokenizer=tokenizer)  # + a <pad>?
    losses.use_chunked_loss(model, args.loss_chunks, args.loss_kernel)  # --loss-chunks pieces: no full logits
    models.use_tiled_mlp(model, args.tiled_mlp)  # --tiled-mlp: each MLP a slice of the tokens at a time
    training.use_sequence_parallel(model, sp, attention, 1 if args.pack else args.micro_batch_size)  # all-to-all
    if args.gradient_checkpointing:  # recompute every --recompute-every-th layer in the backward
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=args.recompute_every)
    model = adapters.wrap(model, checked.tuning)  # --peft lora|qlora: the base frozen, LoRA adapters train
    models.compile_layers(model, args.compile)  # --compile: each decoder layer through torch.compile

    # ---- 5. Optimizer from the JSON ("auto" filled here; FSDP2: AdamW), cosine schedule with warm-up ----
    optimizer, scheduler = training.optimizer_and_schedule(model.parameters(), checked, args, schedule.total_steps)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    eval_dl = accelerator.prepare(DataLoader(eval_set, args.micro_batch_size, collate_fn=pad)) if eval_set else None
    with training.hold_output(checked.output, accelerator.is_main_process):  # --output is this run's to its end
        checkpointer = training.Checkpointer(accelerator, checked, args)  # resumes; saves finite steps when due
        start = checkpointer.resume(load_module_strict=not checked.tuning.adapted)  # adapters: the base is --model's
        meter = training.step_meter(accelerator, checked, model, args, schedule.total_steps, start)
        prior = training.answers_before(accelerator, model, tokenizer, template, prompts, args, start.step > 0, eval_dl)
        model.train()

        # ---- 6. Train: real tokens, model FLOPs (6N + 12LHQT per token; adapters: 4N + 6N of theirs) and memory ----
        for step in training.steps(accelerator, train_dl, scheduler, schedule, start):  # micro-batches, counted
            grad_norm = None
            for batch in step.micro_batches:
                with accelerator.accumulate(model):
                    with models.offload_activations(args.offload_activations):  # saved for backward: host RAM if asked
                        # its token losses summed over the whole step's labelled tokens: one mean however it is split
                        loss = losses.causal_lm_loss(model, data.model_inputs(batch), step.labelled)
                    accelerator.backward(loss * step.backward_scale)  # undoes the mean over accumulation and ranks
                    if accelerator.sync_gradients:  # FSDP2 clips here; DeepSpeed clipped per its JSON: both: the norm
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), training.max_grad_norm(checked))
                    if training.finite(grad_norm):  # a NaN/Inf gradient is never applied (nonfinite.py)
                        optimizer.step()  # DeepSpeed steps optimizer + schedule at the step's last micro-batch
                        scheduler.step()
                    optimizer.zero_grad()
                meter.micro_batch(loss, batch)
            record = meter.step(step, grad_norm)  # metrics.jsonl every --log-every steps: loss, grad norm, tokens/s
            stopping = stop.agreed()  # did a stop signal reach any rank?
            saved = checkpointer.save(step, record, stopping=stopping)  # when due; never a NaN/Inf step's
            if stopping:
                return training.stopped(accelerator, checked, stop, step, schedule.total_steps, saved, meter)

        # ---- 7. Save model/ (adapters: adapter/); validation, sample answers, run record, run info and model card ----
        model_dir = training.save_trained(accelerator, model, tokenizer, checked, template) if args.save_model else None
        evals = [training.validation(step, {"eval_loss": training.evaluate_loss(model, eval_dl, accelerator)})] \
            if eval_set else []
        samples = training.sample_answers(accelerator, model, tokenizer, template, prompts, args, checked, prior, evals)
        training.finish(accelerator, checked, args, model, meter, steps=step.number, total_steps=schedule.total_steps,
                        split=split, evals=evals, saved_to=model_dir, batch=training.batch_shape(args),
                        training={"packing": args.pack}, samples=samples)
    if args.merge and accelerator.is_main_process:  # ---- 8. --merge: the adapter folded into the base in bf16 ----
        training.save_merged(checked, model_dir)  # one process, outside ZeRO-3


if __name__ == "__main__":
    run_main(main)  # bad input or a lost rank: one line saying what to do, exit status 1
