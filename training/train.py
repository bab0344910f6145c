"""The training loop: AdamW, warmup + cosine, grad accumulation and clipping, bf16 autocast on the
GPU, periodic eval, checkpoints with exact resume, metrics.jsonl and a loss-curve PNG.

Run folder (`out_dir`):
    checkpoint.pt   model + optimizer + step + RNG states + config (written atomically)
    metrics.jsonl   one JSON object per logged step ({"step", "loss", "lr", ...}) or eval
    loss.png        train loss (blue) and eval loss (red) against step
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.nn.functional as F

from pie.model.config import ModelConfig
from pie.model.llama import LlamaForCausalLM

from .data import TokenSplits
from .plot import plot_curves
from .tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass(slots=True)
class TrainConfig:
    # --- model (a Llama-family decoder; defaults: ~7.6M params, the bundled story model) ---
    vocab_size: int = 4096  # embedding rows; >= the tokenizer's vocabulary (rounded up to 64 for matmul speed)
    hidden_size: int = 256  # residual width
    num_layers: int = 8
    num_heads: int = 8  # query heads; head_dim = hidden_size // num_heads
    num_kv_heads: int = 4  # grouped-query attention: halves the (int8) KV cache the server keeps
    intermediate_size: int = 768  # SwiGLU width, 3x hidden (~8/3 x hidden rounded, as Llama)
    max_seq_len: int = 512  # max_position_embeddings written to config.json; >= seq_len
    tie_embeddings: bool = True  # lm_head shares embed_tokens: a quarter of the params at this size
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # --- optimisation ---
    batch_size: int = 32  # sequences per micro-batch
    seq_len: int = 256  # tokens per training sequence (TinyStories stories are ~200 tokens)
    grad_accum: int = 1  # micro-batches per optimizer step: tokens/step = batch * seq_len * accum
    lr: float = 1e-3  # peak learning rate (small models tolerate a high one)
    min_lr: float = 1e-4  # floor of the cosine decay (lr / 10, per Chinchilla)
    warmup_steps: int = 100  # linear warmup from ~0: Adam's second moments are noise at first
    max_steps: int = 2000  # optimizer steps to run (a resumed run stops here too)
    lr_decay_steps: int | None = None  # cosine reaches min_lr here (None: max_steps)
    weight_decay: float = 0.1  # applied to >= 2-D params only (matrices, embeddings), not norms/biases
    beta1: float = 0.9
    beta2: float = 0.95  # shorter memory than 0.999: steadier for small-batch LM training
    grad_clip: float = 1.0  # max global grad norm (0 = no clipping)
    # --- bookkeeping ---
    eval_every: int = 200  # steps between eval passes (0 = only at the start and the end)
    eval_steps: int = 20  # batches per eval pass (fixed batches: comparable across evals)
    # steps between checkpoints (0 = only at the end; None = a tenth of max_steps, so that a run that
    # is killed keeps most of its work; Ctrl-C and SIGTERM save one anyway)
    save_every: int | None = None
    log_every: int = 10  # steps between metrics.jsonl rows / progress updates
    seed: int = 0  # model init, batch order
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # autocast compute dtype: auto = bf16 on cuda, fp32 on cpu; or bf16 / fp32
    compile: bool = False  # torch.compile the training forward (worth it on the GPU)
    out_dir: str = "runs/pie"  # run folder (checkpoint, metrics, plot)
    resume: bool = False  # continue from out_dir/checkpoint.pt when it exists
    progress: bool = True  # progress lines on stderr (one line rewritten in place on a terminal)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_seq_len", "batch_size", "seq_len", "grad_accum", "max_steps",
                     "eval_steps", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every", "weight_decay", "grad_clip", "min_lr"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into {self.num_heads} heads of even size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.vocab_size <= max(PAD_ID, BOS_ID, EOS_ID):
            raise ValueError(f"vocab_size {self.vocab_size} cannot hold the special tokens")
        if self.seq_len > self.max_seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_seq_len {self.max_seq_len}")
        if not 0 < self.lr or self.min_lr > self.lr:
            raise ValueError(f"need 0 < min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= 0:
            raise ValueError(f"lr_decay_steps must be positive, got {self.lr_decay_steps}")

    def model_config(self) -> ModelConfig:
        """The decoder these fields describe, as the server's ModelConfig (a plain Llama)."""
        return ModelConfig(
            model_type="llama", architecture="LlamaForCausalLM", vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=None,
            max_position_embeddings=self.max_seq_len, tie_word_embeddings=self.tie_embeddings,
            attention_bias=False, o_proj_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None,
            dtype="float32", bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))

    @property
    def save_interval(self) -> int:
        """Steps between checkpoints: save_every, or a tenth of max_steps when it is None (0: only at the end)."""
        return self.save_every if self.save_every is not None else max(1, self.max_steps // 10)

    def evals_left(self, step: int) -> int:
        """Eval passes still to run once optimizer step `step` is done (its own included): those at
        multiples of eval_every and the one at max_steps."""
        if not self.eval_every:
            return 1
        at_multiples = self.max_steps // self.eval_every - (step - 1) // self.eval_every
        return at_multiples + (self.max_steps % self.eval_every != 0)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay = self.lr_decay_steps or self.max_steps
        if step >= decay:
            return self.min_lr
        progress = (step - self.warmup_steps) / max(1, decay - self.warmup_steps)
        return self.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)


