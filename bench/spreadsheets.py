"""Benchmark: a CSV export of 100,000 orders against 10,000, and an import of 2,000 products.

    python bench/spreadsheets.py             # a few minutes, most of it building the data
    python bench/spreadsheets.py --smoke     # seconds: 1,000 and 2,000 orders, 200 products

Run as an operator runs them: `ordering.py export orders` and `ordering.py import products`,
each in a process of its own (pinned to the last core where there are two or more), the
export's CSV to /dev/null. For the export: the time, the rows (order lines) written a second,
and the process's peak resident memory (the child's getrusage), which is the claim to check:
rows are read and written a batch at a time, so the peak at 100,000 orders should be the
peak at 10,000. For the import: 2,000 new products (SKU, name, category, unit, price, stock,
quantity rules, price breaks) into a copy of a database with 1,000 products, then the same
company's products exported and imported again (every row unchanged, nothing written).
Median of --rounds runs; the load average before and after.
"""

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402

MODULE = os.path.join(os.path.dirname(HERE), "ordering.py")


def timed(args, stdout=subprocess.DEVNULL):
    """(seconds, peak resident memory in MiB) of `python ordering.py ARGS` run to its end."""
    core = [] if (os.cpu_count() or 1) < 2 else ["taskset", "-c", str(os.cpu_count() - 1)]
    started = time.perf_counter()
    child = subprocess.Popen([*core, sys.executable, MODULE, *args], stdout=stdout,
                             stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    took = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(args)} failed: {child.stderr.read().decode()}")
    return took, usage.ru_maxrss / 1024


def product_file(path, count):
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sku", "name", "category", "unit", "price", "stock", "min_quantity",
                         "order_multiple", "price_breaks"])
        for n in range(count):
            writer.writerow([f"IMP-{n}", f"Imported product {n}", f"Cat {n % 12}", "case",
                             f"{10 + n % 90}.{n % 100:02d}", 100 + n, 6, 6,
                             f"24 {9 + n % 90}.00; 48 {8 + n % 90}.50"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, nargs=2, default=(10_000, 100_000))
    parser.add_argument("--products", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.orders, args.products, args.rounds = (1000, 2000), 200, 1
    before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {}
        for orders in args.orders:
            path = os.path.join(tmp, f"orders-{orders}.db")
            sizes[orders] = (path, bench.build_database(path, orders)["company"])
        base, company = sizes[args.orders[0]]
        source = os.path.join(tmp, "products.csv")
        product_file(source, args.products)
        exports = {orders: [] for orders in args.orders}
        imports, again = [], []
        for _ in range(args.rounds):
            for orders, (path, company_id) in sizes.items():
                exports[orders].append(timed(["--db", path, "export", "orders", "--company",
                                              company_id]))
            copy = os.path.join(tmp, "import.db")
            shutil.copy(base, copy)
            imports.append(timed(["--db", copy, "import", "products", "--company", company,
                                  "--file", source]))
            exported = os.path.join(tmp, "exported.csv")
            with open(exported, "wb") as out:
                subprocess.run([sys.executable, MODULE, "--db", copy, "export", "products",
                                "--company", company], stdout=out, check=True)
            again.append(timed(["--db", copy, "import", "products", "--company", company,
                                "--file", exported]))
    after = os.getloadavg()
    lines = {orders: 3 * orders for orders in args.orders}  # three lines an order (bench.py)
    print(f"load average (1 min): {before[0]:.2f} before, {after[0]:.2f} after; median of "
          f"{args.rounds}")
    print("\n| run | seconds | rows a second | peak memory (MiB) |\n|---|---:|---:|---:|")
    for orders, runs in exports.items():
        seconds = statistics.median(run[0] for run in runs)
        print(f"| export orders, {orders:,} orders ({lines[orders]:,} rows) | {seconds:.2f} | "
              f"{lines[orders] / seconds:,.0f} | "
              f"{statistics.median(run[1] for run in runs):.1f} |")
    for title, runs in ((f"import {args.products:,} new products", imports),
                        (f"import them again, exported ({args.products + 1000:,} rows, "
                         f"unchanged)", again)):
        seconds = statistics.median(run[0] for run in runs)
        rows = args.products + (1000 if runs is again else 0)
        print(f"| {title} | {seconds:.2f} | {rows / seconds:,.0f} | "
              f"{statistics.median(run[1] for run in runs):.1f} |")
    small, large = (statistics.median(run[1] for run in exports[n]) for n in args.orders)
    print(f"\n- the export's peak memory at {args.orders[1]:,} orders is {large / small:.2f}x "
          f"its peak at {args.orders[0]:,}")


if __name__ == "__main__":
    main()
