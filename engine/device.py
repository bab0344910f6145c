"""Which device and which dtype an engine runs on."""

from __future__ import annotations

import torch

from pie.model.config import ModelConfig

from .config import MODEL_DTYPES
from .errors import StartupError

# Model dtype names (EngineConfig.dtype, --dtype) and the torch dtypes they stand for.
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert set(TORCH_DTYPES) == set(MODEL_DTYPES) - {"auto"}


def cpu_has_native_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), as read from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def auto_dtype(device: torch.device, model_config: ModelConfig) -> str:
    """`--dtype auto`: bf16 on CUDA. On the CPU, a checkpoint stored in bf16 runs in bf16 where the
    CPU computes bf16 natively (AVX512-BF16, AMX: faster than fp32 there); otherwise fp32, which
    plain AVX2 computes faster than emulated bf16."""
    if device.type == "cuda":
        return "bf16"
    stored = (model_config.dtype or "").replace("torch.", "")
    return "bf16" if stored in ("bfloat16", "bf16") and cpu_has_native_bf16() else "fp32"


def resolve_device(name: str) -> torch.device:
    """The torch device of `--device NAME`; StartupError when it names a GPU this process cannot use."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no usable GPU or driver"
        raise StartupError(f"--device {name}: CUDA is not available here ({build}, torch {torch.__version__}); "
                           "use --device cpu (or auto), or run where a GPU and a CUDA build of torch are")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise StartupError(f"--device {name}: this process sees {torch.cuda.device_count()} GPU(s), "
                           f"cuda:0..cuda:{torch.cuda.device_count() - 1}; pick one of them (CUDA_VISIBLE_DEVICES "
                           "decides which are seen)")
    return device


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's copy on `device`, queued on the current stream without the host waiting for
    it: pinned first on CUDA, then copied asynchronously (the caching host allocator keeps the
    pinned block until the copy is done). A copy from pageable memory (`torch.tensor(..., device=
    "cuda")`, `.to("cuda")` or indexing a CUDA tensor with a list) synchronizes the stream: under
    async scheduling it waits for the step queued before it, and the GPU idles while the host
    prepares the next one. On the CPU: `host` itself."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
