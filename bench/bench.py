"""Benchmark: the service against its own stack's ceilings, measured in one run.

    python bench/bench.py                  # full run: 3 rounds of 10 s per measurement
    python bench/bench.py --smoke          # a few seconds, tiny database: checks it all works

Figures mean something only on a quiet machine: the run refuses to start while the load
average (one minute) is above 1, unless --busy is given, and then the report says so at its
top. The load average before and after the run is printed with the figures (the run itself
keeps both cores busy, so the figure after it is about 2 whatever else ran).

Needs wrk (Debian: apt-get install wrk). Prints a table of req/s, p50 and p99 for each
measurement, the ratio of each to its ceiling, the server's peak RSS and the WAL size. The
storage ceilings are raw sqlite3 committing one order per transaction, at synchronous = FULL
(what the service ships, and the POST ceiling's storage half) and NORMAL (for reference).
"""

import argparse
import os
import random
import re
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import ordering  # noqa: E402

TWO_CORES = (os.cpu_count() or 1) >= 2
#: The one-minute load average above which a run is refused (see the module's docstring).
QUIET_LOAD = 1.0


# Building the database through the module's own functions --------------------------------

def build_database(path, orders, products=1000, customers=200, seed=7):
    """path: a SQLite file or a postgresql:// URL (an empty database)."""
    random.seed(seed)
    db = ordering.Database(path)
    with db.write() as conn:
        company = ordering.create_company(conn, "Bench Wholesale", "bench")["id"]
        key = ordering.create_api_key(conn, company, list(ordering.SCOPES),
                                      rate_limit=10 ** 9)["key"]
        product_ids = [ordering.create_product(
            conn, company, name=f"Product {i}", sku=f"SKU-{i}", category=f"Cat {i % 10}",
            price_cents=random.randint(100, 10000), stock=10 ** 9)["id"] for i in range(products)]
        customer_ids = [ordering.create_customer(conn, company, {
            "email": f"buyer{i}@bench.example", "name": f"Buyer {i}"})["id"]
            for i in range(customers)]
    made = 0
    while made < orders:
        with db.write() as conn:
            for _ in range(min(2000, orders - made)):
                ordering.place_order(conn, company, {
                    "customerId": random.choice(customer_ids),
                    "items": [{"productId": p, "quantity": random.randint(1, 5)}
                              for p in random.sample(product_ids, 3)]})
                made += 1
    order_ids = [row[0] for row in db.conn.execute(
        "SELECT id FROM orders ORDER BY created_at DESC, id DESC")]
    if db.engine is ordering.SQLITE:
        db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    else:
        # What autovacuum does to freshly loaded tables within a minute or so, done now so
        # that it does not happen during a measurement.
        db.conn.execute("VACUUM ANALYZE")
    db.close()
    return {"key": key, "company": company, "products": product_ids,
            "customers": customer_ids, "orders": order_ids}


# Servers -----------------------------------------------------------------------------------

def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pinned(core, command):
    """command on one core where there are two (core None: unpinned)."""
    pin = core is not None and TWO_CORES and shutil.which("taskset")
    return (["taskset", "-c", str(core)] if pin else []) + command


def start(command, port, log_path, core=0, env=None):
    log = open(log_path, "w")
    process = subprocess.Popen(pinned(core, command), stdout=log, stderr=log,
                               env=None if env is None else dict(os.environ, **env))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"server did not start: {command}")


def stop(process):
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()


