"""The DPO recipe's Trainer: TRL's ``DPOTrainer`` (the loss family, the pair collation, the reference), metered,
checked and ended like the HF Trainer recipe's (:mod:`finetune_kit.training.hf_trainer`).

    dpo = preference_trainer.decide(args.dpo_reference, tuning, args.data_cache)  # the reference, once
    targs = hf_trainer.training_arguments(checked, flags, DPOConfig, **preference_trainer.fixed(dpo, ...))
    trainer = preference_trainer.dpo_trainer(checked, args, targs, dpo, model=..., ref_model=..., ...)

The pairs arrive tokenised (:mod:`finetune_kit.data.preference_tokens`: ``prompt_ids``, ``chosen_ids``,
``rejected_ids``) and go to TRL's ``DataCollatorForPreference`` as they are. The reference is one of
:data:`finetune_kit.planning.preference.REFERENCES`:

* ``adapters-off``: TRL's own, the policy's base with the LoRA adapters disabled;
* ``precomputed``: TRL's first pass over the pairs under the policy's ZeRO-3 inference engine, its log-probs cached
  beside the tokenised pairs as ``cache-<hash(fingerprint, reference)>.arrow``. TRL names the reference by hashing
  its ``state_dict()``, in which ZeRO-3's partitioned weights are empty placeholders (only the small unpartitioned
  tensors are whole): references that differ in their large weights would share a cache. :class:`MeteredDPOTrainer`
  names it by :func:`reference_identity` instead (the weight files' digest and the precision), so a changed
  reference recomputes and a relaunch or a resume reads the cache;
* ``sharded``: a second model loaded by the recipe (partitioned by ``zero.Init`` like the policy), which TRL wraps
  in a DeepSpeed inference engine.

What TRL logs per step (rewards of chosen and rejected, margin, accuracy, log-probs) reaches ``metrics.jsonl``,
the console and Prometheus under :data:`finetune_kit.metering.keys.PREFERENCE`'s names.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerCallback
from trl import DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from finetune_kit.errors import ConfigError
from finetune_kit.metering import keys
from finetune_kit.metering.flops import FlopCounter
from finetune_kit.planning.preference import Dpo, default_reference
from finetune_kit.training.hf_trainer import MeteredTrainer, metered_trainer

TOKENISED = {"prompt_ids", "chosen_ids", "rejected_ids"}
WEIGHT_FILES = ("*.safetensors", "*.bin", "config.json")


def decide(choice: str, tuning, data_cache: str) -> Dpo:
    """The run's :class:`Dpo` from ``--dpo_reference`` (``auto``: the base with the adapters off for LoRA/QLoRA,
    else precomputed log-probs); the memory check refuses a reference the method cannot use. A precomputed
    reference is kept with the tokenised pairs, so it needs a ``--data_cache``."""
    dpo = Dpo(default_reference(tuning.plan()) if choice == "auto" else choice)
    if dpo.reference == "precomputed" and data_cache == "none":
        raise ConfigError("--dpo_reference precomputed keeps the reference log-probs with the tokenised pairs, and "
                          "--data_cache none keeps nothing. Pass --data_cache auto (or a folder every rank reads).")
    return dpo


def fixed(dpo: Dpo, given_precompute: bool | None, *, max_seq_len: int, fresh: bool) -> dict:
    """The ``DPOConfig`` values the recipe relies on: the reference as decided (a contradicting
    ``--precompute_ref_log_probs`` is refused), pairs cut at ``--max_seq_len`` from the start (already so when
    tokenised), example ids kept for the run record, and the held-out pairs' accuracy and margin taken before the
    first step of a ``fresh`` run (a resumed run reads them from its checkpoint's log)."""
    precompute = dpo.reference == "precomputed"
    if given_precompute is not None and given_precompute != precompute:
        raise ConfigError(f"--precompute_ref_log_probs {given_precompute} contradicts --dpo_reference "
                          f"{dpo.reference}. Drop --precompute_ref_log_probs: --dpo_reference decides it.")
    return dict(precompute_ref_log_probs=precompute, max_length=max_seq_len, truncation_mode="keep_start",
                remove_unused_columns=False, include_num_input_tokens_seen="non_padding", eval_on_start=fresh,
                eval_strategy="no" if not fresh else "steps", eval_steps=10 ** 9)


def reference_identity(model: str, precision: str) -> str:
    """A digest of the reference's weights (its folder's weight files and config, read whole; a hub id: its cached
    snapshot) and of the ``precision`` its log-probs are computed in: any change to a weight or to the dtype
    changes it."""
    path = Path(model)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, local_files_only=True))
    digest = hashlib.sha256(precision.encode())
    for pattern in WEIGHT_FILES:
        for file in sorted(path.glob(pattern)):
            digest.update(file.name.encode())
            with open(file, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
    return digest.hexdigest()


class PairRecorder:
    """TRL's ``DataCollatorForPreference`` that also keeps the ``example_id`` of each training pair it collates in
    ``seen`` (the run record's rows per rank); paused while the reference pass and evaluations collate."""

    def __init__(self, pad_token_id: int, max_length: int):
        self.collate = DataCollatorForPreference(pad_token_id=pad_token_id, max_length=max_length)
        self.seen: list[int] = []
        self.recording = True

    def __call__(self, examples: list[dict]) -> dict:
        if self.recording:
            self.seen.extend(int(example["example_id"]) for example in examples)
        return self.collate(examples)

    @contextmanager
    def paused(self):
        self.recording = False
        try:
            yield
        finally:
            self.recording = True


class MeteredDPOTrainer(MeteredTrainer, DPOTrainer):
    """``DPOTrainer`` metered like :class:`~finetune_kit.training.hf_trainer.MeteredTrainer`; ``reference_id``: the
    digest that names the precomputed reference's cache (:func:`reference_identity`, rank 0's is the one used)."""

    def __init__(self, *args, reference_id: str | None = None, **kwargs):
        self.reference_id = reference_id
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if TOKENISED <= set(dataset.column_names):  # tokenised through our chat template already
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self._precompute_model_hash = self.reference_id
        with self.data_collator.paused():
            return super()._precompute_ref_logps(dataset, name, batch_size)

    def create_model_card(self, *args, **kwargs):
        """None of TRL's: the run's card is written with the saved model (:mod:`finetune_kit.model_card`)."""

    def evaluate(self, *args, **kwargs):
        with self.data_collator.paused():
            return super().evaluate(*args, **kwargs)


def dpo_trainer(checked, recipe_args, args, dpo: Dpo, *, tokenizer, **trainer_kwargs) -> MeteredDPOTrainer:
    """The recipe's :class:`MeteredDPOTrainer` (``trainer_kwargs``: DPOTrainer's model, ref_model, datasets,
    peft_config), metered with the reference's forward counted unless precomputed."""
    flops = FlopCounter(checked.shape, reference_forward=dpo.reference_forward)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    reference_id = reference_identity(recipe_args.model, precision) if dpo.reference == "precomputed" and \
        args.process_index == 0 else None
    return metered_trainer(checked, recipe_args, args, trainer=MeteredDPOTrainer, flop_counter=flops,
                           reference_id=reference_id, processing_class=tokenizer,
                           data_collator=PairRecorder(tokenizer.pad_token_id, args.max_length), **trainer_kwargs)


class AnswersBefore(TrainerCallback):
    """``--sample_before`` under ZeRO-3: the answers of the model as loaded, taken when ``train()`` has wrapped it
    in its DeepSpeed engine (before, the partitioned weights have no engine to gather them) and before the first
    step. ``before`` holds them afterwards (None when not asked or resumed: :func:`~finetune_kit.training.samples.
    answers_before`)."""

    def __init__(self, trainer, tokenizer, template, prompts, args, resumed: bool):
        self.trainer, self.tokenizer, self.template, self.prompts = trainer, tokenizer, template, prompts
        self.args, self.resumed, self.before = args, resumed, None

    def on_train_begin(self, args, state, control, **kwargs):
        from finetune_kit.training.samples import answers_before

        self.before = answers_before(self.trainer.accelerator, self.trainer.model_wrapped, self.tokenizer,
                                     self.template, self.prompts, self.args, resumed=self.resumed)


def answers_before(trainer, tokenizer, template, prompts, args, resumed: bool) -> AnswersBefore:
    """The callback that answers ``prompts`` before the first step (``.before`` once ``train()`` began)."""
    callback = AnswersBefore(trainer, tokenizer, template, prompts, args, resumed)
    trainer.add_callback(callback)
    return callback


def held_out(trainer) -> list[dict]:
    """The held-out pairs' figures (:func:`evaluation`) before the first step and after the last, as
    ``run_info.json``'s ``evals``: the first from the evaluation at the start of the fresh run's ``train()`` (kept in
    the Trainer's log history, which a resumed run reads back from its checkpoint), the last evaluated now."""
    after = {"step": trainer.state.global_step, "epoch": trainer.state.epoch, **evaluation(trainer.evaluate())}
    first = next((e for e in trainer.state.log_history if e.get("step") == 0 and "eval_loss" in e), None)
    return ([{"step": 0, "epoch": 0.0, **evaluation(first)}] if first else []) + [after]


def evaluation(logs: dict) -> dict:
    """An evaluation's log under our names: loss, and the preference figures (accuracy, margin, ...)."""
    return {"eval_loss": logs.get("eval_loss"), **{f"eval_{k}": v for k, v in keys.preference(logs, "eval_").items()}}
