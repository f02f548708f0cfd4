"""Token files end to end (issue 20, acceptance 2): jobs.prepare writes them, a run trains on them
through np.memmap, a token file several times larger than the memory the process may use trains,
nanoGPT's meta-less folders train with data.vocab_size, and bad files stop the job with exit 2."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np

from hsgd.train.data import _packaged_text
from tests.integration.runs import FAST, REPO, train, train_cli

SHORT = [
    "topology.clusters=1",
    "topology.replicas_per_cluster=2",
    "sync.outer_every=4",
    "train.rounds=3",
    "checkpoint.every=0",
    "optim.inner.lr=1e-2",
]


def _text_folder(tmp_path):
    text = _packaged_text()
    src = tmp_path / "text"
    (src / "more").mkdir(parents=True)
    (src / "a.txt").write_text(text[:150_000])
    (src / "more" / "b.txt").write_text(text[150_000:300_000])
    return src


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_prepared_folder_of_text_trains_through_memmap(tmp_path):
    out = tmp_path / "tokens"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.prepare", str(_text_folder(tmp_path)), str(out)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert (out / "train.bin").stat().st_size == 2 * meta["train_tokens"] > 0
    assert (out / "val.bin").stat().st_size == 2 * meta["val_tokens"] > 0
    s = train(tmp_path / "run", SHORT + [f"data.path={out}"])
    assert s["status"] == "completed" and s["rounds_committed"] == 3
    assert s["final_eval_loss"] < s["initial_eval_loss"], (s["initial_eval_loss"], s["final_eval_loss"])
    assert len(set(s["replica_param_digests"].values())) == 1, s["replica_param_digests"]


class _Tripwire:
    """Unpickling this creates `path`: proof that meta.pkl was loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_nanogpt_folder_without_meta_trains_with_data_vocab_size_and_meta_pkl_is_never_loaded(tmp_path):
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    ids = np.frombuffer(_packaged_text()[:300_000].encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    ids[:270_000].tofile(folder / "train.bin")
    ids[270_000:].tofile(folder / "val.bin")
    tripwire = tmp_path / "meta_pkl_was_loaded"
    (folder / "meta.pkl").write_bytes(pickle.dumps(_Tripwire(tripwire)))
    s = train(tmp_path / "run", SHORT + [f"data.path={folder}", "data.vocab_size=320"])
    assert s["status"] == "completed" and s["final_eval_loss"] < s["initial_eval_loss"]
    assert not tripwire.exists(), "meta.pkl was unpickled"
    # without data.vocab_size the job stops before Ray, naming the field and why meta.pkl is no help
    proc = train_cli(FAST + [f"data.path={folder}", f"run.dir={tmp_path / 'bad'}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("hsgd: config error: data.vocab_size"), line
    assert "meta.pkl is a pickle and is never loaded" in line
    assert not tripwire.exists()


def test_bad_token_files_exit_2_with_one_line(tmp_path):
    ok = (np.arange(5000) % 200).astype(np.uint16)
    cases = {}
    odd = tmp_path / "odd"
    odd.mkdir()
    ok.tofile(odd / "train.bin")
    (odd / "val.bin").write_bytes(ok[:500].tobytes() + b"\x07")
    (odd / "meta.json").write_text(json.dumps({"vocab_size": 200, "dtype": "uint16"}))
    cases[odd] = ("data.path", "val.bin holds 1001 bytes")
    high = tmp_path / "high"
    high.mkdir()
    ok.tofile(high / "train.bin")
    bad_val = ok[:500].copy()
    bad_val[321] = 4000
    bad_val.tofile(high / "val.bin")
    (high / "meta.json").write_text(json.dumps({"vocab_size": 200, "dtype": "uint16"}))
    cases[high] = ("data.path", "val.bin holds token id 4000 at token 321")
    for folder, (field, words) in cases.items():
        proc = train_cli(FAST + [f"data.path={folder}", f"run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
        line = proc.stderr.strip()
        assert proc.returncode == 2, (folder.name, proc.stderr[-2000:])
        assert "\n" not in line and line.startswith(f"hsgd: config error: {field}") and words in line, line
        assert not (tmp_path / "run").exists(), "a config error must stop the job before it makes a run folder"


LIMITED = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np, torch
    from omegaconf import OmegaConf
    from hsgd.config.schema import HsgdConfig
    from hsgd.core.topology import Topology
    from hsgd.train.comm import LevelGroup
    from hsgd.train.data import check_data
    from hsgd.train.trainer import ReplicaTrainer

    torch.set_num_threads(1)
    folder, headroom = sys.argv[1], int(sys.argv[2])

    def vm_data():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData"))

    limit = vm_data() + headroom  # what the interpreter and torch already hold, plus the headroom
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    try:  # the control: reading the token file whole is refused under this limit
        np.fromfile(os.path.join(folder, "train.bin"), dtype=np.uint16)
        whole_read = "allowed"
    except MemoryError:
        whole_read = "refused"
    cfg = OmegaConf.merge(OmegaConf.structured(HsgdConfig), OmegaConf.from_dotlist([
        f"data.path={folder}", "data.batch_size=4", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
        "model.block_size=32", "topology.clusters=1", "topology.replicas_per_cluster=1", "sync.outer_every=4",
        "sync.outer=none", "train.eval_batches=2"]))
    check_data(cfg)
    trainer = ReplicaTrainer(cfg, "c0r0", Topology(1, 1))
    inner = LevelGroup("inner")
    inner.configure(None, "limited", 0, 1, 0)
    report = trainer.run_inner(0, inner)
    print(json.dumps({"limit": limit, "whole_read": whole_read, "losses": report.losses,
                      "eval_loss": trainer.eval_loss(), "vocab_size": trainer.dataset.vocab_size,
                      "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")


def test_token_file_several_times_larger_than_the_memory_limit_trains(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    size = 8 << 30  # 8 GiB of uint16 tokens: a sparse file, so the disk holds only what is written
    rng = np.random.default_rng(0)
    with open(folder / "train.bin", "wb") as f:
        f.truncate(size)
        for at in (0, size // 3, size // 2, size - (1 << 20)):  # real tokens at both ends and between
            f.seek(at)
            f.write(rng.integers(0, 256, 1 << 19, dtype=np.uint16).tobytes())
    rng.integers(0, 256, 100_000, dtype=np.uint16).tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16", "tokenizer": "byte"}))
    headroom = 256 << 20
    proc = subprocess.run(
        [sys.executable, "-c", LIMITED, str(folder), str(headroom)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["whole_read"] == "refused", "the RLIMIT_DATA limit did not bind; the test proves nothing"
    assert size >= 4 * out["limit"], (size, out["limit"])
    assert len(out["losses"]) == 4 and all(np.isfinite(out["losses"])) and np.isfinite(out["eval_loss"])
    assert out["maxrss"] < size / 8, out
