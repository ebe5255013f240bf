"""Preference tuning (DPO) of Llama 3 8B with DeepSpeed ZeRO-3 and TRL's DPOTrainer: full weights or LoRA/QLoRA.

Hardware: one node with 8 x 80 GB GPUs (configs/zero3.json); one 80 GB GPU with about 120 GB of host RAM for the
offloaded optimizer (configs/zero3-offload.json) or with --peft lora|qlora (configs/zero3.json).

Launch from this folder (`deepspeed` or `torchrun`, the same script and config):

    deepspeed --num_gpus=8 train.py --deepspeed configs/zero3.json \\
        --model meta-llama/Meta-Llama-3-8B-Instruct --data prefs.jsonl --output_dir out/llama3-8b-dpo

    # one GPU, LoRA adapters over the frozen base; the reference is the base with the adapters off:
    deepspeed --num_gpus=1 train.py --deepspeed configs/zero3.json --peft lora --data prefs.jsonl

Every DPOConfig flag works (--beta, --loss_type, --learning_rate, --per_device_train_batch_size, ...); this script
changes their defaults, and --dpo_reference decides where the reference log-probabilities come from: the frozen
base with the adapters disabled (LoRA/QLoRA), precomputed before training and cached with the tokenised pairs
(full weights, the default), or a second model sharded beside the policy. --model may be an SFT run's model/ or
adapter/ (merged into its base once, in the cache): the run starts from, and is referenced to, that SFT model.

Data: preference pairs in TRL's shapes (prompt/chosen/rejected strings or message lists, implicit-prompt
conversations, UltraFeedback's), JSONL/JSON/CSV/Parquet or a hub dataset, rendered with the chat template; the
loss is on the answers. Outputs under --output_dir: checkpoint-N/ (resume with the same command), model/ or
adapter/ (with the chat template and the model card, README.md), samples.jsonl (held-out prompts answered before
and after), heldout.jsonl, metrics.jsonl (per step: loss, rewards of chosen and rejected, margin, accuracy,
log-probs, tokens/s, memory), run_record.json and run_info.json (held-out preference accuracy and margin before
and after, the reference, the memory plan).
"""

from dataclasses import dataclass, replace

# First: the package quiets a bitsandbytes warning that importing the HF Trainer would print (it loads peft)
from finetune_kit import data, models, run_main, training

# isort: split
from transformers import set_seed
from trl import DPOConfig

from finetune_kit.models import adapters
from finetune_kit.training import hf_trainer, preference_trainer

RECIPE = "llama3-8b-dpo"
CONFIGS = "configs/zero3.json (or zero3-offload.json)"


@dataclass
class Arguments(training.ModelArguments, training.InstructionData, training.Adapters, training.Samples):
    """The shared families (training/arguments.py) and the reference; the loop's flags are DPOConfig's."""

    dpo_reference: str = training.flag(
        "auto", "where the reference log-probs come from: adapters-off (LoRA/QLoRA: the base with the adapters "
                "disabled), precomputed (full weights: one forward pass before training, cached with the tokenised "
                "pairs), sharded (a second bf16 model partitioned like the policy, one more forward per step); auto: "
                "adapters-off with adapters, else precomputed",
        choices=("auto", "adapters-off", "precomputed", "sharded"))


# The recipe's choices; any of them can be overridden on the command line.
DEFAULTS = dict(
    model="meta-llama/Meta-Llama-3-8B-Instruct", chat_template="auto", output_dir="out/llama3-8b-dpo",
    max_seq_len=1024,  # prompt + answer tokens per sequence; each pair is two sequences
    beta=0.1, loss_type=["sigmoid"],  # the DPO paper's loss and KL strength
    per_device_train_batch_size=2,  # pairs per GPU per forward (4 sequences)
    gradient_accumulation_steps=8,  # global batch: 2 x 8 x 8 GPUs = 128 pairs
    learning_rate=5e-7, lr_scheduler_type="cosine", warmup_steps=0.1, weight_decay=0.0, max_grad_norm=1.0,
    num_train_epochs=1, activation_checkpointing=True,  # less activation memory for about a third more compute
    logging_steps=1, save_steps=200, save_total_limit=2, report_to="none", seed=42,
    bf16=None, fp16=None,  # None: taken from the DeepSpeed JSON
    precompute_ref_log_probs=None,  # decided by --dpo_reference
    resume_from_checkpoint="auto",  # the newest checkpoint in --output_dir if any; never over a finished run
    ddp_timeout=None,  # seconds a collective waits for a silent rank; None: FINETUNE_COLLECTIVE_TIMEOUT_S or 600
)


def parse_args(argv=None) -> tuple[Arguments, dict]:
    """This recipe's arguments, and DPOConfig's as a dict (built once the checks have passed)."""
    return training.parse(Arguments, argv, trainer=DPOConfig, **DEFAULTS,
                          description="Llama 3 8B preference tuning (DPO), ZeRO-3, TRL's DPOTrainer.")


