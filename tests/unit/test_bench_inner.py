"""`python -m benchmarks inner`: one process, no Ray, three variants of the same inner step; with
`--gpus-per-replica 2`, hsgd's replica at k=1 and sharded over 2 gloo rank processes as well."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.inner import peak_flops

ROOT = Path(__file__).resolve().parents[2]


def test_peak_table_matches_device_names():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("Some Future Card") is None


def test_bench_inner_runs_without_ray_and_writes_every_figure(tmp_path):
    # sys.modules["ray"] = None makes any `import ray` on the bench's path raise ImportError
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from benchmarks.cli import main\n"
        f"sys.exit(main(['inner', '--presets', 'tiny', '--steps', '2', '--repeats', '2', '--out', {str(tmp_path)!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "inner.json").read_text())
    assert report["ray_imported"] is False and report["device"] in ("cpu", "cuda")
    (tiny,) = report["results"]
    assert tiny["preset"] == "tiny" and set(tiny["variants"]) == {"hsgd", "plain", "tuned"}
    for name, v in tiny["variants"].items():
        assert len(v["tokens_per_s"]) == 2 and v["tokens_per_s_median"] > 0, name
    # same model, batch, seed and numerics: hsgd and the hand-written loop reach the same loss
    assert abs(tiny["variants"]["hsgd"]["last_loss"] - tiny["variants"]["plain"]["last_loss"]) < 1e-4
    assert tiny["ratio"]["hsgd_vs_plain"] > 0 and tiny["ratio"]["hsgd_vs_tuned"] > 0
    param_bytes = tiny["params"] * 4
    assert tiny["heal"]["bytes"] >= 3 * param_bytes  # params + AdamW's two moments (+ outer state)
    assert tiny["heal"]["steady_gb_per_s"] > 0
    assert "hsgd/tuned" in proc.stdout and "inner.json" in proc.stdout


def test_gpus_per_replica_runs_k1_and_k2_in_one_invocation_and_k2_holds_less_state_per_rank(tmp_path):
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from benchmarks.cli import main\n"
        "sys.exit(main(['inner', '--presets', 'tiny', '--steps', '2', '--repeats', '2', "
        f"'--gpus-per-replica', '2', '--out', {str(tmp_path)!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "inner.json").read_text())
    sharded = report["sharded"]
    assert sharded["gpus_per_replica"] == 2 and sharded["skipped"] is None and sharded["backend"] == "gloo"
    (tiny,) = sharded["results"]
    assert tiny["preset"] == "tiny" and set(tiny["k"]) == {"1", "2"}, "both k must have run"
    one, two = tiny["k"]["1"], tiny["k"]["2"]
    assert (one["rows_per_rank"], two["rows_per_rank"]) == (tiny["batch_size"], tiny["batch_size"] // 2)
    for v in (one, two):
        assert len(v["tokens_per_s"]) == 2 and min(v["tokens_per_s"]) > 0, v
        assert len(v["state_bytes_per_rank"]) == v["ranks"]
        parts = v["state_bytes_by_part_rank0"]
        assert parts["total"] == sum(b for name, b in parts.items() if name != "total")
        # what a DiLoCo replica holds after a commit: params, grads, AdamW, global params, momentum
        assert min(parts[n] for n in ("params", "grads", "inner_optimizer", "global_params", "outer_momentum")) > 0
    # k=1 holds the whole model's fp32 params; each of k=2's ranks about half of them
    assert one["state_bytes_by_part_rank0"]["params"] == report["results"][0]["params"] * 4
    assert two["state_bytes_per_rank_max"] < one["state_bytes_per_rank_max"]
    assert tiny["ratio"]["state_bytes_per_rank"] == two["state_bytes_per_rank_max"] / one["state_bytes_per_rank_max"]
    assert tiny["ratio"]["state_bytes_per_rank"] <= 0.6
    assert tiny["ratio"]["tokens_per_s"] == two["tokens_per_s_median"] / one["tokens_per_s_median"]
    # same seed, tokens and replica batch: the sharded replica trains as the whole one does
    assert abs(two["last_loss"] - one["last_loss"]) <= 1e-4 * abs(one["last_loss"])
    assert "k=1 vs k=2" in proc.stdout and "repeat 2/2 k=2" in proc.stderr


def test_gpus_per_replica_refuses_a_batch_that_does_not_split_across_the_ranks(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "inner",
            "--presets",
            "tiny",
            "--batch-size",
            "5",
            "--gpus-per-replica",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and not (tmp_path / "inner.json").exists()
    assert "--gpus-per-replica 2" in proc.stderr and "--batch-size" in proc.stderr
