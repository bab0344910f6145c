"""`pie train`: corpus -> tokenizer -> training -> (optional) export, in one command.

    pie train --generate-corpus 20000 --out runs/stories --export models/stories   # fully offline
    pie train --data roneneldan/TinyStories --out runs/ts --max-steps 5000 --export models/ts
    pie train --data runs/stories/corpus --out runs/stories --resume               # continue

The run folder keeps tokenizer.json, the token streams (tokens/train.npy, tokens/eval.npy), the
checkpoint, metrics.jsonl and loss.png; a rerun with --resume reuses the tokenizer and the streams.
Local .txt/.jsonl data and --generate-corpus need only a plain install; a hub dataset id (or .parquet)
needs the `train` extra, and says so. service/cli.py puts this parser under `pie`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .documents import TXT_MODES, HubUnreachableError, MissingExtraError

if TYPE_CHECKING:
    from .documents import Documents
    from .train import TrainConfig

_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}

# One line per TrainConfig field that becomes a flag (its default is appended by the formatter).
_FIELD_HELP = {
    "vocab_size": "BPE vocabulary to train; the model's embedding gets the tokenizer's real size rounded up to 64",
    "hidden_size": "residual width",
    "num_layers": "decoder layers",
    "num_heads": "query heads (head size = --hidden-size / --num-heads, which must be even)",
    "num_kv_heads": "key/value heads (grouped-query attention; must divide --num-heads)",
    "intermediate_size": "SwiGLU MLP width",
    "max_seq_len": "context length written to config.json (at least --seq-len)",
    "tie_embeddings": "share the input embedding with the output head",
    "rope_theta": "RoPE base",
    "rms_norm_eps": "RMSNorm epsilon",
    "batch_size": "sequences per micro-batch",
    "seq_len": "tokens per training sequence",
    "grad_accum": "micro-batches per optimizer step (tokens per step = batch size x seq len x this)",
    "lr": "peak learning rate, reached at the end of the warm-up",
    "min_lr": "floor the cosine decay ends at",
    "warmup_steps": "optimizer steps of linear warm-up to --lr (keep it well below --max-steps)",
    "max_steps": "optimizer steps to run in all (a resumed run stops here too)",
    "lr_decay_steps": "step at which the cosine decay reaches --min-lr (default: --max-steps)",
    "weight_decay": "AdamW weight decay, on matrices and embeddings only",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "largest global gradient norm (0 = no clipping)",
    "eval_every": "optimizer steps between eval passes (0 = only at the start and the end)",
    "eval_steps": "batches per eval pass",
    "save_every": "optimizer steps between checkpoints; 0 = only at the end (default: a tenth of --max-steps; "
                  "Ctrl-C or SIGTERM saves one too, and exports what the run has)",
    "log_every": "optimizer steps between metrics.jsonl rows and progress lines",
    "seed": "seeds the model init, the batch order, the generated corpus and the held-out documents",
    "device": "auto (cuda when available, else cpu), cpu, cuda or cuda:N",
    "dtype": "compute dtype under autocast (auto: bf16 on cuda, fp32 on the cpu)",
    "compile": "torch.compile the training forward (worth it on a GPU)",
    "progress": "progress lines on stderr: step, loss, tokens/s, learning rate, time left",
}
_FIELD_CHOICES = {"dtype": ("auto", "bf16", "fp32")}


def add_train_parser(subparsers: argparse._SubParsersAction, *,
                     formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter,
                     ) -> argparse.ArgumentParser:
    """Adds `train` to `subparsers`; `formatter_class` renders its --help (pie passes its own, which
    appends each flag's default)."""
    from .lora import DEFAULT_TARGETS
    from .train import TrainConfig  # light: no datasets/transformers import

    p = subparsers.add_parser("train", help="train a small Llama on stories and export it",
                              description="Corpus (generated offline, local files or a hub dataset) -> byte-level "
                                          "BPE -> a small Llama -> (with --export) a Hugging Face-layout folder "
                                          "that pie serve --model loads.",
                              formatter_class=formatter_class)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", nargs="+", help="local .txt/.jsonl/.parquet files, folders or globs, or a hub "
                     "dataset id such as roneneldan/TinyStories (default: none; give this or --generate-corpus)")
    src.add_argument("--generate-corpus", type=int, metavar="N",
                     help="generate N stories offline (training.corpus) into OUT/corpus and train on them "
                          "(default: none; give this or --data)")
    p.add_argument("--eval-data", nargs="+", help="held-out files (default: the hub's validation split, "
                   "the generated corpus' eval file, or --eval-fraction of the documents)")
    p.add_argument("--eval-fraction", type=float, default=0.01,
                   help="share of the documents held out for eval when there is no other eval data")
    p.add_argument("--text-field", default="text", help="text column of .jsonl/.parquet/hub data")
    p.add_argument("--txt-mode", choices=TXT_MODES, default="separator",
                   help="a .txt document is a block between blank-line pairs (separator), or one line")
    p.add_argument("--max-docs", type=int, default=None,
                   help="use at most this many training documents (default: all of them)")
    p.add_argument("--tokenizer", default=None, help="existing tokenizer.json (default: train one into OUT)")
    p.add_argument("--tokenizer-docs", type=int, default=200_000, help="documents to train the tokenizer on")
    p.add_argument("--out", default="runs/pie", help="run folder: tokenizer, token streams, checkpoint, metrics")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write the Hugging Face-layout model folder here (default: no export)")
    p.add_argument("--export-dtype", choices=tuple(_DTYPES), default="bf16", help="dtype of the exported weights")
    d = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("out_dir", "resume"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_FIELD_HELP[f.name])
        else:
            kind = float if isinstance(default, float) else int if isinstance(default, int) else str
            if f.name in ("lr_decay_steps", "save_every"):  # None by default: no type to read off it
                kind = int
            p.add_argument(flag, type=kind, default=default, dest=f.name, choices=_FIELD_CHOICES.get(f.name),
                           help=_FIELD_HELP[f.name])
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    lora = p.add_argument_group("LoRA fine-tuning (--lora BASE): the base model's weights stay frozen; --export "
                                "writes PEFT's adapter folder, which pie serve --lora NAME=DIR loads")
    lora.add_argument("--lora", default=None, metavar="BASE",
                      help="fine-tune a LoRA adapter of this Hugging Face-layout model folder (its tokenizer is "
                           "used; the model flags are its) instead of training a model (default: off)")
    lora.add_argument("--lora-rank", type=int, default=8, metavar="R", help="the adapter's rank")
    lora.add_argument("--lora-alpha", type=float, default=16.0, help="its scaling numerator (lora_alpha)")
    lora.add_argument("--lora-targets", default=",".join(DEFAULT_TARGETS),
                      help="comma-separated modules to adapt, of q_proj, k_proj, v_proj, o_proj, gate_proj, "
                           "up_proj, down_proj")
    lora.add_argument("--lora-rslora", action="store_true", help="rank-stabilised scaling: alpha / sqrt(r)")
    return p


