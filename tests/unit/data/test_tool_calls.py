"""Tool-calling conversations: every shape files come in reads as the same messages, renders through a chat
template with its schemas, and takes loss on the assistant's text and calls only; a template that cannot render
tools, or whose turns would put loss on a result or none on a call, is refused in one line before anything
starts."""

import json
import re

import pytest

from finetune_kit.data import formats, instructions, loss_mask, templates
from finetune_kit.errors import DataError
from finetune_kit.models.loading import load_tokenizer
from tests.harness import REPO
from tests.unit.data.test_data import learnt_spans

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ANSWER = "It is 18 C and sunny in Paris."
# OpenAI's shape: the call's arguments as JSON text, no content beside the call, the schemas as JSON text
OPENAI = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"},
    {"role": "assistant", "content": ANSWER}], "tools": json.dumps([WEATHER])}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "call_1"}]},
    {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1", "name": "get_weather"},
    {"role": "assistant", "content": ANSWER}]
# LLaMA-Factory's ShareGPT shape: function_call and observation turns, bare schemas
SHAREGPT = {"conversations": [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
    {"from": "observation", "value": "18 C, sunny"},
    {"from": "gpt", "value": ANSWER}], "tools": json.dumps([WEATHER["function"]])}
# What llama3.1.jinja makes of it, written out by hand
RENDERED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n"
    'Call a function by answering with JSON: {"name": function name, "parameters": {argument name: value}}. '
    "The functions:\n\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Today\'s weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n\n'
    "Be brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
    "<|start_header_id|>ipython<|end_header_id|>\n\n18 C, sunny<|eot_id|>"
    f"<|start_header_id|>assistant<|end_header_id|>\n\n{ANSWER}<|eot_id|>")
LEARNT = ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', f"{ANSWER}<|eot_id|><|end_of_text|>"]


@pytest.fixture(scope="module")
def tok3(tiny_llama3):
    return load_tokenizer(str(tiny_llama3))


def convert(row: dict) -> list[dict]:
    return formats.detect(list(row)).to_messages(row)


def conversation(row: dict) -> formats.Conversation:
    return formats.detect(list(row)).read(row)


def learnt_texts(tokenizer, example: dict) -> list[str]:
    """The text of each run of tokens that carries loss."""
    texts = [tokenizer.decode(span) for span in learnt_spans(example)]
    assert texts == loss_mask.learnt_texts(tokenizer, example)  # the check's reading of the labels is the test's
    return texts


def llama31_with(tmp_path, name: str, replacements: dict[str, str]) -> templates.ChatTemplate:
    """The shipped llama3.1 template with pieces of its text replaced (each must be there), as a .jinja file."""
    source = templates.SHIPPED["llama3.1"].read_text()
    for old, new in replacements.items():
        assert old in source, old
        source = source.replace(old, new)
    (tmp_path / f"{name}.jinja").write_text(source)
    return templates.ChatTemplate(str(tmp_path / f"{name}.jinja"), source)


RESULT_TURN = ("{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] | trim "
               "+ '<|eot_id|>' }}")
PLAIN_TURN = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
              "+ '<|eot_id|>' }}")
CALLS = ("""{%- for call in message.tool_calls %}
            {{- '{"name": ' + call.function.name | tojson + ', "parameters": ' + call.function.arguments | tojson """
         """+ '}' }}
            {%- if not loop.last %}
                {{- '\\n' }}
            {%- endif %}
        {%- endfor %}""")


def results_in_answers(tmp_path) -> templates.ChatTemplate:
    """Writes each tool result inside the assistant's next turn (as "Result: ..."): it renders and splits fine."""
    return llama31_with(tmp_path, "results_in_answers", {RESULT_TURN: "", PLAIN_TURN: (
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{%- if not loop.first and loop.previtem['role'] == 'tool' %}"
        "{{- 'Result: ' + loop.previtem['content'] + '\\n' }}{%- endif %}"
        "{{- message['content'] | trim + '<|eot_id|>' }}")})


def calls_in_results(tmp_path) -> templates.ChatTemplate:
    """Writes each call at the head of the tool turn that answers it, not in the assistant's turn."""
    return llama31_with(tmp_path, "calls_in_results", {CALLS: "", RESULT_TURN: (
        "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + loop.previtem.tool_calls[0].function.arguments "
        "| tojson + '\\n' + message['content'] | trim + '<|eot_id|>' }}")})


# ---- every shape reads as the same messages and schemas ----

