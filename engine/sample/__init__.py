"""Choosing tokens from logits: the batched sampler, structured output's grammars and masks, and
the rejection sampling that verifies speculative proposals."""
