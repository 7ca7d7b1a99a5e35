"""The spec, rule by rule, through WebTest against a real SQLite file; webhooks against a real
HTTP receiver on 127.0.0.1; the command line through subprocess."""

import base64
import concurrent.futures
import hashlib
import hmac
import http.server
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import webtest

import ordering

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
# Fixtures
# ---------------------------------------------------------------------------------------------

def build_app(path, **overrides):
    settings = dict(allow_private_webhooks=True, webhook_timeout=2.0,
                    delivery_poll_interval=0.1, ip_rate_limit=0)
    settings.update(overrides)
    return ordering.create_app(str(path), **settings)


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "ordering.db"


@pytest.fixture
def app(db_path):
    app = build_app(db_path)
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
            return ordering.product_json(ordering.create_product(
                conn, self.id, name=name, price_cents=price_cents, stock=stock, **fields))

    def update_product(self, product_id, **changes):
        with self.db.write() as conn:
            return ordering.product_json(ordering.update_product(conn, self.id, product_id,
                                                                 **changes))

    def customer(self, email=None, **fields):
        email = email or f"buyer{time.monotonic_ns()}@example.com"
        with self.db.write() as conn:
            return ordering.customer_json(ordering.create_customer(
                conn, self.id, dict(fields, email=email)))

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
    """A real HTTP server on 127.0.0.1 that records every request it gets. `behaviour` maps a
    path to (status, delay seconds, extra headers)."""

    def __init__(self):
        self.requests = []
        self.behaviour = {}
        self.arrived = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, delay, headers = receiver.behaviour.get(self.path, (200, 0, {}))
                if delay:
                    time.sleep(delay)
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
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
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
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


# ---------------------------------------------------------------------------------------------
# Wire conventions
# ---------------------------------------------------------------------------------------------

def test_unknown_route_is_json_404(api, tenant):
    assert_error(api.get("/api/v1/nothing", headers=tenant.headers, status=404), 404,
                 "Not found.")
    assert_error(api.get("/", status=404), 404, "Not found.")


def test_wrong_method_is_json_405(api, tenant):
    body = assert_error(api.post_json("/api/v1/products", {}, headers=tenant.headers,
                                      status=405), 405, "Method not allowed.")
    assert body == {"error": "Method not allowed."}
    assert_error(api.delete("/api/v1/orders/x", headers=tenant.headers, status=405), 405,
                 "Method not allowed.")


def test_malformed_json_body(api, tenant):
    for raw in (b"{", b"", b"nul", b"\xff\xfe", b'{"a": NaN}', b"[1e999]"):
        response = api.post("/api/v1/customers", raw, headers=dict(
            tenant.headers, **{"Content-Type": "application/json"}), status=400)
        assert response.json == {"error": "Invalid JSON body."}


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
    monkeypatch.setattr(ordering, "load_product", broken)
    response = api.get("/api/v1/products/x", headers=tenant.headers, status=500)
    assert response.body == b"Internal Server Error"
    assert response.content_type == "text/plain"
    assert "boom" in caplog.text and "Traceback" in caplog.text


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


# ---------------------------------------------------------------------------------------------
# Authentication, scopes and tenancy
# ---------------------------------------------------------------------------------------------

MISSING = "Missing or invalid Authorization header. Use: Bearer <api_key>"
INVALID = "Invalid, expired, or revoked API key."


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
    assert app.service.revoke_key(key["id"]) == {"id": key["id"], "revoked": True}
    assert api.get("/api/v1/products", headers=auth(key), status=401).json == {"error": INVALID}


def test_keys_are_stored_only_as_sha256(app, tenant):
    rows = app.service.db.conn.execute("SELECT key_hash FROM api_keys").fetchall()
    assert hashlib.sha256(tenant.key["key"].encode()).hexdigest() in [r[0] for r in rows]
    with open(app.service.settings.db_path, "rb") as handle:
        assert tenant.key["key"].encode() not in handle.read()


