"""Every error the engine raises on bad input, typed so callers and tests can tell them apart.

One family per source of trouble: the model file (`ModelFileError` and a subclass per malformed
case), the model config (`ConfigError`), the request (`TokenIdError`, `PromptTooLongError`) and the
KV cache (`OutOfPagesError`). The command line turns any `NanoqwenError` into one line on stderr.
"""

from __future__ import annotations


class NanoqwenError(Exception):
    """Base of every error that names a problem with the user's input or resources."""


# --- the .nanoqwen file -------------------------------------------------------------------------


def one_line(text, limit: int = 300) -> str:
    """`text` (or an exception's message) as one line of at most `limit` characters, for error messages."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def brief(value, limit: int = 80) -> str:
    """A short repr of a value read from a file: bounded in length and depth, safe on any nesting."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, 40, 40, 40
    return one_line(r.repr(value), limit)


class ModelFileError(NanoqwenError):
    """A .nanoqwen file that cannot be trusted. The message names the file and the problem, on one line."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = one_line(problem, 500)
        super().__init__(f"{self.path}: {self.problem}")


class BadMagicError(ModelFileError):
    """The first 8 bytes are not `NANOQWEN`."""


class UnsupportedVersionError(ModelFileError):
    """The version field names a layout this reader does not know."""


class TruncatedFileError(ModelFileError):
    """The file ends before its fixed preamble, its header or its data does."""


class HeaderError(ModelFileError):
    """The JSON header is not valid UTF-8 JSON, or lacks a required field."""


class HeaderTooLargeError(ModelFileError):
    """The header length field claims more bytes than the file holds (or a sane header needs)."""


class TensorBoundsError(ModelFileError):
    """A tensor's offset or length runs past the end of the file, is misaligned, or overlaps."""


class DTypeMismatchError(ModelFileError):
    """A tensor's dtype is unknown, or not the one its format and config require."""


class ShapeMismatchError(ModelFileError):
    """A tensor's shape disagrees with its byte length, or with the model config."""


class ChecksumMismatchError(ModelFileError):
    """A tensor's bytes do not hash to the checksum stored in the header."""


class MissingTensorError(ModelFileError):
    """A tensor the config requires is absent from the table."""


class UnexpectedTensorError(ModelFileError):
    """The table holds a tensor the config does not use (a layer past num_hidden_layers, a tied lm_head)."""


class EmbeddedTokenizerError(ModelFileError):
    """The embedded `tokenizer.json` is not UTF-8, or not a tokenizer the tokenizers library accepts."""


class AllocationTooLargeError(ModelFileError):
    """Loading would allocate more (KV cache, workspaces) than the file's size plus a fixed allowance."""


# --- config, requests, cache --------------------------------------------------------------------


class ConfigError(NanoqwenError):
    """A model config the engine does not implement; the message names the key."""


class UnknownFormatError(NanoqwenError):
    """A quantization format name that no module in engine/formats registers."""


class OutputPathError(NanoqwenError):
    """An output path that cannot be written (a folder, a missing or read-only parent, a failed write)."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class TokenIdError(NanoqwenError, ValueError):
    """A token id outside [0, vocab_size)."""


class PromptTooLongError(NanoqwenError, ValueError):
    """A prompt (plus the tokens asked for) longer than the KV cache can hold."""


class OutOfPagesError(NanoqwenError, RuntimeError):
    """The page allocator has no free page left."""


class ModelClosedError(NanoqwenError, RuntimeError):
    """A model used after `Model.close()` gave its memory back."""


# Raised by kernels/ (which cannot import engine/), re-exported here so callers find it with the rest.
from kernels import BackendUnavailableError  # noqa: E402,F401
