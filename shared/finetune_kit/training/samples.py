"""Sample answers: what the model says to a few held-out prompts, after training and (``--sample-before``) before.

A validation loss says the model fits the held-out answers better; a sample says what it answers. At the end
of a run the final model answers ``--samples`` prompts (the first held-out rows, or every row of
``--sample-prompts FILE``), rendered with the chat template the run trained with, greedy, at most
``--sample-tokens`` new tokens each, stopping at the template's end of turn. They are printed, written to
``samples.jsonl`` in the run folder and kept in the run record; ``--sample-before`` answers the same prompts
with the model as loaded, before the first step, so the change shows side by side (and, given the validation
data, takes its loss then too).

A verdict line follows (:func:`verdict`): how many answers take their reference's form (:func:`form`: the words
with what varies from row to row masked, so "23 plus 67 is 80." has the form of "23 plus 67 is 90.") and how
many are word for word, before and after, and the validation loss before and after. A tiny model learns the form
of the answers long before their content: the line says which of the two a run reached.

Where the weights are sharded (ZeRO-3, FSDP2) every rank generates the same batch with ``synced_gpus``: each
forward gathers the layers' weights as training does, one layer at a time, so no rank ever holds the whole
model; it costs one all-gather of the weights per generated token (``--sample-tokens`` forwards for the whole
batch: seconds on NVLink for an 8B; the log says how long it took). Attention runs through SDPA while
generating (the packed-rows and sequence-parallel kernels expect training's inputs) and is restored after.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from finetune_kit import outputs
from finetune_kit.launch import env

PROMPT_CHARS = 70  # of a prompt or answer, on the printed side-by-side lines


@dataclass(frozen=True)
class Prompt:
    """One prompt to answer: the conversation up to the answer, rendered and tokenised, and the reference."""

    example_id: int | None  # the source row (held-out rows), or None (a --sample-prompts file)
    messages: list[dict]  # up to the last answer: a user turn, or a tool's result
    text: str  # rendered with the generation prompt (and the row's tool schemas)
    input_ids: list[int]
    reference: str | None  # the row's own answer, when it has one


def sample_prompts(args, heldout: list, tokenizer, template) -> list[Prompt]:
    """The prompts of this run: every row of ``args.sample_prompts`` (any supported data format), or the first
    ``args.samples`` held-out conversations (``heldout``: :func:`finetune_kit.data.heldout_rows`'
    :class:`~finetune_kit.data.formats.Conversation` list). Each is cut before its last assistant turn, which
    becomes the reference (a tool call: as the template writes it); a row's tool schemas render with it. A prompt
    longer than ``args.max_seq_len`` tokens keeps its last ``max_seq_len`` (the end of the conversation and the
    generation prompt), as ``make eval`` does: no sequence longer than the run trained on (measured on an H100:
    held-out conversations of 17,600 tokens after training at 4,096 took the 8B's peak from 36 to 45 GiB)."""
    from finetune_kit.data import instructions, templates

    if not args.samples:
        return []
    if args.sample_prompts:
        rows = instructions.load_rows(args.sample_prompts, flag="--sample-prompts")
        conversations = [rows.format.read(row) for row in rows.rows]  # no example_id: not rows of --data
    else:
        conversations = heldout[: args.samples]
    prompts = []
    for conversation in conversations:
        reference = None
        if conversation.messages and conversation.messages[-1]["role"] == "assistant":
            reference = _reference(tokenizer, template, conversation)
            conversation = conversation.before(-1)
        text = templates.render(tokenizer, template, conversation.messages, generation_prompt=True,
                                tools=conversation.tools)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if limit := getattr(args, "max_seq_len", None):
            ids = ids[-limit:]
        prompts.append(Prompt(conversation.example_id, conversation.messages, text, ids, reference))
    return prompts


def _reference(tokenizer, template, conversation) -> str:
    """The last answer of ``conversation``: its text, or, for a tool call, the call as the template writes it
    (what a model that learnt it says), without the template's special tokens."""
    from finetune_kit.data import templates

    last = conversation.messages[-1]
    if last["content"].strip() or not last.get("tool_calls"):
        return last["content"]
    *_, (turn, _) = templates.segments(tokenizer, template, conversation.messages, conversation.tools)
    return tokenizer.decode(tokenizer(turn, add_special_tokens=False)["input_ids"], skip_special_tokens=True).strip()


def answer(accelerator, model, tokenizer, template, prompts: list[Prompt], max_new_tokens: int) -> list[str]:
    """Greedy answers of ``model`` (prepared or not) to ``prompts``, one batch, left-padded; every rank calls
    and gets the same answers. The model is back in training mode afterwards."""
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import GenerationConfig

    from finetune_kit.data.templates import end_of_turn_ids
    from finetune_kit.models.compiled_layers import eager

    if not prompts:
        return []
    net = accelerator.unwrap_model(model)
    sharded = any(hasattr(p, "ds_id") or isinstance(p.data, DTensor) for p in net.parameters())  # ZeRO-3, FSDP2
    if not sharded and next(net.parameters()).device != accelerator.device:  # the HF Trainer places it later
        net.to(accelerator.device)
    device = next(net.parameters()).device
    longest = max(len(p.input_ids) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (longest - len(p.input_ids)) + p.input_ids for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p.input_ids)) + [1] * len(p.input_ids) for p in prompts],
                        device=device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end_of_turn_ids(
        tokenizer, template), pad_token_id=pad, use_cache=True)
    attention = net.config._attn_implementation
    was_training = model.training
    model.eval()
    net.set_attn_implementation("sdpa")
    try:
        with torch.no_grad(), eager():  # compiled layers (--compile): not compiled again per answer length
            out = net.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                               synced_gpus=sharded and accelerator.num_processes > 1)
    finally:
        net.set_attn_implementation(attention)
        model.train(was_training)
    return [tokenizer.decode(row[longest:], skip_special_tokens=True).strip() for row in out.tolist()]


