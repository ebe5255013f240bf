"""The ablation's fp8 rows (8B shape, torchao float8 linears), checked on CPU: each row's flags parse with
the recipe's own parser and launch the config its engine and precision need, each speed-up is against
the bf16 row of the same engine and compile setting, a row never lands in another command than its
baseline, the documented predicted total is the code's, and on a GPU without fp8 tensor cores the fp8
rows are recorded as not applicable while the others run."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import yaml

from finetune_kit.errors import ConfigError
from finetune_kit.models import fp8
from finetune_tools.gpu_check import ablation, host_check, runner
from finetune_tools.gpu_check.cases import BY_NAME, EVERY_CASE, FP8_FSDP2, recipe_flags
from tests.harness import REPO, load_script
from tests.unit.gpu_check.documented import assert_documented_total

ROWS = ablation.FP8_VARIANTS
COMMAND_S = 540  # one GPU command: 10 minutes, less a minute for the machine's start and the copies
FSDP2_COMPILE = ablation.BY_NAME["8b-fsdp2-mb2-ga4-compile"]  # the sizes every fp8 row shares
CONFIGS = REPO / "recipes" / "llama3-8b-zero3" / "configs"
# name: (launch config, --compile, --fp8)
EXPECTED = {  # the most informative block first: compiled FSDP2, then ZeRO-3, then uncompiled FSDP2
    "8b-fsdp2-compile-bf16": ("configs/fsdp2.yaml", True, "none"),
    "8b-fsdp2-compile-fp8-tensorwise": ("configs/fsdp2-fp8.yaml", True, "tensorwise"),
    "8b-fsdp2-compile-fp8-rowwise": ("configs/fsdp2-fp8.yaml", True, "rowwise"),
    "8b-zero3-bf16": ("configs/zero3.yaml", False, "none"),
    "8b-zero3-fp8-tensorwise": ("configs/zero3.yaml", False, "tensorwise"),
    "8b-fsdp2-bf16": ("configs/fsdp2.yaml", False, "none"),
    "8b-fsdp2-fp8-tensorwise": ("configs/fsdp2-fp8.yaml", False, "tensorwise"),
    "8b-fsdp2-fp8-rowwise": ("configs/fsdp2-fp8.yaml", False, "rowwise"),
}


def launch_config(variant) -> str:
    launcher = EVERY_CASE[variant.case].launcher
    return launcher[launcher.index("--config_file") + 1]


def test_the_rows_are_the_bf16_and_fp8_pairs_in_blocks_bf16_first():
    assert [v.name for v in ROWS] == list(EXPECTED)
    assert all(v in ablation.VARIANTS for v in ROWS) and ablation.VARIANTS[-len(ablation.LONG_VARIANTS):] == \
        ablation.LONG_VARIANTS  # the long-context probe stays last
    assert FP8_FSDP2 not in BY_NAME  # the plain check runs no fp8 case


@pytest.mark.parametrize("variant", ROWS, ids=lambda v: v.name)
def test_every_fp8_row_parses_with_the_recipes_own_parser_at_the_fsdp2_compile_rows_sizes(variant, monkeypatch):
    config, compiled, choice = EXPECTED[variant.name]
    case, sizes = EVERY_CASE[variant.case], EVERY_CASE[FSDP2_COMPILE.case]
    assert launch_config(variant) == config and (CONFIGS.parent / config).is_file()
    assert case.launcher[case.launcher.index("--num_processes") + 1] == "1"
    assert (case.recipe, case.arch, case.layers, case.seq_len) == (sizes.recipe, sizes.arch, sizes.layers,
                                                                   sizes.seq_len)
    assert (variant.micro_batch, variant.grad_accum, variant.seq_len, variant.steps) == (
        FSDP2_COMPILE.micro_batch, FSDP2_COMPILE.grad_accum, None, None)
    monkeypatch.chdir(REPO / "recipes" / case.recipe)
    flags = recipe_flags(case, model="m", data="d.jsonl", output="o", steps=8, seq_len=case.seq_len,
                         micro_batch=variant.micro_batch, grad_accum=variant.grad_accum)
    parsed = load_script(REPO / "recipes" / case.recipe / "train.py").parse_args([*flags, *variant.flags])
    assert (parsed.fp8, parsed.compile) == (choice, compiled)
    assert (parsed.micro_batch_size, parsed.grad_accum, parsed.max_seq_len) == (2, 4, 4096)
    assert parsed.gradient_checkpointing and not parsed.offload_activations
    assert host_check.fp8_choice(variant.flags) == choice
    # only the levers this block compares: no other flag
    assert set(variant.flags) - {"--compile", "--fp8", "tensorwise", "rowwise"} == set()


@pytest.mark.parametrize("variant", ROWS, ids=lambda v: v.name)
def test_the_recipes_fp8_check_accepts_each_rows_launch_config_on_an_h100(variant):
    """configs/fsdp2.yaml loads the weights on rank 0 only, which accelerate's torchao path cannot: hence the
    fp8 FSDP2 rows' own case, and the bf16 twins keep the recipe's plain config."""
    config, _, choice = EXPECTED[variant.name]
    settings = yaml.safe_load((CONFIGS.parent / config).read_text()).get("fsdp_config", {})
    fp8.check(choice, method="full", device_capability=(9, 0),
              cpu_ram_efficient_loading=settings.get("fsdp_cpu_ram_efficient_loading", False))
    if choice != "none" and "fsdp2" in config:
        with pytest.raises(ConfigError, match="configs/fsdp2-fp8.yaml"):
            fp8.check(choice, method="full", device_capability=(9, 0), cpu_ram_efficient_loading=True)


def test_the_fp8_fsdp2_config_differs_from_fsdp2s_only_in_how_the_weights_load():
    plain, fp8_config = (yaml.safe_load((CONFIGS / name).read_text()) for name in ("fsdp2.yaml", "fsdp2-fp8.yaml"))
    assert plain["fsdp_config"].pop("fsdp_cpu_ram_efficient_loading") is True
    assert fp8_config["fsdp_config"].pop("fsdp_cpu_ram_efficient_loading") is False
    assert plain == fp8_config


def test_each_row_is_against_the_bf16_row_of_its_engine_and_compile_setting():
    by_name = {v.name: v for v in ROWS}
    for v in ROWS:
        base = by_name[v.baseline]
        assert EXPECTED[base.name][2] == "none" and EXPECTED[base.name][1] == EXPECTED[v.name][1]  # bf16, compile
        assert ("zero3" in launch_config(base)) == ("zero3" in launch_config(v))  # the same engine
        assert ROWS.index(base) <= ROWS.index(v)
    assert {v.baseline for v in ROWS} == {"8b-zero3-bf16", "8b-fsdp2-bf16", "8b-fsdp2-compile-bf16"}


def _row(name: str, tps: float | None) -> dict:
    v = ablation.BY_NAME[name]
    return {"run": name, "case": v.case, "seq_len": 4096, "tokens_per_s_per_device": tps}


def test_speedups_divide_by_the_named_baseline_not_the_cases_first_row():
    rows = [_row("8b-mb2-ga1", 5000.0),  # the ZeRO-3 case's first row: the default baseline, not the fp8 rows'
            _row("8b-fsdp2-compile-bf16", 8000.0), _row("8b-fsdp2-compile-fp8-tensorwise", 10000.0),
            _row("8b-fsdp2-bf16", 6000.0), _row("8b-fsdp2-fp8-rowwise", 6600.0),
            _row("8b-zero3-bf16", 6000.0), _row("8b-zero3-fp8-tensorwise", 6300.0), _row("8b-mb2-ga4", 7500.0)]
    out = {r["run"]: r for r in ablation.speedups(rows)}
    assert {name: r["speedup"] for name, r in out.items()} == pytest.approx(
        {"8b-mb2-ga1": 1.0, "8b-fsdp2-compile-bf16": 1.0, "8b-fsdp2-compile-fp8-tensorwise": 1.25,
         "8b-fsdp2-bf16": 1.0, "8b-fsdp2-fp8-rowwise": 1.1, "8b-zero3-bf16": 1.0, "8b-zero3-fp8-tensorwise": 1.05,
         "8b-mb2-ga4": 1.5})
    assert out["8b-fsdp2-fp8-rowwise"]["baseline"] == "8b-fsdp2-bf16"
    assert out["8b-mb2-ga4"]["baseline"] == "8b-mb2-ga1"


def test_an_fp8_row_whose_baseline_did_not_finish_has_no_speedup():
    rows = [_row("8b-fsdp2-compile-bf16", None), _row("8b-fsdp2-compile-fp8-rowwise", 9000.0)]
    assert [r["speedup"] for r in ablation.speedups(rows)] == [None, None]
    assert ablation.speedups(rows[1:])[0]["speedup"] is None  # its baseline ran in no row at all


def test_fp8_rows_are_predicted_like_their_bf16_twins_plus_the_compilation():
    fsdp2 = ablation.SECONDS_ON_H100["llama3-8b-zero3-fsdp2"]
    for v in ROWS:
        assert ablation.expected_seconds(v) == ablation.expected_seconds(ablation.BY_NAME[v.baseline])
    assert ablation.expected_seconds(ablation.BY_NAME["8b-fsdp2-compile-fp8-rowwise"]) == \
        fsdp2 + ablation.COMPILE_SECONDS == ablation.expected_seconds(FSDP2_COMPILE)
    assert ablation.expected_seconds(ablation.BY_NAME["8b-fsdp2-fp8-tensorwise"]) == fsdp2
    assert ablation.expected_seconds(ablation.BY_NAME["8b-zero3-fp8-tensorwise"]) == \
        ablation.SECONDS_ON_H100["llama3-8b-zero3"]


@pytest.mark.parametrize("variants", [ROWS, ablation.VARIANTS], ids=["fp8 rows", "every row"])
def test_batches_keep_each_row_with_its_baseline_within_the_budget(variants):
    groups = ablation.batches(variants, COMMAND_S)
    assert [v for g in groups for v in g] == variants
    assert all(ablation.setup_seconds(g) + sum(map(ablation.expected_seconds, g)) <= COMMAND_S for g in groups)
    for group in groups:
        names = {v.name for v in group}
        assert all(v.baseline in names for v in group if v.baseline), [v.name for v in group]


def test_a_block_longer_than_the_budget_gets_a_command_alone_and_is_not_split():
    compiled = [v for v in ROWS if "--compile" in v.flags]
    groups = ablation.batches(ROWS, 300)  # the compiled block alone is 3 x 106 s
    assert compiled in groups
    assert [len(u) for u in ablation.units(ROWS)] == [3, 2, 3]


def test_the_compiled_and_zero3_blocks_fit_one_command_with_fused_adams_setup_alone():
    """No fp8 row offloads its optimizer and they build one model of the 8B shape at 8 layers: the set-up is the
    fp8 command's measured 70 s (fused Adam only), and the first two blocks are one command of at most 9 minutes."""
    first = ablation.batches(ROWS, COMMAND_S)[0]
    assert [v.name for v in first] == list(EXPECTED)[:5]
    assert ablation.setup_seconds(first) == ablation.ONE_MODEL_SETUP_SECONDS
    assert ablation.setup_seconds(first) + sum(map(ablation.expected_seconds, first)) <= COMMAND_S
    offloaded = [ablation.BY_NAME["8b-offload-mb2-ga8"]]  # CPU Adam compiles as well
    assert ablation.setup_seconds(offloaded) == ablation.setup_seconds(ablation.VARIANTS) == ablation.SETUP_SECONDS
    assert not any(runner.cpu_adam(EVERY_CASE[v.case]) for v in ROWS) and runner.cpu_adam(EVERY_CASE[offloaded[0].case])


