"""model/chat_template.py against transformers' apply_chat_template, the oracle: the same text and
the same token ids for Llama 3-, ChatML (Qwen2.5)-, Mistral- and tool-calling-style templates
(tests/chat_templates.py), with and without a generation prompt, with tools, with a continued final
message; the same refusals where the template raises; where templates come from in a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pie.model.chat_template import ChatTemplateError, ChatTemplates, NoChatTemplate
from pie.model.tokenizer import Tokenizer
from tests.chat_templates import CONVERSATIONS, STYLES, WEATHER_TOOL, write_chat_tokenizer
from tests.helpers import write_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return {style: write_chat_tokenizer(tmp_path_factory.mktemp(style), style) for style in STYLES}


@pytest.fixture(scope="module")
def oracle(folders):
    """transformers' tokenizer of each folder."""
    from transformers import AutoTokenizer

    return {style: AutoTokenizer.from_pretrained(str(path)) for style, path in folders.items()}


def render_both(folder: Path, hf, messages, *, tools=None, add_generation_prompt=True, continue_final_message=False):
    """(ours, transformers') as (text, ids), or the exception each raised."""
    def ours():
        text = ChatTemplates.load(folder).render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message)
        return text, Tokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)

    def theirs():
        kw = dict(tools=tools, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message)
        text = hf.apply_chat_template(messages, tokenize=False, **kw)
        return text, list(hf.apply_chat_template(messages, tokenize=True, **kw)["input_ids"])

    results = []
    for fn in (ours, theirs):
        try:
            results.append(fn())
        except Exception as e:  # compared by the test
            results.append(e)
    return results


CASES = [(style, conv, gen, tools) for style in STYLES for conv in CONVERSATIONS for gen in (True, False)
         for tools in ((None, [WEATHER_TOOL]) if style in ("chatml", "tools") else (None,))]


@pytest.mark.parametrize("style, conversation, add_generation_prompt, tools", CASES,
                         ids=[f"{s}-{c.replace(' ', '_')}-gen{int(g)}-tools{int(t is not None)}" for s, c, g, t in CASES])
def test_rendering_equals_transformers(folders, oracle, style, conversation, add_generation_prompt, tools):
    ours, theirs = render_both(folders[style], oracle[style], CONVERSATIONS[conversation], tools=tools,
                               add_generation_prompt=add_generation_prompt)
    if isinstance(theirs, Exception):
        # transformers raises where the template does: so must we (with the template's message)
        assert isinstance(ours, (ChatTemplateError, ValueError)), (ours, theirs)
        assert str(ours).split(": ")[-1] in str(theirs) or type(theirs).__name__ in str(ours), (ours, theirs)
        return
    assert not isinstance(ours, Exception), ours
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]
    # The template's special tokens are single ids, written once (BOS not added twice).
    s = STYLES[style]
    ids = ours[1]
    if s.bos_token in ours[0]:
        assert ids.count(s.token_id(s.bos_token)) == 1 and ids[0] == s.token_id(s.bos_token)


def test_the_cases_cover_every_style_with_a_rendering_and_a_refusal(folders, oracle):
    """The parametrized cases are not all refusals: each style renders most conversations, and the
    Mistral template refuses a system message with its own words."""
    rendered = {style: 0 for style in STYLES}
    for style, conversation, gen, tools in CASES:
        ours, _ = render_both(folders[style], oracle[style], CONVERSATIONS[conversation], tools=tools,
                              add_generation_prompt=gen)
        rendered[style] += not isinstance(ours, Exception)
    assert all(n >= 2 for n in rendered.values()), rendered
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ChatTemplates.load(folders["mistral"]).render(CONVERSATIONS["system and turns"])
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles are supported"):
        ChatTemplates.load(folders["mistral"]).render([{"role": "user", "content": "a"},
                                                       {"role": "robot", "content": "b"}])


@pytest.mark.parametrize("style", ["llama3", "chatml", "mistral"])
def test_continue_final_message_equals_transformers(folders, oracle, style):
    messages = [{"role": "user", "content": "Tell me a story."},
                {"role": "assistant", "content": "Once upon a time, the cat"}]
    ours, theirs = render_both(folders[style], oracle[style], messages, add_generation_prompt=False,
                               continue_final_message=True)
    assert not isinstance(theirs, Exception) and ours == theirs
    assert ours[0].endswith("the cat")


def test_tool_templates_are_chosen_by_the_presence_of_tools(folders):
    templates = ChatTemplates.load(folders["tools"])
    plain = templates.render(CONVERSATIONS["one turn"])
    with_tools = templates.render(CONVERSATIONS["one turn"], tools=[WEATHER_TOOL])
    assert "Environment: ipython" not in plain and "Environment: ipython" in with_tools
    assert json.dumps(WEATHER_TOOL, indent=4, ensure_ascii=False) in with_tools


REASONING_READER = ("{% for m in messages %}{{ m.role }}[{{ m.thinking }}|{{ m.reasoning_content }}]"
                    "{{ m.content }};{% endfor %}")


