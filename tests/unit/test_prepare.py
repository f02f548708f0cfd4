"""jobs.prepare / hsgd.train.tokens.prepare_tokens: text in, nanoGPT token files + meta.json out."""

import gzip
import json
import lzma

import numpy as np
import pytest
import torch

from hsgd.train.data import load_corpus
from hsgd.train.tokens import prepare_tokens
from jobs.prepare import main as prepare_main

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind \u00e9\u4e2d\n" * 60


def _folder_of_text(tmp_path):
    src = tmp_path / "text"
    (src / "z").mkdir(parents=True)
    (src / "b.txt").write_text(TEXT[:2500])
    (src / "z" / "a.txt").write_bytes(TEXT[2500:].replace("\n", "\r\n").encode("utf-8"))
    (src / "ignored.md").write_text("not read")
    return src, TEXT[:2500] + "\n\n" + TEXT[2500:]  # what load_corpus reads: sorted, joined, CRLF -> LF


def _read(folder):
    meta = json.loads((folder / "meta.json").read_text())
    dt = np.dtype(meta["dtype"])
    return meta, np.fromfile(folder / "train.bin", dtype=dt), np.fromfile(folder / "val.bin", dtype=dt)


def test_byte_tokenizer_writes_the_utf8_bytes_split_by_position(tmp_path):
    src, text = _folder_of_text(tmp_path)
    meta = prepare_tokens(str(src), str(tmp_path / "tok"), tokenizer="byte", val_fraction=0.2)
    meta2, train, val = _read(tmp_path / "tok")
    data = text.encode("utf-8")
    assert meta == meta2
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16" and meta["tokenizer"] == "byte"
    assert len(train) == meta["train_tokens"] == int(len(data) * 0.8)
    assert len(val) == meta["val_tokens"] == len(data) - len(train)
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == data
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_char_tokenizer_gives_the_ids_load_corpus_gives(tmp_path):
    src, _ = _folder_of_text(tmp_path)
    (tmp_path / "one.txt.xz").write_bytes(lzma.compress(TEXT.encode()))
    (tmp_path / "one.txt.gz").write_bytes(gzip.compress(TEXT.encode()))
    for name, path in (("folder", src), ("xz", tmp_path / "one.txt.xz"), ("gz", tmp_path / "one.txt.gz")):
        meta = prepare_tokens(str(path), str(tmp_path / name), tokenizer="char")
        corpus = load_corpus(str(path), block_size=16)
        _, train, val = _read(tmp_path / name)
        assert tuple(meta["chars"]) == corpus.chars and meta["vocab_size"] == corpus.vocab_size
        assert torch.equal(torch.from_numpy(train.astype(np.int64)), corpus.train), name
        assert torch.equal(torch.from_numpy(val.astype(np.int64)), corpus.val), name


def test_small_chunks_give_the_same_files_and_report_progress(tmp_path, monkeypatch):
    src, _ = _folder_of_text(tmp_path)
    prepare_tokens(str(src), str(tmp_path / "whole"), tokenizer="char")
    import hsgd.train.tokens as tokens

    real = tokens.iter_text
    monkeypatch.setattr(tokens, "iter_text", lambda *a, **k: real(*a, **{**k, "chunk_chars": 7}))
    seen = []
    prepare_tokens(str(src), str(tmp_path / "chunked"), tokenizer="char", progress=lambda *a: seen.append(a))
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "chunked" / name).read_bytes(), name
    assert {s for s, _, _ in seen} == {"count", "write"} and seen[-1][1] == seen[-1][2] > 0


def test_rewriting_a_folder_replaces_it_and_a_failure_leaves_no_temporaries(tmp_path):
    src, _ = _folder_of_text(tmp_path)
    out = tmp_path / "tok"
    prepare_tokens(str(src), str(out), tokenizer="char")
    prepare_tokens(str(src), str(out), tokenizer="byte")
    assert _read(out)[0]["tokenizer"] == "byte"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (src / "zz.txt").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValueError, match="^src=.*cannot read .*zz.txt as UTF-8"):
        prepare_tokens(str(src), str(out), tokenizer="byte")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old files intact, no .tmp left


def test_cli_writes_the_folder_and_exits_2_with_one_line_on_bad_input(tmp_path, capsys):
    src, _ = _folder_of_text(tmp_path)
    assert prepare_main([str(src), str(tmp_path / "tok"), "--tokenizer", "char", "--val-fraction", "0.25"]) == 0
    assert "train.bin" in capsys.readouterr().out
    assert _read(tmp_path / "tok")[0]["val_tokens"] > 0
    for argv in (
        [str(tmp_path / "missing"), str(tmp_path / "x")],
        [str(src), str(tmp_path / "y"), "--val-fraction", "1.5"],
    ):
        assert prepare_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
