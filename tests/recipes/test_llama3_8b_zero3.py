"""The Llama 3 8B ZeRO-3 recipe end to end: its own train.py and configs, 2 CPU processes.

The main run is the README's command (`make recipe-8b-zero3`, in the repository); the other
launches use a copy of the recipe folder outside the repository, with only the shared
package installed, as a user who copies a recipe would. Against the README command, only
model path, data path, step counts and sizes change -- plus --lr: a randomly initialised
tiny model needs a larger step than a pretrained 8B to show its loss falling in 8 steps.

Regenerate the golden losses after an intended numerics change with
``UPDATE_GOLDEN=1 nox -s test-llama3-8b-zero3`` and say why in the commit.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.harness import (
    PACKED_SPLITS,
    REPO,
    SAMPLE,
    SAMPLE_CHAT,
    SAMPLES,
    SPLIT_LOSS_ATOL,
    SPLITS,
    accelerate_command,
    accelerate_launch,
    assert_adapter_answers_as_its_fp32_merge,
    assert_failed_early,
    assert_finished,
    assert_levers_auto_took_the_first_of_the_ranking,
    assert_matches_golden,
    assert_one_line_error,
    assert_one_model_for_every_split,
    assert_ranks_disjoint,
    assert_refused_to_overwrite,
    assert_resumed_like_uninterrupted,
    assert_throughput_metrics,
    bad_input_args,
    checked,
    fills_when_opened,
    free_port,
    killed_whole_after,
    launch_env,
    load_script,
    losses,
    make_target,
    named_rows,
    nonfinite_lines,
    poisoned_copy,
    read_metrics,
    read_run_info,
    run_and_signal,
    run_command,
    sample_examples,
    side_by_side,
    small_filesystem,
    split_args,
    tensors_in,
    wait_all,
    warm_launch,
    warm_run,
    write_jsonl,
)

pytestmark = pytest.mark.recipe

RECIPE = REPO / "recipes/llama3-8b-zero3"
GOLDEN = REPO / "tests/golden/llama3-8b-zero3.json"
CHAT_GOLDEN = REPO / "tests/golden/llama3-8b-zero3-chat-packed.json"
PACKED_GOLDEN = REPO / "tests/golden/llama3-8b-zero3-packed.json"  # one rank, 8 packed sequences a step
LAUNCH_ENV = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": "configs/zero3.json"}  # what accelerate launch passes
STEPS, SAVE_EVERY = 8, 4


def sizes(model: Path, data: Path = SAMPLE) -> list[str]:
    """The tests' sizes; no sample answers (seconds per launch) but where a test reads them (SAMPLES_ON)."""
    return ["--model", str(model), "--data", str(data), "--max-seq-len", "128",
            "--micro-batch-size", "4", "--grad-accum", "2", "--lr", "1e-3", "--samples", "0"]


SAMPLES_ON = ("--samples", "4")  # the recipe's default


def launch(cwd: Path, *args: str, config: str = "configs/zero3.yaml", nproc: int = 2, warm: bool = True):
    """``accelerate launch`` of train.py from ``cwd``; ``warm``: its ranks forked from a process that imported the
    stack once (tests/warm_launch.py), for what the ranks compute; not ``warm`` where the launcher's behaviour is
    tested (the README's command is tested as such by the module's main run)."""
    return (warm_launch if warm else accelerate_launch)(cwd, *args, config=config, nproc=nproc)


SHM_BUFFERS = "deepspeed_allreduce_buffer_*"  # DeepSpeed's CPU collectives, one per rank in /dev/shm


def readme_variables(model: Path, output: Path, *train_args: str) -> list[str]:
    """The README command's variables for the tests' sizes (CPU=1: on this machine's CPUs)."""
    return ["NUM_GPUS=2", f"MODEL={model}", f"DATA={SAMPLE}", f"OUTPUT={output}",
            "TRAIN_ARGS=" + " ".join([*sizes(model)[4:], *train_args])]


@pytest.fixture(scope="module")
def fresh_launch(tiny_llama3, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, list]:
    """The module's main run, started by the README's command: `make recipe-8b-zero3 NUM_GPUS=2 ...`, which runs
    the input check, then `accelerate launch --config_file configs/zero3.yaml` from the recipe folder."""
    output = tmp_path_factory.mktemp("runs") / "fresh"
    before = set(Path("/dev/shm").glob(SHM_BUFFERS))
    variables = readme_variables(tiny_llama3, output, "--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY),
                                 "--keep-checkpoints", "0", *SAMPLES_ON, "--sample-before")
    (proc,) = wait_all([make_target("recipe-8b-zero3", *variables)], timeout=900)
    left = set(Path("/dev/shm").glob(SHM_BUFFERS)) - before
    if left:  # a launch of a session beside this one holds its buffers for the seconds of its start-up only
        time.sleep(20)
        left &= set(Path("/dev/shm").glob(SHM_BUFFERS))
    assert_finished(proc, STEPS)
    return proc, output, sorted(left)


@pytest.fixture(scope="module")
def run(fresh_launch) -> Path:
    return fresh_launch[1]


@pytest.mark.quick
def test_the_run_leaves_no_buffer_in_dev_shm(fresh_launch):
    """DeepSpeed's shm_comm op never removes its 64 MiB per rank: the run removes them at exit."""
    assert fresh_launch[2] == []


@pytest.mark.quick
def test_by_default_no_metrics_endpoint_and_no_tracker(fresh_launch):
    """Without FINETUNE_METRICS_PORT no port opens (no endpoint is announced); --report-to none writes
    no tracker files (tests/recipes/test_live_metrics.py runs both on)."""
    proc, output, _ = fresh_launch
    assert "FINETUNE_METRICS_PORT" not in launch_env()
    assert "metrics endpoint" not in proc.stdout + proc.stderr
    assert not (output / "tensorboard").exists()


@pytest.fixture(scope="module")
def run_info(run) -> dict:
    return read_run_info(run)


@pytest.mark.quick
def test_run_info_records_the_memory_plan(run_info):
    plan = run_info["memory_plan"]  # no GPU here: predicted, not checked
    assert plan["setup"]["stage"] == 3 and plan["setup"]["gpus_per_node"] * plan["setup"]["nodes"] == 2
    assert plan["fits"] is None and plan["gpu_total_GiB"] > 0 and "not checked" in plan["verdict"]


@pytest.mark.quick
def test_two_ranks_train_on_different_data(run_info):
    assert_ranks_disjoint(run_info)


@pytest.mark.quick
def test_zero3_partitions_parameters(run_info):
    assert run_info["zero_stage"] == 3
    for rank in run_info["ranks"]:
        params = rank["params"]
        assert params["partitioned_params"] > 0
        # each rank holds about half of every partitioned tensor (ZeRO pads to even shards)
        assert params["local"] < 0.6 * params["total"], params


@pytest.mark.quick
def test_loss_falls(run):
    got = losses(run)
    assert len(got) == STEPS
    assert sum(got[-2:]) / 2 < got[0] - 0.2, got


@pytest.mark.quick
def test_losses_match_golden(run):
    assert_matches_golden(losses(run), GOLDEN, STEPS)


@pytest.mark.quick
def test_the_readme_make_command_trains_like_the_launch(fresh_launch, tiny_llama3):
    """`make recipe-8b-zero3 NUM_GPUS=2 ...` from the repository root (CPU=1: on CPUs) launched the module's main
    run (the golden losses: test_losses_match_golden), and its old name runs the same commands."""
    proc, output, _ = fresh_launch
    assert "configs/zero3.yaml --num_processes 2" in proc.stderr  # the command, echoed by set -x
    variables = readme_variables(tiny_llama3, output, "--max-steps", str(STEPS))
    alias = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), "train-llama3-8b-zero3", *variables],
                           capture_output=True, text=True)
    same = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), "recipe-8b-zero3", *variables],
                          capture_output=True, text=True)
    assert alias.returncode == 0 and alias.stdout == same.stdout, alias.stderr


def test_a_warm_launch_trains_the_model_the_readme_launch_trained(run, recipe_copy, tiny_llama3, tmp_path):
    """The tests that compare what ranks compute launch warm (tests/warm_launch.py: ranks forked from a process that
    imported the stack once). Given the module's main run's arguments, a warm launch logs the same losses, gradient
    norms and learning rates, answers the held-out prompts the same, and saves the same model, byte for byte."""
    output = tmp_path / "warm"
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--output", str(output), "--max-steps", str(STEPS),
                  "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "0", *SAMPLES_ON, "--sample-before")
    assert_finished(proc, STEPS)

    def logged(folder: Path) -> list[tuple]:
        return [(m["step"], m["loss"], m["grad_norm"], m["lr"]) for m in read_metrics(folder)]

    def answers(folder: Path) -> list[tuple]:
        return [(row["example_id"], row["before"], row["answer"]) for row in read_jsonl(folder / "samples.jsonl")]

    assert logged(output) == logged(run)
    assert answers(output) == answers(run) and answers(run)
    assert (output / "model/model.safetensors").read_bytes() == (run / "model/model.safetensors").read_bytes()


@pytest.mark.skipif(bool(os.environ.get("UPDATE_GOLDEN")), reason="would rewrite the golden file with its losses")
def test_golden_losses_catch_a_one_percent_learning_rate_change(recipe_copy, tiny_llama3, tmp_path):
    """The golden comparison's negative control: the same run with a 1% higher learning rate fails it."""
    output = tmp_path / "lr-plus-1-percent"
    args = ["1.01e-3" if arg == "1e-3" else arg for arg in sizes(tiny_llama3)]
    proc = launch(recipe_copy, *args, "--output", str(output), "--max-steps", str(STEPS), "--save-every", "0")
    assert_finished(proc, STEPS)
    got = losses(output)
    want = json.loads(GOLDEN.read_text())["losses"]
    print("largest |loss - golden| at lr x 1.01:", max(abs(a - b) for a, b in zip(got, want, strict=True)))
    with pytest.raises(AssertionError):
        assert_matches_golden(got, GOLDEN, STEPS)


LEVERS = {"whole-logits-loss": (("--loss-chunks", "0"), {"loss_chunks": 0, "loss_kernel": "none"}),
          "activations-offloaded": (("--offload-activations",), {"offload_activations": True}),
          "every-other-layer-checkpointed": (("--recompute-every", "2"), {"recompute_every": 2}),
          "compiled-layers": (("--compile",), {"compiled": True})}
# ZeRO-3's levers share one launch: a lever that moved the losses would move them there too, and each is recorded.
LAUNCHES = {"zero3-whole-logits-offloaded-every-other-layer": ("whole-logits-loss", "activations-offloaded",
                                                              "every-other-layer-checkpointed"),
            "fsdp2-compiled-layers": ("compiled-layers",)}


@pytest.mark.skipif(bool(os.environ.get("UPDATE_GOLDEN")), reason="compares with the golden losses")
@pytest.mark.parametrize("launch_of", LAUNCHES)
def test_the_speed_and_memory_levers_train_the_same(launch_of, recipe_copy, tiny_llama3, tmp_path):
    """On two ranks, the levers give the golden losses of the default run of their engine (chunked
    loss, activations in place, every layer checkpointed, eager layers), and the record says each
    was on. torch.compile runs under FSDP2 (ZeRO-3's hooks break its graphs: refused)."""
    levers = LAUNCHES[launch_of]
    flags = [flag for lever in levers for flag in LEVERS[lever][0]]
    recorded = {key: value for lever in levers for key, value in LEVERS[lever][1].items()}
    fsdp2 = launch_of.startswith("fsdp2")
    output = tmp_path / "lever"
    proc = launch(recipe_copy, *sizes(tiny_llama3), *flags, "--output", str(output), "--max-steps", str(STEPS),
                  "--save-every", "0", "--no-save-model", config=FSDP_CONFIG if fsdp2 else "configs/zero3.yaml")
    assert_finished(proc, STEPS)
    assert_matches_golden(losses(output), FSDP_GOLDEN if fsdp2 else GOLDEN, STEPS)
    record = json.loads((output / "run_record.json").read_text())["training"]
    default = {"loss_chunks": 8, "loss_kernel": "chunked", "offload_activations": False, "recompute_every": 1,
               "compiled": False}
    assert {key: record[key] for key in default} == {**default, **recorded}
    assert set(LEVERS) == {lever for levers in LAUNCHES.values() for lever in levers}  # every lever in a launch


