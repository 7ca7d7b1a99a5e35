"""Group commit against one commit per order, on a flush made slow on purpose.

    python bench/group_commit.py            # 5 s per measurement, about a minute
    python bench/group_commit.py --quick    # 1 s per measurement

Writers on real threads place orders through the service's own write path (Database.write()
and place_order) on a SQLite file at synchronous = FULL. A slow disk is modelled by holding
each COMMIT for a further FLUSH milliseconds after SQLite's own sync, while the write
connection stays busy, as a slow fsync holds it: writers that arrive meanwhile queue. One
commit per order is the same code with a batch of at most one body (GROUP_COMMIT_LIMIT = 1).
Prints orders per second and orders per commit for each flush time and writer count.
"""

import argparse
import os
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ordering  # noqa: E402


def measure(path, flush_ms, batch_limit, writers, seconds):
    """(orders per second, orders per commit) with writers threads for seconds."""
    db = ordering.Database(path)
    with db.write() as conn:
        company = ordering.create_company(conn, f"Bench {time.monotonic_ns()}")["id"]
        product = ordering.create_product(conn, company, name="Tea", price_cents=450,
                                          stock=10 ** 9)["id"]
        customer = ordering.create_customer(conn, company, {"email": "b@bench.example"})["id"]
    body = {"customerId": customer, "items": [{"productId": product, "quantity": 1}]}
    real_commit = db._commit

    def slow_commit(conn):
        real_commit(conn)
        time.sleep(flush_ms / 1000)
    db._commit = slow_commit
    limit, ordering.GROUP_COMMIT_LIMIT = ordering.GROUP_COMMIT_LIMIT, batch_limit
    placed, commits_before = [0] * writers, db.commits
    deadline = time.monotonic() + seconds

    def writer(number):
        while time.monotonic() < deadline:
            with db.write() as conn:
                ordering.place_order(conn, company, body)
            placed[number] += 1
    try:
        threads = [threading.Thread(target=writer, args=(n,)) for n in range(writers)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
    finally:
        ordering.GROUP_COMMIT_LIMIT = limit
        db.close()
    commits = db.commits - commits_before
    return sum(placed) / elapsed, sum(placed) / max(commits, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seconds = 1.0 if args.quick else args.seconds
    print(f"load average (1 min) before: {os.getloadavg()[0]:.2f}")
    print("| flush added | writers | one commit per order | group commit | "
          "orders per commit | gain |")
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as workdir:
        for flush_ms in (0, 1, 5):
            for writers in (1, 16):
                path = os.path.join(workdir, f"f{flush_ms}w{writers}.db")
                single, _ = measure(path, flush_ms, 1, writers, seconds)
                grouped, per_commit = measure(path, flush_ms, 64, writers, seconds)
                print(f"| {flush_ms} ms | {writers} | {single:,.0f}/s | {grouped:,.0f}/s | "
                      f"{per_commit:.1f} | {grouped / single:.2f}x |")
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
