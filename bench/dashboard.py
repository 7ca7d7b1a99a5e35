"""Benchmark: the dashboard's orders list at 100,000 orders against the same pages at 1,000.

    python bench/dashboard.py                  # about a minute (most of it building 100,000 orders)
    python bench/dashboard.py --orders 20000   # a smaller large database

Builds the two databases as bench.py does (1,000 products, 200 customers), signs a staff
account in, and times each page through the WSGI app in this process (no network, one
thread), so that the figure is the page's own cost: the median and p95 of --requests calls.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import webtest  # noqa: E402

import bench  # noqa: E402
import ordering  # noqa: E402

PASSWORD = "bench staff password"


def signed_in(path, data):
    app = ordering.create_app(path, deliver=False, ip_rate_limit=0)
    with app.service.db.write() as conn:
        ordering.create_staff(conn, data["company"], "staff@bench.example", PASSWORD)
    browser = webtest.TestApp(app)
    browser.post("/dashboard/sign-in", {"email": "staff@bench.example", "password": PASSWORD},
                 status=303)
    return app, browser


def pages(data):
    orders = data["orders"]
    return {
        "first page": "/dashboard/orders",
        "last page (cursor)": f"/dashboard/orders?cursor={orders[-51]}",
        "status filter": "/dashboard/orders?status=SUBMITTED",
        "customer filter": f"/dashboard/orders?customerId={data['customers'][0]}",
        "date range": "/dashboard/orders?since=2000-01-01&until=2999-01-01",
        "search by order ID": f"/dashboard/orders?search={orders[len(orders) // 2]}",
        "search by PO number": "/dashboard/orders?search=PO-4711",
        "order page": f"/dashboard/orders/{orders[len(orders) // 2]}",
    }


def time_pages(browser, paths, requests):
    results = {}
    for label, path in paths.items():
        browser.get(path, status=200)  # warm the page cache
        took = []
        for _ in range(requests):
            started = time.perf_counter()
            browser.get(path, status=200)
            took.append((time.perf_counter() - started) * 1000)
        took.sort()
        results[label] = (statistics.median(took), took[int(len(took) * 0.95) - 1])
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="ordering-dashboard-bench-")
    measured = {}
    for count in (1000, args.orders):
        path = os.path.join(workdir, f"orders-{count}.db")
        started = time.perf_counter()
        data = bench.build_database(path, count)
        print(f"built {count:,} orders in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
        app, browser = signed_in(path, data)
        try:
            measured[count] = time_pages(browser, pages(data), args.requests)
        finally:
            app.service.close(grace=0)
    small, large = measured[1000], measured[args.orders]
    print(f"| page | p50 ms @1,000 | p50 ms @{args.orders:,} | p95 ms @1,000 | "
          f"p95 ms @{args.orders:,} | p50 ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for label in small:
        print(f"| {label} | {small[label][0]:.2f} | {large[label][0]:.2f} | "
              f"{small[label][1]:.2f} | {large[label][1]:.2f} | "
              f"{large[label][0] / small[label][0]:.2f}x |")


if __name__ == "__main__":
    main()
