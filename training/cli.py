"""`pie train`: corpus -> tokenizer -> training -> (optional) export, in one command.

    pie train --generate-corpus 20000 --out runs/stories --export models/stories   # fully offline
    pie train --data roneneldan/TinyStories --out runs/ts --max-steps 5000 --export models/ts
    pie train --data runs/stories/corpus --out runs/stories --resume               # continue

The run folder keeps tokenizer.json, the token streams (tokens/train.npy, tokens/eval.npy), the
checkpoint, metrics.jsonl and loss.png; a rerun with --resume reuses the tokenizer and the streams.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from training.train import TrainConfig  # light: no datasets/transformers import

    p = subparsers.add_parser("train", help="train a small Llama on stories and export it",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", nargs="+", help="local .txt/.jsonl/.parquet files, folders or globs, or a hub "
                     "dataset id (e.g. roneneldan/TinyStories)")
    src.add_argument("--generate-corpus", type=int, metavar="N",
                     help="generate N stories offline (training.corpus) into OUT/corpus and train on them")
    p.add_argument("--eval-data", nargs="+", help="held-out files (default: the hub's validation split, "
                   "the generated corpus' eval file, or --eval-fraction of the documents)")
    p.add_argument("--eval-fraction", type=float, default=0.01, help="documents held out without --eval-data")
    p.add_argument("--text-field", default="text", help="text column of .jsonl/.parquet/hub data")
    p.add_argument("--txt-mode", choices=("separator", "line"), default="separator",
                   help="a .txt document is a block between blank-line pairs, or one line")
    p.add_argument("--max-docs", type=int, default=None, help="use at most this many training documents")
    p.add_argument("--tokenizer", default=None, help="existing tokenizer.json (default: train one into OUT)")
    p.add_argument("--tokenizer-docs", type=int, default=200_000, help="documents to train the tokenizer on")
    p.add_argument("--out", default="runs/pie", help="run folder")
    p.add_argument("--export", default=None, metavar="DIR", help="write the HF-layout model folder here")
    p.add_argument("--export-dtype", choices=tuple(_DTYPES), default="bf16")
    d = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("out_dir", "resume"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = float if isinstance(default, float) else int if isinstance(default, int) else str
            if f.name == "lr_decay_steps":
                kind = int
            p.add_argument(flag, type=kind, default=default, dest=f.name)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    return p


def _datasets(args, out: Path):
    """(train dataset, eval dataset or None)."""
    from training.data import load_text_dataset, local_files

    common = {"text_field": args.text_field, "txt_mode": args.txt_mode}
    if args.generate_corpus is not None:
        from training.corpus import write_corpus

        corpus_dir = out / "corpus"
        paths = write_corpus(corpus_dir, num_stories=args.generate_corpus, seed=args.seed)
        train_ds = load_text_dataset([str(x) for x in paths["train"]], **common)
        eval_ds = load_text_dataset(str(paths["eval"]), **common)
        return train_ds, eval_ds
    source = args.data if len(args.data) > 1 else args.data[0]
    train_ds = load_text_dataset(source, split="train", **common)
    if args.eval_data:
        return train_ds, load_text_dataset(args.eval_data, **common)
    if local_files(source) is None:  # a hub dataset: use its validation split when it has one
        try:
            return train_ds, load_text_dataset(source, split="validation", **common)
        except ValueError:
            pass
    return train_ds, None


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import tokenizers
    import torch

    from training.data import HubUnreachableError, TokenSplits, iter_texts, prepare_tokens
    from training.export import export_hf
    from training.tokenizer import EOS_ID, train_bpe_tokenizer
    from training.train import TrainConfig, train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok_path = out / "tokenizer.json"
    tokens_dir = out / "tokens"
    try:
        if args.resume and (tokens_dir / "train.npy").is_file() and tok_path.is_file():
            tok = tokenizers.Tokenizer.from_file(str(tok_path))
            splits = TokenSplits(train=np.load(tokens_dir / "train.npy", mmap_mode="r"),
                                 eval=np.load(tokens_dir / "eval.npy", mmap_mode="r"))
        else:
            train_ds, eval_ds = _datasets(args, out)
            if args.max_docs is not None:
                train_ds = train_ds.select(range(min(args.max_docs, len(train_ds))))
            if args.tokenizer:
                tok = tokenizers.Tokenizer.from_file(args.tokenizer)
                tok.save(str(tok_path))
            elif args.resume and tok_path.is_file():
                tok = tokenizers.Tokenizer.from_file(str(tok_path))
            else:
                print(f"training a {args.vocab_size}-token BPE on {min(args.tokenizer_docs, len(train_ds))} "
                      "documents", file=sys.stderr)
                tok = train_bpe_tokenizer(iter_texts(train_ds, args.text_field, args.tokenizer_docs),
                                          args.vocab_size, tok_path)
            splits = prepare_tokens(train_ds, tok, eos_id=EOS_ID, eval_ds=eval_ds, text_field=args.text_field,
                                    eval_fraction=args.eval_fraction, seed=args.seed, save_dir=tokens_dir)
    except (HubUnreachableError, FileNotFoundError) as e:
        print(f"pie train: {e}", file=sys.stderr)
        return 2

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if f.name not in ("out_dir", "resume", "vocab_size")}
    vocab = -(-tok.get_vocab_size() // 64) * 64  # embedding rows rounded up to a multiple of 64
    try:
        cfg = TrainConfig(**fields, vocab_size=vocab, out_dir=str(out), resume=args.resume)
    except ValueError as e:
        print(f"pie train: {e}", file=sys.stderr)
        return 2
    result = train(cfg, splits)
    print(f"step {result['step']}: train loss {result['train_loss']:.4f}, eval loss {result['eval_loss']:.4f} "
          f"(ppl {result['eval_ppl']:.2f}), {result['tokens_per_s']:,.0f} tok/s; run folder {out}",
          file=sys.stderr)
    if args.export:
        dtype = getattr(torch, _DTYPES[args.export_dtype])
        path = export_hf(result["model"], cfg, tok_path, args.export, dtype=dtype)
        print(f"exported to {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m training.cli train ...`) until service/cli.py wires `pie train`."""
    parser = argparse.ArgumentParser(prog="pie")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
