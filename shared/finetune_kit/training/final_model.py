"""What a run leaves at the end: the consolidated model, the Trainer's model, or the LoRA adapter.

Each is written whole or not at all (``outputs.written_whole``: an interrupted write leaves the
previous copy in place). Every rank calls; one writes. A disk without room for it stops the run before
the write, and a disk that fills during it stops every rank with one line (``disk_full``); the last
checkpoint is kept, and the same command resumes there and writes it.

    <output>/model/     consolidated 16-bit safetensors + tokenizer (full fine-tunes), loadable
                        with plain ``AutoModelForCausalLM.from_pretrained``; the tokenizer carries the
                        chat template the run trained with and ``generation_config.json`` stops at its
                        end of turn, so plain ``generate`` ends an answer where training taught it to
    <output>/adapter/   LoRA adapter (+ the classification head, or a resized vocabulary's embeddings) + tokenizer
                        (``--peft lora|qlora``), loadable with ``PeftModel.from_pretrained(base, adapter)``
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from finetune_kit.models import qlora
from finetune_kit.outputs import written_whole
from finetune_kit.training.checkpointing.checkpoints import list_checkpoints, same_on_every_rank
from finetune_kit.training.disk_full import DiskFull, room_for, short_of_room


def save_consolidated(accelerator, model, tokenizer, out: Path, template=None) -> Path:
    """Gather the full 16-bit weights (ZeRO-3: needs stage3_gather_16bit_weights_on_model_save)
    and write safetensors plus tokenizer. All ranks must call; rank 0 writes. FSDP2 keeps fp32
    weights (its master copy): they are written in the model's own dtype (``config.dtype``, bf16
    for Llama), as DeepSpeed writes its 16-bit weights. ``template``: the run's chat template
    (:func:`chat_ready`)."""
    import torch

    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    dtype = getattr(unwrapped.config, "dtype", None)  # what the model was loaded as
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if accelerator.is_main_process and state_dict and isinstance(dtype, torch.dtype):
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    with _in_room(accelerator, Path(out), _bytes(state_dict)):
        if accelerator.is_main_process:
            with written_whole(out) as folder:
                unwrapped.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
                if isinstance(dtype, torch.dtype):  # save_pretrained records the modules' dtype (FSDP2: fp32)
                    unwrapped.config.dtype = dtype
                    unwrapped.config.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                if template is not None:
                    chat_ready(folder, tokenizer, template)
        accelerator.wait_for_everyone()
    return Path(out)


def _bytes(state_dict: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values()) if state_dict else 0


@contextmanager
def _in_room(accelerator, out: Path, needed: int) -> Iterator[None]:
    """The final save of ``out`` (about ``needed`` bytes on rank 0, the writer), every rank in: refused before
    it starts where its disk has not the room, and stopped in one line where it fills during it
    (:func:`~finetune_kit.training.disk_full.room_for`); the run's newest checkpoint is named in both."""
    needed = same_on_every_rank(accelerator, needed)
    newest = list_checkpoints(out.parent)
    before = f"the {out.name}/ saved before is kept; " if out.is_dir() else ""
    kept = (f"Free space on that disk or point --output at a larger one; {before}relaunch the same command: it "
            + (f"resumes from the run's newest checkpoint, {newest[-1]}, and writes {out.name}/." if newest else
               "trains the run again (it saved no checkpoint)."))
    short = short_of_room(out.parent, needed) if accelerator.is_main_process else None
    short = same_on_every_rank(accelerator, short)
    if short:
        raise DiskFull(f"{out.name}/ was not written: '{out.parent}' has no room for it: {short}. {kept}")
    with room_for(out.parent, out.with_name(out.name + ".partial"), needed, what=f"{out.name}/", kept=kept,
                  writer=accelerator.is_main_process):
        yield


