"""The GPU check's models, data and commands, checked without running a recipe (that is the
gpu-check session's job): truncated shapes count what the planner counts, the data fills every
sequence, and every case's flags parse with its recipe's own parser."""

from __future__ import annotations

import pytest
import torch

from finetune_kit.launch import cuda_ops
from finetune_kit.models.shapes import from_config, resolve_model
from finetune_tools.gpu_check import ablation
from finetune_tools.gpu_check.cases import CASES, EVERY_CASE, LONG_CASES, recipe_flags
from finetune_tools.gpu_check.synthetic import build_model, check_config, check_shape, write_data
from tests.harness import REPO, load_script


@pytest.mark.parametrize("arch, layers", [("llama3-8b", 8), ("llama2-13b", 4), ("llama3.3-70b", 8)])
def test_truncated_shapes_have_the_planners_parameter_counts(arch, layers):
    """The model transformers builds from the check config has exactly the parameters the planner and
    the FLOP formula count for the truncated shape (built on the meta device: no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**check_config(arch, layers))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    built = sum(p.numel() for p in model.parameters())
    assert built == resolve_model(arch).truncated(layers).total_params() == check_shape(arch, layers).total_params()
    assert from_config(config).name == f"{arch} (truncated to {layers} layers)"  # what the run record says


def test_tiny_width_keeps_grouped_attention_and_the_config():
    config = check_config("llama3-8b", 2, tiny=True)
    assert (config["vocab_size"], config["hidden_size"], config["rope_theta"]) == (1024, 64, 500000.0)
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 4  # Llama 3's 32:8
    assert check_config("llama2-13b", 2, tiny=True)["num_key_value_heads"] == 4  # multi-head stays multi-head
    seventy = check_config("llama3.3-70b", 2, tiny=True)  # 64 heads : 8 KV heads
    assert (seventy["num_attention_heads"], seventy["num_key_value_heads"]) == (8, 1)


@pytest.fixture(scope="module")
def tiny_check_model(tmp_path_factory):
    return build_model("llama3-8b", "llama3", 2, tmp_path_factory.mktemp("check") / "m", tiny=True)


def test_built_model_loads_with_the_planned_size(tiny_check_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_check_model)
    assert sum(p.numel() for p in model.parameters()) == check_shape("llama3-8b", 2, tiny=True).total_params()
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["instructions", "reviews"])
def test_synthetic_data_fills_every_sequence(kind, tiny_check_model, tmp_path):
    """Every example is longer than the sequence length: truncation fills reviews exactly and
    conversations to within one short exchange."""
    from finetune_kit.data import instructions, reviews
    from finetune_kit.models import loading

    tokenizer = loading.load_tokenizer(str(tiny_check_model))
    path = write_data(kind, tmp_path / f"d.{'csv' if kind == 'reviews' else 'jsonl'}", rows=6, seq_len=64)
    if kind == "instructions":
        examples, counts = instructions.tokenize_rows(instructions.load_rows(str(path)), tokenizer, 64)
        assert counts.truncated == 6
        shortest = 64 - 24  # one exchange: "Continue." and three words, with the template's headers
    else:
        examples = reviews.tokenize(reviews.load_reviews([str(path)])[0], tokenizer, 64)
        shortest = 64
    assert len(examples) == 6 and all(shortest <= len(ids) <= 64 for ids in examples["input_ids"])


@pytest.mark.parametrize("save", [True, False], ids=["save", "no-save"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_case_passes_its_recipes_own_flag_parser(case, save, monkeypatch):
    monkeypatch.chdir(REPO / "recipes" / case.recipe)
    flags = recipe_flags(case, model="m", data="d.jsonl", output="o", steps=8, seq_len=128, micro_batch=2, save=save)
    parsed = load_script(REPO / "recipes" / case.recipe / "train.py").parse_args(flags)
    if case.trainer:
        recipe, trainer = parsed
        assert (trainer["max_steps"], trainer["save_strategy"], recipe.max_seq_len) == (8, "no", 128)
        assert recipe.save_model is save
    else:
        assert (parsed.max_steps, parsed.save_every, parsed.max_seq_len, parsed.micro_batch_size) == (8, 0, 128, 2)
        assert parsed.save_model is save


@pytest.mark.parametrize("variant", [v for v in ablation.VARIANTS if v not in ablation.LONG_VARIANTS],
                         ids=lambda v: v.name)
def test_every_ablation_variant_passes_its_recipes_own_flag_parser(variant, monkeypatch):
    """The long-context rows: test_long_context_rows.py."""
    case = EVERY_CASE[variant.case]
    monkeypatch.chdir(REPO / "recipes" / case.recipe)
    flags = recipe_flags(case, model="m", data="d.jsonl", output="o", steps=8, seq_len=128,
                         micro_batch=variant.micro_batch or case.micro_batch, grad_accum=variant.grad_accum)
    parsed = load_script(REPO / "recipes" / case.recipe / "train.py").parse_args([*flags, *variant.flags])
    if case.trainer:
        recipe, trainer = parsed
        assert trainer["gradient_accumulation_steps"] == variant.grad_accum
    else:
        assert parsed.grad_accum == variant.grad_accum
        assert parsed.gradient_checkpointing is ("--no-gradient-checkpointing" not in variant.flags)


@pytest.mark.parametrize("variant", ablation.VARIANTS, ids=lambda v: v.name)
def test_every_ablation_row_names_its_loss_kernel_so_an_installed_liger_changes_none(variant, monkeypatch):
    case = EVERY_CASE[variant.case]
    monkeypatch.chdir(REPO / "recipes" / case.recipe)
    flags = recipe_flags(case, model="m", data="d.jsonl", output="o", steps=8, seq_len=128, micro_batch=2)
    parsed = load_script(REPO / "recipes" / case.recipe / "train.py").parse_args(
        [*flags, *ablation.one_loss_kernel(case, variant.flags)])
    recipe = parsed[0] if case.trainer else parsed
    if case.data == "reviews":  # the classifier: no loss kernel to name
        assert not hasattr(recipe, "loss_kernel") and ablation.one_loss_kernel(case, variant.flags) == variant.flags
    else:
        assert recipe.loss_kernel == ("liger" if variant.name.endswith("-liger") else "chunked")


def test_ablation_speedups_are_against_each_cases_first_finished_row():
    rows = [{"case": "a", "tokens_per_s_per_device": None}, {"case": "a", "tokens_per_s_per_device": 100.0},
            {"case": "b", "tokens_per_s_per_device": 50.0}, {"case": "a", "tokens_per_s_per_device": 160.0}]
    assert [r["speedup"] for r in ablation.speedups(rows)] == [None, 1.0, 1.0, 1.6]
    assert len({v.name for v in ablation.VARIANTS}) == len(ablation.VARIANTS)


def _stub_case(name: str, script: str):
    """A case whose "launcher" is a shell running ``script`` (train.py and its flags become ignored arguments)."""
    from finetune_tools.gpu_check.cases import Case

    return Case(name, "llama3-8b-zero3", "llama3-8b", "llama3", "instructions", layers=1, seq_len=16, micro_batch=1,
                launcher=("bash", "-c", script, "stub"))


def test_a_case_past_its_time_limit_is_stopped_with_its_children(tmp_path):
    import time

    from finetune_tools.gpu_check.runner import run_case

    marker = tmp_path / "child-alive"
    # the launcher starts a child that would outlive it; the whole session must go
    case = _stub_case("slow", f"(sleep 3; touch {marker}) & sleep 60")
    start = time.monotonic()
    row = run_case(case, REPO, tmp_path, tmp_path / "model", layers=1, steps=1, seq_len=16, micro_batch=1, timeout=1)
    assert row["status"] == "timed out" and row["exit"] is None and time.monotonic() - start < 10
    time.sleep(3.5)
    assert not marker.exists()


def test_a_failed_case_and_a_missing_launcher_are_rows_not_crashes(tmp_path):
    from dataclasses import replace

    from finetune_tools.gpu_check.runner import run_case

    failed = run_case(_stub_case("fails", "echo boom; exit 3"), REPO, tmp_path, tmp_path / "m", layers=1, steps=1,
                      seq_len=16, micro_batch=1)
    assert (failed["status"], failed["exit"]) == ("failed", 3)
    assert "boom" in (tmp_path / "fails" / "run.log").read_text()
    missing = replace(_stub_case("missing", ""), launcher=("no-such-launcher-here",))
    row = run_case(missing, REPO, tmp_path, tmp_path / "m", layers=1, steps=1, seq_len=16, micro_batch=1)
    assert row["status"] == "failed" and "'no-such-launcher-here' not on PATH" in row["error"]


@pytest.mark.parametrize("value, fixed", [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("9.0 10.0f", "9.0;10.0"),
                                          ("9.0a;9.0", "9.0")])
def test_arch_suffixes_deepspeed_cannot_read_are_dropped(value, fixed):
    env = {"TORCH_CUDA_ARCH_LIST": value}
    note = cuda_ops.jit_arch_list(env)
    assert env["TORCH_CUDA_ARCH_LIST"] == fixed and repr(value) in note and repr(fixed) in note


@pytest.mark.parametrize("value", ["9.0", "8.0;9.0+PTX", ""])
def test_arch_lists_deepspeed_reads_are_left_alone(value):
    env = {"TORCH_CUDA_ARCH_LIST": value} if value else {}
    assert cuda_ops.jit_arch_list(env) is None and env == ({"TORCH_CUDA_ARCH_LIST": value} if value else {})


def test_deepspeeds_own_parser_accepts_what_jit_arch_list_leaves(monkeypatch):
    """DeepSpeed's JIT builder sorts the list itself; the suffixed value is what failed on an H100 host."""
    import os

    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    class Probe(CUDAOpBuilder):
        NAME = "probe"

        def absolute_name(self):
            return "probe"

        def sources(self):
            return []

    env = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    probe = Probe(name="probe")
    probe.jit_mode = True
    with pytest.raises(ValueError, match="0a"):
        probe.compute_capability_args()
    cuda_ops.jit_arch_list(env)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env["TORCH_CUDA_ARCH_LIST"])
    assert probe.compute_capability_args() == []  # JIT: it leaves the arch flags to PyTorch, through the env
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0+PTX"


