"""Structured output's cost (issue 30): the host's share (compiling, filling token masks) and what
masks add to a decode step, at a 152k vocabulary.

    python -m benchmarks.structured                 # GPU: Qwen3-4B-shaped model, 64 and 256 rows
    python -m benchmarks.structured --host-only     # the host side alone, any machine
    python -m benchmarks.structured --tiny          # CPU smoke run of everything (small model)

1. Host: building llguidance's tokenizer, compiling a realistic JSON schema (cold, a fresh
   compiler each time; and a cache hit), filling the masks of B rows whose matchers sit at
   staggered points of a valid instance (llguidance's parallel batch fill, as the engine calls it;
   per step and per row), and consuming one token per row.
2. Steps (needs CUDA unless --tiny): an engine decoding B rows, all constrained by a JSON schema
   whose outputs run long, against the same B rows unconstrained; wall time per decode step
   (median of windows of --steps steps, async scheduling and CUDA graphs as served), and the
   kernel that applies the masks alone (152k columns).

The tokenizer is synthetic (151,643 byte-level tokens: English-like words with and without a
leading space, numbers, punctuation and JSON pieces, whitespace runs, CJK, code pieces), since no
real 152k tokenizer is on these machines: mask filling walks the tokenizer's trie, so its cost
depends on the vocabulary's size and shape, not on the weights. `--tokenizer DIR` uses a real one.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from benchmarks.common import DEVICE_HELP, default_device, make_parser
from benchmarks.throughput import LLAMA_4B, TINY, build_model
from pie.engine.config import EngineConfig
from pie.engine.core.engine_core import EngineCore
from pie.engine.sample.structured import GrammarCompiler, GrammarState, StructuredOutputs
from pie.engine.sampling_params import SamplingParams, StructuredOutputParams

QWEN_TOKENS = 151_643  # Qwen2.5's tokenizer, before its special tokens
QWEN_VOCAB = 151_936  # its embedding rows (the logits' width)

# An API's request body: nested objects, arrays, enums, bounded numbers, patterns, optional fields.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 60},
            "email": {"type": "string", "format": "email"},
            "vip": {"type": "boolean"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "CA", "FR", "DE", "JP", "CN"]}}, "required": ["street", "city", "country"],
                "additionalProperties": False}},
            "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0}, "gift": {"type": "boolean"}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "notes": {"type": ["string", "null"]},
        "created": {"type": "string", "format": "date-time"},
    },
    "required": ["order_id", "status", "customer", "items", "created"],
    "additionalProperties": False,
}
ORDER = {"order_id": "ABC-123456", "status": "shipped",
         "customer": {"name": "Ana Lopez", "email": "ana@example.com", "vip": True,
                      "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345", "country": "US"}},
         "items": [{"sku": "X-1", "quantity": 2, "price": 9.99}, {"sku": "Y-22", "quantity": 1, "price": 120.5,
                                                                  "gift": True}],
         "notes": None, "created": "2026-12-01T10:00:00Z"}
# What the step benchmark's rows produce: a list of records with free strings. At least 40 of them
# (no record is shorter than a few tokens), so no row's schema can be complete within the timed
# steps: a random model does close strings and arrays, and a row that ended would leave the masked
# run with fewer rows per step than the free one (2026-12-02: 221 of 256 without minItems).
LONG_SCHEMA = {"type": "array", "minItems": 40, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the rest
    for the characters from U+0100 on, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def synthetic_tokenizer_json(num_tokens: int = QWEN_TOKENS, seed: int = 0) -> str:
    """A byte-level BPE tokenizer.json of `num_tokens` ids (<pad>, <s>, </s> = 0, 1, 2, then the
    256 bytes, then pieces of text); no merges: only its vocabulary matters to llguidance."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    to_char = _bytes_to_unicode()

    def spell(text: str) -> str:
        return "".join(to_char[b] for b in text.encode("utf-8"))

    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        if token not in vocab and len(vocab) < num_tokens:
            vocab[token] = len(vocab)

    for special in ("<pad>", "<s>", "</s>"):
        add(special)
    for b in range(256):
        add(to_char[b])
    fixed = ['{"', '"}', '":', '",', '":"', '","', '"]', '["', "},", "}]", "[{", "{\n", "\n}", ": ", ", ", "null", "true",
             "false", "()", "):", "->", "::", "==", "!=", "<=", ">=", "//", "/*", "*/", "self", "def", "return", "import"]
    for piece in fixed:
        add(spell(piece))
    for n in range(1000):
        add(spell(str(n)))
        add(spell(" " + str(n)))
    for width in range(1, 33):
        for ws in (" ", "\n", "\t"):
            add(spell(ws * width))
        add(spell("\n" + " " * width))
    consonants, vowels = "bcdfghjklmnprstvwyz", "aeiou"
    letters_weights = [8.2, 1.5, 2.8, 4.3, 12.7, 2.2, 2.0, 6.1, 7.0, 0.2, 0.8, 4.0, 2.4, 6.7, 7.5, 1.9, 0.1, 6.0, 6.3,
                       9.1, 2.8, 1.0, 2.4, 0.2, 2.0, 0.1]
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < num_tokens:
        kind = rng.random()
        if kind < 0.55:  # a syllabic word, with a leading space half the time, capitalized a tenth
            word = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 5)))
            word = word[:rng.randint(2, len(word))] if rng.random() < 0.5 else word
            word = word.capitalize() if rng.random() < 0.1 else word
            add(spell((" " if rng.random() < 0.5 else "") + word))
        elif kind < 0.85:  # a letter n-gram (a word's piece)
            add(spell("".join(rng.choices(letters, letters_weights, k=rng.randint(2, 7)))))
        elif kind < 0.93:  # CJK, one or two characters
            add(spell("".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 2)))))
        else:  # code and punctuation pieces
            piece = rng.choice(["_", ".", "(", ")", '"', "'", ",", ";", ":", "=", "[", "]", "{", "}"])
            add(spell(rng.choice(["", " "]) + piece + "".join(rng.choices(letters, k=rng.randint(0, 4)))))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<s>", "</s>")])
    return tokenizer.to_str()


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.3f} ms (min {min(seconds) * 1e3:.3f}, max {max(seconds) * 1e3:.3f})"