def test_the_documented_fp8_total_is_the_codes():
    assert_documented_total(ROWS, "fp8")


# ---- a GPU without fp8 tensor cores ----

@pytest.mark.parametrize("flags, capability, applicable", [
    (("--fp8", "tensorwise"), (8, 0), False),  # A100
    (("--compile", "--fp8=rowwise"), (8, 6), False),
    (("--fp8", "tensorwise"), (8, 9), True),  # L4, L40S
    (("--fp8", "rowwise"), (9, 0), True),  # H100
    (("--fp8", "tensorwise"), None, True),  # CPU: torch's reference kernel
    (("--fp8", "none"), (7, 0), True),
    (("--compile",), (8, 0), True),
])
def test_not_applicable_only_for_fp8_below_compute_capability_8_9(flags, capability, applicable):
    why = host_check.not_applicable(flags, capability)
    assert (why is None) is applicable
    if why:
        assert why.startswith("fp8 needs compute capability 8.9+") and f"{capability[0]}.{capability[1]}" in why


def test_the_capability_comes_from_nvml_without_a_cuda_context(monkeypatch):
    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
                                 nvmlDeviceGetCudaComputeCapability=lambda h: (8, 0) if h == "gpu0" else None)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(host_check.subprocess, "run", lambda *a, **k: pytest.fail("NVML answered"))
    assert host_check.gpu_capability() == (8, 0)


