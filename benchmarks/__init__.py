"""hsgd's benchmarks, apart from the product: `python -m benchmarks <suite> [--quick] [--out DIR]`.

Suites (each a module here named as the suite, with its own `main`): overhead, recovery, goodput,
scale, straggler, plan, inner, ddp, convergence, sites, outer_exchange, report, and with no suite the default one
(hierarchical vs flat, benchmarks/cli.py). `peers/` holds the systems hsgd is compared with (plain
DDP, torchft, Ray Train), `fake_ray.py` the fake Ray `plan` times the supervisor's decisions on,
and `fault_costs.py` the goodput suite's split of a fault's time, read from a run's record.
The suites' committed results (`<suite>.json`, `<suite>.png`) sit beside them; BENCHMARKS.md is
rendered from those JSONs by `python -m benchmarks report --from benchmarks`.

`python -m jobs.bench <suite> [args]` is an alias (jobs/bench.py) that runs the same `main`. A suite
records the command it ran as `python -m benchmarks <suite> ...` (results recorded before the move
say `python -m jobs.bench ...`: the alias still runs them). This package may import `actors`,
`hsgd` and `jobs`; nothing there imports it but that alias.
"""
