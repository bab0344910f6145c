"""Builders of tiny Hugging Face-layout model folders for tests across the tree.

`make_hf_model_dir(tmp_path, "llama")` writes what a real checkpoint folder holds: config.json,
model.safetensors (or shards), generation_config.json, tokenizer.json and tokenizer_config.json. The
weights come from transformers' own model classes (so transformers can serve as the oracle), with
a fresh random seed per call, printed (pytest shows it with a failure) and kept in the folder name.
Importing this module is cheap; transformers is imported on the first call.
"""

from __future__ import annotations

import functools
import json
import os
import random
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the tiny tokenizer's specials: <pad>, <s>, </s>

# Small enough to build in ~0.1 s; head_dim 16, GQA with 2 query heads per kv head.
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)

_WORDS = (
    "the a small large red blue green cat dog bird tree river mountain city house road story model "
    "token cache block layer head query key value runs sleeps reads writes jumps flies sings quickly "
    "slowly today yesterday because and but or with under over near far old new bright dark"
).split()
_UNICODE_WORDS = ("café", "naïve", "über", "garçon", "日本", "東京", "こんにちは", "Привет", "😀", "🚀", "👍🏽")


def sample_sentences(n: int = 400, seed: int = 0) -> list[str]:
    """n short sentences of ASCII words with some multi-byte UTF-8 (accents, CJK, emoji)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), rng.choice(_UNICODE_WORDS))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?"))
    return out


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int, extra_special_tokens: tuple[str, ...] = ()) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # ids 0, 1, 2, then the extra special tokens in order (a chat template's markers)
        special_tokens=["<pad>", "<s>", "</s>", *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(sample_sentences(), trainer=trainer)
    assert (tok.token_to_id("<pad>"), tok.token_to_id("<s>"), tok.token_to_id("</s>")) == (PAD_ID, BOS_ID, EOS_ID)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return tok.to_str()


def write_tokenizer(path: Path, vocab_size: int = 512, *, extra_special_tokens: tuple[str, ...] = (),
                    tokenizer_config: dict[str, Any] | None = None) -> Path:
    """Writes tokenizer.json (byte-level BPE with <pad>/<s>/</s> = 0/1/2 and then
    `extra_special_tokens` as ids 3, 4, ...; BOS added by the post-processor; at most vocab_size
    ids) and tokenizer_config.json (updated with `tokenizer_config`, e.g. a chat_template) into
    `path`; returns path."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_trained_tokenizer_json(vocab_size, tuple(extra_special_tokens)))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        **(tokenizer_config or {}),
    }, indent=2))
    return path


def _config_class(arch: str):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    return classes[arch]


