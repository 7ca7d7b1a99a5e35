"""Benchmark: many processes on one SQLite file.

    python bench/processes.py              # 3 rounds of 10 s per measurement, about 5 minutes
    python bench/processes.py --smoke      # a few seconds: checks it all works

Two measurements, each the median of the rounds, with configurations alternating within a round:

1. The shared rate counter: GET one order from `serve` (one process, pinned to core 0, wrk on
   core 1) with rate limits counted in the shared file (the default) and in the process
   (ORDERING_SHARED_RATE_LIMITS=0). Both the key and the address limits count (the address
   limit is set high enough never to refuse), so each request makes two counts.
2. `serve --workers 2` against `--workers 1`, unpinned (server and wrk share both cores), for
   GET one order, GET orders (50) and POST order.

It also times one count in process (µs per hit) for each counter. Needs wrk.
"""

import argparse
import os
import sys
import tempfile
import time

import bench
from bench import ROOT, free_port, ordering, start, stop, wrk


def hit_cost(counter, count=200_000):
    started = time.perf_counter()
    for number in range(count):
        counter.hit(f"key {number % 50}", 10 ** 9)
    return (time.perf_counter() - started) / count * 1e6


def serve(path, port, workdir, workers=1, core=0, env=None):
    return start([sys.executable, os.path.join(ROOT, "ordering.py"), "--db", path, "serve",
                  "--port", str(port), "--workers", str(workers),
                  "--ip-rate-limit", str(10 ** 9)], port, os.path.join(workdir, "service.log"),
                 core=core, env=env)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10, help="duration of each wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: checks the bench")
    args = parser.parse_args()
    if args.smoke:
        args.seconds, args.rounds = 1, 1
    workdir = tempfile.mkdtemp(prefix="ordering-processes-")
    path = os.path.join(workdir, "bench.db")
    data = bench.build_database(path, 200 if args.smoke else 1000)

    get_script, post_script = bench.scripts(data)
    one_order = f"/api/v1/orders/{data['orders'][0]}"
    runs = {}

    def run(label, url, script, core):
        result = wrk(url, script, args.seconds, args.connections, workdir, core=core)
        runs.setdefault(label, []).append(result)

    for round_number in range(args.rounds):
        for shared in ("1", "0"):
            port = free_port()
            server = serve(path, port, workdir, env={"ORDERING_SHARED_RATE_LIMITS": shared})
            try:
                run(f"GET order, {'shared file' if shared == '1' else 'in process'}",
                    f"http://127.0.0.1:{port}{one_order}", get_script, 1)
            finally:
                stop(server)
        for workers in (1, 2):
            port = free_port()
            server = serve(path, port, workdir, workers=workers, core=None)
            base = f"http://127.0.0.1:{port}"
            try:
                run(f"GET order, --workers {workers}", base + one_order, get_script, None)
                run(f"GET orders (50), --workers {workers}", base + "/api/v1/orders?limit=50",
                    get_script, None)
                run(f"POST order, --workers {workers}", base + "/api/v1/orders", post_script,
                    None)
            finally:
                stop(server)
        print(f"round {round_number + 1} of {args.rounds} done", file=sys.stderr)

    medians = bench.medians(runs)
    print("| measurement | req/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    for label, figures in medians.items():
        print(f"| {label} | {figures['rps']:,.0f} | {figures['p50']:.2f} | {figures['p99']:.2f} |")
    shared, local = medians["GET order, shared file"], medians["GET order, in process"]
    print(f"\n- Shared counter: {shared['rps'] / local['rps']:.2f}x the GET order rate of the "
          f"in-process counter.")
    for name in ("GET order", "GET orders (50)", "POST order"):
        ratio = medians[f"{name}, --workers 2"]["rps"] / medians[f"{name}, --workers 1"]["rps"]
        print(f"- {name}: --workers 2 gives {ratio:.2f}x the rate of --workers 1.")
    counter = ordering.SharedWindowCounter(os.path.join(workdir, "hits-rates"))
    print(f"- One count: {hit_cost(counter):.2f} µs in the shared file, "
          f"{hit_cost(ordering.WindowCounter()):.2f} µs in process.")
    counter.close()


if __name__ == "__main__":
    main()