ENDPOINT_SCOPES = [
    ("GET", "/api/v1/products", "products:read"),
    ("GET", "/api/v1/products/x", "products:read"),
    ("GET", "/api/v1/orders", "orders:read"),
    ("GET", "/api/v1/orders/x", "orders:read"),
    ("POST", "/api/v1/orders", "orders:write"),
    ("PATCH", "/api/v1/orders/x", "orders:write"),
    ("GET", "/api/v1/customers", "customers:read"),
    ("GET", "/api/v1/customers/x", "customers:read"),
    ("POST", "/api/v1/customers", "customers:write"),
    ("PATCH", "/api/v1/customers/x", "customers:write"),
    ("GET", "/api/v1/webhooks", "webhooks:read"),
    ("GET", "/api/v1/webhooks/x", "webhooks:read"),
    ("POST", "/api/v1/webhooks", "webhooks:write"),
    ("PATCH", "/api/v1/webhooks/x", "webhooks:write"),
    ("DELETE", "/api/v1/webhooks/x", "webhooks:write"),
]


@pytest.mark.parametrize("method,path,scope", ENDPOINT_SCOPES)
def test_every_endpoint_checks_its_scope(api, tenant, method, path, scope):
    others = [s for s in ALL_SCOPES if s != scope]
    key = tenant.new_key(others)
    response = api.request(path, method=method, headers=dict(
        auth(key), **{"Content-Type": "application/json"}), body=b"{}", expect_errors=True)
    assert_error(response, 403, f'Insufficient permissions. This key lacks the "{scope}" scope.')
    allowed = tenant.new_key([scope])
    response = api.request(path, method=method, headers=dict(
        auth(allowed), **{"Content-Type": "application/json"}), body=b"{}", expect_errors=True)
    assert response.status_int != 403


def test_read_scope_is_needed_even_with_the_write_scope(api, tenant):
    key = tenant.new_key(["customers:write"])
    assert_error(api.get("/api/v1/customers", headers=auth(key), status=403), 403,
                 'Insufficient permissions. This key lacks the "customers:read" scope.')


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


# ---------------------------------------------------------------------------------------------
# Pagination
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("limit,size", [("10abc", 10), ("0", 1), ("-3", 1), ("500", 100),
                                        ("abc", 50), ("", 50), ("2.9", 2), (" 7", 7),
                                        ("0x10", 16)])
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


def test_lists_are_served_by_an_index(app):
    conn = app.service.db.conn
    plans = {
        "products": "SELECT * FROM products WHERE company_id = ? AND (created_at, id) < (?, ?) "
                    "ORDER BY created_at DESC, id DESC LIMIT 51",
        "orders": "SELECT * FROM orders WHERE company_id = ? AND status = ? "
                  "AND (created_at, id) < (?, ?) ORDER BY created_at DESC, id DESC LIMIT 51",
        "customers": "SELECT * FROM customers WHERE company_id = ? "
                     "ORDER BY created_at DESC, id DESC LIMIT 51",
    }
    for table, sql in plans.items():
        args = [None] * sql.count("?")
        detail = " ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args))
        assert "USING INDEX" in detail and "TEMP B-TREE" not in detail, (table, detail)


# ---------------------------------------------------------------------------------------------
# Products
# ---------------------------------------------------------------------------------------------

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
    assert len(names(active="maybe")) == 3
    assert rice["isActive"] and not oil["isActive"]


def test_product_search_folds_unicode_case(api, tenant):
    tenant.product(name="ÉCLAIRS")
    found = api.get("/api/v1/products", {"search": "éclair"}, headers=tenant.headers).json
    assert [p["name"] for p in found["data"]] == ["ÉCLAIRS"]


def test_unknown_product_is_404(api, tenant):
    assert api.get("/api/v1/products/prod_x", headers=tenant.headers, status=404).json == {
        "error": "Product not found."}