class _Row:
    """What StructuredOutputs.fill reads of a request: its grammar state."""

    def __init__(self, grammar: GrammarState) -> None:
        self.grammar = grammar


def host_side(tokenizer_json: str, vocab: int, batches: list[int], steps: int, threads: int | None,
              replicas: int | None) -> dict:
    out: dict = {}
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer_json, vocab, (2,))
    out["tokenizer_build_ms"] = (time.perf_counter() - t0) * 1e3
    print(f"llguidance tokenizer ({vocab} columns): {out['tokenizer_build_ms']:.0f} ms to build")
    schema = StructuredOutputParams("json_schema", json.dumps(ORDER_SCHEMA))
    manager = StructuredOutputs(compiler, max_num_seqs=max(batches), pin_memory=torch.cuda.is_available(),
                                threads=threads)
    if replicas is not None:
        compiler.replicas = replicas
    cold, first_fill = [], []
    for i in range(5):  # a new text each time (a "$comment"): compiled, not taken from the cache
        params = StructuredOutputParams("json_schema", json.dumps({**ORDER_SCHEMA, "$comment": f"run {i}"}))
        t0 = time.perf_counter()
        matcher = compiler.compile(params)
        cold.append(time.perf_counter() - t0)
        state = GrammarState(Future())
        state.matcher = matcher.deep_copy()
        t0 = time.perf_counter()
        manager.fill([_Row(state)])  # type: ignore[list-item]
        first_fill.append(time.perf_counter() - t0)  # llguidance builds its lexer states lazily
    compiler.compile(schema)
    t0 = time.perf_counter()
    for _ in range(100):
        compiler.compile(schema)
    hit = (time.perf_counter() - t0) / 100
    out["compile_ms"] = statistics.median(cold) * 1e3
    out["first_fill_ms"] = statistics.median(first_fill) * 1e3
    print(f"compile the order schema ({len(json.dumps(ORDER_SCHEMA))} chars), cold: {_ms(cold)}; its first mask "
          f"(one row): {_ms(first_fill)}; from the cache: {hit * 1e6:.1f} us")
    for kind, text in (("regex", r"[A-Z]{3}-[0-9]{6} (19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
                       ("grammar", 'start: expr\nexpr: term (("+" | "-") term)*\nterm: /[0-9]+/ | "(" expr ")"')):
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputParams(kind, text))
        print(f"compile a {kind}: {(time.perf_counter() - t0) * 1e3:.2f} ms")

    # the engine's matchers: copies of the constraint's replicas (engine/sample/structured.py), once all are built
    schema = StructuredOutputParams("json_schema", json.dumps({**ORDER_SCHEMA, "$comment": "replicas"}))
    compiled = compiler.submit(schema).result()
    while len(compiled.matchers) < compiler.replicas:
        time.sleep(0.01)
    print(f"fills from {len(compiled.matchers)} independent matcher(s) of the schema, {manager.threads} threads")
    instance = compiler.tokenizer.tokenize_str(json.dumps(ORDER))
    out["fill"] = {}
    out["replicas"] = len(compiled.matchers)
    for batch in batches:
        rows, positions = [], []
        for r in range(batch):  # each row at its own point of the instance
            state = GrammarState(compiler.submit(schema))
            assert state.ready
            assert state.matcher is not None
            start = (r * 7) % len(instance)
            assert state.matcher.consume_tokens(instance[:start])
            rows.append(_Row(state))
            positions.append(start)
        fills, consumes = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            manager.fill(rows)  # type: ignore[arg-type]
            fills.append(time.perf_counter() - t0)
            pairs = []
            for r, row in enumerate(rows):
                if positions[r] >= len(instance):  # at the end: start over
                    row.grammar.matcher, row.grammar.replica = compiled.take()
                    positions[r] = 0
                pairs.append((row.grammar, instance[positions[r]]))
                positions[r] += 1
            t0 = time.perf_counter()
            manager.consume(pairs)
            consumes.append(time.perf_counter() - t0)
            assert not any(row.grammar.error for row in rows), [row.grammar.error for row in rows if row.grammar.error]
        per_row = statistics.median(fills) / batch * 1e6
        out["fill"][batch] = {"fill_ms": statistics.median(fills) * 1e3, "fill_us_per_row": per_row,
                              "consume_ms": statistics.median(consumes) * 1e3}
        print(f"{batch:4d} rows: fill {_ms(fills)} per step = {per_row:.1f} us/row; consume {_ms(consumes)}")
    return out


