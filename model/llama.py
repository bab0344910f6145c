"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on token-packed inputs.

No batch dimension: a step's tokens from all sequences are concatenated into (T,), each with its
position; the attention backend knows the sequence boundaries (see model/attention.py). Parameter
names follow transformers' without the `model.` prefix, except two fused projections:
`self_attn.qkv_proj` (q, k, v rows stacked) and `mlp.gate_up_proj` (gate, up rows stacked).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import AttentionBackend, BatchedCausalAttention
from .config import ModelConfig
from .layers import FusedOps, Linear, Matmul, RMSNorm, SelfAttention, SwiGLUMLP
from .lora import LoraStep
from .parallel import TensorParallel, local_config, vocab, vocab_per_rank
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(cfg, tp)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual blocks, with each residual add done by the norm that follows it:
        (h, residual) -> (mlp output, residual stream before it), all (T, hidden); the stream is
        residual + h (h alone in the first layer). rope: RotaryEmbedding.lookup."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, rope, attn)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # LoRA slots of the step's rows, when a bank is attached (model/lora.py LoraBank.attach)
    lora_step: LoraStep | None = None

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        """`cfg` is the whole model's config. With `tp`, this is one rank's share of it
        (model/parallel.py): `config` is then the rank's local config (its heads and intermediate
        width), `full_config` the whole model's."""
        super().__init__()
        self.full_config = cfg
        self.tp = tp
        if tp is not None:
            cfg = local_config(cfg, tp)
        self.config = cfg
        # Softmax scale an attention backend must use (backends are built with it).
        self.attn_scale = cfg.attn_scale
        # With tp, this rank's vocabulary rows (model/parallel.py); the last rank's tail is zeros.
        self.vocab = range(cfg.vocab_size) if tp is None else vocab(self.full_config, tp)
        rows = cfg.vocab_size if tp is None else vocab_per_rank(self.full_config, tp.size)
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids (T,) int64, positions (T,) int64 -> final-normed hidden states (T, hidden)."""
        if self.lora_step is not None and not torch.is_grad_enabled():
            self.lora_step.begin(input_ids.shape[0])
        h = self.embed(input_ids)  # (T, hidden)
        rope = self.rotary.lookup(positions, h.dtype)  # once for all layers
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, attn)
        return self.norm(h, residual)[0]

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run the layers' elementwise ops through `ops` (None: the torch ops again). Only for
        inference: while autograd records, the torch ops run regardless."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, SwiGLUMLP, SelfAttention)):
                m.fused = ops

    def use_batch_invariant(self, matmul: Matmul | None) -> None:
        """Run every projection, the lm_head's included, through `matmul`, and every norm row by row
        through the fused ops (`use_fused_ops` first), so that no token's result depends on the rows
        beside it (None: F.linear and the usual norms again). Only for inference: while autograd
        records, the torch ops run regardless."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.matmul = matmul
            elif isinstance(m, RMSNorm):
                m.per_row = matmul is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> (T, hidden). With tp, each rank embeds the ids in its vocabulary rows,
        zeros for the rest, and the all-reduce sums the one rank's row per token."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        h = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) fp32. With tp, a collective: every rank
        calls it on the same rows and gets the whole logits."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_columns(logits, self.full_config.vocab_size)
        return logits.float()

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training forward: input_ids (B, L) -> logits (B, L, vocab_size) in the compute dtype.

        The same modules as `forward`, on the (B * L,) flattening with positions 0..L-1 per row and
        a batched causal SDPA backend, so trained weights serve exactly as they were trained.
        """
        b, n = input_ids.shape
        positions = torch.arange(n, device=input_ids.device).repeat(b)  # (B*L,)
        attn = BatchedCausalAttention(b, n, self.attn_scale)
        hidden = self.forward(input_ids.reshape(b * n), positions, attn)  # (B*L, hidden)
        return self.lm_head(hidden).view(b, n, -1)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """GPT-2 style initialisation for training from scratch: every linear and the embedding
        ~ N(0, std), the projections that write into the residual stream (o_proj, down_proj) with
        std / sqrt(2 * layers) so the residual's variance does not grow with depth; biases 0, norms 1.
        """
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                s = residual_std if name.endswith(("o_proj", "down_proj")) else std
                if module.weight is not self.embed_tokens.weight:  # tied lm_head: set once, below
                    module.weight.normal_(0.0, s, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        self.embed_tokens.weight.normal_(0.0, std, generator=generator)