@pytest.mark.parametrize("stdout, expected", [("9 0\n", (9, 0)), ("", None)])
def test_without_nvml_the_capability_comes_from_torch_in_a_subprocess(monkeypatch, stdout, expected):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.setattr(host_check.subprocess, "run", lambda cmd, **k: subprocess.CompletedProcess(cmd, 0, stdout))
    assert host_check.gpu_capability() == expected


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["A100", "H100"])
def test_the_ablation_records_fp8_rows_as_not_applicable_on_an_old_gpu(capability, monkeypatch, tmp_path):
    """The whole ablation loop with the recipe runs replaced, on a GPU of ``capability``: below 8.9 the fp8
    rows are rows with status "not applicable" and the command passes; torchao is required only where an
    fp8 row will run."""
    import torch

    ran, host = [], {}

    def run_case(case, root, out, model, *, name, seq_len, extra, **kwargs):
        ran.append(name)
        tps = 1000.0 * (1.2 if host_check.fp8_choice(extra) != "none" else 1.0)
        return {"run": name, "case": case.name, "seq_len": seq_len, "micro_batch": 2, "grad_accum": 4, "status": "ok",
                "tokens_per_s_per_device": tps}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner, "gpu_memory", lambda: None)
    monkeypatch.setattr(runner.host_check, "gpu_capability", lambda index=0: capability)
    monkeypatch.setattr(runner.host_check, "problems", lambda *args, **kwargs: host.update(kwargs) or [])
    monkeypatch.setattr(runner, "run_case", run_case)
    monkeypatch.setattr(runner, "build_models", lambda specs, out, tiny: {spec: out / "m" for spec in specs})
    names = [v.name for v in ROWS]
    code = runner.main(["--ablation", "--variants", ",".join(names), "--tiny", "--out", str(tmp_path),
                        "--root", str(REPO)])
    rows = {r["run"]: r for r in json.loads((tmp_path / "summary.json").read_text())["cases"]}
    bf16 = [n for n in names if EXPECTED[n][2] == "none"]
    assert code == 0 and list(rows) == names
    if capability < (8, 9):
        assert ran == bf16 and host["fp8"] is False
        for name in set(names) - set(bf16):
            assert rows[name]["status"] == "not applicable" and rows[name]["speedup"] is None
            assert rows[name]["reason"].startswith("fp8 needs compute capability 8.9+ (--fp8 ")
            assert rows[name]["lever"] == ablation.BY_NAME[name].lever
    else:
        assert ran == names and host["fp8"] is True
        assert [rows[n]["speedup"] for n in names] == pytest.approx([1.0, 1.2, 1.2, 1.0, 1.2, 1.0, 1.2, 1.2])
