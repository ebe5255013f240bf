"""The heldout task of an instruction run, end to end: the CLI's token perplexity of the answers equals one
computed here with transformers alone, and the tolerance is tight enough to see one token miscounted."""

from __future__ import annotations

import json
import math

import pytest
import torch

from finetune_kit.data import templates
from finetune_kit.data.formats import Conversation
from finetune_kit.data.loss_mask import tokenize_conversation
from finetune_kit.losses import IGNORE_INDEX
from tests.unit.harness.conftest import CONVERSATIONS, run_harness, summary

# Measured: the harness (fp32, CPU; batches of 1, 3 or 8 conversations alike) and the one-conversation-at-a-time
# forward below agree to 3.0e-8 relative on the perplexity (4.8e-9 on the loss); 1e-5 leaves ~300x that. The
# negative controls move the perplexity by 5.7e-3 relative (the EOS token left out) and 0.12 (one answer token
# fewer counted): 570x and 12,000x the tolerance.
RTOL = 1e-5


def reference(model_dir, *, with_eos: bool = True, uncounted: int = 0) -> dict:
    """The answers' token perplexity from a plain forward pass over each whole rendered conversation (+ EOS):
    the negative log-likelihood summed over the tokens after the rendered prompt, exp(sum / count)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count, greedy, answers = 0.0, 0, 0, []
    for messages in CONVERSATIONS:
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        if with_eos and not text.endswith(tokenizer.eos_token):  # Llama 2's turns end with EOS already
            text += tokenizer.eos_token
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes BOS
        start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == (tokenizer.eos_token_id if with_eos else ids[-1])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        positions, answer = torch.arange(start - 1, len(ids) - 1), torch.tensor(ids[start:])
        nll -= logprobs[positions, answer].sum().item()
        count += len(answer)
        greedy += bool((logprobs[positions].argmax(-1) == answer).all())
        answers.append(ids[start:])
    count -= uncounted
    return {"perplexity": math.exp(nll / count), "loss": nll / count, "acc": greedy / len(CONVERSATIONS),
            "tokens": count, "answers": answers}


@pytest.fixture(scope="module")
def evaluated(instruction_run):
    proc = run_harness(str(instruction_run), "--device", "cpu", "--batch-size", "3")
    return instruction_run, proc


def test_the_perplexity_of_the_answers_equals_a_plain_forward_pass(evaluated):
    run, proc = evaluated
    got = summary(run)
    expected = reference(run / "model")
    heldout = got["tasks"]["heldout"]
    assert heldout["perplexity"] == pytest.approx(expected["perplexity"], rel=RTOL)
    assert heldout["loss"] == pytest.approx(expected["loss"], rel=RTOL)
    assert heldout["acc"] == expected["acc"]
    assert got["device"] == "cpu" and got["dtype"] == "float32" and got["limit"] is None and got["lm_eval"] == "0.4.13"
    assert got["model"] == str(run / "model")
    documents = [json.loads(line) for line in (run / "eval/tasks/heldout.jsonl").read_text().splitlines()]
    assert sum(d["answer_tokens"] for d in documents) == expected["tokens"]
    assert "heldout  perplexity" in proc.stdout and "nats/token" in proc.stdout  # the table
    card = (run / "model/README.md").read_text()  # the model card shows the summary
    assert f"| heldout | perplexity | {heldout['perplexity']:.4g} |" in card and "model cards: " in proc.stdout
    assert json.loads((run / "eval/results.json").read_text())["heldout"]["results"]["heldout"]["sample_len"] == 4


def test_the_tolerance_sees_a_missing_eos_and_one_token_miscounted(evaluated):
    run, _ = evaluated
    got = summary(run)["tasks"]["heldout"]["perplexity"]
    for wrong in (reference(run / "model", with_eos=False), reference(run / "model", uncounted=1)):
        assert abs(wrong["perplexity"] - got) > 100 * RTOL * got


def test_the_scored_tokens_are_the_ones_training_learnt_of_the_last_answer(evaluated):
    """Each document's answer tokens are the labelled tokens of the conversation's last answer in training's own
    tokenisation (finetune_kit.data.instructions): the answer's text, <|eot_id|> and EOS."""
    from transformers import AutoTokenizer

    run, _ = evaluated
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    template = templates.ChatTemplate("tokenizer's own", tokenizer.chat_template)
    expected = reference(run / "model")["answers"]
    samples = [json.loads(line) for line in (run / "eval/samples/heldout.jsonl").read_text().splitlines()]
    for messages, answer, sample in zip(CONVERSATIONS, expected, samples, strict=True):
        example, _ = tokenize_conversation(tokenizer, template, Conversation(messages), max_seq_len=512)
        labels = example["labels"]
        last_answer = labels[max(i for i, label in enumerate(labels) if label == IGNORE_INDEX) + 1:]
        assert last_answer == answer
        assert sample["doc"]["answer_tokens"] == len(answer)
        assert tokenizer.convert_ids_to_tokens(answer[-2:]) == ["<|eot_id|>", tokenizer.eos_token]
        context, continuation = sample["arguments"][0]
        assert context.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert continuation == f"{messages[-1]['content']}<|eot_id|>{tokenizer.eos_token}"


def test_lm_evals_own_hf_model_would_score_the_headers_newlines_as_answer(evaluated):
    """Why the heldout task runs through ``finetune-hf``: HFLM moves the context's trailing whitespace (the
    template's ``\\n\\n`` after the assistant header) into the continuation, so the answer would count two more
    tokens here; with the tokenizer's BOS it adds nothing twice (it sees the template's)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune_tools.harness.causal import ChatTurnLM, encode_pair

    run, _ = evaluated
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    model = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32)
    document = json.loads((run / "eval/tasks/heldout.jsonl").read_text().splitlines()[0])
    context, target = document["context"], document["target"]
    plain = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)._encode_pair(context, target)
    ours = ChatTurnLM(pretrained=model, tokenizer=tokenizer, batch_size=1)._encode_pair(context, target)
    assert ours == encode_pair(tokenizer, context, target) and len(ours[1]) == document["answer_tokens"]
    assert tokenizer.convert_ids_to_tokens(plain[1][:2]) == ["Ċ", "Ċ"] and plain[1][2:] == ours[1]
    assert plain[0] + plain[1] == ours[0] + ours[1] and ours[0].count(tokenizer.bos_token_id) == 1


def test_a_llama2_run_scores_each_answer_with_the_eos_its_turn_ends_with(tmp_path, tiny_llama2):
    """The 13B recipe's template ends every answer with ``</s>`` (EOS) itself: the target gets no second one."""
    import shutil

    from transformers import AutoTokenizer

    from tests.unit.harness.conftest import write_jsonl

    run = tmp_path / "llama2-13b-zero2"
    shutil.copytree(tiny_llama2, run / "model")
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    tokenizer.chat_template = templates.SHIPPED["llama2"].read_text()
    tokenizer.save_pretrained(run / "model")
    write_jsonl(run / "heldout.jsonl", [{"example_id": n, "messages": m} for n, m in enumerate(CONVERSATIONS)])
    run_harness(str(run), "--device", "cpu")
    expected = reference(run / "model")
    assert summary(run)["tasks"]["heldout"]["perplexity"] == pytest.approx(expected["perplexity"], rel=RTOL)
    targets = [json.loads(line)["target"] for line in (run / "eval/tasks/heldout.jsonl").read_text().splitlines()]
    assert targets[0] == " Paris is the capital of France. </s>"