@pytest.mark.quick
def test_metrics_carry_throughput_and_memory(run):
    assert_throughput_metrics(run)


@pytest.mark.quick
def test_run_record_describes_the_run(run, tiny_llama3):
    from transformers import AutoConfig

    from finetune_kit.metering.flops import FlopCounter
    from finetune_kit.metering.run_record import RunRecord
    from finetune_kit.models import shapes

    rec = RunRecord.read(run / "run_record.json")
    assert rec.recipe == "llama3-8b-zero3"
    assert (rec.hardware.device, rec.hardware.devices, rec.hardware.nodes) == ("cpu", 2, 1)
    assert rec.hardware.peak_bf16_tflop_per_s_per_device is None and rec.measured.mfu_percent is None
    arch = shapes.from_config(AutoConfig.from_pretrained(tiny_llama3))
    assert rec.model.params_total == rec.model.params_trainable == arch.total_params()
    assert (rec.training.zero_stage, rec.training.global_batch_size, rec.training.seq_len) == (3, 16, 128)
    m = rec.measured
    assert (m.steps_total, m.warmup_steps_excluded, m.steps_measured) == (STEPS, 3, STEPS - 3)
    steady = read_metrics(run)[3:]
    assert m.tokens_per_s == pytest.approx(statistics.median(x["tokens_per_s"] for x in steady))
    # TFLOP/s is the FLOP formula applied to the real tokens of each step
    per_token_min = FlopCounter(arch).per_token(8)
    assert m.model_tflop_per_s_per_device * 1e12 >= m.tokens_per_s_per_device * per_token_min * 0.99
    assert m.peak_host_rss_GiB_per_node > 0 and m.peak_gpu_allocated_GiB is None
    plan = read_run_info(run)["memory_plan"]
    assert m.predicted_gpu_GiB == pytest.approx(plan["gpu_total_GiB"], abs=1e-3)  # the planner's, beside the peaks


@pytest.mark.quick
def test_consolidated_model_is_the_trained_model(run, run_info, tiny_llama3):
    """Plain transformers loads model/; its weights equal the fp32 masters of the last
    DeepSpeed checkpoint rounded to bf16, so logits agree exactly; and it reproduces the
    validation loss that the run reported."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from finetune_kit.data import batching
    from finetune_kit.models import loading
    from finetune_kit.training.evaluation import token_loss_sums

    saved = AutoModelForCausalLM.from_pretrained(run / "model")
    assert saved.dtype == torch.bfloat16
    masters = get_fp32_state_dict_from_zero_checkpoint(str(run / f"checkpoints/step_{STEPS:06d}"),
                                                       tag="pytorch_model")
    rebuilt = AutoModelForCausalLM.from_pretrained(tiny_llama3)
    rebuilt.load_state_dict({k: v.to(torch.bfloat16) for k, v in masters.items()})
    original = AutoModelForCausalLM.from_pretrained(tiny_llama3)
    assert not torch.equal(original.lm_head.weight, saved.lm_head.weight)  # training changed it

    tokenizer = loading.load_tokenizer(str(run / "model"))
    eval_set = sample_examples(tokenizer, run_info["eval_example_ids"], 128)
    batch = batching.PadCollator(tokenizer.pad_token_id)(eval_set)
    with torch.no_grad():
        logits = saved(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert torch.equal(logits, rebuilt(input_ids=batch["input_ids"],
                                           attention_mask=batch["attention_mask"]).logits)
    sums, counts = token_loss_sums(logits, batch["labels"])
    assert (sums.sum() / counts.sum()).item() == pytest.approx(run_info["eval_loss"], rel=1e-2)


# ---- after training: sample answers, the model card, a folder plain transformers generates from ----

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.quick
def test_the_run_answers_held_out_prompts_before_and_after_training(run, run_info):
    """--samples 4 (the default) of the held-out rows, answered by the model as loaded (--sample-before) and by
    the final model; in samples.jsonl and the log, and in figures alone in the run record: the record is what a
    run publishes, and no prompt, reference, answer or held-out row is in it."""
    heldout = read_jsonl(run / "heldout.jsonl")
    assert [row["example_id"] for row in heldout] == run_info["eval_example_ids"]
    samples = read_jsonl(run / "samples.jsonl")
    assert [s["example_id"] for s in samples] == run_info["eval_example_ids"][:4]
    for sample, row in zip(samples, heldout, strict=False):
        assert sample["prompt"] == row["messages"][-2]["content"]
        assert sample["reference"] == row["messages"][-1]["content"]
        assert sample["answer"] and sample["before"]
    assert any(s["answer"] != s["before"] for s in samples)  # training changed what it says
    from finetune_kit.training.samples import figures

    record = (run / "run_record.json").read_text()
    assert json.loads(record)["samples"] == figures(samples) and figures(samples)["scored"] == 4
    texts = {t for s in samples for t in (s["prompt"], s["reference"], s["answer"], s["before"]) if len(t) > 8}
    texts |= {m["content"] for row in heldout for m in row["messages"] if len(m["content"]) > 8}
    assert texts and not [t for t in texts if json.dumps(t)[1:-1] in record]


@pytest.mark.quick
def test_plain_transformers_answers_like_the_run_from_the_saved_folder(run):
    """model/ carries the chat template the run trained with and stops at its end of turn: plain transformers
    renders the sample prompts and generates, with the folder's own generation_config, the run's answers (greedy,
    from the same bf16 weights, the prompts in one left-padded batch as the run generated them under ZeRO-3)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tokenizer = AutoTokenizer.from_pretrained(run / "model", padding_side="left")
    stops = GenerationConfig.from_pretrained(run / "model").eos_token_id
    assert stops == tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    samples = read_jsonl(run / "samples.jsonl")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": s["prompt"]}], tokenize=False,
                                           add_generation_prompt=True) for s in samples]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=128, do_sample=False)
    answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert [a.strip() for a in answers] == [s["answer"] for s in samples]


@pytest.mark.quick
def test_the_model_card_is_generated_from_the_run(run, run_info):
    """model/README.md: front matter a hub reads, the settings, data, measured speed, validation and samples,
    each taken from the run's files."""
    import hashlib

    import yaml

    card = (run / "model/README.md").read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"llama3-8b-zero3", "deepspeed", "zero-3", "full"} <= set(meta["tags"])
    assert "datasets" not in meta  # hub ids only: the local file is named with its sha256 in the body
    assert f"local file `{SAMPLE.name}`, sha256 {hashlib.sha256(SAMPLE.read_bytes()).hexdigest()}" in body
    assert "base_model" not in meta  # a local folder is no hub id
    record = json.loads((run / "run_record.json").read_text())
    assert f"| tokens/s (all devices) | {record['measured']['tokens_per_s']:,.0f} |" in body
    assert f"| global batch (sequences) | {record['training']['global_batch_size']} |" in body
    assert f"| peak learning rate | {run_info['settings']['lr']} |" in body
    assert f"loss {run_info['eval_loss']:.4f} (nats/token)" in body
    assert all(s["prompt"] in body for s in read_jsonl(run / "samples.jsonl"))


HARNESS_VS_RUN_RTOL = 1e-3  # measured 3.5e-5: the run's bf16 forward under ZeRO-3 against the harness's fp32 one


