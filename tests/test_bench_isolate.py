"""benchmarks/bench_resnet_dcn.py's run_isolated on stand-in workers (tests/_bench_standin.py): the processes compile
side by side, each timing runs alone after every compile, a process that ends without a record still gets one;
which nets compile with torch's compile caches."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import _bench_standin  # noqa: E402
import bench_resnet_dcn  # noqa: E402


def test_compiles_side_by_side_then_timings_one_at_a_time():
    kinds = ("a", "ends-early", "b", "ends-late")
    specs = [(k, "b32-224", "bfloat16", "default") for k in kinds]
    settings = dict(compile_s=2.0, measure_s=0.3)
    logged = []
    records = bench_resnet_dcn.run_isolated(specs, settings, logged.append, worker=_bench_standin.worker)
    assert [r["net"] for r in records] == list(kinds) and logged == records
    assert all(r["compiled_beside"] == 3 for r in records)
    for r in records:
        assert ("error" in r) == r["net"].startswith("ends"), r
    assert "exit code 3" in records[1]["error"] and "exit code 4" in records[3]["error"]
    done = [r for r in records if "window" in r]
    windows = sorted(r["window"] for r in done)
    assert windows[0][1] <= windows[1][0]  # one timing at a time
    starts = [r["start"] for r in done]
    assert max(starts) - min(starts) < settings["compile_s"], starts  # the compiles overlapped
    assert min(w[0] for w in windows) >= max(starts) + settings["compile_s"]  # no timing before every compile is done


def test_compile_caches_off_for_deformconv_unless_warm():
    import argparse

    ap = argparse.ArgumentParser()
    bench_resnet_dcn.add_route_args(ap)
    ap.add_argument("--warm-caches", action="store_true")
    try:
        for argv, deformconv_on in (([], False), (["--warm-caches"], True)):
            bench_resnet_dcn.apply_settings(ap.parse_args(argv))
            assert bench_resnet_dcn.compile_caches("deformconv") is deformconv_on
            assert bench_resnet_dcn.compile_caches("torchvision") and bench_resnet_dcn.compile_caches("plain")
    finally:
        bench_resnet_dcn.apply_settings(ap.parse_args([]))