def save_trainer_model(trainer, out: Path, template=None) -> Path:
    """The HF Trainer's consolidated model in ``out``, put in place only once complete (all ranks
    call it; the Trainer writes on rank 0). ``template``: the run's chat template (:func:`chat_ready`)."""
    with written_whole(Path(out), writer=trainer.args.should_save) as folder:
        trainer.save_model(str(folder))
        if template is not None and trainer.args.should_save:
            chat_ready(folder, trainer.processing_class, template)
    return Path(out)


def chat_ready(folder: Path, tokenizer, template) -> None:
    """Make the saved model in ``folder`` answer as it trained: the tokenizer with ``template`` as its chat
    template (``apply_chat_template`` renders what training rendered) and ``generation_config.json`` whose stop
    tokens are the template's end of turn and the EOS (a base model's config has only its EOS, so a chat-tuned
    model would run past the end of its answer)."""
    from transformers import GenerationConfig

    from finetune_kit.data.templates import end_of_turn_ids

    tokenizer.chat_template = template.source
    tokenizer.save_pretrained(folder)
    path = Path(folder) / "generation_config.json"
    config = GenerationConfig.from_pretrained(folder) if path.is_file() else GenerationConfig()
    config.eos_token_id = end_of_turn_ids(tokenizer, template)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.save_pretrained(folder)


def save_trained(accelerator, model, tokenizer, checked, template=None) -> Path:
    """What the run trained, by its method (``checked.tuning``): ``adapter/`` for adapters (``--peft lora|qlora``),
    else the consolidated ``model/``. All ranks must call."""
    if checked.tuning.adapted:
        return save_adapter(accelerator, model, tokenizer, checked.output / "adapter", template,
                            base_vocab=checked.model_config.vocab_size)
    return save_consolidated(accelerator, model, tokenizer, checked.output / "model", template)


def save_adapter(accelerator, model, tokenizer, out: Path, template=None, *, base_vocab: int | None = None) -> Path:
    """Write the LoRA adapter and the head, if any (``adapter_model.safetensors``), plus tokenizer.

    Loadable with ``PeftModel.from_pretrained(base, out)``. All ranks must call; rank 0 writes. A vocabulary grown
    past the base's ``base_vocab`` (a pad token added) saves its embeddings and head with the adapter, which then
    loads over the base resized to the tokenizer. ``template``: a causal LM's chat template (:func:`chat_ready`).
    """
    unwrapped = accelerator.unwrap_model(model)
    embeddings = unwrapped.get_input_embeddings()
    resized = (embeddings.weight, unwrapped.get_output_embeddings().weight) \
        if base_vocab is not None and embeddings.num_embeddings > base_vocab else ()
    state = qlora.trainable_state_dict(unwrapped, also=resized)
    if accelerator.is_main_process:
        empty = [name for name, t in state.items() if t.numel() == 0]
        if empty:
            raise RuntimeError(f"adapter tensors are empty after gathering: {empty[:3]}")
    with _in_room(accelerator, Path(out), _bytes(state) if accelerator.is_main_process else 0):
        if accelerator.is_main_process:
            with written_whole(out) as folder:  # an interrupted write leaves the previous adapter whole
                unwrapped.save_pretrained(folder, state_dict=state, safe_serialization=True,
                                          save_embedding_layers=bool(resized))
                tokenizer.save_pretrained(folder)
                if template is not None:
                    chat_ready(folder, tokenizer, template)
        accelerator.wait_for_everyone()
    return Path(out)


def save_merged(checked, adapter: Path, *, dtype: str = "bfloat16", labels: dict[int, str] | None = None) -> Path:
    """``merged/``: the run's adapter folded into its base loaded in ``dtype`` (:func:`qlora.merge_adapter`), and
    the model cards written again to name it. One process (rank 0), after the run has left ZeRO-3."""
    from finetune_kit import model_card

    merged = qlora.merge_adapter(checked.script_args["model"], adapter, checked.output / "merged",
                                 dtype=qlora.parse_dtype(dtype, "--dtype"), labels=labels)
    print(f"merged model saved to {merged}; model card: {model_card.write(checked.output)[-1]}")
    return merged

