"""Hostile conditions, with figures: the heavier variants of the suite's race, kill and
malformed-input tests.

    python bench/hostile.py              # about a minute
    python bench/hostile.py --quick      # a few seconds

Needs the test extra (pip install -e '.[test]'): it drives the server with the suite's own
helpers.
"""

import argparse
import json
import os
import random
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import webtest  # noqa: E402

import ordering  # noqa: E402
import test_ordering as suite  # noqa: E402

FIELD_NAMES = ["customerId", "items", "productId", "quantity", "poNumber", "notes", "status",
               "tracking", "carrier", "number", "url", "email", "name", "creditLimit",
               "taxRateOverride", "events", "isActive"]


def random_value(rng, depth=0):
    kinds = ["null", "bool", "int", "float", "text", "list", "object"]
    kind = rng.choice(kinds if depth < 4 else kinds[:5])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, -1, 1, 2 ** 63, -2 ** 64, 10 ** 30, rng.randint(-10 ** 6, 10 ** 6)])
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e308, 1e-308, 0.1 + 0.2, rng.uniform(-1e9, 1e9)])
    if kind == "text":
        return rng.choice(["", " ", "ACTIVE", "SHIPPED", "OTHER", "a@b.co", "x" * 5000,
                           "ünïcødé ✓ 漢字", "\u0000\u202e", "'; DROP TABLE orders; --",
                           "https://hooks.example/x", "order.created"])
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELD_NAMES): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 5))}


RAW_BODIES = [b"", b"{", b"[]", b"null", b'{"a": NaN}', b"\xff\xfe\x00", b"[" * 50_000,
              b'{"email": "\\udfff"}', b'{"items": [{"quantity": 1e999}]}']


def malformed(count, seed=11):
    """Random bodies, types, queries and IDs at every route; returns (cases, 500s)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as workdir:
        app = suite.build_app(os.path.join(workdir, "fuzz.db"))
        try:
            tenant = suite.Tenant(app, "Fuzz Co")
            tenant.product()
            tenant.customer()
            api = webtest.TestApp(app)
            failures = 0
            for case in range(count):
                route = rng.choice(ordering.ROUTES)
                path = route.path
                for name in ("product_id", "order_id", "customer_id", "webhook_id"):
                    path = path.replace(f"<{name}>", rng.choice(["x", "%00", "..", "ord_" + "9" * 40]))
                query = "&".join(f"{k}={rng.choice(['', '-1', '0x', 'ü', '%ff', '9' * 30])}"
                                 for k in rng.sample(["limit", "cursor", "status", "since",
                                                      "until", "search", "active"], 2))
                if case % 5 == 0:
                    body = rng.choice(RAW_BODIES)
                else:
                    body = json.dumps(random_value(rng), ensure_ascii=rng.random() < 0.5).encode()
                headers = dict(tenant.headers, **{
                    "Content-Type": rng.choice(["application/json", "text/plain", ""])})
                response = api.request(f"{path}?{query}", method=route.method, headers=headers,
                                       body=b"" if route.method == "GET" else body,
                                       expect_errors=True)
                if response.status_int >= 500:
                    failures += 1
                    print(f"500: {route.method} {path}?{query} {body[:200]!r}", file=sys.stderr)
        finally:
            app.service.close(grace=0)
    return count, failures


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    threads, rounds, kill_clients, run_for, cases = ((16, 10, 4, 1.0, 300) if args.quick else
                                                     (32, 60, 16, 3.0, 5000))
    with tempfile.TemporaryDirectory() as workdir:
        race = suite.race_through_server(os.path.join(workdir, "race.db"), threads=threads,
                                         rounds=rounds)
        receiver = suite.Receiver()
        try:
            kill = suite.kill_and_restart(os.path.join(workdir, "kill.db"), receiver,
                                          clients=kill_clients, run_for=run_for)
        finally:
            receiver.close()
    oversold = [p for p in race["products"] if race["stock"][p] < 0 or race["stock"][p] !=
                race["start_stock"] - race["ordered"].get(p, 0)]
    lost = len(race["acknowledged"].keys() - race["stored"].keys())
    tried, server_errors = malformed(cases)
    print(f"race: {threads} client threads, {race['requests']} requests, "
          f"{len(race['acknowledged'])} orders acknowledged (201), "
          f"{race['statuses'][400]} refused (400), {race['statuses']['bad']} 5xx/locked/failed, "
          f"{lost} acknowledged orders missing, {len(oversold)} products oversold")
    print(f"kill: {kill['requests']} requests, {len(kill['acknowledged'])} orders acknowledged "
          f"before SIGKILL, {len(kill['committed'])} found after restart, "
          f"{len(kill['acknowledged'] - kill['committed'])} lost, integrity {kill['integrity']}, "
          f"{len(kill['delivered'] & kill['committed'])} of {len(kill['committed'])} "
          f"order.created delivered ({kill['deliveries']} deliveries in all); "
          f"{kill['claimed']} deliveries were claimed by the killed server, and all were "
          f"delivered {kill['settled']:.1f}s after the restart (the lease is 9 s)")
    print(f"malformed: {tried} cases tried, {server_errors} answered 500")


if __name__ == "__main__":
    main()
