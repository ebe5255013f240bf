"""The Llama 3.3 70B QLoRA recipe end to end, as a real two-node job on one machine.

Two ``accelerate launch`` processes, one per "node", with the recipe's own main and worker
YAMLs (machine_rank 0 and 1), rendezvous over loopback into one world of 2 CPU ranks; a
second run puts the nodes in two network namespaces joined by a veth pair, as two hosts.
The main run is the README's per-node make command, in the repository; the other runs use a
copy of the recipe folder outside the repository. Against the README
commands only the model (a tiny Llama 3), the data (the shipped sample), --num_processes
(1 per node instead of 4), the main node's address and port, step counts and sizes change
-- plus --lr (a random tiny model needs a larger step than a pretrained 70B) and
--lora-dropout 0 (so a resumed run can be compared with the uninterrupted one exactly).

Regenerate the golden losses after an intended numerics change with
``UPDATE_GOLDEN=1 nox -s test-llama3-70b-qlora`` and say why in the commit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.harness import (
    POISON_WORD,
    REPO,
    SAMPLE_CHAT,
    SAMPLE_REVIEWS,
    SPLITS,
    accelerate_command,
    accelerate_launch,
    assert_finished,
    assert_levers_auto_took_the_first_of_the_ranking,
    assert_matches_golden,
    assert_one_model_for_every_split,
    assert_ranks_disjoint,
    assert_refused_to_overwrite,
    assert_resumed_like_uninterrupted,
    assert_throughput_metrics,
    bad_input_args,
    fills_when_opened,
    free_port,
    launch_nodes,
    load_script,
    losses,
    make_target,
    named_rows,
    netns_unavailable,
    nonfinite_lines,
    poisoned_copy,
    read_metrics,
    read_run_info,
    run_and_signal,
    side_by_side,
    small_filesystem,
    split_args,
    tensors_in,
    two_hosts,
    wait_all,
    warm_launch,
    warm_run,
)

pytestmark = pytest.mark.recipe

RECIPE = REPO / "recipes/llama3-70b-qlora"
SAMPLE = SAMPLE_REVIEWS
GOLDEN = REPO / "tests/golden/llama3-70b-qlora.json"
LAUNCH_ENV = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": "configs/zero3.json"}  # what accelerate launch passes
STEPS, SAVE_EVERY = 6, 3
MAIN, WORKER = "configs/zero3-main.yaml", "configs/zero3-worker.yaml"
COLLECTIVE_TIMEOUT = 15  # seconds (FINETUNE_COLLECTIVE_TIMEOUT_S); the recipes' default is 600


def sizes(model: Path) -> list[str]:
    return ["--model", str(model), "--data", str(SAMPLE), "--max-seq-len", "64", "--micro-batch-size", "4",
            "--grad-accum", "2", "--lr", "2e-3", "--lora-rank", "8",
            # no dropout: a resumed run draws its dropout masks from another point of the RNG
            # stream than the uninterrupted one, so only without dropout do the losses match exactly
            "--lora-dropout", "0"]


def node_command(config: str, main_ip: str, port: int, args, nproc: str = "2") -> list[str]:
    """The README's per-node command, with one process per node instead of four."""
    return ["accelerate", "launch", "--config_file", config, "--num_processes", nproc,
            "--main_process_ip", main_ip, "--main_process_port", str(port), "train.py", *args]


def launch_two_nodes(cwd: Path, *args: str, main_ip: str = "127.0.0.1", prefixes=((), ()), env=(None, None),
                     worker_config: str = WORKER, worker_nproc: str = "2", timeout: int = 600, warm: bool = False):
    """Start main and worker together; return both finished processes (stdout, stderr, returncode). ``warm``: each
    node's rank forked from a process that imported the stack once (tests/warm_launch.py), for what they compute."""
    port = free_port()
    commands = [[*prefix, *node_command(config, main_ip, port, args, nproc)]
                for config, nproc, prefix in zip((MAIN, worker_config), ("2", worker_nproc), prefixes, strict=True)]
    if warm:
        return side_by_side([(cwd, command, extra) for command, extra in zip(commands, env, strict=True)],
                            timeout=timeout, warm=True)
    return launch_nodes(cwd, commands, list(env), timeout=timeout)


def assert_ok(nodes) -> None:
    for name, proc in zip(("main", "worker"), nodes, strict=True):
        assert_finished(proc, name=f"{name} node")


def readme_variables(model: Path, output: Path, port: int, *train_args: str) -> list[str]:
    """The README per-node command's variables but NODE_RANK, for the tests' sizes (one process per node)."""
    return ["MAIN_IP=127.0.0.1", f"MAIN_PORT={port}", "GPUS_PER_NODE=1", f"MODEL_70B={model}", f"DATA={SAMPLE}",
            f"OUTPUT_70B={output}", "TRAIN_ARGS=" + " ".join([*sizes(model)[4:], *train_args])]


@pytest.fixture(scope="module")
def made(tiny_llama3, tmp_path_factory) -> tuple[list, Path]:
    """The module's main run, started by the README's per-node command on each "node" from the repository root
    (CPU=1: on CPUs; GPUS_PER_NODE=1: one process each): `make recipe-70b-qlora NODE_RANK=0 ...` and, on the worker,
    its old name `make train-llama3-70b-qlora NODE_RANK=1 ...`."""
    output = tmp_path_factory.mktemp("runs") / "fresh"
    common = readme_variables(tiny_llama3, output, free_port(), "--max-steps", str(STEPS), "--save-every",
                              str(SAVE_EVERY), "--keep-checkpoints", "0")
    nodes = wait_all([make_target("recipe-70b-qlora", "NODE_RANK=0", *common),
                      make_target("train-llama3-70b-qlora", "NODE_RANK=1", *common)], timeout=600)
    assert_ok(nodes)
    assert f"done: {STEPS} steps" in nodes[0].stdout
    return nodes, output


