import gzip
import lzma

import pytest
import torch

from hsgd.train.data import batch_for_step, decode, encode, eval_batches, load_corpus

PACKAGED_CHARS = 5_057_280  # hsgd/corpus/README.md


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def _write_text(tmp_path, name="a.txt", n=4000):
    text = ("To be, or not to be, that is the question:\n" * (n // 43 + 1))[:n]
    (tmp_path / name).write_text(text)
    return text


def test_packaged_corpus_is_the_modern_spelling_text_from_the_readme(corpus):
    assert corpus.source == "builtin:shakespeare"
    assert len(corpus.train) + len(corpus.val) == PACKAGED_CHARS
    assert corpus.vocab_size == 84 and list(corpus.chars) == sorted(corpus.chars)
    text = decode(corpus.train[:200_000], corpus.chars) + decode(corpus.val, corpus.chars)
    assert "Actus Primus" not in text and "Scoena Prima" not in text  # folio-only headings


def test_train_and_val_split_by_position_and_val_non_empty(corpus):
    assert corpus.train.dtype == corpus.val.dtype == torch.int64
    assert len(corpus.val) == PACKAGED_CHARS - int(PACKAGED_CHARS * 0.9) > 0
    assert "WINTER'S TALE" in decode(corpus.val, corpus.chars)  # last play is held out


def test_encode_decode_round_trip_and_unknown_char_rejected(corpus):
    s = "O Romeo, Romeo!\n"
    assert decode(encode(s, corpus.chars), corpus.chars) == s
    with pytest.raises(ValueError):
        encode("\u00e9", corpus.chars)


def test_batch_for_step_is_deterministic_and_shifted(corpus):
    kw = dict(seed=7, replica_index=2, step=11, batch_size=4, block_size=16)
    x1, y1 = batch_for_step(corpus.train, **kw)
    torch.manual_seed(999)  # global RNG state must not matter
    x2, y2 = batch_for_step(corpus.train, **kw)
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_batch_for_step_differs_across_replicas_steps_and_seeds(corpus):
    kw = dict(batch_size=4, block_size=16)
    base = batch_for_step(corpus.train, seed=0, replica_index=0, step=0, **kw)[0]
    for other in [dict(seed=0, replica_index=1, step=0), dict(seed=0, replica_index=0, step=1),
                  dict(seed=1, replica_index=0, step=0)]:
        assert not torch.equal(base, batch_for_step(corpus.train, **other, **kw)[0])


def test_batch_offsets_reach_but_never_pass_the_end():
    tokens = torch.arange(10)
    xs = torch.cat([batch_for_step(tokens, seed=0, replica_index=0, step=s,
                                   batch_size=8, block_size=8)[1] for s in range(20)])
    assert xs.max() == 9  # y may end on the last token, never beyond


def test_eval_batches_are_fixed(corpus):
    a = eval_batches(corpus.val, batch_size=2, block_size=8, n_batches=3)
    b = eval_batches(corpus.val, batch_size=2, block_size=8, n_batches=3)
    assert len(a) == 3 and all(torch.equal(x, u) and torch.equal(y, v)
                               for (x, y), (u, v) in zip(a, b))


def test_txt_xz_gz_and_folder_paths_load_the_same_text(tmp_path):
    text = _write_text(tmp_path)
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress(text.encode()))
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode()))
    sub = tmp_path / "folder" / "z"
    sub.mkdir(parents=True)
    (tmp_path / "folder" / "b.txt").write_text(text[:2000])
    (sub / "a.txt").write_text(text[2000:].replace("\n", "\r\n"))
    for name in ["a.txt", "a.txt.xz", "a.txt.gz"]:
        c = load_corpus(str(tmp_path / name))
        assert decode(torch.cat([c.train, c.val]), c.chars) == text
    c = load_corpus(str(tmp_path / "folder"))  # b.txt before z/a.txt, CRLF normalised
    assert decode(torch.cat([c.train, c.val]), c.chars) == text[:2000] + "\n\n" + text[2000:]


def test_missing_path_or_empty_folder_error_names_data_path(tmp_path):
    for p in [tmp_path / "nope.txt", tmp_path]:
        with pytest.raises(FileNotFoundError, match="data.path") as e:
            load_corpus(str(p))
        assert "\n" not in str(e.value)


def test_too_little_text_or_tiny_val_split_error_names_data_path(tmp_path):
    _write_text(tmp_path, "short.txt", n=1000)
    with pytest.raises(ValueError, match="data.path"):
        load_corpus(str(tmp_path / "short.txt"))
    _write_text(tmp_path, "ok.txt", n=3000)
    with pytest.raises(ValueError, match="data.path"):
        load_corpus(str(tmp_path / "ok.txt"), val_fraction=0.01)
