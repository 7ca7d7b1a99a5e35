"""Benchmark: the pages that grow with a business's history, small against large.

    python bench/growth.py           # a few minutes, most of it building the large database
    python bench/growth.py --smoke   # tiny and quick: checks the bench

Two databases, each built as bench.py builds one (1,000 products, 200 customers) and then
grown by plain inserts of rows shaped as the service writes them:

- receivables and a statement: 1,000 against 10,000 invoices, one every three hours up to
  today (the large database has the longer history), half of them one customer's (the
  statement's), the rest spread over the other customers, a fifth of them open;
- a product's stock history: 1,000 against 1,000,000 movements of that product;
- the dashboard's lists (customers, products, returns, invoices, emails; the orders list is
  dashboard.py's): 1,000 against 100,000 rows each;
- the store's catalog and a buyer's order history, among those 100,000 customers and
  products.

A staff account and a buyer are signed in to each, and each page is timed through the WSGI app in this
process (no network, one thread), the two databases taking turns request by request, so
that load from elsewhere falls on both alike: the median and p95 of --requests calls, and
the ratio of the medians (the budget: at most 1.3x).
"""

import argparse
import os
import sqlite3
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import webtest  # noqa: E402

import bench  # noqa: E402
import dashboard  # noqa: E402
import ordering  # noqa: E402

DAY_MS = 86_400_000
#: A business invoices at the same pace in both databases, up to today: the large one has the
#: longer history (a statement's period holds about as many invoices in both).
INVOICE_EVERY_MS = 3 * 3_600_000


def timed_ids(prefix, count, start_ms, step_ms=1):
    """count IDs of prefix and their creation times, step_ms apart from start_ms, sorting as
    the service's own do."""
    return [(f"{prefix}_{start_ms + i * step_ms:012x}{i:018x}",
             ordering.iso(start_ms + i * step_ms)) for i in range(count)]


def insert(conn, table, rows):
    columns = list(rows[0])
    conn.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES "
                     f"({', '.join('?' for _ in columns)})",
                     [tuple(row[column] for column in columns) for row in rows])


def grow(path, data, invoices, movements, rows):
    """Add the invoices, one product's movements and the list rows to a database from
    bench.build_database; returns the statement's customer and the product."""
    company, customers, orders = data["company"], data["customers"], data["orders"]
    now = int(time.time() * 1000)
    start = now - 400 * DAY_MS
    conn = sqlite3.connect(path)
    with conn:
        owner = customers[0]
        insert(conn, "customer_invoices", [{
            "id": made, "company_id": company, "order_id": orders[i],
            "customer_id": owner if i % 2 == 0 else customers[1 + i % (len(customers) - 1)],
            "sequence": i + 1, "number": ordering.INVOICE_NUMBER.format(i + 1),
            "status": "OPEN" if i % 5 == 0 else "PAID", "subtotal_cents": 10_000,
            "tax_rate": 0, "tax_cents": 0, "total_cents": 10_000,
            "paid_cents": 0 if i % 5 == 0 else 10_000, "credited_cents": 0, "terms_days": 30,
            "issued_at": at, "due_at": ordering.iso(ordering.js_parse_date(at) + 30 * DAY_MS),
            "reminders_sent": 0, "next_reminder_at": None, "created_at": at,
            "updated_at": at} for i, (made, at) in enumerate(timed_ids(
                "cin", invoices, now - invoices * INVOICE_EVERY_MS, INVOICE_EVERY_MS))])
        product = data["products"][0]
        for first in range(0, movements, 100_000):
            insert(conn, "stock_movements", [{
                "company_id": company, "created_at": at, "id": made, "product_id": product,
                "change": -1, "level_after": 10 ** 9 - first - i, "reason": "adjustment",
                "order_id": None, "return_id": None, "note": None, "actor_type": "system",
                "actor_id": None} for i, (made, at) in enumerate(timed_ids(
                    "mov", min(100_000, movements - first), start + first))])
        ids = timed_ids("cus", rows, start)
        insert(conn, "customers", [{
            "id": made, "email": f"list{i}@growth.example", "email_key": f"list{i}@growth.example",
            "name": f"Listed {i}", "status": "ACTIVE", "company_id": company, "created_at": at,
            "updated_at": at} for i, (made, at) in enumerate(ids)])
        insert(conn, "products", [{
            "id": made, "name": f"Listed product {i}", "sku": f"L-{i}", "price_cents": 500,
            "stock": 10, "company_id": company, "created_at": at, "updated_at": at}
            for i, (made, at) in enumerate(timed_ids("prod", rows, start))])
        insert(conn, "returns", [{
            "id": made, "company_id": company, "order_id": orders[i % len(orders)],
            "customer_id": None, "status": "REQUESTED", "reason": "Damaged", "item_count": 1,
            "created_at": at, "updated_at": at}
            for i, (made, at) in enumerate(timed_ids("ret", rows, start))])
        insert(conn, "emails", [{
            "id": made, "company_id": company, "kind": "order_confirmation",
            "to_address": f"list{i}@growth.example", "subject": "Your order", "data": "{}",
            "state": "sent", "queued_at": at, "next_attempt_at": at, "created_at": at,
            "finished_at": at} for i, (made, at) in enumerate(timed_ids("eml", rows, start))])
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return owner, product


