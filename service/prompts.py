"""A request's prompt made ready for the engine: a chat rendered with the model's template, a text
tokenized (refused from its length alone when that proves it too long), a structured output's
constraint compiled to refuse one that does not compile. Long work goes to the worker threads
(service/workers.py); every refusal is a ServiceError, or a RequestError naming the field."""

from __future__ import annotations

import functools

import grpc

from pie.engine.client.engine_client import EngineClient
from pie.engine.errors import RequestError
from pie.engine.limits import prompt_too_long
from pie.engine.sampling_params import StructuredOutputParams
from pie.model.chat_template import ChatTemplateError, ChatTemplates, NoChatTemplate
from pie.model.tokenizer import TooManyTokens

from .errors import ServiceError
from .validation import ChatPrompt
from .workers import Workers

# Texts up to this many characters are tokenized on the event loop (~1 ms at most); longer ones on
# a worker thread, with the GIL released (model.Tokenizer.encode), so the loop keeps serving.
INLINE_TOKENIZE_CHARS = 2048
# Conversations with more characters than this are rendered with their chat template on a worker
# thread (a template loops over every message in Python: ~1 ms per few KB).
INLINE_RENDER_CHARS = 8192


async def encode(workers: Workers, client: EngineClient, text: str, add_special_tokens: bool = True,
                 max_tokens: int | None = None) -> list[int]:
    """`text`'s token ids (a TooManyTokens past `max_tokens`)."""
    encode = functools.partial(client.tokenizer.encode, text, add_special_tokens, max_tokens=max_tokens)
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return encode()
    return await workers.encode(encode, len(text))


async def render(workers: Workers, templates: ChatTemplates | None, problem: str, chat: ChatPrompt,
                 field: str = "chat") -> str:
    """The conversation rendered with the model's chat template (on a worker thread when long);
    without templates, `problem` says why chats cannot be served."""
    if templates is None:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"{field}: {problem}", reason="NO_CHAT_TEMPLATE")
    render = functools.partial(templates.render, chat.messages, tools=chat.tools,
                               add_generation_prompt=chat.add_generation_prompt,
                               continue_final_message=chat.continue_final_message, extra=chat.extra)
    try:
        return render() if chat.chars <= INLINE_RENDER_CHARS else await workers.run(render)
    except ChatTemplateError as e:
        raise RequestError(f"{field}.messages", f"the model's chat template refused the conversation: {e}") \
            from None
    except NoChatTemplate as e:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"{field}: {e}", reason="NO_CHAT_TEMPLATE") from None
    except ValueError as e:  # a conversation no template can render (continue_final_message without text)
        raise RequestError(field, str(e)) from None


async def prompt_ids(workers: Workers, client: EngineClient, text: str, field: str, *,
                     add_special_tokens: bool) -> list[int]:
    """A prompt's token ids: refused when it tokenizes to nothing or leaves no room for one token."""
    max_len = client.info.max_model_len
    try:  # a prompt must leave room for one token: longer ones are refused uncounted
        ids = await encode(workers, client, text, add_special_tokens, max_tokens=max_len - 1)
    except TooManyTokens as e:
        too_long = prompt_too_long(e.count, max_len, at_least=e.at_least)
        raise RequestError(field, too_long.message, too_long.reason) from None
    if not ids:
        raise RequestError(field, "tokenizes to no tokens")
    return ids


async def check_structured(workers: Workers, client: EngineClient, params: StructuredOutputParams) -> None:
    """Refuses a constraint that does not compile, with the compiler's message (compiled off the
    event loop the first time, answered from the cache after): a RequestError naming the engine's
    field (`structured.regex`)."""
    if client.structured_known(params):
        client.check_structured(params)
    else:
        await workers.run(client.check_structured, params)
