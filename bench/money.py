"""Benchmark: the Receivables page and a statement at 10,000 invoices against 1,000.

    python bench/money.py                     # about a minute
    python bench/money.py --invoices 20000

Builds two databases as bench.py does (1,000 products, 200 customers), invoices every order
(issued over the past 200 days, on 30-day terms, so that every aging bucket holds some),
pays a third of them, and times the pages through the WSGI app in this process (no network,
one thread): the median and p95 of --requests calls, the two databases taking turns. The
statement is of one customer with the same 20 invoices at both sizes: what grows is the
company's history, not that customer's.
"""

import argparse
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402
import dashboard  # noqa: E402
import ordering  # noqa: E402

DAY_MS = 86_400_000


def invoice_everything(path, data, now_ms):
    """Every order invoiced, one in three paid; one more customer with 20 invoices of its
    own. Returns that customer's ID."""
    random.seed(11)
    db = ordering.Database(path)
    try:
        with db.write() as conn:
            ordering.update_company(conn, data["company"], {"payment_terms_days": 30})
            for order_id in data["orders"]:
                issued = now_ms - random.randint(0, 200) * DAY_MS
                invoice = ordering.invoice_order(conn, data["company"], order_id, issued,
                                                 announce=False)
                if random.random() < 1 / 3:
                    ordering.record_payment(conn, data["company"], invoice["id"],
                                            ordering.cents_from_number(invoice["total"]),
                                            now_ms=now_ms)
            regular = ordering.create_customer(conn, data["company"], {
                "email": "regular@bench.example", "name": "Regular"})["id"]
            for _ in range(20):
                order = ordering.place_order(conn, data["company"], {
                    "customerId": regular, "items": [{"productId": data["products"][0],
                                                      "quantity": 1}]})
                ordering.invoice_order(conn, data["company"], order["id"], now_ms,
                                       announce=False)
        db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    return regular


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--invoices", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="ordering-money-bench-")
    now_ms = int(time.time() * 1000)
    apps, browsers, paths = [], [], []
    for count in (1000, args.invoices):
        path = os.path.join(workdir, f"invoices-{count}.db")
        started = time.perf_counter()
        data = bench.build_database(path, count)
        regular = invoice_everything(path, data, now_ms)
        print(f"built {count:,} invoices in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
        app, browser = dashboard.signed_in(path, data)
        apps.append(app)
        browsers.append(browser)
        paths.append({"receivables": "/dashboard/receivables",
                      "statement (20 invoices)": f"/dashboard/customers/{regular}/statement"})
    dashboard.measure_and_print(apps, browsers, paths, args.requests, args.invoices)


if __name__ == "__main__":
    main()
