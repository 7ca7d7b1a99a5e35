"""Webhook delivery timings, which the suite checks only as rules (a delivery in flight does
not hold up the API; a receiver that does not answer is a timed-out failure):

    python bench/webhooks.py              # about a minute
    python bench/webhooks.py --quick      # a few seconds

1. The API's answer time for POST /api/v1/customers with no webhook, and with a subscribed
   receiver on 127.0.0.1 that never answers (every delivery hangs until its timeout).
2. The durationMs the delivery log records for those deliveries, against the timeout.

Needs the test extra (pip install -e '.[test]'): it uses the suite's receiver and fixtures.
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import webtest  # noqa: E402

import test_ordering as suite  # noqa: E402


def answer_times(api, tenant, count, label):
    times = []
    for number in range(count):
        started = time.perf_counter()
        api.post_json("/api/v1/customers", {"email": f"{label}{number}@example.com"},
                      headers=tenant.headers, status=201)
        times.append((time.perf_counter() - started) * 1000)
    return times


def summary(times):
    ordered = sorted(times)
    return (f"p50 {statistics.median(ordered):6.2f} ms  "
            f"p99 {ordered[int(len(ordered) * 0.99) - 1]:6.2f} ms  max {ordered[-1]:6.2f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    count, timeout = (40, 0.5) if args.quick else (200, 1.0)
    hold = threading.Event()
    receiver = suite.Receiver()
    receiver.behaviour["/hang"] = (200, hold, {})
    with tempfile.TemporaryDirectory() as workdir:
        db_path = os.path.join(workdir, "webhooks.db")
        app = suite.build_app(db_path, webhook_timeout=timeout)
        try:
            api = webtest.TestApp(app)
            tenant = suite.Tenant(app, "Bench Webhooks")
            tenant.headers = suite.auth(tenant.new_key(suite.ALL_SCOPES, rate_limit=10 ** 6))
            quiet = answer_times(api, tenant, count, "quiet")
            hook = suite.subscribe(api, tenant, receiver.url + "/hang", ["customer.created"])
            hanging = answer_times(api, tenant, count, "hanging")
            rows = suite.done_rows(db_path, hook["id"], count, timeout=count * timeout + 30)
        finally:
            hold.set()
            app.service.close(grace=0)
            receiver.close()
    durations = [row["duration_ms"] for row in rows]
    print(f"POST /api/v1/customers, {count} requests each, one process, WSGI in-process")
    print(f"  no webhook:                  {summary(quiet)}")
    print(f"  receiver that never answers: {summary(hanging)}")
    print(f"delivery log of those {len(rows)} deliveries (timeout {timeout:g} s):")
    print(f"  durationMs min {min(durations)}  median {statistics.median(durations):.0f}  "
          f"max {max(durations)}; failures {sum(1 for r in rows if not r['success'])}")


if __name__ == "__main__":
    main()
