"""Benchmark: the storefront's pages against the API's, at size, and checkout against placement.

    python bench/storefront.py             # about 6 minutes: 3 rounds of 10 s per measurement
    python bench/storefront.py --smoke     # a few seconds, tiny databases: checks it all works

Three measurements, each against its own reference in the same run:

(a) the catalog: GET /store/{slug}/products?limit=50 with a signed-in buyer's cookie (the
    buyer has its own prices for a fifth of the products) against GET /api/v1/products?limit=50
    with an API key, over HTTP: `ordering.py serve` on core 0, wrk on core 1 (goal: the page
    costs at most 1.5x the API's page).
(b) at size: a buyer's order history, GET /store/{slug}/orders, and the dashboard's order
    list, GET /dashboard/orders, at --orders orders (default 100,000) against the same pages at
    1,000, over HTTP in the same way (goal: within 1.3x). The buyer holds one order in ten at
    both sizes, so both sizes fill the page.
(c) checkout against API order placement, in this process through the operations: each
    checkout (`checkout()`: the cart of 3 lines, at the buyer's prices, shipped to a saved
    address, a confirmation email queued, the cart emptied) against `place_order()` of the same
    3 lines, each in a write transaction of its own at synchronous = FULL, one thread, taking
    turns. Filling the cart (3 `add_to_cart`, a transaction of its own) is not timed: a buyer
    does it on pages before checking out. No webhook subscribes, so neither writes events.

A storefront page this build does not serve (404) is reported as such and not measured.

Figures mean something only on a quiet machine: as bench.py, the run refuses to start while
the one-minute load average is above 1, unless --busy is given (the report then says so), and
prints the load average before and after the run. Needs wrk (Debian: apt-get install wrk).
"""

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import bench  # noqa: E402
import ordering  # noqa: E402

BUYER_EMAIL = "buyer@bench.example"
STAFF_EMAIL = "staff@bench.example"
#: The buyer's share of the orders (one in ten) and of the products with a price of its own.
BUYER_ORDER_SHARE = 10
BUYER_PRICE_SHARE = 5
ADDRESS = {"name": "Bench Receiving", "line1": "1 Quay Street", "city": "Leith",
           "postalCode": "EH6 6LX", "country": "GB"}


# Data, through the module's own functions ---------------------------------------------------

