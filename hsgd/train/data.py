"""Character-level corpus and stateless, step-indexed batches.

Contract:
- `load_corpus(path=None)` returns a `Corpus`: the whole text encoded as int64 character
  ids, split by position into `train` (the first 1 - val_fraction) and `val` (the rest).
  `path=None` is the packaged Shakespeare corpus (hsgd/corpus/shakespeare.txt.xz); otherwise
  a text file (.txt, or .xz/.gz compressed) or a folder of *.txt files. Bad paths raise
  FileNotFoundError, too little text raises ValueError; both are one line naming `data.path`.
- `batch_for_step(train, seed=, replica_index=, step=, ...)` is a pure function of its
  arguments. A replica carries no data-loader state: its data position IS its step counter,
  so a replica restored at step s draws exactly the batches it would have drawn anyway.
- `eval_batches(val, ...)` is a fixed list of batches: the same for every call with the
  same arguments, so val losses from different replicas and runs are comparable.
"""

import gzip
import lzma
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

MIN_CHARS = 2 * 1024  # less text than this is surely the wrong data.path
ACCEPTED = "a .txt file, a .xz/.gz compressed text file, or a folder of *.txt files"
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


# ----------------------------------------------------------------------------- text sources

@lru_cache(maxsize=None)  # several replicas in one process share one decoded copy
def _packaged_text(name: str = "shakespeare.txt.xz") -> str:
    raw = resources.files("hsgd.corpus").joinpath(name).read_bytes()
    return lzma.decompress(raw).decode("utf-8")


def _read_file(file: Path, path: str) -> str:
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(file.suffix, open)
    try:
        with opener(file, "rt", encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, lzma.LZMAError, gzip.BadGzipFile, EOFError) as e:
        raise ValueError(f"data.path={path!r}: cannot read {file} as UTF-8 text "
                         f"({type(e).__name__}); expected {ACCEPTED}") from None


def _read_text(path: str) -> str:
    p = Path(path).expanduser()
    if p.is_file():
        text = _read_file(p, path)
    elif p.is_dir():
        files = sorted((f for f in p.rglob("*.txt") if f.is_file()),
                       key=lambda f: f.relative_to(p).as_posix())
        if not files:
            raise FileNotFoundError(f"data.path={path!r} is a folder with no *.txt files; "
                                    f"expected {ACCEPTED}")
        text = "\n\n".join(_read_file(f, path) for f in files)
    else:
        raise FileNotFoundError(f"data.path={path!r} does not exist; expected {ACCEPTED}")
    return text.replace("\r\n", "\n").replace("\r", "\n")


# ----------------------------------------------------------------------------- encoding

def _codepoints(text: str) -> torch.Tensor:
    buf = bytearray(text.encode("utf-32-le"))  # 4 bytes per character, no BOM
    if not buf:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int32).long()  # (N,)


def encode(text: str, chars) -> torch.Tensor:
    """text -> (N,) int64 ids into `chars`; ValueError on a character not in `chars`."""
    cps = _codepoints(text)  # (N,)
    codes = torch.tensor([ord(c) for c in chars], dtype=torch.int64)  # (V,)
    sorted_codes, order = codes.sort()
    pos = torch.searchsorted(sorted_codes, cps).clamp(max=len(codes) - 1)  # (N,)
    unknown = sorted_codes[pos] != cps
    if unknown.any():
        bad = sorted({chr(c) for c in cps[unknown][:100].tolist()})
        raise ValueError(f"characters not in the vocabulary: {bad!r}")
    return order[pos]


def decode(ids, chars) -> str:
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return "".join(chars[i] for i in ids)


# ----------------------------------------------------------------------------- corpus

def load_corpus(path: str | None = None, val_fraction: float = 0.1, *,
                block_size: int = 128) -> Corpus:
    """Load and split a corpus. `block_size` is the longest block a caller will sample:
    train and val must each hold at least one block plus its shifted target."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1)")
    source = "builtin:shakespeare" if path is None else str(path)
    text = _packaged_text() if path is None else _read_text(str(path))
    if len(text) < MIN_CHARS:
        raise ValueError(f"data.path={source!r} holds {len(text)} characters; "
                         f"need at least {MIN_CHARS}")

    cps = _codepoints(text)  # (N,)
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
        raise ValueError(f"data.path={source!r}: split of {len(ids)} characters at "
                         f"val_fraction={val_fraction} leaves train={len(train)}, "
                         f"val={len(val)}; each needs > block_size={block_size}")
    return Corpus(train=train, val=val, chars=chars, source=source)


# ----------------------------------------------------------------------------- batches

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


def batch_for_step(tokens: torch.Tensor, *, seed: int, replica_index: int, step: int,
                   batch_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch replica `replica_index` trains on at `step`: x, y of shape (B, T) int64,
    y = x shifted by one. Depends only on the arguments, never on global RNG state."""
    B, T = batch_size, block_size
    if len(tokens) < T + 1:
        raise ValueError(f"{len(tokens)} tokens cannot hold one block of {T} plus a target")
    g = torch.Generator().manual_seed(_mix(seed, replica_index, step))
    offsets = torch.randint(0, len(tokens) - T, (B,), generator=g)  # (B,) in [0, N-T-1]
    chunk = tokens[offsets[:, None] + torch.arange(T + 1)]  # (B, T+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, T), (B, T)


def eval_batches(tokens: torch.Tensor, *, batch_size: int, block_size: int, n_batches: int,
                 seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed evaluation batches from `tokens` (the val split): stream replica_index=-1,
    steps 0..n_batches-1, so they never coincide with a training replica's stream."""
    return [batch_for_step(tokens, seed=seed, replica_index=-1, step=i,
                           batch_size=batch_size, block_size=block_size)
            for i in range(n_batches)]
