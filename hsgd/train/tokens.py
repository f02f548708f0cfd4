"""Token files as the field uses them: nanoGPT's `train.bin` / `val.bin` (a flat array of
little-endian `uint16` token ids, `uint32` past 65,536; no header), read through `np.memmap`. A
`meta.json` beside them (`prepare_tokens` writes it) names the vocabulary; without one (nanoGPT's
GPT-2 files) `data.vocab_size` does and the dtype follows. nanoGPT's `meta.pkl` is never loaded
(unpickling runs arbitrary code): a folder with only that is refused.

Nothing is read whole: the files are memory-mapped read-only (clean pages the OS may drop; they do
not count against RLIMIT_DATA) and every check is bounded (`open_token_folder`, `check_ids`). Every
error is one line starting with the field to fix (`data.path=...` or `data.vocab_size=...`).
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsgd.record.rundir import atomic_write_text

META = "meta.json"
FORMAT = "hsgd-tokens/1"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TOKENIZERS = ("byte", "char")
TEXT_ACCEPTED = "a .txt file, a .xz/.gz compressed text file, or a folder of *.txt files"
SCAN_TOKENS = 8 << 20  # what a scan reads at a time


def dtype_for_vocab(vocab_size: int) -> str:
    """nanoGPT's convention: uint16 while every id fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class TokenFiles:
    """A checked token folder: where the files are and how to read them (no open handles, so it
    pickles as a few strings; memmaps are opened where the batches are drawn)."""

    folder: str
    source: str  # data.path as the user wrote it, for messages
    dtype: str  # "uint16" | "uint32"
    vocab_size: int  # what the model's embedding must hold (data.vocab_size when set)
    tokens: dict  # split -> token count
    meta: dict  # meta.json's contents, {} without one

    def memmap(self, split: str) -> np.memmap:
        path = Path(self.folder) / f"{split}.bin"
        return np.memmap(path, dtype=DTYPES[self.dtype], mode="r", shape=(self.tokens[split],))


def _fail(field: str, value, problem: str, exc=ValueError):
    return exc(f"{field}={value!r}: {problem}")