def build(path, orders):
    """bench.py's database (1,000 products, 200 customers, `orders` orders), then a buyer with
    a password, prices of its own, a saved address and one order in ten, and a staff account;
    each signed in. Returns bench.build_database's dict with "buyer", its own "contact",
    "buyerCookie" and "staffCookie" (Cookie header values)."""
    others = orders - orders // BUYER_ORDER_SHARE
    data = bench.build_database(path, others)
    db = ordering.Database(path)
    now_ms = int(time.time() * 1000)
    idle = ordering.Settings().session_idle_seconds
    with db.write() as conn:
        buyer = ordering.create_customer(conn, data["company"], {
            "email": BUYER_EMAIL, "name": "Bench Buyer"}, source="storefront",
            password="bench buyer password", email_verified=True)["id"]
        contact = ordering.customer_contacts(conn, buyer)[0]
        for product_id in data["products"][::BUYER_PRICE_SHARE]:
            ordering.set_customer_price(conn, data["company"], buyer, product_id,
                                        random.randint(50, 9000))
        ordering.save_address(conn, buyer, ordering.parse_address(ADDRESS))
        staff = ordering.create_staff(conn, data["company"], STAFF_EMAIL, "bench staff password")
        buyer_token = ordering.start_session(
            conn, ordering.CONTACTS, contact, ordering.sign_in_subjects(
                BUYER_EMAIL, "bench"), now_ms, idle)
        staff_token = ordering.start_session(
            conn, ordering.STAFF, staff, ordering.sign_in_subjects(STAFF_EMAIL, "bench"),
            now_ms, idle)
    made = 0
    while made < orders // BUYER_ORDER_SHARE:
        with db.write() as conn:
            for _ in range(min(2000, orders // BUYER_ORDER_SHARE - made)):
                ordering.place_order(conn, data["company"], {"customerId": buyer, "items": [
                    {"productId": p, "quantity": 1}
                    for p in random.sample(data["products"], 3)]}, source="storefront")
                made += 1
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return dict(data, buyer=buyer, contact=contact["id"],
                buyerCookie=f"{ordering.STORE_SESSION_COOKIE}={buyer_token}",
                staffCookie=f"{ordering.SESSION_COOKIE}={staff_token}")


# (a) and (b): pages over HTTP ---------------------------------------------------------------

def pages(data):
    """{label: (path, request headers)} of one database."""
    buyer, staff = {"Cookie": data["buyerCookie"]}, {"Cookie": data["staffCookie"]}
    return {"API products (50)": ("/api/v1/products?limit=50",
                                  {"Authorization": "Bearer " + data["key"]}),
            "store products (50)": ("/store/bench/products?limit=50", buyer),
            "store orders (buyer)": ("/store/bench/orders", buyer),
            "dashboard orders": ("/dashboard/orders", staff)}


def wrk_script(headers):
    return "".join(f'wrk.headers["{name}"] = "{value}"\n' for name, value in headers.items())


def served(base, path, headers):
    """Whether the server answers path with 200 (False for a 404: not served by this build)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers),
                                    timeout=30) as answer:
            return answer.status == 200
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return False
        raise


def measure_pages(args, workdir, small, small_data, large, large_data):
    """{label: {"1k": [wrk results], "N": [...]}} and the labels a server did not serve."""
    results, missing = {}, set()
    for round_number in range(args.rounds):
        for path, data, size in ((small, small_data, "1k"), (large, large_data, "N")):
            port = bench.free_port()
            server = bench.start([sys.executable, os.path.join(ROOT, "ordering.py"), "--db",
                                  path, "serve", "--port", str(port), "--threads",
                                  str(args.threads), "--ip-rate-limit", "0"], port,
                                 os.path.join(workdir, "service.log"))
            base = f"http://127.0.0.1:{port}"
            try:
                for label, (page, headers) in pages(data).items():
                    if size == "1k" and "products" in label:
                        continue  # the catalog is the same at both sizes: measured at N
                    if label in missing or not served(base, page, headers):
                        missing.add(label)
                        continue
                    results.setdefault(label, {}).setdefault(size, []).append(bench.wrk(
                        base + page, wrk_script(headers), args.seconds, args.connections,
                        workdir))
            finally:
                bench.stop(server)
        print(f"pages: round {round_number + 1} of {args.rounds} done", file=sys.stderr)
    return {label: {size: bench.medians({label: runs})[label] for size, runs in sizes.items()}
            for label, sizes in results.items()}, missing


# (c): checkout against placement, in process ------------------------------------------------

def measure_checkout(path, data, count):
    """{"API placement": [seconds per order], "checkout": [...]}, taking turns."""
    db = ordering.Database(path)
    company, buyer, contact = data["company"], data["buyer"], data["contact"]
    address_id = ordering.customer_addresses(db.conn, buyer)[0]["id"]
    took = {"API placement": [], "checkout": []}
    try:
        for n in range(count):
            products = random.sample(data["products"], 3)
            started = time.perf_counter()
            with db.write() as conn:
                ordering.place_order(conn, company, {"customerId": buyer, "items": [
                    {"productId": p, "quantity": 1} for p in products]})
            took["API placement"].append(time.perf_counter() - started)
            with db.write() as conn:
                for p in products:
                    ordering.add_to_cart(conn, company, contact, p, 1)
            started = time.perf_counter()
            with db.write() as conn:
                ordering.checkout(conn, "bench", contact, f"bench-checkout-{n:08d}",
                                  address_id=address_id)
            took["checkout"].append(time.perf_counter() - started)
    finally:
        db.close()
    return took


# The report ---------------------------------------------------------------------------------

def report(args, measured, missing, took):
    lines = [f"{args.orders:,} orders against {args.small:,} (the buyer's: one in ten), 1,000 "
             f"products; "
             f"{args.threads} server threads, {args.connections} connections, {args.seconds} s "
             f"per run, median of {args.rounds}" + ("; server on core 0, wrk on core 1"
                                                    if bench.TWO_CORES else "; one core"),
             "",
             f"| page | req/s @{args.small:,} | p50 / p99 ms @{args.small:,} | req/s "
             f"@{args.orders:,} | p50 / p99 ms @{args.orders:,} |",
             "|---|---:|---:|---:|---:|"]
    for label, sizes in measured.items():
        cells = []
        for size in ("1k", "N"):
            figures = sizes.get(size)
            cells += ([f"{figures['rps']:,.0f}", f"{figures['p50']:.2f} / {figures['p99']:.2f}"]
                      if figures else ["", ""])
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    catalog = measured.get("store products (50)")
    if catalog:
        cost = measured["API products (50)"]["N"]["rps"] / catalog["N"]["rps"]
        lines.append(f"- (a) the store's catalog page costs {cost:.2f}x the API's page of 50 "
                     f"(goal: at most 1.5x)")
    for label in ("store orders (buyer)", "dashboard orders"):
        if label in measured:
            cost = measured[label]["1k"]["rps"] / measured[label]["N"]["rps"]
            lines.append(f"- (b) {label} at {args.orders:,} orders costs {cost:.2f}x its cost "
                         f"at {args.small:,} (goal: at most 1.3x)")
    for label in sorted(missing):
        lines.append(f"- {label}: not served by this build (404), not measured")
    rates = {label: len(times) / sum(times) for label, times in took.items()}
    lines += [f"- (c) in process, {len(took['checkout']):,} of each, taking turns: API "
              f"placement {rates['API placement']:,.0f} orders/s (p50 "
              f"{statistics.median(took['API placement']) * 1000:.2f} ms), checkout "
              f"{rates['checkout']:,.0f} orders/s (p50 "
              f"{statistics.median(took['checkout']) * 1000:.2f} ms): a checkout costs "
              f"{rates['API placement'] / rates['checkout']:.2f}x a placement"]
    return "\n".join(lines)


#: The whole numbers a run takes: (option, default, help).
OPTIONS = (("--orders", 100_000, "orders in the large database"),
           ("--seconds", 10, "duration of each wrk run"),
           ("--rounds", 3, "runs per measurement (median)"),
           ("--connections", 16, "wrk's connections"),
           ("--threads", 4, "server threads"),
           ("--checkouts", 2000, "checkouts (and API placements) measured in process"))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for option, default, text in OPTIONS:
        parser.add_argument(option, type=int, default=default, help=text)
    for option, text in (("--smoke", "tiny and quick: checks the bench"),
                         ("--busy", "run although the load average is above 1 (the report "
                                    "says so)")):
        parser.add_argument(option, action="store_true", help=text)
    args = parser.parse_args()
    before = os.getloadavg()[0]
    if before > bench.QUIET_LOAD and not (args.busy or args.smoke):
        sys.exit(f"load average {before:.2f} is above {bench.QUIET_LOAD}: other work would be "
                 "measured too. Wait for a quiet machine, or pass --busy to run anyway with the "
                 "report marked.")
    args.small = 1000
    if args.smoke:
        args.small, args.orders, args.seconds, args.rounds, args.checkouts = 100, 1000, 1, 1, 30
    if not shutil.which("wrk"):
        sys.exit("wrk is needed: apt-get install wrk")
    random.seed(7)
    with tempfile.TemporaryDirectory() as workdir:
        small, large = (os.path.join(workdir, name) for name in ("small.db", "large.db"))
        started = time.monotonic()
        small_data, large_data = build(small, args.small), build(large, args.orders)
        print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr)
        measured, missing = measure_pages(args, workdir, small, small_data, large, large_data)
        took = measure_checkout(small, small_data, args.checkouts)
    after = os.getloadavg()[0]
    if before > bench.QUIET_LOAD:
        print(f"**NOT A QUIET MACHINE: load average {before:.2f} before the run (above "
              f"{bench.QUIET_LOAD}); these figures include other work.**\n")
    print(f"load average (1 min): {before:.2f} before the run, {after:.2f} after it\n")
    print(report(args, measured, missing, took))


if __name__ == "__main__":
    main()
