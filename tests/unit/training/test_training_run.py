"""A run's bookkeeping that needs no DeepSpeed: the position, the schedule, the split's ids, trainable counts;
and the per-rank partition report of run_info.json."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from finetune_kit.errors import ConfigError
from finetune_kit.training.checkpointing.partitions import parameter_partition, rank_report
from finetune_kit.training.loop import Position, Schedule
from finetune_kit.training.records import DataSplit, describe_eval, example_ids, trainable_parameters


def test_position_as_dict_and_fresh_run_defaults():
    assert Position(step=7, epoch=1, batch_in_epoch=12).as_dict() == {"step": 7, "epoch": 1, "batch_in_epoch": 12}
    assert Position().as_dict() == {"step": 0, "epoch": 0, "batch_in_epoch": 0}


def test_example_ids_from_either_column():
    import datasets

    packed = datasets.Dataset.from_dict({"example_ids": [[4, 9], [2], [7, 1, 3]], "input_ids": [[1], [2], [3]]})
    single = datasets.Dataset.from_dict({"example_id": [5, 0, 8], "input_ids": [[1], [2], [3]]})
    assert example_ids(packed) == [4, 9, 2, 7, 1, 3]
    assert example_ids(single) == [5, 0, 8]
    assert DataSplit.of(packed, single) == DataSplit(3, [5, 0, 8])
    assert DataSplit.of(single) == DataSplit(3, [])


def test_trainable_parameters_skip_frozen_and_read_zero3_full_sizes():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # 12 frozen
    assert trainable_parameters(model) == 4 + 8 + 2
    model[1].weight.ds_numel = 1000  # ZeRO-3: p.numel() is this rank's placeholder, ds_numel the full size
    assert trainable_parameters(model) == 4 + 1000 + 2


def test_describe_eval():
    assert describe_eval({"eval_loss": 0.693147}) == "loss 0.6931"
    assert describe_eval({"eval_loss": 1.5, "eval_accuracy": 0.75}) == "loss 1.5000, accuracy 0.750"
    assert describe_eval({"eval_loss": 1.5, "eval_accuracy": None}) == "loss 1.5000"


@pytest.mark.parametrize(("examples", "world", "grad_accum", "epochs", "max_steps", "per_epoch", "total"), [
    (10, 1, 1, 1, 0, 5, 5),     # 5 micro-batches of 2
    (10, 2, 1, 3, 0, 2, 6),     # global batches of 4: the last 2 examples make no step (no repeats to fill it)
    (10, 2, 2, 3, 0, 1, 3),     # global batches of 8
    (11, 1, 2, 4, 5, 2, 5),     # max_steps caps 8
    (10, 1, 2, 4, 20, 2, 8),    # max_steps above the plan changes nothing
    (10, 1, 1, 2, None, 5, 10),
])
def test_the_schedule(examples, world, grad_accum, epochs, max_steps, per_epoch, total):
    args = SimpleNamespace(micro_batch_size=2, grad_accum=grad_accum, epochs=epochs, max_steps=max_steps)
    assert Schedule.plan(examples, args, world) == Schedule(per_epoch, total)


def test_no_full_step_names_the_numbers_and_the_flags():
    args = SimpleNamespace(micro_batch_size=2, grad_accum=4, epochs=1, max_steps=None)
    with pytest.raises(ConfigError, match=r"^10 training examples make no full optimizer step of 2 x 4 x 2 "
                                          r"processes; lower --micro-batch-size or --grad-accum, or add data\.$"):
        Schedule.plan(10, args, 2)  # a global batch of 16


# ---- partitions ----

def test_plain_model_is_held_whole():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))
    assert parameter_partition(model) == {"local": 24, "total": 24, "partitioned_params": 0}


def test_zero3_parameter_counts_only_its_shard_as_local():
    model = nn.Linear(4, 2)  # weight 8, bias 2
    model.weight.ds_numel = 8
    model.weight.ds_tensor = torch.zeros(4)  # this rank's half
    assert parameter_partition(model) == {"local": 4 + 2, "total": 10, "partitioned_params": 1}


def engine(stage: int, module: nn.Module, optimizer=None):
    return SimpleNamespace(parameters=module.parameters, module=module, optimizer=optimizer,
                           zero_optimization_stage=lambda: stage)


def test_rank_report_under_zero3_has_no_optimizer_entry():
    model = nn.Linear(3, 2)
    assert rank_report(engine(3, model)) == {"params": {"local": 8, "total": 8, "partitioned_params": 0}}


def test_rank_report_under_zero2_counts_this_ranks_masters_and_adam_state():
    model = nn.Linear(3, 2)  # 8 parameters; this rank's flat fp32 partition holds 5 of them
    master = nn.Parameter(torch.zeros(5))
    adam = torch.optim.Adam([master])
    master.grad = torch.ones(5)
    adam.step()  # exp_avg, exp_avg_sq (5 each) and a scalar step
    zero_opt = SimpleNamespace(single_partition_of_fp32_groups=[master], optimizer=adam)
    report = rank_report(engine(2, model, zero_opt))
    assert report["params"] == {"local": 8, "total": 8, "partitioned_params": 0}
    assert report["optimizer"] == {"fp32_master_local": 5, "adam_state_local": 10, "params_total": 8,
                                   "optimizer": "Adam", "master_device": "cpu"}