@pytest.mark.parametrize("key", ["reasoning_content", "thinking", "reasoning"])
def test_a_messages_reasoning_reaches_the_template_under_both_names(tmp_path, key):
    """transformers hands a message's reasoning, under whichever of its names the caller used, to
    the template as reasoning_content and thinking (Qwen3-style templates read the one, gpt-oss-style
    the other); ours the same, a set `thinking` kept."""
    from transformers import AutoTokenizer

    folder = write_tokenizer(tmp_path, tokenizer_config={"chat_template": REASONING_READER})
    hf = AutoTokenizer.from_pretrained(str(folder))
    renders = []
    for messages in ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: "because"}],
                     [{"role": "assistant", "content": "a", key: "r1", "thinking": "own"}],
                     [{"role": "assistant", "content": "a", key: None}]):
        ours, theirs = render_both(folder, hf, messages, add_generation_prompt=False)
        assert not isinstance(ours, Exception) and ours == theirs, (ours, theirs)
        renders.append(ours[0])
    assert renders[0] == "user[|]q;assistant[because|because]a;"


def test_an_empty_tool_list_is_tools_as_in_transformers(folders, oracle, tmp_path):
    """tools=[] is handed over as an empty list and picks the "tool_use" template (transformers
    tells tools apart by `is not None`); no tools at all is None."""
    from transformers import AutoTokenizer

    folder = write_tokenizer(tmp_path, tokenizer_config={
        "chat_template": "{{ tools is none }}|{{ tools | length if tools is not none }}|{{ messages[0].content }}"})
    hf = AutoTokenizer.from_pretrained(str(folder))
    for tools in (None, []):
        ours, theirs = render_both(folder, hf, CONVERSATIONS["one turn"], tools=tools)
        assert not isinstance(ours, Exception) and ours == theirs, (tools, ours, theirs)
    ours, theirs = render_both(folders["tools"], oracle["tools"], CONVERSATIONS["one turn"], tools=[])
    assert not isinstance(ours, Exception) and ours == theirs
    assert "Environment: ipython" in ours[0]  # the tool_use template


def test_extra_variables_reach_the_template_and_may_replace_special_tokens(tmp_path):
    folder = write_tokenizer(tmp_path, tokenizer_config={
        "chat_template": "{{ bos_token }}{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"})
    templates = ChatTemplates.load(folder)
    assert templates.render([{"role": "user", "content": "x"}]) == "<s>x"
    assert templates.render([{"role": "user", "content": "x"}], extra={"enable_thinking": True}) == "<s><think>x"
    assert templates.render([{"role": "user", "content": "x"}], extra={"bos_token": "B"}) == "Bx"


def test_the_sandbox_holds(tmp_path):
    """A template from a model folder is untrusted: no attribute walk to Python's internals."""
    folder = write_tokenizer(tmp_path, tokenizer_config={
        "chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(ChatTemplateError):
        ChatTemplates.load(folder).render([{"role": "user", "content": "x"}])
    folder = write_tokenizer(tmp_path / "ns", tokenizer_config={
        "chat_template": "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}"})
    with pytest.raises(ChatTemplateError, match="_x"):
        ChatTemplates.load(folder).render([{"role": "user", "content": "x"}])


def test_where_templates_come_from(tmp_path):
    config_only = write_tokenizer(tmp_path / "config", tokenizer_config={"chat_template": "config:{{ messages[0].content }}"})
    assert ChatTemplates.load(config_only).render([{"role": "user", "content": "x"}]) == "config:x"
    # chat_template.jinja wins over tokenizer_config.json (as transformers reads a folder)
    (config_only / "chat_template.jinja").write_text("jinja:{{ messages[0].content }}")
    assert ChatTemplates.load(config_only).render([{"role": "user", "content": "x"}]) == "jinja:x"
    named = config_only / "chat_templates"
    named.mkdir()
    (named / "tool_use.jinja").write_text("tools:{{ tools | length }}")
    templates = ChatTemplates.load(config_only)
    assert templates.render([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL]) == "tools:1"
    # --chat-template FILE replaces them all
    override = tmp_path / "override.jinja"
    override.write_text("override:{{ messages | length }}")
    assert ChatTemplates.load(config_only, override).render([{"role": "user", "content": "x"}]) == "override:1"


def test_no_template_and_a_template_that_does_not_compile(tmp_path):
    bare = write_tokenizer(tmp_path / "bare")
    with pytest.raises(NoChatTemplate, match="no chat template"):
        ChatTemplates.load(bare)
    broken = write_tokenizer(tmp_path / "broken", tokenizer_config={"chat_template": "{% for m in messages %}{{ m"})
    with pytest.raises(NoChatTemplate, match="does not compile"):
        ChatTemplates.load(broken)
    named = write_tokenizer(tmp_path / "named", tokenizer_config={"chat_template": [
        {"name": "rag", "template": "a"}, {"name": "tool_use", "template": "b"}]})
    with pytest.raises(NoChatTemplate, match="none named 'default'"):
        ChatTemplates.load(named).render([{"role": "user", "content": "x"}])


def test_conversations_that_cannot_be_rendered(folders):
    templates = ChatTemplates.load(folders["chatml"])
    with pytest.raises(ValueError, match="at least one message"):
        templates.render([])
    with pytest.raises(ValueError, match="exclude each other"):
        templates.render(CONVERSATIONS["one turn"], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="may not replace messages"):
        templates.render(CONVERSATIONS["one turn"], extra={"messages": []})
    with pytest.raises(ValueError, match="text content"):
        templates.render([{"role": "assistant"}], add_generation_prompt=False, continue_final_message=True)
