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

Data: JSONL/CSV rows (or a hub dataset) in any of the formats the README lists (chat "messages",
ShareGPT, Alpaca, prompt/completion, prompt/response), rendered with Llama 2's chat template,
"<s>[INST] prompt [/INST] answer </s>" per turn; the loss is on the answers. Outputs under
--output_dir: checkpoint-N/ (resume with --resume_from_checkpoint latest), model/ (consolidated
bf16 safetensors + tokenizer), metrics.jsonl (one line per logged step: loss, tokens/s, TFLOP/s,
MFU, memory), run_record.json (throughput medians, peak memory, hardware and library versions:
what results/ collects), run_info.json (data split, per-rank optimizer shards, validation, the
memory plan).
"""

import dataclasses
from dataclasses import dataclass, field

# First: the package quiets a bitsandbytes warning that importing the HF Trainer would print (it loads peft)
from finetune_kit import TrainerRun, data, evaluate_loss, models, run_main, save_trainer_model

# isort: split
from torch.utils.data import DataLoader
from transformers import HfArgumentParser, TrainingArguments, set_seed

from finetune_kit.errors import DataError

RECIPE = "llama2-13b-zero2"
CONFIGS = "configs/zero2.json (or zero2-fp16.json, zero2-offload.json)"


@dataclass
class RecipeArguments:
    model: str = field(default="meta-llama/Llama-2-13b-hf", metadata={"help": "hub id or local folder"})
    data: str = field(default=None, metadata={"help": ".jsonl/.json/.csv file or hub dataset name"})
    data_format: str = field(default="auto", metadata={"help": "messages, sharegpt, alpaca, prompt-completion, "
                                                                "prompt-response; auto: detected from the columns"})
    prompt_field: str = field(default="prompt", metadata={"help": "prompt-response format: the prompt's column"})
    response_field: str = field(default="response", metadata={"help": "prompt-response format: the answer's column"})
    chat_template: str = field(default="llama2", metadata={
        "help": "llama2 ([INST] ... [/INST]), llama3, plain, auto (the tokenizer's own, else plain), a .jinja file "
                "or a tokenizer to borrow it from"})
    max_seq_len: int = field(default=2048, metadata={"help": "tokens; longer conversations lose turns from the end"})
    offload_activations: bool = field(default=False, metadata={
        "help": "keep the tensors saved for backward in pinned host memory: less GPU memory for PCIe copies"})
    loss_chunks: int = field(default=8, metadata={
        "help": "compute the LM loss this many token chunks at a time: one chunk's logits in memory instead of "
                "the whole micro-batch's, for a second pass of the head (0: full logits)"})
    loss_kernel: str = field(default="auto", metadata={
        "help": "what computes the chunked loss: chunked (plain torch) or liger (Liger-Kernel's fused linear "
                "cross-entropy; CUDA, liger-kernel installed); auto: liger where it can run"})
    data_cache: str = field(default="auto", metadata={
        "help": "folder of tokenised data kept between launches (auto: $FINETUNE_CACHE_DIR or ~/.cache/finetune_kit; "
                "none: tokenise every launch)"})
    data_workers: int = field(default=0, metadata={
        "help": "processes that tokenise (0: one per CPU, up to 8, from 20,000 rows)"})
    attention: str = field(default="auto", metadata={
        "help": "auto (packed_varlen with --pack: each example attends to itself, no mask built; else sdpa), sdpa, "
                "packed_varlen, flex_attention, eager"})
    pack: bool = field(default=False, metadata={
        "help": "several whole examples per sequence; attention stays inside each"})
    eval_fraction: float = field(default=0.05, metadata={"help": "share of rows held out"})
    skip_memory_check: bool = field(
        default=False, metadata={"help": "launch even if the memory planner predicts the run does not fit the GPUs"})
    save_model: bool = field(default=True, metadata={
        "help": "false: skip the final model save (throughput checks and benchmarks)"})
    meter_warmup_steps: int = field(
        default=3, metadata={"help": "first optimizer steps left out of the run record's throughput medians"})


# The recipe's choices; any of them can be overridden on the command line.
TRAINER_DEFAULTS = dict(
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


def parse_args(argv=None) -> tuple[RecipeArguments, dict]:
    """The recipe's own arguments, and TrainingArguments' as a dict (built later: see step 2)."""
    parser = HfArgumentParser((RecipeArguments, TrainingArguments))
    parser.set_defaults(**TRAINER_DEFAULTS)
    values = vars(parser.parse_args(argv))
    names = {f.name for f in dataclasses.fields(RecipeArguments)}
    recipe = RecipeArguments(**{k: v for k, v in values.items() if k in names})
    return recipe, {k: v for k, v in values.items() if k not in names}


def preflight(argv=None):
    """Step 1: every check that needs no process group (seconds); raises UserInputError. Each rank
    runs it first; `python -m finetune_kit.check` runs it once before the launcher starts any."""
    recipe, trainer_kwargs = parse_args(argv)
    if recipe.data is None:
        raise DataError("no training data: pass --data with a .jsonl/.csv file or a hub dataset name.")
    run = TrainerRun.preflight(RECIPE, recipe, trainer_kwargs, zero_stage=2, configs=CONFIGS)
    rows = data.load_rows(recipe.data, recipe.data_format, recipe.prompt_field, recipe.response_field)
    return recipe, run, rows


def main(argv=None) -> None:
    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    recipe, run, rows = preflight(argv)

    # ---- 2. TrainingArguments (fills the JSON's "auto" values); the process group starts here ----
    args = run.training_arguments(**TRAINER_FIXED)
    set_seed(args.seed)
    world = args.world_size
    if args.process_index == 0:
        print(f"world size {world}, device {args.device}, ZeRO stage 2, config {run.ds_path}, "
              f"batch {args.per_device_train_batch_size} x {args.gradient_accumulation_steps} x {world}")

    # ---- 3. Data: chat template, loss on the assistant's turns, a held-out validation split ----
    tokenizer = models.load_tokenizer(recipe.model)
    with args.main_process_first(local=True, desc="tokenising"):  # one process per node, or --data_cache
        examples, counts = data.tokenize_rows(rows, tokenizer, recipe.max_seq_len, recipe.chat_template,
                                              cache=recipe.data_cache, workers=recipe.data_workers)
    train_set, eval_set = data.holdout_split(examples, recipe.eval_fraction, args.seed)
    if recipe.pack:  # whole examples per sequence, attention kept inside each
        train_set = data.pack(train_set, recipe.max_seq_len)
    run.record_split(train_set, eval_set, counts)
    pad = data.PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    recorder = data.RowRecorder(data.PackedCollator() if recipe.pack else pad)  # rows this rank loaded, for the record
    run.check_enough_data(len(train_set))

    # ---- 4. Model: every rank holds the bf16 weights; ZeRO-2 splits gradients and optimizer ----
    model = models.load_causal_lm(recipe.model, models.attention_for(recipe.attention, packed=recipe.pack))
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # only if a <pad> token had to be added
    model.config.use_cache = False
    models.use_chunked_loss(model, recipe.loss_chunks, recipe.loss_kernel)  # --loss_chunks pieces: no full logits

    # ---- 5. Train: optimizer from the JSON ("auto" filled from the flags), cosine schedule ----
    trainer = run.trainer(model=model, train_dataset=train_set, data_collator=recorder, processing_class=tokenizer)
    # checkpoint-N every --save_steps; a stop signal (SIGTERM, SIGUSR1) saves one and exits 0
    trainer.train(resume_from_checkpoint=str(run.resume_from) if run.resume_from else None)

    # ---- 6. Save the consolidated model; validation, run record and run info ----
    # ZeRO-2: every rank has the full weights; rank 0 writes
    model_dir = save_trainer_model(trainer, run.output / "model") if recipe.save_model else None
    trainer.save_state()  # trainer_state.json: the Trainer's own log history (grad norms included)
    if eval_set is not None:
        eval_dl = trainer.accelerator.prepare(DataLoader(eval_set, batch_size=args.per_device_eval_batch_size,
                                                         collate_fn=pad))
        run.evaluate = lambda: {"eval_loss": evaluate_loss(trainer.model_wrapped, eval_dl, trainer.accelerator)}
    run.finish(trainer.model_wrapped, saved_to=model_dir, seen_ids=recorder.seen, training={"packing": recipe.pack})


if __name__ == "__main__":
    run_main(main)  # bad input or a lost rank: one line saying what to do, exit status 1
