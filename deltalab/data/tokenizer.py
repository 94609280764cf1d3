"""Tokenizers: a byte-level one built in, any local Hugging Face tokenizer through an adapter.

Both satisfy the `Tokenizer` protocol, the only interface the rest of the data layer uses:
`encode(text) -> list[int]` without special tokens, `decode(ids) -> str` without special tokens,
`vocab_size`, the special ids, and `spec`, the string `load_tokenizer` was given.

`save_tokenizer(tokenizer, path)` writes either kind as Hugging Face tokenizer files, so a model
directory loads with `AutoTokenizer.from_pretrained` and `pipeline("text-generation", ...)`; the
byte tokenizer becomes a `tokenizers` fast tokenizer with the same ids, specials included.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from deltalab.errors import DataError

BYTE_SPEC = "byte"
NUM_BYTES = 256


@runtime_checkable
class Tokenizer(Protocol):
    """What the data layer needs of a tokenizer.

    `eos_id` separates documents in the packed token stream; `bos_id` and `pad_id` are there for
    the model and generation code and are never written into shards.
    """

    @property
    def spec(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then three specials: `<|bos|>` 256, `<|eos|>` 257, `<|pad|>` 258.

    `encode("hé")` -> `[104, 195, 169]`; `decode([104, 257, 195, 169])` -> `"hé"` (specials are
    dropped), or `"h<|eos|>é"` with `render_special=True`. Bytes that are not valid UTF-8, as a
    window cut through a multi-byte character, decode to U+FFFD instead of raising.
    """

    SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")

    @property
    def spec(self) -> str:
        return BYTE_SPEC

    @property
    def vocab_size(self) -> int:
        return NUM_BYTES + len(self.SPECIAL_TOKENS)

    @property
    def bos_id(self) -> int:
        return NUM_BYTES

    @property
    def eos_id(self) -> int:
        return NUM_BYTES + 1

    @property
    def pad_id(self) -> int:
        return NUM_BYTES + 2

    def encode(self, text: str) -> list[int]:
        """`text` -> its UTF-8 bytes as ints; no special token is added."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], *, render_special: bool = False) -> str:
        """Token ids -> text; specials are dropped, or written as `<|eos|>` etc. when asked."""
        pieces: list[str] = []
        run = bytearray()
        for position, token in enumerate(ids):
            token = int(token)
            if 0 <= token < NUM_BYTES:
                run.append(token)
                continue
            if not NUM_BYTES <= token < self.vocab_size:
                raise ValueError(
                    f"ids[{position}] = {token} is not a token id of the byte tokenizer, "
                    f"expected 0 <= id < {self.vocab_size}"
                )
            if render_special:
                # A special cuts the byte run: each run is decoded on its own, as written.
                pieces.append(run.decode("utf-8", errors="replace"))
                pieces.append(self.SPECIAL_TOKENS[token - NUM_BYTES])
                run = bytearray()
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def token_byte_lengths(self) -> torch.Tensor:
        """`[vocab_size]`: 1 for each byte token, 0 for the specials."""
        lengths = torch.zeros(self.vocab_size, dtype=torch.int64)
        lengths[:NUM_BYTES] = 1
        return lengths

    def to_transformers(self) -> Any:
        """The same tokenizer as a `transformers` fast tokenizer (`tokenizers`-backed).

        Byte b is token b and the specials keep their ids 256..258, so `encode(text,
        add_special_tokens=False)` and `decode(ids, skip_special_tokens=True)` give what `encode`
        and `decode` give here, for any text and any ids (cut UTF-8 included: both replace it by
        U+FFFD). No BOS is prepended by default, as training streams carry none.
        """
        import tokenizers

        unicode_of = _gpt2_byte_alphabet()
        # A BPE without merges over the byte alphabet: one token per byte, id = byte value.
        model = tokenizers.models.BPE(vocab={unicode_of[b]: b for b in range(NUM_BYTES)}, merges=[])
        raw = tokenizers.Tokenizer(model)
        # No regex split and no prefix space: the text is mapped byte for byte, nothing added.
        raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False
        )
        raw.decoder = tokenizers.decoders.ByteLevel()
        raw.add_special_tokens(
            [tokenizers.AddedToken(t, special=True, normalized=False) for t in self.SPECIAL_TOKENS]
        )
        return byte_level_fast(raw, self.SPECIAL_TOKENS)

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` (see `to_transformers`) to `path`."""
        self.to_transformers().save_pretrained(path)


