"""Start-up checks of a model folder, in the words an operator can act on.

Reading config.json and the tokenizer fails with a StartupError that names the `--model` path and
what to do (a missing folder, a file instead of a folder, unreadable or malformed JSON, an
unsupported architecture), instead of a FileNotFoundError or KeyError from deep inside. Then:

- a tokenizer with ids past the model's embedding is refused: such an id would index past
  `embed_tokens` (and the sampler never produces it, so the text could not round-trip);
- `model_notes` lists what is worth one log line at start: no end-of-sequence id anywhere
  (generation then stops only at max_tokens), a model vocabulary much larger than the tokenizer's
  (likely another model's tokenizer), no chat template (prompts reach the model as sent; chat
  requests are refused), a chat template that does not compile (chat requests are refused).

`pie serve` runs these before it binds (service/startup.py) and logs the notes once; the engine
reads the folder through the same functions, so an engine built directly fails the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pie.model.chat_template import ChatTemplates, NoChatTemplate, read_templates
from pie.model.config import ModelConfig
from pie.model.tokenizer import Tokenizer

from .errors import StartupError

FOLDER_HINT = "give a Hugging Face-layout folder holding config.json, *.safetensors and tokenizer.json"

# A model's embedding is often padded past its tokenizer (to a multiple of 64 or 128 rows for fast
# matmuls; Qwen2's 151,936 rows for 151,665 ids): ids nothing produces. Beyond this many spare
# rows, and beyond a tenth of the tokenizer, the tokenizer is more likely another model's.
SPARE_ROWS_EXPECTED = 1024


@dataclass(frozen=True, slots=True)
class ModelNote:
    """One line worth logging once at start about a model folder."""

    level: str  # "warning" or "info"
    event: str  # the log line's event name
    fields: dict[str, Any] = field(default_factory=dict)  # its other fields (a `hint` says what it means)


def read_model_config(path: str) -> ModelConfig:
    """`path`/config.json as a ModelConfig; StartupError naming the path and the fix otherwise."""
    folder = Path(path)
    if not folder.exists():
        raise StartupError(f"--model {path}: no such folder; {FOLDER_HINT}")
    if not folder.is_dir():
        raise StartupError(f"--model {path} is a file; {FOLDER_HINT} (the folder, not a file in it)")
    file = folder / "config.json"
    if not file.is_file():
        raise StartupError(f"--model {path}: the folder has no config.json; {FOLDER_HINT}")
    try:
        raw = json.loads(file.read_text())
    except OSError as e:
        raise StartupError(f"--model {path}: cannot read config.json ({e.strerror or e}); check its permissions") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StartupError(f"--model {path}: config.json is not valid JSON ({e}); restore it from the model's "
                           "source") from e
    if not isinstance(raw, dict):
        raise StartupError(f"--model {path}: config.json holds {type(raw).__name__}, not a JSON object")
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as e:
        raise StartupError(f"--model {path}: config.json has no {e.args[0]!r}; it is not a decoder's "
                           "config (pie serves Llama, Mistral, Qwen2 and Qwen3)") from e
    except (ValueError, TypeError) as e:
        raise StartupError(f"--model {path}: config.json: {e}") from e


def check_weights_present(path: str) -> None:
    """The folder holds model.safetensors or a sharded checkpoint's index (the tensors themselves
    are checked against the config when they are loaded)."""
    folder = Path(path)
    if not (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").is_file():
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pth"))
        found = f" (found {', '.join(others[:3])}: only safetensors are read)" if others else ""
        raise StartupError(f"--model {path}: no model.safetensors or model.safetensors.index.json{found}; "
                           f"{FOLDER_HINT}")


def read_tokenizer(path: str, model_config: ModelConfig) -> Tokenizer:
    """The folder's tokenizer; StartupError naming the path and the fix when it cannot be read."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise StartupError(f"--model {path}: no tokenizer.json (only fast-tokenizer folders are served; "
                           "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(DIR) writes one)")
    try:
        return Tokenizer.from_pretrained(path, model_config)
    except OSError as e:
        raise StartupError(f"--model {path}: cannot read the tokenizer ({e.strerror or e})") from e
    except Exception as e:  # tokenizers raises plain Exception for a malformed tokenizer.json
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StartupError(f"--model {path}: tokenizer.json cannot be loaded ({first}); restore it from the "
                           "model's source") from e


def check_vocab(path: str, model_config: ModelConfig, tokenizer: Tokenizer) -> None:
    """Refuses a tokenizer with ids past the model's embedding rows."""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise StartupError(
            f"--model {path}: the tokenizer has {tokenizer.vocab_size} ids (tokenizer.json, added tokens included) "
            f"but the model's embedding only {model_config.vocab_size} rows (config.json vocab_size): ids past "
            "them would index out of the embedding; use the tokenizer that came with the model")


def has_chat_template(path: str) -> bool:
    """The folder has a chat template: tokenizer_config.json's `chat_template`, a
    chat_template.jinja (or named ones in chat_templates/), or a chat_template.json."""
    try:
        return bool(read_templates(Path(path)))
    except (OSError, ValueError):
        return False


def check_chat_template(path: str, override: str) -> None:
    """`pie serve --chat-template FILE`: the file is readable and compiles."""
    file = Path(override)
    if not file.is_file():
        raise StartupError(f"--chat-template {override}: {'is a folder' if file.is_dir() else 'no such file'}; "
                           "give a Jinja chat template file")
    try:
        ChatTemplates.load(path, override)
    except NoChatTemplate as e:
        raise StartupError(f"--chat-template {override}: {str(e).removeprefix(override + ' ')}") from e
    except (OSError, ValueError) as e:
        raise StartupError(f"--chat-template {override}: cannot read it ({e}); give a UTF-8 Jinja template "
                           "file") from e


def model_notes(path: str, model_config: ModelConfig, tokenizer: Tokenizer,
                chat_template: str | None = None) -> list[ModelNote]:
    """What to log once at start about the folder (see the module docstring); `chat_template`:
    the template file that replaces the folder's (nothing is said about the folder's then)."""
    notes = []
    if not tokenizer.eos_token_ids:
        notes.append(ModelNote("warning", "model_has_no_eos", {
            "hint": "no eos_token_id in generation_config.json or config.json and no eos_token in "
                    "tokenizer_config.json: generation stops only at max_tokens (or a request's stop "
                    "strings and stop_token_ids); add the model's eos_token_id to generation_config.json"}))
    spare = model_config.vocab_size - tokenizer.vocab_size
    if spare > max(SPARE_ROWS_EXPECTED, tokenizer.vocab_size // 10):
        notes.append(ModelNote("warning", "model_vocab_exceeds_tokenizer", {
            "model_vocab_size": model_config.vocab_size, "tokenizer_vocab_size": tokenizer.vocab_size,
            "hint": f"{spare} embedding rows no token id reaches: is tokenizer.json this model's? (sampled ids "
                    "past the tokenizer decode to nothing)"}))
    if chat_template is not None:
        return notes
    if not has_chat_template(path):
        notes.append(ModelNote("info", "model_has_no_chat_template", {
            "hint": "no chat_template in tokenizer_config.json and no chat_template.jinja: likely a base model; "
                    "prompts reach it as sent, and chat requests are refused (or give --chat-template FILE)"}))
    else:
        try:
            ChatTemplates.load(path)
        except (NoChatTemplate, OSError, ValueError) as e:
            notes.append(ModelNote("warning", "model_chat_template_unusable", {
                "error": str(e), "hint": "chat requests are refused with FAILED_PRECONDITION; give a working "
                                         "template with --chat-template FILE"}))
    return notes