def peak_rss_mb(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# Load --------------------------------------------------------------------------------------

GET_SCRIPT = """
wrk.headers["Authorization"] = "Bearer {key}"
"""

POST_SCRIPT = """
wrk.method = "POST"
wrk.headers["Authorization"] = "Bearer {key}"
wrk.headers["Content-Type"] = "application/json"
local products = {{{products}}}
local customers = {{{customers}}}
math.randomseed(os.time())
request = function()
  local a = math.random(#products)
  local b = (a % #products) + 1
  local c = (b % #products) + 1
  local body = string.format(
    '{{"customerId":"%s","items":[{{"productId":"%s","quantity":1}},' ..
    '{{"productId":"%s","quantity":2}},{{"productId":"%s","quantity":1}}]}}',
    customers[math.random(#customers)], products[a], products[b], products[c])
  return wrk.format(nil, nil, nil, body)
end
"""



def scripts(data):
    """wrk's Lua scripts for a database from build_database: (GET with its key, POST order)."""
    def quoted(ids):
        return ",".join(f'"{i}"' for i in ids)
    return (GET_SCRIPT.format(key=data["key"]),
            POST_SCRIPT.format(key=data["key"], products=quoted(data["products"]),
                               customers=quoted(data["customers"])))


def medians(runs):
    """{label: [wrk results]} as {label: the median of each figure}."""
    return {label: {field: statistics.median(r[field] for r in results)
                    for field in ("rps", "p50", "p99")} for label, results in runs.items()}


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def wrk(url, script, seconds, connections, workdir, core=1):
    script_path = os.path.join(workdir, "script.lua")
    with open(script_path, "w") as handle:
        handle.write(script)
    output = subprocess.run(pinned(core, ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s",
                                       "--latency", "-s", script_path, url]),
                            capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))
    latency = {}
    for label in ("50%", "99%"):
        value, unit = re.search(label + r"\s+([\d.]+)(us|ms|s)", output).groups()
        latency[label] = float(value) * _UNITS[unit]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    if errors:
        raise RuntimeError(f"{url}: {errors.group(1)} error responses\n{output}")
    return {"rps": rps, "p50": latency["50%"], "p99": latency["99%"]}