@dataclass(frozen=True)
class Before:
    """The model as loaded: its answers to the sample prompts, and its validation loss when it was taken."""

    answers: list[str]
    eval_loss: float | None = None  # nats/token


def answers_before(accelerator, model, tokenizer, template, prompts: list[Prompt], args, resumed: bool,
                   eval_dl=None) -> Before | None:
    """``--sample-before``: the answers of the model as loaded, before the first step, and its validation loss
    over ``eval_dl`` when given (None when not asked, or when the run resumed: its model is no longer the one
    loaded). Every rank calls it (a sharded model's forward is collective)."""
    if not (args.sample_before and prompts):
        return None
    if resumed:
        accelerator.print("--sample-before: skipped, the run resumed from a checkpoint (the answers before training "
                          "are those of its first launch)")
        return None
    answers = _timed(accelerator, model, tokenizer, template, prompts, args.sample_tokens, "model as loaded")
    if eval_dl is None:
        return Before(answers)
    from finetune_kit.training.evaluation import evaluate_loss

    return Before(answers, evaluate_loss(model, eval_dl, accelerator))


def sample_answers(accelerator, model, tokenizer, template, prompts: list[Prompt], args, checked,
                   before: Before | None = None, evals: list[dict] | None = None) -> list[dict]:
    """The final model's answers to ``prompts``, printed beside ``before``'s and written to ``samples.jsonl`` in
    ``checked.output``, then the verdict (:func:`report`; ``evals``: the run's validations, the last one final);
    the rows, for the run record."""
    after = _timed(accelerator, model, tokenizer, template, prompts, args.sample_tokens, "final model")
    final = evals[-1].get("eval_loss") if evals else None
    losses = (before.eval_loss, final) if before and before.eval_loss is not None and final is not None else None
    return report(checked.output, prompts, after, before.answers if before else None, losses)