@pytest.mark.quick
def test_make_eval_scores_the_held_out_split_as_the_run_did(run, run_info, tmp_path):
    """`make eval RUN=...` (lm-evaluation-harness, offline) on a copy of the run: its heldout task is the run's own
    validation (one-turn rows: the same answer tokens), so its loss is the run's eval_loss; the summary lands in
    eval/, the run record and the model card. (That the harness counts exactly the labelled tokens, and that one
    token more or less moves the figure, is tests/unit/harness.)"""
    import math

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    proc, = wait_all([make_target("eval", f"RUN={copy}")], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((copy / "eval/summary.json").read_text())
    heldout = summary["tasks"]["heldout"]
    print(f"harness loss {heldout['loss']:.6f}, the run's eval_loss {run_info['eval_loss']:.6f}")
    assert heldout["loss"] == pytest.approx(run_info["eval_loss"], rel=HARNESS_VS_RUN_RTOL)
    assert heldout["perplexity"] == pytest.approx(math.exp(heldout["loss"]))
    assert json.loads((copy / "run_record.json").read_text())["evaluation"] == summary
    assert f"| heldout | loss | {heldout['loss']:.4g} |" in (copy / "model/README.md").read_text()


# ---- the same train.py under PyTorch FSDP2 (configs/fsdp2.yaml) ----

FSDP_GOLDEN = REPO / "tests/golden/llama3-8b-zero3-fsdp2.json"
FSDP_CONFIG = "configs/fsdp2.yaml"
ZERO3_VS_FSDP2_ATOL = 1e-3  # measured: 1.1e-4 over the 8 steps


@pytest.fixture(scope="module")
def fsdp_run(recipe_copy, tiny_llama3, tmp_path_factory) -> Path:
    """The ZeRO-3 run's command with the FSDP2 launch config instead: nothing else changes."""
    output = tmp_path_factory.mktemp("runs") / "fsdp2"
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--output", str(output), "--max-steps", str(STEPS),
                  "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "0", *SAMPLES_ON, config=FSDP_CONFIG)
    assert_finished(proc, STEPS, "FSDP2")
    assert "FSDP2 (full sharding; fp32 weights, bf16 compute, fp32 gradient reduction)" in proc.stdout
    return output


def test_fsdp2_losses_match_golden(fsdp_run):
    assert_matches_golden(losses(fsdp_run), FSDP_GOLDEN, STEPS)


def test_fsdp2_answers_its_samples_from_the_sharded_model(fsdp_run):
    """Generation gathers FSDP2's shards layer by layer on every rank (synced_gpus), as ZeRO-3's does."""
    samples = read_jsonl(fsdp_run / "samples.jsonl")
    assert len(samples) == 4 and all(s["answer"] for s in samples)
    assert (fsdp_run / "model/README.md").is_file()


def test_zero3_and_fsdp2_train_alike(run, fsdp_run):
    """Same seed, data, initial weights and schedule: the first loss is the same number, and the
    others stay within ZERO3_VS_FSDP2_ATOL. Both keep fp32 master weights and Adam states and
    compute in bf16; what differs is the gradient path: DeepSpeed reduces bf16 gradients, this
    FSDP2 setup reduce-scatters them in fp32, so the updates differ in their last bits."""
    zero3, fsdp2 = losses(run), losses(fsdp_run)
    assert zero3[0] == fsdp2[0]
    diffs = [abs(a - b) for a, b in zip(zero3, fsdp2, strict=True)]
    print("ZeRO-3 vs FSDP2 per-step loss difference:", " ".join(f"{d:.1e}" for d in diffs))
    assert max(diffs) < ZERO3_VS_FSDP2_ATOL, list(zip(zero3, fsdp2, strict=True))
    assert [m["lr"] for m in read_metrics(fsdp_run)] == pytest.approx([m["lr"] for m in read_metrics(run)])


def test_fsdp2_shards_parameters_and_records_the_engine(fsdp_run, tiny_llama3):
    from finetune_kit.metering.run_record import RunRecord

    info = read_run_info(fsdp_run)
    assert (info["engine"], info["zero_stage"], info["precision"], info["deepspeed_config"]) == ("fsdp2", 3, "bf16", "")
    assert_ranks_disjoint(info)
    for rank in info["ranks"]:
        params = rank["params"]  # every parameter a DTensor, split in two along its first dimension
        assert params["local"] * 2 == params["total"] and params["partitioned_params"] > 0, params
    plan = info["memory_plan"]
    assert plan["setup"]["engine"] == "fsdp2"
    assert "fp32 weights + gradients + Adam, sharded (16 B/param / GPUs)" in plan["gpu_GiB"]
    rec = RunRecord.read(fsdp_run / "run_record.json")
    assert (rec.training.engine, rec.training.zero_stage, rec.training.offload) == ("fsdp2", 3, "none")
    assert_throughput_metrics(fsdp_run)


def test_fsdp2_consolidated_model_is_the_trained_model(fsdp_run, tiny_llama3):
    """model/ is bf16 safetensors that plain transformers loads; its weights are the fp32 weights of
    the last sharded checkpoint (torch.distributed.checkpoint) rounded to bf16."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(fsdp_run / "model")
    assert saved.dtype == torch.bfloat16
    whole = fsdp_run / "dcp.pt"
    dcp_to_torch_save(fsdp_run / f"checkpoints/step_{STEPS:06d}/pytorch_model_fsdp_0", whole)
    masters = torch.load(whole, weights_only=True)["model"]  # accelerate saves {"model": state dict}
    assert {v.dtype for v in masters.values()} == {torch.float32}
    state = saved.state_dict()
    assert set(state) == set(masters)
    for name, master in masters.items():
        assert torch.equal(state[name], master.to(torch.bfloat16)), name
    original = AutoModelForCausalLM.from_pretrained(tiny_llama3)
    assert not torch.equal(original.lm_head.weight, saved.lm_head.weight)  # training changed it


# On the same 2 ranks the resume repeats the uninterrupted run's arithmetic: exact. On 1 rank the
# gradients of a step are summed in another order (4 local micro-batches, not 2 per rank reduced
# across ranks): like ZeRO-3's resume on another number of ranks, within 5e-4 (ZeRO-3 measured
# 1.1e-4; FSDP2 on 1 rank 0 on an AVX512-BF16 CPU, above 1e-5 on an AMX one).
@pytest.mark.parametrize("nproc, atol", [(2, 0.0), (1, 5e-4)], ids=["2-ranks-exact", "1-rank"])
def test_fsdp2_checkpoint_resumes(nproc, atol, fsdp_run, recipe_copy, tiny_llama3, tmp_path):
    """The step-4 sharded checkpoint, resumed on 2 ranks and on 1 (torch.distributed.checkpoint
    reshards on load; the global batch kept: 1 x 4 x 4 is 2 x 4 x 2): the losses of steps 5-8 are
    the uninterrupted run's; the schedule is counted in optimizer steps, not ranks' steps."""
    output = tmp_path / f"resumed-{nproc}"
    shutil.copytree(fsdp_run / f"checkpoints/step_{SAVE_EVERY:06d}", output / f"checkpoints/step_{SAVE_EVERY:06d}")
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--grad-accum", str(4 // nproc), "--output", str(output),
                  "--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "0",
                  config=FSDP_CONFIG, nproc=nproc)
    assert_finished(proc, STEPS, f"FSDP2 resume on {nproc}")
    assert f"at step {SAVE_EVERY}" in proc.stdout
    assert_resumed_like_uninterrupted(fsdp_run, output, SAVE_EVERY, STEPS, atol=atol)
    assert [m["lr"] for m in read_metrics(output)] == pytest.approx([m["lr"] for m in read_metrics(fsdp_run)][4:])


def test_fsdp2_refuses_a_resume_of_a_deepspeed_checkpoint(run, recipe_main, tiny_llama3, tmp_path, monkeypatch):
    from finetune_kit.errors import UserInputError

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what configs/fsdp2.yaml exports
    for key, value in {"FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "bf16",
                       "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                       "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserInputError, match="belongs to a different run: engine 'deepspeed' in the checkpoint, "
                                             "'fsdp2' now"):
        recipe_main([*sizes(tiny_llama3), "--output", str(tmp_path / "other"),
                     "--resume", str(run / f"checkpoints/step_{SAVE_EVERY:06d}")])


@pytest.fixture(scope="module")
def chat_run(recipe_copy, tiny_llama3, tmp_path_factory):
    """Multi-turn conversations with system turns, packed: the same command with --data and --pack."""
    output = tmp_path_factory.mktemp("runs") / "chat"
    proc = launch(recipe_copy, *sizes(tiny_llama3, SAMPLE_CHAT), "--pack", "--output", str(output),
                  "--max-steps", str(STEPS), "--save-every", "0")
    assert_finished(proc, STEPS, "multi-turn packed run")
    return output, proc.stdout


def test_multi_turn_packed_run_matches_golden(chat_run):
    output, _ = chat_run
    got = losses(output)
    assert sum(got[-2:]) / 2 < got[0] - 0.2, got
    assert_matches_golden(got, CHAT_GOLDEN, STEPS)


@pytest.mark.skipif(bool(os.environ.get("UPDATE_GOLDEN")), reason="compares with the golden losses")
def test_packed_rows_train_the_same_through_sdpas_block_mask(recipe_copy, tiny_llama3, tmp_path):
    """The packed run above goes through the variable-length path (--attention auto); the same run through
    SDPA with the block-diagonal mask transformers builds gives the same golden losses."""
    output = tmp_path / "sdpa"
    proc = launch(recipe_copy, *sizes(tiny_llama3, SAMPLE_CHAT), "--pack", "--attention", "sdpa", "--output",
                  str(output), "--max-steps", str(STEPS), "--save-every", "0", "--no-save-model")
    assert_finished(proc, STEPS, "multi-turn packed run through SDPA")
    assert_matches_golden(losses(output), CHAT_GOLDEN, STEPS)


def test_multi_turn_packed_run_counts_its_data(chat_run, tiny_llama3):
    from finetune_kit.data import instructions
    from finetune_kit.metering.run_record import RunRecord
    from finetune_kit.models import loading

    output, stdout = chat_run
    rec = RunRecord.read(output / "run_record.json")
    _, expected = instructions.tokenize_rows(instructions.load_rows(str(SAMPLE_CHAT)),
                                             loading.load_tokenizer(str(tiny_llama3)), 128)
    assert rec.data == expected and rec.training.packing
    assert (rec.data.format, rec.data.chat_template) == ("messages", "tokenizer's own")
    assert rec.data.truncated > 0 and rec.data.examples + rec.data.dropped_too_long == rec.data.rows
    assert expected.summary() in stdout  # said at the start, too
    metrics = read_metrics(output)
    assert all(m["padding_fraction"] == 0 for m in metrics)  # packed rows are laid end to end, unpadded
    info = read_run_info(output)
    assert_ranks_disjoint(info)
    assert info["train_examples"] < rec.data.examples  # several conversations per packed row


def test_every_format_trains(recipe_copy, tiny_llama3, tmp_path):
    """One optimizer step per remaining format (messages and prompt/response run above; ShareGPT in the 13B
    recipe's test), the launches side by side, their ranks warm: Alpaca from JSONL, prompt/completion from a
    folder of Parquet files as a hub dataset keeps them (train, validation and test splits: it trains on train and
    validates on validation, and reads no test row), and the tool-calling sample (messages with tool calls and
    results, a tools column) through --chat-template llama3.1 on 2 ranks that share each packed sequence, with a
    held-out split and sample answers. Its held-out rows read back as make eval reads them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from finetune_kit.data import formats, templates
    from finetune_kit.metering.run_record import RunRecord
    from finetune_tools.harness.tasks import conversation_pair

    parquet = tmp_path / "prompt_completion"  # 44 train rows, 4 validation, 12 test
    table = pa.Table.from_pylist([json.loads(line) for line in
                                  (SAMPLES / "prompt_completion.jsonl").read_text().splitlines()])
    (parquet / "data").mkdir(parents=True)
    for split, (start, end) in {"train": (0, 44), "validation": (44, 48), "test": (48, 60)}.items():
        pq.write_table(table.slice(start, end - start), parquet / f"data/{split}-00000-of-00001.parquet")
    common = ("--model", str(tiny_llama3), "--micro-batch-size", "2", "--grad-accum", "1", "--max-steps", "1",
              "--save-every", "0")
    runs = {"alpaca": (SAMPLES / "alpaca.jsonl", ("--max-seq-len", "128", "--eval-fraction", "0"), 1),
            "prompt_completion": (parquet, ("--max-seq-len", "128", "--samples", "0"), 1),
            "tools": (SAMPLES / "tools.jsonl", ("--chat-template", "llama3.1", "--max-seq-len", "512", "--pack",
                                                *SEQUENCE_PARALLEL, "--eval-fraction", "0.25", "--samples", "2",
                                                "--sample-tokens", "24"), 2)}
    procs = side_by_side([(recipe_copy, accelerate_command(
        *common, "--data", str(data), *extra, "--output", str(tmp_path / name), config="configs/zero3.yaml",
        nproc=nproc)) for name, (data, extra, nproc) in runs.items()], warm=True)
    for name, proc in zip(runs, procs, strict=True):
        assert_finished(proc, 1, name)
        want = {"tools": "messages, chat template llama3.1"}.get(name, f"{name.replace('_', '-')}, chat template "
                                                                        "tokenizer's own")
        assert f"({want})" in proc.stdout, name
    assert ("split 'train', held out: its 'validation' split (4 rows) in place of --eval-fraction, 'test' (12 rows) "
            "not read") in procs[1].stdout
    info = read_run_info(tmp_path / "prompt_completion")
    assert (info["train_examples"], info["eval_example_ids"]) == (44, [44, 45, 46, 47])
    assert all(i < 44 for rank in info["ranks"] for i in rank["example_ids"])  # trained on train rows alone
    # the tool calls: trained on 2 ranks sharing each packed sequence, the run's model saved with the template
    run = tmp_path / "tools"
    record = RunRecord.read(run / "run_record.json")
    assert (record.data.examples, record.training.sequence_parallel, record.training.packing) == (48, 2, True)
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    assert tokenizer.chat_template == templates.SHIPPED["llama3.1"].read_text()
    heldout = [json.loads(line) for line in (run / "heldout.jsonl").read_text().splitlines()]
    assert len(heldout) == 12 and sum("tools" in row for row in heldout) >= 10
    # the sample answers: held-out prompts cut before their last answer, most of them after a tool's result
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and any(row["prompt"].startswith("(result of ") for row in samples), samples
    # make eval's heldout task (its documents, without importing lm-eval here, which sets an environment variable
    # the warm launches after this test would differ in): the context runs to the tool's result and the header
    template = templates.ChatTemplate("the model's", tokenizer.chat_template)
    after_results = [dict(zip(("context", "target"), conversation_pair(
        tokenizer, template, formats.Conversation.from_record(row)), strict=True))
                     for row in heldout if row["messages"][-2]["role"] == "tool"]
    assert after_results and all(re.search(r"<\|start_header_id\|>ipython<\|end_header_id\|>\n\n[^<]*<\|eot_id\|>"
                                           r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n$", d["context"])
                                 and d["target"].endswith("<|eot_id|><|end_of_text|>") for d in after_results)


# ---- one model, however the batch is split ----

# the loss before the step's count: each micro-batch its own mean
PER_MICRO_BATCH_MEAN = "loss = model(**data.model_inputs(batch)).loss / step.backward_scale"


@pytest.fixture(scope="module")
def split_run(recipe_copy, tiny_llama3, tmp_path_factory):
    """A 4-step run of 8 sequences per optimizer step, split as ``ranks x micro-batch x accumulation``;
    each distinct launch runs once; ``extra`` flags come last (a later flag wins: e.g. --save-every).
    ``per_micro_batch_mean``: train.py with each micro-batch's own mean
    as its loss (the negative control). ``split_run.ahead(splits, *extra)`` runs the one-rank launches among
    ``splits`` not run yet side by side, one core each."""
    done, control = {}, None

    def key_of(ranks: int, micro: int, accum: int, *extra: str, config: str = "configs/zero3.yaml",
               per_micro_batch_mean: bool = False, launcher_args=()) -> tuple:
        return ranks, micro, accum, extra, config, per_micro_batch_mean

    def planned(ranks: int, micro: int, accum: int, *extra: str, config: str = "configs/zero3.yaml",
                per_micro_batch_mean: bool = False, launcher_args=()) -> tuple[Path, list[str], Path]:
        nonlocal control
        cwd = recipe_copy
        if per_micro_batch_mean:
            if control is None:
                control = tmp_path_factory.mktemp("control") / "recipe"
                shutil.copytree(recipe_copy, control)
                script = (control / "train.py").read_text()
                line = "loss = losses.causal_lm_loss(model, data.model_inputs(batch), step.labelled)"
                assert line in script
                (control / "train.py").write_text(script.replace(line, PER_MICRO_BATCH_MEAN))
            cwd = control
        output = tmp_path_factory.mktemp("splits") / "x".join(map(str, (ranks, micro, accum)))
        command = accelerate_command(*sizes(tiny_llama3), *split_args(ranks, micro, accum), "--output", str(output),
                                     "--max-steps", "4", "--save-every", "0", *extra, config=config, nproc=ranks,
                                     launcher_args=launcher_args)
        return cwd, command, output

    def start(ranks: int, micro: int, accum: int, *extra: str, **kwargs) -> Path:
        key = key_of(ranks, micro, accum, *extra, **kwargs)
        if key not in done:
            cwd, command, output = planned(ranks, micro, accum, *extra, **kwargs)
            assert_finished(warm_run(command, cwd), 4)
            done[key] = output
        return done[key]

    def ahead(splits, *extra: str, **kwargs) -> None:
        todo = {}
        for ranks, micro, accum in splits:
            key = key_of(ranks, micro, accum, *extra, **kwargs)
            if ranks == 1 and key not in done and key not in todo:
                todo[key] = planned(ranks, micro, accum, *extra, **kwargs,
                                    launcher_args=("--main_process_port", str(free_port())))
        launches = [(c, cmd) for c, cmd, _ in todo.values()]
        for (key, (_, _, output)), proc in zip(todo.items(), side_by_side(launches, warm=True), strict=True):
            assert_finished(proc, 4)
            done[key] = output

    start.ahead = ahead
    return start


LEVERS_AUTO = ("--levers", "auto", "--levers-gpu", "h100")  # ranked for H100s on this CPU


def assert_levers_auto_chose(output: Path, given: tuple[int, int], model: Path) -> None:
    """The run of ``given`` (micro-batch, accumulation) with --levers auto, from the installed package, took the
    first line of the ranking with the package's calibrated constants, and kept the sequences per step: the tiny
    model fits an H100 with neither checkpointing nor that split."""
    assert_levers_auto_took_the_first_of_the_ranking(output, model, given)
    record = json.loads((output / "run_record.json").read_text())["training"]
    assert (record["micro_batch_size"], record["gradient_checkpointing"]) != (given[0], True)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_same_data_split_four_ways_trains_one_model(packed, split_run, tiny_llama3):
    """1 x 8 x 1, 1 x 2 x 4, 2 x 2 x 2 and 2 x 4 x 1 (ranks x micro-batch x accumulation): the loss of each step is
    the mean over its labelled tokens on all ranks, so every split logs the same losses and saves the same model.
    Packed rows, whose tokens per micro-batch differ from rank to rank and from one accumulation step to the next:
    1 x 8 x 1 against 2 x 2 x 2, which splits across ranks and accumulation at once (the padded rows run all four).
    The padded 2 x 2 x 2 is launched with --levers auto: the split and checkpointing it picks train the same model."""
    splits = PACKED_SPLITS if packed else SPLITS
    split_run.ahead(splits, *(["--pack"] if packed else []))
    auto = {} if packed else {(2, 2, 2): LEVERS_AUTO}
    runs = {split: split_run(*split, *(["--pack"] if packed else []), *auto.get(split, ())) for split in splits}
    assert_one_model_for_every_split(runs, tiny_llama3)
    for split in auto:
        assert_levers_auto_chose(runs[split], split[1:], tiny_llama3)


def test_fsdp2_trains_one_model_however_the_batch_is_split(split_run, tiny_llama3):
    """accelerate's FSDP2 divides by the accumulation steps, its reduce-scatter averages the ranks: undone too."""
    runs = {split: split_run(*split, config=FSDP_CONFIG) for split in ((1, 8, 1), (2, 2, 2))}
    assert_one_model_for_every_split(runs, tiny_llama3)


def test_the_split_tolerances_catch_each_micro_batchs_own_mean(split_run, tiny_llama3):
    """The negative control: with each micro-batch's own mean as its loss (the recipes' loss before the step's
    token count), 1 x 2 x 4 does not train the model 1 x 8 x 1 trains."""
    runs = {(1, 8, 1): split_run(1, 8, 1), (1, 2, 4): split_run(1, 2, 4, per_micro_batch_mean=True)}
    with pytest.raises(AssertionError, match="not one model"):
        assert_one_model_for_every_split(runs, tiny_llama3)


# ---- adapters: --peft lora and --peft qlora ----

ADAPTER_RANK = 16  # the flags' default
# The tiny Llama 3: 2 layers, hidden 64, 2 KV heads of 8, ffn 224. LoRA on every linear layer of a block holds
# r (in + out) per layer: q 64+64, k 64+16, v 64+16, o 64+64, gate and up 64+224, down 224+64.
ADAPTER_PARAMS = 2 * ADAPTER_RANK * (128 + 80 + 80 + 128 + 288 + 288 + 288)


@pytest.fixture(scope="module")
def adapter_runs(recipe_copy, tiny_llama3, tmp_path_factory) -> dict[str, Path]:
    """The README's commands with adapters on two ranks, side by side: `make recipe-8b-zero3 NUM_GPUS=2 ...
    TRAIN_ARGS="... --peft lora --merge"`, and `accelerate launch --config_file configs/zero3.yaml train.py ...
    --peft qlora` from a copy of the recipe folder. 8 steps, a checkpoint at 4, two sample answers each. The LoRA run
    without dropout (--lora-dropout 0): dropout's masks depend on how the batch is split and are not kept in a
    checkpoint, so only without them can a resumed or re-split run train the same adapter."""
    common = ("--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "0", "--samples", "2")
    outputs = {peft: tmp_path_factory.mktemp("runs") / peft for peft in ("lora", "qlora")}
    lora = make_target("recipe-8b-zero3", *readme_variables(tiny_llama3, outputs["lora"], "--peft", "lora",
                                                            "--lora-dropout", "0", "--merge", *common))
    qlora = subprocess.Popen(accelerate_command(*sizes(tiny_llama3), "--peft", "qlora", "--output",
                                                str(outputs["qlora"]), *common, config="configs/zero3.yaml"),
                             cwd=recipe_copy, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=launch_env())
    for peft, proc in zip(outputs, wait_all([lora, qlora], timeout=900), strict=True):
        assert_finished(proc, STEPS, f"--peft {peft}")
    return outputs


def test_lora_and_qlora_train_their_adapters_alone_under_zero3(adapter_runs):
    """Each run trains the adapters alone (r 16 on all seven linear layers of both blocks: ADAPTER_PARAMS), its
    loss falls and the adapted model answers its held-out prompts. Three failures of this stack on the public
    trackers would each fail here:
    - non-reentrant activation checkpointing over ZeRO-3's frozen partitions (transformers#47254, trl#2514): both
      runs checkpoint every layer, and the tiny model's frozen linear weights are above ZeRO-3's persistence
      threshold (10 x hidden), so they are released after each forward, the recompute's too;
    - an adapter saved with zero-size tensors under ZeRO-3 (trl#4416): every tensor of adapter/ has LoRA's shape;
    - fp32 adapters over a bf16 base in ZeRO-3's coalesced all-gather (DeepSpeed#8072): LoRA's adapters are saved
      as peft made them, fp32, over the bf16 base, and the run took its 8 optimizer steps (QLoRA's come out bf16)."""
    from safetensors.torch import load_file

    for peft, output in adapter_runs.items():
        record, info = json.loads((output / "run_record.json").read_text()), read_run_info(output)
        assert (record["training"]["method"], record["model"]["params_trainable"]) == (peft, ADAPTER_PARAMS)
        assert record["training"]["gradient_checkpointing"] and info["zero_stage"] == 3
        assert info["details"]["lora"]["peft"] == peft and info["details"]["lora"]["rank"] == ADAPTER_RANK
        assert all(rank["params"]["partitioned_params"] > 0 for rank in info["ranks"])
        got = losses(output)
        assert got[-1] < got[0], (peft, got)
        config = json.loads((output / "adapter/adapter_config.json").read_text())
        assert (config["task_type"], config["r"], config["peft_type"]) == ("CAUSAL_LM", ADAPTER_RANK, "LORA")
        tensors = load_file(output / "adapter/adapter_model.safetensors")
        assert sum(t.numel() for t in tensors.values()) == ADAPTER_PARAMS
        assert all(ADAPTER_RANK in t.shape and t.numel() > 0 for t in tensors.values())
        assert {t.dtype for t in tensors.values()} == {{"lora": torch.float32, "qlora": torch.bfloat16}[peft]}
        assert not (output / "model").exists()
        samples = [json.loads(line) for line in (output / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == 2 and all("answer" in s and s["example_id"] in info["eval_example_ids"] for s in samples)
    assert (adapter_runs["lora"] / "merged/model.safetensors").is_file()  # --merge
    assert not (adapter_runs["qlora"] / "merged").exists()
    assert read_run_info(adapter_runs["qlora"])["details"]["lora"]["quant_type"] == "nf4"


def test_the_adapter_over_its_base_answers_as_make_merge_s_folder(adapter_runs, tiny_llama3, tmp_path):
    """plain `PeftModel.from_pretrained` over the base gives the logits of the folder `make merge` writes (in fp32
    here, so the comparison is not bf16's rounding), within MERGED_LOGITS_ATOL (tests/harness.py); the base alone
    does not (the negative control). The recipe's own --merge folder (bf16) loads with plain transformers and its
    generation config stops at the chat template's end of turn; the adapter's card says how to load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert_adapter_answers_as_its_fp32_merge(adapter_runs["lora"], tiny_llama3, tmp_path,
                                             "Spell the word 'silver' backwards.")
    tokenizer = AutoTokenizer.from_pretrained(adapter_runs["lora"] / "adapter")
    bf16 = AutoModelForCausalLM.from_pretrained(adapter_runs["lora"] / "merged")
    assert bf16.dtype == torch.bfloat16
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") in bf16.generation_config.eos_token_id
    card = (adapter_runs["lora"] / "adapter/README.md").read_text()
    assert "library_name: peft" in card and "PeftModel.from_pretrained(base" in card
    assert "| LoRA | rank 16, alpha 32, dropout 0, targets all-linear |" in card


def test_make_eval_scores_a_qlora_run_through_its_adapter(adapter_runs, tmp_path):
    """A run that saved adapter/ alone: make eval loads the adapter over its base (bf16, as make merge does) and
    scores the held-out rows; the summary reaches the run record and the card."""
    copy = tmp_path / "run"
    shutil.copytree(adapter_runs["qlora"], copy, ignore=shutil.ignore_patterns("checkpoints"))
    proc, = wait_all([make_target("eval", f"RUN={copy}")], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    heldout = json.loads((copy / "eval/summary.json").read_text())["tasks"]["heldout"]
    info = read_run_info(copy)
    print(f"harness loss {heldout['loss']:.4f} (bf16 base), the run's eval_loss {info['eval_loss']:.4f} (4-bit base)")
    assert heldout["loss"] == pytest.approx(info["eval_loss"], rel=0.05)
    assert f"| heldout | loss | {heldout['loss']:.4g} |" in (copy / "adapter/README.md").read_text()


def test_an_adapter_resumes_exactly_from_its_checkpoint(adapter_runs, recipe_copy, tiny_llama3, tmp_path):
    """The LoRA run's checkpoint at step 4, resumed: the frozen base is rebuilt from --model, the adapters and their
    optimizer states come back from ZeRO-3's partitions, and steps 5-8 log the uninterrupted run's losses."""
    output = tmp_path / "resumed"
    checkpoint = adapter_runs["lora"] / f"checkpoints/step_{SAVE_EVERY:06d}"
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--peft", "lora", "--lora-dropout", "0", "--max-steps", str(STEPS),
                  "--save-every", "0", "--output", str(output), "--resume", str(checkpoint))
    assert_finished(proc, STEPS, "resumed LoRA")
    assert_resumed_like_uninterrupted(adapter_runs["lora"], output, SAVE_EVERY, STEPS, atol=1e-6)


def test_an_adapter_trains_one_model_however_the_batch_is_split(split_run, tiny_llama3):
    """--peft lora (without dropout, whose masks follow the split), 1 x 8 x 1 against 2 x 2 x 2: the same losses,
    gradient norms and adapter update (LoRA's B matrices, which start at zero: the update itself; A starts at its
    seeded random values)."""
    runs = {split: split_run(*split, "--peft", "lora", "--lora-dropout", "0") for split in ((1, 8, 1), (2, 2, 2))}
    assert_one_model_for_every_split(runs, None, file="adapter/adapter_model.safetensors",
                                     keep=lambda name: "lora_B" in name)


# ---- fp8: torchao float8 linears ----

FP8_CONFIG = "configs/fsdp2-fp8.yaml"
# Measured (tiny Llama 3, the run's 8 steps of 16 sequences; fp8 emulated on CPU, models.fp8): fp8 against bf16,
# largest per-step loss difference 1.0e-3 with tensorwise scales, 1.5e-3 rowwise (ZeRO-3), 1.7e-3 rowwise (FSDP2) on
# an AMX Xeon; 6.7e-4, 1.4e-3 and 1.8e-3 with oneDNN held to AVX2. A 10% higher learning rate in bf16: 2.0e-2 (the
# negative control below).
FP8_LOSS_ATOL = 6e-3


@pytest.fixture(scope="module")
def fp8_run(recipe_copy, tiny_llama3, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The ZeRO-3 run's command with --fp8 tensorwise."""
    output = tmp_path_factory.mktemp("runs") / "fp8"
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--fp8", "tensorwise", "--output", str(output), "--max-steps",
                  str(STEPS), "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "0")
    assert_finished(proc, STEPS, "fp8")
    return proc, output


def assert_trains_like(got: list[float], want: list[float], atol: float = FP8_LOSS_ATOL) -> None:
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    print("per-step |loss difference|:", " ".join(f"{d:.1e}" for d in diffs))
    assert max(diffs) <= atol, list(zip(got, want, strict=True))


def test_fp8_under_zero3_trains_like_bf16(fp8_run, run):
    """Every decoder linear layer of the tiny model converts (7 per layer; the LM head stays bf16), the loss
    falls, and each step's loss is the bf16 run's within FP8_LOSS_ATOL; the record says fp8."""
    proc, output = fp8_run
    assert "fp8 (tensorwise scaling): 14 linear layers compute in float8" in proc.stdout
    assert "--fp8 tensorwise without --compile: measured 0.61x the tokens/s of bf16 on one H100" in proc.stdout
    got = losses(output)
    assert got[-1] < got[0] - 0.2
    assert_trains_like(got, losses(run))
    assert json.loads((output / "run_record.json").read_text())["training"]["fp8"] == "tensorwise"


def test_fp8_rowwise_under_fsdp2_trains_like_bf16(recipe_copy, tiny_llama3, fsdp_run, tmp_path):
    """accelerate's torchao path under FSDP2 (configs/fsdp2-fp8.yaml: every rank loads the weights), scales per row."""
    output = tmp_path / "fp8-fsdp2"
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--fp8", "rowwise", "--output", str(output), "--max-steps",
                  str(STEPS), "--save-every", "0", "--no-save-model", config=FP8_CONFIG)
    assert_finished(proc, STEPS, "fp8 FSDP2")
    assert "fp8 (rowwise scaling): 14 linear layers compute in float8" in proc.stdout
    assert "--fp8 rowwise without --compile: not measured; tensorwise uncompiled measured 0.61x" in proc.stdout
    assert_trains_like(losses(output), losses(fsdp_run))


def test_the_fp8_tolerance_catches_a_ten_percent_learning_rate_change(recipe_copy, tiny_llama3, run, tmp_path):
    """The negative control: bf16 at 1.1x the learning rate is not within FP8_LOSS_ATOL of the run."""
    output = tmp_path / "lr-plus-10-percent"
    args = ["1.1e-3" if arg == "1e-3" else arg for arg in sizes(tiny_llama3)]
    proc = launch(recipe_copy, *args, "--output", str(output), "--max-steps", str(STEPS), "--save-every", "0",
                  "--no-save-model")
    assert_finished(proc, STEPS)
    with pytest.raises(AssertionError):
        assert_trains_like(losses(output), losses(run))


def test_an_fp8_run_resumes_exactly_and_saves_a_plain_bf16_model(fp8_run, run, recipe_copy, tiny_llama3, tmp_path):
    """Resumed from its step-4 checkpoint, the fp8 run logs steps 5-8 as it did straight through (the scales are
    computed from each tensor, nothing to restore); its consolidated model holds the bf16 run's tensor names and
    dtypes, no float8 tensor or wrapper, and plain transformers loads it and generates."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, straight = fp8_run
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / f"checkpoints/step_{SAVE_EVERY:06d}", resumed / f"checkpoints/step_{SAVE_EVERY:06d}")
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--fp8", "tensorwise", "--output", str(resumed), "--max-steps",
                  str(STEPS), "--save-every", "0", "--no-save-model")
    assert_finished(proc, STEPS)
    assert losses(resumed) == losses(straight)[SAVE_EVERY:]

    fp8_weights = load_file(straight / "model/model.safetensors")
    bf16_weights = load_file(run / "model/model.safetensors")
    assert sorted(fp8_weights) == sorted(bf16_weights)
    assert {t.dtype for t in fp8_weights.values()} == {torch.bfloat16}
    config = json.loads((straight / "model/config.json").read_text())
    assert "quantization_config" not in config and "float8" not in json.dumps(config).lower()
    model = AutoModelForCausalLM.from_pretrained(straight / "model")
    assert not any("Float8" in type(m).__name__ for m in model.modules())
    tokenizer = AutoTokenizer.from_pretrained(straight / "model")
    out = model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > 1


# ---- long context: ranks that share each sequence (Ulysses, DeepSpeed ALST) ----

SEQUENCE_PARALLEL = ("--sequence-parallel", "2")
SAVE_EACH_STEP = ("--save-every", "1", "--keep-checkpoints", "0")  # the cross-node run's checkpoints, resumed below
NODES_CONFIG = "configs/zero3-ulysses-nodes.yaml"


def launch_hosts(cwd: Path, *args: str, hosts: int = 2):
    """The multi-node long-context command on ``hosts`` "hosts" of one rank each: one launcher per host with its
    own --machine_rank, meeting over loopback (the 70B recipe's test also runs its nodes in network namespaces).
    Their ranks warm (tests/warm_launch.py): these tests compare what the group computes; the Slurm session runs
    the same command with real launchers on its two nodes (tests/recipes/test_slurm.py)."""
    port = free_port()
    return side_by_side([(cwd, ["accelerate", "launch", "--config_file", NODES_CONFIG, "--num_machines", str(hosts),
                                "--num_processes", str(hosts), "--machine_rank", str(rank), "--main_process_ip",
                                "127.0.0.1", "--main_process_port", str(port), "train.py", *args])
                         for rank in range(hosts)], warm=True)


@pytest.fixture(scope="module")
def across_hosts(recipe_copy, tiny_llama3, tmp_path_factory) -> tuple[Path, list]:
    """2 hosts of one rank each, --sequence-parallel 2 spanning them: packed rows, the MLP in slices, a checkpoint
    at every step; 8 sequences per step, as the one-rank run with the whole sequences."""
    output = tmp_path_factory.mktemp("hosts") / "sp2"
    nodes = launch_hosts(recipe_copy, *sizes(tiny_llama3), *split_args(2, 8, 1), "--output", str(output),
                         "--max-steps", "4", "--pack", *SEQUENCE_PARALLEL, "--tiled-mlp", *SAVE_EACH_STEP)
    assert_finished(nodes[0], 4, name="main host")  # rank 0 says the summary
    assert_finished(nodes[1], name="second host")
    return output, nodes


@pytest.mark.parametrize("placement", ["one-node-padded", "two-hosts-packed-tiled-mlp"])
def test_two_ranks_sharing_each_sequence_train_the_model_one_rank_trains(placement, split_run, across_hosts,
                                                                         tiny_llama3):
    """2 ranks, each with half of every sequence's tokens (attention by all-to-all), against 1 rank with the whole
    sequences, 8 sequences per step: the same per-step losses, gradient norms and weight update within the split
    tolerances (measured: losses within 5e-5, gradient norms within 4e-4 relative). Padded rows on one node; packed
    rows with the MLP in slices (--tiled-mlp) in a group that spans two hosts, which says what crosses the network."""
    if placement == "one-node-padded":
        runs = {(1, 8, 1): split_run(1, 8, 1), (2, 8, 1): split_run(2, 8, 1, *SEQUENCE_PARALLEL)}
    else:
        output, nodes = across_hosts
        runs = {(1, 8, 1): split_run(1, 8, 1, "--pack"), (2, 8, 1): output}
        # the Slurm long-context job (tests/recipes/test_slurm.py) must log these losses too
        assert_matches_golden(losses(runs[(1, 8, 1)]), PACKED_GOLDEN, 4, atol=SPLIT_LOSS_ATOL)
        assert "--sequence-parallel 2 spans 2 nodes per group" in nodes[0].stderr
        assert [r["machine_rank"] for r in read_run_info(output)["ranks"]] == [0, 1]
    assert_one_model_for_every_split(runs, tiny_llama3)


def test_a_checkpoint_of_a_group_across_hosts_resumes_on_one_host_and_back(across_hosts, recipe_copy, tiny_llama3,
                                                                          tmp_path):
    """Saved by the group spanning two hosts (the run above), resumed at step 2 on one host by one rank with the whole
    sequences (--sequence-parallel 1, micro-batch 8: the same 8 per step), whose step-3 checkpoint resumes on two
    hosts with the group again: steps 3 and 4 log what the uninterrupted run logged, within the split tolerance."""
    common = [*sizes(tiny_llama3), "--grad-accum", "1", "--max-steps", "4", "--micro-batch-size", "8", "--pack",
              *SAVE_EACH_STEP]
    straight = across_hosts[0]
    one, back = tmp_path / "one-host", tmp_path / "back"
    shutil.copytree(straight / "checkpoints/step_000002", one / "checkpoints/step_000002")
    proc = launch(recipe_copy, *common, "--output", str(one), nproc=1)
    assert_finished(proc, 4)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    shutil.copytree(one / "checkpoints/step_000003", back / "checkpoints/step_000003")
    main, second = launch_hosts(recipe_copy, *common, *SEQUENCE_PARALLEL, "--tiled-mlp", "--output", str(back))
    assert_finished(main, 4, name="main host")
    assert_finished(second, name="second host")

    def by_step(output: Path) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in read_metrics(output)}

    want, step3, step4 = by_step(straight), by_step(one)[3], by_step(back)[4]
    assert sorted(by_step(one)) == [3, 4] and sorted(by_step(back)) == [4]
    assert abs(step3 - want[3]) <= SPLIT_LOSS_ATOL and abs(step4 - want[4]) <= SPLIT_LOSS_ATOL, (want, step3, step4)


def test_sigterm_stops_with_a_checkpoint_and_the_same_command_resumes(run, recipe_copy, tiny_llama3, tmp_path):
    """SIGTERM to every process of the job mid-run: the ranks agree to stop after the same step,
    checkpoint it and exit 0; the unchanged command then finishes with the uninterrupted losses.
    (The launcher, signalled too, reports the signal it got and exits non-zero.) Before the relaunch
    the output also gets the remains of a save of step 8 that never completed (a killed process
    leaves only the .partial folder): the relaunch deletes them and resumes from the stopped step."""
    output = tmp_path / "preempted"
    args = (*sizes(tiny_llama3), "--output", str(output), "--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--keep-checkpoints", "0")
    [proc], seconds = run_and_signal([accelerate_command(*args, config="configs/zero3.yaml")], recipe_copy, output,
                                     after_step=2)
    stopped = re.search(r"stopped by SIGTERM after step (\d+) of 8; checkpoint: (\S+)\. Run the same", proc.stdout)
    assert stopped, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    step = int(stopped.group(1))
    assert 2 <= step < STEPS and Path(stopped.group(2)) == output / f"checkpoints/step_{step:06d}"
    assert (output / f"checkpoints/step_{step:06d}/manifest.json").is_file()
    assert "SIGTERM received: stopping after this optimizer step" in proc.stderr
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    assert proc.returncode != 0 and "got signal: 15" in proc.stderr  # the launcher's own report
    print(f"stopped after step {step}: {seconds:.1f} s from SIGTERM until every process had exited")
    assert seconds < 60, f"{seconds:.1f} s from SIGTERM to exit"
    assert [m["step"] for m in read_metrics(output)] == list(range(1, step + 1))

    partial = output / f"checkpoints/step_{STEPS:06d}.partial"
    shutil.copytree(run / f"checkpoints/step_{STEPS:06d}", partial, ignore=shutil.ignore_patterns("*.json"))
    relaunched = launch(recipe_copy, *args)  # the signalled launch was real; the resumed ranks' work is compared
    assert_finished(relaunched, STEPS, "relaunch")
    assert f"removed {partial}: a checkpoint save that never completed" in relaunched.stdout
    assert f"at step {step}" in relaunched.stdout
    assert losses(output) == pytest.approx(losses(run), abs=1e-4)
    saved = sorted({f"step_{step:06d}", f"step_{SAVE_EVERY:06d}", f"step_{STEPS:06d}"})
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == saved
    assert (output / f"checkpoints/step_{STEPS:06d}/manifest.json").is_file()


def largest_file(checkpoint: Path) -> Path:
    return max((f for f in checkpoint.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


@pytest.fixture(scope="module")
def twelve_steps(recipe_copy, tiny_llama3, tmp_path_factory) -> tuple[list[str], Path]:
    """12 optimizer steps uninterrupted (61 rows: 3 steps of 2 x 4 x 2 an epoch, 4 epochs), a checkpoint every 2:
    its arguments but --output, and its output, that the runs killed, damaged or out of disk are compared with."""
    folder = tmp_path_factory.mktemp("twelve")
    rows = SAMPLE.read_text().splitlines()[:64]
    data = write_jsonl(folder / "rows.jsonl", [json.loads(row) for row in rows])
    args = [*sizes(tiny_llama3, data), "--epochs", "4", "--save-every", "2", "--keep-checkpoints", "0"]
    assert_finished(launch(recipe_copy, *args, "--output", str(folder / "straight")), 12)
    return args, folder / "straight"


def assert_trained_like(output: Path, straight: Path, steps: list[int]) -> None:
    """``output``'s metrics (every launch's lines) are ``steps``, each loss the uninterrupted run's bit for bit, and
    its model/ is that run's, tensor for tensor."""
    from safetensors.torch import load_file

    want = {m["step"]: m["loss"] for m in read_metrics(straight)}
    got = read_metrics(output)
    assert [m["step"] for m in got] == steps, [m["step"] for m in got]
    assert all(m["loss"] == want[m["step"]] for m in got), [(m["step"], m["loss"] - want[m["step"]]) for m in got]
    final, reference = load_file(output / "model/model.safetensors"), load_file(straight / "model/model.safetensors")
    assert final.keys() == reference.keys() and all(torch.equal(final[name], reference[name]) for name in reference)


def test_a_job_killed_whole_twice_resumes_bit_for_bit_past_damaged_checkpoints_and_a_second_launch_is_refused(
        twelve_steps, recipe_copy, tmp_path):
    """Every process of the job SIGKILLed at once (a lost node, a killed container), then the same command again:
    it resumes from the newest complete checkpoint that verifies, and the losses and the final model are the
    uninterrupted run's, bit for bit. Before each relaunch the newest checkpoint is damaged on disk for real: its
    largest shard truncated, then (the next time) a block of it zeroed in place, its size unchanged, which only the
    manifest's checksums see. Each relaunch names the damaged file and resumes from the checkpoint before it, once
    mid-epoch and once at an epoch boundary. While the first attempt ran, a second launch into its folder stopped
    before any rank started, naming the run that holds it."""
    args, straight = twelve_steps
    killed = tmp_path / "killed"
    command = accelerate_command(*args, "--output", str(killed), config="configs/zero3.yaml")
    with killed_whole_after(command, recipe_copy, killed, step=7) as first:  # checkpoints 2, 4 and 6 on disk
        second = run_command(checked(command), recipe_copy, timeout=300)
    assert_one_line_error(second, r"output folder '.*killed' is in use by a running job: process \d+ on host "
                                  r"\S+, since .*\. Wait for it to finish, .*", status=2)
    assert "world size" not in second.stdout  # no rank started
    assert first.returncode == -signal.SIGKILL
    truncated = largest_file(killed / "checkpoints/step_000006")
    with truncated.open("r+b") as f:
        f.truncate(half := truncated.stat().st_size // 2)
    with killed_whole_after(command, recipe_copy, killed, step=9) as again:  # resumes from step 4: mid-epoch
        pass
    zeroed = largest_file(killed / "checkpoints/step_000008")  # 6 saved anew (the damaged one replaced), and 8
    with zeroed.open("r+b") as f:
        f.seek(zeroed.stat().st_size // 2)
        f.write(bytes(4096))
    last = warm_run(command, recipe_copy)  # the killed launches were real; the resumed ranks' work is compared
    assert_finished(last, 12)
    for log, step, damaged, what in ((again.printed, 4, truncated, f"has {half:,} bytes, the manifest says"),
                                     (last.stdout, 6, zeroed, "has the size the manifest says but not its contents")):
        checkpoint = killed / f"checkpoints/step_{step + 2:06d}"
        name = damaged.relative_to(checkpoint)
        assert f"not resuming from {checkpoint}: it is damaged ({name} {what}" in log, log[-3000:]
        assert f"resumed from {killed / 'checkpoints'}/step_{step:06d} at step {step}" in log, log[-3000:]
    # every attempt's lines: 1-7, then 5-9 (from step 4), then 7-12 (from step 6)
    assert_trained_like(killed, straight, [*range(1, 8), *range(5, 10), *range(7, 13)])


def test_a_disk_that_fills_mid_save_stops_every_rank_in_one_line_and_the_same_command_resumes_bit_for_bit(
        twelve_steps, recipe_copy, tmp_path):
    """The output on a real filesystem (tmpfs, 32 MiB), and another writer that takes all its free room at an exact
    point of a save: when rank 1 opens its ZeRO shard of the step-4 checkpoint (after the save's check of free
    space passed), then, in the next launch, when rank 0 opens the first file of model/ while rank 1 waits for it.
    Each time every rank stops within seconds and the launch ends with one line: the folder, the bytes against
    those free, what is kept. The partial folder is gone, the checkpoint before is complete and verifies (with
    --keep-checkpoints 1, rotation waits for the new one), no model/ was put in place. Once the room is back, the
    same command resumes: from step 2, then from step 12 (only model/ and the records left to write), and the
    losses and the model are the uninterrupted run's, bit for bit."""
    from finetune_kit.training.checkpointing import checkpoints

    args, straight = twelve_steps
    with small_filesystem(tmp_path / "disk", 32 * 2**20) as disk:
        output = disk / "run"
        ckpt = output / "checkpoints"
        run_launch = accelerate_command(*args, "--keep-checkpoints", "1", "--output", str(output),
                                        config="configs/zero3.yaml")
        logs = []
        for pattern, what, where, kept in (
                (r"step_000004\.partial/.*zero_pp_rank_1_", "the step-4 checkpoint", ckpt,
                 rf"The newest complete checkpoint is {ckpt}/step_000002 \(kept\)\. Free space on that disk "
                 r"\(--keep-checkpoints 1 keeps only the newest checkpoint\) or point --output at a larger one, "
                 r"then relaunch the same command: it resumes from the newest complete checkpoint\."),
                (r"/model\.partial/", "model/", output,
                 r"Free space on that disk or point --output at a larger one; relaunch the same command: it resumes "
                 rf"from the run's newest checkpoint, {ckpt}/step_000012, and writes model/\.")):
            with fills_when_opened(disk, pattern) as other_writer:
                proc = run_command(checked(run_launch), recipe_copy, timeout=600)
                ended = time.monotonic()
            logs.append(proc.stdout)
            assert other_writer.opened, proc.stdout[-3000:] + proc.stderr[-3000:]
            assert_one_line_error(proc, rf"{re.escape(what)} did not fit on disk: '{re.escape(str(where))}' filled up "
                                        r"while it was written \((No space left on device|a write failed|another "
                                        r"rank's write failed)\); it takes about [\d.]+ MiB and [\d.]+ MiB are free "
                                        rf"now \(its partial folder removed\)\. {kept}", status=1)
            print(f"{what}: every process gone {ended - other_writer.when:.1f} s after the disk filled")
            assert ended - other_writer.when < 30
            assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
            assert not list(ckpt.glob("*.partial")) and not (output / "model").exists()
            assert not (output / "model.partial").exists()
            newest = checkpoints.list_checkpoints(output)  # complete, and it verifies
            assert [p.name for p in newest] == ["step_000002" if what != "model/" else "step_000012"]
            assert checkpoints.verify(newest[-1]) == newest[-1]
        assert f"resumed from {ckpt}/step_000002 at step 2" in logs[1], logs[1][-3000:]
        last = warm_run(run_launch, recipe_copy)  # the failed launches were real; the ranks compared
        assert_finished(last, 12)
        assert f"resumed from {ckpt}/step_000012 at step 12" in last.stdout, last.stdout[-3000:]
        assert_trained_like(output, straight, [*range(1, 5), *range(3, 13)])


def test_a_checkpoint_resumes_on_another_number_of_ranks(run, recipe_copy, tiny_llama3, tmp_path):
    """2 ranks -> 1, then that 1-rank run's checkpoint -> 2, the global batch kept (micro-batch x accumulation x
    ranks = 16): DeepSpeed's universal checkpoint carries weights, optimizer and schedule; the data position is
    counted in examples. The same examples make each step, so the losses are those of the uninterrupted 2-rank
    run, up to the order of floating-point sums. (That one rank from the start trains the 2-rank model is the
    split tests' 1 x 8 x 1 against 2 x 4 x 1.)"""
    common = ("--max-steps", str(STEPS), "--keep-checkpoints", "0")
    one_rank = [*sizes(tiny_llama3), "--grad-accum", "4"]  # the last --grad-accum wins

    down = tmp_path / "down"
    proc = launch(recipe_copy, *one_rank, *common, "--save-every", "2", "--output", str(down),
                  "--resume", str(run / f"checkpoints/step_{SAVE_EVERY:06d}"), nproc=1)
    assert_finished(proc, STEPS, "2 -> 1")
    assert "was saved by 2 ranks; converting it for 1 (DeepSpeed universal checkpoint" in proc.stdout
    assert_resumed_like_uninterrupted(run, down, SAVE_EVERY, STEPS, atol=5e-4)

    up, at = tmp_path / "up", SAVE_EVERY + 2
    proc = launch(recipe_copy, *sizes(tiny_llama3), *common, "--save-every", str(SAVE_EVERY), "--output", str(up),
                  "--resume", str(down / f"checkpoints/step_{at:06d}"))
    assert_finished(proc, STEPS, "1 -> 2")
    assert "was saved by 1 rank" in proc.stdout, proc.stdout[-2000:]
    assert_resumed_like_uninterrupted(run, up, at, STEPS, atol=5e-4)


def test_the_slurm_script_stops_on_usr1_and_requeues_itself(run, recipe_copy, tiny_llama3, tmp_path):
    """slurm/train.sbatch as Slurm runs it, with srun and scontrol replaced by shims. SIGUSR1 to
    every process of the job step (what --signal=USR1@300 does): the launcher ignores it, the ranks
    checkpoint and exit 0, and the script requeues its job. The requeued job (the same script)
    finishes with the uninterrupted losses and does not requeue again."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (shims / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    output = tmp_path / "slurm"
    train_args = [*sizes(tiny_llama3)[4:], "--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY),
                  "--keep-checkpoints", "0"]
    job = {"PATH": f"{shims}:{os.environ['PATH']}", "MODEL": str(tiny_llama3), "DATA": str(SAMPLE),
           "OUTPUT": str(output), "NUM_GPUS": "2", "SLURM_JOB_ID": "42", "TRAIN_ARGS": " ".join(train_args)}
    [proc], _ = run_and_signal([["bash", "slurm/train.sbatch"]], recipe_copy, output, after_step=2,
                               sig=signal.SIGUSR1, ranks_only=True, env=job)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"stopped by SIGUSR1 after step \d+ of 8; checkpoint: ", proc.stdout), proc.stdout[-2000:]
    assert "requeueing job 42" in proc.stdout and (tmp_path / "scontrol.log").read_text() == "requeue 42\n"

    requeued = subprocess.run(["bash", "slurm/train.sbatch"], cwd=recipe_copy, capture_output=True, text=True,
                              env=launch_env(job), timeout=900)
    assert requeued.returncode == 0 and "requeueing" not in requeued.stdout, requeued.stderr[-4000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 42\n"
    assert losses(output) == pytest.approx(losses(run), abs=1e-4)


def test_output_with_checkpoints_is_not_overwritten(run, recipe_copy, tiny_llama3):
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--output", str(run), "--max-steps", "2", nproc=1, warm=False)
    assert_refused_to_overwrite(proc, run / "checkpoints", before)


def test_batch_sizes_contradicting_the_launch_fail_before_training(recipe_copy, tiny_llama3, tmp_path):
    bad = json.loads((recipe_copy / "configs/zero3.json").read_text())
    bad["train_batch_size"] = 64  # launch gives 4 x 2 x 2 = 16
    (recipe_copy / "configs/bad.json").write_text(json.dumps(bad))
    yaml_text = (recipe_copy / "configs/zero3.yaml").read_text().replace("configs/zero3.json", "configs/bad.json")
    (recipe_copy / "configs/bad.yaml").write_text(yaml_text)
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--output", str(tmp_path / "out"), config="configs/bad.yaml",
                  warm=False)
    assert_failed_early(proc, "train_batch_size = 64", "= 16")
    assert not (tmp_path / "out").exists()  # failed before anything was written


def test_the_check_says_a_bad_input_in_one_line_and_starts_no_rank(recipe_copy, tiny_llama3, tmp_path):
    """`python -m finetune_kit.check <the README's launch command>`: the inputs are checked once,
    here, and a bad one is the whole output, exit 2."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}])
    launch = accelerate_command(*sizes(tiny_llama3, data), "--output", str(tmp_path / "out"),
                                config="configs/zero3.yaml")
    proc = run_command(checked(launch), recipe_copy, timeout=300)
    assert_one_line_error(proc, r"data '.*d\.jsonl' has the columns \['prompt', 'answer'\], which match no known "
                                r"format .*", status=2)
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_the_check_ends_a_launch_with_the_error_a_rank_found(recipe_copy, tiny_llama3, tmp_path):
    """A bad input only the ranks can see (here: too little data for one optimizer step, known once
    the data is tokenized) is said by rank 0 alone, and is the launch's last line, after the
    launcher's report of the failed ranks."""
    launch = accelerate_command(*sizes(tiny_llama3), "--grad-accum", "1000", "--output", str(tmp_path / "out"),
                                config="configs/zero3.yaml")
    proc = run_command(checked(launch), recipe_copy, timeout=300)
    assert_one_line_error(proc, r"\d+ training examples make no full optimizer step of 4 x 1000 x 2 processes; .*",
                          status=1)
    assert "ChildFailedError" in proc.stderr  # the launcher's report came, and came before


def test_the_check_alone_names_what_would_run(recipe_copy, tiny_llama3, tmp_path):
    launch = accelerate_command(*sizes(tiny_llama3), "--output", str(tmp_path / "out"), config="configs/fsdp2.yaml")
    proc = run_command(checked(launch, "--check-only"), recipe_copy, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("inputs checked: train.py, 2 processes on 1 node (accelerate launch, FSDP); "
                                         "nothing launched (--check-only)"), proc.stdout[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, pattern", [
    ("missing_file", r"data file '.*absent\.jsonl' does not exist"),
    ("missing_fields", r"columns \['prompt', 'answer'\], which match no known format"),
    ("not_json", r"d\.jsonl', line 2: not JSON"),
    ("unknown_template", r"chat template 'llama9' is not one of auto, llama2, llama3, llama3\.1, plain"),
    ("empty_after_filter", r"no training examples left"),
    ("seq_len_too_long", r"--max-seq-len 4096 is above the limit .*max_position_embeddings = 512"),
    ("no_model", r"model path '/no/such/model' does not exist"),
    ("model_without_tokenizer", r"model folder '.*bare' has config\.json but no tokenizer \(none of tokenizer\.json, "
                                r".*\)\. Save the tokenizer beside the weights"),
    ("deepspeed_typo", r"unknown key 'zero_optimization\.stage3_prefetch_bucket_sise' \(did you mean "
                       r"'zero_optimization\.stage3_prefetch_bucket_size'\?\)"),
    ("unwritable_output", r"output folder '.*taken/out' cannot be written.*\(Not a directory\)"),
    ("no_room_for_a_checkpoint", r"has 1\.0 MiB free and a checkpoint takes about .* MiB.*--save-every 0"),
    ("negative_loss_chunks", r"--loss-chunks -1: the loss is computed in that many chunks .* Pass --loss-chunks 8"),
    ("negative_data_workers", r"--data-workers -2: that many processes tokenise the data.* Pass --data-workers 0"),
    ("flex_attention_on_cpu", r"--attention flex_attention needs a CUDA GPU: PyTorch's FlexAttention has no backward"),
    ("compile_under_zero3", r"--compile under DeepSpeed ZeRO: its parameter hooks .* Compile with FSDP2 \(accelerate "
                            r"launch --config_file configs/fsdp2\.yaml\), or drop --compile\."),
    ("liger_without_cuda", r"--loss-kernel liger: Liger-Kernel's fused loss is a Triton kernel for CUDA GPUs.* "
                           r"pass --loss-kernel chunked"),
    ("recompute_every_zero", r"--recompute-every 0: activation checkpointing applies to every N-th decoder layer.* "
                              r"Pass --recompute-every 1"),
    ("negative_samples", r"--samples -1: the number of held-out prompts the final model answers, 0 or more\. "
                         r"Pass --samples 0"),
    ("sample_before_without_samples", r"--sample-before with --samples 0: there are no prompts to answer before "
                                      r"training\. Pass --samples 4"),
    ("no_sample_tokens", r"--sample-tokens 0: the most new tokens of a sample answer, 1 or more"),
    ("missing_sample_prompts", r"data file '.*absent-prompts\.jsonl' does not exist\. Pass --sample-prompts with"),
    ("peft_adapter_as_model", r"model folder '.*adapter' is a PEFT adapter \(adapter_config\.json; its base: "
                              r"'meta-llama/Meta-Llama-3-8B'\), not a model.* Merge it into its base first .* "
                              r"or pass --model meta-llama/Meta-Llama-3-8B"),
    ("checkpoint_as_model", r"model folder '.*step_000004' is a training checkpoint .* launch the run's command "
                            r"again with --output .*/earlier --resume .*step_000004; .* "
                            r"pass --model .*earlier/model\.$"),
    ("run_folder_as_model", r"model folder '.*earlier' is a training run's output folder, not a model: its saved "
                            r"model is .*earlier/model; pass --model .*earlier/model\.$"),
    ("classifier_as_model", r"model '.*classifier' is a sequence classifier \(LlamaForSequenceClassification: a "
                            r"score head of 2 labels, no LM head\); this recipe trains a causal LM"),
    ("tools_without_a_template_for_them", r"data '.*tools\.jsonl' has 44 row\(s\) with tools, but the chat template "
                                          r"'tokenizer's own' cannot train tool calling \(its text leaves out the "
                                          r"tool schemas and the tool call\)\. Pass --chat-template llama3\.1"),
    ("lora_target_typo", r"--lora-targets names qkv_proj, which is not a linear layer of --model .*; its linear "
                         r"layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    ("qlora_storage", r"--quant-storage float16 differs from the model's dtype bfloat16\. .* Pass --quant-storage "
                      r"bfloat16\.$"),
    ("adapters_under_fsdp2", r"llama3-8b-zero3 runs under DeepSpeed ZeRO-3 with adapters \(--peft lora\); FSDP2 "
                             r"launch configs are supported for full fine-tuning"),
    ("fsdp_settings", r"FSDP settings of the accelerate YAML that this recipe does not run: fsdp_version is 1; .*"
                      r"fsdp_state_dict_type is FULL_STATE_DICT; .*fsdp_activation_checkpointing is true and the "
                      r"script checkpoints every decoder layer too"),
])
def test_bad_input_fails_early_with_a_clear_message(case, pattern, recipe_main, tiny_llama3, tmp_path, monkeypatch):
    from collections import namedtuple

    from finetune_kit.errors import UserInputError
    from finetune_kit.training.checkpointing import checkpoints

    args = {"--model": str(tiny_llama3), "--data": str(SAMPLE), "--max-seq-len": "128",
            "--output": str(tmp_path / "out")}
    if case == "missing_file":
        args["--data"] = str(tmp_path / "absent.jsonl")
    elif case == "missing_fields":
        args["--data"] = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}])
    elif case == "not_json":
        args["--data"] = str(tmp_path / "d.jsonl")
        (tmp_path / "d.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a",\n')
    elif case == "unknown_template":
        args["--chat-template"] = "llama9"
    elif case == "tools_without_a_template_for_them":  # Llama 3 Instruct's own template has no tools
        args["--data"] = str(SAMPLES / "tools.jsonl")
    elif case == "empty_after_filter":
        args["--data"] = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "word " * 200, "response": "b"}])
    elif case == "seq_len_too_long":
        args["--max-seq-len"] = "4096"
    elif case == "no_model":
        args["--model"] = "/no/such/model"
    elif case == "model_without_tokenizer":  # what a bare model.save_pretrained(folder) leaves
        shutil.copytree(tiny_llama3, tmp_path / "bare", ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
        args["--model"] = str(tmp_path / "bare")
    elif case == "peft_adapter_as_model":  # what PEFT's save_pretrained leaves
        (tmp_path / "adapter").mkdir()
        (tmp_path / "adapter/adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "base_model_name_or_path": "meta-llama/Meta-Llama-3-8B", "r": 16}))
        args["--model"] = str(tmp_path / "adapter")
    elif case in ("checkpoint_as_model", "run_folder_as_model"):  # a run's folders: checkpoints/step_N, the run
        step = tmp_path / "earlier/checkpoints/step_000004"
        step.mkdir(parents=True)
        (step / "manifest.json").write_text("{}")
        shutil.copytree(tiny_llama3, tmp_path / "earlier/model")
        (tmp_path / "earlier/run_record.json").write_text("{}")
        args["--model"] = str(step if case == "checkpoint_as_model" else tmp_path / "earlier")
    elif case == "classifier_as_model":  # the 70B recipe's merged/ folder, say
        shutil.copytree(tiny_llama3, tmp_path / "classifier")
        config = json.loads((tmp_path / "classifier/config.json").read_text())
        config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "neg", "1": "pos"},
                      label2id={"neg": 0, "pos": 1})
        (tmp_path / "classifier/config.json").write_text(json.dumps(config))
        args["--model"] = str(tmp_path / "classifier")
    elif case == "negative_loss_chunks":
        args["--loss-chunks"] = "-1"
    elif case == "negative_data_workers":
        args["--data-workers"] = "-2"
    elif case == "flex_attention_on_cpu":
        args["--attention"] = "flex_attention"
    elif case == "compile_under_zero3":
        args["--compile"] = True
    elif case == "liger_without_cuda":
        args["--loss-kernel"] = "liger"
    elif case == "recompute_every_zero":
        args["--recompute-every"] = "0"
    elif case == "negative_samples":
        args["--samples"] = "-1"
    elif case == "sample_before_without_samples":
        args["--samples"], args["--sample-before"] = "0", True
    elif case == "no_sample_tokens":
        args["--sample-tokens"] = "0"
    elif case == "missing_sample_prompts":
        args["--sample-prompts"] = str(tmp_path / "absent-prompts.jsonl")
    elif case == "deepspeed_typo":
        config = json.loads((RECIPE / "configs/zero3.json").read_text())
        config["zero_optimization"]["stage3_prefetch_bucket_sise"] = config["zero_optimization"].pop(
            "stage3_prefetch_bucket_size")
        (tmp_path / "typo.json").write_text(json.dumps(config))
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "typo.json"))
    elif case == "unwritable_output":
        (tmp_path / "taken").write_text("a file where the output folder should go")
        args["--output"] = str(tmp_path / "taken/out")
    elif case == "no_room_for_a_checkpoint":
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    elif case == "lora_target_typo":
        args["--peft"], args["--lora-targets"] = "lora", "q_proj,qkv_proj"
    elif case == "qlora_storage":
        args["--peft"], args["--quant-storage"] = "qlora", "float16"
    elif case == "adapters_under_fsdp2":
        args["--peft"] = "lora"
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    elif case == "fsdp_settings":  # what accelerate exports from an FSDP1 YAML with full state dicts and its AC on
        for key, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "ACCELERATE_MIXED_PRECISION": "bf16",
                           "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                           "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
                           "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_ACTIVATION_CHECKPOINTING": "true"}.items():
            monkeypatch.setenv(key, value)
    with pytest.raises(UserInputError, match=pattern):
        recipe_main(bad_input_args(args))
    assert not (tmp_path / "out").exists()