def check_inputs(argv=None):
    """Step 1: every check that needs no process group (seconds); raises UserInputError. Each rank runs it first;
    `python -m finetune_kit.check` runs it once before the launcher starts any."""
    args, trainer_flags = parse_args(argv)
    sft = args.model  # an SFT run's adapter/ starts (and is the reference) as its base with it merged, made once
    args = replace(args, model=models.start_weights(args.model))
    tuning = adapters.decide(args, recipe=RECIPE)  # --peft: every weight, or LoRA over a 16-bit or 4-bit frozen base
    dpo = preference_trainer.decide(args.dpo_reference, tuning, args.data_cache)  # the reference, decided once
    given_precompute = trainer_flags.pop("precompute_ref_log_probs")
    checked = training.for_trainer(RECIPE, args, trainer_flags, zero_stage=3, configs=CONFIGS, tuning=tuning,
                                   dpo=dpo)
    pairs = data.load_pairs(args.data, split=args.data_split)  # row-numbered refusals of bad pairs
    fixed = preference_trainer.fixed(dpo, given_precompute, max_seq_len=args.max_seq_len,
                                     fresh=checked.resume_from is None and args.eval_fraction > 0)
    return args, trainer_flags, fixed, checked, dpo, pairs, sft


def main(argv=None) -> None:
    # ---- 1. Check every input before any process group, data or weights (seconds) ----
    args, trainer_flags, fixed, checked, dpo, pairs, sft = check_inputs(argv)

    # ---- 2. DPOConfig (fills the JSON's "auto" values); the process group starts here ----
    targs = hf_trainer.training_arguments(checked, trainer_flags, DPOConfig, **fixed)
    set_seed(targs.seed)
    if targs.process_index == 0:
        print(f"world size {targs.world_size}, device {targs.device}, ZeRO stage 3, config {checked.ds_path}, "
              f"{targs.per_device_train_batch_size} x {targs.gradient_accumulation_steps} x {targs.world_size} "
              f"pairs, {checked.tuning.describe()}, reference {dpo.reference}, beta {targs.beta}, "
              f"loss {'+'.join(targs.loss_type)}")

    # ---- 3. Data: pairs through the chat template, loss on the answers, held-out pairs ----
    tokenizer = models.load_tokenizer(args.model)
    template = data.chat_template(args.chat_template, tokenizer)  # renders every pair; saved with the model
    data.check_room(pairs, tokenizer, template, args.max_seq_len)  # a prompt must leave room for an answer
    train_pairs, held_pairs = data.holdout_pairs(pairs, args.eval_fraction, targs.seed)
    with targs.main_process_first(local=True, desc="tokenising"):  # one process per node, or --data_cache
        train_set = data.tokenize_pairs(train_pairs, tokenizer, template, args.max_seq_len, cache=args.data_cache)
        eval_set = data.tokenize_pairs(held_pairs, tokenizer, template, args.max_seq_len,
                                       cache=args.data_cache) if held_pairs else None
    split = training.DataSplit.of_pairs(train_set, held_pairs)  # held out: prompt + chosen, the samples' reference
    prompts = training.sample_prompts(args, split.heldout, tokenizer, template)  # --samples, answered at the end
    hf_trainer.check_enough_data(targs, len(train_set))

    # ---- 4. Policy (and a sharded reference): ZeRO-3 builds them inside deepspeed.zero.Init ----
    model = models.load_causal_lm(args.model, "sdpa", checked.quantization, tokenizer=tokenizer)  # qlora: 4-bit
    ref_model = models.load_causal_lm(args.model, "sdpa", tokenizer=tokenizer) if dpo.reference == "sharded" else None
    peft_config = checked.tuning.lora_config("CAUSAL_LM") if checked.tuning.adapted else None

    # ---- 5. Train: TRL's loss over pairs; the precomputed reference's pass first (or read from the cache) ----
    with training.hold_output(checked.output, targs.process_index == 0):  # --output_dir: this run's to its end
        trainer = preference_trainer.dpo_trainer(checked, args, targs, dpo, tokenizer=tokenizer, model=model,
                                                 ref_model=ref_model, train_dataset=train_set, eval_dataset=eval_set,
                                                 peft_config=peft_config)
        before = preference_trainer.answers_before(trainer, tokenizer, template, prompts, args,  # --sample_before
                                                   resumed=checked.resume_from is not None)  # at train()'s start
        # checkpoint-N every --save_steps; a stop signal (SIGTERM, SIGUSR1) saves one and ends train()
        trainer.train(resume_from_checkpoint=str(checked.resume_from) if checked.resume_from else None)
        if trainer.stopped_by:  # the same command resumes from that checkpoint
            return

        # ---- 6. Save; held-out preference accuracy and margin before and after; run record and card ----
        saved = training.save_trained(trainer.accelerator, trainer.model_wrapped, tokenizer, checked, template) \
            if args.save_model else None
        trainer.save_state()  # trainer_state.json: the Trainer's own log history
        # held-out pairs' loss, preference accuracy and margin: at step 0 (logged by train()) and now
        evals = preference_trainer.held_out(trainer) if eval_set is not None else []
        samples = training.sample_answers(trainer.accelerator, trainer.model_wrapped, tokenizer, template, prompts,
                                          args, checked, before.before, evals)
        training.finish(trainer.accelerator, checked, args, trainer.model_wrapped, trainer,
                        steps=trainer.state.global_step, total_steps=trainer.state.max_steps, split=split, evals=evals,
                        saved_to=saved, batch=hf_trainer.batch_shape(targs), samples=samples,
                        details={"dpo": {"method": "DPO", "beta": targs.beta, "loss_type": targs.loss_type,
                                         "reference": dpo.reference, "reference_model": sft,
                                         **({"merged_into": args.model} if sft != args.model else {})}})


if __name__ == "__main__":
    run_main(main)  # bad input or a lost rank: one line saying what to do, exit status 1
