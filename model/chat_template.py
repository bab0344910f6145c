"""A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it.

Where the template comes from, first found (as transformers' tokenizer loading reads them):
`chat_template.jinja` (the default template) with named ones in `chat_templates/NAME.jinja`; else
tokenizer_config.json's `chat_template`, a string or a list of {"name", "template"}; else a
processor's `chat_template.json`. `pie serve --chat-template FILE` replaces them all.

Several named templates: "tool_use" when the request brings tools (an empty list counts, as in
transformers) and the model has one, else "default" (a model with named templates and no default
has no usable template).

Rendering: a sandboxed jinja2 environment (ImmutableSandboxedEnvironment: a template from a model
folder is untrusted code) with trim_blocks, lstrip_blocks and the loop-controls extension; the
filter `tojson` (json.dumps: no HTML escaping, non-ASCII kept, `indent`, `separators`,
`sort_keys`), the globals `raise_exception(message)`, `strftime_now(format)`, a `dict` limited to
calls and `fromkeys`, and a `namespace` that refuses underscore attributes; the variables
`messages` (keys whose value is None left out; a message's reasoning, under any of
transformers' names, as both `reasoning_content` and `thinking`), `tools` (None without tools),
`documents` (None), `add_generation_prompt`, the
special tokens as tokenizer_config.json names them (`bos_token`, `eos_token`, `unk_token`,
`pad_token`, ... as strings; special_tokens_map.json fills in those it lacks) and the caller's
extra variables. `{% generation %}` blocks (transformers' assistant-mask extension) render their
body. `continue_final_message`: the last message's content gets a marker, the rendering is cut
where the marker is, so what the template writes after the message (its end-of-turn) is dropped.

The rendered text is the whole prompt, special tokens written by the template included: the
caller tokenizes it without adding special tokens (`Tokenizer.encode(text, False)`), so a template
that writes `{{ bos_token }}` yields one BOS, not two.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# The special tokens a template sees by name (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What a template leaves after the continued message: found and cut (transformers' marker, so
# that templates which strip or inspect the content see the same text).
_CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "
# Variables the renderer sets itself: a caller's extra variables may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed while rendering it;
    the message is the template's own."""


class NoChatTemplate(LookupError):
    """There is no usable template: none in the folder, or it does not compile."""


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_templates(folder: Path) -> dict[str, str]:
    """The folder's chat templates by name ("default" for the only or the default one); empty
    when it has none. OSError / ValueError when a file that is there cannot be read."""
    templates: dict[str, str] = {}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        templates["default"] = jinja.read_text(encoding="utf-8")
    named = folder / "chat_templates"
    if named.is_dir():
        for file in sorted(named.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    value = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    value = _read_json(folder / "chat_template.json").get("chat_template")
    return {"default": value} if isinstance(value, str) else {}


def read_special_tokens(folder: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as the folder's tokenizer_config.json names them (strings), with
    special_tokens_map.json filling in the ones it lacks."""
    config = _read_json(folder / "tokenizer_config.json")
    legacy = _read_json(folder / "special_tokens_map.json")
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is None:
            text = _token_text(legacy.get(name))
        if text is not None:
            tokens[name] = text
    return tokens


# ---- the environment ------------------------------------------------------------------------------

class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (transformers marks what it
    spans for training masks; rendering a prompt needs only the text)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names, by precedence


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under both names templates read, as transformers hands it over: the
    first of reasoning_content / thinking / reasoning that is set, as `reasoning_content` and, unless
    the message sets it, as `thinking` (gpt-oss-style templates read that one)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without the type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attributes (a way to CPython's internals)."""

    def __init__(*args, **kwargs):  # jinja2's signature trick: `namespace(self=...)` keeps working
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} on a namespace")


def environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


# ---- the templates of one model ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChatTemplates:
    """The compiled chat templates of one model and the special tokens they are rendered with."""

    templates: dict[str, jinja2.Template]  # by name; "default" the one used without tools
    sources: dict[str, str]  # their text, by name (a template names what it reads, e.g. "content")
    special_tokens: dict[str, str]  # bos_token, eos_token, ...
    origin: str  # where they were read (a file, or tokenizer_config.json), for messages

    @classmethod
    def load(cls, folder: str | Path, override: str | Path | None = None) -> ChatTemplates:
        """The templates of a model folder, or `override` (a template file) instead. Raises
        NoChatTemplate when there is none or one does not compile (its message says which and
        why), OSError / ValueError when a file cannot be read."""
        folder = Path(folder)
        if override is not None:
            sources, origin = {"default": Path(override).read_text(encoding="utf-8")}, str(override)
        else:
            sources, origin = read_templates(folder), f"the chat template of {folder}"
        if not sources:
            raise NoChatTemplate(f"{folder} has no chat template (no chat_template in tokenizer_config.json, no "
                                 "chat_template.jinja): a base model, or start pie serve with --chat-template FILE")
        env = environment()
        compiled = {}
        for name, text in sources.items():
            try:
                compiled[name] = env.from_string(text)
            except jinja2.TemplateSyntaxError as e:
                label = origin if len(sources) == 1 else f"{origin} ({name!r})"
                raise NoChatTemplate(f"{label} does not compile: {e.message} (line {e.lineno})") from e
        return cls(compiled, sources, read_special_tokens(folder), origin)

    def _select(self, has_tools: bool) -> str:
        if has_tools and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        if len(self.templates) == 1:
            return next(iter(self.templates))
        raise NoChatTemplate(f"{self.origin} has several templates ({', '.join(sorted(self.templates))}) and none "
                             "named 'default'; start pie serve with --chat-template FILE")

    def render(self, messages: list[dict[str, Any]], *, tools: list[Any] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text of a conversation. `messages`: dicts of plain JSON values with at least
        "role" (keys whose value is None are left out, as transformers does). Raises
        ChatTemplateError with the template's message, NoChatTemplate (several templates and no
        default), ValueError for a conversation that cannot be rendered at all."""
        if not messages:
            raise ValueError("a conversation needs at least one message")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        reserved = sorted(RESERVED_VARIABLES & set(extra or ()))
        if reserved:
            raise ValueError(f"extra variables may not replace {', '.join(reserved)}")
        name = self._select(tools is not None)  # an empty list too, as transformers does
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ValueError("continue_final_message needs a last message with text content")
            if "content" not in self.sources[name]:
                raise ValueError("continue_final_message: the chat template does not read a message's content")
            chat[-1] = {**chat[-1], "content": final + _CONTINUE_MARKER}
        # The special tokens first: the caller's variables may replace them (as transformers lets them).
        variables = {**self.special_tokens, **(extra or {})}
        try:
            text = self.templates[name].render(messages=chat, tools=tools, documents=None,
                                               add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception, an undefined value, a sandbox refusal
            raise ChatTemplateError(e.message or type(e).__name__) from None
        except Exception as e:  # the template did something its inputs do not support (a TypeError, ...)
            raise ChatTemplateError(f"{type(e).__name__}: {e}") from None
        if final is not None:
            marker = _CONTINUE_MARKER.strip()
            if final.strip() not in text or marker not in text:
                raise ChatTemplateError("continue_final_message: the chat template does not write the last message "
                                        "as it is, so it cannot be continued")
            at = text.rindex(marker)
            # A template that trims the content loses the marker's space: cut before trailing spaces too.
            text = text[:at] if text[at:at + len(_CONTINUE_MARKER)] == _CONTINUE_MARKER else text[:at].rstrip()
        return text
