import json
from pathlib import Path

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.models import loading


def test_llama3_pad_is_reserved_token_not_eos(tiny_llama3):
    tok = loading.load_tokenizer(str(tiny_llama3))
    assert tok.pad_token == "<|finetune_right_pad_id|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "right"


def test_llama2_pad_is_unk(tiny_llama2):
    tok = loading.load_tokenizer(str(tiny_llama2))
    assert tok.pad_token == "<unk>" and tok.pad_token_id != tok.eos_token_id


def test_pad_added_as_last_resort(tiny_llama2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama2))
    tok.unk_token = None
    n = len(tok)
    assert loading.ensure_pad_token(tok) == "<pad>"
    assert len(tok) == n + 1


def test_missing_model_path():
    with pytest.raises(ConfigError, match=r"model path '/no/such/model' does not exist"):
        loading.load_config("/no/such/model")


def test_folder_without_config(tmp_path):
    with pytest.raises(ConfigError, match=r"has no config.json"):
        loading.load_config(str(tmp_path))


def test_model_file_the_user_cannot_read(tmp_path, monkeypatch):
    # A model folder written by root and mounted into a container that runs as uid 1000: safetensors
    # would say "No such file or directory" for a file that is there.
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(loading.os, "access", lambda f, mode: Path(f).name != "model.safetensors")
    with pytest.raises(ConfigError, match=r"cannot read: model.safetensors.*chmod -R a\+rX"):
        loading.load_config(str(tmp_path))


def test_seq_len_above_model_limit(tiny_llama3):
    config = loading.load_config(str(tiny_llama3))
    limit = json.loads((tiny_llama3 / "config.json").read_text())["max_position_embeddings"]
    loading.check_seq_len(limit, config, "tiny")
    with pytest.raises(ConfigError, match=rf"--max-seq-len {limit + 1} is above.*{limit}"):
        loading.check_seq_len(limit + 1, config, "tiny")


@pytest.mark.parametrize("token, says", [(None, "no HF_TOKEN is set"), ("hf_x", "HF_TOKEN is set, but its account")])
def test_a_gated_hub_model_without_access_names_the_licence_and_the_token(monkeypatch, token, says):
    from huggingface_hub.errors import GatedRepoError
    from transformers import AutoConfig

    def gated(name, **kwargs):  # what transformers raises for a gated repo without an accepted licence
        cause = GatedRepoError.__new__(GatedRepoError)
        Exception.__init__(cause, "401 Client Error: access to model meta-llama/Meta-Llama-3-8B is restricted")
        raise OSError(f"You are trying to access a gated repo.\nMake sure to have access to it at "
                      f"https://huggingface.co/{name}.") from cause

    monkeypatch.setattr(AutoConfig, "from_pretrained", gated)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    else:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=rf"model 'meta-llama/Meta-Llama-3-8B' is gated on the Hugging Face hub and "
                                          rf"{says}.*https://huggingface\.co/meta-llama/Meta-Llama-3-8B, then export "
                                          r"HF_TOKEN=.*every node"):
        loading.load_config("meta-llama/Meta-Llama-3-8B")
