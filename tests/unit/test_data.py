import gzip
import lzma

import pytest
import torch

from hsgd.train.data import load_corpus
from tests.fakes.references import batch_for_step

PACKAGED_CHARS = 5_057_280  # hsgd/corpus/README.md


def decode(ids: torch.Tensor, chars: tuple[str, ...]) -> str:
    return "".join(chars[i] for i in ids.tolist())


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
    for other in [
        dict(seed=0, replica_index=1, step=0),
        dict(seed=0, replica_index=0, step=1),
        dict(seed=1, replica_index=0, step=0),
    ]:
        assert not torch.equal(base, batch_for_step(corpus.train, **other, **kw)[0])


def test_batch_offsets_reach_but_never_pass_the_end():
    tokens = torch.arange(10)
    xs = torch.cat(
        [batch_for_step(tokens, seed=0, replica_index=0, step=s, batch_size=8, block_size=8)[1] for s in range(20)]
    )
    assert xs.max() == 9  # y may end on the last token, never beyond


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


# ----------------------------------------------------------------------------- datasets (issue 20)

import json  # noqa: E402
import pickle  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from hsgd.config.schema import DataConfig, HsgdConfig  # noqa: E402
from hsgd.train.data import TextDataset, TokenDataset, build_dataset, check_data  # noqa: E402
from hsgd.train.tokens import prepare_tokens  # noqa: E402


def _token_folder(tmp_path, train, val, meta=True, dtype=np.uint16, vocab=None, name="tok"):
    folder = tmp_path / name
    folder.mkdir()
    np.asarray(train, dtype=dtype).tofile(folder / "train.bin")
    np.asarray(val, dtype=dtype).tofile(folder / "val.bin")
    if meta:
        v = vocab or int(max(np.max(train), np.max(val))) + 1
        (folder / "meta.json").write_text(json.dumps({"vocab_size": v, "dtype": np.dtype(dtype).name}))
    return folder


def _cfg(**data):
    cfg = OmegaConf.structured(HsgdConfig)
    cfg.model.block_size = 16
    cfg.data.batch_size = 4
    for k, v in data.items():
        cfg.data[k] = v
    return cfg


def _one_line_error(exc_type, fn, match):
    with pytest.raises(exc_type, match=match) as e:
        fn()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_dataset_micro_batch_zero_is_todays_batch_and_other_micro_batches_differ():
    ds = build_dataset(DataConfig(batch_size=4), 16)
    assert isinstance(ds, TextDataset) and ds.source == "builtin:shakespeare" and ds.vocab_size == 84
    for step in (0, 7):
        x0, y0 = ds.batch("train", seed=5, replica_index=3, step=step, micro=0)
        ref = batch_for_step(ds.corpus.train, seed=5, replica_index=3, step=step, batch_size=4, block_size=16)
        assert torch.equal(x0, ref[0]) and torch.equal(y0, ref[1])
        x1, _ = ds.batch("train", seed=5, replica_index=3, step=step, micro=1)
        torch.manual_seed(1)  # no global RNG state involved
        assert torch.equal(x1, ds.batch("train", seed=5, replica_index=3, step=step, micro=1)[0])
        assert not torch.equal(x0, x1)
    for i in range(2):  # evaluation's batches: replica_index -1, seed 1234, the step as index
        x, y = batch_for_step(ds.corpus.val, seed=1234, replica_index=-1, step=i, batch_size=4, block_size=16)
        vx, vy = ds.batch("val", seed=1234, replica_index=-1, step=i, micro=0)
        assert torch.equal(x, vx) and torch.equal(y, vy)


@pytest.mark.parametrize("dtype, vocab", [(np.uint16, 50257), (np.uint32, 100_000)])
def test_token_folder_batches_are_int64_windows_of_the_memmap(tmp_path, dtype, vocab):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, vocab, 5000), rng.integers(0, vocab, 500)
    folder = _token_folder(tmp_path, train, val, meta=False, dtype=dtype)
    ds = build_dataset(DataConfig(path=str(folder), batch_size=4, vocab_size=vocab), 16)
    assert isinstance(ds, TokenDataset) and ds.vocab_size == vocab and ds.files.dtype == np.dtype(dtype).name
    for split, tokens in (("train", train), ("val", val)):
        x, y = ds.batch(split, seed=1, replica_index=0, step=3, micro=2)
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        ref = batch_for_step(
            torch.from_numpy(tokens.astype(np.int64)), seed=1, replica_index=0, step=3, batch_size=4, block_size=16
        )
        if split == "train":  # micro 2 is not today's stream; micro 0 is
            x0, y0 = ds.batch(split, seed=1, replica_index=0, step=3, micro=0)
            assert torch.equal(x0, ref[0]) and torch.equal(y0, ref[1])


def test_token_dataset_pickles_as_its_description_not_its_data(tmp_path):
    folder = _token_folder(tmp_path, np.arange(200_000) % 300, np.arange(1000) % 300)
    ds = build_dataset(DataConfig(path=str(folder), batch_size=4), 16)
    before = ds.batch("train", seed=0, replica_index=0, step=0, micro=0)  # opens the memmap
    blob = pickle.dumps(ds)
    assert len(blob) < 4096, len(blob)  # the file is 400 KB
    after = pickle.loads(blob).batch("train", seed=0, replica_index=0, step=0, micro=0)
    assert torch.equal(before[0], after[0])


