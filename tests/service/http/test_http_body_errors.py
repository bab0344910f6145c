"""A request body the HTTP door cannot read is refused in pie's words: the OpenAI parameter named
as a caller wrote it (`messages[0].content`), a field of several forms named once with its forms,
and a body that is not JSON, or not an object, said to be so. pydantic's errors come in as FastAPI
hands them over (each location under "body")."""

from __future__ import annotations

import pydantic
import pytest

from pie.service.http.errors import body_problem
from pie.service.http.requests import ChatRequest, CompletionRequest


def _problem(model: type[pydantic.BaseModel], body: object) -> tuple[str | None, str]:
    with pytest.raises(pydantic.ValidationError) as refused:
        model.model_validate(body)
    return body_problem([{**e, "loc": ("body", *e["loc"])} for e in refused.value.errors()])


@pytest.mark.parametrize("model,body,param,message", [
    (CompletionRequest, {"prompt": [1.5, 2]}, "prompt",
     "prompt: matches none of its forms (str, list[int], list[str], list[list[int]])"),
    (CompletionRequest, {"prompt": 5}, "prompt",
     "prompt: matches none of its forms (str, list[int], list[str], list[list[int]])"),
    (CompletionRequest, {}, "prompt", "prompt: is required"),
    (CompletionRequest, {"prompt": "x", "max_tokens": "many"}, "max_tokens",
     "max_tokens: must be a valid integer, unable to parse string as an integer"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"7": "up"}}, "logit_bias.7",
     "logit_bias.7: must be a valid number, unable to parse string as a number"),
    (ChatRequest, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content: matches none of its forms (str, list[dict[str,any]])"),
    (ChatRequest, {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "messages[1].role",
     "messages[1].role: is required"),
    (ChatRequest, {"messages": "hi"}, "messages", "messages: must be a valid list"),
    (ChatRequest, {"messages": [], "tool_choice": 5}, "tool_choice",
     "tool_choice: matches none of its forms (str, dict[str,any])"),
])
def test_a_field_is_named_as_the_caller_wrote_it(model, body, param, message) -> None:
    assert _problem(model, body) == (param, message)


def test_a_body_that_is_not_json_or_not_an_object() -> None:
    # FastAPI's errors for `{not json`, an empty body and `[1, 2]`
    not_json = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                 "ctx": {"error": "Expecting property name enclosed in double quotes"}}]
    assert body_problem(not_json) == (
        None, "the body is not valid JSON (Expecting property name enclosed in double quotes at character 1)")
    for error in ({"type": "missing", "loc": ("body",), "msg": "Field required"},
                  {"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}):
        assert body_problem([error]) == (None, "the body must be a JSON object (the request's fields)")
    assert body_problem([]) == (None, "the body is not a valid request")
