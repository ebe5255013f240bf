"""Instruction fine-tuning of Llama 2 13B (full weights) with DeepSpeed ZeRO-2 and the HF Trainer.

Hardware: one node with 8 x A100/H100 80 GB (configs/zero2.json, bf16); GPUs without bf16
take configs/zero2-fp16.json (dynamic loss scaling); fewer GPUs take configs/zero2-offload.json
(fp32 master weights and Adam states in host RAM, updated by DeepSpeed's CPU Adam).

Launch from this folder, with either launcher (same script, same config):

    deepspeed --num_gpus=8 train.py --deepspeed configs/zero2.json \\
        --model meta-llama/Llama-2-13b-hf --data my_data.jsonl --output_dir out/llama2-13b

    torchrun --nproc_per_node=8 train.py --deepspeed configs/zero2.json \\
        --model meta-llama/Llama-2-13b-hf --data my_data.jsonl --output_dir out/llama2-13b

Every TrainingArguments flag works (--per_device_train_batch_size, --gradient_accumulation_steps,
--learning_rate, --save_steps, ...); this script only changes their defaults. A value fixed in the
DeepSpeed JSON must agree with its flag, or the run stops in its first seconds.

Data: JSONL/CSV/Parquet rows (or a hub dataset) in any of the formats the README lists (chat "messages",
ShareGPT, Alpaca, prompt/completion, prompt/response), rendered with Llama 2's chat template,
"<s>[INST] prompt [/INST] answer </s>" per turn; the loss is on the answers. Outputs under
--output_dir: checkpoint-N/ (resume with --resume_from_checkpoint latest), model/ (consolidated
bf16 safetensors + tokenizer with the chat template, generation_config.json stopping at its end of turn,
README.md: the model card), samples.jsonl (held-out prompts answered by the final model), heldout.jsonl,
metrics.jsonl (one line per logged step: loss, tokens/s, TFLOP/s,
MFU, memory), run_record.json (throughput medians, peak memory, hardware and library versions:
what results/ collects), run_info.json (data split, per-rank optimizer shards, validation, the
memory plan).
"""

from dataclasses import dataclass

# First: the package quiets a bitsandbytes warning that importing the HF Trainer would print (it loads peft)
from finetune_kit import data, losses, models, run_main, training

# isort: split
from torch.utils.data import DataLoader
from transformers import TrainingArguments, set_seed

from finetune_kit.training import hf_trainer

RECIPE = "llama2-13b-zero2"
CONFIGS = "configs/zero2.json (or zero2-fp16.json, zero2-offload.json)"


@dataclass
class Arguments(training.ModelArguments, training.InstructionData, training.Samples, training.Kernels,
                training.NonfiniteSteps):
    """The shared families (training/arguments.py); the loop's flags are TrainingArguments'."""


# The recipe's choices; any of them can be overridden on the command line.
DEFAULTS = dict(
    model="meta-llama/Llama-2-13b-hf", chat_template="llama2",  # "<s>[INST] prompt [/INST] answer </s>" per turn
    output_dir="out/llama2-13b-zero2",
    per_device_train_batch_size=4,  # micro-batch per GPU (the seed's value)
    gradient_accumulation_steps=4,  # global batch: 4 x 4 x 8 GPUs = 128 sequences
    learning_rate=2e-5, lr_scheduler_type="cosine", warmup_steps=0.03, weight_decay=0.0,
    adam_beta2=0.95, max_grad_norm=1.0, num_train_epochs=3,
    activation_checkpointing=True,  # less activation memory for about a third more compute
    logging_steps=1, save_steps=200, save_total_limit=2, report_to="none", seed=42,
    bf16=None, fp16=None,  # None: taken from the DeepSpeed JSON
    resume_from_checkpoint="auto",  # the newest checkpoint in --output_dir if any; never over a finished run
    ddp_timeout=None,  # seconds a collective waits for a silent rank; None: FINETUNE_COLLECTIVE_TIMEOUT_S or 600
)
# What the code below relies on: real-token counting for tokens/s, example ids kept for the run record.
TRAINER_FIXED = dict(include_num_input_tokens_seen="non_padding", remove_unused_columns=False,
                     activation_checkpointing_kwargs={"use_reentrant": False})


def parse_args(argv=None) -> tuple[Arguments, dict]:
    """This recipe's arguments, and TrainingArguments' as a dict (built once the checks have passed)."""
    return training.parse(Arguments, argv, trainer=TrainingArguments, **DEFAULTS,
                          description="Llama 2 13B instruction fine-tune, ZeRO-2, HF Trainer.")