def test_a_runs_saved_model_folder_is_a_base_the_checks_take(run, recipe_main, tmp_path):
    """model/ of a finished run (weights, config, tokenizer, chat template, its card) starts another run: the checks
    pass it (recipe_main: from the recipe folder, as a launcher starts a rank)."""
    recipe = load_script(RECIPE / "train.py")
    flags = {"--model": str(run / "model"), "--data": str(SAMPLE), "--max-seq-len": "128",
             "--output": str(tmp_path / "next")}
    args, checked, rows = recipe.check_inputs(bad_input_args(flags))
    assert (run / "model/README.md").is_file() and checked.shape.num_hidden_layers > 0 and rows


DEMO_FLOOR = 5  # of 8 held-out answers in the references' form: measured 7 on a 2-core EPYC; 4-5 with 84-119 steps


@pytest.mark.quick
def test_make_demo_shows_the_model_learned(tmp_path):
    """`make demo`, the README's first command, as written: most of its held-out answers take the form of the
    references, and its verdict line says so. Negative control, from the same run: the model as loaded (the answers
    before training) fails the same floor."""
    import re

    from finetune_kit.training.samples import form

    output = tmp_path / "demo"
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "demo"], text=True, capture_output=True,
                          env={**launch_env(), "DEMO_OUTPUT": str(output)}, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    said = re.findall(r"verdict: (\d+) of (\d+) held-out answers take the reference's form, (\d+) word for word "
                      r"\(after training\); before training (\d+) and (\d+); validation loss ([\d.]+) -> ([\d.]+)",
                      proc.stdout + proc.stderr)
    assert len(said) == 1, (proc.stdout + proc.stderr)[-4000:]
    shape, total, _, before_shape, _, loss_before, loss_after = said[0]
    rows = read_jsonl(output / "samples.jsonl")
    assert int(total) == len(rows) == 8
    assert int(shape) == sum(form(r["answer"]) == form(r["reference"]) for r in rows) >= DEMO_FLOOR
    assert int(before_shape) == sum(form(r["before"]) == form(r["reference"]) for r in rows) < DEMO_FLOOR
    assert float(loss_after) < float(loss_before) - 2  # measured 6.27 -> 2.08 nats/token
    assert (output / "model/config.json").is_file()