def test_openai_calls_read_with_their_arguments_as_an_object():
    assert convert(OPENAI) == MESSAGES
    as_object = json.loads(json.dumps(OPENAI))
    as_object["messages"][2].update(content="", tool_calls=[{**CALL, "id": "call_1"}])
    assert convert(as_object) == MESSAGES
    bare = json.loads(json.dumps(OPENAI))  # {"name", "arguments"} without the "function" wrapper
    bare["messages"][2]["tool_calls"] = [{"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}]
    assert convert(bare) == MESSAGES


def test_sharegpt_function_call_and_observation_render_as_the_openai_row(tok3):
    messages = convert(SHAREGPT)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"] == [CALL] and messages[3] == {"role": "tool", "content": "18 C, sunny"}
    template = templates.resolve("llama3.1", tok3)
    assert formats.tools(SHAREGPT) == formats.tools(OPENAI) == [WEATHER]
    assert (templates.render(tok3, template, messages, tools=formats.tools(SHAREGPT))
            == templates.render(tok3, template, MESSAGES, tools=[WEATHER]) == RENDERED)


def test_the_tools_column_as_a_list_as_text_or_absent():
    assert formats.tools({"tools": [WEATHER]}) == formats.tools({"tools": json.dumps([WEATHER])}) == [WEATHER]
    # a Parquet table gives each schema every schema's keys, the missing ones null: those are dropped
    padded = {"type": "function", "function": {**WEATHER["function"], "strict": None}}
    assert formats.tools({"tools": [padded]}) == [WEATHER]
    for none in ({}, {"tools": None}, {"tools": ""}, {"tools": []}, {"tools": "[]"}):
        assert formats.tools(none) is None


@pytest.mark.parametrize(("turn", "message"), [
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{city"}}]},
     r"row 2: the arguments of tool call 1 \(f\) of turn 2 of 'messages' is not JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     r"row 2: the arguments of tool call 1 \(f\) of turn 2 of 'messages' are a list, not an object"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": {}}}]},
     r"row 2: tool call 1 of turn 2 of 'messages' has no function name"),
    ({"role": "assistant", "content": "x", "tool_calls": "f()"},
     r"row 2: turn 2 of 'messages' has tool_calls of type str, not a list of calls"),
    ({"role": "tool", "content": "18 C"},
     r"row 2: turn 2 is a tool result, but turn 1 \(user\) calls no tool"),
])
def test_a_bad_call_or_result_is_named_by_row_and_turn(turn, message):
    rows = [{"messages": MESSAGES}, {"messages": [MESSAGES[1], turn, {"role": "assistant", "content": "x"}]}]
    with pytest.raises(DataError, match=r"(?s)1 row\(s\) cannot be read as a conversation:\n  " + message):
        formats.check_rows(rows, formats.detect(["messages"]))


def test_bad_schemas_are_named():
    rows = [{"messages": MESSAGES, "tools": '{"name": "f"}'}, {"messages": MESSAGES, "tools": "[{"}]
    with pytest.raises(DataError, match=r"(?s)2 row\(s\).*row 1: 'tools' is dict, not a list of function schemas"
                                        r"\n  row 2: 'tools' is not JSON"):
        formats.check_rows(rows, formats.detect(["messages", "tools"]))


# ---- rendering and the loss: the calls and answers are learnt, the schemas and results not ----

def test_the_rendered_text_and_the_labelled_spans_are_exact(tok3):
    template = templates.resolve("llama3.1", tok3)
    example, status = instructions.tokenize_conversation(tok3, template, conversation(OPENAI), 512)
    assert status == "ok"
    assert tok3.decode(example["input_ids"]) == RENDERED + "<|end_of_text|>"
    assert learnt_texts(tok3, example) == LEARNT


@pytest.mark.parametrize(("build", "why"), [
    (results_in_answers, "the tool result's tokens would carry loss"),
    (calls_in_results, "the tool call's tokens would carry no loss (it is written outside the assistant's turn)"),
], ids=["results-in-answers", "calls-in-results"])
def test_a_template_whose_turns_mislabel_tools_is_refused_by_the_check(build, why, tok3, tmp_path):
    """Negative controls of the check itself: each template renders every part of the conversation and splits at
    its turns, so rendering alone passes it, but the labels training would give are wrong (shown first, tokenised
    as training does); the check labels its probe the same way and refuses the template naming the fault. The
    shipped llama3.1 passes it."""
    template = build(tmp_path)
    example, _ = instructions.tokenize_conversation(tok3, template, conversation(OPENAI), 512)
    text, learnt = tok3.decode(example["input_ids"]), learnt_texts(tok3, example)
    assert "18 C, sunny" in text and "Paris" in text and learnt != LEARNT
    if build is results_in_answers:
        assert learnt[1] == f"Result: 18 C, sunny\n{ANSWER}<|eot_id|><|end_of_text|>"  # the result would be learnt
    else:
        assert not any('"city"' in t for t in learnt)  # the call would not
    assert loss_mask.tool_labelling_fault(tok3, template) == why
    with pytest.raises(DataError, match=rf"cannot train tool calling \({re.escape(why)}\)\. Pass --chat-template"):
        loss_mask.check_tools(tok3, template, "rows.jsonl", 1)
    assert loss_mask.tool_labelling_fault(tok3, templates.resolve("llama3.1", tok3)) is None