def test_char_prepared_folder_draws_the_same_batches_as_the_text_it_came_from(tmp_path):
    text = _write_text(tmp_path, "a.txt", n=6000) + "\u00e9\u4e2d"
    (tmp_path / "a.txt").write_text(text)
    prepare_tokens(str(tmp_path / "a.txt"), str(tmp_path / "tok"), tokenizer="char", val_fraction=0.1)
    as_text = build_dataset(DataConfig(path=str(tmp_path / "a.txt"), batch_size=4), 16)
    as_tokens = build_dataset(DataConfig(path=str(tmp_path / "tok"), batch_size=4), 16)
    assert as_tokens.vocab_size == as_text.vocab_size
    for split, replica, step in (("train", 0, 0), ("train", 2, 9), ("val", -1, 1)):
        a = as_text.batch(split, seed=0, replica_index=replica, step=step, micro=0)
        b = as_tokens.batch(split, seed=0, replica_index=replica, step=step, micro=0)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (split, replica, step)


def test_nanogpt_folder_without_meta_needs_data_vocab_size_and_never_loads_meta_pkl(tmp_path):
    folder = _token_folder(tmp_path, np.arange(3000) % 50257, np.arange(300), meta=False)
    msg = _one_line_error(ValueError, lambda: build_dataset(DataConfig(path=str(folder)), 16), "^data.vocab_size")
    assert "meta.json" in msg and "pickle" not in msg
    (folder / "meta.pkl").write_bytes(b"\x80\x04 not to be unpickled")
    msg = _one_line_error(ValueError, lambda: build_dataset(DataConfig(path=str(folder)), 16), "^data.vocab_size")
    assert "meta.pkl is a pickle and is never loaded" in msg
    assert build_dataset(DataConfig(path=str(folder), vocab_size=50304), 16).vocab_size == 50304


def test_bad_token_files_fail_with_one_line_naming_the_field(tmp_path):
    ok = np.arange(3000) % 100
    cases = []
    odd = _token_folder(tmp_path, ok, ok[:300], name="odd")
    with open(odd / "train.bin", "ab") as f:
        f.write(b"\x01")  # 3001 tokens' worth plus one stray byte
    cases.append((odd, None, ValueError, "^data.path=.*train.bin holds 6001 bytes"))
    big = _token_folder(tmp_path, ok, ok[:300], vocab=100, name="big")
    arr = np.fromfile(big / "train.bin", dtype=np.uint16)
    arr[1234] = 100
    arr.tofile(big / "train.bin")
    cases.append((big, None, ValueError, "^data.path=.*token id 100 at token 1234.*vocab_size=100"))
    no_val = _token_folder(tmp_path, ok, ok[:300], name="no_val")
    (no_val / "val.bin").unlink()
    cases.append((no_val, None, FileNotFoundError, "^data.path=.*without val.bin"))
    nometa = _token_folder(tmp_path, ok, ok[:300], meta=False, name="nometa")
    cases.append((nometa, 50, ValueError, "^data.vocab_size=50: .*token id 99"))
    cases.append(
        (
            _token_folder(tmp_path, ok, ok[:300], name="small_vocab"),
            64,
            ValueError,
            "^data.vocab_size=64: is smaller than the 100",
        )
    )
    short = _token_folder(tmp_path, ok, ok[:10], name="short")
    cases.append((short, None, ValueError, "^data.path=.*val.bin holds 10 tokens.*block_size=16"))
    cases.append((big / "train.bin", None, ValueError, "^data.path=.*point data.path at the folder"))
    for path, vocab, exc, match in cases:
        _one_line_error(exc, lambda: build_dataset(DataConfig(path=str(path), vocab_size=vocab), 16), match)  # noqa: B023 — called within the iteration
        _one_line_error(exc, lambda: check_data(_cfg(path=str(path), vocab_size=vocab)), match)  # noqa: B023 — called within the iteration


def test_check_data_scans_all_of_val_and_batches_check_every_window(tmp_path, monkeypatch):
    n = 4 << 20  # more than the cheap open-time sample (1 M tokens) reads
    train, val = np.zeros(n, dtype=np.uint16), np.zeros(n, dtype=np.uint16)
    val[n // 2 + 7] = 999  # between the sampled windows
    folder = _token_folder(tmp_path, train, val, vocab=10)
    ds = build_dataset(DataConfig(path=str(folder), batch_size=4), 16)  # the bounded sample misses it
    _one_line_error(
        ValueError,
        lambda: check_data(_cfg(path=str(folder))),
        f"^data.path=.*val.bin holds token id 999 at token {n // 2 + 7}",
    )
    monkeypatch.setattr("hsgd.train.data._offsets", lambda *a, **k: torch.tensor([n // 2]))
    _one_line_error(
        ValueError,
        lambda: ds.batch("val", seed=0, replica_index=0, step=0, micro=0),
        "^data.path=.*val.bin holds token id 999",
    )


def make_counting_dataset(data_cfg, block_size, *, start=0):
    """A user's data plug-in (the shape README documents): counts from `start`."""

    def batch(split, *, seed, replica_index, step, micro):
        x = torch.arange(start, start + block_size).repeat(data_cfg.batch_size, 1) + step
        return x, x + 1

    return types.SimpleNamespace(source="counting", vocab_size=None, batch=batch)


def test_check_data_builds_a_user_target_and_names_it_when_it_fails():
    check_data(_cfg(_target_=f"{__name__}.make_counting_dataset", args={"start": 5}))
    _one_line_error(
        ValueError,
        lambda: check_data(_cfg(_target_="no_such_module_h5.build")),
        "^data._target_: 'no_such_module_h5.build': cannot import no_such_module_h5",
    )
    _one_line_error(
        ValueError,
        lambda: check_data(_cfg(_target_=f"{__name__}.make_counting_dataset", args={"stop": 5})),
        "^data._target_=.*failed .TypeError",
    )
    _one_line_error(
        ValueError,
        lambda: check_data(_cfg(_target_=f"{__name__}.make_no_batches")),
        "^data._target_=.*returned dict, which has no batch",
    )


def make_no_batches(data_cfg, block_size):
    return {"source": "not a dataset"}
