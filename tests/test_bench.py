"""The benchmark's command line on the CPU: every kernel asked for is timed, each peer in its
own layout, its output agrees with ours, and the JSON says where it ran."""

import json

import pytest

from eqx_bsattn import bench


@pytest.mark.slow
def test_bench_times_every_kernel_and_records_the_environment(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--lengths", "128", "--patterns", "causal", "document", "--batch", "1",
                "--heads", "2", "--dim", "16", "--reps", "1", "--window", "32",
                "--kernels", "XlaBlockSparse", "DenseReference", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["platform"] == "cpu" and data["versions"]["jax"] == data["jax"]
    by = {(r["pattern"], r["impl"]): r for r in data["records"]}
    assert set(by) == {(p, i) for p in ("causal", "document")
                       for i in ("ours:xla", "ours:reference", "xla")}
    for (pattern, impl), r in by.items():
        assert "error" not in r, r
        assert r["layout"] == ("bhld" if impl.startswith("ours") else "blhd")
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0
        if impl != "ours:xla":  # the first implementation is the others' yardstick
            assert r["rel_diff_vs_ours"] < 1e-5, (pattern, impl, r["rel_diff_vs_ours"])
    # Each kernel against its own causal time.
    assert by[("causal", "ours:reference")]["fwd_tflops_vs_own_causal"] == pytest.approx(1.0)
    doc = by[("document", "ours:reference")]
    assert doc["fwd_tflops_vs_own_causal"] == pytest.approx(
        doc["fwd_tflops"] / by[("causal", "ours:reference")]["fwd_tflops"])
    assert "own input layout" in capsys.readouterr().out


def test_unknown_kernel_is_refused():
    with pytest.raises(SystemExit, match="unknown kernel 'Nope'"):
        bench.main(["--kernels", "Nope", "--lengths", "128"])
