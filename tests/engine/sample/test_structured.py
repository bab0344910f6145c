"""Structured output in the engine (engine/sample/structured.py): every finished sample parses, fullmatches
its regex or equals a choice; the masks hold with n > 1, stop strings, logprobs, penalties, async
scheduling and preemption; only max_tokens cuts an output short; constraints that do not compile
are refused naming the field; a request waits for its constraint to compile without holding up
others. A tiny random model sampled at temperature 1 (fresh seeds each run) is the worst case: it
has no idea of JSON, so only the masks make the output parse."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import Future

import jsonschema
import pytest

from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.errors import RequestError
from pie.engine.messages import RequestStatus
from pie.engine.sample.structured import GrammarCompiler, GrammarState
from pie.engine.sampling_params import SamplingParams, StructuredOutputParams
from tests.chat_templates import STYLES, make_chat_model_dir
from tests.engine.invariants import assert_engine_invariants

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
# llguidance's own layout: any whitespace between tokens.
FLEXIBLE_PERSON = {**PERSON, "x-guidance": {"whitespace_flexible": True}}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
COLORS = ("red", "green", "blue", "dark violet", "日本")
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


def json_schema(schema: dict) -> StructuredOutputParams:
    return StructuredOutputParams("json_schema", json.dumps(schema))


def regex(pattern: str) -> StructuredOutputParams:
    return StructuredOutputParams("regex", pattern)


def choice(*options: str) -> StructuredOutputParams:
    return StructuredOutputParams("choice", choices=options)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A ChatML model: two end-of-sequence ids (end of turn, end of text), either ends a sample.
    return make_chat_model_dir(tmp_path_factory.mktemp("structured"), "chatml")


def _engine(model_dir, async_scheduling: bool = False, **kw) -> EngineCore:
    cfg = dict(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=256, max_num_seqs=16,
               max_num_batched_tokens=256, async_scheduling=async_scheduling)
    return EngineCore(EngineConfig(**{**cfg, **kw}))


def _run(engine: EngineCore, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[tuple[str, int], dict]:
    """Runs to completion, checking the engine's invariants after every step; per (request id,
    sample index): ids, text, status, stop reason, logprob entries."""
    for rid, prompt, sp in requests:
        engine.check_request(prompt, sp)
        engine.add_request(rid, prompt, sp)
    res: dict[tuple[str, int], dict] = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            r = res.setdefault((o.request_id, o.index), dict(ids=[], text="", status=None, reason=None, logprobs=[]))
            r["ids"] += o.new_token_ids
            r["text"] += o.new_text
            r["logprobs"] += o.new_logprobs
            if o.finished:
                r["status"], r["reason"] = o.status, o.stop_reason
                assert o.status != RequestStatus.FINISHED_ERROR, o.error
        assert_engine_invariants(engine)
        steps += 1
        assert steps < 5_000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks, "KV blocks leaked"
    return res


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(rng.randint(2, 12))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_samples_at_temperature_one_validate_against_their_schema(model_dir, rng, async_scheduling):
    engine = _engine(model_dir, async_scheduling)
    sp = SamplingParams(max_tokens=480, temperature=1.0, n=8, seed=rng.randrange(2**31), structured=json_schema(PERSON))
    reqs = [(f"j{i}", _prompt(rng), sp) for i in range(3)]
    res = _run(engine, reqs)
    assert len(res) == 24
    for key, r in res.items():
        assert r["status"] == RequestStatus.FINISHED_STOPPED, (key, r["text"])
        value = json.loads(r["text"])
        jsonschema.validate(value, PERSON)
        if "\\" not in r["text"]:  # (escapes in strings may be written either way)
            assert r["text"] == json.dumps(value, ensure_ascii=False), "not json.dumps' layout"


def test_the_schema_sets_its_own_layout(model_dir, rng):
    """"x-guidance": {"whitespace_flexible": true}: any whitespace between tokens (a random model
    at temperature 1 then writes plenty of it), and the output still validates."""
    engine = _engine(model_dir)
    res = _run(engine, [("f", _prompt(rng), SamplingParams(max_tokens=480, temperature=1.0, n=8,
                                                           seed=rng.randrange(2**31),
                                                           structured=json_schema(FLEXIBLE_PERSON)))])
    texts = [r["text"] for r in res.values() if r["status"] == RequestStatus.FINISHED_STOPPED]
    assert len(texts) >= 6
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert any(text != json.dumps(json.loads(text), ensure_ascii=False) for text in texts)


def test_regex_choice_and_grammar(model_dir, rng):
    engine = _engine(model_dir)
    kinds = [
        (regex(DATE), lambda text: re.fullmatch(DATE, text)),
        (choice(*COLORS), lambda text: text in COLORS),
        (StructuredOutputParams("grammar", LARK), lambda text: re.fullmatch(r"[0-9()+\-]+", text) and eval(text)),
    ]
    reqs = [(f"k{i}", _prompt(rng), SamplingParams(max_tokens=300, temperature=1.0, n=6, seed=rng.randrange(2**31),
                                                   structured=params))
            for i, (params, _) in enumerate(kinds)]
    res = _run(engine, reqs)
    seen_choices = set()
    for i, (_, check) in enumerate(kinds):
        for index in range(6):
            r = res[(f"k{i}", index)]
            assert r["status"] == RequestStatus.FINISHED_STOPPED, r
            assert check(r["text"]), r["text"]
            if i == 1:
                seen_choices.add(r["text"])
    assert len(seen_choices) > 1, "at temperature 1 the choices should vary"


def test_a_regex_digit_is_an_ascii_digit(model_dir):
    """\\d is [0-9] (Rust's \\d would take every Unicode digit: a random model wrote a date in
    Javanese digits): every token the mask allows at the start of `\\d+` is ASCII digits only."""
    engine = _engine(model_dir)
    compiler = engine.structured.compiler
    state = GrammarState(Future())
    state.matcher = compiler.compile(regex(r"\d+")).deep_copy()

    class Row:
        grammar = state

    masks = engine.structured.fill([Row()])  # type: ignore[list-item]
    assert masks is not None
    words = masks.bitmask[0].tolist()
    allowed = [v for v in range(engine.vocab_size) if (words[v // 32] >> (v % 32)) & 1]
    pieces = [compiler.tokenizer.decode_bytes([v]) for v in allowed]
    assert len(pieces) >= 10 and all(p.isdigit() and p.isascii() for p in pieces), pieces


def test_a_constraint_is_compiled_into_replicas_taken_in_turn(model_dir, rng):
    """As many independent matchers of a constraint as the executor has threads (llguidance's
    copies of one matcher share its lexer's lock, so their masks would fill one at a time); new
    samples copy them in turn; a fill over rows of every replica, in any state, gives each row the
    mask a copy of the first replica in the same state gives."""
    engine = _engine(model_dir)
    structured = engine.structured
    compiler = structured.compiler
    assert compiler.replicas == structured.threads >= 1
    compiler.replicas = 3
    params = json_schema(PERSON)
    compiled = compiler.submit(params).result()
    compiler._worker().submit(lambda: None).result()  # the compiler's thread has built the rest
    assert len(compiled.matchers) == 3 and len({id(m) for m in compiled.matchers}) == 3
    states = [GrammarState(compiler.submit(params)) for _ in range(7)]
    assert all(s.ready for s in states)
    assert [s.replica for s in states] == [0, 1, 2, 0, 1, 2, 0]
    text = json.dumps({"name": "ab", "age": 7, "tags": ["red"], "ok": True}, separators=(", ", ": "))
    ids = compiler.tokenizer.tokenize_str(text)
    cuts = [rng.randrange(len(ids)) for _ in states]
    for s, cut in zip(states, cuts):
        assert s.matcher is not None and s.matcher.consume_tokens(ids[:cut])

    class Row:
        def __init__(self, grammar):
            self.grammar = grammar

    masks = structured.fill([Row(s) for s in states])  # type: ignore[arg-type]
    assert masks is not None
    got = masks.bitmask.clone()  # the fills below reuse the buffers
    for i, cut in enumerate(cuts):
        alone = GrammarState(Future())
        alone.matcher = compiled.matchers[0].deep_copy()
        assert alone.matcher.consume_tokens(ids[:cut])
        want = structured.fill([Row(alone)])  # type: ignore[arg-type]
        assert want is not None and got[i].tolist() == want.bitmask[0].tolist()


def test_the_boolean_schemas(model_dir, rng):
    """JSON Schema's `true` admits any JSON value (it compiles as {}); `false` admits none and is
    refused naming the field."""
    engine = _engine(model_dir)
    sp = SamplingParams(max_tokens=120, temperature=1.0, seed=rng.randrange(2**32), n=3,
                        structured=StructuredOutputParams("json_schema", "true"))
    for r in _run(engine, [("any", _prompt(rng), sp)]).values():
        if r["status"] != RequestStatus.FINISHED_LENGTH:
            json.loads(r["text"])
    with pytest.raises(RequestError, match="structured.json_schema: the schema false admits no value"):
        engine.check_request(_prompt(rng), SamplingParams(structured=StructuredOutputParams("json_schema", "false")))


def test_json_object(model_dir, rng):
    """Any JSON object: its strings are unbounded, so a random model may run into max_tokens (then
    LENGTH, cut at exactly max_tokens); whatever ends on its own parses as an object."""
    engine = _engine(model_dir)
    res = _run(engine, [("o", _prompt(rng), SamplingParams(max_tokens=120, temperature=1.0, n=8,
                                                           seed=rng.randrange(2**31),
                                                           structured=StructuredOutputParams("json_object")))])
    for r in res.values():
        assert r["text"].lstrip().startswith("{")
        if r["status"] == RequestStatus.FINISHED_STOPPED:
            assert isinstance(json.loads(r["text"]), dict)
        else:
            assert r["status"] == RequestStatus.FINISHED_LENGTH and len(r["ids"]) == 120
    matcher = engine.structured.compiler.compile(StructuredOutputParams("json_object"))
    encode = engine.tokenizer.encode
    assert matcher.deep_copy().try_consume_tokens(encode('{"a": [1, {"b": null}]}', add_special_tokens=False)) > 0
    refused = matcher.deep_copy()
    assert refused.try_consume_tokens(encode("[1]", add_special_tokens=False)) == 0


def test_a_complete_constraint_ends_the_sample_without_an_end_of_sequence(model_dir):
    """A regex with one match: its tokens, then the end (no EOS generated, no stop reason)."""
    engine = _engine(model_dir)
    res = _run(engine, [("r", [5, 6, 7], SamplingParams(max_tokens=50, temperature=1.0, seed=1,
                                                        structured=regex("story model")))])
    r = res[("r", 0)]
    assert r["text"] == "story model" and r["status"] == RequestStatus.FINISHED_STOPPED and r["reason"] is None
    assert r["ids"] == engine.tokenizer.encode("story model", add_special_tokens=False) or \
        engine.tokenizer.decode(r["ids"]) == "story model"
    assert not set(r["ids"]) & set(engine.eos_token_ids)


def test_where_the_constraint_may_end_every_end_of_sequence_id_is_allowed(model_dir):
    """The mask at a complete-but-extendable point allows the constraint's continuations and every
    EOS id of the model (generation_config's list), not only the tokenizer's own EOS."""
    engine = _engine(model_dir)
    compiler = engine.structured.compiler
    matcher = compiler.compile(regex("a|ab")).deep_copy()
    assert matcher.consume_token(engine.tokenizer.encode("a", add_special_tokens=False)[0])
    state = GrammarState(Future())
    state.matcher = matcher

    class Row:  # what fill() reads of a request
        grammar = state

    masks = engine.structured.fill([Row()])  # type: ignore[list-item]
    assert masks is not None and masks.rows.tolist() == [0]
    words = masks.bitmask[0].tolist()
    allowed = {v for v in range(engine.vocab_size) if (words[v // 32] >> (v % 32)) & 1}
    assert set(engine.eos_token_ids) == set(STYLES["chatml"].end_of_turn_ids) and len(engine.eos_token_ids) == 2
    assert set(engine.eos_token_ids) <= allowed
    assert {engine.tokenizer.decode([t]) for t in allowed - set(engine.eos_token_ids)} <= {"b"}


def test_min_tokens_holds_back_the_end_but_not_a_complete_constraint(model_dir, rng):
    """min_tokens bans the EOS ids where the constraint may still go on (so the output goes on),
    and never leaves a row with nothing allowed: a constraint that can take nothing more ends its
    sample, whatever min_tokens says."""
    engine = _engine(model_dir)
    seed = rng.randrange(2**31)
    res = _run(engine, [
        ("digits", _prompt(rng), SamplingParams(max_tokens=30, temperature=1.0, seed=seed, min_tokens=12,
                                                structured=regex("[0-9]+"))),
        ("word", _prompt(rng), SamplingParams(max_tokens=30, temperature=1.0, seed=seed, min_tokens=12,
                                              structured=choice("red", "blue"))),
    ])
    digits, word = res[("digits", 0)], res[("word", 0)]
    assert re.fullmatch("[0-9]+", digits["text"]) and len(digits["ids"]) >= 12, digits
    assert word["text"] in ("red", "blue") and word["status"] == RequestStatus.FINISHED_STOPPED, word
    assert len(word["ids"]) < 12


def test_only_max_tokens_cuts_an_output_short(model_dir, rng):
    engine = _engine(model_dir)
    res = _run(engine, [("cut", _prompt(rng), SamplingParams(max_tokens=3, temperature=1.0, seed=rng.randrange(2**31),
                                                             structured=json_schema(PERSON)))])
    r = res[("cut", 0)]
    assert r["status"] == RequestStatus.FINISHED_LENGTH and len(r["ids"]) == 3
    assert r["text"].startswith("{")
    with pytest.raises(ValueError):
        json.loads(r["text"])


def test_with_stop_strings_logprobs_and_penalties(model_dir, rng):
    """Penalties and logprobs work on the masked logits: every alternative with a finite logprob is
    a token the constraint allowed there; a stop string the caller set still ends the text."""
    engine = _engine(model_dir)
    sp_logprobs = SamplingParams(max_tokens=300, temperature=1.0, n=3, seed=rng.randrange(2**31), logprobs=5,
                                 repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5,
                                 structured=json_schema(PERSON))
    sp_stop = SamplingParams(max_tokens=50, temperature=1.0, seed=rng.randrange(2**31), stop=["-"],
                             structured=regex(DATE))
    sp_greedy = SamplingParams(max_tokens=100, temperature=0.0, structured=choice(*COLORS))
    res = _run(engine, [("lp", _prompt(rng), sp_logprobs), ("stop", _prompt(rng), sp_stop),
                        ("greedy", _prompt(rng), sp_greedy)])
    compiler = engine.structured.compiler
    for index in range(3):
        r = res[("lp", index)]
        assert r["status"] == RequestStatus.FINISHED_STOPPED
        jsonschema.validate(json.loads(r["text"]), PERSON)
        matcher = compiler.compile(json_schema(PERSON)).deep_copy()
        assert len(r["logprobs"]) == len(r["ids"])
        for token, entry in zip(r["ids"], r["logprobs"]):
            assert entry.token_id == token and entry.logprob <= 0.0
            finite = [t for t, lp in entry.top if lp > float("-inf")]
            assert finite and all(matcher.validate_tokens([t]) == 1 for t in finite), "a masked token has a logprob"
            assert matcher.consume_token(token)
    stop = res[("stop", 0)]
    assert stop["status"] == RequestStatus.FINISHED_STOPPED and stop["reason"] == "-"
    assert re.fullmatch(r"(19|20)\d\d", stop["text"]), stop["text"]
    assert res[("greedy", 0)]["text"] in COLORS


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_samples_keep_their_matchers(model_dir, rng, async_scheduling):
    """A pool too small for everyone: constrained samples are preempted and recomputed, and their
    outputs still validate (the matcher holds what was appended, nothing is consumed twice)."""
    engine = _engine(model_dir, async_scheduling, num_kv_blocks=40, block_size=4)
    sp = SamplingParams(max_tokens=120, temperature=1.0, seed=rng.randrange(2**31), structured=json_schema(PERSON))
    res = _run(engine, [(f"p{i}", _prompt(rng), sp) for i in range(8)])
    assert engine.stats().num_preemptions > 0
    for r in res.values():
        assert r["status"] in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if r["status"] == RequestStatus.FINISHED_STOPPED:
            jsonschema.validate(json.loads(r["text"]), PERSON)


def test_sync_and_async_scheduling_sample_the_same_constrained_tokens(model_dir, rng):
    seed = rng.randrange(2**31)
    reqs = [("a", [5, 9, 11], SamplingParams(max_tokens=200, temperature=1.0, n=4, seed=seed,
                                             structured=json_schema(PERSON))),
            ("b", [8, 3], SamplingParams(max_tokens=30, temperature=0.8, seed=seed + 1)),  # unconstrained beside
            ("c", [4, 4, 4, 4], SamplingParams(max_tokens=60, temperature=1.0, seed=seed + 2, structured=regex(DATE)))]
    sync = _run(_engine(model_dir, False), reqs)
    asyn = _run(_engine(model_dir, True), reqs)
    assert {k: (v["ids"], v["text"], v["status"]) for k, v in sync.items()} == \
        {k: (v["ids"], v["text"], v["status"]) for k, v in asyn.items()}


@pytest.mark.parametrize("params, field, message", [
    (StructuredOutputParams("json_schema", '{"type": "object"'), "structured.json_schema", "is not JSON"),
    (StructuredOutputParams("json_schema", '{"type": "no-such-type"}'), "structured.json_schema", "no-such-type"),
    (StructuredOutputParams("json_schema", "[1, 2]"), "structured.json_schema", "must be a JSON object"),
    (StructuredOutputParams("regex", "a(b"), "structured.regex", "unclosed group"),
    (StructuredOutputParams("grammar", "start: missing_rule"), "structured.grammar", "missing_rule"),
])
def test_a_constraint_that_does_not_compile_is_refused_with_the_compilers_message(model_dir, params, field, message):
    engine = _engine(model_dir)
    with pytest.raises(RequestError) as err:
        engine.check_request([5, 6], SamplingParams(structured=params))
    assert err.value.field == field and message in err.value.message


@pytest.mark.parametrize("params, field", [
    (StructuredOutputParams("json_schema", ""), "structured.json_schema"),
    (StructuredOutputParams("choice"), "structured.choice"),
    (StructuredOutputParams("choice", choices=("a", "")), "structured.choice"),
    (StructuredOutputParams("regex", "x" * (256 * 1024 + 1)), "structured.regex"),
    (StructuredOutputParams("yaml", "a: 1"), "structured"),
])
def test_malformed_constraints_are_refused_before_compiling(params, field):
    with pytest.raises(RequestError) as err:
        SamplingParams(structured=params)
    assert err.value.field == field


def test_compilations_are_cached_by_their_text(model_dir):
    engine = _engine(model_dir)
    compiler = engine.structured.compiler
    first = compiler.compile(json_schema(PERSON))
    assert compiler.compile(json_schema(PERSON)) is first
    assert compiler.cached(json_schema(PERSON)) is not None and compiler.cached(regex("x+")) is None
    with pytest.raises(RequestError):
        compiler.compile(regex("a(b"))
    assert compiler.cached(regex("a(b")) is not None  # errors are remembered too


def test_a_request_waits_for_its_constraint_without_holding_up_others(model_dir):
    """While a constraint compiles its request stays in the queue; requests behind it are admitted."""
    engine = _engine(model_dir)
    compiling: Future = Future()
    submit = engine.structured.compiler.submit
    engine.structured.compiler.submit = lambda params: compiling  # type: ignore[method-assign]
    try:
        engine.add_request("slow", [5, 6, 7], SamplingParams(max_tokens=4, temperature=1.0, structured=regex("[ab]+")))
    finally:
        engine.structured.compiler.submit = submit  # type: ignore[method-assign]
    engine.add_request("free", [8, 9], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["free"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["slow"]
    assert engine.scheduler.compiling() == [compiling]
    compiling.set_result(engine.structured.compiler.submit(regex("[ab]+")).result())
    res: dict[str, str] = {}
    while engine.has_unfinished():
        for o in engine.step():
            res[o.request_id] = res.get(o.request_id, "") + o.new_text
    assert re.fullmatch("[ab]+", res["slow"])


def test_a_constraint_that_fails_in_the_engine_fails_its_request_only(model_dir):
    """The service refuses such constraints first; one that reaches the engine anyway (offline use
    without check_request) ends its own request with FINISHED_ERROR, naming the compiler's message."""
    engine = _engine(model_dir)
    engine.add_request("bad", [5, 6], SamplingParams(max_tokens=5, temperature=1.0, structured=regex("a(b")))
    engine.add_request("good", [5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    bad = [o for o in outputs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].status == RequestStatus.FINISHED_ERROR and "unclosed group" in bad[0].error
    good = [o for o in outputs if o.request_id == "good"]
    assert sum(len(o.new_token_ids) for o in good) == 5


def test_compiler_over_a_larger_vocabulary_than_the_tokenizer(model_dir):
    """Rows of the logits past the tokenizer (a padded embedding) are never allowed."""
    engine = _engine(model_dir)
    compiler = GrammarCompiler(engine.tokenizer.backend.to_str(), 600, engine.eos_token_ids)
    matcher = compiler.compile(StructuredOutputParams("json_object")).deep_copy()
    state = GrammarState(Future())
    state.matcher = matcher

    class Row:
        grammar = state

    from pie.engine.sample.structured import StructuredOutputs

    masks = StructuredOutputs(compiler, max_num_seqs=2, pin_memory=False).fill([Row()])  # type: ignore[list-item]
    assert masks is not None and masks.bitmask.shape == (1, -(-600 // 32))
    words = masks.bitmask[0].tolist()
    assert not any((words[v // 32] >> (v % 32)) & 1 for v in range(512, 600))


@pytest.mark.gpu
def test_on_the_gpu_with_cuda_graphs_and_async_scheduling(model_dir, rng):
    """As served on CUDA: decode steps replay CUDA graphs, the masks go onto the graph's logits
    (the Triton kernel), and async scheduling fills them while the forward pass runs."""
    engine = _engine(model_dir, None, device="cuda", dtype="fp32")
    assert engine.runner.graphs and engine._async
    sp = SamplingParams(max_tokens=480, temperature=1.0, n=8, seed=rng.randrange(2**31), structured=json_schema(PERSON))
    res = _run(engine, [(f"g{i}", _prompt(rng), sp) for i in range(4)] +
               [("free", _prompt(rng), SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True))])
    for key, r in res.items():
        if key[0] == "free":
            assert r["status"] == RequestStatus.FINISHED_LENGTH
            continue
        assert r["status"] == RequestStatus.FINISHED_STOPPED, (key, r["text"])
        jsonschema.validate(json.loads(r["text"]), PERSON)
