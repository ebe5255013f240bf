"""fp8 against bf16 as measured on one H100 (results/runs/fp8/): the pairs, the planner's fp8 cost fitted on them,
the figures the recipe prints, and the pairing rules on a made-up command."""

import json
import shutil
from dataclasses import replace

import pytest

from finetune_kit.models import fp8
from finetune_kit.planning.speed import calibrated
from finetune_tools.planning.fp8_speed import fp8_cost
from finetune_tools.results import calibration, fp8_pairs
from tests.harness import REPO

RESULTS = REPO / "results"
EFFICIENCY = calibration.fitted_efficiency(RESULTS)


def summary_rows() -> dict[tuple[str, str], dict]:
    return {(path.stem, row["run"]): row for path in sorted((RESULTS / fp8_pairs.FOLDER).glob("*.json"))
            for row in json.loads(path.read_text())["cases"] if "run" in row}


def test_every_finished_fp8_row_pairs_with_the_bf16_row_of_its_own_command():
    found = fp8_pairs.pairs(RESULTS)
    rows = summary_rows()
    fp8_rows = {key for key, row in rows.items() if "--fp8" in row.get("extra_flags", []) and row["status"] == "ok"}
    assert {(p.command, p.run) for p in found} == fp8_rows and len(found) >= 3
    for pair in found:
        assert pair.speedup == pytest.approx(rows[pair.command, pair.run]["speedup"], rel=1e-9)  # as the run printed
        assert rows[pair.command, pair.baseline]["extra_flags"] == [f for f in pair.row["extra_flags"]
                                                                    if f not in ("--fp8", pair.scaling)]
        assert pair.job.shape.num_hidden_layers == pair.row["layers"] and pair.job.seq_len == pair.row["seq_len"]
        assert pair.engine == ("FSDP2" if "fsdp2" in pair.row["case"] else "ZeRO-3")


def test_the_fitted_planner_reproduces_each_measured_pair_and_the_published_fit_does_not():
    found = fp8_pairs.pairs(RESULTS)
    fitted = replace(EFFICIENCY, fp8_overhead=fp8_pairs.fitted(found, EFFICIENCY))
    published = replace(EFFICIENCY, fp8_overhead={})
    for pair in found:
        assert fp8_pairs.predicted_speedup(pair, fitted) == pytest.approx(pair.speedup, rel=1e-6)
    # the negative control: fitted on torchao's published pair (and the assumed unfused casts), the planner
    # missed every measured pair by more than 10%, the uncompiled one by more than 40%
    misses = {p.key: fp8_pairs.predicted_speedup(p, published) / p.speedup - 1 for p in found}
    assert all(miss > 0.10 for miss in misses.values()), misses
    assert misses["tensorwise uncompiled"] > 0.40


def test_the_calibration_file_holds_the_costs_fitted_on_the_records():
    written, _ = calibrated()
    fitted = fp8_pairs.fitted(fp8_pairs.pairs(RESULTS), EFFICIENCY)
    assert written.fp8_overhead == {k: float(f"{v:.4g}") for k, v in fitted.items()}
    for key in fitted:
        scaling, compiled = key.split()
        assert fp8_cost(scaling, compiled == "compiled", written)[1] == "fitted on a measured pair"


def test_the_figures_the_recipe_prints_are_the_measured_ones():
    """The runtime's copy (an image has no results/) is what `make results` regenerates from the records."""
    assert (REPO / fp8_pairs.PACKAGED).read_text() == fp8_pairs.speedup_json(RESULTS), "run 'make results'"
    assert fp8.SPEEDUP_FILE.read_text() == (REPO / fp8_pairs.PACKAGED).read_text()  # installed: as package data
    assert fp8.measured_speedup() == {(p.scaling, p.compiled): p.speedup for p in fp8_pairs.pairs(RESULTS)}
    assert "measured 0.61x" in fp8.speed_note("tensorwise", False) and "slower" in fp8.speed_note("tensorwise", False)
    assert fp8.speed_note("tensorwise", True).endswith("faster")


def test_a_row_pairs_only_with_a_finished_baseline_of_its_own_command(tmp_path):
    folder = tmp_path / fp8_pairs.FOLDER
    shutil.copytree(RESULTS / fp8_pairs.FOLDER, folder)
    command = folder / "2026-11-27-h100-1.json"
    data = json.loads(command.read_text())
    for row in data["cases"]:
        if row["run"] == "8b-fsdp2-compile-bf16":
            row.update(status="failed", tokens_per_s_per_device=None)
    command.write_text(json.dumps(data))
    commands = {p.command for p in fp8_pairs.pairs(tmp_path)}
    assert commands == {"2026-11-27-h100-2"}  # the compiled fp8 rows lost their baseline; no other command's
    assert fp8_pairs.table(tmp_path.parent / "nothing", EFFICIENCY) == ["None measured yet."]
