"""The tokenizer a .nanoqwen file carries: its embedded `tokenizer.json` as a `tokenizers.Tokenizer`.

`embedded_tokenizer(model)` is the one place that turns those bytes into a tokenizer. A file without
one gives None; bytes that are not UTF-8, or a JSON the tokenizers library refuses (including a panic
inside it), raise `EmbeddedTokenizerError` naming the file, so a bad model never escapes as a
traceback from the command line, the prompt reader or `nanoqwen descend`.
"""

from __future__ import annotations

import engine.errors as E

NAME = "tokenizer.json"


def embedded_tokenizer(model, verify_checksums: bool = True):
    """The `tokenizers.Tokenizer` embedded in `model` (a path or an open ModelFile), or None."""
    from engine.modelfile import ModelFile

    if isinstance(model, ModelFile):
        blob, path = model.file(NAME), model.path
    else:
        with ModelFile(model, verify_checksums=verify_checksums) as mf:
            blob, path = mf.file(NAME), mf.path
    if blob is None:
        return None
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise E.EmbeddedTokenizerError(path, f"embedded {NAME} is not UTF-8 (byte {e.start}: {e.reason})") from None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - the library's Rust panics derive from BaseException
        raise E.EmbeddedTokenizerError(path, f"embedded {NAME} is not a tokenizer the tokenizers library "
                                             f"accepts ({E.one_line(e)})") from None
