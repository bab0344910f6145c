"""Finish reasons at the edge: a stop string that only appears when held-back text is flushed;
min_tokens holding back EOS and stop token ids that logit_bias makes all but certain."""

from __future__ import annotations

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.messages import RequestStatus, SampledToken
from pie.engine.sampling_params import SamplingParams
from pie.engine.scheduling.step import StepOutput
from tests.helpers import EOS_ID, make_hf_model_dir


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

    speculative = False  # no proposals verified
    done = None  # no device event: the host's clock times the step

    def __init__(self, out, tokens) -> None:
        self.requests = self.all_requests = out.sampling_requests
        self._tokens = tokens

    def result(self) -> StepOutput:
        return StepOutput(self.requests, [[SampledToken(next(self._tokens), 0.0, [])] for _ in self.requests])


def test_min_tokens_holds_back_eos_and_stop_ids_the_bias_forces(tmp_path):
    """logit_bias +100 on EOS (or a stop token id): the first token allowed to end the request is
    the one after min_tokens, in a batch with a request that uses neither."""
    engine = EngineCore(EngineConfig(model=str(make_hf_model_dir(tmp_path, "llama")), device="cpu",
                                     kv_cache_dtype="fp32", num_kv_blocks=32))
    stop_id = 77
    requests = {
        "eos": SamplingParams(max_tokens=20, temperature=0.8, seed=1, min_tokens=5, logit_bias={EOS_ID: 100.0}),
        "stop_id": SamplingParams(max_tokens=20, temperature=0, min_tokens=3, stop_token_ids=[stop_id],
                                  logit_bias={stop_id: 100.0}, ignore_eos=True),
        "plain": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        "eos_now": SamplingParams(max_tokens=20, temperature=0, logit_bias={EOS_ID: 100.0}),
        # EOS named as a stop token id too: then it is the stop reason
        "eos_asked": SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[EOS_ID], logit_bias={EOS_ID: 100.0}),
    }
    for rid, sp in requests.items():
        engine.add_request(rid, [5, 6, 7], sp)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    last = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            last[o.request_id] = o
    assert tokens["eos"][-1] == EOS_ID and len(tokens["eos"]) == 6 and EOS_ID not in tokens["eos"][:5]
    assert tokens["stop_id"] == tokens["stop_id"][:3] + [stop_id] and stop_id not in tokens["stop_id"][:3]
    assert last["stop_id"].stop_reason == stop_id
    assert len(tokens["plain"]) == 6
    assert tokens["eos_now"] == [EOS_ID]  # without min_tokens the bias ends it at once
    # The end of sequence is no stop reason (generate.proto: empty for end-of-sequence); a stop id is.
    assert last["eos"].stop_reason is None and last["eos_now"].stop_reason is None
    assert tokens["eos_asked"] == [EOS_ID] and last["eos_asked"].stop_reason == EOS_ID
