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


def _benchmark_script(name: str):
    """benchmarks/<name>.py, imported as a module (benchmarks/ is no package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ring_scaling():
    return _benchmark_script("ring_scaling")


def test_ring_scaling_script_prints_its_table(tmp_path, capsys):
    """benchmarks/ring_scaling.py runs, reads rates from a JSON, and its numbers follow the
    model: sent bytes and hop times from the shard, compute from the rates."""
    scaling = _ring_scaling()
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"forward_tflops": 100.0, "forward_backward_tflops": 50.0}))
    scaling.main(["--rates", str(rates), "--lengths", "1048576", "--devices", "8", "1024"])
    out = capsys.readouterr().out
    assert "| 1,048,576 | 8 | 131,072 |" in out and "| 1,048,576 | 1024 | 1,024 |" in out
    assert str(rates) in out and "Head sharding" in out
    step = scaling.ring_step(2**20, 8, heads=32, kv_heads=32, dim=128,
                             rates={"forward_tflops": 100.0, "forward_backward_tflops": 50.0})
    assert step["sent_fwd"] == 2 * 32 * 131072 * 128 * 2
    assert step["fwd_s"] == pytest.approx(4 * 32 * 131072**2 * 128 * 0.5 / 100e12)
    assert step["bwd_s"] == pytest.approx(3.5 * 4 * 32 * 131072**2 * 128 * 0.5 / 50e12)
    assert step["hop_fwd_IB"] == pytest.approx(step["sent_fwd"] / 50e9)


def _score_terms_script():
    return _benchmark_script("score_terms_gpu")


def test_score_terms_benchmark_parses_its_arguments():
    """benchmarks/score_terms_gpu.py imports on a CPU; its defaults are issue 27's target
    (16k tokens, window 1024, a 32-bucket table, Triton) and bad arguments are refused."""
    script = _score_terms_script()
    args = script.parse_args([])
    assert (args.length, args.window, args.buckets, args.kernel) == (
        16384, 1024, 32, ["TritonBlockSparse"])
    assert args.masks == ["causal", "window"] and args.kv_heads == args.heads
    assert script.parse_args(["--kernel", "MosaicBlockSparse", "TritonBlockSparse"]).kernel == [
        "MosaicBlockSparse", "TritonBlockSparse"]
    with pytest.raises(SystemExit):
        script.parse_args(["--kernel", "Nope"])
    with pytest.raises(SystemExit):
        script.parse_args(["--heads", "6", "--kv-heads", "4"])


@pytest.mark.slow
def test_score_terms_benchmark_runs_on_cpu(tmp_path, capsys):
    """The same code on the XLA kernel at a small size: every row timed, ratios to `none`,
    and traced (`--device-times`)."""
    out = tmp_path / "scores.json"
    _score_terms_script().main(["--kernel", "XlaBlockSparse", "--length", "128", "--window",
                                "32", "--batch", "1", "--heads", "2", "--dim", "16", "--reps",
                                "1", "--buckets", "8", "--max-distance", "20", "--masks",
                                "window", "--scores", "none", "both", "--no-flex", "--out",
                                str(out), "--device-times"])
    records = json.loads(out.read_text())["records"]
    assert [(r["mask"], r["score"]) for r in records] == [("window", "none"), ("window", "both")]
    assert all("error" not in r and r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in records)
    # A CPU has no GPU stream: each pass is traced, and holds no kernel.
    assert all(r["device_us"] == {"fwd": {}, "fwdbwd": {}} for r in records)
    assert records[0]["fwd_vs_none"] == 1.0 and "fwd+bwd / none" in capsys.readouterr().out


def test_score_terms_device_times_read_the_gpu_streams(tmp_path):
    """`--device-times` sums each kernel's events on a GPU process's stream lines, by name,
    and leaves the host's events and the GPU's per-op summary lines out."""
    import gzip

    script = _score_terms_script()
    assert script.parse_args(["--device-times"]).device_times
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2,
             "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 3, "args": {"name": "XLA Ops"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "Stream"}}]
    events = [{"ph": "X", "name": "forward_kernel", "pid": 7, "tid": 2, "ts": 0, "dur": 30.0},
              {"ph": "X", "name": "forward_kernel", "pid": 7, "tid": 2, "ts": 50, "dur": 10.0},
              {"ph": "X", "name": "loop_fusion", "pid": 7, "tid": 2, "ts": 70, "dur": 2.5},
              {"ph": "X", "name": "forward_kernel", "pid": 7, "tid": 3, "ts": 0, "dur": 99.0},
              {"ph": "X", "name": "forward_kernel", "pid": 1, "tid": 2, "ts": 0, "dur": 99.0},
              {"ph": "i", "name": "forward_kernel", "pid": 7, "tid": 2, "ts": 5}]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "gpu.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    assert script.kernel_microseconds(str(tmp_path)) == {"forward_kernel": 40.0,
                                                        "loop_fusion": 2.5}
    record = {"impl": "ours", "mask": "causal", "score": "none",
              "device_us": {"fwd": {"forward_kernel": 40.0, "loop_fusion": 2.5}}}
    assert "| ours | causal | none | fwd | 42.5 | forward_kernel 40.0, loop_fusion 2.5 |" in (
        script._device_table([record]))


def test_compile_time_script_reads_the_kernels_compile_events(tmp_path):
    """benchmarks/mosaic_compile_time.py's `--profile` reads Mosaic GPU's `Compile` events
    from the profiler's trace files (any depth under the folder), in the order they ran, and
    nothing else; a child's error is its exception line, not a note printed after it."""
    import gzip

    script = _benchmark_script("mosaic_compile_time")
    events = [{"ph": "X", "name": "Compile", "ts": 30, "dur": 800_000},
              {"ph": "X", "name": "CompileToBackendResult", "ts": 5, "dur": 9_000_000},
              {"ph": "X", "name": "Compile", "ts": 10, "dur": 1_250_000},
              {"ph": "i", "name": "Compile", "ts": 20}]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert script.kernel_compiles(str(tmp_path)) == [1.25, 0.8]
    assert script.kernel_compiles(str(tmp_path / "plugins" / "none")) == []
    stderr = "Traceback:\n  ...\nValueError: kernel mosaic cannot run this call\n" \
             "For simplicity, JAX has removed its internal frames.\n"
    assert script.last_error(stderr) == "ValueError: kernel mosaic cannot run this call"
    assert script.last_error("") == "no output"


