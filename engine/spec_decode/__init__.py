"""Speculative decoding's proposals: the n-gram proposer, the draft model, and the `Speculator` the
scheduler asks how many each decode gets."""