def _read_meta(folder: Path, source: str) -> dict:
    meta_path = folder / META
    if not meta_path.exists():
        return {}
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _fail(
            "data.path", source, f"cannot read {meta_path.name} ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] < 1:
        raise _fail("data.path", source, f"{meta_path.name} has no positive integer vocab_size")
    if meta.get("dtype", dtype_for_vocab(meta["vocab_size"])) not in DTYPES:
        raise _fail("data.path", source, f"{meta_path.name} dtype {meta.get('dtype')!r} is not one of {list(DTYPES)}")
    return meta


def open_token_folder(
    path: str, *, vocab_size: int | None, block_size: int, sample_tokens: int = 1 << 20
) -> TokenFiles:
    """Check a token folder cheaply and describe it. Raises FileNotFoundError / ValueError, one line
    naming `data.path` (files, lengths, ids) or `data.vocab_size` (missing, too small)."""
    folder = Path(path).expanduser()
    meta = _read_meta(folder, path)
    missing = [f"{s}.bin" for s in SPLITS if not (folder / f"{s}.bin").is_file()]
    if missing:
        raise _fail(
            "data.path",
            path,
            f"token folder without {' and '.join(missing)}; a token folder holds "
            "train.bin and val.bin (write one with `python -m jobs.prepare <text> <folder>`)",
            FileNotFoundError,
        )
    if meta:
        data_vocab = meta["vocab_size"]
        if vocab_size is not None and vocab_size < data_vocab:
            raise _fail(
                "data.vocab_size",
                vocab_size,
                f"is smaller than the {data_vocab} tokens {META} "
                f"in {path!r} names; leave it null or make it >= {data_vocab}",
            )
        vocab, dtype = vocab_size or data_vocab, meta.get("dtype", dtype_for_vocab(data_vocab))
    elif vocab_size is None:
        pkl = " (its meta.pkl is a pickle and is never loaded)" if (folder / "meta.pkl").exists() else ""
        raise ValueError(
            f"data.vocab_size=null: data.path={path!r} has train.bin/val.bin but no {META}{pkl}; "
            "set data.vocab_size to the tokenizer's vocabulary (50257 for GPT-2), or write the "
            "folder with `python -m jobs.prepare`"
        )
    else:
        vocab, dtype = vocab_size, dtype_for_vocab(vocab_size)
    tokens = _split_tokens(folder, path, meta, dtype, block_size)
    files = TokenFiles(folder=str(folder), source=path, dtype=dtype, vocab_size=vocab, tokens=tokens, meta=meta)
    for split in SPLITS:
        check_ids(files, split, sample_tokens=sample_tokens)
    return files


def _split_tokens(folder: Path, path: str, meta: dict, dtype: str, block_size: int) -> dict[str, int]:
    """Each split's token count from its size: whole tokens, more than a block, as meta.json says."""
    itemsize = DTYPES[dtype].itemsize
    tokens = {}
    for split in SPLITS:
        size = (folder / f"{split}.bin").stat().st_size
        if size % itemsize:
            raise _fail(
                "data.path",
                path,
                f"{split}.bin holds {size} bytes, not a whole number of {dtype} "
                f"tokens ({itemsize} bytes each); truncated, or not {dtype} token ids",
            )
        tokens[split] = size // itemsize
        if tokens[split] < block_size + 1:
            raise _fail(
                "data.path",
                path,
                f"{split}.bin holds {tokens[split]} tokens; it needs more than model.block_size={block_size}",
            )
        if meta.get(f"{split}_tokens", tokens[split]) != tokens[split]:
            raise _fail(
                "data.path",
                path,
                f"{split}.bin holds {tokens[split]} tokens but {META} says "
                f"{meta[f'{split}_tokens']}; the folder is half-written or mixed up",
            )
    return tokens


def _windows(n: int, sample_tokens: int | None, window: int = 1 << 16) -> list[tuple[int, int]]:
    """(start, count) windows spread evenly over n tokens, about sample_tokens in all (all of it
    when n is smaller, or sample_tokens None): the head, the tail and what lies between."""
    if sample_tokens is None or n <= sample_tokens:
        return [(0, n)]
    k = max(2, sample_tokens // window)
    return [((n - window) * i // (k - 1), window) for i in range(k)]


def check_ids(files: TokenFiles, split: str, *, sample_tokens: int | None) -> None:
    """Raise ValueError (one line naming data.path, or data.vocab_size without meta.json) when a
    token id in the scanned part of `split` is >= meta.json's vocab_size (else data.vocab_size).
    sample_tokens=None scans the whole file."""
    mm = files.memmap(split)
    best, where = -1, -1  # the largest id, and its position, read SCAN_TOKENS at a time
    for start, count in _windows(files.tokens[split], sample_tokens):
        for a in range(start, start + count, SCAN_TOKENS):
            block = mm[a : min(a + SCAN_TOKENS, start + count)]
            i = int(block.argmax())
            if int(block[i]) > best:
                best, where = int(block[i]), a + i
    limit = files.meta.get("vocab_size", files.vocab_size)
    if best >= limit:
        if files.meta:
            raise _fail(
                "data.path",
                files.source,
                f"{split}.bin holds token id {best} at token {where}, but "
                f"{META} says vocab_size={limit}; the files do not match their meta.json",
            )
        raise _fail(
            "data.vocab_size",
            files.vocab_size,
            f"{split}.bin in data.path={files.source!r} holds "
            f"token id {best} at token {where}; data.vocab_size must be > {best}",
        )


# ----------------------------------------------------------------------------- writing token files


def text_files(src: str, field: str = "data.path") -> list[Path]:
    """The text files `load_corpus` reads for `src`, in its order (one file, or a folder's *.txt
    sorted by relative path)."""
    p = Path(src).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted((f for f in p.rglob("*.txt") if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
        if not files:
            raise FileNotFoundError(f"{field}={src!r} is a folder with no *.txt files; expected {TEXT_ACCEPTED}")
        return files
    raise FileNotFoundError(f"{field}={src!r} does not exist; expected {TEXT_ACCEPTED}")


def iter_text(files: list[Path], source: str, chunk_chars: int = 1 << 22, field: str = "data.path") -> Iterator[str]:
    """The text of `files` in chunks, joined as `load_corpus` joins them ("\\n\\n" between files),
    newlines normalised to \\n (universal newlines, also across chunk edges)."""
    for k, file in enumerate(files):
        if k:
            yield "\n\n"
        opener = {".xz": lzma.open, ".gz": gzip.open}.get(file.suffix, open)
        try:
            with opener(file, "rt", encoding="utf-8") as f:
                while chunk := f.read(chunk_chars):
                    yield chunk
        except (UnicodeDecodeError, lzma.LZMAError, gzip.BadGzipFile, EOFError) as e:
            raise ValueError(
                f"{field}={source!r}: cannot read {file} as UTF-8 text ({type(e).__name__}); expected {TEXT_ACCEPTED}"
            ) from None


def codepoints(chunk: str) -> np.ndarray:
    return np.frombuffer(chunk.encode("utf-32-le"), dtype="<u4")  # (n,) no BOM


def prepare_tokens(
    src: str,
    out: str,
    *,
    tokenizer: str = "byte",
    val_fraction: float = 0.1,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Tokenize the text at `src` into `out`/train.bin, val.bin and meta.json; returns the meta.
    Two streaming passes (count; encode and write): memory stays bounded by one chunk. The split
    is by position as in `load_corpus`. Each file is renamed into place, meta.json last (after any
    old one is removed), so a folder with a meta.json is complete. `progress(pass_name, chars_done,
    chars_total)` after each chunk. Raises FileNotFoundError / ValueError, one line."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"--tokenizer={tokenizer!r}: must be one of {list(TOKENIZERS)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction={val_fraction}: must be in (0, 1)")
    files = text_files(src, field="src")
    out_dir = Path(out).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"out={out!r} exists and is not a folder")
    report = progress or (lambda *_: None)

    n_chars, n_tokens, vocab, chars, table = _count(files, src, tokenizer, report)
    dtype = DTYPES[dtype_for_vocab(vocab)]
    n_train = int(n_tokens * (1.0 - val_fraction))
    if min(n_train, n_tokens - n_train) < 2:
        raise ValueError(
            f"src={src!r}: {n_tokens} tokens at --val-fraction={val_fraction} leave "
            f"train={n_train}, val={n_tokens - n_train}; too little text"
        )

    _write(files, src, out_dir, table, dtype, n_train, n_tokens, n_chars, report)
    meta = {
        "format": FORMAT,
        "vocab_size": vocab,
        "dtype": dtype_for_vocab(vocab),
        "tokenizer": tokenizer,
        "train_tokens": n_train,
        "val_tokens": n_tokens - n_train,
        "source": str(src),
    }
    if chars is not None:
        meta["chars"] = chars
    atomic_write_text(out_dir / META, json.dumps(meta, ensure_ascii=True))
    return meta


def _count(files: list[Path], src: str, tokenizer: str, report) -> tuple:
    """Pass 1: (chars, tokens, vocab, the char vocabulary or None, its code point -> id table or None)."""
    n_chars = n_tokens = 0
    seen = np.zeros(0x110000, dtype=bool)  # every Unicode code point
    for chunk in iter_text(files, src, field="src"):
        n_chars += len(chunk)
        if tokenizer == "byte":
            n_tokens += len(chunk.encode("utf-8"))
        else:
            cps = codepoints(chunk)
            n_tokens += len(cps)
            seen[cps] = True
        report("count", n_chars, 0)
    if tokenizer == "byte":
        vocab, chars, table = 256, None, None
    else:
        uniq = np.flatnonzero(seen)  # sorted codepoints present: the load_corpus vocabulary
        chars = [chr(c) for c in uniq]
        vocab = len(chars)
        table = np.zeros(len(seen), dtype=np.int64)
        table[uniq] = np.arange(vocab)
    return n_chars, n_tokens, vocab, chars, table


def _write(files, src, out_dir: Path, table, dtype, n_train: int, n_tokens: int, n_chars: int, report) -> None:
    """Pass 2: encode and write, switching from train to val at n_train; each file renamed into place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = {s: out_dir / f".{s}.bin.tmp-{tag}" for s in SPLITS}
    try:
        with open(tmp["train"], "wb") as ftrain, open(tmp["val"], "wb") as fval:
            written, done_chars = 0, 0
            for chunk in iter_text(files, src, field="src"):
                ids = table[codepoints(chunk)] if table is not None else np.frombuffer(chunk.encode(), np.uint8)
                ids = ids.astype(dtype)
                cut = min(len(ids), max(0, n_train - written))
                ftrain.write(ids[:cut].tobytes())
                fval.write(ids[cut:].tobytes())
                written += len(ids)
                done_chars += len(chunk)
                report("write", done_chars, n_chars)
            for f in (ftrain, fval):
                f.flush()
                os.fsync(f.fileno())
        if written != n_tokens:
            raise ValueError(f"src={src!r} changed while it was read ({n_tokens} tokens, then {written})")
        (out_dir / META).unlink(missing_ok=True)
        for s in SPLITS:
            os.replace(tmp[s], out_dir / f"{s}.bin")
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