def test_a_call_with_text_beside_it_learns_both_and_a_turn_of_only_a_call_is_an_answer(tok3):
    messages = [*MESSAGES[:2], {**MESSAGES[2], "content": "Let me look."}]  # the conversation ends on the call
    example, status = instructions.tokenize_conversation(tok3, templates.resolve("llama3.1", tok3),
                                                         formats.Conversation(messages, [WEATHER]), 512)
    assert status == "ok"
    assert learnt_texts(tok3, example) == [
        'Let me look.\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|><|end_of_text|>']


def test_without_tools_llama3_1_renders_as_llama3(tok3):
    """Plain conversations (system turns, several exchanges) render the same with either template."""
    rows = instructions.load_rows(str(instructions.SAMPLE_DIR / "chat.jsonl"))
    llama3, llama31 = templates.resolve("llama3", tok3), templates.resolve("llama3.1", tok3)
    for row in list(rows.rows)[:30]:
        messages = rows.format.to_messages(row)
        for cut in (len(messages), len(messages) - 1):
            assert (templates.render(tok3, llama31, messages[:cut], cut < len(messages))
                    == templates.render(tok3, llama3, messages[:cut], cut < len(messages)))


def test_the_shipped_sample_trains_on_calls_and_answers(tok3):
    rows = instructions.load_rows(str(instructions.SAMPLE_DIR / "tools.jsonl"))
    assert rows.format.name == "messages" and rows.tool_rows == 44 and len(rows) == 48
    examples, counts = instructions.tokenize_rows(rows, tok3, 512, "llama3.1")
    assert (counts.examples, counts.dropped_too_long, counts.truncated) == (48, 0, 0)
    for i, example in enumerate(examples):
        messages = rows.conversation(i).messages
        texts = [tok3.decode(s, skip_special_tokens=True) for s in learnt_spans(example)]
        calls = ["\n".join(json.dumps({"name": c["function"]["name"], "parameters": c["function"]["arguments"]})
                           for c in m["tool_calls"]) if m.get("tool_calls") else m["content"]
                 for m in messages if m["role"] == "assistant"]
        assert texts == calls  # exactly the calls and answers: no schema, header or tool result


# ---- a template that cannot render tools: one line, before anything starts ----

@pytest.mark.parametrize(("choice", "why"), [
    ("auto", r"its text leaves out the tool schemas and the tool call"),  # the tiny model's own: Llama 3's
    ("llama2", r"it raises TemplateError: Conversation roles must alternate user/assistant"),
    ("plain", r"it raises TemplateError: the plain template knows the roles system, user and assistant, not 'tool'"),
    ("custom", r"its text leaves out the tool schemas"),
])
def test_a_template_without_tools_is_refused_in_one_line_before_launch(choice, why, tiny_llama3, tmp_path):
    if choice == "custom":  # renders calls and results, but never the schemas
        choice = llama31_with(tmp_path, "no_schemas", {"{%- if tools %}": "{%- if false %}"}).name
    tools = str(instructions.SAMPLE_DIR / "tools.jsonl")
    with pytest.raises(DataError) as err:
        instructions.load_rows(tools, chat_template=choice, model=str(tiny_llama3))
    assert "\n" not in str(err.value)
    assert re.match(r"data '.*tools\.jsonl' has 44 row\(s\) with tools, but the chat template '.*' cannot train "
                    rf"tool calling \({why}.*\)\. Pass --chat-template llama3\.1", str(err.value)), str(err.value)
    assert instructions.load_rows(tools, chat_template="llama3.1", model=str(tiny_llama3)).template.name \
        == "llama3.1"  # the fix it names passes
    plain = str(instructions.SAMPLE_DIR / "chat.jsonl")
    instructions.load_rows(plain, chat_template=choice, model="/no/such/model")  # no tools: no tokenizer is read


def test_the_template_is_proven_once_and_again_only_when_another_renders(tok3, tiny_llama3, monkeypatch):
    """load_rows proves the template; tokenising with that template does not prove it again; tokenising with
    another template, or rows loaded without a template, does."""
    calls = []
    monkeypatch.setattr(instructions, "check_tools", lambda *a: calls.append(a[1].name))
    tools = str(instructions.SAMPLE_DIR / "tools.jsonl")
    rows = instructions.load_rows(tools, chat_template="llama3.1", model=str(tiny_llama3))
    instructions.tokenize_rows(rows, tok3, 512, "llama3.1", cache="none")
    assert calls == ["llama3.1"]
    instructions.tokenize_rows(rows, tok3, 512, "auto", cache="none")
    instructions.tokenize_rows(instructions.load_rows(tools), tok3, 512, "llama3.1", cache="none")
    assert calls == ["llama3.1", "tokenizer's own", "llama3.1"]


