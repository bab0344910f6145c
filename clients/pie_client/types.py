"""Plain result types of the pie client: what the RPCs return, without protobuf in sight."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely alternatives at a generated position."""

    token_id: int
    logprob: float  # natural log
    token: str  # text piece of the token


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one generated token, with the most likely alternatives."""

    token_id: int
    logprob: float  # natural log
    token: str  # text piece of the token
    top_logprobs: list[TopLogprob] = field(default_factory=list)  # most likely first


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """Log-probability of one prompt token given the prompt tokens before it (`prompt_logprobs=K`)."""

    token_id: int
    token: str  # text piece of the token
    logprob: float | None  # natural log; None for the first prompt token, which nothing precedes
    top_logprobs: list[TopLogprob] = field(default_factory=list)  # the K most likely there, most likely first


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int  # over all choices
    total_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, served from the server's prefix cache


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the n samples of a `generate` call with n > 1."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Completion:
    """The whole answer of `generate`."""

    request_id: str
    text: str  # generated text, without the prompt and without a matched stop string
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: str  # the matched stop string, or the stop token id as text; "" otherwise
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked
    choices: list[Choice] = field(default_factory=list)  # all n samples when n > 1 (the fields above are choice 0's)
    cached_prompt_tokens: int = 0  # of prompt_tokens, served from the server's prefix cache
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # one per prompt token when asked

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Delta:
    """One message of `stream`: what is new since the previous one.

    `finish_reason`, `stop_reason` and `usage` are set on the last delta only.
    """

    request_id: str
    text: str  # new text; may be empty while a character or a possible stop string is held back
    token_ids: list[int]  # new token ids; several when the server coalesced messages
    finish_reason: str | None = None  # None until the last delta
    stop_reason: str = ""
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0  # the choice this delta belongs to (n > 1)
    # On the stream's first delta (of choice 0) when prompt_logprobs was asked: one per prompt token.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Tokenization:
    """Result of `tokenize`."""

    token_ids: list[int]
    tokens: list[str]  # text piece of each token, parallel to token_ids
    rendered_text: str = ""  # of a chat: the conversation as the model's template rendered it

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """The server's load when `model_info` was answered."""

    kv_blocks_total: int
    kv_blocks_free: int  # counting cached blocks no request holds
    requests_running: int
    requests_waiting: int
    max_num_seqs: int
    max_waiting: int  # queue bound; beyond it the server answers RESOURCE_EXHAUSTED
    kv_blocks_cached: int = 0  # of kv_blocks_free, those holding a reusable cached prompt prefix
    # Of requests_waiting, how many wait at each priority (lower runs first); priorities with none left out.
    requests_waiting_by_priority: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpeculativeDecoding:
    """How the server speculates (`pie serve --speculative`), and its counts since it started."""

    method: str  # "ngram" or "draft"
    num_speculative_tokens: int  # proposals per request and step at most
    num_drafts: int  # verify steps of a request that carried proposals
    num_draft_tokens: int  # proposals verified
    num_accepted_tokens: int  # of those, accepted
    acceptance_rate: float  # num_accepted_tokens / num_draft_tokens (0 before any proposal)
    mean_acceptance_length: float  # tokens per verify step, 1 + num_accepted_tokens / num_drafts (0 before any)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model and how the server runs it (mirrors GetModelInfoResponse)."""

    model_name: str
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # "llama", "mistral", "qwen2", "qwen3"
    max_model_len: int  # context length served, prompt plus completion
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    kv_cache_dtype: str  # "int8", "bf16", "fp32"
    block_size: int  # tokens per KV-cache block
    device: str
    dtype: str  # weights
    load: ModelLoad
    logprobs_mode: str = ""  # "raw" or "processed": what generated tokens' logprobs are (empty: an older server)
    speculative: SpeculativeDecoding | None = None  # None: the server does not speculate (or is older)