_MODEL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_seq_len", "tie_embeddings", "rope_theta", "rms_norm_eps")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_model(cfg: TrainConfig, device: torch.device) -> LlamaForCausalLM:
    """A freshly initialised fp32 model (seeded by cfg.seed) on `device`, in train mode."""
    model = LlamaForCausalLM(cfg.model_config())
    model.init_weights(generator=torch.Generator().manual_seed(cfg.seed))
    return model.to(device).train()


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decay on matrices and embeddings only (norm gains and biases are not decayed)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()  # tied weights once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the stream: inputs (B, L) and next-token targets (B, L), int64 on device."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"token stream of {len(tokens)} tokens is too short for seq_len {seq_len}")
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator).numpy()
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (B, L+1)
    window = torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))
    if device.type == "cuda":
        window = window.pin_memory().to(device, non_blocking=True)
    return window[:, :-1], window[:, 1:]


def _loss(forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = forward(x)  # (B, L, V)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(forward, model: torch.nn.Module, tokens: np.ndarray, cfg: TrainConfig, device: torch.device,
             autocast, on_batch: Callable[[int], bool] | None = None) -> float | None:
    """Mean loss over cfg.eval_steps batches drawn with a fixed seed: the same batches every time.
    `on_batch(i)` is called after batch i (1-based); when it returns False the pass stops and the
    result is None (the run is being interrupted)."""
    model.eval()
    g = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    try:
        for i in range(1, cfg.eval_steps + 1):
            x, y = get_batch(tokens, cfg.batch_size, min(cfg.seq_len, len(tokens) - 2), g, device)
            with autocast():
                losses.append(_loss(forward, x, y).item())
            if on_batch is not None and not on_batch(i):
                return None
    finally:
        model.train()
    return sum(losses) / len(losses)


