"""One step on the device: staging the inputs, the forward pass (CUDA graphs, paged attention over
the KV pool), sampling, and the copy back to the host; the KV pool's sizing and tensor
parallelism's workers."""