def byte_level_fast(raw: Any, specials: tuple[str, str, str]) -> Any:
    """The `tokenizers.Tokenizer` `raw` (byte-level, holding the `specials` BOS, EOS, PAD) as a
    `transformers` fast tokenizer that encodes and decodes text exactly: the text "<|eos|>" in a
    document is its bytes, not the EOS that ends documents, and decoding rewrites no spaces."""
    from transformers import PreTrainedTokenizerFast

    bos, eos, pad = specials
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )


def _gpt2_byte_alphabet() -> dict[int, str]:
    """Byte -> the printable character `tokenizers`' ByteLevel pre-tokenizer stands it for.

    Printable Latin-1 bytes stand for themselves; the other 68 take the code points from 256 up,
    in byte order (the GPT-2 convention, which the Rust pre-tokenizer and decoder hard-code).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(NUM_BYTES):
        if b not in alphabet:
            alphabet[b] = chr(NUM_BYTES + extra)
            extra += 1
    return alphabet


class HuggingFaceTokenizer:
    """A `transformers` tokenizer behind the `Tokenizer` protocol.

    Tokenizers without a BOS or PAD token (GPT-2 has neither) use the EOS id for them, the usual
    convention; a tokenizer without an EOS token is refused, since EOS separates documents.
    """

    def __init__(self, tokenizer: Any, spec: str) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"the tokenizer at {spec!r} has no eos_token_id; one is needed to separate "
                "documents in the token stream"
            )
        self._tokenizer = tokenizer
        self._spec = spec
        self._eos = int(eos)
        bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
        self._bos = self._eos if bos is None else int(bos)
        self._pad = self._eos if pad is None else int(pad)
        self._byte_lengths: torch.Tensor | None = None

    @property
    def spec(self) -> str:
        return self._spec

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens, which `tokenizer.vocab_size` leaves out.
        return len(self._tokenizer)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def pad_id(self) -> int:
        return self._pad

    def token_byte_lengths(self) -> torch.Tensor | None:
        """`[vocab_size]`: the UTF-8 bytes each id stands for (0 for special tokens), when the
        tokenizer is byte-level (its decoder `tokenizers`' ByteLevel: every token a fixed byte
        string, one alphabet character a byte); None for any other tokenizer, whose tokens
        need not be whole bytes."""
        if self._byte_lengths is not None:
            return self._byte_lengths
        import tokenizers

        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None or not isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
            return None
        lengths = torch.zeros(self.vocab_size, dtype=torch.int64)
        added = backend.get_added_tokens_decoder()
        for token, index in backend.get_vocab(with_added_tokens=True).items():
            if index in added:
                special = added[index].special
                lengths[index] = 0 if special else len(added[index].content.encode("utf-8"))
            else:
                lengths[index] = len(token)
        self._byte_lengths = lengths
        return lengths

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Writes the tokenizer's files to `path`, so a checkpoint carries its tokenizer."""
        self._tokenizer.save_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike[str]) -> None:
    """Writes `tokenizer` to `path` as Hugging Face tokenizer files (beside a model's weights).

    Both tokenizers of `load_tokenizer` can; any other must have its own `save_pretrained`.
    """
    save = getattr(tokenizer, "save_pretrained", None)
    if not callable(save):
        raise TypeError(
            f"tokenizer must have a save_pretrained(path) method to be exported, got "
            f"{type(tokenizer).__name__} without one"
        )
    save(path)


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` -> `ByteTokenizer`; otherwise a local directory loaded by `transformers`.

    Nothing is downloaded: the directory must hold the tokenizer files (`tokenizer.json` etc.).
    """
    if not isinstance(spec, str):
        raise TypeError(f"tokenizer spec must be a str, got {type(spec).__name__}")
    if spec == BYTE_SPEC:
        return ByteTokenizer()
    path = Path(spec)
    if not path.exists():
        raise DataError(
            f"tokenizer spec {spec!r} is neither 'byte' nor an existing local path to a "
            "Hugging Face tokenizer directory"
        )
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            f"loading the tokenizer at {spec!r} needs transformers: pip install transformers"
        ) from error
    if not path.is_dir():
        raise DataError(
            f"tokenizer {spec!r} is a file; expected 'byte' or a tokenizer directory (the files "
            "a tokenizer's save_pretrained writes: tokenizer.json, tokenizer_config.json, ...)"
        )
    if not any(path.iterdir()):
        # transformers would fail with a long message about the Hub and repository ids.
        raise DataError(
            f"tokenizer directory {spec!r} is empty; expected the files a tokenizer's "
            "save_pretrained writes (tokenizer.json, tokenizer_config.json, ...), or use 'byte'"
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return HuggingFaceTokenizer(tokenizer, spec)
