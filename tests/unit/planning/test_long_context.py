"""Long-context planning: Ulysses sequence parallelism, TiledMLP and the longest-context search (DeepSpeed
ALST, arXiv 2506.13996), and the generated results/long-context.md."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.models.shapes import resolve_model
from finetune_kit.planning.activations import activation_bytes
from finetune_kit.planning.hardware import GPUS
from finetune_kit.planning.speed import Cluster, Job, all_to_all_bytes, predict
from finetune_kit.planning.verdict import Setup, plan
from finetune_tools.planning import long_context
from finetune_tools.planning.long_context import alst_levers, longest_context
from tests.harness import REPO

SHAPE = resolve_model("llama3.1-8b")


def test_sequence_parallel_halves_the_sequence_dependent_terms():
    args = (SHAPE, 1, 65536, True)
    one = activation_bytes(*args, loss_chunks=8, kv_repeated=False)
    two = activation_bytes(*args, loss_chunks=8, kv_repeated=False, sequence_parallel=2)
    for term in ("kept", "loss", "recompute"):
        assert two[term] == pytest.approx(one[term] / 2, rel=1e-6)
    assert one["a2a"] == 0 and two["a2a"] > 0  # Ulysses' buffers only with sp > 1


def test_sp_1_and_no_tiling_are_the_plain_plan():
    base = Setup(gpus_per_node=8, micro_batch=4, seq_len=2048, loss_chunks=8)
    assert plan("llama3-8b", replace(base, sequence_parallel=1, tiled_mlp=False)).gpu_parts == \
        plan("llama3-8b", base).gpu_parts


def test_tiled_mlp_shrinks_only_the_rebuilt_layer():
    plain = activation_bytes(SHAPE, 1, 131072, True)
    tiled = activation_bytes(SHAPE, 1, 131072, True, tiled_mlp=True)
    assert tiled["kept"] == plain["kept"]  # checkpointed layer inputs do not depend on the MLP
    # the SwiGLU intermediates (8f bytes per token) of one 4,096-token shard instead of all 131,072 tokens
    assert plain["recompute"] - tiled["recompute"] == 8 * SHAPE.intermediate_size * (131072 - 4096)


def test_sequence_parallel_must_divide_the_gpus():
    with pytest.raises(ConfigError, match="sequence_parallel 3"):
        plan("llama3.1-8b", Setup(gpus_per_node=8, sequence_parallel=3))


def _longest(nodes, gpus_per_node, sp, **fields):
    setup = alst_levers(Setup(nodes=nodes, gpus_per_node=gpus_per_node, sequence_parallel=sp, offload_optimizer=True,
                              gpu_memory_GiB=80, **fields))
    return longest_context("llama3.1-8b", setup)


def test_longest_context_grows_with_gpus_and_is_the_edge_of_fitting():
    one, eight, thirty_two = _longest(1, 1, 1, offload_param=True), _longest(1, 8, 8), _longest(4, 8, 32)
    assert one.setup.seq_len < eight.setup.seq_len < thirty_two.setup.seq_len
    assert eight.setup.seq_len % 1024 == 0 and thirty_two.setup.seq_len % 1024 == 0
    longer = replace(eight.setup, seq_len=eight.setup.seq_len + 1024)
    assert plan("llama3.1-8b", replace(longer, loss_chunks=longer.loss_chunks + 1)).fits is False


def test_negative_control_more_gpus_without_sequence_parallelism_do_not_lengthen_the_context():
    # Data parallelism alone shards the model states, not the sequence: the longest context barely moves.
    one, eight = _longest(1, 1, 1), _longest(1, 8, 1)
    assert eight.setup.seq_len < 1.5 * one.setup.seq_len
    assert _longest(1, 8, 8).setup.seq_len > 4 * eight.setup.seq_len


def test_host_memory_bounds_the_longest_context():
    roomy, tight = _longest(1, 8, 8), _longest(1, 8, 8, host_memory_GiB=400)
    assert tight.setup.seq_len < roomy.setup.seq_len and tight.host_bytes <= 400 * 2**30


def test_all_to_all_traffic_and_attention_flops():
    short, long = Job(SHAPE, seq_len=2**20, sequence_parallel=8), Job(SHAPE, seq_len=2**21, sequence_parallel=8)
    assert all_to_all_bytes(Job(SHAPE, seq_len=2**20)) == 0
    assert all_to_all_bytes(long) == pytest.approx(2 * all_to_all_bytes(short))  # linear in the length
    # 4 all-to-alls per layer, 3 passes with checkpointing, 7/8 of each local tensor sent
    local = 2**20 / 8
    per_layer = (2 * SHAPE.hidden_size + 2 * SHAPE.kv_dim) * 2 * local
    assert all_to_all_bytes(short) == pytest.approx(SHAPE.num_hidden_layers * 3 * 7 / 8 * per_layer)
    node = Cluster(GPUS["h100"], gpus_per_node=8)
    a, b = predict(short, node), predict(long, node)
    assert b.matmul_s > 2 * a.matmul_s  # attention grows with seq^2 per sequence
    assert a.intra_node_s > predict(Job(SHAPE, seq_len=2**20 // 8), node).intra_node_s


def test_the_table_generator_reproduces_the_committed_file():
    from finetune_tools.results import long_context_runs

    results = REPO / "results"
    assert (results / long_context.FILE).read_text() == long_context_runs.page(results)


def test_the_table_compares_with_each_published_alst_figure():
    rows = long_context.predictions(REPO / "results")
    assert [int(r["seq_len"]) for r, _ in rows] == [500_000, 3_700_000, 15_000_000]
    for row, p in rows:
        assert p is not None and p.fits
        assert 0.5 < p.setup.seq_len / int(row["seq_len"]) < 2  # within a factor of two of what ALST ran