# ---- after training: the sample answers and make eval's held-out task read the rows with their tools ----

def test_a_held_out_row_ending_in_a_tool_result_is_a_sample_prompt(tok3, tmp_path):
    """heldout_rows keeps the schemas beside the messages; the sample prompt is the conversation up to the last
    answer, so it ends with the tool's result and the assistant's header; a row whose last answer is a call has
    the call, as the template writes it, for reference."""
    from types import SimpleNamespace

    import datasets

    from finetune_kit.training.samples import report, sample_prompts

    rows = instructions.InstructionRows(datasets.Dataset.from_list([OPENAI]), formats.detect(["messages", "tools"]),
                                        "mem", tool_rows=1)
    heldout = instructions.heldout_rows(rows, [0])
    assert heldout == [formats.Conversation(MESSAGES, [WEATHER], 0)]
    assert heldout[0].record() == {"example_id": 0, "messages": MESSAGES, "tools": [WEATHER]}  # heldout.jsonl's line
    assert formats.Conversation.from_record(heldout[0].record()) == heldout[0]  # as make eval reads it back
    heldout.append(formats.Conversation(MESSAGES[:3], [WEATHER], 1))  # ends on the call
    args = SimpleNamespace(samples=2, sample_prompts=None, max_seq_len=512)
    template = templates.resolve("llama3.1", tok3)
    result, call = sample_prompts(args, heldout, tok3, template)
    assert result.text == RENDERED[: RENDERED.index(ANSWER)] and result.reference == ANSWER
    assert call.text == RENDERED[: RENDERED.index('{"name": "get_weather", "parameters"')]
    assert call.reference == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    rows = report(tmp_path, [result], ["It is sunny."])
    assert rows[0]["prompt"] == "(result of get_weather) 18 C, sunny"  # samples.jsonl says what the prompt ends with


def test_make_evals_pair_is_the_context_to_the_tool_result_and_the_answer(tok3):
    from finetune_tools.harness.tasks import conversation_pair

    context, target = conversation_pair(tok3, templates.resolve("llama3.1", tok3),
                                        formats.Conversation(MESSAGES, [WEATHER]))
    assert context + target == RENDERED + "<|end_of_text|>"
    assert target == f"{ANSWER}<|eot_id|><|end_of_text|>"


def test_the_documented_rendering_is_the_recipes(tok3):
    """docs/tool-calling.md and the 8B README show OPENAI rendered by llama3.1 with the learnt tokens in [[ ]]: the
    text without the marks is the tokenised conversation, and the marked pieces are its learnt spans."""
    example, _ = instructions.tokenize_conversation(tok3, templates.resolve("llama3.1", tok3), conversation(OPENAI),
                                                    512)
    for page in ("docs/tool-calling.md", "recipes/llama3-8b-zero3/README.md"):
        doc = (REPO / page).read_text()
        block = doc.split("<!-- rendered: llama3.1 -->\n```text\n", 1)[1].split("\n```", 1)[0]
        assert block.replace("[[", "").replace("]]", "") == tok3.decode(example["input_ids"]), page
        assert re.findall(r"\[\[(.*?)\]\]", block, re.S) == learnt_texts(tok3, example), page
        assert f'"tools": [{json.dumps(WEATHER)[:60]}' in " ".join(doc.split()), page  # the row shown is this one


def test_a_parquet_file_of_tool_calls_as_hub_datasets_keep_them_reads_as_the_jsonl(tmp_path):
    """The sample as a hub dataset stores it: arguments and schemas as JSON text, the turns one struct type, so
    every turn has every key (tool_calls, tool_call_id, name) and the ones it lacks are null. It reads as the
    same conversations and schemas as the JSONL file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = instructions.SAMPLE_DIR / "tools.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    for row in rows:
        for turn in row["messages"]:
            for call in turn.get("tool_calls") or ():
                if not isinstance(call["function"]["arguments"], str):
                    call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        row["tools"] = row.get("tools") if isinstance(row.get("tools"), str | None) else json.dumps(row["tools"])
    table = pa.Table.from_pylist(rows)
    assert pa.types.is_struct(table.schema.field("messages").type.value_type)  # one type for every turn
    pq.write_table(table, tmp_path / "tools.parquet")
    want, got = instructions.load_rows(str(source)), instructions.load_rows(str(tmp_path / "tools.parquet"))
    assert got.tool_rows == want.tool_rows == 44
    assert [want.conversation(i) for i in range(len(want))] == [got.conversation(i) for i in range(len(got))]
