"""The config before Ray starts: compose it as Hydra would, turn Hydra's nested errors into one
line, and every check that needs no cluster (`precheck`), each refusal a one-line `ConfigError`."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hsgd.config.capacity import PROCESS_BYTES, embedded_capacity_problem, rank_state_bytes, usable_memory_bytes
from hsgd.config.layout import RunLayout, sites_and_ranks
from hsgd.config.paths import output_path, under_ray_job
from hsgd.config.schema import ConfigError, HsgdConfig, register_schema
from hsgd.config.validate import NUMERIC_FIELDS, validate
from hsgd.record.rundir import read_json
from hsgd.record.runlock import LOCK_NAME

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_config(overrides: list[str]) -> DictConfig:
    """The resolved config for these overrides, as Hydra would build it. Raises Hydra/OmegaConf
    errors for bad keys or types; does not validate."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    plain = [o for o in overrides if not o.startswith("-") and not o.lstrip("+~").startswith("hydra")]
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="hsgd"):
        cfg = compose(config_name="config", overrides=plain)
    OmegaConf.resolve(cfg)
    return cfg


def describe_hydra_error(err: BaseException) -> str:
    """One line from Hydra/OmegaConf's nested errors: the field and what went wrong."""
    from omegaconf.errors import OmegaConfBaseException

    chain, cause = [], err
    while cause is not None and len(chain) < 5:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    for e in chain:
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            msg = str(getattr(e, "msg", "") or e).split("\n")[0]
            return f"{e.full_key}: {msg}"
    return " ".join(str(err).split())[:400]


def precheck(overrides: list[str], *, run_folder: bool = False) -> None:
    """Compose and validate the config before Ray starts (and, with `run_folder`, check_run_folder
    before Hydra writes its `.hydra/` there). Raises ConfigError."""
    try:
        cfg = compose_config(overrides)
        validate(cfg)
        if not attaches_to_cluster(cfg):
            check_embedded_capacity(cfg)
        if run_folder:
            check_run_folder(os.path.abspath(output_path(cfg.run.dir)), bool(cfg.train.resume))
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 — Hydra/OmegaConf parse and type errors
        field, _, problem = describe_hydra_error(err).partition(": ")
        if field in NUMERIC_FIELDS and "valid:" not in problem:  # e.g. seed=1e23: "could not be converted to Integer"
            problem += f"; valid: {NUMERIC_FIELDS[field].describe()}"
        raise ConfigError(field, problem) from err


def attaches_to_cluster(cfg) -> bool:
    """True when the run attaches to an existing Ray cluster instead of starting an embedded one."""
    return bool(
        cfg.ray.address
        or os.environ.get("RAY_ADDRESS")
        or under_ray_job()
        or os.environ.get("RAY_JOB_ID")
        or os.environ.get("RAY_JOB_SUBMISSION_ID")
    )


def check_embedded_capacity(cfg: HsgdConfig, layout: RunLayout | None = None) -> int:
    """Raise ConfigError when the embedded cluster cannot hold the topology (replicas and spares, each
    of topology.gpus_per_replica rank processes); returns how many replicas it will hold."""
    (topo, ranks), t = sites_and_ranks(cfg, layout), cfg.topology
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 2**40  # unknown: do not refuse on memory (a container limit, if any, still counts)
    n = topo.num_replicas + topo.clusters * t.spares_per_cluster
    problem = embedded_capacity_problem(
        replicas=n,
        cpus_per_replica=t.cpus_per_replica,
        cores=os.cpu_count() or 1,
        num_cpus=cfg.ray.num_cpus,
        memory_bytes=usable_memory_bytes(physical),
        ranks=ranks,
        per_replica_bytes=PROCESS_BYTES
        + rank_state_bytes(cfg.model.n_layer, cfg.model.n_embd, cfg.model.block_size, ranks),
    )
    if problem is not None:
        raise ConfigError("topology.replicas_per_cluster", problem)
    return n


def is_hsgd_run_folder(folder: Path) -> bool:
    """What only hsgd writes: its lock, or a run.json or finalized checkpoint manifest
    (`checkpoints/round_*/manifest.json`: one copied by hand to resume from) naming a run id (a
    non-empty string `run_id`). A common file name (config.yaml, checkpoints/) proves nothing."""
    if (folder / LOCK_NAME).exists():
        return True
    infos = (read_json(m) for m in [folder / "run.json", *sorted(folder.glob("checkpoints/round_*/manifest.json"))])
    return any(
        isinstance(info, dict) and isinstance(info.get("run_id"), str) and info["run_id"] != "" for info in infos
    )  # lazily: stops at the first marker that names a run


def check_run_folder(run_dir: str, resume: bool, *, hydra_wrote: bool = False) -> None:
    """Raise ConfigError (one line) when this run may not use run_dir. Read-only: jobs.train calls it
    before Hydra writes, run_training again before it takes the lock (`hydra_wrote`: Hydra's own
    `.hydra/` and `*.log` there then do not make the folder foreign)."""
    from hsgd.record import runlock

    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise ConfigError("run.dir", f"{run_dir} exists and is not a folder; choose a new run.dir")
    entries = sorted(os.listdir(p)) if p.is_dir() else []
    if hydra_wrote:
        entries = [e for e in entries if e != ".hydra" and not e.endswith(".log")]
    if entries and not is_hsgd_run_folder(p):
        raise ConfigError(
            "run.dir",
            f"{run_dir} is not empty and is not an hsgd run folder (no {LOCK_NAME}, "
            f"no run.json of an hsgd run; it holds {', '.join(entries[:3])}"
            f"{', ...' if len(entries) > 3 else ''}); choose a new or empty folder",
        )
    try:
        runlock.check(run_dir, takeover=resume)
    except runlock.RunLocked as err:
        raise ConfigError("run.dir", str(err)) from err
    if not resume and {"summary.json", "supervisor_state.json"} & set(entries):
        raise ConfigError("run.dir", f"{run_dir} already holds a run; choose a new run.dir or add train.resume=true")
