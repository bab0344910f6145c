"""What splitting the embedding and LM head by vocabulary saves each tensor-parallel rank (issue 19).

    python3 benchmarks/tp_vocab.py [--sizes 2,4,8] [--rows 1,64,256]

pie's ranks each hold 1/N of the embedding and LM head rows (model/parallel.py), as vLLM's do.
For real model shapes (bf16 weights), this prints:
1. per rank: the bytes of its weights (a model built on the meta device with each size's
   TensorParallel: the loader's shapes, not arithmetic), and the bytes the embedding and LM head
   would take replicated, which the vocabulary split saves;
2. on a CUDA GPU: the LM head's time for a decode step of R rows, whole (replicated) against a
   1/N vocabulary slice (before gathering the logits), and the step's weight-read time on this GPU
   (the rank's bytes at the measured copy bandwidth), the floor a decode step of that rank cannot
   beat.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "clients")]  # benchmarks.*, and this checkout's pie
from benchmarks.common import make_parser  # noqa: E402
from pie.model.config import ModelConfig  # noqa: E402
from pie.model.llama import LlamaForCausalLM  # noqa: E402
from pie.model.parallel import TensorParallel  # noqa: E402

SHAPES = {  # the published configs' shapes (random weights; nothing is downloaded)
    "Llama-3.2-1B": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "Qwen3-4B": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                     tie_word_embeddings=True),
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "Llama-3.1-70B": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                          tie_word_embeddings=False),
}
GIB = 2**30


def rank_bytes(cfg: ModelConfig, size: int) -> tuple[int, int]:
    """(weight bytes of rank 0 of `size`, bytes its embedding and LM head would add replicated), bf16."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, TensorParallel(0, size) if size > 1 else None)
    params = {id(p): p for p in model.parameters()}  # a tied head counted once
    total = sum(p.numel() for p in params.values()) * 2
    heads = 1 if cfg.tie_word_embeddings else 2
    replicated = heads * cfg.vocab_size * cfg.hidden_size * 2
    held = heads * model.embed_tokens.weight.numel() * 2
    return total, replicated - held


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    import triton

    return 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def lm_head_ms(rows: int, hidden: int, vocab: int) -> float:
    import triton

    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16, device="cuda")
    return triton.testing.do_bench(lambda: torch.nn.functional.linear(x, w), return_mode="median")


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--sizes", default="2,4,8", help="tensor-parallel sizes, comma-separated")
    ap.add_argument("--rows", default="1,64,256", help="decode rows (batch sizes) to time the LM head at")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    gpu = torch.cuda.is_available()
    bandwidth = copy_bandwidth() if gpu else None
    if bandwidth:
        print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    head = "| model | N | rank weights GiB | replicated embedding + LM head would add GiB |"
    if gpu:
        head += " weight read ms | " + " | ".join(f"LM head ms R={r}: whole / 1/N" for r in rows) + " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, shape in SHAPES.items():
        cfg = ModelConfig.from_hf(dict(architectures=["X"], max_position_embeddings=4096, **shape))
        for size in [1, *sizes]:
            if cfg.num_attention_heads % size or cfg.intermediate_size % size:
                continue
            total, saved = rank_bytes(cfg, size)
            line = f"| {name} | {size} | {total / GIB:.2f} | {saved / GIB:.2f} (+{saved / total:.0%}) |"
            if gpu and bandwidth:
                line += f" {total / bandwidth * 1e3:.2f} |"
                for r in rows:
                    whole = lm_head_ms(r, cfg.hidden_size, cfg.vocab_size)
                    part = lm_head_ms(r, cfg.hidden_size, -(-cfg.vocab_size // size)) if size > 1 else whole
                    line += f" {whole:.3f} / {part:.3f} |"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
