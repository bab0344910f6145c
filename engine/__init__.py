"""Continuous-batching engine over a paged KV cache. Speaks no protobuf or gRPC."""
