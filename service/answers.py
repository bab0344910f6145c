"""The engine's outputs as the caller's messages: a stream's message per choice and hand-off, the
unary answer with its choices, and the logprobs of both (the answer's tokens, the prompt's).
Building many logprob entries is Python work in one piece: large ones go to a worker thread."""

from __future__ import annotations

from pie.engine.messages import RequestOutput, RequestStatus, SampledToken
from pie.engine.sampling_params import SamplingParams
from pie.model.tokenizer import Tokenizer
from pie.v1 import generate_pb2 as pb

from .generation import Handoff
from .logging import RequestSummary
from .workers import Workers

# A unary answer with more logprob entries than this is assembled on a worker thread: building
# the messages is Python work the loop would otherwise do in one piece (4,096 entries take ~3 ms
# on this 2-core machine; 16 samples x 2,048 tokens x 21 entries would take ~0.5 s).
INLINE_LOGPROB_ENTRIES = 4096

_FINISH = {
    RequestStatus.FINISHED_STOPPED: pb.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: pb.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: pb.FINISH_REASON_ABORT,
}


async def stream_messages(handoff: Handoff, s: RequestSummary, workers: Workers) -> list[pb.GenerateStreamResponse]:
    """GenerateStream's messages for one hand-off: one per choice present in it (one when n == 1)
    with its new text, tokens and logprobs; the prompt's logprobs on the message with choice 0's
    first token; a choice's finish and stop reasons on its last message, the usage on the request's
    last."""
    a = handoff.admitted
    tokenizer = a.client.tokenizer
    messages = []
    groups = sorted(_by_index(handoff.outputs).items())
    for j, (index, outs) in enumerate(groups):
        last = outs[-1]
        msg = pb.GenerateStreamResponse(
            request_id=a.request_id, index=index, text="".join(o.new_text for o in outs),
            token_ids=[t for o in outs for t in o.new_token_ids],
            logprobs=_token_logprobs(outs, tokenizer) if a.sampling.logprobs else [])
        if a.sampling.prompt_logprobs is not None:  # on the message with choice 0's first token
            entries = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
            if entries is not None:
                msg.prompt_logprobs.extend(await _prompt_logprob_messages(workers, a.prompt, entries, a.sampling,
                                                                          tokenizer))
        if last.finished:
            msg.finish_reason = _FINISH.get(last.status, pb.FINISH_REASON_UNSPECIFIED)
            msg.stop_reason = "" if last.stop_reason is None else str(last.stop_reason)
        if handoff.last and j == len(groups) - 1:
            n_generated = s.generated_tokens
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(a.prompt), completion_tokens=n_generated,
                                        total_tokens=len(a.prompt) + n_generated,
                                        cached_prompt_tokens=handoff.cached_tokens))
        messages.append(msg)
    return messages


async def unary_response(last: Handoff, outputs: list[RequestOutput], workers: Workers) -> pb.GenerateResponse:
    """Generate's answer from every output of the request (`last` is the hand-off that finished
    it): choice 0 at the top level, every choice in `choices` when n > 1, the usage, the prompt's
    logprobs."""
    a = last.admitted
    sampling = a.sampling
    groups = sorted(_by_index(outputs).items())
    tokenizer = a.client.tokenizer if sampling.logprobs else None
    if sampling.logprobs and len(outputs) * (1 + sampling.logprobs) > INLINE_LOGPROB_ENTRIES:
        choices = await workers.run(_choices, groups, tokenizer)
    else:
        choices = _choices(groups, tokenizer)
    first = choices[0]
    completion = sum(len(c.token_ids) for c in choices)
    entries = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    prompt_logprobs = [] if entries is None else await _prompt_logprob_messages(
        workers, a.prompt, entries, sampling, a.client.tokenizer)
    return pb.GenerateResponse(
        request_id=a.request_id, text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
        stop_reason=first.stop_reason, logprobs=first.logprobs,
        usage=pb.Usage(prompt_tokens=len(a.prompt), completion_tokens=completion,
                       total_tokens=len(a.prompt) + completion, cached_prompt_tokens=last.cached_tokens),
        choices=choices if sampling.n > 1 else [], prompt_logprobs=prompt_logprobs,
    )


def _by_index(outputs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    """Outputs grouped by choice index (n > 1), each group in arrival order."""
    groups: dict[int, list[RequestOutput]] = {}
    for o in outputs:
        groups.setdefault(o.index, []).append(o)
    return groups


def _choices(groups: list[tuple[int, list[RequestOutput]]], tokenizer: Tokenizer | None) -> list[pb.Choice]:
    """The answer's choices; with a tokenizer, their logprobs too."""
    return [_choice(i, outs, tokenizer) for i, outs in groups]


def _choice(index: int, outputs: list[RequestOutput], tokenizer: Tokenizer | None) -> pb.Choice:
    """One sample's whole answer from its outputs (in order; the last one finished it)."""
    last = outputs[-1]
    return pb.Choice(
        index=index, text="".join(o.new_text for o in outputs),
        token_ids=[t for o in outputs for t in o.new_token_ids],
        finish_reason=_FINISH.get(last.status, pb.FINISH_REASON_UNSPECIFIED),
        stop_reason="" if last.stop_reason is None else str(last.stop_reason),
        logprobs=_token_logprobs(outputs, tokenizer) if tokenizer is not None else [])


def _token_logprobs(outputs: list[RequestOutput], tokenizer: Tokenizer) -> list[pb.TokenLogprob]:
    text = tokenizer.token_text
    return [pb.TokenLogprob(token_id=s.token_id, logprob=s.logprob, token=text(s.token_id),
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp, token=text(t)) for t, lp in s.top])
            for o in outputs for s in o.new_logprobs]


def _prompt_logprobs(prompt: list[int], entries: list[SampledToken], tokenizer: Tokenizer) -> list[pb.PromptLogprob]:
    """One entry per prompt token: the first with no logprob, then each one's given those before."""
    text = tokenizer.token_text
    first = pb.PromptLogprob(token_id=prompt[0], token=text(prompt[0]))
    return [first] + [pb.PromptLogprob(token_id=e.token_id, logprob=e.logprob, token=text(e.token_id),
                                       top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp, token=text(t))
                                                     for t, lp in e.top])
                      for e in entries]


async def _prompt_logprob_messages(workers: Workers, prompt: list[int], entries: list[SampledToken],
                                   sampling: SamplingParams, tokenizer: Tokenizer) -> list[pb.PromptLogprob]:
    """`_prompt_logprobs`, on a worker thread when there are many (a long prompt's take as long to
    build as the answer's logprobs do)."""
    if len(entries) * (1 + (sampling.prompt_logprobs or 0)) > INLINE_LOGPROB_ENTRIES:
        return await workers.run(_prompt_logprobs, prompt, entries, tokenizer)
    return _prompt_logprobs(prompt, entries, tokenizer)
