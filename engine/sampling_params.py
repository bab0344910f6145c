"""Sampling parameters of one request, validated once when the request is made.

The service validates protobuf fields and names them in INVALID_ARGUMENT errors; this dataclass is
the engine-side form (plain Python, no protobuf) and re-checks the same ranges so the engine is safe
to use on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import RequestError

# Caps that keep one request from costing unbounded work per step.
MAX_LOGPROBS = 20  # top-n logprobs per token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16  # samples per request
MAX_LOGIT_BIAS = 1024  # logit_bias entries (OpenAI allows 300; one sparse add per entry per step)
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 all but bans a token, 100 all but forces it
# Prompt tokens x (1 + prompt_logprobs) at most: each entry is a protobuf message in one answer
# (~20 bytes), so this keeps a whole answer of them inside the default 16 MiB message limit.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 20
# Structured output: a schema, regex or grammar text of at most this many characters (a large
# JSON schema is tens of KB), and at most this many choices of at most MAX_CHOICE_CHARS each.
MAX_STRUCTURED_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
# The kinds of structured output (the oneof of pie.v1.StructuredOutput, by field name).
STRUCTURED_KINDS = ("json_schema", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """What a structured output must be (compiled by engine/sample/structured.py into an llguidance
    matcher). Hashable: the compiled grammars are cached by it."""

    kind: str  # one of STRUCTURED_KINDS
    text: str = ""  # the JSON schema, regex or Lark grammar; "" for choice and json_object
    choices: tuple[str, ...] = ()  # kind == "choice": the output is exactly one of them

    @property
    def field(self) -> str:
        """The field a problem with it is reported under (`structured.json_schema`, ...)."""
        return f"structured.{self.kind}"

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError("structured", f"kind must be one of {', '.join(STRUCTURED_KINDS)}, got "
                                                    f"{self.kind!r}")
        if self.kind in ("json_schema", "regex", "grammar"):
            if not self.text:
                raise RequestError(self.field, "must not be empty")
            if len(self.text) > MAX_STRUCTURED_CHARS:
                raise RequestError(self.field, f"is longer than {MAX_STRUCTURED_CHARS} characters")
        elif self.text:
            raise RequestError(self.field, "takes no text")
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                raise RequestError(self.field, f"needs 1 to {MAX_CHOICES} choices, got {len(self.choices)}")
            for c in self.choices:
                if not c:
                    raise RequestError(self.field, "choices must not be empty")
                if len(c) > MAX_CHOICE_CHARS:
                    raise RequestError(self.field, f"choices are at most {MAX_CHOICE_CHARS} characters")
        elif self.choices:
            raise RequestError(self.field, "takes no choices")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16  # tokens to generate at most (>= 1)
    temperature: float = 1.0  # 0 = greedy (argmax); otherwise logits / temperature
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p; 1 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; 0 = off
    repetition_penalty: float = 1.0  # CTRL-style, over prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # OpenAI-style, subtracted once per token seen in the output
    frequency_penalty: float = 0.0  # OpenAI-style, subtracted per occurrence in the output
    seed: int | None = None  # fixes the random stream of this request (same text whatever the batch)
    stop: list[str] = field(default_factory=list)  # stop strings; the text is cut before them
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end the request
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    logprobs: int = 0  # number of top logprobs per generated token; 0 = none
    skip_special_tokens: bool = True  # drop special tokens from the returned text
    n: int = 1  # independent samples of the same prompt (prompt prefilled once via the prefix cache)
    # Top logprobs per prompt position (the prompt tokens' own logprobs too); None = none. A request
    # that asks computes its whole prompt (no prefix-cache hit: cached positions have no logits).
    prompt_logprobs: int | None = None
    # token id -> added to its logit before penalties, temperature and the filters
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # EOS / stop token ids / stop strings cannot end the request before this many
    # Constrain the output (a JSON schema, regex, choice or grammar): tokens outside it are masked
    # before sampling, and the request ends when the constraint is complete. None = free text.
    structured: StructuredOutputParams | None = None
    # This request decodes without speculative decoding even where the server speculates (its
    # tokens are the same either way; speculation only changes how fast they come).
    disable_speculation: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        def finite(name: str, value: float) -> None:
            if not math.isfinite(value):
                raise RequestError(name, f"must be a finite number, got {value}")

        if self.max_tokens < 1:
            raise RequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0.0:
            raise RequestError("temperature", f"must be >= 0, got {self.temperature}")
        if self.temperature != 0.0 and self.temperature < 1e-3:
            raise RequestError("temperature", "must be 0 (greedy) or >= 0.001")
        if self.temperature > 100.0:
            raise RequestError("temperature", f"must be <= 100, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise RequestError("top_k", f"must be <= vocab size {vocab_size}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise RequestError(
                "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise RequestError(
                "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise RequestError(
                "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError("seed", "must be in [0, 2^63)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not s:
                raise RequestError("stop", "stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise RequestError(
                    "stop", f"stop strings are at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise RequestError("stop_token_ids", f"token id {t} is outside the vocabulary")
        if not 1 <= self.n <= MAX_N:
            raise RequestError("n", f"must be in [1, {MAX_N}], got {self.n}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise RequestError("prompt_logprobs",
                                      f"must be in [0, {MAX_LOGPROBS}] (or unset), got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError("min_tokens", f"must be in [0, max_tokens = {self.max_tokens}], "
                                                    f"got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for t, bias in self.logit_bias.items():
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise RequestError("logit_bias", f"token id {t} is outside the vocabulary"
                                          + (f" [0, {vocab_size})" if vocab_size is not None else ""))
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:  # NaN fails this too
                raise RequestError("logit_bias", f"the bias of token {t} must be in "
                                          f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}")
        if self.structured is not None:
            self.structured.validate()