def test_an_nvme_run_refuses_another_number_of_ranks(run, recipe_main, tiny_llama3, tmp_path, monkeypatch):
    """A 2-rank checkpoint resumed by 1 rank with the NVMe config (its swap files are per rank)."""
    from finetune_kit.errors import UserInputError
    from tests.debian import ensure_debian_packages

    ensure_debian_packages("libaio-dev", present="/usr/include/libaio.h")  # the NVMe input checks need libaio
    config = json.loads((RECIPE / "configs/zero3-nvme.json").read_text())
    for section in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][section]["nvme_path"] = str(tmp_path)
    (tmp_path / "nvme.json").write_text(json.dumps(config))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "nvme.json"))
    with pytest.raises(UserInputError, match=r"was saved by 2 ranks, this launch has 1: a run that offloads to NVMe "
                                             r"resumes on the same number of ranks"):
        recipe_main([*sizes(tiny_llama3), "--grad-accum", "4", "--output", str(tmp_path / "out"),
                     "--resume", str(run / f"checkpoints/step_{SAVE_EVERY:06d}")])


POISONED_ROW = 2  # the row (counted from 1, as the error names rows) whose token has a NaN embedding


@pytest.fixture(scope="module")
def poisoned(tiny_llama3, tmp_path_factory) -> tuple[Path, str]:
    rows = [json.loads(row) for row in SAMPLE.read_text().splitlines()[:47]]
    return poisoned_copy(tiny_llama3, rows, POISONED_ROW, tmp_path_factory.mktemp("models"))


