"""Generated protobuf and gRPC code for the pie contract (see protos/ and clients/codegen.py)."""