@pytest.fixture(scope="module")
def run(made) -> Path:
    return made[1]


@pytest.fixture(scope="module")
def run_info(run) -> dict:
    return read_run_info(run)


@pytest.mark.quick
def test_two_nodes_form_one_world_and_train_on_different_shards(run_info):
    assert_ranks_disjoint(run_info)
    ranks = {r["rank"]: r for r in run_info["ranks"]}
    assert [ranks[i]["machine_rank"] for i in (0, 1)] == [0, 1]  # one rank from each node


@pytest.mark.quick
def test_base_is_4bit_and_only_lora_and_head_train(run_info):
    classes = run_info["details"]["parameter_classes"]
    assert classes["linear4bit_modules"] == 2 * 7  # every linear layer of the 2 decoder blocks
    assert classes["quantized_frozen"] > 0 and classes["other_trainable"] == 0
    assert classes["lora_trainable"] > 0
    assert classes["head_trainable"] == 64 * 2  # score: hidden 64 -> 2 labels, trained in full


@pytest.mark.quick
def test_zero3_partitions_parameters(run_info):
    assert run_info["zero_stage"] == 3
    for rank in run_info["ranks"]:
        params = rank["params"]
        assert params["partitioned_params"] > 0
        assert params["local"] < 0.6 * params["total"], params  # about half of every tensor per rank


@pytest.mark.quick
def test_loss_falls_and_matches_golden(run):
    got = losses(run)
    assert len(got) == STEPS
    assert sum(got[-2:]) / 2 < got[0] - 0.03, got
    # the loss is taken in fp32 from the two-class head's bf16 logits, whose rounding (about 2**-8 of a logit)
    # moves it by about 1e-3 from one CPU to another (AVX2 against AVX-512 measured 9.8e-4), so this golden allows 5e-3
    assert_matches_golden(got, GOLDEN, STEPS, atol=5e-3)


@pytest.mark.quick
def test_metrics_carry_throughput_and_memory(run):
    assert_throughput_metrics(run)


@pytest.mark.quick
def test_run_record_counts_frozen_base_flops(run, run_info, tiny_llama3):
    """The record's TFLOP/s follow the frozen-base formula: 4N for the 4-bit base, 6N for LoRA
    and the head, with the 2-label head in place of the LM head."""
    from transformers import AutoConfig

    from finetune_kit.metering.flops import FlopCounter
    from finetune_kit.metering.run_record import RunRecord
    from finetune_kit.models import shapes

    rec = RunRecord.read(run / "run_record.json")
    classes = run_info["details"]["parameter_classes"]
    trainable = classes["lora_trainable"] + classes["head_trainable"]
    assert (rec.recipe, rec.training.method, rec.model.params_trainable) == ("llama3-70b-qlora", "qlora", trainable)
    assert (rec.hardware.devices, rec.hardware.nodes, rec.training.zero_stage) == (2, 2, 3)
    assert rec.measured.flops_formula.startswith("frozen base")
    arch = shapes.from_config(AutoConfig.from_pretrained(tiny_llama3))
    assert rec.model.params_matmul == arch.matmul_params(num_labels=2)
    counter = FlopCounter(arch, num_labels=2, trainable=trainable, head_trainable=True)
    full = FlopCounter(arch, num_labels=2)
    steady = read_metrics(run)[rec.measured.warmup_steps_excluded:]
    ratio = [m["model_tflop_per_s_per_device"] * 1e12 / m["tokens_per_s_per_device"] for m in steady]
    # FLOPs per real token lie between the formula at the shortest and the longest padded length
    assert all(counter.per_token(8) * 0.999 <= r <= counter.per_token(run_info["seq_len"]) * 1.001 for r in ratio)
    assert counter.per_token(64) < full.per_token(64)
    assert rec.measured.predicted_gpu_GiB == pytest.approx(run_info["memory_plan"]["gpu_total_GiB"], abs=1e-3)


