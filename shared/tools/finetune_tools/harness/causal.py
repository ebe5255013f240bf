"""The language-model route (8B, 13B recipes): the model folder's weights, loaded once, scored by lm-eval's HFLM.

Two lm-eval models share the weights. Tasks of lm-eval run through its own ``hf`` model (HFLM), unchanged. The
heldout task runs through ``finetune-hf``, HFLM with one difference, in how a request's (context, continuation)
becomes tokens (:func:`encode_pair`):

- HFLM moves a context's trailing whitespace into the continuation before it tokenises (``_encode_pair`` in
  lm_eval/api/model.py), so that "Answer:" + " Paris" is tokenised as a word. A chat template's generation prompt
  ends in whitespace (Llama 3: ``<|end_header_id|>\\n\\n``), so HFLM would score the header's newlines as part of
  the answer: one more token per answer, and one the model finds trivially.
- HFLM lets the tokenizer add its special tokens unless the text starts with BOS. The rendered conversation
  carries ``<|begin_of_text|>`` itself; training tokenised it with ``add_special_tokens=False`` (a template
  without BOS, such as ``plain``, then has none).

``encode_pair`` tokenises as training did: the context and the answer each on their own, nothing added. The
heldout task counts each answer's tokens with the same function (finetune_tools.harness.tasks), so the token
count of the perplexity is the number of tokens scored. With Llama 3's tokenizer the context then ends in the
token ``\\n\\n`` (id 271) and the answer starts at its first word, as in one tokenisation of the whole text.
"""

from __future__ import annotations

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from finetune_tools.harness.inputs import ModelSource


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of ``context`` and of ``continuation``, each tokenised alone with no special tokens added."""
    return (tokenizer(context, add_special_tokens=False)["input_ids"],
            tokenizer(continuation, add_special_tokens=False)["input_ids"])


@register_model("finetune-hf")
class ChatTurnLM(HFLM):
    """HFLM that scores a continuation exactly as given: the context keeps its trailing whitespace, and no
    special token is added (see the module's docstring). For tasks whose context is a rendered chat."""

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        return encode_pair(self.tokenizer, context, continuation)


def load_tokenizer(source: ModelSource):
    """The tokenizer saved with the model (or the adapter; else the adapter's base's): its chat template renders
    the heldout task."""
    from transformers import AutoTokenizer

    saved = (source.folder / "tokenizer_config.json").is_file() or not source.base
    return AutoTokenizer.from_pretrained(str(source.folder) if saved else source.base)


def load_model(source: ModelSource, *, device: str, dtype: str):
    """``source``'s causal LM in eval mode: the model folder, or a causal LoRA adapter merged into its base. On
    ``cuda`` the layers are spread over the visible GPUs (device_map="auto": an 8B model in bf16 needs ~16 GB,
    a 13B one ~26 GB); on ``cpu`` they stay in host memory."""
    import torch
    from transformers import AutoModelForCausalLM

    placement = {"device_map": "auto"} if device == "cuda" else {}
    if source.base:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(source.base, dtype=getattr(torch, dtype), **placement)
        return PeftModel.from_pretrained(base, str(source.folder)).merge_and_unload().eval()
    return AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=getattr(torch, dtype), **placement).eval()


def language_models(model, tokenizer, *, batch_size: int, max_length: int | None = None) -> tuple[HFLM, HFLM]:
    """(the heldout task's ``finetune-hf``, the other tasks' ``hf``) over the same loaded ``model``. The heldout
    log-softmax runs in float32: a bf16 one rounds each token's log-probability to ~3 significant digits.
    ``max_length`` (the run's --max-seq-len): a longer document keeps its last ``max_length`` tokens (lm-eval cuts
    the context from the left), so no forward is longer than the model trained on; None: the model's own limit."""
    length = {"max_length": max_length} if max_length else {}
    return (ChatTurnLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, softmax_dtype="float32",
                       **length),
            HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **length))
