"""The full-depth 70B case's model: a 4-bit folder built one decoder layer at a time, checked against what
transformers itself writes when it quantizes a 16-bit folder and saves it (finetune_tools.tiny_models.save_4bit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune_kit.models import qlora
from finetune_tools.gpu_check import synthetic
from finetune_tools.gpu_check.cases import BY_NAME, FULL_70B
from finetune_tools.tiny_models import save_4bit

ARCH = "llama3.3-70b"
QUANT_STATE = "quant_state.bitsandbytes__nf4"


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("four-bit")
    reference = save_4bit(synthetic.build_model(ARCH, "llama3", 2, root / "bf16", tiny=True), root / "saved")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(synthetic, "SHARD_BYTES", 60_000)  # several shards at the tiny width, as at 70B
        built = synthetic.build_4bit_model(ARCH, "llama3", 2, root / "built", tiny=True)
    return reference, built


def test_layer_by_layer_folder_holds_what_transformers_saves(folders):
    reference, built = map(tensors, folders)
    assert sorted(built) == sorted(reference)
    for name, tensor in reference.items():
        if name.endswith(QUANT_STATE):  # the JSON of each weight's quantization: the same fields
            saved, ours = (json.loads(bytes(t.tolist()).decode()) for t in (tensor, built[name]))
            assert sorted(ours) == sorted(saved) and ours["quant_type"] == "nf4", name
        else:
            assert (built[name].dtype, built[name].shape) == (tensor.dtype, tensor.shape), name
    configs = [json.loads((folder / "config.json").read_text()) for folder in folders]
    assert configs[1] == configs[0]


def test_the_shards_index_names_every_tensor_once(folders):
    built = folders[1]
    index = json.loads((built / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in built.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert sorted(index["weight_map"]) == sorted(tensors(built))
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors(built).values())


def test_the_folder_loads_as_the_recipes_4bit_base_with_random_weights(folders):
    from transformers import AutoConfig, AutoModelForCausalLM

    built = folders[1]
    config = AutoConfig.from_pretrained(built)
    assert qlora.check_prequantized(config, qlora.bnb_config(torch.bfloat16, torch.bfloat16), model=str(built))
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (1, 16))
    assert torch.isfinite(model(input_ids=ids).logits).all()
    weights = model.dequantize(dtype=torch.bfloat16).model.layers[1].mlp.down_proj.weight.float()
    # nf4 keeps the random init's spread (normal, std initializer_range); a layer of zeros or of unscaled codes fails
    assert weights.std().item() == pytest.approx(config.initializer_range, rel=0.1)


def test_the_disk_estimate_is_the_folders_size(folders):
    size = json.loads((folders[1] / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert synthetic.folder_bytes(ARCH, 2, tiny=True, prequantized=True) == pytest.approx(size, rel=0.02)
    # all 80 layers: about 40 GB, where 16-bit weights would take 141 GB
    full = synthetic.folder_bytes(ARCH, 80, prequantized=True)
    assert 38e9 < full < 42e9 and synthetic.folder_bytes(ARCH, 80) > 3.5 * full


def test_the_full_depth_case_is_the_chat_recipe_on_every_layer():
    case = BY_NAME[FULL_70B]
    assert (case.recipe, case.layers, case.prequantized, case.data) == ("llama3-70b-qlora-chat", 80, True,
                                                                        "instructions")
