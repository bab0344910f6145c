"""gRPC service: servicer, validation, error mapping, health, reflection and the `pie` CLI.
Knows nothing of blocks, tensors or CUDA."""