def _documents(args, out: Path) -> tuple[Documents, Documents | None]:
    """(train documents, eval documents or None)."""
    from .documents import load_documents, local_files

    common = {"text_field": args.text_field, "txt_mode": args.txt_mode}
    if args.generate_corpus is not None:
        from .corpus import write_corpus

        corpus_dir = out / "corpus"
        paths = write_corpus(corpus_dir, num_stories=args.generate_corpus, seed=args.seed)
        return load_documents(paths["train"], **common), load_documents(paths["eval"], **common)
    source = args.data if len(args.data) > 1 else args.data[0]
    train_docs = load_documents(source, split="train", **common)
    if args.eval_data:
        return train_docs, load_documents(args.eval_data, **common)
    if local_files(source) is None:  # a hub dataset: use its validation split when it has one
        try:
            return train_docs, load_documents(source, split="validation", **common)
        except ValueError:
            pass
    return train_docs, None


def schedule_warning(cfg: TrainConfig) -> str | None:
    """What is off in the learning-rate schedule, in the flags' words (None when all is well)."""
    if cfg.warmup_steps < cfg.max_steps:
        return None
    return (f"--warmup-steps {cfg.warmup_steps} >= --max-steps {cfg.max_steps}: the learning rate warms up for "
            f"the whole run (it ends at {cfg.lr_at(cfg.max_steps - 1):.3g}, --lr is {cfg.lr:g}) and never "
            f"decays; lower --warmup-steps (e.g. to {max(1, cfg.max_steps // 10)}) or raise --max-steps")


