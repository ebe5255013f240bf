"""StepReport: what an accelerate loop logs per optimizer step (one process, no launcher)."""

import json
from types import SimpleNamespace

import pytest
import torch

from finetune_kit.metering.flops import FlopCounter
from finetune_kit.metering.step_report import StepReport
from finetune_kit.models.shapes import ModelShape

TINY = ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)


def one_process():
    return SimpleNamespace(num_processes=1, trackers=[], is_main_process=True, is_local_main_process=False,
                           device=torch.device("cpu"), reduce=lambda t, op: t)


def test_a_steps_loss_is_the_sum_of_its_micro_batches_token_shares_and_every_nth_is_logged(tmp_path):
    """Each micro-batch's loss is its token-loss sum over the step's labelled tokens (training.steps)."""
    report = StepReport(one_process(), FlopCounter(TINY), tmp_path, total_steps=3, initial_step=0, log_every=2)
    losses = [(2.0, 4.0), (3.0, 1.0), (1.0, 1.0)]
    for step, (a, b) in enumerate(losses, start=1):
        report.micro_batch(torch.tensor(a), {"attention_mask": torch.tensor([[1, 1, 1, 0]])})
        report.micro_batch(torch.tensor(b), {"attention_mask": torch.tensor([[1, 1, 0, 0]])})
        record = report.optimizer_step(step, epoch=0, lr=1e-3)
        assert record["loss"] == pytest.approx(a + b) and record["tokens"] == 5
        assert record["padding_fraction"] == pytest.approx(3 / 8)
    report.close()
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [2, 3]  # every 2nd step, and the last
    assert len(report.meter.history) == 3  # every step is metered for the run record


def test_the_endpoint_gets_every_step_and_this_ranks_tokens(tmp_path):
    from tests.unit.training.test_trainer_metrics import FakeEndpoint

    endpoint = FakeEndpoint()
    report = StepReport(one_process(), FlopCounter(TINY), tmp_path, total_steps=3, initial_step=0, log_every=2,
                        endpoint=endpoint)
    for step in (1, 2, 3):
        report.micro_batch(torch.tensor(1.5), {"attention_mask": torch.tensor([[1, 1, 1, 0]])})
        report.optimizer_step(step, epoch=0, lr=1e-3)
    report.close()
    assert [r["step"] for r in endpoint.records] == [1, 2, 3]  # logged or not
    assert endpoint.records[0]["loss"] == pytest.approx(1.5) and endpoint.tokens == 9