@pytest.mark.quick
def test_saved_adapter_reproduces_the_reported_validation(run, run_info, tiny_llama3):
    """Plain PEFT loads the adapter onto a freshly quantised base in this process; its
    tensors are whole (not ZeRO-3's empty placeholders) and it scores the validation
    reviews as the run did."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from finetune_kit.data import reviews
    from finetune_kit.models import loading, qlora

    tensors = load_file(run / "adapter/adapter_model.safetensors")
    assert any("lora_A" in k for k in tensors) and any("score" in k for k in tensors)
    assert all(t.numel() > 0 for t in tensors.values()), {k: t.shape for k, t in tensors.items()}

    tokenizer = loading.load_tokenizer(str(run / "adapter"))
    base = qlora.load_quantized_classifier(str(tiny_llama3), qlora.bnb_config(torch.bfloat16, torch.bfloat16),
                                           pad_token_id=tokenizer.pad_token_id)
    model = PeftModel.from_pretrained(base, str(run / "adapter")).eval()
    qlora.keep_cpu_weights_unpacked(model)  # the numerics path the run used on CPU

    rows, _ = reviews.load_reviews([str(SAMPLE)])
    wanted = set(run_info["eval_example_ids"])
    eval_rows = rows.filter(lambda r: r["example_id"] in wanted)
    batch = reviews.ReviewCollator(tokenizer.pad_token_id)(list(reviews.tokenize(eval_rows, tokenizer, 64)))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits, batch["labels"]).item()
    accuracy = (logits.argmax(-1) == batch["labels"]).float().mean().item()
    assert len(eval_rows) == len(wanted) == run_info["evals"][-1]["eval_reviews"]
    assert loss == pytest.approx(run_info["eval_loss"], abs=2e-3)
    assert accuracy == pytest.approx(run_info["eval_accuracy"], abs=1.01 / len(wanted))  # at most one review flips
    untrained = qlora.load_quantized_classifier(str(tiny_llama3), qlora.bnb_config(torch.bfloat16, torch.bfloat16),
                                                pad_token_id=tokenizer.pad_token_id)
    assert not torch.equal(untrained.score.weight, model.base_model.model.score.modules_to_save["default"].weight)


def test_resume_continues_from_the_saved_step(run, recipe_copy, tiny_llama3, tmp_path, recipe_main, monkeypatch):
    output = tmp_path / "resumed"
    nodes = launch_two_nodes(recipe_copy, *sizes(tiny_llama3), "--output", str(output), "--max-steps", str(STEPS),
                             "--save-every", str(SAVE_EVERY),
                             "--resume", str(run / f"checkpoints/step_{SAVE_EVERY:06d}"), "--merge", warm=True)
    assert_ok(nodes)
    assert f"at step {SAVE_EVERY}" in nodes[0].stdout
    assert_resumed_like_uninterrupted(run, output, SAVE_EVERY, STEPS)

    # --merge: plain transformers loads merged/, whose head is the trained one
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    merged = AutoModelForSequenceClassification.from_pretrained(output / "merged")
    head = next(t for k, t in load_file(output / "adapter/adapter_model.safetensors").items() if "score" in k)
    assert torch.equal(merged.score.weight, head.to(merged.score.weight.dtype))
    assert merged.config.pad_token_id is not None
    assert merged.config.id2label == {0: "negative", 1: "positive"}
    assert_merged_classifies_like_base_and_adapter(output, tiny_llama3, merged)
    # merged/ is a base another run can start from: the recipe's checks take it (recipe_main: from the recipe folder)
    args, checked, *_ = load_script(RECIPE / "train.py").check_inputs(
        [*sizes(tiny_llama3)[2:], "--model", str(output / "merged"), "--output", str(tmp_path / "from-merged")])
    assert checked.shape.num_hidden_layers == merged.config.num_hidden_layers and args.model.endswith("merged")


MERGED_LOGITS_ATOL = 1e-2  # measured 2.9e-3 (bf16 rounding of W + BA); LoRA updates 10% larger: 3.7e-2


def assert_merged_classifies_like_base_and_adapter(output: Path, base: Path, merged) -> None:
    """merged/ predicts what the 16-bit base with the adapter on top predicts, on the held-out reviews
    (heldout.jsonl), and its card and the adapter's say what each folder is."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    heldout = [json.loads(line) for line in (output / "heldout.jsonl").read_text().splitlines()]
    assert heldout and {row["label_name"] for row in heldout} <= {"negative", "positive"}
    assert [row["example_id"] for row in heldout] == read_run_info(output)["eval_example_ids"]
    tokenizer = AutoTokenizer.from_pretrained(output / "merged")
    net = AutoModelForSequenceClassification.from_pretrained(base, num_labels=2, dtype=torch.bfloat16,
                                                             pad_token_id=tokenizer.pad_token_id)
    if getattr(net.config, "quantization_config", None):  # a base saved in 4-bit: the bf16 it dequantizes to
        net = net.dequantize()
    unmerged = PeftModel.from_pretrained(net, output / "adapter").eval()
    batch = tokenizer([row["text"] for row in heldout], return_tensors="pt", padding=True)
    with torch.no_grad():
        want, got = unmerged(**batch).logits.float(), merged.eval()(**batch).logits.float()
    for module in unmerged.modules():  # the negative control: the LoRA updates 10% larger
        if isinstance(getattr(module, "scaling", None), dict):
            module.scaling["default"] *= 1.1
    with torch.no_grad():
        scaled = unmerged(**batch).logits.float()
    print(f"merged vs base + adapter: logits within {(want - got).abs().max().item():.2e}; with the updates 10% "
          f"larger {(scaled - got).abs().max().item():.2e}")
    assert torch.allclose(got, want, atol=MERGED_LOGITS_ATOL) and torch.equal(got.argmax(-1), want.argmax(-1))
    assert not torch.allclose(got, scaled, atol=MERGED_LOGITS_ATOL)
    adapter_card, merged_card = (output / "adapter/README.md").read_text(), (output / "merged/README.md").read_text()
    assert "library_name: peft" in adapter_card and "PeftModel.from_pretrained" in adapter_card
    assert "library_name: transformers" in merged_card and "vLLM" in merged_card


