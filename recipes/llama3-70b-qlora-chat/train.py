"""Chat fine-tuning of Llama 3.3 70B: QLoRA on two nodes, the loss on the assistant's turns.

4-bit nf4 base (bitsandbytes, frozen; --peft lora: bf16) + LoRA adapters (PEFT) on the causal LM,
DeepSpeed ZeRO-3 over 2 nodes x 4 GPUs (80 GB H100), orchestrated by accelerate: the configs of the
llama3-70b-qlora review classifier, this script in place of its train.py.

Launch from this folder on both nodes at the same time (shared model/data paths, e.g. NFS):

    # main node (10.0.0.1)
    accelerate launch --config_file configs/zero3-main.yaml --main_process_ip 10.0.0.1 train.py \\
        --model /nfs/models/Llama-3.3-70B-Instruct --data /nfs/data/chats.jsonl --output /nfs/runs/70b-chat
    # worker node
    accelerate launch --config_file configs/zero3-worker.yaml --main_process_ip 10.0.0.1 train.py \\
        --model /nfs/models/Llama-3.3-70B-Instruct --data /nfs/data/chats.jsonl --output /nfs/runs/70b-chat

Data: JSONL/CSV/Parquet rows (or a hub dataset) in any of the formats the 8B recipe reads: chat "messages",
ShareGPT, Alpaca, prompt/completion, prompt/response (a review CSV is refused: that is the classifier's).
Outputs under --output: checkpoints/step_N/, adapter/ (LoRA, for PeftModel over the base, with the chat
template and the model card), merged/ (--merge: base + adapter in bf16, for transformers or vLLM),
samples.jsonl (held-out prompts answered by the final model), heldout.jsonl (for `make eval`), metrics.jsonl
(per step: loss, tokens/s, MFU, memory), run_record.json (what results/ collects), run_info.json (data split,
shards, validation, LoRA settings, the memory plan).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# First: the package quiets a bitsandbytes warning that importing peft would print
from finetune_kit import data, losses, models, run_main, training

# isort: split
from torch.utils.data import DataLoader

from finetune_kit.models import adapters

RECIPE = "llama3-70b-qlora-chat"
LAUNCH = "'accelerate launch --config_file configs/zero3-main.yaml train.py ...' (zero3-worker.yaml on the worker)"


@dataclass
class Arguments(training.ModelArguments, training.InstructionData, training.Adapters, training.Samples,
                training.Kernels, training.LoopArguments):
    """The shared families (training/arguments.py: the adapters' too) and this recipe's own: the nodes' wait."""

    rendezvous_timeout: float = training.flag(300, "seconds to wait for the other node's ranks before failing")


def parse_args(argv=None) -> Arguments:
    return training.parse(Arguments, argv, description="Llama 3.3 70B QLoRA chat fine-tune, ZeRO-3 on two nodes.",
                          model="meta-llama/Llama-3.3-70B-Instruct", output="out/llama3-70b-qlora-chat",
                          max_seq_len=2048, lr=1e-4, epochs=1, peft="qlora")


def check_inputs(argv=None):
    """Step 1: every check that needs no process group (seconds); raises UserInputError. Each rank
    runs it first; `python -m finetune_kit.check` runs it once before the launcher starts any."""
    args = parse_args(argv)
    # --peft qlora (nf4, double quantization, bf16 compute and storage) or lora: the flags, checked, decided once
    tuning = adapters.decide(args, recipe=RECIPE, allowed=("lora", "qlora"))
    checked = training.for_accelerate(RECIPE, args, zero_stage=3, launch=LAUNCH, configs=": use configs/zero3.json.",
                                      tuning=tuning)  # a 4-bit folder: its own settings
    args = replace(args, **checked.plan.flags)  # the split and levers as decided (--levers auto: its pick)
    rows = data.load_rows(args.data, args.data_format, args.prompt_field, args.response_field, split=args.data_split,
                          chat_template=args.chat_template, model=args.model)  # review CSVs: refused here
    return args, checked, rows


def main(argv=None) -> None:
    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    args, checked, rows = check_inputs(argv)

    # ---- 2. Distributed setup: the nodes agree on the job's shape and launch plan, then the YAML + JSON drive it ----
    accelerator = training.start(checked, args, rendezvous_timeout=args.rendezvous_timeout)
    stop = training.StopSignal(accelerator)  # SIGTERM, SIGINT, Slurm's SIGUSR1: stop after the step, with a checkpoint

    # ---- 3. Data: chat template, loss on the assistant's turns, a held-out validation split ----
    tokenizer = models.load_tokenizer(args.model)
    template = data.chat_template(args.chat_template, tokenizer)  # renders every conversation; saved with the adapter
    with accelerator.local_main_process_first():  # one process per node tokenises, or reads --data-cache
        examples, counts = data.tokenize_rows(rows, tokenizer, args.max_seq_len, template,
                                              cache=args.data_cache, workers=args.data_workers)
    train_set, eval_set = data.holdout_split(examples, args.eval_fraction, args.seed, rows)
    train_set = data.pack(train_set, args.max_seq_len) if args.pack else train_set  # --pack: whole examples a row
    split = training.DataSplit.of(train_set, eval_set, counts, rows)  # sizes, and the held-out rows
    prompts = training.sample_prompts(args, split.heldout, tokenizer, template)  # --samples: answered at the end
    pad = data.PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    train_dl = DataLoader(train_set, batch_size=args.micro_batch_size, shuffle=True,
                          collate_fn=data.PackedCollator() if args.pack else pad)
    schedule = training.Schedule.plan(len(train_set), args, checked.data_ranks)  # steps per epoch, in all

    # ---- 4. Model: the causal LM built shard by shard (zero.Init), 4-bit linears as it loads; LoRA trains ----
    attention = models.attention_for(args.attention, packed=args.pack)
    model = models.load_causal_lm(args.model, attention, checked.quantization, tokenizer=tokenizer)  # + a <pad>?
    losses.use_chunked_loss(model, args.loss_chunks, args.loss_kernel)  # --loss-chunks pieces: no full logits
    if args.gradient_checkpointing:  # non-reentrant: works with frozen inputs and ZeRO-3's parameter hooks
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=args.recompute_every)
    model = adapters.wrap(model, checked.tuning)  # the base frozen, LoRA adapters on its linear layers

    # ---- 5. Optimizer from the JSON ("auto" filled here) over the adapters, cosine schedule with warm-up ----
    optimizer, scheduler = training.optimizer_and_schedule(model.parameters(), checked, args, schedule.total_steps)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    eval_dl = accelerator.prepare(DataLoader(eval_set, args.micro_batch_size, collate_fn=pad)) if eval_set else None
    with training.hold_output(checked.output, accelerator.is_main_process):  # --output is this run's to its end
        checkpointer = training.Checkpointer(accelerator, checked, args)  # resumes; saves finite steps when due
        # Not strict: the frozen base is rebuilt from --model, not stored; LoRA comes back from the ZeRO-3 partitions.
        start = checkpointer.resume(load_module_strict=False)
        meter = training.step_meter(accelerator, checked, model, args, schedule.total_steps, start)
        prior = training.answers_before(accelerator, model, tokenizer, template, prompts, args, start.step > 0, eval_dl)
        model.train()

        # ---- 6. Train (frozen-base model FLOPs: 4N_frozen + 6N_trainable + 12LHQT per token) ----
        for step in training.steps(accelerator, train_dl, scheduler, schedule, start):  # micro-batches, counted
            for batch in step.micro_batches:
                with accelerator.accumulate(model):
                    with models.offload_activations(args.offload_activations):  # saved for backward: host RAM if asked
                        # its token losses summed over the whole step's labelled tokens: one mean however it is split
                        loss = losses.causal_lm_loss(model, data.model_inputs(batch), step.labelled)
                    accelerator.backward(loss * step.backward_scale)  # undoes the mean over accumulation and ranks
                    optimizer.step()  # DeepSpeed steps optimizer + schedule at the step's last micro-batch (a NaN/Inf
                    scheduler.step()  # gradient it discards itself: training/nonfinite.py)
                    optimizer.zero_grad()
                meter.micro_batch(loss, batch)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), training.max_grad_norm(checked))  # DeepSpeed's
            record = meter.step(step, grad_norm)  # metrics.jsonl every --log-every steps: loss, grad norm, tokens/s
            stopping = stop.agreed()  # did a stop signal reach any rank?
            saved = checkpointer.save(step, record, stopping=stopping)  # when due; never a NaN/Inf step's
            if stopping:
                return training.stopped(accelerator, checked, stop, step, schedule.total_steps, saved, meter)

        # ---- 7. Save adapter/ (gathered from the ZeRO-3 shards); validation, sample answers, records, model card ----
        adapter_dir = training.save_trained(accelerator, model, tokenizer, checked, template) if args.save_model \
            else None
        evals = [training.validation(step, {"eval_loss": training.evaluate_loss(model, eval_dl, accelerator)})] \
            if eval_set else []
        samples = training.sample_answers(accelerator, model, tokenizer, template, prompts, args, checked, prior, evals)
        training.finish(accelerator, checked, args, model, meter, steps=step.number, total_steps=schedule.total_steps,
                        split=split, evals=evals, saved_to=adapter_dir, batch=training.batch_shape(args),
                        training={"packing": args.pack}, samples=samples)

    # ---- 8. Optional: merged export (one process, outside ZeRO-3): the bf16 base, the adapter merged in ----
    if args.merge and accelerator.is_main_process:
        training.save_merged(checked, adapter_dir)


if __name__ == "__main__":
    run_main(main)  # bad input or a lost rank: one line saying what to do, exit status 1