def pages(owner, product):
    return {
        "receivables": "/dashboard/receivables",
        "statement (the customer with half the invoices)":
            f"/dashboard/customers/{owner}/statement",
        "invoices list": "/dashboard/invoices",
        "a product's stock history": f"/dashboard/products/{product}/stock",
        "a product's page (its latest movements)": f"/dashboard/products/{product}",
        "customers list": "/dashboard/customers",
        "products list": "/dashboard/products",
        "returns list": "/dashboard/returns",
        "emails list": "/dashboard/emails",
    }


BUYER_EMAIL, BUYER_PASSWORD = "buyer@growth.example", "growth buyer password"


def signed_in_buyer(app, data):
    """A browser signed in at the store as a buyer of the bench's company, through its form."""
    with app.service.db.write() as conn:
        ordering.create_customer(conn, data["company"], {
            "email": BUYER_EMAIL, "name": "Growth Buyer"}, source="storefront",
            password=BUYER_PASSWORD, email_verified=True)
    browser = webtest.TestApp(app)
    form = browser.get("/store/bench/sign-in").forms[0]
    form["email"], form["password"] = BUYER_EMAIL, BUYER_PASSWORD
    form.submit(status=303)
    return browser


#: The store's pages a buyer sees at every size: the lists' 100,000 customers are the
#: store's other customers, and their 100,000 products its catalog.
STORE_PAGES = {"the store's catalog (a buyer's)": "/store/bench/products",
               "the store's order history (a buyer's)": "/store/bench/orders"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--invoices", type=int, default=10_000)
    parser.add_argument("--movements", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: checks the bench")
    args = parser.parse_args()
    small = (1000, 1000, 1000)
    large = (args.invoices, args.movements, args.rows)
    if args.smoke:
        small, large, args.requests = (20, 20, 20), (200, 200, 200), 5
    print(f"load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    workdir = tempfile.mkdtemp(prefix="ordering-growth-bench-")
    apps, browsers, paths, buyers = [], [], [], []
    for invoices, movements, rows in (small, large):
        path = os.path.join(workdir, f"growth-{invoices}-{movements}-{rows}.db")
        started = time.perf_counter()
        data = bench.build_database(path, invoices)
        owner, product = grow(path, data, invoices, movements, rows)
        print(f"built {invoices:,} invoices, {movements:,} movements and {rows:,} rows of each "
              f"list in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        app, browser = dashboard.signed_in(path, data)
        apps.append(app)
        browsers.append(browser)
        paths.append(pages(owner, product))
        buyers.append(signed_in_buyer(app, data))
    try:
        measured = dashboard.time_pages(browsers, paths, args.requests)
        measured |= dashboard.time_pages(buyers, [STORE_PAGES] * 2, args.requests)
    finally:
        for app in apps:
            app.service.close(grace=0)
    print("| page | p50 ms small | p50 ms large | p95 ms small | p95 ms large | p50 ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, ((small_p50, small_p95), (large_p50, large_p95)) in measured.items():
        print(f"| {label} | {small_p50:.2f} | {large_p50:.2f} | {small_p95:.2f} | "
              f"{large_p95:.2f} | {large_p50 / small_p50:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
