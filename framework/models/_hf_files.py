"""The tokenizer files of a ``model.pretrained`` folder, carried to the model so that its exports
(``save_pretrained``, ``model_16bit/``) load with ``AutoTokenizer`` / ``pipeline`` as the source folder did."""
from __future__ import annotations

from pathlib import Path

from torch import nn

# What transformers' tokenizers save (fast and slow, BPE, WordPiece, SentencePiece) and chat templates: each one
# the source folder holds is carried; nothing else of it is (weights and config.json are written anew).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
_ATTRIBUTE = "framework_tokenizer_files"   # on the model: not its config, which config.json would write


def carry_tokenizer_files(model: nn.Module, folder: Path) -> None:
    """Read ``folder``'s ``TOKENIZER_FILES`` into ``model`` (their bytes, at build: an export into the folder it
    was loaded from, or a source changed since, still writes what the model started from)."""
    found = {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}
    if found:
        setattr(model, _ATTRIBUTE, found)


def tokenizer_files(model: nn.Module) -> dict[str, bytes]:
    """{file name: bytes} that ``carry_tokenizer_files`` gave ``model``; {} for any other model."""
    return dict(getattr(model, _ATTRIBUTE, None) or {})