def format_duration(seconds: float) -> str:
    """A progress line's time left: 42s, 3m05s, 2h07m (? when unknown)."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class _Progress:
    """Progress on stderr: step/max, loss, tokens/s, lr and the time left to max_steps. On a terminal
    one line is rewritten in place (carriage return); elsewhere (a log file, CI) every update is a
    line of its own."""

    def __init__(self, enabled: bool, total: int, stream: TextIO | None = None) -> None:
        self.enabled, self.total = enabled, total
        self.stream = sys.stderr if stream is None else stream
        self.in_place = self.stream.isatty()
        self.open_len = 0  # length of the line being rewritten in place (0: none)

    def update(self, step: int, loss: float, tok_s: float, lr: float, eta_s: float) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        line = (f"[{bar}] {step}/{self.total} loss {loss:.4f} {tok_s:,.0f} tok/s lr {lr:.2e} "
                f"eta {format_duration(eta_s)}")
        if self.in_place:
            self.stream.write("\r" + line.ljust(self.open_len))
            self.open_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def begin(self, text: str) -> None:
        """A phase without optimizer steps starts (an eval pass, a checkpoint): on a terminal it
        takes the line in place (tick() updates it, note() replaces it); elsewhere a line of its own."""
        if not self.enabled:
            return
        if self.in_place:
            self.stream.write("\r" + text.ljust(self.open_len))
            self.open_len = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def tick(self, text: str) -> None:
        """Updates begin()'s line on a terminal; elsewhere nothing (a log gets begin's line and the result)."""
        if self.enabled and self.in_place:
            self.begin(text)

    def note(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\r" + text.ljust(self.open_len) if self.open_len else text) + "\n")
            self.open_len = 0
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.open_len:
            self.stream.write("\n")
            self.open_len = 0
            self.stream.flush()


def _synced_clock(device: torch.device) -> float:
    """time.perf_counter() once the queued device work is done (it belongs to the steps before)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _save_checkpoint(path: Path, model, optimizer, step: int, batch_gen: torch.Generator, cfg: TrainConfig) -> None:
    state = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
        "config": dataclasses.asdict(cfg), "batch_generator": batch_gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a torn checkpoint


def _plot(out: Path, metrics_file: Path) -> Path:
    train_pts, eval_pts = [], []
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            train_pts.append((row["step"], row["loss"]))
        if "eval_loss" in row:
            eval_pts.append((row["step"], row["eval_loss"]))
    path = out / "loss.png"
    plot_curves(path, [train_pts, eval_pts])
    return path