def run(args: argparse.Namespace) -> int:
    """Runs `pie train` as parsed by add_train_parser's parser; the exit status (2: bad input)."""
    import numpy as np
    import tokenizers
    import torch

    from .data import TokenSplits, iter_texts, prepare_tokens
    from .export import export_hf
    from .tokenizer import EOS_ID, train_bpe_tokenizer
    from .train import TrainConfig, train

    out = Path(args.out)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if f.name not in ("out_dir", "resume")}
    try:  # checked before any data is read; vocab_size is set again from the tokenizer below
        cfg = TrainConfig(**fields, out_dir=str(out), resume=args.resume)
    except ValueError as e:
        print(f"pie train: {e}", file=sys.stderr)
        return 2
    warning = schedule_warning(cfg)
    if warning:
        print(f"pie train: warning: {warning}", file=sys.stderr)

    if args.lora:
        base_tokenizer = Path(args.lora) / "tokenizer.json"
        if not base_tokenizer.is_file():
            print(f"pie train: --lora {args.lora}: no tokenizer.json there (a Hugging Face-layout model folder)",
                  file=sys.stderr)
            return 2
        args.tokenizer = str(base_tokenizer)  # the adapter reads the base model's tokens
    out.mkdir(parents=True, exist_ok=True)
    tok_path = out / "tokenizer.json"
    tokens_dir = out / "tokens"
    try:
        if args.resume and (tokens_dir / "train.npy").is_file() and tok_path.is_file():
            tok = tokenizers.Tokenizer.from_file(str(tok_path))
            splits = TokenSplits(train=np.load(tokens_dir / "train.npy", mmap_mode="r"),
                                 eval=np.load(tokens_dir / "eval.npy", mmap_mode="r"))
        else:
            train_docs, eval_docs = _documents(args, out)
            if args.max_docs is not None:
                train_docs = train_docs.select(range(min(args.max_docs, len(train_docs))))
            if args.tokenizer:
                tok = tokenizers.Tokenizer.from_file(args.tokenizer)
                tok.save(str(tok_path))
            elif args.resume and tok_path.is_file():
                tok = tokenizers.Tokenizer.from_file(str(tok_path))
            else:
                print(f"training a {args.vocab_size}-token BPE on {min(args.tokenizer_docs, len(train_docs))} "
                      "documents", file=sys.stderr)
                tok = train_bpe_tokenizer(iter_texts(train_docs, args.tokenizer_docs), args.vocab_size, tok_path)
            splits = prepare_tokens(train_docs, tok, eos_id=EOS_ID, eval_docs=eval_docs,
                                    eval_fraction=args.eval_fraction, seed=args.seed, save_dir=tokens_dir)
    except (HubUnreachableError, MissingExtraError, FileNotFoundError, ValueError) as e:
        print(f"pie train: {e}", file=sys.stderr)
        return 2

    vocab = -(-tok.get_vocab_size() // 64) * 64  # embedding rows rounded up to a multiple of 64
    try:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    except ValueError as e:
        print(f"pie train: {e}", file=sys.stderr)
        return 2
    model, adapter = None, None
    if args.lora:
        try:
            model, adapter = _lora_model(args)
        except (ValueError, OSError) as e:
            print(f"pie train: {e}", file=sys.stderr)
            return 2
    with _stop_on_signals() as stop:
        result = train(cfg, splits, model=model, stop=stop.event)
    if result["interrupted"] and result["step"] == 0:
        print(f"pie train: stopped by {stop.name} before the first step; nothing to save or export", file=sys.stderr)
        return 128 + stop.signum
    print(f"step {result['step']}: train loss {result['train_loss']:.4f}, eval loss {result['eval_loss']:.4f} "
          f"(ppl {result['eval_ppl']:.2f}), {result['tokens_per_s']:,.0f} tok/s; run folder {out}",
          file=sys.stderr)
    if args.export and adapter is not None:
        path = adapter.export(args.export, base=str(args.lora))
        print(f"exported the LoRA adapter (PEFT's format) to {path}", file=sys.stderr)
    elif args.export:
        dtype = getattr(torch, _DTYPES[args.export_dtype])
        print(f"exporting step {result['step']} to {args.export} ({args.export_dtype})", file=sys.stderr)
        path = export_hf(result["model"], cfg, tok_path, args.export, dtype=dtype)
        print(f"exported to {path}", file=sys.stderr)
    if result["interrupted"]:
        print(f"pie train: stopped by {stop.name} at step {result['step']} of {cfg.max_steps}; the run continues "
              f"with: pie train ... --out {out} --resume", file=sys.stderr)
        return 128 + stop.signum
    return 0


def _lora_model(args: argparse.Namespace):
    """The base model of --lora (fp32, frozen) with a trainable adapter attached: (model, LoraTraining)."""
    import torch

    from pie.model.loader import load_model

    from .lora import LoraTraining

    model, _ = load_model(args.lora, dtype=torch.float32)
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    return model, LoraTraining(model, targets, args.lora_rank, args.lora_alpha, rslora=args.lora_rslora,
                               seed=args.seed)


class _StopRequest:
    """The first SIGINT or SIGTERM sets `event` (training stops after its step, saves and exports);
    a second one acts as the signal does by default (SIGINT: KeyboardInterrupt, SIGTERM: exit)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum = 0
        self.name = ""

    def handle(self, signum: int, frame) -> None:
        self.signum, self.name = signum, signal.Signals(signum).name
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        print(f"{chr(10) if sys.stderr.isatty() else ''}pie train: {self.name}: stopping after this step, then "
              "saving a checkpoint (and the export); send it again to quit at once", file=sys.stderr)
        self.event.set()


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[_StopRequest]:
    """SIGINT and SIGTERM become a stop request while training runs (main thread only: signal
    handlers cannot be set elsewhere, and then the signals keep their default)."""
    request = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
