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
    form = browser.get("/dashboard/sign-in").forms[0]
    form["email"], form["password"] = "staff@bench.example", PASSWORD
    form.submit(status=303)
    return app, browser


def pages(data):
    orders = data["orders"]
    return {
        "first page": "/dashboard/orders",
        "last page (cursor)": f"/dashboard/orders?cursor={orders[-51]}",
        "status filter": "/dashboard/orders?status=SUBMITTED",
        # a customer has some 5 orders among 1,000 and 500 among 100,000: 5 rows on both
        "customer filter (5 rows)": f"/dashboard/orders?customerId={data['customers'][0]}"
                                    f"&limit=5",
        "date range": "/dashboard/orders?since=2000-01-01&until=2999-01-01",
        "search by order ID": f"/dashboard/orders?search={orders[len(orders) // 2]}",
        "search by PO number": "/dashboard/orders?search=PO-4711",
        "order page": f"/dashboard/orders/{orders[len(orders) // 2]}",
    }


def time_pages(browsers, paths, requests):
    """{page: {size: (p50 ms, p95 ms)}}. The databases take turns request by request, so a
    change in the machine's load falls on both alike."""
    results = {}
    for label in paths[0]:
        took = [[] for _ in browsers]
        for browser, path in zip(browsers, paths):
            browser.get(path[label], status=200)  # warm the page cache
        for _ in range(requests):
            for browser, path, times in zip(browsers, paths, took):
                started = time.perf_counter()
                browser.get(path[label], status=200)
                times.append((time.perf_counter() - started) * 1000)
        results[label] = [(statistics.median(times), sorted(times)[int(len(times) * 0.95) - 1])
                          for times in took]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="ordering-dashboard-bench-")
    apps, browsers, paths = [], [], []
    for count in (1000, args.orders):
        path = os.path.join(workdir, f"orders-{count}.db")
        started = time.perf_counter()
        data = bench.build_database(path, count)
        print(f"built {count:,} orders in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
        app, browser = signed_in(path, data)
        apps.append(app)
        browsers.append(browser)
        paths.append(pages(data))
    measure_and_print(apps, browsers, paths, args.requests, args.orders)


def measure_and_print(apps, browsers, paths, requests, large):
    """Time the pages (see time_pages), close the apps, and print the table: the small
    database against the one of `large` records."""
    try:
        measured = time_pages(browsers, paths, requests)
    finally:
        for app in apps:
            app.service.close(grace=0)
    print(f"| page | p50 ms @1,000 | p50 ms @{large:,} | p95 ms @1,000 | "
          f"p95 ms @{large:,} | p50 ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, ((small_p50, small_p95), (large_p50, large_p95)) in measured.items():
        print(f"| {label} | {small_p50:.2f} | {large_p50:.2f} | {small_p95:.2f} | "
              f"{large_p95:.2f} | {large_p50 / small_p50:.2f}x |")


if __name__ == "__main__":
    main()
