"""The run's topology as site requests shaped it: the applied add-sites in the order added
(hsgd/core/site_requests.py keeps their records), the topology widened by those that joined
(`joined_topology`), those a resumed run starts again one after the other or can never start
(`site_queue`, `stranded_notice`), and the `topology.sites` a new site's replicas start with
(`widened_sites`). Pure: records in, a Topology or a list out.
"""

from __future__ import annotations

from hsgd.core.site_requests import Outcome, RequestKind
from hsgd.core.topology import Topology


def applied_sites(done: dict[str, dict]) -> list[Outcome]:
    """The applied add-sites' outcome records, by their new cluster's index (the order they were added)."""
    sites = [d for d in map(Outcome.of, done.values()) if d.applied_as(RequestKind.ADD_SITE) and d.replicas >= 1]
    return sorted(sites, key=lambda d: d.cluster)


def joined_topology(
    base: Topology, done: dict[str, dict], joined_ids, drained_clusters=(), abandoned_ids=()
) -> Topology:
    """`base` (the config's topology) widened by the applied add-sites in the order added: each that
    joined in this run (`joined_ids`) or was drained since (`drained_clusters`: it joined once, and a
    drained index is never reused), up to the first that is neither (a resumed run starts it again:
    it and those after it are `SiteChanges`' queue); one abandoned before it joined (`abandoned_ids`)
    never was in it. Raises ValueError when a site's index is not the next one (a site added while
    another was still starting, which `SiteChanges` refuses)."""
    topology = base
    for d in applied_sites(done):
        if d.id in abandoned_ids or d.cluster < topology.clusters:
            continue  # given up; or a resume whose config has a site at its index (drained stays drained)
        if d.cluster != topology.clusters or (d.id not in joined_ids and d.cluster not in drained_clusters):
            break  # a gap (a resume with fewer clusters: `site_queue`'s stranded), or one to start again
        topology = topology.with_site(d.replicas, label=d.label, name=d.name)
    return topology


def site_queue(clusters: int, done: dict[str, dict], abandoned_ids=()) -> tuple[list[Outcome], list[Outcome]]:
    """The applied add-sites past a topology of `clusters` clusters (not abandoned), in the order added,
    split: (queue, stranded). `queue`: those it can take, each the next index (a resumed run starts them
    one after the other; a drained one only keeps its index). `stranded`: those after a gap, a resume
    whose config has fewer clusters than the sites added before them: never started in this run (a
    site's index is its data streams and its place in the record, so it is never renumbered)."""
    queue: list[Outcome] = []
    stranded: list[Outcome] = []
    for d in applied_sites(done):
        if d.id in abandoned_ids or d.cluster < clusters:
            continue
        (queue if not stranded and d.cluster == clusters + len(queue) else stranded).append(d)
    return queue, stranded


def stranded_notice(clusters: int, done: dict[str, dict], abandoned_ids=(), drained_clusters=()) -> str | None:
    """One line for a resume that cannot start an added site (`site_queue`'s stranded, a drained one not
    named: it never trains again), said before any actor starts; None when every one can start."""
    _, stranded = site_queue(clusters, done, abandoned_ids)
    named = [d.site for d in stranded if d.cluster not in drained_clusters]
    if not named:
        return None
    need = stranded[0].cluster
    return (
        f"train.resume: added site(s) {', '.join(named)} not started in this run: they come after "
        f"c0..c{need - 1}, and this config has {clusters} cluster(s); resume with {need} (topology.clusters or "
        f"topology.sites) to train with them. An add-site in this run is refused (it could never start)"
    )


SITE_KEYS = (
    "replicas",
    "label",
    "name",
    "min_replicas",
    "min_step_s",
    "straggle_p",
    "straggle_factor",
    "gpus_per_replica",
)


def widened_sites(configured: list[dict], topology: Topology) -> list[dict]:
    """`topology.sites` for the config a new site's replicas start with: the configured entries as they
    are (their pacing and floors), then one entry per site past them (the uniform keys' sites, a site
    that joined) from `topology`: its size, label and name, nothing else set."""
    out = [dict(site) for site in configured[: topology.clusters]]
    for c in range(len(out), topology.clusters):
        site = dict.fromkeys(SITE_KEYS)
        site.update(
            replicas=topology.size(c),
            label=topology.label(c),
            name=topology.names[c] if c < len(topology.names) else None,
        )
        out.append(site)
    return out
