"""The one check of a request against an engine's limits, made where requests enter the engine:
`EngineClient.submit` (the service's path, before the request is queued for the core, wherever
the core runs) and `EngineCore.generate` (offline use). The core's loop trusts what its client
sends. Field-level checks of sampling parameters are `SamplingParams.validate`'s."""

from __future__ import annotations

from .config import EngineConfig
from .errors import RequestError
from .sampling_params import MAX_PROMPT_LOGPROB_ENTRIES, SamplingParams


def prompt_too_long(num_tokens: int, max_model_len: int, *, at_least: bool = False) -> RequestError:
    """`at_least`: `num_tokens` is a lower bound (the text was refused before it was tokenized)."""
    return RequestError("prompt", f"prompt has {'at least ' if at_least else ''}{num_tokens} tokens; the context "
                                 f"length is {max_model_len} and at least one token must be generated", "PROMPT_TOO_LONG")


def check_request(prompt_token_ids: list[int], sampling: SamplingParams, *, config: EngineConfig,
                  vocab_size: int, max_model_len: int, num_kv_blocks: int) -> None:
    """Raises RequestError for a request that could never be served by an
    engine of this configuration (also used where the engine runs in another process)."""
    if not prompt_token_ids:
        raise RequestError("prompt", "must not be empty")
    n = len(prompt_token_ids)
    if n >= max_model_len:  # before any pass over the ids: a prompt may hold a million of them
        raise prompt_too_long(n, max_model_len)
    if not (0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab_size):
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise RequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    sampling.validate(vocab_size)
    if sampling.n > config.max_num_seqs + config.max_waiting:
        raise RequestError(
            "n", f"{sampling.n} samples can never be admitted: max_num_seqs + max_waiting is "
                 f"{config.max_num_seqs + config.max_waiting}")
    if n + sampling.max_tokens > max_model_len:
        raise RequestError(
            "sampling.max_tokens",
            f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceeds the context length "
            f"{max_model_len}")
    if sampling.prompt_logprobs is not None and n * (1 + sampling.prompt_logprobs) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise RequestError(
            "prompt_logprobs", f"{n} prompt tokens x (1 + {sampling.prompt_logprobs}) entries exceed the "
                               f"{MAX_PROMPT_LOGPROB_ENTRIES} a request may ask for")
    needed = -(-(n + sampling.max_tokens) // config.block_size)
    if needed > num_kv_blocks:
        raise RequestError("prompt", f"needs {needed} KV blocks but the pool holds {num_kv_blocks}", "PROMPT_TOO_LONG")
