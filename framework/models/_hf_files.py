"""The tokenizer files of a ``model.pretrained`` folder, carried to the model so that its exports
(``save_pretrained``, ``model_16bit/``) load with ``AutoTokenizer`` / ``pipeline`` as the source folder did; and its
generation_config.json, read onto the model."""
from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from framework.comm.distributed import rank_and_world
from framework.core import files
from framework.core.errors import ConfigError, one_line, say

# What transformers' tokenizers save (fast and slow, BPE, WordPiece, SentencePiece) and chat templates: each one
# the source folder holds is carried; nothing else of it is (weights and config.json are written anew).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
_ATTRIBUTE = "framework_tokenizer_files"   # on the model: not its config, which config.json would write
_RECORD = ".framework_tokenizer_files.json"   # in a folder saved into: {name: sha256} of the tokenizer files written


def carry_tokenizer_files(model: nn.Module, folder: Path) -> None:
    """Read ``folder``'s ``TOKENIZER_FILES`` into ``model`` (their bytes, at build: an export into the folder it
    was loaded from, or a source changed since, still writes what the model started from)."""
    found = {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}
    if found:
        setattr(model, _ATTRIBUTE, found)


def tokenizer_files(model: nn.Module) -> dict[str, bytes]:
    """{file name: bytes} that ``carry_tokenizer_files`` gave ``model``; {} for any other model."""
    return dict(getattr(model, _ATTRIBUTE, None) or {})


def write_tokenizer_files(folder: Path, carried: Mapping[str, bytes]) -> None:
    """``carried`` (``tokenizer_files``) into ``folder``, with a record of what was written. The tokenizer files an
    earlier save there recorded that this model does not carry are removed (its exports would load another model's
    tokenizer), unless changed since: a file the user wrote or edited there stays, as every other file."""
    record = folder / _RECORD
    files.refuse_links(record, *(folder / n for n in carried))
    try:
        earlier = files.parse_json(record.read_bytes())
    except (OSError, ValueError):   # none (a folder no save wrote tokenizer files into), or not ours to read
        earlier = {}
    for name, data in carried.items():
        files.write_atomic(folder / name, data, shared=True)
    for name, digest in earlier.items() if isinstance(earlier, dict) else ():
        path = folder / name   # (only the names it carries: a record naming anything else is ignored)
        if name in TOKENIZER_FILES and name not in carried and not files.is_link(path) and path.is_file() \
                and hashlib.sha256(path.read_bytes()).hexdigest() == digest:
            path.unlink()
    if carried:
        written = {name: hashlib.sha256(data).hexdigest() for name, data in carried.items()}
        files.write_atomic(record, json.dumps(written, indent=1).encode(), shared=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            record.unlink()


def read_generation_config(model: nn.Module, folder: Path) -> None:
    """``folder``'s generation_config.json onto ``model``. One that cannot be read (not JSON, not UTF-8: an OSError
    from transformers) is skipped with a warning, as transformers' from_pretrained skips it (silently); one it
    refuses otherwise (a ValueError, or nested too deeply to parse) is a ConfigError."""
    import transformers

    file = folder / "generation_config.json"
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    except OSError as e:
        if rank_and_world()[0] == 0:   # (every rank builds the model: said once)
            say(f"warning: model.pretrained: {file} is skipped: {one_line(e)} (transformers' from_pretrained skips it "
                f"too); fix it to use its generation settings, or remove it")
    except (ValueError, RecursionError) as e:
        why = "nested too deeply to parse" if isinstance(e, RecursionError) else one_line(e)
        raise ConfigError(f"model.pretrained: {file} is not a valid generation config ({why}); fix or remove "
                          f"it") from None