def test_a_nan_step_stops_the_run_before_it_is_applied_naming_its_rows(poisoned, recipe_copy, tmp_path):
    """A row whose token the model turns into NaN (the weight poisoned in the saved base, nothing patched): at the
    step that holds it, DeepSpeed discards the update (its norm is not finite) and every rank stops there with one
    line naming the step, the values and the rows of its micro-batches, the poisoned row among them. No checkpoint
    is taken after it; the ones before (every step's, --keep-checkpoints 1) are there, complete, with finite
    weights. With --on-nonfinite skip the same data trains to its end, skipping each step that holds the row, and
    its model is finite but for the poisoned row itself; under FSDP2 too, where the loop holds the update back."""
    model, data = poisoned
    args = [*sizes(model, Path(data)), "--max-seq-len", "64", "--save-every", "1", "--keep-checkpoints", "1"]
    stopped = tmp_path / "stopped"
    proc = launch(recipe_copy, *args, "--output", str(stopped))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = nonfinite_lines(proc, "error: ")
    assert len(errors) == 1, proc.stderr[-3000:]
    found = re.fullmatch(r"error: step (\d+) is not finite \(loss nan, gradient norm inf\); its micro-batches held "
                         r"rows? ([\d, -]+) \((\d+)\) of data '.*rows\.jsonl'\. Stopped there \(--on-nonfinite stop\): "
                         r"its update was not applied and no checkpoint was taken after it, .*", errors[0])
    assert found, errors[0]
    step, named = int(found[1]), named_rows(errors[0])
    assert POISONED_ROW in named and int(found[3]) == len(named) == 16, errors[0]  # 2 ranks x 4 x 2 rows
    logged = read_metrics(stopped)
    assert [m["step"] for m in logged] == list(range(1, step + 1)) and math.isnan(logged[-1]["loss"])
    assert all(math.isfinite(m["loss"]) for m in logged[:-1])
    kept = sorted(p.name for p in (stopped / "checkpoints").iterdir())
    assert kept == ([f"step_{step - 1:06d}"] if step > 1 else []), kept  # nothing of the NaN step, the last kept
    if step > 1:
        newest = stopped / f"checkpoints/step_{step - 1:06d}"
        from finetune_kit.training.checkpointing import checkpoints

        checkpoints.verify(newest)
        shards = [torch.load(f, weights_only=False) for f in newest.rglob("*optim_states.pt")]
        bad = sum(int((~torch.isfinite(t)).sum()) for shard in shards for t in tensors_in(shard)
                  if t.is_floating_point())
        hidden = json.loads((model / "config.json").read_text())["hidden_size"]
        assert shards and bad == hidden  # the fp32 master of the poisoned row as it came; every moment finite
    assert not (stopped / "model").exists() and not (stopped / "run_record.json").exists()

    skipped = tmp_path / "skipped"
    proc = launch(recipe_copy, *args, "--on-nonfinite", "skip", "--output", str(skipped))
    assert_finished(proc, None)
    lines = nonfinite_lines(proc, "skipped: step ")
    trained = read_metrics(skipped)
    nan_steps = [m["step"] for m in trained if not math.isfinite(m["loss"])]  # the row's steps, in each epoch
    assert nan_steps == [int(line.split()[2]) for line in lines] and trained[-1]["step"] > nan_steps[-1], lines
    assert lines[0].startswith(f"skipped: step {step} is not finite (loss nan, gradient norm inf)"), lines
    in_a_row = [1]
    for before, now in zip(nan_steps, nan_steps[1:], strict=False):
        in_a_row.append(in_a_row[-1] + 1 if now == before + 1 else 1)
    assert all(POISONED_ROW in named_rows(line) and f"its update was not applied ({n} in a row, "
               "--max-nonfinite-skips 3 stops the run)" in line for line, n in zip(lines, in_a_row, strict=True)), lines
    from safetensors.torch import load_file

    fsdp2 = tmp_path / "fsdp2"  # the loop itself holds optimizer.step() back here: FSDP2 would apply a NaN gradient
    proc = launch(recipe_copy, *args, "--on-nonfinite", "skip", "--output", str(fsdp2), config=FSDP_CONFIG)
    assert_finished(proc, None)
    assert [int(line.split()[2]) for line in nonfinite_lines(proc, "skipped: step ")] == nan_steps
    assert [m["step"] for m in read_metrics(fsdp2) if not math.isfinite(m["loss"])] == nan_steps
    for run in (skipped, fsdp2):
        final = load_file(run / "model/model.safetensors")
        embed = final.pop("model.embed_tokens.weight")
        assert int((~torch.isfinite(embed)).any(dim=1).sum()) == 1  # the poisoned token's row, as it came
        assert all(torch.isfinite(t).all() for t in final.values())


