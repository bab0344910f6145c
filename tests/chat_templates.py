"""Chat templates in the styles real checkpoints ship, and tiny model folders that carry them.

Each style is a template written here in the manner of a family's tokenizer_config.json (Llama 3's
header blocks with a dated system prompt, Qwen2.5's ChatML with tools, Mistral's [INST] turns that
refuse roles out of order, a Llama 3.1-style tool-calling template with `ipython` results and
named templates), the special tokens its markers need (trained into the test tokenizer as
ids 3, 4, ...), its BOS/EOS as tokenizer_config.json names them and its end-of-turn ids
(generation_config.json's eos list). Between them they use what transformers' renderer offers:
raise_exception, strftime_now, tojson with indent and separators, namespace, loop controls,
`{% generation %}`, bos_token/eos_token, `tools` and `add_generation_prompt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import BOS_ID, EOS_ID, make_hf_model_dir, write_tokenizer

LLAMA3 = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CHATML = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Written with block tags on lines of their own, indented (as older templates are): what
# trim_blocks and lstrip_blocks remove decides the text.
MISTRAL = r"""{{- bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {% generation %}
        {{- ' ' + message['content'] + eos_token }}
        {% endgeneration %}
    {% else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {% endif %}
{% endfor %}
"""

# Llama 3.1-style tool calling: tools in the first user message (tojson with indent), assistant
# tool calls as JSON (tojson with separators), results under the `ipython` role; a namespace and a
# loop break find the last user message. The plain chat is a second, named template.
TOOLS_DEFAULT = LLAMA3
TOOLS_TOOL_USE = r"""{{- bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{{- "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n" }}
{{- "Today Date: " + strftime_now("%Y-%m-%d") + "\n" }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
        {%- if loop.index0 == ns.last_user and tools %}
            {{- "Given the following functions, respond with a JSON function call.\n\n" }}
            {%- for tool in tools %}
                {{- tool | tojson(indent=4) }}
                {{- "\n\n" }}
            {%- endfor %}
        {%- endif %}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls is defined %}
        {%- for tool_call in message.tool_calls %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>' }}
            {{- {"name": tool_call.function.name, "parameters": tool_call.function.arguments} | tojson(separators=(",", ":"), sort_keys=true) }}
            {{- "<|eom_id|>" }}
            {%- break %}
        {%- endfor %}
    {%- elif message.role in ('tool', 'ipython') %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.tool_call_id is defined %}{{- "[" + message.tool_call_id + "] " }}{%- endif %}
        {{- message.content | tojson + "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

_LLAMA3_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>")


@dataclass(frozen=True)
class ChatStyle:
    template: str | dict[str, str]  # one template, or named ones ("default", "tool_use")
    special_tokens: tuple[str, ...]  # beyond <pad>, <s>, </s>: ids 3, 4, ... in order
    bos_token: str
    eos_token: str
    end_of_turn: tuple[str, ...]  # generation_config.json's eos list, by token text
    config_extra: dict[str, Any] = field(default_factory=dict)

    def token_id(self, token: str) -> int:
        base = {"<pad>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
        return base[token] if token in base else 3 + self.special_tokens.index(token)

    @property
    def end_of_turn_ids(self) -> list[int]:
        return [self.token_id(t) for t in self.end_of_turn]

    def tokenizer_config(self) -> dict[str, Any]:
        template: Any = self.template
        if isinstance(template, dict):  # the list form of named templates
            template = [{"name": name, "template": text} for name, text in template.items()]
        return {"bos_token": self.bos_token, "eos_token": {"__type": "AddedToken", "content": self.eos_token, "special": True},
                "chat_template": template, **self.config_extra}


STYLES: dict[str, ChatStyle] = {
    "llama3": ChatStyle(LLAMA3, _LLAMA3_TOKENS, "<|begin_of_text|>", "<|eot_id|>",
                        ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "chatml": ChatStyle(CHATML, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<s>", "<|im_end|>",
                        ("<|im_end|>", "<|endoftext|>"), {"bos_token": None}),
    "mistral": ChatStyle(MISTRAL, (), "<s>", "</s>", ("</s>",)),
    "tools": ChatStyle({"default": TOOLS_DEFAULT, "tool_use": TOOLS_TOOL_USE}, _LLAMA3_TOKENS, "<|begin_of_text|>",
                       "<|eot_id|>", ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
}


def write_chat_tokenizer(path: Path, style: str) -> Path:
    """A tokenizer folder (tokenizer.json, tokenizer_config.json with the style's template)."""
    s = STYLES[style]
    return write_tokenizer(path, extra_special_tokens=s.special_tokens, tokenizer_config=s.tokenizer_config())


def make_chat_model_dir(tmp_path: Path, style: str, arch: str = "llama", **kw: Any) -> Path:
    """A tiny random model folder whose tokenizer and template are the style's, and whose
    generation_config.json lists its end-of-turn ids."""
    s = STYLES[style]
    return make_hf_model_dir(tmp_path, arch, generation_eos=s.end_of_turn_ids, extra_special_tokens=s.special_tokens,
                             tokenizer_config=s.tokenizer_config(), **kw)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now: <b>°C</b> & ° \"F\", à Paris, 東京.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]},
    },
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one turn": [{"role": "user", "content": "Hello there, who are you?"}],
    "system and turns": [
        {"role": "system", "content": "  Answer briefly.  "},
        {"role": "user", "content": "The cat sleeps under the tree."},
        {"role": "assistant", "content": "Yes, and the dog reads."},
        {"role": "user", "content": "Café? 日本 😀 and \"quotes\" <b>tags</b>"},
    ],
    "tool round trip": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "id": "call_1", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ],
}
