"""Character-level corpus and stateless, step-indexed batches; `build_dataset`, the default
`data._target_` (the dataset contract, batches pure in their arguments, is hsgd/train/task.py's)."""

import lzma
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsgd.train import task
from hsgd.train import tokens as token_files
from hsgd.train.tokens import SPLITS

MIN_CHARS = 2 * 1024  # less text than this is surely the wrong data.path
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value to compare with
class Corpus:
    train: torch.Tensor  # (N_train,) int64 token ids
    val: torch.Tensor  # (N_val,) int64 token ids, held out: never sampled for training
    chars: tuple[str, ...]  # vocabulary: sorted unique characters of train+val
    source: str  # the path, or "builtin:shakespeare"

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


@cache  # several replicas in one process share one decoded copy
def _packaged_text(name: str = "shakespeare.txt.xz") -> str:
    raw = resources.files("hsgd.corpus").joinpath(name).read_bytes()
    return lzma.decompress(raw).decode("utf-8")


def load_corpus(path: str | None = None, val_fraction: float = 0.1, *, block_size: int = 128) -> Corpus:
    """The text at `path` (None: the packaged Shakespeare; a .txt/.xz/.gz file or a folder of *.txt)
    as int64 character ids, split by position into `train` (the first 1 - val_fraction) and `val`,
    each at least one `block_size` block plus its shifted target. Raises FileNotFoundError (bad
    path) or ValueError (too little text), one line naming `data.path`."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1)")
    source = "builtin:shakespeare" if path is None else str(path)
    # a file or a folder of *.txt, read as jobs.prepare reads it (newlines normalised, files joined by a blank line)
    text = _packaged_text() if path is None else "".join(token_files.iter_text(token_files.text_files(source), source))
    if len(text) < MIN_CHARS:
        raise ValueError(f"data.path={source!r} holds {len(text)} characters; need at least {MIN_CHARS}")

    cps = torch.from_numpy(token_files.codepoints(text).astype(np.int64))  # (N,)
    uniq = torch.bincount(cps).nonzero().squeeze(1)  # (V,) sorted codepoints present
    chars = tuple(chr(c) for c in uniq.tolist())  # sorted unique characters
    table = torch.zeros(int(uniq[-1]) + 1, dtype=torch.int64)  # codepoint -> id
    table[uniq] = torch.arange(len(uniq))
    ids = table[cps]  # (N,) int64

    # Split by position, not at random: with the packaged corpus (plays sorted by filename)
    # the val tail is whole plays at the end of the alphabet, never seen in training.
    n_train = int(len(ids) * (1.0 - val_fraction))
    train, val = ids[:n_train], ids[n_train:]
    if min(len(train), len(val)) < block_size + 1:
        raise ValueError(
            f"data.path={source!r}: split of {len(ids)} characters at "
            f"val_fraction={val_fraction} leaves train={len(train)}, "
            f"val={len(val)}; each needs > block_size={block_size}"
        )
    return Corpus(train=train, val=val, chars=chars, source=source)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix(*xs: int) -> int:
    """Well-spread hash of a few integers (negatives allowed), in [0, 2**63)."""
    h = 0
    for x in xs:
        h = _splitmix64(h ^ (x & _MASK64))
    return h >> 1


def _offsets(
    n_tokens: int, *, seed: int, replica_index: int, step: int, micro: int, batch_size: int, block_size: int
) -> torch.Tensor:
    """(B,) window starts in [0, N-T-1], a pure function of the arguments (never global RNG state).
    Micro-batch 0 mixes (seed, replica, step); micro-batch m > 0 mixes m in as well."""
    if n_tokens < block_size + 1:
        raise ValueError(f"{n_tokens} tokens cannot hold one block of {block_size} plus a target")
    key = _mix(seed, replica_index, step) if micro == 0 else _mix(seed, replica_index, step, micro)
    g = torch.Generator().manual_seed(key)
    return torch.randint(0, n_tokens - block_size, (batch_size,), generator=g)  # (B,)


def _batch_at(tokens: torch.Tensor, offsets: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = tokens[offsets[:, None] + torch.arange(block_size + 1)]  # (B, T+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, T), (B, T)


BUILTIN_TARGET = "hsgd.train.data.build_dataset"


class TextDataset:
    """A character-level corpus held in RAM (the packaged Shakespeare or a text path)."""

    def __init__(self, corpus: Corpus, *, batch_size: int, block_size: int, vocab_size: int | None = None):
        if vocab_size is not None and vocab_size < corpus.vocab_size:
            raise ValueError(
                f"data.vocab_size={vocab_size}: the text at data.path={corpus.source!r} has "
                f"{corpus.vocab_size} distinct characters; leave it null or make it >= that"
            )
        self.corpus = corpus
        self.source = corpus.source
        self.vocab_size = vocab_size or corpus.vocab_size
        self.batch_size, self.block_size = batch_size, block_size

    def batch(
        self, split: str, *, seed: int, replica_index: int, step: int, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.corpus.train if split == "train" else self.corpus.val if split == "val" else None
        if tokens is None:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        offsets = _offsets(
            len(tokens),
            seed=seed,
            replica_index=replica_index,
            step=step,
            micro=micro,
            batch_size=self.batch_size,
            block_size=self.block_size,
        )
        return _batch_at(tokens, offsets, self.block_size)


class TokenDataset:
    """Token files (train.bin/val.bin) read through np.memmap: a batch copies its B windows of
    T+1 ids and nothing else, so a corpus larger than RAM trains. Pickles as the folder's
    description (the memmaps are reopened where it lands), never as the data."""

    def __init__(self, files: token_files.TokenFiles, *, batch_size: int, block_size: int):
        self.files = files
        self.source = files.source
        self.vocab_size = files.vocab_size
        # ids must stay below what meta.json names (or data.vocab_size without one)
        self._id_limit = files.meta.get("vocab_size", files.vocab_size)
        self.batch_size, self.block_size = batch_size, block_size
        self._maps: dict[str, np.memmap] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}

    def batch(
        self, split: str, *, seed: int, replica_index: int, step: int, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if split not in self._maps:
            if split not in SPLITS:
                raise ValueError(f"split {split!r} is not one of {SPLITS}")
            self._maps[split] = self.files.memmap(split)
        mm = self._maps[split]
        T = self.block_size
        offsets = _offsets(
            len(mm),
            seed=seed,
            replica_index=replica_index,
            step=step,
            micro=micro,
            batch_size=self.batch_size,
            block_size=T,
        )
        chunk = np.stack([mm[o : o + T + 1] for o in offsets.tolist()]).astype(np.int64)  # (B, T+1)
        top = int(chunk.max())
        if top >= self._id_limit:  # the bounded check at open time cannot see every window
            raise ValueError(
                f"data.path={self.source!r}: {split}.bin holds token id {top} (in a batch of step "
                f"{step}), not below the vocabulary of {self._id_limit}"
            )
        chunk = torch.from_numpy(chunk)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, T), (B, T)


def build_dataset(data_cfg: Any, block_size: int) -> TextDataset | TokenDataset:
    """The built-in `data._target_`: `data.path` null (the packaged corpus), a text file or folder
    of *.txt (char-level), or a token folder (train.bin/val.bin [+ meta.json]). Raises
    FileNotFoundError / ValueError, one line starting with the field to fix."""
    path = data_cfg.path
    vocab_size = data_cfg.vocab_size
    if path is not None:
        p = Path(str(path)).expanduser()
        if p.is_file() and p.suffix == ".bin":
            raise ValueError(
                f"data.path={str(path)!r}: point data.path at the folder that holds "
                "train.bin and val.bin, not at one .bin file"
            )
        # a folder that holds (or means to hold) token files rather than text
        if p.is_dir() and any((p / name).exists() for name in ("train.bin", "val.bin", token_files.META, "meta.pkl")):
            files = token_files.open_token_folder(str(path), vocab_size=vocab_size, block_size=block_size)
            return TokenDataset(files, batch_size=data_cfg.batch_size, block_size=block_size)
    corpus = load_corpus(path, data_cfg.val_fraction, block_size=block_size)
    return TextDataset(corpus, batch_size=data_cfg.batch_size, block_size=block_size, vocab_size=vocab_size)


def check_data(cfg) -> None:
    """Test-load the configured data before any actor starts (validation calls this), cheaply: a
    token folder's ids scanned in bounded chunks, text read (it lives in RAM anyway), a user's
    `data._target_` built and asked for one batch. Raises ValueError / FileNotFoundError / OSError,
    one line starting with the bad field."""
    target = cfg.data._target_
    try:
        ds = task.build_dataset(cfg)
        if isinstance(ds, TokenDataset):
            token_files.check_ids(ds.files, "val", sample_tokens=None)
            token_files.check_ids(ds.files, "train", sample_tokens=64 << 20)
        for split in SPLITS if target == BUILTIN_TARGET else ("train",):
            ds.batch(split, seed=cfg.seed, replica_index=0, step=0, micro=0)
    except Exception as e:  # noqa: BLE001 — the user's code may fail in any way: one line naming their field
        if target == BUILTIN_TARGET:
            raise
        msg = " ".join(str(e).split())
        if isinstance(e, ValueError) and msg.startswith("data."):
            raise ValueError(msg) from None
        raise ValueError(
            f"data._target_={target!r}: building the dataset or drawing one batch failed "
            f"({type(e).__name__}: {msg[:200]})"
        ) from None