def test_an_output_disk_too_small_for_the_run_is_warned_of_before_it_starts(recipe_main, tiny_llama3, tmp_path,
                                                                            capsys):
    """The recipe's checks with --output on a real filesystem of 6 MiB (tmpfs): one checkpoint of the tiny model
    fits (the save-time check passes), the three that --keep-checkpoints 2 has at once and model/ do not: one
    warning line with the numbers, and the run may start; with --keep-checkpoints 1, no warning."""
    recipe = load_script(RECIPE / "train.py")
    with small_filesystem(tmp_path / "disk", 6 * 2**20) as disk:
        args = [*sizes(tiny_llama3), "--output", str(disk / "run")]
        _, checked, _ = recipe.check_inputs([*args, "--keep-checkpoints", "2"])
        checkpoint = checked.checkpoint_estimate
        final = 2 * checked.plan.memory.total_params  # model/ in bf16
        assert 1.1 * checkpoint < 6 * 2**20 < 3 * checkpoint + final  # one fits (with the margin); not all of it
        warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
        assert len(warnings) == 1 and re.fullmatch(
            rf"warning: '{re.escape(str(disk))}' has 6\.0 MiB free; this run needs about [\d.]+ MiB there \(3 "
            r"checkpoints of [\d.]+ MiB: --keep-checkpoints 2 keeps 2 at once, plus one being written; and [\d.]+ MiB "
            r"for the final save\)\. It starts, but a save will stop it once the disk is full: .*", warnings[0])
        recipe.check_inputs([*args, "--keep-checkpoints", "1", "--no-save-model"])
        assert "warning: " not in capsys.readouterr().err


def test_resuming_with_another_model_is_refused(run, recipe_main, tiny_llama2, tmp_path):
    from finetune_kit.errors import UserInputError

    checkpoint = max((run / "checkpoints").glob("step_*"))
    with pytest.raises(UserInputError, match=r"belongs to a different run: architecture 'llama: hidden .*' in the "
                                             r"checkpoint, 'llama: hidden .*' now.*nothing was overwritten"):
        recipe_main(["--model", str(tiny_llama2), "--data", str(SAMPLE), "--max-seq-len", "128",
                     "--output", str(tmp_path / "out"), "--resume", str(checkpoint)])