def storage_ceiling(path, data, count, synchronous, ledger=False):
    """Raw sqlite3 doing one order's writes (3 items), one commit per order. With ledger, also
    the rows the service writes beside them since the stock ledger and order numbers: the
    order's number (the company's highest plus one), a stock movement a line and the order's
    first status change."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    started = time.perf_counter()
    for n in range(count):
        products = random.sample(data["products"], 3)
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute("SELECT id, price_cents, stock FROM products WHERE id IN (?, ?, ?)",
                            products).fetchall()
        order_id = f"ceiling_{n}"
        now = ordering.now_iso()
        number = None
        if ledger:
            number = conn.execute("SELECT COALESCE(MAX(number), 0) + 1 FROM orders WHERE "
                                  "company_id = ?", (data["company"],)).fetchone()[0]
        conn.execute("INSERT INTO orders (id, company_id, customer_id, status, total_cents, "
                     "source, number, created_at, updated_at) VALUES (?, ?, ?, 'SUBMITTED', ?, "
                     "'api', ?, ?, ?)", (order_id, data["company"], data["customers"][0],
                                         sum(r[1] for r in rows), number, now, now))
        conn.executemany("INSERT INTO order_items (id, order_id, position, product_id, quantity, "
                         "unit_price_cents) VALUES (?, ?, ?, ?, 1, ?)",
                         [(f"{order_id}_{i}", order_id, i, r[0], r[1])
                          for i, r in enumerate(rows)])
        conn.executemany("UPDATE products SET stock = stock - 1 WHERE id = ?",
                         [(r[0],) for r in rows])
        if ledger:
            conn.executemany(
                "INSERT INTO stock_movements (id, company_id, product_id, change, level_after, "
                "reason, order_id, actor_type, created_at) VALUES (?, ?, ?, -1, ?, 'order', ?, "
                "'system', ?)", [(f"{order_id}_m{i}", data["company"], r[0], r[2] - 1, order_id,
                                  now) for i, r in enumerate(rows)])
            conn.execute("INSERT INTO order_status_changes (id, order_id, to_status, source, "
                         "created_at) VALUES (?, ?, 'SUBMITTED', 'api', ?)",
                         (f"{order_id}_s", order_id, now))
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return count / elapsed


def last_page_in_process(small, small_data, large, large_data, rounds=30, calls=20):
    """The last page of a cursor walk at 1,000 and at N orders, through the WSGI app in this
    process, alternating between the two databases so that load from elsewhere on the machine
    hits both alike. Returns the median cost at N over the median cost at 1,000."""
    import webtest
    pages = []
    for path, data in ((small, small_data), (large, large_data)):
        api = webtest.TestApp(ordering.create_app(path, deliver=False, ip_rate_limit=0))
        pages.append((api, f"/api/v1/orders?limit=50&cursor={data['orders'][-51]}",
                      {"Authorization": "Bearer " + data["key"]}))
    costs = ([], [])
    for _ in range(rounds):
        for (api, url, headers), cost in zip(pages, costs):
            started = time.perf_counter()
            for _ in range(calls):
                api.get(url, headers=headers)
            cost.append(time.perf_counter() - started)
    return statistics.median(costs[1]) / statistics.median(costs[0])


# The run -----------------------------------------------------------------------------------

def measure(args, workdir):
    small = os.path.join(workdir, "small.db")
    large = os.path.join(workdir, "large.db")
    started = time.monotonic()
    small_data = build_database(small, 1000)
    print(f"built 1,000 orders in {time.monotonic() - started:.1f}s", file=sys.stderr)
    started = time.monotonic()
    large_data = build_database(large, args.orders)
    print(f"built {args.orders:,} orders in {time.monotonic() - started:.1f}s", file=sys.stderr)

    get_script, post_script = scripts(large_data)
    rounds = {name: [] for name in ("ceiling GET", "ceiling POST", "GET order",
                                    "GET products (50)", "GET orders (50)", "POST order",
                                    "last page @1k", "last page @N", "storage FULL",
                                    "storage NORMAL", "storage FULL, with the ledger")}
    rss = wal = None
    for round_number in range(args.rounds):
        port = free_port()
        ceiling = start([sys.executable, os.path.join(HERE, "ceiling_app.py"), str(port),
                         str(args.threads)], port, os.path.join(workdir, "ceiling.log"))
        try:
            base = f"http://127.0.0.1:{port}"
            rounds["ceiling GET"].append(wrk(base + "/get", "", args.seconds, args.connections,
                                             workdir))
            rounds["ceiling POST"].append(wrk(base + "/post", post_script, args.seconds,
                                              args.connections, workdir))
        finally:
            stop(ceiling)
        for path, data, label in ((small, small_data, "last page @1k"),
                                  (large, large_data, None)):
            port = free_port()
            service = start([sys.executable, os.path.join(ROOT, "ordering.py"), "--db", path,
                             "serve", "--port", str(port), "--threads", str(args.threads),
                             "--ip-rate-limit", "0"], port, os.path.join(workdir, "service.log"))
            base = f"http://127.0.0.1:{port}/api/v1"
            script = GET_SCRIPT.format(key=data["key"])
            last_page = f"{base}/orders?limit=50&cursor={data['orders'][-51]}"
            try:
                if label:
                    rounds[label].append(wrk(last_page, script, args.seconds, args.connections,
                                             workdir))
                    continue
                rounds["GET order"].append(wrk(f"{base}/orders/{data['orders'][0]}", get_script,
                                               args.seconds, args.connections, workdir))
                rounds["GET products (50)"].append(wrk(f"{base}/products?limit=50", get_script,
                                                       args.seconds, args.connections, workdir))
                rounds["GET orders (50)"].append(wrk(f"{base}/orders?limit=50", get_script,
                                                     args.seconds, args.connections, workdir))
                rounds["last page @N"].append(wrk(last_page, get_script, args.seconds,
                                                  args.connections, workdir))
                rounds["POST order"].append(wrk(f"{base}/orders", post_script, args.seconds,
                                                args.connections, workdir))
                rss = peak_rss_mb(service.pid)
                wal = os.path.getsize(path + "-wal") / 2 ** 20 if os.path.exists(
                    path + "-wal") else 0.0
            finally:
                stop(service)
        for label, synchronous, ledger in (("storage FULL", "FULL", False),
                                           ("storage NORMAL", "NORMAL", False),
                                           ("storage FULL, with the ledger", "FULL", True)):
            copy = os.path.join(workdir, "storage.db")
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(copy + suffix):
                    os.remove(copy + suffix)
            shutil.copy(small, copy)
            rps = storage_ceiling(copy, small_data, args.storage_orders, synchronous, ledger)
            rounds[label].append({"rps": rps, "p50": float("nan"), "p99": float("nan")})
        print(f"round {round_number + 1} of {args.rounds} done", file=sys.stderr)
    walk = last_page_in_process(small, small_data, large, large_data)
    return medians(rounds), rss, wal, walk


def report(results, rss, wal, walk_in_process, args):
    fw_get = results["ceiling GET"]["rps"]
    fw_post = results["ceiling POST"]["rps"]
    storage = results["storage FULL"]["rps"]
    post_ceiling = 1 / (1 / fw_post + 1 / storage)
    ledger_ceiling = 1 / (1 / fw_post + 1 / results["storage FULL, with the ledger"]["rps"])
    targets = {
        "GET order": (fw_get, 0.7, "framework GET"),
        "GET products (50)": (fw_get, 0.4, "framework GET"),
        "GET orders (50)": (fw_get, 0.2, "framework GET"),
        "POST order": (post_ceiling, 0.9, "framework POST + FULL storage in series"),
    }
    lines = [f"{args.orders:,} orders, 1,000 products, 200 customers; {args.threads} server "
             f"threads, {args.connections} connections, {args.seconds}s per run, median of "
             f"{args.rounds}; server on core 0, wrk on core 1" if TWO_CORES else "one core",
             "",
             "| measurement | req/s | p50 ms | p99 ms | p99/p50 | ratio | target | ceiling |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, result in results.items():
        ratio, target, ceiling = "", "", ""
        if name in targets:
            base, goal, ceiling = targets[name]
            ratio, target = f"{result['rps'] / base:.2f}x", f">= {goal}x"
        spread = result["p99"] / result["p50"] if result["p50"] == result["p50"] else float("nan")
        lines.append(f"| {name} | {result['rps']:,.0f} | {result['p50']:.2f} | "
                     f"{result['p99']:.2f} | {spread:.1f} | {ratio} | {target} | {ceiling} |")
    walk = results["last page @1k"]["rps"] / results["last page @N"]["rps"]
    lines += ["",
              f"- POST ceiling (framework POST and FULL storage in series): "
              f"{post_ceiling:,.0f} req/s; with the ledger's rows in the storage: "
              f"{ledger_ceiling:,.0f} req/s, POST order "
              f"{results['POST order']['rps'] / ledger_ceiling:.2f}x of it",
              f"- the service under test ships synchronous = {ordering.Settings().synchronous}",
              f"- last page at {args.orders:,} orders costs {walk:.2f}x the same page at 1,000 "
              f"(target <= 1.3x); in process, alternating between the two: "
              f"{walk_in_process:.2f}x",
              f"- server peak RSS after the run: {rss:.1f} MB (target <= 80 MB)",
              f"- WAL file after the run: {wal:.1f} MB (target < 64 MB)"]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=100_000, help="orders in the large database")
    parser.add_argument("--seconds", type=int, default=10, help="duration of each wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--threads", type=int, default=4, help="server threads (both servers; the service default)")
    parser.add_argument("--storage-orders", type=int, default=3000)
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: checks the bench")
    parser.add_argument("--busy", action="store_true",
                        help="run although the load average is above 1 (the report says so)")
    args = parser.parse_args()
    before = os.getloadavg()[0]
    if before > QUIET_LOAD and not (args.busy or args.smoke):
        sys.exit(f"load average {before:.2f} is above {QUIET_LOAD}: other work would be measured "
                 "too. Wait for a quiet machine (nothing else running), or pass --busy to run "
                 "anyway with the report marked.")
    if args.smoke:
        args.orders, args.seconds, args.rounds, args.storage_orders = 2000, 1, 1, 200
    if not shutil.which("wrk"):
        sys.exit("wrk is needed: apt-get install wrk")
    with tempfile.TemporaryDirectory() as workdir:
        results, rss, wal, walk = measure(args, workdir)
    after = os.getloadavg()[0]
    if before > QUIET_LOAD:
        print(f"**NOT A QUIET MACHINE: load average {before:.2f} before the run (above "
              f"{QUIET_LOAD}); these figures include other work.**\n")
    print(f"load average (1 min): {before:.2f} before the run, {after:.2f} after it\n")
    print(report(results, rss, wal, walk, args))


if __name__ == "__main__":
    main()
