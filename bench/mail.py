"""Email throughput: 1,000 queued emails drained into a local mail server (aiosmtpd).

    python bench/mail.py              # about a minute
    python bench/mail.py --quick      # a few seconds

For each way of sending, on a new SQLite database (synchronous = FULL, as shipped): 1,000
shipping emails are queued in one transaction, then the outbox's sender (its default 4
threads) drains them into an aiosmtpd on 127.0.0.1 that accepts every message. Reported:
emails per second from the sender's start until the last email is recorded as sent, and the
SMTP connections used. "one connection per batch" is the service (MAIL_BATCH emails per
connection); "one connection per email" is the same sender with batches of one. Each is
measured against a plain server (smtp://) and against one that requires STARTTLS and a login
(smtp+starttls://, its certificate made with the openssl command and trusted through the CA
file), as providers do. Median of 3 rounds.

Needs the test extra (pip install -e '.[test]'): it uses the suite's mail server.
"""

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ordering  # noqa: E402
import test_ordering as suite  # noqa: E402


def queue(db, count):
    with db.write() as conn:
        company = ordering.create_company(conn, "Bench Mail")["id"]
        for number in range(count):
            ordering.queue_email(conn, company, "order_shipped", f"buyer{number}@example.com", {
                "orderId": f"ord_{number}", "customerName": f"Buyer {number}", "facts": [
                    ["Order", f"ord_{number}"], ["PO number", f"PO-{number}"],
                    ["Carrier", "CARRIER_A"], ["Tracking number", f"TN{number:08d}"],
                    ["Track it", f"https://tracking.carrier-a.example/track?number=TN{number}"]]},
                to_name=f"Buyer {number}")


def drain(count, batch, certificates):
    """(emails per second, connections) for one round; with certificates, over STARTTLS
    with a login."""
    if certificates:
        server = suite.MailServer(tls=certificates[1], users={"bench": "bench password"})
        url, ca_file = f"smtp+starttls://bench:bench%20password@127.0.0.1:{server.port}", \
            certificates[0]
    else:
        server = suite.MailServer()
        url, ca_file = server.url, ""
    with tempfile.TemporaryDirectory() as workdir:
        settings = ordering.Settings(
            db_path=os.path.join(workdir, "mail.db"), smtp_url=url, smtp_ca_file=ca_file,
            mail_from="orders@bench.example", base_url="https://orders.bench.example",
            delivery_poll_interval=0.05)
        db = ordering.Database(settings.db_path, settings)
        queue(db, count)
        channel = ordering.EmailChannel(settings)
        channel.batch = batch
        outbox = ordering.Outbox(db, settings, [channel])
        started = time.perf_counter()
        outbox.start()
        try:
            while db.conn.execute("SELECT COUNT(*) FROM emails WHERE state = 'sent'"
                                  ).fetchone()[0] < count:
                time.sleep(0.01)
            elapsed = time.perf_counter() - started
        finally:
            outbox.stop(grace=5)
            db.close()
            server.close()
    assert len(server.messages) == count, len(server.messages)
    return count / elapsed, server.connections


def main():
    # aiosmtpd warns of its own deprecation at every login it accepts
    warnings.filterwarnings("ignore", message="Session.login_data is deprecated")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    count, rounds = (200, 1) if args.quick else (1000, 3)
    with open("/proc/loadavg") as handle:
        print(f"load average before: {handle.read().strip()}")
    with tempfile.TemporaryDirectory() as where:
        certificates = suite.make_certificates(pathlib.Path(where))
        for server, tls in (("smtp://", None), ("smtp+starttls:// and login", certificates)):
            for label, batch in (("one connection per batch", ordering.MAIL_BATCH),
                                 ("one connection per email", 1)):
                results = [drain(count, batch, tls) for _ in range(rounds)]
                rates = [rate for rate, _ in results]
                print(f"{server:27s} {label:25s} {statistics.median(rates):7.1f} emails/s "
                      f"(rounds: {', '.join(f'{rate:.1f}' for rate in rates)}; "
                      f"connections: {results[0][1]})", flush=True)
    with open("/proc/loadavg") as handle:
        print(f"load average after:  {handle.read().strip()}")


if __name__ == "__main__":
    main()