def test_ptxas_script_builds_signatures_and_reads_reports():
    """benchmarks/triton_ptxas.py: a launch's arrays (inputs, then outputs) are pointers of
    their dtype and the other parameters constexprs; ptxas' register and spill counts are
    read from its report, and a report without them is refused."""
    import numpy as np

    script = _benchmark_script("triton_ptxas")
    sig = script.signature(["Q", "LIST", "O", "H", "BLOCK_M"],
                           [np.dtype("float32"), np.dtype("int32"), np.dtype("int16")])
    assert sig == {"Q": "*fp32", "LIST": "*i32", "O": "*i16", "H": "constexpr",
                   "BLOCK_M": "constexpr"}
    with pytest.raises(ValueError, match="3 arrays for a kernel of 2 parameters"):
        script.signature(["Q", "O"], [np.dtype("float32")] * 3)
    report = ("ptxas info    : Compiling entry function 'dkdv_kernel' for 'sm_90a'\n"
              "ptxas info    : Function properties for dkdv_kernel\n"
              "    104 bytes stack frame, 216 bytes spill stores, 240 bytes spill loads\n"
              "ptxas info    : Used 255 registers, used 1 barriers, 104 bytes cumulative stack\n")
    assert script.ptxas_summary(report) == {"registers": 255, "spill_stores": 216,
                                            "spill_loads": 240}
    with pytest.raises(ValueError, match="no register or spill line"):
        script.ptxas_summary("ptxas info    : Used 40 registers\n")
