"""What one step's results cost to cross from the engine process to its client: the typed messages
(engine/messages.py, msgspec Structs as MessagePack) against the two forms they were weighed
against, plain tuples pickled and rebuilt (what the engine sent before) and slotted dataclasses
pickled as they are. A step of --rows decode outputs (one token and a word of text each; with
--logprobs, that many top entries per token); the sending side encodes, the receiving side
decodes into objects the service reads. Medians over --repeats rounds of --number calls.

    python benchmarks/wire.py [--rows 256] [--logprobs 0]
"""

from __future__ import annotations

import dataclasses
import pickle
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import make_parser  # noqa: E402
from pie.engine.messages import (  # noqa: E402
    EngineStats,
    RequestOutput,
    RequestStatus,  # noqa: E402
    SampledToken,
    StepResult,
    decode_result,
    encode,
)


@dataclasses.dataclass(slots=True)
class _Token:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass(slots=True)
class _Output:  # RequestOutput's fields as a slotted dataclass
    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[_Token]
    finished: bool
    status: RequestStatus
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None
    out_of_memory: bool
    queue_time_s: float | None
    num_cached_tokens: int
    index: int
    all_finished: bool


def _fields(i: int, logprobs: int) -> tuple:
    top = [(j, -0.5 * j) for j in range(logprobs)]
    return (f"r{i}", [i % 32000], " word", [(i % 32000, -1.5, top)] if logprobs else [], False, RequestStatus.RUNNING,
            None, 300, i % 200, None, False, None, 0, 0, False)


def _struct(f: tuple) -> RequestOutput:
    lp = [SampledToken(*t) for t in f[3]]
    return RequestOutput(f[0], f[1], f[2], lp, *f[4:])


def _time(fn, number: int, repeats: int) -> float:
    rounds = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - t) / number)
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--rows", type=int, default=256, help="outputs in the step (decoding streams)")
    ap.add_argument("--logprobs", type=int, default=0, help="top logprobs per token (0: none)")
    ap.add_argument("--number", type=int, default=200, help="calls per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the median is reported")
    args = ap.parse_args(argv)
    fields = [_fields(i, args.logprobs) for i in range(args.rows)]
    stats = EngineStats(4096, 2048, args.rows, 0)

    result = StepResult([_struct(f) for f in fields], stats, 100, args.rows)
    data = encode(result)
    typed = (_time(lambda: encode(result), args.number, args.repeats),
             _time(lambda: decode_result(data), args.number, args.repeats), len(data))

    tuples = [(f[0], f[1], f[2], f[3] or None, *f[4:]) for f in fields]
    blob = pickle.dumps(("out", tuples, stats, 100, args.rows), protocol=pickle.HIGHEST_PROTOCOL)

    def untuple():
        _, wire, *_ = pickle.loads(blob)
        return [RequestOutput(t[0], t[1], t[2], [SampledToken(*x) for x in t[3]] if t[3] else [], *t[4:])
                for t in wire]

    plain = (_time(lambda: pickle.dumps(("out", tuples, stats, 100, args.rows), protocol=pickle.HIGHEST_PROTOCOL),
                   args.number, args.repeats), _time(untuple, args.number, args.repeats), len(blob))

    objs = [_Output(f[0], f[1], f[2], [_Token(*t) for t in f[3]], *f[4:]) for f in fields]
    dblob = pickle.dumps(objs, protocol=pickle.HIGHEST_PROTOCOL)
    dc = (_time(lambda: pickle.dumps(objs, protocol=pickle.HIGHEST_PROTOCOL), args.number, args.repeats),
          _time(lambda: pickle.loads(dblob), args.number, args.repeats), len(dblob))

    print(f"one step of {args.rows} outputs, {args.logprobs} top logprobs each (median of {args.repeats} x {args.number})")
    print("| form | send (encode) us | receive (decode to objects) us | bytes |")
    print("|---|---|---|---|")
    for name, (enc, dec, size) in (("msgspec Structs, MessagePack (now)", typed),
                                   ("tuples, pickled, rebuilt (before)", plain),
                                   ("slotted dataclasses, pickled", dc)):
        print(f"| {name} | {1e6 * enc:.0f} | {1e6 * dec:.0f} | {size:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