def test_cuda_ops_pick_the_adam_the_config_runs_and_check_nothing_without_cuda():
    assert cuda_ops.adam_op({"zero_optimization": {"stage": 3}}) == "FusedAdamBuilder"
    assert cuda_ops.adam_op({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) == "CPUAdamBuilder"
    if not torch.cuda.is_available():
        assert cuda_ops.check_ops({"zero_optimization": {"stage": 3}}, quantized=True) == []


def test_cuda_mismatch_names_both_versions_and_the_fix():
    from finetune_kit.errors import ConfigError

    cuda_ops.check_nvcc("12.4", "12.8", "fused_adam")  # same major release: DeepSpeed accepts it
    with pytest.raises(ConfigError, match=r"fused_adam op with nvcc 11\.8, but torch was built for CUDA 12\.8.*"
                                          r"Install the CUDA 12\.8 toolkit"):
        cuda_ops.check_nvcc("11.8", "12.8", "fused_adam")


def test_bitsandbytes_without_its_cuda_library_is_named(monkeypatch):
    from bitsandbytes import cextension

    from finetune_kit.errors import ConfigError

    monkeypatch.setattr(cextension, "lib", cextension.ErrorHandlerMockBNBNativeLibrary("libcudart.so.12 not found"))
    with pytest.raises(ConfigError, match=r"bitsandbytes .* found no CUDA library"):
        cuda_ops._bitsandbytes()


def test_host_check_lists_every_missing_piece_at_once(monkeypatch, tmp_path):
    """No launcher on PATH, no toolchain, a too-old transformers and a full disk: one list, all named."""
    from torch.utils import cpp_extension
    from transformers import PreTrainedModel

    from finetune_tools.gpu_check import host_check

    monkeypatch.setenv("PATH", str(tmp_path))  # no accelerate, deepspeed, c++ or g++
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setattr(host_check.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable", raising=False)
    found = host_check.problems(CASES, tmp_path / "out", gpu=True, model_bytes=2**60, gpu_used_GiB=5.0,
                               environ={})
    text = "\n".join(found)
    for expected in ("'accelerate' is not on PATH", "'deepspeed' is not on PATH",
                     "no activation_checkpointing_enable",
                     "nvcc not found", "ninja not found", "no C++ compiler", "Python.h", "in use before the check",
                     "the models need"):
        assert expected in text, (expected, text)


def test_host_check_is_quiet_on_a_ready_cpu_host(monkeypatch, tmp_path):
    import os
    import sys

    from finetune_tools.gpu_check import host_check

    # the stack's launchers live beside its Python
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    cpu_cases = [c for c in CASES if not c.gpu_only]
    assert host_check.problems(cpu_cases, tmp_path, gpu=False, model_bytes=2**20) == []


def test_a_librarys_own_requirements_are_checked_against_what_is_installed(monkeypatch):
    """An image's older pyarrow under the pinned datasets: named with both versions."""
    from finetune_tools.gpu_check import host_check

    real = host_check.metadata.requires
    monkeypatch.setattr(host_check.metadata, "requires",
                        lambda name: ["pyarrow>=999.0", 'tomli; python_version < "3.0"'] if name == "datasets"
                        else real(name))
    found = host_check.requirement_problems(["datasets"])
    assert len(found) == 1 and found[0].startswith("datasets ")
    assert "needs pyarrow>=999.0; installed: pyarrow " in found[0]


def test_every_variant_has_a_measured_case_time_and_the_batches_fit_their_budget():
    long_cases = {c.name for c in LONG_CASES}
    assert {v.case for v in ablation.VARIANTS} - long_cases <= set(ablation.SECONDS_ON_H100) | set(ablation.TIMED_LIKE)
    assert set(ablation.TIMED_LIKE.values()) <= set(ablation.SECONDS_ON_H100)
    groups = ablation.batches(ablation.VARIANTS, 540)
    assert [v for g in groups for v in g] == ablation.VARIANTS  # all of them, in order
    assert all(ablation.setup_seconds(g) + sum(map(ablation.expected_seconds, g)) <= 540 for g in groups)
    assert len(groups) > 1 and all(groups)
    compiled = ablation.BY_NAME["8b-fsdp2-mb2-ga4-compile"]
    assert ablation.expected_seconds(compiled) == ablation.SECONDS_ON_H100[compiled.case] + ablation.COMPILE_SECONDS
