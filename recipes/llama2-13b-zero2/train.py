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

Data: JSONL/CSV rows (or a hub dataset) with "prompt" and "response" fields, formatted as
"<s>[INST] prompt [/INST] response </s>". Outputs under --output_dir: checkpoint-N/ (resume with
--resume_from_checkpoint latest), model/ (consolidated bf16 safetensors + tokenizer),
metrics.jsonl (one line per logged step: loss, tokens/s, TFLOP/s, MFU, memory), run_record.json
(throughput medians, peak memory, hardware and library versions: what results/ collects),
run_info.json.
"""

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from accelerate.utils import gather_object
from torch.utils.data import DataLoader
from transformers import HfArgumentParser, TrainingArguments, set_seed

from finetune_kit import architectures, checkpoints, data, launch_checks, memory, models, run_record
from finetune_kit.distributed import optimizer_partition_report, trainer_cpu_overrides
from finetune_kit.errors import ConfigError, DataError, UserInputError
from finetune_kit.evaluation import evaluate_loss
from finetune_kit.flops import FlopCounter
from finetune_kit.throughput import peak_memory_all_ranks
from finetune_kit.trainer_metrics import MeteredTrainer


@dataclass
class RecipeArguments:
    model: str = field(default="meta-llama/Llama-2-13b-hf", metadata={"help": "hub id or local folder"})
    data: str = field(default=None, metadata={"help": ".jsonl/.json/.csv file or hub dataset name"})
    prompt_field: str = "prompt"
    response_field: str = "response"
    prompt_format: Literal["llama2", "auto"] = field(
        default="llama2", metadata={"help": "llama2: [INST] ... [/INST]; auto: chat template or ### Instruction"})
    max_seq_len: int = field(default=2048, metadata={"help": "tokens; longer examples are truncated"})
    pack: bool = field(default=False, metadata={"help": "pack several examples per sequence"})
    eval_fraction: float = field(default=0.05, metadata={"help": "share of rows held out"})
    skip_memory_check: bool = field(
        default=False, metadata={"help": "launch even if the memory planner predicts the run does not fit the GPUs"})
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


def main(argv=None) -> None:
    recipe, trainer_kwargs = parse_args(argv)
    output = Path(trainer_kwargs["output_dir"])

    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    if not trainer_kwargs["deepspeed"]:
        raise ConfigError("no DeepSpeed config: pass --deepspeed configs/zero2.json (or zero2-fp16.json, "
                          "zero2-offload.json).")
    if recipe.data is None:
        raise DataError("no training data: pass --data with a .jsonl/.csv file or a hub dataset name.")
    ds_path = trainer_kwargs["deepspeed"]
    ds_config = launch_checks.load_deepspeed_config(ds_path)
    if launch_checks.zero_stage(ds_config) != 2:
        raise ConfigError(f"{ds_path} sets ZeRO stage {launch_checks.zero_stage(ds_config)}; this recipe "
                          "is ZeRO-2. Use configs/zero2.json, zero2-fp16.json or zero2-offload.json.")
    for key, from_json in launch_checks.precision_flags(ds_config).items():
        if trainer_kwargs[key] is None:  # --bf16/--fp16 not given: the JSON decides
            trainer_kwargs[key] = from_json
    launch_checks.check_trainer_agreement(ds_config, trainer_kwargs, world=launch_checks.world_size(),
                                          source=ds_path)
    model_config = models.load_config(recipe.model)
    models.check_seq_len(recipe.max_seq_len, model_config, recipe.model)
    memory_plan = memory.preflight(
        model_config, ds_config, world_size=launch_checks.world_size(),
        micro_batch=trainer_kwargs["per_device_train_batch_size"], seq_len=recipe.max_seq_len,
        gradient_checkpointing=trainer_kwargs["activation_checkpointing"], skip=recipe.skip_memory_check,
        skip_flag="--skip_memory_check",
        flags={"micro_batch": "--per_device_train_batch_size", "grad_accum": "--gradient_accumulation_steps",
               "gradient_checkpointing": "--activation_checkpointing true"})
    rows = data.load_rows(recipe.data, recipe.prompt_field, recipe.response_field)
    resume_from = checkpoints.resolve_resume(trainer_kwargs["resume_from_checkpoint"], output,
                                             checkpoints.TRAINER_LAYOUT)

    # ---- 2. TrainingArguments (fills the JSON's "auto" values); the process group starts here ----
    args = TrainingArguments(**{**trainer_kwargs, **TRAINER_FIXED, **trainer_cpu_overrides()})
    launch_checks.check_trainer_mismatches(args, source=ds_path)
    set_seed(args.seed)
    world = args.world_size
    if args.process_index == 0:
        print(f"world size {world}, device {args.device}, ZeRO stage 2, config {ds_path}, "
              f"batch {args.per_device_train_batch_size} x {args.gradient_accumulation_steps} x {world}")

    # ---- 3. Data: tokenise with the prompt masked, hold out a validation split ----
    tokenizer = models.load_tokenizer(recipe.model)
    with args.main_process_first(desc="tokenising"):
        examples = data.tokenize_rows(rows, tokenizer, recipe.max_seq_len, recipe.prompt_field,
                                      recipe.response_field, source=recipe.data, prompt_format=recipe.prompt_format)
    n_eval = max(1, round(len(examples) * recipe.eval_fraction)) if recipe.eval_fraction > 0 else 0
    split = examples.train_test_split(test_size=n_eval, seed=args.seed) if n_eval else None
    train_set = split["train"] if split else examples
    if recipe.pack:
        train_set = data.pack(train_set, recipe.max_seq_len)
    collate = data.PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    recorder = data.RowRecorder(collate)  # the rows this rank loaded, for the run record
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    if len(train_set) < global_batch:
        raise ConfigError(f"{len(train_set)} training sequences make no full optimizer step of "
                          f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} x {world} "
                          "processes; lower --per_device_train_batch_size or --gradient_accumulation_steps, "
                          "or add data.")

    # ---- 4. Model: every rank holds the bf16 weights; ZeRO-2 splits gradients and optimizer ----
    model = models.load_causal_lm(recipe.model)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # only if a <pad> token had to be added
    model.config.use_cache = False

    # ---- 5. Train: optimizer from the JSON ("auto" filled from the flags), cosine schedule ----
    arch = architectures.from_config(model_config)
    trainer = MeteredTrainer(model=model, args=args, train_dataset=train_set, data_collator=recorder,
                             processing_class=tokenizer, flop_counter=FlopCounter(arch), metrics_dir=output)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)

    # ---- 6. Evaluate, save the consolidated model, write the run record ----
    eval_loss = None
    if split:
        eval_dl = trainer.accelerator.prepare(DataLoader(split["test"], batch_size=args.per_device_eval_batch_size,
                                                         collate_fn=collate))
        eval_loss = evaluate_loss(trainer.model_wrapped, eval_dl, trainer.accelerator)
    model_dir = output / "model"
    trainer.save_model(str(model_dir))  # ZeRO-2: every rank has the full weights; rank 0 writes
    trainer.save_state()  # trainer_state.json: the Trainer's own log history (grad norms included)
    engine = trainer.model_wrapped
    ranks = gather_object([{"rank": args.process_index, "world_size": args.world_size, "example_ids": recorder.seen,
                            "optimizer": optimizer_partition_report(engine)}])
    peaks = peak_memory_all_ranks(trainer.accelerator)
    if args.process_index == 0:
        record = run_record.for_training_run(
            recipe="llama2-13b-zero2", model_name=recipe.model, arch=arch, flop_counter=trainer.tally.flop_counter,
            params_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad), ds_config=ds_config,
            script_args={**dataclasses.asdict(recipe), **{k: v for k, v in trainer_kwargs.items()
                                                          if k not in ("output_dir", "resume_from_checkpoint")}},
            world=world, nodes=launch_checks.num_nodes(), meter=trainer.meter, warmup_steps=recipe.meter_warmup_steps,
            peaks=peaks, where=Path(__file__).parent, predicted_gpu_GiB=memory_plan.gpu_bytes / 2**30,
            training={"method": "full", "seq_len": recipe.max_seq_len,
                      "micro_batch_size": args.per_device_train_batch_size,
                      "grad_accum": args.gradient_accumulation_steps,
                      "gradient_checkpointing": bool(args.activation_checkpointing), "packing": recipe.pack})
        record.write(output / "run_record.json")
        run_info = {
            "recipe": "llama2-13b-zero2", "model": recipe.model, "world_size": world,
            "zero_stage": engine.zero_optimization_stage(), "deepspeed_config": ds_path,
            "precision": "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32",
            "steps": trainer.state.global_step, "resumed_from": str(resume_from or ""),
            "eval_loss": eval_loss, "train_sequences": len(train_set),
            "eval_example_ids": [i for ids in split["test"]["example_ids"] for i in ids] if split else [],
            "max_seq_len": recipe.max_seq_len, "micro_batch_size": args.per_device_train_batch_size,
            "grad_accum": args.gradient_accumulation_steps, "model_dir": str(model_dir), "ranks": ranks,
            "memory_plan": memory_plan.to_dict(),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (output / "run_info.json").write_text(json.dumps(run_info, indent=2))
        eval_text = f"{eval_loss:.4f}" if eval_loss is not None else "n/a"
        print(f"done: {trainer.state.global_step} steps, validation loss {eval_text}, "
              f"{trainer.state.num_input_tokens_seen:,} tokens trained, model saved to {model_dir}\n"
              f"per-step loss, tokens/s and memory: {output / 'metrics.jsonl'}; "
              f"run record: {output / 'run_record.json'}")
    trainer.accelerator.end_training()  # leave the process group before exit: a clean shutdown on every rank


if __name__ == "__main__":
    try:
        main()
    except UserInputError as err:
        sys.exit(f"error: {err}")
