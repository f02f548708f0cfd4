"""Tokenize text into train.bin, val.bin and meta.json for `data.path` (docs/own-model.md, "Text and token files").

No network. Exit 0 on success, 2 on a bad argument or unreadable input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time

from hsgd.train.tokens import TOKENIZERS, prepare_tokens


def _progress(every_s: float = 2.0):
    last = [time.monotonic()]

    def report(stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < every_s:
            return
        last[0] = now
        of = f" of {total / 1e6:,.1f} M" if total else ""
        print(f"prepare: {stage}: {done / 1e6:,.1f} M characters{of}", file=sys.stderr, flush=True)

    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a .txt/.xz/.gz text file, or a folder of *.txt files")
    parser.add_argument("out", help="the folder to write train.bin, val.bin and meta.json into")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="byte")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="the tail held out as val.bin")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        meta = prepare_tokens(
            args.src, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction, progress=_progress()
        )
    except (OSError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: train.bin {meta['train_tokens']:,} and val.bin {meta['val_tokens']:,} "
        f"{meta['dtype']} tokens, {args.tokenizer} tokenizer, vocab_size {meta['vocab_size']} "
        f"({time.monotonic() - start:.1f}s); train with `python -m jobs.train data.path={args.out}`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