def check_inputs(argv=None):
    """Step 1: every check that needs no process group (seconds); raises UserInputError. Each rank
    runs it first; `python -m finetune_kit.check` runs it once before the launcher starts any."""
    args, trainer_flags = parse_args(argv)
    checked = training.for_trainer(RECIPE, args, trainer_flags, zero_stage=2, configs=CONFIGS)
    rows = data.load_rows(args.data, args.data_format, args.prompt_field, args.response_field, split=args.data_split,
                          chat_template=args.chat_template, model=args.model)  # tool calls: the template is proven
    return args, trainer_flags, checked, rows


def main(argv=None) -> None:
    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    args, trainer_flags, checked, rows = check_inputs(argv)

    # ---- 2. TrainingArguments (fills the JSON's "auto" values); the process group starts here ----
    targs = hf_trainer.training_arguments(checked, trainer_flags, **TRAINER_FIXED)
    set_seed(targs.seed)
    world = targs.world_size
    if targs.process_index == 0:
        print(f"world size {world}, device {targs.device}, ZeRO stage 2, config {checked.ds_path}, "
              f"batch {targs.per_device_train_batch_size} x {targs.gradient_accumulation_steps} x {world}")

    # ---- 3. Data: chat template, loss on the assistant's turns, a held-out validation split ----
    tokenizer = models.load_tokenizer(args.model)
    template = data.chat_template(args.chat_template, tokenizer)  # renders every conversation; saved with the model
    with targs.main_process_first(local=True, desc="tokenising"):  # one process per node, or --data_cache
        examples, counts = data.tokenize_rows(rows, tokenizer, args.max_seq_len, template,
                                              cache=args.data_cache, workers=args.data_workers)
    train_set, eval_set = data.holdout_split(examples, args.eval_fraction, targs.seed, rows)
    if args.pack:  # whole examples per sequence, attention kept inside each
        train_set = data.pack(train_set, args.max_seq_len)
    split = training.DataSplit.of(train_set, eval_set, counts, rows)  # sizes, and the held-out rows
    prompts = training.sample_prompts(args, split.heldout, tokenizer, template)  # --samples, answered at the end
    pad = data.PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    recorder = data.RowRecorder(data.PackedCollator() if args.pack else pad)  # rows this rank loaded, for the record
    hf_trainer.check_enough_data(targs, len(train_set))

    # ---- 4. Model: every rank holds the bf16 weights; ZeRO-2 splits gradients and optimizer ----
    model = models.load_causal_lm(args.model, models.attention_for(args.attention, packed=args.pack),
                                  tokenizer=tokenizer)  # resized only if a <pad> token had to be added
    losses.use_chunked_loss(model, args.loss_chunks, args.loss_kernel)  # --loss_chunks pieces: no full logits

    # ---- 5. Train: optimizer from the JSON ("auto" filled from the flags), cosine schedule ----
    with training.hold_output(checked.output, targs.process_index == 0):  # --output_dir: this run's to its end
        trainer = hf_trainer.metered_trainer(checked, args, targs, model=model, train_dataset=train_set,
                                             data_collator=recorder, processing_class=tokenizer)
        before = training.answers_before(trainer.accelerator, model, tokenizer, template, prompts, args,
                                         resumed=checked.resume_from is not None)
        # checkpoint-N every --save_steps; a stop signal (SIGTERM, SIGUSR1) saves one and ends train()
        trainer.train(resume_from_checkpoint=str(checked.resume_from) if checked.resume_from else None)
        if trainer.stopped_by:  # the same command resumes from that checkpoint
            return

        # ---- 6. Save the consolidated model; validation, run record and run info ----
        # ZeRO-2: every rank has the full weights; rank 0 writes
        model_dir = training.save_trainer_model(trainer, checked.output / "model", template) \
            if args.save_model else None
        trainer.save_state()  # trainer_state.json: the Trainer's own log history (grad norms included)
        evals = []
        if eval_set is not None:
            eval_dl = trainer.accelerator.prepare(DataLoader(eval_set, batch_size=targs.per_device_eval_batch_size,
                                                             collate_fn=pad))
            loss = training.evaluate_loss(trainer.model_wrapped, eval_dl, trainer.accelerator)
            evals = [{"step": trainer.state.global_step, "epoch": trainer.state.epoch, "eval_loss": loss}]
        samples = training.sample_answers(trainer.accelerator, trainer.model_wrapped, tokenizer, template, prompts,
                                          args, checked, before, evals)
        training.finish(trainer.accelerator, checked, args, trainer.model_wrapped, trainer,
                        steps=trainer.state.global_step, total_steps=trainer.state.max_steps, split=split, evals=evals,
                        saved_to=model_dir, batch=hf_trainer.batch_shape(targs), training={"packing": args.pack},
                        samples=samples)


if __name__ == "__main__":
    run_main(main)  # bad input or a lost rank: one line saying what to do, exit status 1
