from safetensors.torch import load_file
from transformers import AutoConfig

from finetune_tools.tiny_models import build_tiny


def test_llama3_shape(tiny_llama3):
    cfg = AutoConfig.from_pretrained(tiny_llama3)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 4  # 32:8 as in Llama 3 8B
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    assert cfg.tie_word_embeddings is False


def test_llama2_shape(tiny_llama2):
    cfg = AutoConfig.from_pretrained(tiny_llama2)
    assert cfg.num_key_value_heads == cfg.num_attention_heads  # multi-head attention
    assert cfg.rope_parameters["rope_theta"] == 10000.0


def test_build_is_deterministic(tmp_path, tiny_llama3):
    again = build_tiny("llama3", tmp_path / "again")
    a, b = load_file(tiny_llama3 / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert (again / "tokenizer.json").read_text() == (tiny_llama3 / "tokenizer.json").read_text()
