"""`python -m benchmarks inner`: one process, no Ray, three variants of the same inner step."""
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
    code = ("import sys; sys.modules['ray'] = None\n"
            "from benchmarks.cli import main\n"
            f"sys.exit(main(['inner', '--presets', 'tiny', '--steps', '2', '--repeats', '2', '--out', {str(tmp_path)!r}]))")
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