def mask_kernel(device: str, vocab: int, batches: list[int]) -> None:
    if device == "cuda":
        from pie.kernels.triton_bitmask import apply_token_bitmask_
    else:
        from pie.kernels.reference import apply_token_bitmask_
    for batch in batches:
        logits = torch.randn(batch, vocab, device=device)
        mask = torch.randint(-2**31, 2**31 - 1, (batch, -(-vocab // 32)), dtype=torch.int32).pin_memory() \
            if device == "cuda" else torch.randint(-2**31, 2**31 - 1, (batch, -(-vocab // 32)), dtype=torch.int32)
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        times = []
        for _ in range(20):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            apply_token_bitmask_(logits, mask.to(device, non_blocking=True), rows)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"apply the masks of {batch} rows x {vocab} (copy included) on {device}: {_ms(times[5:])}")


def steps_side(args, tokenizer_json: str) -> dict:
    shape = dict(TINY, vocab_size=args.vocab) if args.tiny else dict(LLAMA_4B, vocab_size=args.vocab)
    folder = Path(tempfile.mkdtemp(prefix="structured-bench-"))
    build_model(folder, shape, torch.bfloat16 if args.device == "cuda" else torch.float32, made_by="pie")
    (folder / "tokenizer.json").write_text(tokenizer_json)
    out = {}
    for batch in args.batches:
        engine = EngineCore(EngineConfig(model=str(folder), device=args.device, max_num_seqs=batch,
                                         max_num_batched_tokens=max(2048, batch * 64),
                                         dtype="bf16" if args.device == "cuda" else "fp32"))
        times = {}
        for label, structured in (("free", None),
                                  ("json_schema", StructuredOutputParams("json_schema", json.dumps(LONG_SCHEMA)))):
            engine.block_manager.reset_prefix_cache()
            rng = random.Random(0)
            total = args.warmup + args.steps * args.windows + 8
            for i in range(batch):
                prompt = [rng.randrange(3, 2000) for _ in range(32)]
                engine.add_request(f"{label}-{i}", prompt, SamplingParams(max_tokens=total, temperature=1.0, seed=i,
                                                                          ignore_eos=True, structured=structured))
            for _ in range(args.warmup):  # admission, prefill, compiling, the first decodes
                engine.step()
            windows, rows_per_step = [], []
            for _ in range(args.windows):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                n_out = 0
                for _ in range(args.steps):
                    n_out += len(engine.step())
                if args.device == "cuda":
                    torch.cuda.synchronize()
                windows.append((time.perf_counter() - t0) / args.steps)
                # Every row decodes every step (LONG_SCHEMA cannot be complete this early): the two
                # runs compare steps of the same rows, which the rows-per-step figure shows.
                rows_per_step.append(n_out / args.steps)
                assert n_out >= batch * (args.steps - 1), f"rows ended early ({n_out} outputs in {args.steps} steps)"
            engine.abort_all()
            while engine.has_unfinished():
                engine.step()
            times[label] = statistics.median(windows)
            times[label + "_rows"] = statistics.median(rows_per_step)
        overhead = times["json_schema"] / times["free"] - 1
        out[batch] = {"free_ms": times["free"] * 1e3, "json_schema_ms": times["json_schema"] * 1e3,
                      "overhead": overhead, "free_rows_per_step": times["free_rows"],
                      "json_schema_rows_per_step": times["json_schema_rows"]}
        print(f"{batch:4d} rows decoding: {times['free'] * 1e3:.3f} ms/step free, "
              f"{times['json_schema'] * 1e3:.3f} ms/step with masks (+{overhead * 100:.1f}%); rows per step "
              f"{times['free_rows']:.1f} / {times['json_schema_rows']:.1f}")
        engine.close()
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model (hidden 256, 4 layers), 8 and 16 rows")
    ap.add_argument("--host-only", action="store_true", help="only the host side (compile, fill, consume)")
    ap.add_argument("--device", default=None, help=DEVICE_HELP)
    ap.add_argument("--tokenizer", default=None,
                    help="folder with a real tokenizer.json to use (default: the synthetic 151,643-token one)")
    ap.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="logits' width (the model's vocabulary)")
    ap.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=None,
                    help="rows per step, comma-separated (default: 64,256; 8,16 with --tiny)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timed window")
    ap.add_argument("--windows", type=int, default=5, help="timed windows (the median is reported)")
    ap.add_argument("--warmup", type=int, default=6, help="steps before timing (admission, prefill, compile)")
    ap.add_argument("--threads", type=int, default=None,
                    help="llguidance's threads for filling masks (default: the engine's: usable cores, at most 8)")
    ap.add_argument("--replicas", type=int, default=None,
                    help="host side: independent matchers of the schema (default: the engine's, one per thread)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here (default: print only)")
    args = ap.parse_args(argv)
    args.device = args.device or default_device()
    args.batches = args.batches or ([8, 16] if args.tiny else [64, 256])
    if not (args.tiny or args.host_only) and args.device != "cuda":
        ap.exit(2, f"{ap.prog}: the step benchmark needs a CUDA GPU (none visible); --host-only or --tiny run here\n")
    tokenizer_json = (Path(args.tokenizer, "tokenizer.json").read_text() if args.tokenizer
                      else synthetic_tokenizer_json())
    print(f"device {args.device}; torch {torch.__version__}; vocabulary {args.vocab} columns")
    results = {"host": host_side(tokenizer_json, args.vocab, args.batches, 50, args.threads, args.replicas)}
    mask_kernel(args.device, args.vocab, args.batches)
    if not args.host_only:
        results["steps"] = steps_side(args, tokenizer_json)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
