"""StepMeter: what an accelerate loop records per optimizer step (one process, no launcher)."""

import json
from types import SimpleNamespace

import pytest
import torch

from finetune_kit.metering.flops import FlopCounter
from finetune_kit.metering.step_meter import StepMeter
from finetune_kit.models.shapes import ModelShape

TINY = ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)


def a_step(number: int, ids=(), seconds: float = 0.5):
    """What StepMeter reads of a training.loop.Step."""
    import time

    return SimpleNamespace(number=number, epoch=0, lr=1e-3, example_ids=list(ids),
                           started=time.perf_counter() - seconds, taken=False)


def one_process():
    return SimpleNamespace(num_processes=1, trackers=[], is_main_process=True, is_local_main_process=False,
                           device=torch.device("cpu"), reduce=lambda t, op: t)


def test_a_steps_loss_is_the_sum_of_its_micro_batches_token_shares_and_every_nth_is_logged(tmp_path):
    """Each micro-batch's loss is its token-loss sum over the step's labelled tokens (training.loop)."""
    meter = StepMeter(one_process(), FlopCounter(TINY), tmp_path, total_steps=3, initial_step=0, log_every=2)
    losses = [(2.0, 4.0), (3.0, 1.0), (1.0, 1.0)]
    for step, (a, b) in enumerate(losses, start=1):
        meter.micro_batch(torch.tensor(a), {"attention_mask": torch.tensor([[1, 1, 1, 0]])})
        meter.micro_batch(torch.tensor(b), {"attention_mask": torch.tensor([[1, 1, 0, 0]])})
        record = meter.step(a_step(step, ids=[step, 10 + step]), grad_norm=0.5)
        assert record["loss"] == pytest.approx(a + b) and record["tokens"] == 5 and record["grad_norm"] == 0.5
        assert record["padding_fraction"] == pytest.approx(3 / 8)
        assert record["step_time_s"] == pytest.approx(0.5, abs=0.2)  # from the step's start, not the last step's end
    meter.close()
    assert meter.seen_ids == [1, 11, 2, 12, 3, 13]
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [2, 3]  # every 2nd step, and the last
    assert len(meter.rates.history) == 3  # every step is metered for the run record


def test_the_endpoint_gets_every_step_and_this_ranks_tokens(tmp_path):
    from tests.unit.training.test_trainer_metrics import FakeEndpoint

    endpoint = FakeEndpoint()
    meter = StepMeter(one_process(), FlopCounter(TINY), tmp_path, total_steps=3, initial_step=0, log_every=2)
    meter.endpoint = endpoint
    for step in (1, 2, 3):
        meter.micro_batch(torch.tensor(1.5), {"attention_mask": torch.tensor([[1, 1, 1, 0]])})
        meter.step(a_step(step))
    meter.close()
    assert [r["step"] for r in endpoint.records] == [1, 2, 3]  # logged or not
    assert endpoint.records[0]["loss"] == pytest.approx(1.5) and endpoint.tokens == 9