def add_massive_k_channels(model, scale: float, pairs: list[int]) -> None:
    """Gives K a few massive channels, as real checkpoints have, without changing the function:
    K channels c and c + D/2 (a RoPE pair, so the rotation commutes with the scaling) of every kv
    head are multiplied by `scale`, and the same channels of every query head divided by it, so
    q . k is unchanged and transformers' output stays the oracle. Where a per-head q/k norm
    (Qwen3) would undo a projection's scaling, the norms' weights of those channels are scaled
    instead. `pairs`: the channels c, each < D/2."""
    import torch

    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    chans = [c + off for c in pairs for off in (0, d // 2)]
    assert all(0 <= c < d // 2 for c in pairs), f"pair channels must be < D/2 = {d // 2}: {pairs}"
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "k_norm"):
                attn.k_norm.weight[chans] *= scale
                attn.q_norm.weight[chans] /= scale
                continue
            for proj, factor, heads in ((attn.k_proj, scale, cfg.num_key_value_heads),
                                        (attn.q_proj, 1.0 / scale, cfg.num_attention_heads)):
                rows = [h * d + c for h in range(heads) for c in chans]
                proj.weight[rows] *= factor
                if proj.bias is not None:
                    proj.bias[rows] *= factor


def make_hf_model_dir(tmp_path: Path, arch: str, *, seed: int | None = None, weight_scale: float = 1.0,
                      max_shard_size: str | None = None, generation_eos: int | list[int] | None = None,
                      massive_k: tuple[float, list[int]] | None = None,
                      extra_special_tokens: tuple[str, ...] = (), tokenizer_config: dict[str, Any] | None = None,
                      **overrides: Any) -> Path:
    """A tiny random `arch` model folder under tmp_path, loadable by transformers and by model/.

    arch: "llama" | "mistral" | "qwen2" | "qwen3". overrides: config fields over TINY_CONFIG (e.g.
    tie_word_embeddings=True, rope_scaling={...}, attention_bias=True). seed: weights' seed (fresh
    and printed when None). weight_scale: multiplies every projection and embedding weight after
    transformers' init (std 0.02), for sharper attention and output distributions. Norm weights and
    biases are also randomized (transformers initializes them to 1 and 0), so that a swapped norm or
    a dropped bias shows. max_shard_size (e.g. "20KB") forces a sharded checkpoint.
    generation_eos: eos_token_id written to generation_config.json (default: the config's).
    massive_k: (scale, pair channels): see `add_massive_k_channels`.
    extra_special_tokens, tokenizer_config: see `write_tokenizer` (tests/chat_templates.py uses
    them for chat models).
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # save/load bars would flood test output
    if seed is None:
        seed = secrets.randbelow(2**31)
    print(f"make_hf_model_dir: arch={arch} seed={seed} weight_scale={weight_scale} massive_k={massive_k} "
          f"overrides={overrides}")
    cfg_kwargs = {**TINY_CONFIG, "dtype": "float32", **overrides}
    config = _config_class(arch)(**cfg_kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * weight_scale * torch.randn_like(p))
            else:
                p.mul_(weight_scale)
    if massive_k is not None:
        add_massive_k_channels(model, *massive_k)

    path = Path(tempfile.mkdtemp(dir=tmp_path, prefix=f"{arch}-seed{seed}-"))
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    eos = cfg_kwargs.get("eos_token_id") if generation_eos is None else generation_eos
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg_kwargs.get("bos_token_id"), "eos_token_id": eos,
         "pad_token_id": cfg_kwargs.get("pad_token_id")}, indent=2))
    write_tokenizer(path, vocab_size=min(cfg_kwargs["vocab_size"], 512), extra_special_tokens=extra_special_tokens,
                    tokenizer_config=tokenizer_config)
    return path


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    """Polls a condition (never a blind sleep) until it holds, returning its value, or fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# ---- engine_setup hooks for servers whose engine runs in a child process -------------------------
# (module-level, so the spawned engine process can unpickle them)

def _after_steps(engine, n: int, action) -> None:
    """Wraps the engine's runner: steps after the first n call action() before running."""
    original = engine.runner.launch
    count = [0]

    def launch(out):
        count[0] += 1
        if count[0] > n:
            action()
        return original(out)

    engine.runner.launch = launch


def _raise(error: str) -> None:
    raise RuntimeError(error)


def fail_steps_after(engine, n: int, error: str) -> None:
    """Steps after the first n raise RuntimeError(error) (an engine fault inside the child)."""
    _after_steps(engine, n, lambda: _raise(error))


def exit_process_after(engine, n: int) -> None:
    """The engine process dies abruptly (os._exit) in the step after the first n."""
    import os

    _after_steps(engine, n, lambda: os._exit(7))


def hang_steps_after(engine, n: int, seconds: float) -> None:
    """Steps after the first n sleep `seconds` (a hung step, for the watchdog)."""
    import time as _time

    _after_steps(engine, n, lambda: _time.sleep(seconds))


def slow_steps(engine, seconds: float) -> None:
    """Every step sleeps `seconds` first (long generations, for deadlines and cancels)."""
    _after_steps(engine, 0, lambda: time.sleep(seconds))


class StepGate:
    """engine_setup for an engine on a thread (not a process): while held, each step waits for a
    permit the test hands out, so the test decides what exists when, without sleeping."""

    def __init__(self) -> None:
        self._permits: threading.Semaphore | None = None
        self._given = self._taken = 0  # permits handed out and used since hold()

    def __call__(self, engine) -> None:
        _after_steps(engine, 0, self._wait)

    def _wait(self) -> None:
        permits = self._permits
        if permits is not None:
            assert permits.acquire(timeout=60), "a held step got no permit within 60 s"
            self._taken += 1

    def step_when_idle(self) -> None:
        """One more permit, unless the last one is still unused: a polling loop that calls this lets
        the engine take one step at a time, never a run of steps on permits piled up while it was
        idle."""
        if self._permits is not None and self._taken >= self._given:
            self._given += 1
            self._permits.release(1)

    def hold(self) -> None:
        """From now on every step waits for `allow`."""
        self._permits = threading.Semaphore(0)
        self._given = self._taken = 0

    def allow(self, steps: int = 1) -> None:
        assert self._permits is not None, "hold() first"
        self._given += steps
        self._permits.release(steps)

    def release(self) -> None:
        """Steps run freely again (also any step waiting now)."""
        permits, self._permits = self._permits, None
        if permits is not None:
            permits.release(1_000_000)


def stall_start(engine, marker: str, seconds: float) -> None:
    """Used as engine_setup: the engine is built but its start stalls, as a slow load would:
    writes the file `marker` (the stalled process's pid), then sleeps `seconds`."""
    tmp = Path(f"{marker}.tmp")
    tmp.write_text(str(os.getpid()))
    tmp.rename(marker)  # atomic: a reader never sees it half written
    time.sleep(seconds)


def help_problems(parser) -> list[str]:
    """What is wrong with the --help of `parser` and of its subcommands: a flag without a
    description, or whose rendered help shows its default other than exactly once (positional
    arguments without a default are exempt from the default rule). Empty when all is well.

    A flag's help is rendered as --help renders it (the parser's formatter, so defaults that an
    ArgumentDefaultsHelpFormatter appends count); "(default: None)" is a problem of its own: say in
    words what no value means."""
    import argparse

    problems: list[str] = []
    seen: set[int] = set()

    def visit(p: argparse.ArgumentParser) -> None:
        if id(p) in seen:
            return
        seen.add(id(p))
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in dict.fromkeys(action.choices.values()):
                    visit(sub)
                continue
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            name = f"{p.prog}: {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help == argparse.SUPPRESS:
                problems.append(f"{name}: no description")
                continue
            text = " ".join(p._get_formatter()._expand_help(action).split())
            positional = not action.option_strings and action.nargs not in ("?", "*")
            shown = text.count("(default: ")
            if "(default: None)" in text:
                problems.append(f"{name}: says '(default: None)' instead of what no value means: {text!r}")
            elif not positional and shown != 1:
                problems.append(f"{name}: default shown {shown} times: {text!r}")

    visit(parser)
    return problems


ROOT = Path(__file__).resolve().parents[1]


def copy_tracked_files(dst: Path) -> None:
    """The checkout's tracked files into dst, as a fresh clone has them: symbolic links stay links
    (clients/pie's links to the package folders). Outside a git checkout, everything but build output."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        names = [n for n in files.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".git", "node_modules", "runs", "__pycache__", ".pytest_cache"}
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if (p.is_file() or p.is_symlink()) and not skip & set(p.parts)]
    for name in names:
        src, out = ROOT / name, dst / name
        if not (src.is_symlink() or src.is_file()):
            continue  # deleted in the working tree, not yet in the index
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)


def save_peft_adapter(base_dir: Path, out: Path, *, seed: int, scale: float, **lora_config: Any) -> Path:
    """A LoRA adapter of the transformers model in `base_dir` as peft writes it, into `out`: A and B
    random (init_lora_weights=False: both non-zero, nn.Linear's init), multiplied by `scale` so its
    delta is of the base projections' size. lora_config: peft.LoraConfig's fields (r, lora_alpha,
    target_modules, use_rslora, ...)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    model.save_pretrained(out)
    return out
