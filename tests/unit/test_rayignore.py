"""`ray job submit --working-dir .` uploads the repo to every node: .rayignore keeps secrets out
(matched with Ray's own matcher, as the upload does) and the code in."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def excluded():
    from ray._private.runtime_env.packaging import _get_ignore_file

    match = _get_ignore_file(REPO, ignore_file=".rayignore")
    assert match is not None, "no .rayignore at the repo root"
    return lambda rel: match(REPO / rel)


@pytest.mark.parametrize(
    "rel",
    [
        ".env",
        ".env.local",
        "prod.env",
        "conf/.env",
        ".envrc",
        ".netrc",
        "sub/.netrc",
        ".pgpass",
        ".git-credentials",
        ".pypirc",
        "server.pem",
        "keys/tls.key",
        "id_rsa",
        "id_ed25519.pub",
        "credentials",
        "credentials.json",
        "gcp-credentials.json",
        ".aws/credentials",
        ".aws/config",
        ".config/gcloud/application_default_credentials.json",
        ".ssh/id_rsa",
        ".kube/config",
        "service-account-prod.json",
        "secrets.yaml",
        ".secrets/token",
    ],
)
def test_secrets_stay_out_of_the_upload(excluded, rel):
    assert excluded(rel), rel


@pytest.mark.parametrize(
    "rel",
    [
        "hsgd/train/trainer.py",
        "actors/launch.py",
        "jobs/train.py",
        "conf/config.yaml",
        "README.md",
        "examples/README.md",
        "hsgd/corpus/shakespeare.txt.xz",
        "pyproject.toml",
        "tests/unit/test_diagnose.py",
    ],
)
def test_the_code_is_uploaded(excluded, rel):
    assert not excluded(rel), rel
