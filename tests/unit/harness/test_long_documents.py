"""Held-out rows longer than the run's --max-seq-len: ``make eval`` keeps each document within that length, and a
batch within BATCH_TOKENS tokens. On an H100 the harness ran out of memory before this, on four held-out
conversations of ~17,600 tokens (after training at 4,096): lm-eval's float32 log-softmax of one batch asked for
33.7 GiB. Here every forward the harness makes is recorded."""

from __future__ import annotations

import json
import shutil

import pytest

from finetune_tools.harness.inputs import BATCH_TOKENS, MAX_BATCH, default_batch_size
from tests.unit.harness.conftest import CONVERSATIONS, summary

MAX_SEQ_LEN = 40  # shorter than the longest held-out conversation (asserted), longer than every answer


@pytest.mark.parametrize("max_length, batch", [(None, MAX_BATCH), (512, MAX_BATCH), (4096, 4), (8192, 2),
                                               (17_600, 1), (131_072, 1)])
def test_the_default_batch_holds_at_most_batch_tokens(max_length, batch):
    assert default_batch_size(max_length) == batch
    assert max_length is None or batch == 1 or batch * max_length <= BATCH_TOKENS


@pytest.fixture
def forwards(monkeypatch) -> list[tuple[int, int]]:
    """(batch, length) of every forward lm-eval's HFLM makes in this process."""
    from lm_eval.models.huggingface import HFLM

    shapes, model_call = [], HFLM._model_call

    def recorded(self, inps, *args, **kwargs):
        shapes.append(tuple(inps.shape))
        return model_call(self, inps, *args, **kwargs)

    monkeypatch.setattr(HFLM, "_model_call", recorded)
    return shapes


def test_no_forward_is_longer_than_the_run_trained_on(instruction_run, tmp_path, forwards):
    from transformers import AutoTokenizer

    from finetune_tools.harness.__main__ import main

    run = tmp_path / "run"
    shutil.copytree(instruction_run, run, ignore=shutil.ignore_patterns("eval"))
    info = json.loads((run / "run_info.json").read_text())
    info["settings"]["max_seq_len"] = MAX_SEQ_LEN
    (run / "run_info.json").write_text(json.dumps(info))
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    longest = max(len(tokenizer(tokenizer.apply_chat_template(c, tokenize=False), add_special_tokens=False)
                      ["input_ids"]) for c in CONVERSATIONS)
    assert longest > MAX_SEQ_LEN  # without the cut, a forward would be this long

    assert main([str(run), "--device", "cpu"]) == 0
    assert forwards and max(length for _, length in forwards) <= MAX_SEQ_LEN, forwards
    assert max(batch for batch, _ in forwards) <= default_batch_size(MAX_SEQ_LEN)
    assert 0 < summary(run)["tasks"]["heldout"]["loss"] < 20  # every answer scored whole, after its cut context
