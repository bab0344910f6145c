"""INT8 KV-cache fidelity on the bundled trained model (CPU, torch reference attention path).

    python benchmarks/bundled_fidelity.py [--eval-stories 200] [--prompts 50] [--tokens 128]

1. Held-out perplexity with the fp32, bf16 and int8 caches. Each story is prefilled through the
   paged cache; K/V are written to their pages and read back before attention, so every attention
   read sees the cache's precision (int8 included), as decode does.
2. Greedy agreement of the int8 cache with the fp32 cache over `--tokens` generated tokens on
   `--prompts` prompts (first sentences of held-out stories): position-wise agreement, whole
   continuations identical, mean common prefix.
Held-out stories are the corpus generator's eval stream of the bundled model's run (seed 0 ->
stream 1), which training never saw.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import make_parser  # noqa: E402
from pie.engine.config import DEFAULT_MODEL, EngineConfig  # noqa: E402
from pie.engine.core.engine_core import EngineCore  # noqa: E402
from pie.engine.runner.attention import AttentionMetadata, PagedAttention  # noqa: E402
from pie.engine.runner.kv_cache import KVCache  # noqa: E402
from pie.engine.sampling_params import SamplingParams  # noqa: E402
from pie.model.loader import load_model  # noqa: E402
from pie.model.tokenizer import Tokenizer  # noqa: E402
from pie.training.corpus import generate_stories  # noqa: E402

BLOCK = 16


@torch.inference_mode()
def perplexity(model, cfg, docs: list[list[int]], kv: str) -> float:
    nll, count = 0.0, 0
    for ids in docs:
        n = len(ids)
        blocks = math.ceil(n / BLOCK)
        cache = KVCache(num_layers=cfg.num_hidden_layers, num_blocks=blocks, block_size=BLOCK,
                        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, kv_cache_dtype=kv,
                        device=torch.device("cpu"))
        attn = PagedAttention(cache, cfg.attn_scale, "torch")
        attn.metadata = AttentionMetadata(
            slot_mapping=torch.arange(n), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            max_query_len=n, max_seq_len=n)
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(n), attn))
        nll += F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        count += n - 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--model", default=None,
                    help="Hugging Face-layout model folder (default: the bundled story model)")
    ap.add_argument("--eval-stories", type=int, default=200, help="held-out stories for the perplexity")
    ap.add_argument("--prompts", type=int, default=50, help="prompts for the greedy agreement")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    args = ap.parse_args(argv)
    args.model = args.model or DEFAULT_MODEL
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, cfg = load_model(args.model, device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_pretrained(args.model, cfg)
    stories = list(generate_stories(max(args.eval_stories, args.prompts), 1))
    eos = tok.eos_token_ids[0]
    docs = [tok.encode(s)[: cfg.max_model_len - 1] + [eos] for s in stories[: args.eval_stories]]
    print(f"model {args.model}: {sum(len(d) for d in docs)} held-out tokens in {len(docs)} stories")
    ppl = {kv: perplexity(model, cfg, docs, kv) for kv in ("fp32", "bf16", "int8")}
    print("| cache | held-out perplexity | vs fp32 |")
    print("|---|---|---|")
    for kv, p in ppl.items():
        print(f"| {kv} | {p:.5f} | {100 * (p / ppl['fp32'] - 1):+.3f}% |")

    prompts = [tok.encode(s.split(". ")[0] + ".") for s in stories[: args.prompts]]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    outs = {}
    for kv in ("fp32", "int8"):
        eng = EngineCore(EngineConfig(model=args.model, device="cpu", kv_cache_dtype=kv, num_kv_blocks=1024,
                                     max_num_seqs=64))
        outs[kv] = eng.generate(prompts, sp)
    same = sum(a == b for x, y in zip(outs["fp32"], outs["int8"]) for a, b in zip(x, y))
    whole = sum(x == y for x, y in zip(outs["fp32"], outs["int8"]))
    prefix = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                 for x, y in zip(outs["fp32"], outs["int8"])) / len(prompts)
    total = args.tokens * len(prompts)
    print(f"\ngreedy int8 vs fp32 cache, {len(prompts)} prompts x {args.tokens} tokens: position-wise agreement "
          f"{same}/{total} = {100 * same / total:.1f}%, identical continuations {whole}/{len(prompts)}, "
          f"mean common prefix {prefix:.1f} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