def train(cfg: TrainConfig, data: TokenSplits, model: LlamaForCausalLM | None = None,
          stop: threading.Event | None = None) -> dict[str, Any]:
    """Trains (or, with cfg.resume and a checkpoint in cfg.out_dir, continues) until cfg.max_steps,
    or until `stop` is set (Ctrl-C, SIGTERM: the CLI sets it): then the step under way finishes, an
    eval pass under way is dropped, and a checkpoint of the last step is saved.

    Returns {"model" (fp32, eval mode), "step", "train_loss", "eval_loss", "eval_ppl", "tokens_per_s",
    "checkpoint", "metrics", "plot", "params", "interrupted" (stop was set before max_steps)}.
    """
    device = resolve_device(cfg.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, metrics_path = out / "checkpoint.pt", out / "metrics.jsonl"
    torch.manual_seed(cfg.seed)
    model = model.to(device).train() if model is not None else build_model(cfg, device)
    optimizer = make_optimizer(model, cfg, device)
    batch_gen = torch.Generator().manual_seed(cfg.seed)
    step = 0
    if cfg.resume and ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        saved = state["config"]
        diff = [f for f in _MODEL_FIELDS if saved.get(f) != getattr(cfg, f)]
        if diff:
            raise ValueError(f"checkpoint {ckpt_path} was trained with different model fields: "
                             + ", ".join(f"{f}={saved.get(f)!r} (now {getattr(cfg, f)!r})" for f in diff))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batch_gen.set_state(state["batch_generator"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        step = int(state["step"])
    elif metrics_path.exists():
        metrics_path.unlink()  # a fresh run starts a fresh log

    compute_dtype = torch.bfloat16 if (cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")) \
        else torch.float32

    def autocast():
        return torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32)

    forward = torch.compile(model.forward_train) if cfg.compile else model.forward_train
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    progress = _Progress(cfg.progress, cfg.max_steps)
    progress.note(f"model: {n_params / 1e6:.2f}M params on {device} ({compute_dtype}); "
                  f"{len(data.train):,} train / {len(data.eval):,} eval tokens; starting at step {step}")
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    result: dict[str, Any] = {"train_loss": float("nan"), "eval_loss": float("nan"), "tokens_per_s": 0.0}
    eval_seconds: list[float] = []  # each eval pass's wall time, for the time left
    saved_at = step if ckpt_path.is_file() and cfg.resume else -1  # the step the checkpoint on disk holds

    def stopping() -> bool:
        return stop is not None and stop.is_set()

    with open(metrics_path, "a") as metrics:
        def log(row: dict[str, Any]) -> None:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

        def run_eval() -> None:
            t0 = _synced_clock(device)
            progress.begin(f"step {step}: evaluating on {cfg.eval_steps} batches")

            def on_batch(i: int) -> bool:
                progress.tick(f"step {step}: evaluating, batch {i}/{cfg.eval_steps}")
                return not stopping()

            loss = evaluate(forward, model, data.eval, cfg, device, autocast, on_batch=on_batch)
            if loss is None:
                progress.note(f"step {step}: eval pass dropped (stopping)")
                return
            eval_seconds.append(time.perf_counter() - t0)
            result["eval_loss"] = loss
            log({"step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))})
            progress.note(f"step {step}: eval loss {loss:.4f} ppl {math.exp(min(loss, 50.0)):.2f}")

        def save(why: str) -> None:
            nonlocal saved_at
            progress.begin(f"step {step}: saving the checkpoint ({why})")
            _save_checkpoint(ckpt_path, model, optimizer, step, batch_gen, cfg)
            saved_at = step
            progress.note(f"step {step}: checkpoint saved to {ckpt_path}")

        if step == 0:
            run_eval()
        # tokens/s counts training time alone (eval passes and checkpoints are `paused`); the time
        # left is this run's mean training time per step for the steps left, plus the mean eval
        # pass for the passes left (the final one included: at max_steps/max_steps it is what is left)
        t_start, start_step = time.perf_counter(), step
        t_last, steps_since, paused, paused_total = t_start, 0, 0.0, 0.0
        while step < cfg.max_steps and not stopping():
            lr = cfg.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for _ in range(cfg.grad_accum):
                x, y = get_batch(data.train, cfg.batch_size, cfg.seq_len, batch_gen, device)
                with autocast():
                    loss = _loss(forward, x, y)
                (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            steps_since += 1
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                train_loss = loss_sum.item() / cfg.grad_accum  # the only host sync of a step
                now = time.perf_counter()
                tok_s = steps_since * tokens_per_step / max(now - t_last - paused, 1e-9)
                t_last, steps_since, paused = now, 0, 0.0
                result["train_loss"], result["tokens_per_s"] = train_loss, tok_s
                log({"step": step, "loss": train_loss, "lr": lr, "grad_norm": float(grad_norm),
                     "tokens_per_s": tok_s, "elapsed_s": now - t_start})
                per_step = (now - t_start - paused_total) / (step - start_step)
                mean_eval = sum(eval_seconds) / len(eval_seconds) if eval_seconds else 0.0
                eta_s = per_step * (cfg.max_steps - step) + mean_eval * cfg.evals_left(step)
                progress.update(step, train_loss, tok_s, lr, eta_s)
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
                t0 = _synced_clock(device)
                run_eval()
                paused += time.perf_counter() - t0
                paused_total += time.perf_counter() - t0
            if (cfg.save_interval and step % cfg.save_interval == 0) or step == cfg.max_steps:
                t0 = _synced_clock(device)
                save("the last step" if step == cfg.max_steps else f"every {cfg.save_interval} steps")
                paused += time.perf_counter() - t0
                paused_total += time.perf_counter() - t0
        interrupted = step < cfg.max_steps
        if interrupted:
            if step > saved_at and step > 0:
                save("stopping")
            else:
                progress.note(f"stopping at step {step}: " + ("the checkpoint holds it already" if step
                                                               else "nothing trained, nothing saved"))
    progress.close()
    plot = _plot(out, metrics_path)
    return {**result, "model": model.eval(), "step": step, "eval_ppl": math.exp(min(result["eval_loss"], 50.0)),
            "checkpoint": ckpt_path, "metrics": metrics_path, "plot": plot, "params": n_params,
            "interrupted": interrupted}
