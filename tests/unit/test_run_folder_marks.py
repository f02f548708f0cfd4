"""Run-folder recognition (issue 31, Build 4): an hsgd run folder is recognised only by what only
hsgd writes — run.json holding an hsgd run id, or hsgd.lock — never by a common file name."""

from __future__ import annotations

import json

import pytest

from hsgd.config import ConfigError
from hsgd.config.compose import check_run_folder, is_hsgd_run_folder


@pytest.mark.parametrize(
    "files",
    [
        {"config.yaml": "lr: 0.1\n"},
        {"checkpoints/x": "1"},
        {"checkpoints/round_000002/manifest.json": '{"files": {}}'},
        {"run.json": "{}"},
        {"run.json": '{"run_id": 7}'},
        {"run.json": "[1]"},
        {"run.json": "not json"},
    ],
)
def test_a_folder_without_an_hsgd_mark_is_refused_and_left_untouched(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    assert not is_hsgd_run_folder(tmp_path)
    for resume in (False, True):
        with pytest.raises(ConfigError, match="not an hsgd run folder") as err:
            check_run_folder(str(tmp_path), resume)
        assert "\n" not in str(err.value)
    assert {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_run_json_with_an_hsgd_run_id_marks_a_run_folder(tmp_path):
    (tmp_path / "config.yaml").write_text("x: 1\n")
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "hsgd-1a2b3c"}))
    assert is_hsgd_run_folder(tmp_path)
    check_run_folder(str(tmp_path), resume=True)  # a run's folder: resumable
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a run"):
        check_run_folder(str(tmp_path), resume=False)


def test_a_checkpoint_copied_by_hand_marks_a_run_folder_to_resume_from(tmp_path):
    manifest = tmp_path / "checkpoints" / "round_000002" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"run_id": "hsgd-1a2b3c", "round": 2, "files": {}}))
    assert is_hsgd_run_folder(tmp_path)
    check_run_folder(str(tmp_path), resume=True)


def test_an_empty_folder_and_hydra_s_own_files_are_not_foreign(tmp_path):
    check_run_folder(str(tmp_path), resume=False)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "train.log").write_text("")
    check_run_folder(str(tmp_path), resume=False, hydra_wrote=True)
