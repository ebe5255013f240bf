"""The 8B shape's lever commands in results/runs/mfu/: the results page's table, the full-depth verdict beside each
row, and which of their records join the speed model's fit."""

from __future__ import annotations

import json

from finetune_kit.metering.run_record import RunRecord
from finetune_kit.planning.verdict import plan
from finetune_tools.results import calibration, lever_runs
from tests.harness import REPO

RESULTS = REPO / "results"


def test_every_finished_row_is_a_line_with_its_speed_up_against_a_row_of_its_command():
    found = lever_runs.rows(RESULTS)
    assert len(found) >= 8
    for command, row in found:
        summary = json.loads((RESULTS / lever_runs.FOLDER / f"{command}.json").read_text())
        names = {r["run"]: r for r in summary["cases"]}
        base = names[row["baseline"]]  # a row of the same command
        assert row["speedup"] == row["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
    table = "\n".join(lever_runs.table(RESULTS))
    assert all(f"`{row['run']}`" in table for _, row in found)


def test_the_full_depth_verdict_is_the_planners_for_the_rows_own_settings():
    rows = {row["run"]: row for _, row in lever_runs.rows(RESULTS)}
    base, nockpt = rows["8b-mb2-ga4"], rows["8b-mb4-ga4-nockpt"]
    setup = lever_runs.full_depth_setup(nockpt)
    assert (setup.micro_batch, setup.gradient_checkpointing, setup.gpus_per_node, setup.gpu_memory_GiB) == \
        (4, False, 8, 80.0)
    assert lever_runs.full_depth_setup(rows["8b-mb4-ga4-ckpt2"]).recompute_every == 2
    assert lever_runs.full_depth_setup(rows["8b-fsdp2-mb4-ga4-nockpt-compile"]).engine == "fsdp2"
    # keeping all 32 layers' activations is what makes micro-batch 4 without checkpointing not fit
    assert plan("llama3-8b", lever_runs.full_depth_setup(base)).fits
    assert not plan("llama3-8b", setup).fits


def test_only_records_the_speed_model_can_describe_join_its_fit():
    records = {p.stem: RunRecord.read(p) for p in sorted((RESULTS / "runs/mfu/records").glob("*/*.json"))}
    joined = {o.name for o, _ in calibration.measured_observations(RESULTS / "runs/mfu/records", "*/*.json",
                                                                     only_plain=True)}
    assert joined == set(records) - {"8b-packed-varlen", "8b-padded"}
    # negative control: every one of the others packs its rows or pads them
    for name in set(records) - joined:
        assert not calibration.plain(records[name]), name
    assert calibration.plain(records["8b-mb2-ga4"]) and not calibration.plain(records["8b-padded"])  # 17% padding