def _timed(accelerator, model, tokenizer, template, prompts, max_new_tokens: int, what: str) -> list[str]:
    started = time.perf_counter()
    answers = answer(accelerator, model, tokenizer, template, prompts, max_new_tokens)
    if prompts:
        accelerator.print(f"sample answers of the {what}: {len(prompts)} prompts, at most {max_new_tokens} new tokens "
                          f"each, {time.perf_counter() - started:.1f} s")
    return answers


def report(output: Path, prompts: list[Prompt], after: list[str], before: list[str] | None = None,
           losses: tuple[float, float] | None = None) -> list[dict]:
    """Print the prompts with their answers (and the answers before training), then :func:`verdict`, and write
    ``samples.jsonl`` (rank 0); return the rows (the run record keeps their :func:`figures`)."""
    rows = [{"example_id": p.example_id, "prompt": _last_turn(p.messages),
             "reference": p.reference, "answer": a, **({"before": before[i]} if before else {})}
            for i, (p, a) in enumerate(zip(prompts, after, strict=True))]
    if not rows or not env.is_main_rank():
        return rows
    outputs.write_text_whole(Path(output) / "samples.jsonl", outputs.jsonl(rows))
    print(f"\nsample answers ({len(rows)}, greedy; {Path(output) / 'samples.jsonl'}):")
    for row in rows:
        print(f"  prompt:    {_short(row['prompt'])}")
        if row["reference"] is not None:
            print(f"  reference: {_short(row['reference'])}")
        if "before" in row:
            print(f"  before:    {_short(row['before'])}")
        print(f"  after:     {_short(row['answer'])}\n")
    line = verdict(rows, losses)
    if line:
        print(line)
    return rows


def _last_turn(messages: list[dict]) -> str:
    """What a prompt ends with, as the sample lines show it: the user's text, or a tool's result, so marked."""
    if not messages:
        return ""
    last = messages[-1]
    if last["role"] == "tool":
        return f"(result of {last.get('name') or 'a tool'}) {last['content']}"
    return last["content"]


def form(text: str) -> str:
    """What an answer says with what varies from row to row masked: quoted words ('_'), numbers (#) and capitalised
    words after the first (names: "The capital of _ is _"); lower case, spaces and the closing stop normalised."""
    text = re.sub(r"-?\d+(\.\d+)?", "#", re.sub(r"'[^']*'", "'_'", " ".join(text.split()).rstrip(".!?")))
    return " ".join(w if i == 0 or not w[:1].isupper() else "_" for i, w in enumerate(text.split(" "))).lower()


def figures(rows: list[dict]) -> dict:
    """The sample answers in figures: prompts, those with a reference (scored), and how many answers take their
    reference's form (:func:`form`) and match it word for word, after training and (rows with ``before``)
    before. What the run record keeps of them (``RunRecord.samples``); the texts stay in samples.jsonl."""
    scored = [r for r in rows if r.get("reference")]
    out = {"prompts": len(rows), "scored": len(scored)}

    def counts(key: str) -> tuple[int, int]:
        same = [" ".join(r[key].split()).lower() == " ".join(r["reference"].split()).lower() for r in scored]
        return sum(form(r[key]) == form(r["reference"]) for r in scored), sum(same)

    if scored:
        out["form_after"], out["exact_after"] = counts("answer")
        if all("before" in r for r in scored):
            out["form_before"], out["exact_before"] = counts("before")
    return out


def verdict(rows: list[dict], losses: tuple[float, float] | None = None) -> str | None:
    """One line: how many answers take their reference's form (:func:`form`) and how many match it word for word,
    after training and (rows with ``before``) before; the validation loss before -> after. None without
    references (a --sample-prompts file without answers)."""
    got = figures(rows)
    if not got["scored"]:
        return None
    line = (f"verdict: {got['form_after']} of {got['scored']} held-out answers take the reference's form, "
            f"{got['exact_after']} word for word (after training)")
    if "form_before" in got:
        line += f"; before training {got['form_before']} and {got['exact_before']}"
    if losses:
        line += f"; validation loss {losses[0]:.3f} -> {losses[1]:.3f} nats/token"
    return line


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= PROMPT_CHARS else text[: PROMPT_CHARS - 3] + "..."