def test_make_merge_from_a_4bit_base_dequantizes_it(split_run, tiny_llama3_4bit, tmp_path):
    """`make merge` of the run that trained on the 4-bit folder: its base dequantized to bf16 with the adapter
    merged in, predicting what PeftModel over the dequantized base predicts."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    copy = tmp_path / "run"
    shutil.copytree(split_run(*FROM_4BIT), copy)
    proc, = wait_all([make_target("merge", f"RUN={copy}")], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged = AutoModelForSequenceClassification.from_pretrained(copy / "merged")
    assert getattr(merged.config, "quantization_config", None) is None  # a plain bf16 model
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert_merged_classifies_like_base_and_adapter(copy, tiny_llama3_4bit, merged)


def test_make_merge_exports_a_run_that_finished_without_merging(run, tiny_llama3, tmp_path):
    """`make merge RUN=...` on a copy of a finished run: merged/ as --merge writes it, with its card."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    assert not (copy / "merged").exists()
    proc, = wait_all([make_target("merge", f"RUN={copy}")], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"merged model saved to {copy / 'merged'}" in proc.stdout
    assert_merged_classifies_like_base_and_adapter(copy, tiny_llama3,
                                                   AutoModelForSequenceClassification.from_pretrained(copy / "merged"))


@pytest.mark.parametrize("missing, message", [
    ("adapter", "holds no adapter/adapter_config.json: merging needs the adapter a run with --peft lora or qlora"),
    ("run_info.json", "has no run_info.json to read the base model from. Pass --base"),
])
def test_merge_names_what_the_run_folder_lacks(missing, message, run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", missing))
    proc = subprocess.run([sys.executable, "-m", "finetune_tools.merge", str(copy)], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (copy / "merged").exists()


def test_a_preempted_worker_node_stops_both_nodes_with_a_checkpoint(run, recipe_copy, tiny_llama3, tmp_path):
    """SIGTERM to the worker node's training processes only: both nodes stop after the same step
    with one checkpoint and both launchers exit 0; the same two commands then finish the run with
    the uninterrupted losses. (Signalling a node's launcher too makes torch's agent on the other
    node wait out its 5-minute exit barrier: the README says so.)"""
    output = tmp_path / "preempted"
    args = (*sizes(tiny_llama3), "--output", str(output), "--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--keep-checkpoints", "0")
    port = free_port()
    commands = [node_command(MAIN, "127.0.0.1", port, args), node_command(WORKER, "127.0.0.1", port, args)]
    (main, worker), seconds = run_and_signal(commands, recipe_copy, output, after_step=2, signalled=(1,),
                                             ranks_only=True)
    stopped = re.search(rf"stopped by a stop signal to another rank after step (\d+) of {STEPS}; checkpoint: "
                        r"(\S+)\. Run", main.stdout)
    assert stopped, f"{main.stdout[-2000:]}\n{main.stderr[-3000:]}\n{worker.stderr[-3000:]}"
    step = int(stopped.group(1))
    assert 2 <= step < STEPS and Path(stopped.group(2)) == output / f"checkpoints/step_{step:06d}"
    assert main.returncode == worker.returncode == 0 and "SIGTERM received" in worker.stderr
    print(f"stopped after step {step}: {seconds:.1f} s from SIGTERM until every process had exited")
    assert seconds < 60, f"{seconds:.1f} s from SIGTERM to exit"

    assert_ok(launch_two_nodes(recipe_copy, *args, warm=True))  # the signalled launches were real
    assert losses(output) == pytest.approx(losses(run), abs=1e-4)


@pytest.mark.parametrize("sig, says", [
    (signal.SIGKILL, "another rank closed its connection: its process died or its node went away"),
    (signal.SIGSTOP, f"no answer from another rank within {COLLECTIVE_TIMEOUT} s"),  # a hung rank, or a lost network
], ids=["killed", "hung"])
def test_a_rank_that_dies_or_hangs_stops_the_other_node_in_seconds(sig, says, recipe_copy, tiny_llama3, tmp_path):
    """The worker node's training process is killed (or frozen) after step 2: the main node's rank
    says why in one line and exits 1 within the collective timeout, instead of hanging for torch's
    default half hour; its launcher exits non-zero too."""
    output = tmp_path / "lost"
    args = (*sizes(tiny_llama3), "--output", str(output), "--max-steps", "50", "--save-every", "0")
    port = free_port()
    commands = [node_command(MAIN, "127.0.0.1", port, args), node_command(WORKER, "127.0.0.1", port, args)]
    (main, _), seconds = run_and_signal(commands, recipe_copy, output, after_step=2, signalled=(1,), sig=sig,
                                        ranks_only=True, watched=(0,),
                                        env={"FINETUNE_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT)})
    assert main.returncode != 0 and f"error: rank 0 of 2 (node 0) stops: {says}" in main.stderr, main.stderr[-3000:]
    assert "relaunch the same command on every node" in main.stderr
    print(f"{sig.name}: the main node had exited {seconds:.1f} s later")
    assert seconds < COLLECTIVE_TIMEOUT + 30


def test_a_two_node_checkpoint_resumes_on_one_rank(run, recipe_copy, tiny_llama3, tmp_path):
    """2 ranks on two nodes -> 1 rank with twice the accumulation (the same global batch): LoRA, head,
    optimizer and schedule come from DeepSpeed's universal checkpoint, the 4-bit base from --model."""
    output = tmp_path / "one-rank"
    proc = warm_launch(recipe_copy, *sizes(tiny_llama3), "--grad-accum", "4", "--output", str(output),
                       "--max-steps", str(STEPS), "--resume", str(run / f"checkpoints/step_{SAVE_EVERY:06d}"),
                       config=MAIN, nproc=1, launcher_args=("--num_machines", "1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was saved by 2 ranks; converting it for 1" in proc.stdout
    assert_resumed_like_uninterrupted(run, output, SAVE_EVERY, STEPS, atol=5e-4)


@pytest.fixture(scope="module")
def split_run(recipe_copy, tiny_llama3, tiny_llama3_4bit, tmp_path_factory):
    """A 4-step run of 8 reviews per optimizer step, split as ``ranks x micro-batch x accumulation``: one rank
    on one node, or two nodes of one rank each. ``split_run.ahead(splits)`` runs the one-rank ones among
    ``splits`` side by side, one core each (each on a free port), for ``split_run`` to return."""
    done = {}

    def args_of(ranks: int, micro: int, accum: int) -> tuple[list[str], Path]:
        output = tmp_path_factory.mktemp("splits") / "x".join(map(str, (ranks, micro, accum)))
        model = tiny_llama3_4bit if (ranks, micro, accum) == FROM_4BIT else tiny_llama3
        return [*sizes(model), *split_args(ranks, micro, accum), "--output", str(output), "--max-steps", "4",
                "--save-every", "0", *LEVERS_AUTO.get((ranks, micro, accum), ())], output

    def one_rank(args: list[str], port: tuple = ()) -> list[str]:
        return accelerate_command(*args, config=MAIN, nproc=1, launcher_args=("--num_machines", "1", *port))

    def start(ranks: int, micro: int, accum: int) -> Path:
        if (ranks, micro, accum) not in done:
            args, output = args_of(ranks, micro, accum)
            if ranks == 2:
                assert_ok(launch_two_nodes(recipe_copy, *args, warm=True))
            else:
                assert_finished(warm_run(one_rank(args), recipe_copy, timeout=300), 4)
            done[ranks, micro, accum] = output
        return done[ranks, micro, accum]

    def ahead(splits) -> None:
        todo = {split: args_of(*split) for split in splits if split[0] == 1 and split not in done}
        commands = [(recipe_copy, one_rank(args, ("--main_process_port", str(free_port()))))
                    for args, _ in todo.values()]
        for split, proc in zip(todo, side_by_side(commands, timeout=300, warm=True), strict=True):
            assert_finished(proc, 4)
            done[split] = todo[split][1]

    start.ahead = ahead
    return start


# the two-node 2 x 2 x 2 ranked for two H100s over 400 Gb/s InfiniBand on this CPU: the split and checkpointing
# --levers auto picks
LEVERS_AUTO = {(2, 2, 2): ("--levers", "auto", "--levers-gpu", "h100", "--levers-network", "ib400")}
# the two-node 2 x 4 x 1 from the same model saved in 4-bit (a *-bnb-4bit folder): its nf4 weights are those the
# others quantize as they load
FROM_4BIT = (2, 4, 1)


def test_the_same_reviews_split_four_ways_train_one_adapter(split_run):
    """1 x 8 x 1, 1 x 2 x 4, 2 x 2 x 2 and 2 x 4 x 1 (ranks x micro-batch x accumulation): each review's loss over
    the labelled reviews of the whole step. Compared: the LoRA B matrices, which start at zero (finetune_kit.losses'
    unit tests show a short micro-batch weighing no more than a full one, which these full ones cannot). The
    2 x 2 x 2 runs with --levers auto, which keeps the reviews per step and changes how they are split; the
    2 x 4 x 1 trains from the model saved in 4-bit, the others quantize it as they load."""
    split_run.ahead(SPLITS)
    runs = {split: split_run(*split) for split in SPLITS}
    from_4bit = read_run_info(runs[FROM_4BIT])
    assert from_4bit["model"].endswith("bnb-4bit") and all(not read_run_info(runs[s])["model"].endswith("bnb-4bit")
                                                            for s in SPLITS if s != FROM_4BIT)
    assert from_4bit["details"]["parameter_classes"] == read_run_info(runs[SPLITS[0]])["details"]["parameter_classes"]
    for split in LEVERS_AUTO:
        assert_levers_auto_took_the_first_of_the_ranking(runs[split], read_run_info(runs[split])["model"], split[1:],
                                                         network="ib400")
        record = json.loads((runs[split] / "run_record.json").read_text())["training"]
        assert (record["micro_batch_size"], record["gradient_checkpointing"]) != (2, True)
    # the two-class head's bf16 logits round its loss by about 1e-3 (see the golden test): measured here within
    # 4.2e-4 and the gradient norms within 2.3e-3, so 5e-3 and 1e-2
    assert_one_model_for_every_split(runs, None, file="adapter/adapter_model.safetensors",
                                     keep=lambda name: "lora_B" in name, loss_atol=5e-3, norm_rtol=1e-2)


def test_resuming_with_other_lora_settings_is_refused(run, recipe_main, tiny_llama3, tmp_path):
    from finetune_kit.errors import UserInputError

    checkpoint = max((run / "checkpoints").glob("step_*"))
    with pytest.raises(UserInputError, match=r"belongs to a different run: adapters 'qlora r 8, alpha 32, dropout 0, "
                                             r"targets all-linear, nf4 double-quantized stored as bfloat16' in the "
                                             r"checkpoint, 'qlora r 4, alpha 32, dropout 0, targets all-linear, nf4 "
                                             r"double-quantized stored as bfloat16' now"):
        recipe_main([*sizes(tiny_llama3), "--output", str(tmp_path / "out"), "--resume", str(checkpoint),
                     "--lora-rank", "4"])


def test_a_damaged_checkpoint_is_refused_by_name_and_passed_over_by_auto(run, recipe_main, tiny_llama3, tmp_path,
                                                                          capsys):
    """The two-rank run's checkpoints, copied, the newest with a block of its largest file zeroed on disk (its size
    unchanged). Each rank checksummed the files it wrote. Named on the command line, the damaged one is refused in
    one line naming the file; --resume auto passes over it to the one before, saying so. Both in the recipe's
    checks, which every rank (and the pre-launch check) runs before anything loads."""
    import shutil

    from finetune_kit.errors import UserInputError
    from finetune_kit.training.checkpointing import checkpoints

    output = tmp_path / "out"
    shutil.copytree(run / "checkpoints", output / "checkpoints")
    newest = output / f"checkpoints/step_{STEPS:06d}"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert sorted(manifest["checksums"]) == sorted(manifest["files"]) and manifest["checksum"] == "xxh3_64"
    assert {checkpoints.writer(name) for name in manifest["checksums"]} == {0, 1}  # both ranks' own files
    damaged = max((f for f in newest.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with damaged.open("r+b") as f:
        f.seek(damaged.stat().st_size // 3)
        f.write(bytes(1024))
    name = re.escape(str(damaged.relative_to(newest)))
    with pytest.raises(UserInputError, match=rf"checkpoint '{re.escape(str(newest))}' is damaged: {name} has the size "
                                             r"the manifest says but not its contents \(xxh3_64 [0-9a-f]{16} when "
                                             r"saved\)\. Resume from another checkpoint"):
        recipe_main([*sizes(tiny_llama3), "--output", str(output), "--resume", str(newest)])
    _, launch, *_ = load_script(RECIPE / "train.py").check_inputs([*sizes(tiny_llama3), "--output", str(output),
                                                                "--grad-accum", "4"])  # 1 rank: the global batch kept
    assert launch.resume_from == output / f"checkpoints/step_{SAVE_EVERY:06d}"  # --resume auto, the default
    assert re.search(rf"not resuming from {re.escape(str(newest))}: it is damaged \({name} has the size the manifest "
                     rf"says but not its contents .*\); resuming from step_{SAVE_EVERY:06d}, the newest checkpoint "
                     "that verifies", capsys.readouterr().out)


def test_a_disk_that_fills_mid_save_stops_both_nodes_in_one_line_each_and_the_same_commands_resume(
        run, recipe_copy, tiny_llama3, tmp_path):
    """The two nodes' output on a real filesystem (tmpfs, 32 MiB), and another writer that takes all its free room
    when the worker's rank opens its ZeRO shard of the step-6 checkpoint, then, in the next launch, when the main
    rank opens the first file of adapter/ while the worker waits for it. Each time both nodes stop within seconds,
    each with one line: the folder, the bytes against those free, what is kept; the partial folder is gone, the
    newest complete checkpoint verifies, no adapter/ was put in place. Once the room is back, the same two commands
    resume from step 3, then from step 6 (only adapter/ and the records to write): the uninterrupted run's losses
    and adapter, bit for bit."""
    from safetensors.torch import load_file

    from finetune_kit.training.checkpointing import checkpoints

    with small_filesystem(tmp_path / "disk", 32 * 2**20) as disk:
        output = disk / "run"
        ckpt = output / "checkpoints"
        args = (*sizes(tiny_llama3), "--output", str(output), "--max-steps", str(STEPS), "--save-every",
                str(SAVE_EVERY), "--keep-checkpoints", "1")
        for pattern, what, where, newest, kept in (
                (rf"step_{STEPS:06d}\.partial/.*zero_pp_rank_1_", f"the step-{STEPS} checkpoint", ckpt, SAVE_EVERY,
                 rf"The newest complete checkpoint is {ckpt}/step_{SAVE_EVERY:06d} \(kept\)\. Free space .*"),
                (r"/adapter\.partial/", "adapter/", output, STEPS,
                 r"Free space on that disk or point --output at a larger one; relaunch the same command: it resumes "
                 rf"from the run's newest checkpoint, {ckpt}/step_{STEPS:06d}, and writes adapter/\.")):
            with fills_when_opened(disk, pattern) as other_writer:
                nodes = launch_two_nodes(recipe_copy, *args)
                ended = time.monotonic()
            assert other_writer.opened, nodes[0].stdout[-3000:] + nodes[0].stderr[-3000:]
            for node in nodes:  # one line each: every node's launcher has a log of its own
                said = [line for line in node.stderr.splitlines() if line.startswith("error: ")]
                assert node.returncode != 0 and len(said) == 1, node.stderr[-4000:]
                assert re.fullmatch(rf"error: {re.escape(what)} did not fit on disk: '{re.escape(str(where))}' filled "
                                    r"up while it was written \((No space left on device|a write failed|another "
                                    r"rank's write failed)\); it takes about [\d.]+ MiB and [\d.]+ MiB are free now "
                                    rf"\(its partial folder removed\)\. {kept}", said[0]), said[0]
                assert "[rank0]: Traceback" not in node.stderr and "[rank1]: Traceback" not in node.stderr
            print(f"{what}: both nodes gone {ended - other_writer.when:.1f} s after the disk filled")
            assert ended - other_writer.when < 30
            assert not list(ckpt.glob("*.partial")) and not (output / "adapter").exists()
            assert not (output / "adapter.partial").exists()
            complete = checkpoints.list_checkpoints(output)
            assert [p.name for p in complete] == [f"step_{newest:06d}"]
            assert checkpoints.verify(complete[-1]) == complete[-1]
        assert_ok(launch_two_nodes(recipe_copy, *args, warm=True))  # the failed launches were real
        assert [m["step"] for m in read_metrics(output)] == [*range(1, STEPS + 1), *range(SAVE_EVERY + 1, STEPS + 1)]
        assert losses(output) == [*losses(run), *losses(run)[SAVE_EVERY:]]  # bit for bit
        got, want = (load_file(o / "adapter/adapter_model.safetensors") for o in (output, run))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


POISONED_ROW = 6  # of 41 reviews: in the training split, after the first step


def test_a_nan_step_stops_both_nodes_before_it_is_applied_naming_its_rows(tiny_llama3, recipe_copy, tmp_path):
    """A review whose token the 4-bit model turns into NaN (its embedding poisoned in the saved base, nothing
    patched): at the step that holds it, DeepSpeed discards the update and both nodes stop there, each with one line
    naming the step, the values and the rows of the step's micro-batches on both ranks, the poisoned review among
    them. The checkpoint before (every step's, --keep-checkpoints 1) is kept, complete, its LoRA weights finite; no
    adapter/ is written. With --on-nonfinite skip the run trains to its end past that step, its adapter finite."""
    import csv

    from safetensors.torch import load_file

    from finetune_kit.training.checkpointing import checkpoints

    with SAMPLE.open(newline="") as f:
        rows = list(csv.DictReader(f))[:40]
    model, data = poisoned_copy(tiny_llama3, rows, POISONED_ROW, tmp_path, text=lambda r: r["text"],
                                inserted={"rating": "1", "title": "Odd", "text": f"The {POISON_WORD} broke."})
    args = [*sizes(model), "--data", data, "--max-steps", "4", "--save-every", "1", "--keep-checkpoints", "1"]
    stopped = tmp_path / "stopped"
    nodes = launch_two_nodes(recipe_copy, *args, "--output", str(stopped), warm=True)
    steps = set()
    for node in nodes:  # one line each: every node's launcher has a log of its own
        errors = nonfinite_lines(node, "error: ")
        assert node.returncode == 1 and len(errors) == 1, node.stderr[-3000:]
        found = re.fullmatch(r"error: step (\d+) is not finite \(loss nan, gradient norm [^)]*\); its micro-batches "
                             r"held rows? [\d, -]+ \((\d+)\) of data '.*rows\.csv'\. Stopped there \(--on-nonfinite "
                             r"stop\): its update was not applied and no checkpoint was taken after it, .*", errors[0])
        assert found and POISONED_ROW in named_rows(errors[0]) and int(found[2]) == 16, errors[0]  # 2 x 4 x 2 rows
        steps.add(int(found[1]))
    (step,) = steps  # both nodes name the same step; one after the first, so that a checkpoint comes before it
    assert step > 1, step
    logged = read_metrics(stopped)
    assert [m["step"] for m in logged] == list(range(1, step + 1)) and all(m["loss"] == m["loss"] for m in logged[:-1])
    complete = checkpoints.list_checkpoints(stopped)
    assert [p.name for p in complete] == [f"step_{step - 1:06d}"]
    checkpoints.verify(complete[0])
    shards = [torch.load(f, weights_only=False) for f in complete[0].rglob("*optim_states.pt")]
    assert shards and all(torch.isfinite(t).all() for shard in shards for t in tensors_in(shard)
                          if t.is_floating_point())
    assert not (stopped / "adapter").exists() and not (stopped / "run_record.json").exists()

    skipped = tmp_path / "skipped"
    nodes = launch_two_nodes(recipe_copy, *args, "--on-nonfinite", "skip", "--output", str(skipped), warm=True)
    assert_ok(nodes)
    lines = nonfinite_lines(nodes[0], "skipped: step ")
    assert lines and lines[0].startswith(f"skipped: step {step} is not finite (loss nan"), lines
    assert all(POISONED_ROW in named_rows(line) for line in lines), lines
    adapter = load_file(skipped / "adapter/adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())


def test_output_with_checkpoints_is_not_overwritten(run, recipe_copy, tiny_llama3):
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = accelerate_launch(recipe_copy, *sizes(tiny_llama3), "--output", str(run), config=MAIN, nproc=1,
                             launcher_args=("--num_machines", "1"), timeout=300)
    assert_refused_to_overwrite(proc, run / "checkpoints", before)


# ---- bad input: clear errors before any process group, data or weights ----

def write_csv(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text).lstrip())
    return str(path)


@pytest.mark.parametrize("case, pattern", [
    ("no_rating_column", r"has no column 'rating'; its columns are \['stars', 'text'\]"),
    ("no_text_column", r"has no column 'text'.*--rating-column/--text-column"),
    ("rating_out_of_range", r"line 3 \(data row 2\): rating = '7' is not a star rating; expected a whole "
                            r"number from 1 to 5"),
    ("rating_not_a_number", r"line 2 \(data row 1\): rating = 'five'"),
    ("quant_storage_mismatch", r"--quant-storage float32 differs from the model's dtype bfloat16.*"
                               r"Pass --quant-storage bfloat16"),
    ("full_fine_tune", r"--peft none: llama3-70b-qlora takes --peft lora or qlora"),
    ("chat_data", r"holds \.jsonl rows, not reviews: this recipe trains a sentiment classifier.*"
                  r"with the llama3-70b-qlora-chat recipe"),
    ("chat_csv", r"holds prompt-response rows \(columns \['prompt', 'response'\]\), not reviews"),
    ("device_map_under_zero3", r"--device-map 'auto' cannot be used under DeepSpeed ZeRO-3"),
    ("fsdp_launch", r"llama3-70b-qlora runs under DeepSpeed ZeRO-3 with adapters \(--peft qlora\); FSDP2 launch "
                    r"configs are supported for full fine-tuning"),
])
def test_bad_input_fails_early_with_a_clear_message(case, pattern, recipe_main, tiny_llama3, tmp_path, monkeypatch):
    from finetune_kit.errors import UserInputError

    args = {"--model": str(tiny_llama3), "--data": str(SAMPLE), "--max-seq-len": "64",
            "--output": str(tmp_path / "out")}
    if case == "no_rating_column":
        args["--data"] = write_csv(tmp_path / "r.csv", "stars,text\n5,great\n")
    elif case == "no_text_column":
        args["--data"] = write_csv(tmp_path / "r.csv", "rating,review\n5,great\n")
    elif case == "rating_out_of_range":
        args["--data"] = write_csv(tmp_path / "r.csv", "rating,text\n5,great\n7,wow\n1,bad\n")
    elif case == "rating_not_a_number":
        args["--data"] = write_csv(tmp_path / "r.csv", "rating,text\nfive,great\n")
    elif case == "quant_storage_mismatch":
        args["--quant-storage"] = "float32"
    elif case == "full_fine_tune":
        args["--peft"] = "none"
    elif case == "chat_data":
        args["--data"] = str(SAMPLE_CHAT)
    elif case == "chat_csv":
        args["--data"] = write_csv(tmp_path / "r.csv", "prompt,response\nHi,Hello\n")
    elif case == "device_map_under_zero3":
        args["--device-map"] = "auto"
    elif case == "fsdp_launch":  # the 8B recipe's configs/fsdp2.yaml, launched here
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UserInputError, match=pattern):
        recipe_main(bad_input_args(args))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, pattern", [
    (("machine_rank: 1", "machine_rank: 0"), r"must have a machine_rank from 1 to 1"),
    (("num_machines: 2", "num_machines: 3"), r"num_machines differs between the nodes: .* has 2, .* has 3"),
    (("main_process_port: 29500", "main_process_port: 29501"), r"main_process_port differs"),
])
def test_the_input_checks_reject_a_worker_that_disagrees_with_the_main_node(edit, pattern, recipe_copy, tmp_path):
    """What `make train-llama3-70b-qlora` runs before launching: fails in well under a second."""
    import re

    worker = tmp_path / "worker.yaml"
    worker.write_text((recipe_copy / WORKER).read_text().replace(*edit))
    ok = subprocess.run([sys.executable, "-m", "finetune_kit.launch.multinode", MAIN, WORKER, "--node-rank", "1"],
                        cwd=recipe_copy, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: 2 machines x 4 processes"), ok.stderr
    bad = subprocess.run([sys.executable, "-m", "finetune_kit.launch.multinode", MAIN, str(worker)],
                         cwd=recipe_copy, capture_output=True, text=True)
    assert bad.returncode == 2 and re.search(pattern, bad.stderr), bad.stderr


@pytest.mark.quick
def test_the_readme_make_command_on_both_nodes_trains_like_the_launch(made):
    """`make recipe-70b-qlora NODE_RANK=0|1 MAIN_IP=...` on each "node", and its old name on the worker, ran the
    module's main run to its end (its golden losses: test_loss_falls_and_matches_golden)."""
    nodes, _ = made
    assert "ok: 2 machines x 1 processes" in nodes[1].stdout  # the config pair, checked first on each node


def test_worker_with_another_num_machines_fails_in_seconds(recipe_copy, tiny_llama3, tmp_path):
    """Both real launchers: torch would form the world from the main node's view, train,
    then hang 5 minutes in the worker's exit barrier; the handshake stops both nodes."""
    bad = tmp_path / "worker-3-machines.yaml"
    bad.write_text((recipe_copy / WORKER).read_text().replace("num_machines: 2", "num_machines: 3"))
    start = time.monotonic()
    nodes = launch_two_nodes(recipe_copy, *sizes(tiny_llama3), "--output", str(tmp_path / "out"),
                             worker_config=str(bad), worker_nproc="3", timeout=300)  # 3 machines x 1 process
    assert time.monotonic() - start < 120
    for proc in nodes:
        assert proc.returncode != 0
        assert "error: the nodes disagree on num_machines" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


HANDSHAKE = "from finetune_kit.launch import multinode; multinode.handshake(timeout_s=float(__import__('sys').argv[1]))"


def test_run_time_handshake_fails_fast_when_nodes_disagree():
    """Two ranks launched by nodes that disagree on num_machines (torch alone would form
    the world from the main node's view and hang at exit): both fail in seconds."""
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))  # the agent's store
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1"}
    views = [{"RANK": "0", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2"},
             {"RANK": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3"}]
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", HANDSHAKE, "60"], env={**base, **v}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for v in views]
    results = [p.communicate(timeout=60) for p in procs]
    assert time.monotonic() - start < 30
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode != 0
        assert "the nodes disagree on num_machines: machine_rank" in err and "has 3" in err, err[-2000:]
    del store


def test_run_time_handshake_names_a_missing_node():
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "1", "RANK": "0", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "-c", HANDSHAKE, "3"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "rank 1 did not report within 3 s" in proc.stderr, proc.stderr[-2000:]
    del store


# ---- two hosts: the nodes in two network namespaces joined by a veth pair ----

def test_two_hosts_in_network_namespaces_form_one_world(recipe_copy, tiny_llama3, tmp_path):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    output = tmp_path / "netns"
    with two_hosts() as (ns, dev, addrs):
        nodes = launch_two_nodes(recipe_copy, *sizes(tiny_llama3), "--output", str(output), "--max-steps", "2",
                                 "--save-every", "100", main_ip=addrs[0],
                                 prefixes=[("ip", "netns", "exec", name) for name in ns],
                                 env=[{"GLOO_SOCKET_IFNAME": iface} for iface in dev])
        leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(name in leftover for name in ns)
    assert not any(name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                   for name in ns)
    assert_ok(nodes)
    info = read_run_info(output)
    assert info["devices"] == 2
    assert sorted(r["machine_rank"] for r in info["ranks"]) == [0, 1]
    assert all(r["world_size"] == 2 for r in info["ranks"])
