"""Finish reasons at the edge: a stop string that only appears when held-back text is flushed."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import SampledToken
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from tests.helpers import make_hf_model_dir


def test_stop_string_found_in_flushed_text_ends_as_stop(tmp_path):
    """The last token leaves a split UTF-8 character; the request ends by length, the held-back
    text is flushed, and the stop string found in it makes the finish reason "stop"."""
    engine = EngineCore(EngineConfig(model=str(make_hf_model_dir(tmp_path, "llama")), device="cpu",
                                    kv_cache_dtype="fp32", num_kv_blocks=16))
    tok = engine.tokenizer
    forced = [tok.token_to_id("a"), tok.token_to_id("b"), tok.token_to_id("Ã")]  # "Ã" = byte 0xC3
    assert None not in forced
    assert tok.decode(forced) == "ab\ufffd"
    steps = iter(forced)
    engine.runner.launch = lambda out: Forced(out, steps)  # the model's choice replaced by the forced tokens
    engine.add_request("r", tok.encode("x"), SamplingParams(max_tokens=3, stop=["b\ufffd"]))
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert "".join(o.new_text for o in outputs) == "a"
    assert outputs[-1].status == RequestStatus.FINISHED_STOPPED and outputs[-1].stop_reason == "b\ufffd"


class Forced:
    """A launched step whose sampled tokens are given, not computed (ModelRunner.launch's result)."""

    def __init__(self, out, tokens) -> None:
        self.requests = out.sampling_requests
        self._tokens = tokens

    def result(self) -> list[SampledToken]:
        return [SampledToken(next(self._tokens), 0.0, []) for _ in self.requests]
