"""A stand-in for bench_resnet_dcn's per-case process (run_isolated's worker): no GPU, its "compile" a sleep, its
timing window recorded."""

import os
import time


def worker(spec, settings, ready, go, results):
    kind = spec[0]
    if kind == "ends-early":
        os._exit(3)
    start = time.time()
    time.sleep(settings["compile_s"])
    ready.set()
    go.wait()
    begin = time.time()
    time.sleep(settings["measure_s"])
    if kind == "ends-late":
        os._exit(4)
    results.put(dict(net=kind, start=start, window=(begin, time.time())))
