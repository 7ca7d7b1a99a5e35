"""ordering: a multi-tenant wholesale ordering service on SQLite.

Products, orders, customers and signed webhooks behind a small REST API (/api/v1), in one
module you can run (``python ordering.py``), vendor, or embed (``create_app()`` returns a WSGI
app). The sections follow the way a request travels:

  1. Settings      every tunable, read once from flags and environment
  2. Storage       connections, schema and migrations, the write transaction
  3. Values        IDs, timestamps, money, JavaScript-like integer and date parsing
  4. Errors        ApiError and the validators that raise it with the spec's messages
  5. Records       rows to the JSON the API shows, one function per record type
  6. Events        the catalog, emit() into the outbox, signatures
  7. Operations    what the business does (place_order, update_customer, ...), HTTP-free
  8. Delivery      the webhook sender: claiming, address checks, the thread pool, the log
  9. HTTP          pagination, the routes, the OpenAPI document built from them, auth and
                   scopes, rate limits, idempotency, the app factory, error handlers
 10. Command line  main(), the operator commands, serve
"""

import argparse
import base64
import collections
import dataclasses
import datetime
import hashlib
import hmac
import http.client
import io
import ipaddress
import json
import logging
import math
import os
import queue
import re
import secrets
import signal
import socket
import sqlite3
import ssl
import sys
import threading
import time
import urllib.parse

import bottle

__version__ = "0.1.0"

log = logging.getLogger("ordering")

# ---------------------------------------------------------------------------------------------
# 1. Settings
# ---------------------------------------------------------------------------------------------

def _find_schema():
    """schema.sql beside this file (a checkout or a vendored copy), or where the wheel puts it."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "schema.sql"),
                      os.path.join(here, "ordering_data", "schema.sql")):
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"schema.sql not found beside {__file__}")


SCHEMA_PATH = _find_schema()

#: The schema version this module writes; older files are migrated up to it at start.
SCHEMA_VERSION = 1

DEFAULT_TRACKING_URL_TEMPLATES = {
    "CARRIER_A": "https://tracking.carrier-a.example/track?number={number}",
    "CARRIER_B": "https://tracking.carrier-b.example/parcels/{number}",
    "CARRIER_C": "https://tracking.carrier-c.example/?tracknum={number}",
    "CARRIER_D": "https://tracking.carrier-d.example/track/{number}",
    "CARRIER_E": "https://tracking.carrier-e.example/status?id={number}",
}


@dataclasses.dataclass
class Settings:
    #: Path of the SQLite database file (created if missing).
    db_path: str = "ordering.db"
    #: Address and port the server listens on.
    host: str = "127.0.0.1"
    port: int = 8080
    #: Request-handling threads of the server (waitress's default: more mostly add GIL contention).
    threads: int = 4
    #: SQLite PRAGMA synchronous. NORMAL in WAL mode survives any process crash; see README.
    synchronous: str = "NORMAL"
    #: Milliseconds a writer waits for the database lock before giving up.
    busy_timeout_ms: int = 10000
    #: Largest request body accepted, in bytes (413 beyond).
    max_body_bytes: int = 1024 * 1024
    #: Webhook delivery: seconds allowed for one whole exchange (connect, send, response).
    webhook_timeout: float = 10.0
    #: Webhook delivery: concurrent deliveries (threads of the sender pool).
    delivery_workers: int = 4
    #: Webhook delivery: seconds between looks at the outbox for work from other processes.
    delivery_poll_interval: float = 1.0
    #: Allow webhook URLs that resolve to loopback, private or reserved addresses.
    allow_private_webhooks: bool = False
    #: Requests per minute from one client address, checked before authentication; 0 is off.
    ip_rate_limit: int = 600
    #: Take the client address from X-Forwarded-For (only behind a proxy you run).
    trust_proxy: bool = False
    #: Seconds an Idempotency-Key and its response are remembered.
    idempotency_ttl: int = 24 * 3600
    #: Seconds a looked-up API key is trusted before it is read again (revocation delay for
    #: other processes; revocations through this process take effect at once).
    key_cache_seconds: float = 5.0
    #: URL templates for the named carriers; {number} is replaced by the tracking number.
    tracking_url_templates: dict = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_TRACKING_URL_TEMPLATES))

    @classmethod
    def from_environment(cls, environ=os.environ, **overrides):
        """Settings from ORDERING_* variables; explicit keyword overrides win."""
        values = {}
        readers = {
            "ORDERING_DB": ("db_path", str),
            "ORDERING_SYNCHRONOUS": ("synchronous", str),
            "ORDERING_WEBHOOK_TIMEOUT": ("webhook_timeout", float),
            "ORDERING_DELIVERY_WORKERS": ("delivery_workers", int),
            "ORDERING_ALLOW_PRIVATE_WEBHOOKS": ("allow_private_webhooks", _flag),
            "ORDERING_IP_RATE_LIMIT": ("ip_rate_limit", int),
            "ORDERING_TRUST_PROXY": ("trust_proxy", _flag),
            "ORDERING_TRACKING_URL_TEMPLATES": ("tracking_url_templates", json.loads),
        }
        for variable, (field, parse) in readers.items():
            if environ.get(variable, "") != "":
                values[field] = parse(environ[variable])
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        templates = dict(DEFAULT_TRACKING_URL_TEMPLATES)
        templates.update(settings.tracking_url_templates)
        settings.tracking_url_templates = templates
        return settings


def _flag(text):
    return text.strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------
# 2. Storage
# ---------------------------------------------------------------------------------------------

class Database:
    """One SQLite file: a connection per thread, and write() for every transaction that writes.

    Connections run in autocommit mode so that write() alone decides where a transaction
    begins (BEGIN IMMEDIATE, which takes the write lock up front: a read-then-write such as a
    stock check can then never be overtaken by another writer) and where it ends.
    """

    def __init__(self, path, settings=None):
        self.path = path
        self.settings = settings or Settings(db_path=path)
        self._local = threading.local()
        self._listeners = []
        # Writers of this process queue here rather than in SQLite's busy handler, which
        # sleeps in growing steps and turns lock contention into long tail latency.
        self._write_lock = threading.Lock()
        with self.write() as conn:
            apply_schema(conn)

    def connect(self):
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=self.settings.busy_timeout_ms / 1000)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA busy_timeout = {int(self.settings.busy_timeout_ms)}")
        conn.execute(f"PRAGMA synchronous = {self.settings.synchronous}")
        conn.create_function("contains_folded", 2, contains_folded, deterministic=True)
        return conn

    @property
    def conn(self):
        """This thread's connection, for reads outside a transaction."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.connect()
        return conn

    def write(self):
        return _WriteTransaction(self)

    def on_commit(self, listener):
        """Call listener(event_ids) after each commit that emitted events."""
        self._listeners.append(listener)

    def close(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class _WriteTransaction:
    def __init__(self, db):
        self.db = db

    def __enter__(self):
        conn = self.db.conn
        self.db._write_lock.acquire()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.db._write_lock.release()
            raise
        _emitted.event_ids = []
        return conn

    def __exit__(self, kind, error, tb):
        conn = self.db.conn
        emitted, _emitted.event_ids = _emitted.event_ids, None
        try:
            if kind is None:
                try:
                    conn.execute("COMMIT")
                except sqlite3.Error:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            elif conn.in_transaction:  # some errors (a full disk) end the transaction already
                conn.execute("ROLLBACK")
        finally:
            self.db._write_lock.release()
        if kind is None and emitted:
            for listener in self.db._listeners:
                listener(emitted)
        return False


#: Event IDs emitted by the transaction open on this thread (see emit()).
_emitted = threading.local()


def apply_schema(conn):
    """Create what is missing, then migrate by PRAGMA user_version."""
    for statement in schema_statements():
        conn.execute(statement)
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"database schema version {version} is newer than this program "
                           f"({SCHEMA_VERSION}); upgrade ordering")
    for target in range(version + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS.get(target, ()):
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def schema_statements():
    statements, pending = [], ""
    with open(SCHEMA_PATH, encoding="utf-8") as handle:
        for line in handle:
            pending += line
            if sqlite3.complete_statement(pending):
                statements.append(pending)
                pending = ""
    return statements


#: Statements that bring a file from version N-1 to N, beyond what schema.sql creates.
MIGRATIONS = {1: ()}


def contains_folded(haystack, needle):
    return haystack is not None and needle in haystack.casefold()


# ---------------------------------------------------------------------------------------------
# 3. Values
# ---------------------------------------------------------------------------------------------

_id_lock = threading.Lock()
_id_last = [0, 0]


def new_id_at(prefix):
    """An opaque ID and the creation time it encodes (ISO text).

    48 bits of milliseconds, then 72 bits of randomness that increase within one millisecond,
    in lower-case hex: IDs made in order sort in order, and records sorted by (createdAt, id)
    sort exactly as they were made in this process."""
    with _id_lock:
        ms = max(int(time.time() * 1000), _id_last[0])
        tail = _id_last[1] + 1 if ms == _id_last[0] else secrets.randbits(71)
        _id_last[0], _id_last[1] = ms, tail
    return f"{prefix}_{ms:012x}{tail:018x}", iso(ms)


def new_id(prefix):
    return new_id_at(prefix)[0]


def iso(ms):
    """ISO 8601 UTC with milliseconds: 2026-11-22T14:33:54.123Z."""
    seconds, millis = divmod(ms, 1000)
    t = time.gmtime(seconds)
    # Formatted by hand: strftime does not zero-pad years below 1000, and these strings are
    # compared as text.
    return "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ" % (t.tm_year, t.tm_mon, t.tm_mday, t.tm_hour,
                                                     t.tm_min, t.tm_sec, millis)


def now_iso():
    return iso(int(time.time() * 1000))


def money(cents):
    """Integer cents to the JSON number the API shows, as JSON.stringify writes it: 12.5 for
    1250, 45 for 4500."""
    if cents is None:
        return None
    return cents // 100 if cents % 100 == 0 else cents / 100


def cents_from_number(value):
    """A JSON number to integer cents, or None when it has more than two decimals."""
    cents = round(value * 100)
    if abs(value * 100 - cents) > 1e-6 * max(1, abs(cents)):
        return None
    return int(cents)


def cents_from_text(text):
    """'12.50' to 1250 for the command line; None when it is not a plain amount."""
    match = re.fullmatch(r"\s*(\d+)(?:\.(\d{1,2}))?\s*", text or "")
    if not match:
        return None
    return int(match.group(1)) * 100 + int((match.group(2) or "0").ljust(2, "0"))


_PARSE_INT = re.compile(r"\s*([+-]?)(?:0[xX]([0-9a-fA-F]*)|([0-9]+))", re.ASCII)


def js_parse_int(text):
    """JavaScript's parseInt(text): leading digits after optional space and sign, 0x for hex;
    None where JavaScript gives NaN."""
    match = _PARSE_INT.match(text or "")
    if not match:
        return None
    sign, hex_digits, digits = match.groups()
    if hex_digits == "":
        return None
    digits = (hex_digits or digits).lstrip("0") or "0"
    if len(digits) > 18:
        number = 10 ** 18  # beyond any limit we clamp, and short of int()'s digit cap
    else:
        number = int(digits, 16 if hex_digits else 10)
    return -number if sign == "-" else number


_DATE_FORMS = re.compile(
    r"(?P<year>\d{4})(?:-(?P<month>\d{2})(?:-(?P<day>\d{2}))?)?"
    r"(?:[T ](?P<hour>\d{2}):(?P<minute>\d{2})(?::(?P<second>\d{2})(?:\.(?P<fraction>\d+))?)?"
    r"(?P<zone>Z|[+-]\d{2}:?\d{2})?)?")


def js_parse_date(text):
    """The ISO forms a JavaScript Date parser accepts, as epoch milliseconds, or None.

    A date alone is UTC midnight, as in JavaScript. A date-time without an offset is read as
    UTC too (JavaScript would use the server's local zone, which would make results depend on
    where the server runs).
    """
    match = _DATE_FORMS.fullmatch((text or "").strip())
    if not match:
        return None
    part = match.groupdict()
    try:
        moment = datetime.datetime(
            int(part["year"]), int(part["month"] or 1), int(part["day"] or 1),
            int(part["hour"] or 0), int(part["minute"] or 0), int(part["second"] or 0),
            int((part["fraction"] or "0")[:3].ljust(3, "0")) * 1000,
            tzinfo=datetime.timezone.utc)
    except ValueError:
        return None
    zone = part["zone"]
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        hours, minutes = int(zone[1:3]), int(zone[-2:])
        if hours > 23 or minutes > 59:
            return None
        try:
            moment -= sign * datetime.timedelta(hours=hours, minutes=minutes)
        except OverflowError:
            return None
    return int(moment.timestamp() * 1000)


def hash_key(key):
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# 4. Errors and validation
# ---------------------------------------------------------------------------------------------

class ApiError(Exception):
    """Every refusal the API makes: an HTTP status and the spec's message, character for
    character. details (field and rule) is added for the generic 'Validation failed.'."""

    def __init__(self, status, message, details=None, extra=None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details
        self.extra = extra or {}
        self.headers = headers or {}

    def body(self):
        body = {"error": self.message}
        if self.details:
            body["details"] = self.details
        body.update(self.extra)
        return body


VALIDATION_FAILED = "Validation failed."


def invalid(field, rule):
    return ApiError(400, VALIDATION_FAILED, details=[{"field": field, "rule": rule}])


def not_found(resource):
    return ApiError(404, f"{resource} not found.")


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_object(body, field="body"):
    if not isinstance(body, dict):
        raise invalid(field, "must be a JSON object")
    return body


def optional_text(body, field, max_length, min_length=0, strip=False):
    """A string field that may be absent or null; returns the value, or None."""
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(field, "must be a string or null")
    if strip:
        value = value.strip()
    if not min_length <= len(value) <= max_length:
        raise invalid(field, f"must be {min_length} to {max_length} characters")
    return value


def optional_bounded_number(body, field, low, high, message):
    value = body.get(field)
    if value is None:
        return None
    if not is_number(value):
        raise invalid(field, "must be a number or null")
    if not low <= value <= high:
        raise ApiError(400, message)
    return value


def optional_money(body, field, low, high, message):
    value = optional_bounded_number(body, field, low, high, message)
    if value is None:
        return None
    cents = cents_from_number(value)
    if cents is None:
        raise invalid(field, "must have at most two decimal places")
    return cents


_EMAIL = re.compile(r"[^@\s\x00-\x1f\x7f\"(),:;<>\[\]\\]+@[^@\s\x00-\x1f\x7f\"(),:;<>\[\]\\]+")


def valid_email(email):
    if len(email) > 254 or not _EMAIL.fullmatch(email):
        return False
    local, domain = email.rsplit("@", 1)
    labels = domain.split(".")
    return (len(local) <= 64 and len(labels) >= 2 and len(labels[-1]) >= 2
            and all(labels) and not local.startswith(".") and not local.endswith(".")
            and ".." not in local
            and all(not label.startswith("-") and not label.endswith("-") for label in labels))


def valid_http_url(url):
    if not isinstance(url, str) or not 1 <= len(url) <= 2048 or not url.isascii():
        return False
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port
    except ValueError:
        return False
    return (parts.scheme in ("http", "https") and valid_host(parts.hostname or "")
            and parts.username is None and parts.password is None)


_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9_-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9_-]*[a-z0-9])?)*\.?")


def valid_host(host):
    """A DNS name (letters, digits, hyphens, underscores, dots) or an IP address."""
    if _HOST_NAME.fullmatch(host) and len(host) <= 253:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# 5. Records
# ---------------------------------------------------------------------------------------------

# The serializers below read rows by position, which is several times faster than by name on
# the list endpoints' hot path: schema.sql puts the columns the API shows first, in this order,
# so that SELECT * rows (and the tuples place_order builds) unpack straight into them.

def product_json(row):
    (product_id, name, sku, description, category, unit, price_cents, stock, image_url,
     is_active, created_at, updated_at) = row[:12]
    return {
        "id": product_id,
        "name": name,
        "sku": sku,
        "description": description,
        "category": category,
        "unit": unit,
        "price": money(price_cents),
        "stock": stock,
        "imageUrl": image_url,
        "isActive": bool(is_active),
        "createdAt": created_at,
        "updatedAt": updated_at,
    }


def customer_json(row):
    (customer_id, email, name, status, notes, credit_limit_cents, tax_rate_override,
     email_verified, created_at, updated_at) = row[:10]
    return {
        "id": customer_id,
        "email": email,
        "name": name,
        "status": status,
        "notes": notes,
        "creditLimit": money(credit_limit_cents),
        "taxRateOverride": tax_rate_override,
        "emailVerified": bool(email_verified),
        "createdAt": created_at,
        "updatedAt": updated_at,
    }


def order_item_json(row):
    """row: id, quantity, unit_price_cents, product_id, product name, product sku."""
    item_id, quantity, unit_price_cents, product_id, product_name, product_sku = row[:6]
    return {
        "id": item_id,
        "quantity": quantity,
        "unitPrice": money(unit_price_cents),
        "productId": product_id,
        "productName": product_name,
        "productSku": product_sku,
    }


def order_json(row, items):
    (order_id, status, po_number, notes, total_cents, created_at, updated_at, customer_id,
     tracking_carrier, tracking_number, tracking_url) = row[:11]
    return {
        "id": order_id,
        "status": status,
        "poNumber": po_number,
        "notes": notes,
        "total": money(total_cents),
        "createdAt": created_at,
        "updatedAt": updated_at,
        "customerId": customer_id,
        "tracking": None if tracking_carrier is None else {
            "carrier": tracking_carrier, "number": tracking_number, "url": tracking_url},
        "items": [order_item_json(item) for item in items],
    }


def webhook_json(row, with_secret=False, at=None):
    grace = row["grace_expires_at"]
    record = {
        "id": row["id"],
        "url": row["url"],
        "events": json.loads(row["events"]),
        "isActive": bool(row["is_active"]),
        "secretRotationGraceExpiresAt": grace if grace and grace > (at or now_iso()) else None,
        "createdAt": row["created_at"],
        "updatedAt": row["updated_at"],
    }
    if with_secret:
        record["secret"] = row["secret"]
    return record


def delivery_json(row):
    return {
        "id": row["id"],
        "event": row["event"],
        "payload": json.loads(row["body"]),
        "statusCode": row["status_code"],
        "responseBody": row["response_body"],
        "durationMs": row["duration_ms"],
        "success": bool(row["success"]),
        "createdAt": row["attempted_at"],
    }


_ITEMS_OF_ORDERS = """
    SELECT i.id, i.quantity, i.unit_price_cents, i.product_id, p.name, p.sku, i.order_id
    FROM order_items i JOIN products p ON p.id = i.product_id
    WHERE i.order_id IN ({})
    ORDER BY i.order_id, i.position"""


def orders_json(conn, order_rows):
    """Orders with their items in two queries, however many orders there are."""
    if not order_rows:
        return []
    items = collections.defaultdict(list)
    ids = [row[0] for row in order_rows]
    sql = _ITEMS_OF_ORDERS.format(",".join("?" * len(ids)))
    for item in conn.execute(sql, ids):
        items[item[6]].append(item)
    return [order_json(row, items[row[0]]) for row in order_rows]


# ---------------------------------------------------------------------------------------------
# 6. Events
# ---------------------------------------------------------------------------------------------

EVENT_CATALOG = (
    "order.created", "order.status_changed", "order.shipped", "order.cancelled",
    "customer.created", "customer.updated", "product.updated", "product.low_stock",
    "invoice.paid", "return.created", "return.approved", "refund.processed",
)


def emit(conn, company_id, name, data):
    """Record an event in the outbox, in the caller's transaction, with one pending delivery
    for each active webhook of the company subscribed to it. The sender delivers after the
    commit; an event nobody subscribes to is not stored."""
    assert name in EVENT_CATALOG, name
    targets = [row["id"] for row in conn.execute(
        "SELECT id, events FROM webhooks WHERE company_id = ? AND is_active = 1", (company_id,))
        if name in json.loads(row["events"])]
    if not targets:
        return None
    event_id, at = new_id_at("evt")
    body = json_text({"event": name, "timestamp": at, "data": data})
    conn.execute("INSERT INTO events (id, company_id, name, body, created_at) "
                 "VALUES (?, ?, ?, ?, ?)", (event_id, company_id, name, body, at))
    conn.executemany(
        "INSERT INTO deliveries (id, event_id, webhook_id, created_at) VALUES (?, ?, ?, ?)",
        [(new_id("dlv"), event_id, webhook_id, at) for webhook_id in targets])
    pending = getattr(_emitted, "event_ids", None)
    if pending is not None:
        pending.append(event_id)
    return event_id


# Built once: json.dumps with options makes a new encoder per call. The API's values are trees
# of plain dicts and lists, so the circular-reference bookkeeping is skipped too.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                         check_circular=False)


def json_text(value):
    return _JSON.encode(value)


def sign(secret, body):
    """X-Webhook-Signature: sha256=<hex HMAC-SHA256 of the raw body, keyed by the whole secret>."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def verify_signature(secret, body, header):
    """For receivers: True when header is the signature of body (bytes) under secret."""
    if isinstance(body, str):
        body = body.encode("utf-8")
    return isinstance(header, str) and hmac.compare_digest(sign(secret, body), header.strip())


# ---------------------------------------------------------------------------------------------
# 7. Operations
# ---------------------------------------------------------------------------------------------
# Each takes a connection inside a write transaction that its caller opened (so a route can
# store its idempotency record in the same one), checks tenancy, and emits its events.

SCOPES = ("products:read", "orders:read", "orders:write", "customers:read", "customers:write",
          "webhooks:read", "webhooks:write")
ORDER_STATUSES = ("SUBMITTED", "CONFIRMED", "SHIPPED", "DELIVERED", "CANCELLED")
CARRIERS = ("CARRIER_A", "CARRIER_B", "CARRIER_C", "CARRIER_D", "CARRIER_E", "OTHER")
CUSTOMER_STATUSES = ("ACTIVE", "BLOCKED")

#: The dashboard's stricter workflow; the API itself enforces only the CANCELLED lock.
DASHBOARD_TRANSITIONS = {
    "SUBMITTED": ("CONFIRMED", "CANCELLED"),
    "CONFIRMED": ("SHIPPED", "CANCELLED"),
    "SHIPPED": ("DELIVERED",),
    "DELIVERED": (),
    "CANCELLED": (),
}

MAX_ORDER_LINES = 100
MAX_QUANTITY = 1_000_000_000
MAX_PO_NUMBER = 100
MAX_ORDER_NOTES = 2000
MAX_WEBHOOKS = 10
MAX_CENTS = 2 ** 63 - 1
MAX_AMOUNT_CENTS = 10 ** 12  # a product price, and any amount an operator command takes


def insert_row(conn, table, row):
    """INSERT one row given as {column: value} (column names come from this module only)."""
    conn.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                 list(row.values()))


def update_changed(conn, table, before, changes):
    """UPDATE the columns in changes that differ from the row before, and updated_at. Returns
    what changed; when nothing did, nothing is written and updatedAt stays."""
    changed = {column: value for column, value in changes.items() if before[column] != value}
    if changed:
        assignments = ", ".join(f"{column} = ?" for column in changed)
        conn.execute(f"UPDATE {table} SET {assignments}, updated_at = ? WHERE id = ?",
                     [*changed.values(), now_iso(), before["id"]])
    return changed


def load_row(conn, table, resource, company_id, row_id):
    """A row of the company, or the resource's 404: another company's row, an unknown ID and
    a malformed one are all the same "not found"."""
    row = conn.execute(f"SELECT * FROM {table} WHERE id = ? AND company_id = ?",
                       (row_id, company_id)).fetchone()
    if row is None:
        raise not_found(resource)
    return row


def load_company(conn, company_id):
    row = conn.execute("SELECT * FROM companies WHERE id = ?", (company_id,)).fetchone()
    if row is None:
        raise not_found("Company")
    return row


def create_company(conn, name, slug=None):
    name = (name or "").strip()
    if not name:
        raise invalid("name", "is required")
    slug = slug if slug is not None else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not re.fullmatch(r"[a-z0-9]+(?:-[a-z0-9]+)*", slug or ""):
        raise invalid("slug", "must be lower-case letters, digits and single hyphens")
    if conn.execute("SELECT 1 FROM companies WHERE slug = ?", (slug,)).fetchone():
        raise ApiError(409, f'A company with slug "{slug}" already exists.')
    company_id, at = new_id_at("co")
    conn.execute("INSERT INTO companies (id, name, slug, created_at) VALUES (?, ?, ?, ?)",
                 (company_id, name, slug, at))
    return {"id": company_id, "name": name, "slug": slug}


def create_api_key(conn, company_id, scopes, rate_limit=60, expires_at=None):
    """A new key; the returned "key" is shown this once and only its hash is kept."""
    load_company(conn, company_id)
    unknown = [scope for scope in scopes if scope not in SCOPES]
    if unknown or not scopes:
        raise invalid("scopes", f"must be some of {', '.join(SCOPES)}")
    if not isinstance(rate_limit, int) or rate_limit < 1:
        raise invalid("rateLimit", "must be a positive whole number")
    key = "sk_" + secrets.token_urlsafe(32)
    key_id, at = new_id_at("key")
    conn.execute(
        "INSERT INTO api_keys (id, company_id, key_hash, scopes, rate_limit, expires_at, "
        "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (key_id, company_id, hash_key(key), " ".join(scopes), rate_limit, expires_at, at))
    return {"id": key_id, "key": key, "companyId": company_id, "scopes": list(scopes),
            "rateLimit": rate_limit, "expiresAt": expires_at}


def revoke_api_key(conn, key_id):
    if conn.execute("UPDATE api_keys SET revoked = 1 WHERE id = ?", (key_id,)).rowcount == 0:
        raise not_found("API key")
    return {"id": key_id, "revoked": True}


# Products (written by the dashboard and the operator commands; read-only over the API)

def load_product(conn, company_id, product_id):
    return load_row(conn, "products", "Product", company_id, product_id)


_PRODUCT_FIELDS = ("name", "sku", "description", "category", "unit", "price_cents", "stock",
                   "image_url", "is_active", "low_stock_threshold")


def _check_product_fields(fields):
    if "name" in fields and not (fields["name"] or "").strip():
        raise invalid("name", "is required")
    if "unit" in fields and not (fields["unit"] or "").strip():
        raise invalid("unit", "must not be empty")
    price = fields.get("price_cents")
    if "price_cents" in fields and not (
            isinstance(price, int) and 0 <= price <= MAX_AMOUNT_CENTS):
        raise invalid("price", f"must be an amount from 0 to {money(MAX_AMOUNT_CENTS)}")
    if "stock" in fields and not (
            isinstance(fields["stock"], int) and 0 <= fields["stock"] <= MAX_QUANTITY):
        raise invalid("stock", f"must be a whole number from 0 to {MAX_QUANTITY}")
    threshold = fields.get("low_stock_threshold")
    if threshold is not None and not (isinstance(threshold, int) and threshold >= 0):
        raise invalid("lowStockThreshold", "must be a whole number >= 0")
    if fields.get("image_url") is not None and not valid_http_url(fields["image_url"]):
        raise invalid("imageUrl", "must be an http or https URL")
    unknown = set(fields) - set(_PRODUCT_FIELDS)
    if unknown:
        raise invalid(sorted(unknown)[0], "is not a product field")


def create_product(conn, company_id, **fields):
    load_company(conn, company_id)
    fields.setdefault("unit", "each")
    fields.setdefault("is_active", 1)
    fields.setdefault("stock", 0)
    _check_product_fields(fields)
    if "price_cents" not in fields:
        raise invalid("price", "is required")
    product_id, at = new_id_at("prod")
    row = dict(fields, id=product_id, company_id=company_id, created_at=at, updated_at=at,
               is_active=int(bool(fields["is_active"])))
    threshold = row.get("low_stock_threshold")
    row["low_stock_alerted"] = int(threshold is not None and row["stock"] <= threshold)
    insert_row(conn, "products", row)
    return load_product(conn, company_id, product_id)


def update_product(conn, company_id, product_id, **changes):
    """A dashboard edit: emits product.updated (the lighter payload for an active toggle alone)
    and product.low_stock when the new stock reaches the threshold."""
    _check_product_fields(changes)
    before = load_product(conn, company_id, product_id)
    if "is_active" in changes:
        changes["is_active"] = int(bool(changes["is_active"]))
    changed = update_changed(conn, "products", before, changes)
    if not changed:
        return before
    after = load_product(conn, company_id, product_id)
    if set(changed) == {"is_active"}:
        emit(conn, company_id, "product.updated", {
            "id": after["id"], "sku": after["sku"], "name": after["name"],
            "isActive": bool(after["is_active"])})
    else:
        emit(conn, company_id, "product.updated", {
            "id": after["id"], "sku": after["sku"], "name": after["name"],
            "price": money(after["price_cents"]), "stock": after["stock"],
            "isActive": bool(after["is_active"]), "category": after["category"]})
    check_low_stock(conn, company_id, after, triggering_order_id=None)
    return after


def check_low_stock(conn, company_id, product, triggering_order_id):
    """product.low_stock fires once when stock reaches the threshold, and is re-armed only
    when stock rises above it again."""
    threshold = product["low_stock_threshold"]
    low = threshold is not None and product["stock"] <= threshold
    if low and not product["low_stock_alerted"]:
        conn.execute("UPDATE products SET low_stock_alerted = 1 WHERE id = ?", (product["id"],))
        emit(conn, company_id, "product.low_stock", {
            "id": product["id"], "sku": product["sku"], "name": product["name"],
            "currentStock": product["stock"], "threshold": threshold,
            "triggeringOrderId": triggering_order_id})
    elif not low and product["low_stock_alerted"]:
        conn.execute("UPDATE products SET low_stock_alerted = 0 WHERE id = ?", (product["id"],))


# Customers

def load_customer(conn, company_id, customer_id):
    return load_row(conn, "customers", "Customer", company_id, customer_id)


CREDIT_LIMIT_MESSAGE = "Credit limit must be between 0 and 100000000."
TAX_RATE_MESSAGE = "Tax rate override must be between 0 and 0.3."


def _customer_changes(body):
    """The validated fields of a create or update body that it actually sends."""
    changes = {}
    if "name" in body:
        changes["name"] = optional_text(body, "name", 200, min_length=1, strip=True)
    if "notes" in body:
        changes["notes"] = optional_text(body, "notes", 2000)
    if "creditLimit" in body:
        changes["credit_limit_cents"] = optional_money(body, "creditLimit", 0, 100_000_000,
                                                       CREDIT_LIMIT_MESSAGE)
    if "taxRateOverride" in body:
        changes["tax_rate_override"] = optional_bounded_number(body, "taxRateOverride", 0, 0.3,
                                                               TAX_RATE_MESSAGE)
    if "status" in body:
        if body["status"] not in CUSTOMER_STATUSES:
            raise ApiError(400, "Invalid status.")
        changes["status"] = body["status"]
    return changes


def create_customer(conn, company_id, body, source="api", store_slug=None, password=None):
    require_object(body)
    email = body.get("email")
    if email is not None and not isinstance(email, str):
        raise invalid("email", "must be a string")
    email = (email or "").strip()
    if not email:
        raise ApiError(400, "Email is required.")
    if not valid_email(email):
        raise ApiError(400, "Invalid email address.")
    fields = _customer_changes(body)
    email_key = email.casefold()
    if conn.execute("SELECT 1 FROM customers WHERE company_id = ? AND email_key = ?",
                    (company_id, email_key)).fetchone():
        raise ApiError(409, "A customer with this email already exists.")
    customer_id, at = new_id_at("cus")
    row = {"id": customer_id, "company_id": company_id, "email": email, "email_key": email_key,
           "status": "ACTIVE", "created_at": at, "updated_at": at,
           "password_hash": password and hash_password(password)}
    row.update(fields)
    insert_row(conn, "customers", row)
    customer = load_customer(conn, company_id, customer_id)
    payload = {"id": customer_id, "email": email, "name": customer["name"]}
    if source == "api":
        payload.update(status=customer["status"], source="api")
    else:
        payload.update(storeSlug=store_slug, source="storefront")
    emit(conn, company_id, "customer.created", payload)
    return customer


def update_customer(conn, company_id, customer_id, body):
    require_object(body)
    if "email" in body:
        raise invalid("email", "cannot be changed")
    changes = _customer_changes(body)
    before = load_customer(conn, company_id, customer_id)
    changed = update_changed(conn, "customers", before, changes)
    if not changed:
        return before
    after = load_customer(conn, company_id, customer_id)
    payload = {"id": after["id"], "email": after["email"], "name": after["name"],
               "status": after["status"]}
    if "status" in changed:
        payload["previousStatus"] = before["status"]
    emit(conn, company_id, "customer.updated", payload)
    return after


def hash_password(password):
    salt = secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, 200_000)
    return "pbkdf2_sha256$200000$" + salt.hex() + "$" + digest.hex()


def company_by_slug(conn, store_slug):
    row = conn.execute("SELECT * FROM companies WHERE slug = ?", (store_slug,)).fetchone()
    if row is None:
        raise not_found("Store")
    return row


def storefront_register(conn, store_slug, email, name=None, password=None):
    """Self-registration on /store/{slug}: customer.created with source storefront."""
    company = company_by_slug(conn, store_slug)
    body = {"email": email} if name is None else {"email": email, "name": name}
    return create_customer(conn, company["id"], body, source="storefront",
                           store_slug=store_slug, password=password)


# Orders

def load_order(conn, company_id, order_id):
    return load_row(conn, "orders", "Order", company_id, order_id)


def order_with_items(conn, company_id, order_id):
    return orders_json(conn, [load_order(conn, company_id, order_id)])[0]


def parse_order_request(body):
    """Step 1 of order placement: the body's shape, with the spec's messages."""
    require_object(body)
    customer_id = body.get("customerId")
    if customer_id is None or customer_id == "":
        raise ApiError(400, "customerId is required")
    if not isinstance(customer_id, str):
        raise invalid("customerId", "must be a string")
    items = body.get("items")
    if items is not None and not isinstance(items, list):
        raise invalid("items", "must be an array")
    if not items:
        raise ApiError(400, "At least one item is required")
    if len(items) > MAX_ORDER_LINES:
        raise invalid("items", f"at most {MAX_ORDER_LINES} items")
    lines = []
    for index, item in enumerate(items):
        require_object(item, f"items[{index}]")
        product_id = item.get("productId")
        if product_id is None or product_id == "":
            raise ApiError(400, "productId is required")
        if not isinstance(product_id, str):
            raise invalid(f"items[{index}].productId", "must be a string")
        quantity = item.get("quantity")
        if not is_number(quantity):
            raise ApiError(400, "quantity must be a number")
        if isinstance(quantity, float) and not math.isinf(quantity):
            if not quantity.is_integer():
                raise ApiError(400, "quantity must be a whole number")
            quantity = int(quantity)
        if quantity < 1:
            raise ApiError(400, "quantity must be at least 1")
        if quantity > MAX_QUANTITY:
            raise invalid(f"items[{index}].quantity", f"must be at most {MAX_QUANTITY}")
        lines.append((product_id, quantity))
    po_number = optional_text(body, "poNumber", MAX_PO_NUMBER)
    notes = optional_text(body, "notes", MAX_ORDER_NOTES)
    return customer_id, lines, po_number, notes


def place_order(conn, company_id, body, source="api"):
    """POST /api/v1/orders in the spec's processing order. The caller's BEGIN IMMEDIATE makes
    the stock check and the decrement one step: stock never goes below zero."""
    customer_id, lines, po_number, notes = parse_order_request(body)
    load_customer(conn, company_id, customer_id)
    wanted = {}
    for product_id, quantity in lines:
        wanted[product_id] = wanted.get(product_id, 0) + quantity
    ids = list(wanted)
    # The unary + keeps SQLite on the primary key: without table statistics it would rather
    # scan the company's active products.
    products = {row["id"]: row for row in conn.execute(
        f"SELECT * FROM products WHERE id IN ({','.join('?' * len(ids))}) "
        f"AND +company_id = ? AND +is_active = 1", [*ids, company_id])}
    for product_id in ids:
        if product_id not in products:
            raise ApiError(400, f'Product "{product_id}" not found or is inactive.')
    for product_id, quantity in wanted.items():
        product = products[product_id]
        if product["stock"] < quantity:
            raise ApiError(400, f'Insufficient stock for product "{product["name"]}". '
                                f'Available: {max(product["stock"], 0)}, requested: {quantity}.')
    total = sum(products[product_id]["price_cents"] * quantity for product_id, quantity in lines)
    if total > MAX_CENTS:
        raise invalid("items", "order total is too large")
    order_id, at = new_id_at("ord")
    conn.execute(
        "INSERT INTO orders (id, company_id, customer_id, status, po_number, notes, total_cents, "
        "source, created_at, updated_at) VALUES (?, ?, ?, 'SUBMITTED', ?, ?, ?, ?, ?, ?)",
        (order_id, company_id, customer_id, po_number, notes, total, source, at, at))
    items = [(new_id("oi"), quantity, products[product_id]["price_cents"], product_id,
              products[product_id]["name"], products[product_id]["sku"])
             for product_id, quantity in lines]
    conn.executemany(
        "INSERT INTO order_items (id, order_id, position, product_id, quantity, "
        "unit_price_cents) VALUES (?, ?, ?, ?, ?, ?)",
        [(item_id, order_id, position, product_id, quantity, unit_price_cents)
         for position, (item_id, quantity, unit_price_cents, product_id, _, _)
         in enumerate(items)])
    conn.executemany("UPDATE products SET stock = stock - ?, updated_at = ? WHERE id = ?",
                     [(quantity, at, product_id) for product_id, quantity in wanted.items()])
    order = order_json((order_id, "SUBMITTED", po_number, notes, total, at, at, customer_id,
                        None, None, None), items)
    if source == "api":
        emit(conn, company_id, "order.created",
             {k: v for k, v in order.items() if k != "tracking"})
    else:
        emit(conn, company_id, "order.created", {
            "id": order_id, "status": "SUBMITTED", "total": order["total"],
            "customerId": customer_id, "poNumber": po_number, "itemCount": len(lines)})
    for product_id, quantity in wanted.items():
        product = dict(products[product_id])
        product["stock"] -= quantity
        check_low_stock(conn, company_id, product, order_id)
    return order


def storefront_place_order(conn, store_slug, customer_id, items, po_number=None, notes=None):
    """An order placed by a logged-in customer on the storefront (order.created carries the
    storefront shape, with itemCount and no items). Blocked customers cannot log in."""
    company = company_by_slug(conn, store_slug)
    if load_customer(conn, company["id"], customer_id)["status"] == "BLOCKED":
        raise ApiError(403, "Customer is blocked.")
    body = {"customerId": customer_id, "items": items, "poNumber": po_number, "notes": notes}
    return place_order(conn, company["id"], body, source="storefront")


def parse_status_update(body, templates):
    """The body of PATCH /api/v1/orders/{id}: (status, tracking or None)."""
    require_object(body)
    status = body.get("status")
    if status not in ORDER_STATUSES:
        raise ApiError(400, "Invalid order status.")
    tracking = body.get("tracking")
    if tracking is None:
        return status, None
    if status != "SHIPPED":
        raise ApiError(400, "Tracking info is only valid when status is SHIPPED.")
    require_object(tracking, "tracking")
    carrier = tracking.get("carrier")
    if carrier not in CARRIERS:
        raise invalid("tracking.carrier", f"must be one of {', '.join(CARRIERS)}")
    number = tracking.get("number")
    if not isinstance(number, str) or not 3 <= len(number.strip()) <= 64:
        raise invalid("tracking.number", "must be 3 to 64 characters")
    number = number.strip()
    url = tracking.get("url")
    if url is None or url == "":
        if carrier == "OTHER":
            raise ApiError(400, "Tracking URL is required when carrier is OTHER.")
        url = templates[carrier].format(number=urllib.parse.quote(number, safe=""))
    elif not valid_http_url(url):
        raise invalid("tracking.url", "must be an http or https URL of at most 2048 characters")
    return status, {"carrier": carrier, "number": number, "url": url}


def update_order_status(conn, company_id, order_id, status, tracking=None):
    """The API's rule: any status to any status, except out of CANCELLED. Tracking, once set,
    stays through later transitions. Cancelling touches neither stock nor returns."""
    before = load_order(conn, company_id, order_id)
    if before["status"] == "CANCELLED":
        raise ApiError(422, "Cannot update a cancelled order.")
    at = now_iso()
    if tracking:
        conn.execute(
            "UPDATE orders SET status = ?, tracking_carrier = ?, tracking_number = ?, "
            "tracking_url = ?, updated_at = ? WHERE id = ?",
            (status, tracking["carrier"], tracking["number"], tracking["url"], at, order_id))
    else:
        conn.execute("UPDATE orders SET status = ?, updated_at = ? WHERE id = ?",
                     (status, at, order_id))
    order = order_with_items(conn, company_id, order_id)
    previous = before["status"]
    emit(conn, company_id, "order.status_changed", dict(order, previousStatus=previous))
    summary = {"id": order_id, "previousStatus": previous, "total": order["total"],
               "customerId": order["customerId"]}
    if status == "SHIPPED":
        emit(conn, company_id, "order.shipped", dict(summary, tracking=order["tracking"]))
    elif status == "CANCELLED":
        emit(conn, company_id, "order.cancelled", summary)
    return order


def dashboard_allows(from_status, to_status):
    return to_status in DASHBOARD_TRANSITIONS.get(from_status, ())


def dashboard_update_order_status(conn, company_id, order_id, status, tracking=None):
    """A status change on the dashboard's behalf, held to its stricter workflow."""
    current = load_order(conn, company_id, order_id)["status"]
    if current == "CANCELLED" or not dashboard_allows(current, status):
        if current == "CANCELLED":
            raise ApiError(422, "Cannot update a cancelled order.")
        raise ApiError(422, f"The dashboard does not move an order from {current} to {status}.")
    return update_order_status(conn, company_id, order_id, status, tracking)


# Returns, refunds and the company's own invoices (recorded for their events)

def load_return(conn, company_id, return_id):
    return load_row(conn, "returns", "Return", company_id, return_id)


def open_return(conn, company_id, order_id, reason, item_count=None, actor=None):
    """A return opened by a customer (actor None) or from the dashboard (actor 'staff')."""
    order = load_order(conn, company_id, order_id)
    reason = (reason or "").strip()
    if not 3 <= len(reason) <= 2000:
        raise invalid("reason", "must be 3 to 2000 characters")
    if actor not in (None, "staff"):
        raise invalid("actor", "must be staff or absent")
    lines = conn.execute("SELECT COUNT(*) FROM order_items WHERE order_id = ?",
                         (order_id,)).fetchone()[0]
    item_count = lines if item_count is None else item_count
    if not 1 <= item_count <= lines:
        raise invalid("itemCount", f"must be 1 to {lines}, the order's line items")
    return_id, at = new_id_at("ret")
    conn.execute(
        "INSERT INTO returns (id, company_id, order_id, customer_id, status, reason, item_count, "
        "actor, created_at, updated_at) VALUES (?, ?, ?, ?, 'REQUESTED', ?, ?, ?, ?, ?)",
        (return_id, company_id, order_id, order["customer_id"], reason, item_count, actor, at, at))
    payload = {"id": return_id, "orderId": order_id, "customerId": order["customer_id"],
               "itemCount": item_count, "reason": reason, "status": "REQUESTED"}
    if actor:
        payload["actor"] = actor
    emit(conn, company_id, "return.created", payload)
    return load_return(conn, company_id, return_id)


def _move_return(conn, company_id, return_id, from_status, to_status):
    row = load_return(conn, company_id, return_id)
    if row["status"] != from_status:
        raise ApiError(422, f"Return is {row['status']}; only a {from_status} return can "
                            f"become {to_status}.")
    conn.execute("UPDATE returns SET status = ?, updated_at = ? WHERE id = ?",
                 (to_status, now_iso(), return_id))
    return load_return(conn, company_id, return_id)


def approve_return(conn, company_id, return_id):
    row = _move_return(conn, company_id, return_id, "REQUESTED", "APPROVED")
    emit(conn, company_id, "return.approved", {
        "id": row["id"], "orderId": row["order_id"], "customerId": row["customer_id"],
        "status": "APPROVED"})
    return row


def receive_return(conn, company_id, return_id):
    return _move_return(conn, company_id, return_id, "APPROVED", "RECEIVED")


def refund_return(conn, company_id, return_id, method, good_units, damaged_units,
                  subtotal_cents, amount_cents=None):
    """The refund row that moves a return RECEIVED to REFUNDED; amount defaults to the
    subtotal and may be overridden."""
    if method not in ("CREDIT", "MANUAL"):
        raise invalid("method", "must be CREDIT or MANUAL")
    for field, value in (("goodUnits", good_units), ("damagedUnits", damaged_units),
                         ("subtotal", subtotal_cents)):
        if not isinstance(value, int) or value < 0:
            raise invalid(field, "must be a whole number >= 0")
    amount_cents = subtotal_cents if amount_cents is None else amount_cents
    if not isinstance(amount_cents, int) or amount_cents < 0:
        raise invalid("amount", "must be an amount >= 0")
    row = _move_return(conn, company_id, return_id, "RECEIVED", "REFUNDED")
    refund_id, at = new_id_at("ref")
    conn.execute(
        "INSERT INTO refunds (id, company_id, return_id, amount_cents, method, good_units, "
        "damaged_units, subtotal_cents, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (refund_id, company_id, return_id, amount_cents, method, good_units, damaged_units,
         subtotal_cents, at))
    payload = {"id": refund_id, "returnId": return_id, "orderId": row["order_id"],
               "customerId": row["customer_id"], "amount": money(amount_cents), "method": method,
               "breakdown": {"goodUnits": good_units, "damagedUnits": damaged_units,
                             "subtotal": money(subtotal_cents)}}
    emit(conn, company_id, "refund.processed", payload)
    return payload


def record_invoice_paid(conn, company_id, stripe_invoice_id, amount_paid_cents, currency,
                        hosted_invoice_url, number, period_start, period_end):
    """A paid invoice of the company's own subscription, as the billing provider reports it."""
    load_company(conn, company_id)
    for field, value in (("stripeInvoiceId", stripe_invoice_id), ("number", number)):
        if not value:
            raise invalid(field, "is required")
    if not re.fullmatch(r"[a-z]{3}", currency or ""):
        raise invalid("currency", "must be a three-letter lower-case code")
    if not valid_http_url(hosted_invoice_url):
        raise invalid("hostedInvoiceUrl", "must be an http or https URL")
    if not isinstance(amount_paid_cents, int) or amount_paid_cents < 0:
        raise invalid("amountPaid", "must be an amount >= 0")
    period = []
    for field, value in (("periodStart", period_start), ("periodEnd", period_end)):
        ms = js_parse_date(value)
        if ms is None:
            raise invalid(field, "must be an ISO 8601 datetime")
        period.append(iso(ms))
    if conn.execute("SELECT 1 FROM invoices WHERE stripe_invoice_id = ?",
                    (stripe_invoice_id,)).fetchone():
        raise ApiError(409, f'Invoice "{stripe_invoice_id}" was already recorded.')
    invoice_id, at = new_id_at("inv")
    conn.execute(
        "INSERT INTO invoices (id, company_id, stripe_invoice_id, amount_paid_cents, currency, "
        "hosted_invoice_url, number, period_start, period_end, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (invoice_id, company_id, stripe_invoice_id, amount_paid_cents, currency,
         hosted_invoice_url, number, period[0], period[1], at))
    payload = {"stripeInvoiceId": stripe_invoice_id, "amountPaid": money(amount_paid_cents),
               "currency": currency, "hostedInvoiceUrl": hosted_invoice_url, "number": number,
               "periodStart": period[0], "periodEnd": period[1]}
    emit(conn, company_id, "invoice.paid", payload)
    return payload


# Webhook subscriptions

def load_webhook(conn, company_id, webhook_id):
    return load_row(conn, "webhooks", "Webhook", company_id, webhook_id)


def new_webhook_secret():
    return "whsec_" + base64.urlsafe_b64encode(secrets.token_bytes(24)).decode("ascii")


def _webhook_changes(body, creating):
    require_object(body)
    changes = {}
    if creating or "url" in body:
        url = body.get("url")
        if creating and (url is None or url == ""):
            raise ApiError(400, "URL is required.")
        if not valid_http_url(url):
            raise ApiError(400, "Invalid URL.")
        changes["url"] = url
    if creating or "events" in body:
        events = body.get("events")
        if events is not None and not isinstance(events, list):
            raise invalid("events", "must be an array of event names")
        if not events:
            raise ApiError(400, "At least one event is required.")
        for name in events:
            if not isinstance(name, str):
                raise invalid("events", "must be an array of event names")
            if name not in EVENT_CATALOG:
                raise ApiError(400, f'Unknown event: "{name}".')
        changes["events"] = json_text(list(dict.fromkeys(events)))
    if "isActive" in body:
        if not isinstance(body["isActive"], bool):
            raise invalid("isActive", "must be true or false")
        changes["is_active"] = int(body["isActive"])
    return changes


def create_webhook(conn, company_id, body):
    changes = _webhook_changes(body, creating=True)
    count = conn.execute("SELECT COUNT(*) FROM webhooks WHERE company_id = ?",
                         (company_id,)).fetchone()[0]
    if count >= MAX_WEBHOOKS:
        raise ApiError(409, f"Maximum of {MAX_WEBHOOKS} webhooks per company.")
    webhook_id, at = new_id_at("wh")
    conn.execute(
        "INSERT INTO webhooks (id, company_id, url, events, is_active, secret, created_at, "
        "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (webhook_id, company_id, changes["url"], changes["events"], changes.get("is_active", 1),
         new_webhook_secret(), at, at))
    return load_webhook(conn, company_id, webhook_id)


def update_webhook(conn, company_id, webhook_id, body):
    changes = _webhook_changes(body, creating=False)
    update_changed(conn, "webhooks", load_webhook(conn, company_id, webhook_id), changes)
    return load_webhook(conn, company_id, webhook_id)


def delete_webhook(conn, company_id, webhook_id):
    """Removes the webhook, its delivery log and its pending deliveries."""
    load_webhook(conn, company_id, webhook_id)
    conn.execute("DELETE FROM webhooks WHERE id = ?", (webhook_id,))
    return {"id": webhook_id, "deleted": True}


def rotate_webhook_secret(conn, webhook_id, grace_hours=24):
    """A new secret; for grace_hours the old one still signs X-Webhook-Signature-Old."""
    row = conn.execute("SELECT * FROM webhooks WHERE id = ?", (webhook_id,)).fetchone()
    if row is None:
        raise not_found("Webhook")
    if not isinstance(grace_hours, (int, float)) or not 0 <= grace_hours <= 24 * 30:
        raise invalid("graceHours", "must be 0 to 720")
    secret = new_webhook_secret()
    grace = iso(int((time.time() + grace_hours * 3600) * 1000)) if grace_hours else None
    conn.execute("UPDATE webhooks SET secret = ?, old_secret = ?, grace_expires_at = ?, "
                 "updated_at = ? WHERE id = ?",
                 (secret, row["secret"] if grace else None, grace, now_iso(), webhook_id))
    return {"id": webhook_id, "secret": secret, "secretRotationGraceExpiresAt": grace}


def recent_deliveries(conn, webhook_id, count=5):
    """The delivery log as the dashboard shows it: the most recent attempts first."""
    return [delivery_json(row) for row in conn.execute(
        "SELECT d.*, e.name AS event, e.body FROM deliveries d JOIN events e ON e.id = d.event_id "
        "WHERE d.webhook_id = ? AND d.state = 'done' ORDER BY d.attempted_at DESC, d.id DESC "
        "LIMIT ?", (webhook_id, count))]


# ---------------------------------------------------------------------------------------------
# 8. Delivery
# ---------------------------------------------------------------------------------------------
# One attempt per delivery, as the spec says, but an attempt is never forgotten: deliveries
# are claimed from the outbox under a lease, so a process that dies mid-send leaves them to be
# claimed again. That makes duplicates possible (receivers dedupe on X-Webhook-Id).

USER_AGENT = f"ordering-webhooks/{__version__}"
MAX_LOGGED_BODY = 2000


class DeliveryRefused(Exception):
    """A destination the sender will not connect to."""


class _DeadlineReader(io.RawIOBase):
    """Socket reads that share one deadline, so a slow-drip response cannot outlast it."""

    def __init__(self, sock, deadline):
        self.sock = sock
        self.deadline = deadline

    def readable(self):
        return True

    def readinto(self, buffer):
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class _DeadlineSocket:
    def __init__(self, sock, deadline):
        self.reader = io.BufferedReader(_DeadlineReader(sock, deadline))

    def makefile(self, *args, **kwargs):
        return self.reader


def address_allowed(address):
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def resolve(host, port, timeout):
    """getaddrinfo under the delivery deadline (it has no timeout of its own)."""
    answer = {}

    def lookup():
        try:
            answer["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            answer["error"] = error
    thread = threading.Thread(target=lookup, name="ordering-resolve", daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" in answer:
        raise answer["error"]
    if not answer.get("infos"):
        raise socket.timeout("timed out")
    return answer["infos"]


def post_webhook(url, body, headers, timeout, allow_private=False):
    """One POST, with one deadline for the whole exchange, to the address that was checked
    (so a second DNS answer cannot point it elsewhere). Returns (status, response text)."""
    deadline = time.monotonic() + timeout
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    infos = resolve(parts.hostname, port, timeout)
    if not allow_private:
        for info in infos:
            if not address_allowed(info[4][0]):
                raise DeliveryRefused(
                    f"Refused: {parts.hostname} resolves to {info[4][0]}, a loopback, private, "
                    f"link-local or reserved address.")
    sock, error = None, None
    for family, kind, proto, _, address in infos:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        candidate = socket.socket(family, kind, proto)
        try:
            candidate.settimeout(remaining)
            candidate.connect(address)
            sock = candidate
            break
        except OSError as failure:
            candidate.close()
            error = failure
    if sock is None:
        raise error
    try:
        if parts.scheme == "https":
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        lines = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}",
                 f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        response = http.client.HTTPResponse(_DeadlineSocket(sock, deadline))
        response.begin()
        text = response.read(MAX_LOGGED_BODY * 4).decode("utf-8", "replace")
        return response.status, text[:MAX_LOGGED_BODY]
    finally:
        sock.close()


def describe_failure(error, timeout):
    if isinstance(error, DeliveryRefused):
        return str(error)
    if isinstance(error, socket.timeout):
        return f"Timed out after {timeout:g} seconds."
    if isinstance(error, ConnectionRefusedError):
        return "Connection refused."
    if isinstance(error, socket.gaierror):
        return f"DNS lookup failed: {error.strerror or error}."
    return f"{type(error).__name__}: {error}"[:MAX_LOGGED_BODY]


#: WAL size in bytes beyond which the sender's housekeeping truncates it.
WAL_TRUNCATE_BYTES = 16 * 1024 * 1024

_CLAIMABLE = ("state = 'pending' OR (state = 'sending' AND lease_until < :now)")


class Sender:
    """The webhook sender: a dispatcher thread that claims deliveries from the outbox and a
    bounded pool of threads that send them and write the delivery log."""

    def __init__(self, db, settings):
        self.db = db
        self.settings = settings
        self.jobs = queue.Queue()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.busy = 0
        self.busy_changed = threading.Condition()
        self.threads = []
        self.next_housekeeping = 0.0

    # Life cycle

    def start(self):
        """Workers and the dispatcher, which also picks up what other processes recorded and
        what a crash left behind."""
        self.start_workers()
        dispatcher = threading.Thread(target=self._dispatch, name="ordering-dispatch",
                                      daemon=True)
        dispatcher.start()
        self.threads.append(dispatcher)

    def start_workers(self):
        for number in range(self.settings.delivery_workers):
            worker = threading.Thread(target=self._work, name=f"ordering-deliver-{number}",
                                      daemon=True)
            worker.start()
            self.threads.append(worker)

    def notify(self, event_ids=None):
        self.wake.set()

    def stop(self, grace=None):
        """Stop claiming; give deliveries in flight up to grace seconds (default: the delivery
        timeout). Whatever is not sent stays in the outbox for the next start."""
        self.stopping.set()
        self.wake.set()
        grace = self.settings.webhook_timeout if grace is None else grace
        self.wait_idle(grace)
        for _ in self.threads:
            self.jobs.put(None)

    def wait_idle(self, timeout):
        deadline = time.monotonic() + timeout
        with self.busy_changed:
            while self.busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.busy_changed.wait(remaining)
        return True

    # Claiming

    def claim(self, limit, event_ids=None):
        """Atomically take up to limit deliveries (only of event_ids, if given) under a lease."""
        now = now_iso()
        conn = self.db.conn
        if event_ids is None:
            waiting = f"SELECT id FROM deliveries WHERE {_CLAIMABLE} ORDER BY id LIMIT :limit"
            args = {"now": now, "limit": limit}
            if conn.execute(waiting, args).fetchone() is None:
                return []
        else:
            waiting = ("SELECT id FROM deliveries WHERE state = 'pending' AND event_id IN "
                       "(SELECT value FROM json_each(:events)) LIMIT :limit")
            args = {"limit": limit, "events": json_text(list(event_ids))}
        # A send is bounded by the timeout (DNS included); the slack covers writing its result.
        lease = iso(int((time.time() + 2 * self.settings.webhook_timeout + 5) * 1000))
        with self.db.write() as conn:
            ids = [row[0] for row in conn.execute(
                f"UPDATE deliveries SET state = 'sending', lease_until = :lease "
                f"WHERE id IN ({waiting}) RETURNING id", dict(args, lease=lease))]
        if not ids:
            return []
        return conn.execute(
            "SELECT d.id, d.event_id, e.name AS event, e.body, w.url, w.secret, w.old_secret, "
            "w.grace_expires_at FROM deliveries d JOIN events e ON e.id = d.event_id "
            "JOIN webhooks w ON w.id = d.webhook_id "
            f"WHERE d.id IN ({','.join('?' * len(ids))}) ORDER BY d.id", ids).fetchall()

    def submit(self, jobs):
        with self.busy_changed:
            self.busy += len(jobs)
        for job in jobs:
            self.jobs.put(job)

    def deliver_events(self, event_ids, timeout=None):
        """Send the deliveries of these events now and wait (the operator commands use this
        so that their events go out before they exit)."""
        if event_ids:
            self.submit(self.claim(10_000, event_ids))
        return self.wait_idle(self.settings.webhook_timeout + 5 if timeout is None else timeout)

    def _dispatch(self):
        while not self.stopping.is_set():
            self.wake.wait(self.settings.delivery_poll_interval)
            self.wake.clear()
            if self.stopping.is_set():
                break
            try:
                free = self.settings.delivery_workers - self.busy
                if free > 0:
                    self.submit(self.claim(free))
                self._housekeeping()
            except sqlite3.Error:
                log.exception("could not claim webhook deliveries; will try again")

    def _housekeeping(self):
        """Off the request path: keep the WAL file bounded, and once a minute forget expired
        idempotency keys."""
        wal = self.db.path + "-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > WAL_TRUNCATE_BYTES:
            # Under constant reads SQLite's automatic checkpoints never get to restart the
            # WAL, so it would grow without end; TRUNCATE waits for a gap between readers.
            self.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        if time.monotonic() < self.next_housekeeping:
            return
        self.next_housekeeping = time.monotonic() + 60
        with self.db.write() as conn:
            conn.execute("DELETE FROM idempotency_keys WHERE expires_at < ?", (now_iso(),))

    # Sending

    def _work(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                self.send(job)
            except Exception:
                log.exception("webhook delivery %s failed unexpectedly", job["id"])
            finally:
                with self.busy_changed:
                    self.busy -= 1
                    self.busy_changed.notify_all()
                self.wake.set()

    def send(self, job):
        body = job["body"].encode("utf-8")
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "X-Webhook-Event": job["event"],
            "X-Webhook-Id": job["event_id"],
            "X-Webhook-Signature": sign(job["secret"], body),
        }
        if job["old_secret"] and job["grace_expires_at"] and job["grace_expires_at"] > now_iso():
            headers["X-Webhook-Signature-Old"] = sign(job["old_secret"], body)
        started = time.monotonic()
        try:
            status, text = post_webhook(job["url"], body, headers, self.settings.webhook_timeout,
                                        self.settings.allow_private_webhooks)
        except Exception as error:  # every failure of the one attempt is logged, never raised
            status, text = None, describe_failure(error, self.settings.webhook_timeout)
        duration_ms = int((time.monotonic() - started) * 1000)
        success = status is not None and 200 <= status < 300
        with self.db.write() as conn:
            conn.execute(
                "UPDATE deliveries SET state = 'done', lease_until = NULL, status_code = ?, "
                "response_body = ?, duration_ms = ?, success = ?, attempted_at = ? WHERE id = ?",
                (status, text, duration_ms, int(success), now_iso(), job["id"]))


# ---------------------------------------------------------------------------------------------
# 9. HTTP
# ---------------------------------------------------------------------------------------------

Route = collections.namedtuple("Route", "method path scope status handler summary")

#: Every operation of the API; the app, and the OpenAPI document, are built from this table.
ROUTES = []


def route(method, path, scope, status=200):
    def register(handler):
        summary = (handler.__doc__ or "").strip().splitlines()[0] if handler.__doc__ else ""
        ROUTES.append(Route(method, path, scope, status, handler, summary))
        return handler
    return register


class Call:
    """What a route handler gets: the connection (inside the write transaction for writes),
    the key's company, the query parameters and the parsed body."""
    __slots__ = ("conn", "company_id", "query", "body", "settings")

    def __init__(self, conn, company_id, query, body, settings):
        self.conn = conn
        self.company_id = company_id
        self.query = query
        self.body = body
        self.settings = settings


Key = collections.namedtuple("Key", "id company_id scopes rate_limit expires_at revoked")


class WindowCounter:
    """Requests per fixed one-minute window. Only the current window's counts are kept, so
    memory is bounded by the clients seen in one minute."""

    def __init__(self):
        self.lock = threading.Lock()
        self.window = None
        self.counts = {}

    def hit(self, client, limit, now=None):
        """(allowed, remaining, seconds until the window resets)."""
        now = time.time() if now is None else now
        window = int(now // 60)
        with self.lock:
            if window != self.window:
                self.window, self.counts = window, {}
            count = self.counts.get(client, 0) + 1
            self.counts[client] = count
        return count <= limit, max(0, limit - count), (window + 1) * 60 - now


RATE_LIMITED = "Rate limit exceeded. Try again shortly."
MISSING_AUTH = "Missing or invalid Authorization header. Use: Bearer <api_key>"
INVALID_KEY = "Invalid, expired, or revoked API key."


def rate_limited(reset_seconds, headers):
    retry_after = max(1, math.ceil(reset_seconds))
    return ApiError(429, RATE_LIMITED, extra={"retryAfter": retry_after},
                    headers=dict(headers, **{"Retry-After": str(retry_after)}))


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def _json_int(text):
    # Valid JSON, but past int()'s digit cap: as large as JavaScript would make it, so the
    # field's own range check answers.
    return int(text) if len(text) < 4000 else float(text)


def _has_lone_surrogate(value):
    pending = [value]  # a loop, not recursion: bodies may nest deeper than the stack
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            if any("\ud800" <= ch <= "\udfff" for ch in value):
                return True
        elif isinstance(value, dict):
            pending.extend(value)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False


def parse_json_body(raw):
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant,
                           parse_int=_json_int)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ApiError(400, "Invalid JSON body.") from None
    # A \ud800-style escape decodes to a lone surrogate, which is not text: no UTF-8 form.
    if b"\\u" in raw and _has_lone_surrogate(value):
        raise ApiError(400, "Invalid JSON body.")
    return value


def page_limit(text):
    """limit as the spec reads it: parseInt, default 50 when not a number, clamped to 1..100."""
    number = js_parse_int(text)
    return 50 if number is None else min(100, max(1, number))


def paginate(conn, table, company_id, query, filters=(), params=(), serialize=None):
    """One page of a list endpoint, newest first, (createdAt, id) descending so that equal
    timestamps never skip or repeat a record. The cursor is the last ID of the previous page;
    one that is not the company's gives an empty last page."""
    limit = page_limit(query.get("limit"))
    where, args = ["company_id = ?", *filters], [company_id, *params]
    cursor = query.get("cursor")
    if cursor:
        anchor = conn.execute(f"SELECT created_at, id FROM {table} WHERE id = ? AND company_id = ?",
                              (cursor, company_id)).fetchone()
        if anchor is None:
            return {"data": [], "pagination": {"hasMore": False, "nextCursor": None}}
        where.append("(created_at, id) < (?, ?)")
        args += [anchor["created_at"], anchor["id"]]
    rows = conn.execute(
        f"SELECT * FROM {table} WHERE {' AND '.join(where)} "
        f"ORDER BY created_at DESC, id DESC LIMIT ?", [*args, limit + 1]).fetchall()
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {"data": serialize(conn, rows),
            "pagination": {"hasMore": has_more, "nextCursor": rows[-1]["id"] if has_more else None}}


def search_filter(columns, needle):
    """Case-insensitive substring match on any of columns (Unicode case folding)."""
    folded = needle.casefold()
    return "(" + " OR ".join(f"contains_folded({c}, ?)" for c in columns) + ")", [folded] * len(columns)


def date_filter(query, name):
    text = query.get(name)
    if not text:
        return None
    ms = js_parse_date(text)
    if ms is None:
        raise invalid(name, "must be a date (2026-11-22) or an ISO 8601 datetime")
    return iso(ms)


# Routes: parse, call an operation, wrap.

@route("GET", "/api/v1/products", "products:read")
def list_products(call):
    """List products"""
    filters, params = [], []
    if call.query.get("category"):
        filters.append("category = ?")
        params.append(call.query["category"])
    if call.query.get("search"):
        clause, values = search_filter(("name", "sku", "category"), call.query["search"])
        filters.append(clause)
        params += values
    active = call.query.get("active")
    if active in ("true", "false"):
        filters.append("is_active = ?")
        params.append(int(active == "true"))
    return paginate(call.conn, "products", call.company_id, call.query, filters, params,
                    lambda conn, rows: [product_json(row) for row in rows])


@route("GET", "/api/v1/products/<product_id>", "products:read")
def get_product(call, product_id):
    """Fetch one product"""
    return {"data": product_json(load_product(call.conn, call.company_id, product_id))}


@route("GET", "/api/v1/orders", "orders:read")
def list_orders(call):
    """List orders"""
    filters, params = [], []
    status = call.query.get("status")
    if status:
        if status not in ORDER_STATUSES:
            raise ApiError(400, "Invalid order status.")
        filters.append("status = ?")
        params.append(status)
    if call.query.get("customerId"):
        filters.append("customer_id = ?")
        params.append(call.query["customerId"])
    for name, operator in (("since", ">="), ("until", "<=")):
        bound = date_filter(call.query, name)
        if bound is not None:
            filters.append(f"created_at {operator} ?")
            params.append(bound)
    return paginate(call.conn, "orders", call.company_id, call.query, filters, params,
                    orders_json)


@route("GET", "/api/v1/orders/<order_id>", "orders:read")
def get_order(call, order_id):
    """Fetch one order"""
    return {"data": order_with_items(call.conn, call.company_id, order_id)}


@route("POST", "/api/v1/orders", "orders:write", status=201)
def post_order(call):
    """Place an order"""
    return {"data": place_order(call.conn, call.company_id, call.body)}


@route("PATCH", "/api/v1/orders/<order_id>", "orders:write")
def patch_order(call, order_id):
    """Update an order's status and tracking"""
    status, tracking = parse_status_update(call.body, call.settings.tracking_url_templates)
    return {"data": update_order_status(call.conn, call.company_id, order_id, status, tracking)}


@route("GET", "/api/v1/customers", "customers:read")
def list_customers(call):
    """List customers"""
    filters, params = [], []
    status = call.query.get("status")
    if status:
        if status not in ("ACTIVE", "BLOCKED", "PENDING"):
            raise ApiError(400, "Invalid status.")
        filters.append("status = ?")
        params.append(status)
    if call.query.get("search"):
        clause, values = search_filter(("email_key", "name"), call.query["search"])
        filters.append(clause)
        params += values
    return paginate(call.conn, "customers", call.company_id, call.query, filters, params,
                    lambda conn, rows: [customer_json(row) for row in rows])


@route("GET", "/api/v1/customers/<customer_id>", "customers:read")
def get_customer(call, customer_id):
    """Fetch one customer"""
    return {"data": customer_json(load_customer(call.conn, call.company_id, customer_id))}


@route("POST", "/api/v1/customers", "customers:write", status=201)
def post_customer(call):
    """Create a customer"""
    return {"data": customer_json(create_customer(call.conn, call.company_id, call.body))}


@route("PATCH", "/api/v1/customers/<customer_id>", "customers:write")
def patch_customer(call, customer_id):
    """Update a customer"""
    return {"data": customer_json(
        update_customer(call.conn, call.company_id, customer_id, call.body))}


@route("GET", "/api/v1/webhooks", "webhooks:read")
def list_webhooks(call):
    """List webhook subscriptions"""
    at = now_iso()
    return {"data": [webhook_json(row, at=at) for row in call.conn.execute(
        "SELECT * FROM webhooks WHERE company_id = ? ORDER BY created_at DESC, id DESC",
        (call.company_id,))]}


@route("GET", "/api/v1/webhooks/<webhook_id>", "webhooks:read")
def get_webhook(call, webhook_id):
    """Fetch one webhook subscription"""
    return {"data": webhook_json(load_webhook(call.conn, call.company_id, webhook_id))}


@route("POST", "/api/v1/webhooks", "webhooks:write", status=201)
def post_webhook_subscription(call):
    """Create a webhook subscription (the only response that carries its secret)"""
    return {"data": webhook_json(create_webhook(call.conn, call.company_id, call.body),
                                 with_secret=True)}


@route("PATCH", "/api/v1/webhooks/<webhook_id>", "webhooks:write")
def patch_webhook(call, webhook_id):
    """Update a webhook subscription"""
    return {"data": webhook_json(
        update_webhook(call.conn, call.company_id, webhook_id, call.body))}


@route("DELETE", "/api/v1/webhooks/<webhook_id>", "webhooks:write")
def remove_webhook(call, webhook_id):
    """Delete a webhook subscription and its delivery log"""
    return {"data": delete_webhook(call.conn, call.company_id, webhook_id)}


# The OpenAPI document -----------------------------------------------------------------------

# OpenAPI 3.1. The document is built from ROUTES (method, path, scope, success status, summary)
# and OPERATIONS (what ROUTES does not know: query parameters, request body, success body and
# error statuses). A route without an OPERATIONS entry stops openapi_document() with a
# KeyError, so the document cannot fall behind the app. Schemas are JSON Schema 2020-12.

OPENAPI_VERSION = "3.1.0"


def schema_ref(name):
    return {"$ref": "#/components/schemas/" + name}


def nullable(schema):
    """schema or null: `type: [..., "null"]`, or anyOf for a reference."""
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return dict(schema, type=[*types, "null"])
    return {"anyOf": [schema, {"type": "null"}]}


def object_schema(properties, optional=(), closed=True, **keywords):
    """An object whose properties are required except `optional`. Closed objects (responses,
    events) carry no other field; open ones (request bodies) may, as unknown fields are
    ignored."""
    schema = {"type": "object", "properties": properties,
              "required": [name for name in properties if name not in optional]}
    if closed:
        schema["additionalProperties"] = False
    schema.update(keywords)
    return schema


def string_schema(min_length=None, max_length=None, **keywords):
    schema = {"type": "string", **keywords}
    if min_length is not None:
        schema["minLength"] = min_length
    if max_length is not None:
        schema["maxLength"] = max_length
    return schema


def enum_schema(values):
    return {"type": "string", "enum": list(values)}


def integer_schema(minimum=None, maximum=None):
    schema = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def money_schema(maximum=None, exact=False):
    """A JSON number of currency units (12.5 is 12.50). exact: a client's amount, which may not
    have more than two decimal places (400 Validation failed.)."""
    schema = {"type": "number", "minimum": 0}
    if maximum is not None:
        schema["maximum"] = maximum
    if exact:
        schema["multipleOf"] = 0.01
    return schema


BOOLEAN = {"type": "boolean"}
ID_SCHEMA = string_schema(1)
TIMESTAMP_SCHEMA = {"type": "string", "format": "date-time",
                    "description": "ISO 8601 UTC with milliseconds: 2026-11-22T14:33:54.123Z"}
#: A URL the service accepted: http or https, no credentials, no spaces, ASCII.
URL_SCHEMA = string_schema(1, 2048, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[!-~]+$")
_PORT = r"(6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|\d{1,4})"
#: A URL a client sends: the common shape of what the service accepts.
URL_INPUT_SCHEMA = string_schema(
    1, 2048, pattern=rf"^[Hh][Tt][Tt][Pp][Ss]?://[A-Za-z0-9.-]+(:{_PORT})?([/?#][!-~]*)?$",
    description="An http or https URL, at most 2048 characters, without credentials.")
CUSTOMER_STATUS_VALUES = (*CUSTOMER_STATUSES, "PENDING")    # PENDING is stored, never set
TAX_RATE = {"type": "number", "minimum": 0, "maximum": 0.3}
EVENT_NAMES = enum_schema(EVENT_CATALOG)

_ORDER_FIELDS = {
    "id": ID_SCHEMA,
    "status": enum_schema(ORDER_STATUSES),
    "poNumber": nullable(string_schema(max_length=MAX_PO_NUMBER)),
    "notes": nullable(string_schema(max_length=MAX_ORDER_NOTES)),
    "total": money_schema(),
    "createdAt": TIMESTAMP_SCHEMA,
    "updatedAt": TIMESTAMP_SCHEMA,
    "customerId": nullable(ID_SCHEMA),
    "tracking": nullable(schema_ref("Tracking")),
    "items": {"type": "array", "items": schema_ref("OrderItem")},
}
_CUSTOMER_INPUT = {
    "name": nullable(string_schema(1, 200, pattern=r"\S", description="Trimmed.")),
    "notes": nullable(string_schema(0, 2000)),
    "creditLimit": nullable(money_schema(100_000_000, exact=True)),
    "taxRateOverride": nullable(dict(TAX_RATE, description="null: the company's rate.")),
    "status": enum_schema(CUSTOMER_STATUSES),
}
_WEBHOOK_INPUT = {
    "url": URL_INPUT_SCHEMA,
    "events": {"type": "array", "items": EVENT_NAMES, "minItems": 1,
               "description": "Replaces the whole list; duplicates are dropped."},
    "isActive": dict(BOOLEAN, default=True),
}


def _webhook(with_secret):
    fields = {
        "id": ID_SCHEMA,
        "url": URL_SCHEMA,
        "events": {"type": "array", "items": EVENT_NAMES, "minItems": 1, "uniqueItems": True},
        "isActive": BOOLEAN,
        "secretRotationGraceExpiresAt": nullable(TIMESTAMP_SCHEMA),
        "createdAt": TIMESTAMP_SCHEMA,
        "updatedAt": TIMESTAMP_SCHEMA,
    }
    if with_secret:
        fields["secret"] = string_schema(pattern=r"^whsec_[A-Za-z0-9_-]{32}$", description=(
            "Signs the deliveries. Returned by this response only."))
    return object_schema(fields)


COMPONENT_SCHEMAS = {
    "Product": object_schema({
        "id": ID_SCHEMA,
        "name": string_schema(1),
        "sku": nullable(string_schema()),
        "description": nullable(string_schema()),
        "category": nullable(string_schema()),
        "unit": string_schema(1, description="Free text such as each, case, lb, kg."),
        "price": money_schema(10_000_000_000),
        "stock": integer_schema(0, MAX_QUANTITY),
        "imageUrl": nullable(URL_SCHEMA),
        "isActive": BOOLEAN,
        "createdAt": TIMESTAMP_SCHEMA,
        "updatedAt": TIMESTAMP_SCHEMA,
    }),
    "OrderItem": object_schema({
        "id": ID_SCHEMA,
        "quantity": integer_schema(1, MAX_QUANTITY),
        "unitPrice": money_schema(),
        "productId": ID_SCHEMA,
        "productName": string_schema(),
        "productSku": nullable(string_schema()),
    }),
    "Tracking": object_schema({
        "carrier": enum_schema(CARRIERS),
        "number": string_schema(3, 64),
        "url": nullable(string_schema()),
    }),
    "Order": object_schema(_ORDER_FIELDS),
    "Customer": object_schema({
        "id": ID_SCHEMA,
        "email": string_schema(3, 254),
        "name": nullable(string_schema(1, 200)),
        "status": enum_schema(CUSTOMER_STATUS_VALUES),
        "notes": nullable(string_schema(0, 2000)),
        "creditLimit": nullable(money_schema(100_000_000)),
        "taxRateOverride": nullable(TAX_RATE),
        "emailVerified": BOOLEAN,
        "createdAt": TIMESTAMP_SCHEMA,
        "updatedAt": TIMESTAMP_SCHEMA,
    }),
    "Webhook": _webhook(with_secret=False),
    "WebhookWithSecret": _webhook(with_secret=True),
    "WebhookDeleted": object_schema({"id": ID_SCHEMA, "deleted": {"const": True}}),
    "Pagination": object_schema({"hasMore": BOOLEAN, "nextCursor": nullable(ID_SCHEMA)}),
    "Error": object_schema({
        "error": string_schema(description="The message (clients branch on status and text)."),
        "details": {"type": "array", "minItems": 1,
                    "items": object_schema({"field": string_schema(), "rule": string_schema()})},
        "retryAfter": integer_schema(1),
    }, optional=("details", "retryAfter")),
    # Request bodies. A body that is not a JSON object is 400; unknown fields are ignored.
    "OrderCreate": object_schema({
        "customerId": ID_SCHEMA,
        "items": {"type": "array", "minItems": 1, "maxItems": MAX_ORDER_LINES,
                  "description": "Lines of one product are checked together against its stock.",
                  "items": object_schema({"productId": ID_SCHEMA,
                                          "quantity": integer_schema(1, MAX_QUANTITY)},
                                         closed=False)},
        "poNumber": nullable(string_schema(max_length=MAX_PO_NUMBER)),
        "notes": nullable(string_schema(max_length=MAX_ORDER_NOTES)),
    }, optional=("poNumber", "notes"), closed=False),
    "TrackingInput": object_schema({
        "carrier": enum_schema(CARRIERS),
        "number": string_schema(3, 64, pattern=r"\S[\s\S]+\S",
                                description="Stripped; 3 to 64 characters without the "
                                            "surrounding whitespace."),
        "url": nullable(dict(URL_INPUT_SCHEMA, description=(
            "Required for OTHER. For the named carriers the service builds the link from the "
            "number; a URL given here overrides it."))),
    }, optional=("url",), closed=False, **{
        "if": {"properties": {"carrier": {"const": "OTHER"}}},
        "then": {"required": ["url"], "properties": {"url": {"type": "string"}}}}),
    "OrderUpdate": object_schema({
        "status": enum_schema(ORDER_STATUSES),
        "tracking": nullable(dict(schema_ref("TrackingInput"), description=(
            "Only with status SHIPPED. Once set, tracking stays through later changes."))),
    }, optional=("tracking",), closed=False, **{
        "if": {"required": ["tracking"], "properties": {"tracking": {"type": "object"}}},
        "then": {"properties": {"status": {"const": "SHIPPED"}}}}),
    "CustomerCreate": object_schema({
        "email": string_schema(3, 254, format="email", description=(
            "Trimmed; unique within the company, ignoring case (409).")),
        **_CUSTOMER_INPUT,
    }, optional=tuple(_CUSTOMER_INPUT), closed=False),
    "CustomerUpdate": object_schema(
        {**_CUSTOMER_INPUT, "email": False}, optional=(*_CUSTOMER_INPUT, "email"), closed=False,
        description="Only what changes; null clears name, notes, creditLimit and "
                    "taxRateOverride. Sending email is 400: it cannot be changed."),
    "WebhookCreate": object_schema(_WEBHOOK_INPUT, optional=("isActive",), closed=False),
    "WebhookUpdate": object_schema(_WEBHOOK_INPUT, optional=tuple(_WEBHOOK_INPUT),
                                   closed=False),
}


# Event payloads: the `data` of each event, exactly as emit() is given it.

def _order_summary(**more):
    return object_schema({"id": ID_SCHEMA, "previousStatus": enum_schema(ORDER_STATUSES),
                          "total": money_schema(), "customerId": nullable(ID_SCHEMA), **more})


_PRODUCT_NAMES = {"id": ID_SCHEMA, "sku": nullable(string_schema()), "name": string_schema()}
_CUSTOMER_NAMES = {"id": ID_SCHEMA, "email": string_schema(), "name": nullable(string_schema())}
_RETURN_NAMES = {"id": ID_SCHEMA, "orderId": ID_SCHEMA, "customerId": nullable(ID_SCHEMA)}

EVENT_PAYLOADS = {
    "order.created": {"oneOf": [
        object_schema({k: v for k, v in _ORDER_FIELDS.items() if k != "tracking"},
                      description="Through the API: the Order, without tracking."),
        object_schema({"id": ID_SCHEMA, "status": {"const": "SUBMITTED"},
                       "total": money_schema(), "customerId": ID_SCHEMA,
                       "poNumber": nullable(string_schema()), "itemCount": integer_schema(1)},
                      description="On the storefront: the number of lines, no items."),
    ]},
    "order.status_changed": object_schema(
        {**_ORDER_FIELDS, "previousStatus": enum_schema(ORDER_STATUSES)}),
    "order.shipped": _order_summary(tracking=nullable(schema_ref("Tracking"))),
    "order.cancelled": _order_summary(),
    "customer.created": {"oneOf": [
        object_schema({**_CUSTOMER_NAMES, "status": enum_schema(CUSTOMER_STATUS_VALUES),
                       "source": {"const": "api"}}),
        object_schema({**_CUSTOMER_NAMES, "storeSlug": string_schema(1),
                       "source": {"const": "storefront"}}),
    ]},
    "customer.updated": object_schema({
        **_CUSTOMER_NAMES, "status": enum_schema(CUSTOMER_STATUS_VALUES),
        "previousStatus": enum_schema(CUSTOMER_STATUS_VALUES),
    }, optional=("previousStatus",), description="previousStatus: when the status changed."),
    "product.updated": {"oneOf": [
        object_schema({**_PRODUCT_NAMES, "price": money_schema(), "stock": integer_schema(0),
                       "isActive": BOOLEAN, "category": nullable(string_schema())}),
        object_schema({**_PRODUCT_NAMES, "isActive": BOOLEAN},
                      description="When only the active flag changed."),
    ]},
    "product.low_stock": object_schema({
        **_PRODUCT_NAMES, "currentStock": integer_schema(), "threshold": integer_schema(0),
        "triggeringOrderId": nullable(ID_SCHEMA)}),
    "invoice.paid": object_schema({
        "stripeInvoiceId": string_schema(1), "amountPaid": money_schema(),
        "currency": string_schema(pattern="^[a-z]{3}$"), "hostedInvoiceUrl": URL_SCHEMA,
        "number": string_schema(1), "periodStart": TIMESTAMP_SCHEMA,
        "periodEnd": TIMESTAMP_SCHEMA}),
    "return.created": object_schema({
        **_RETURN_NAMES, "itemCount": integer_schema(1), "reason": string_schema(3, 2000),
        "status": {"const": "REQUESTED"}, "actor": {"const": "staff"},
    }, optional=("actor",), description="actor: only when opened from the dashboard."),
    "return.approved": object_schema({**_RETURN_NAMES, "status": {"const": "APPROVED"}}),
    "refund.processed": object_schema({
        "id": ID_SCHEMA, "returnId": ID_SCHEMA, "orderId": ID_SCHEMA,
        "customerId": nullable(ID_SCHEMA), "amount": money_schema(),
        "method": enum_schema(("CREDIT", "MANUAL")),
        "breakdown": object_schema({"goodUnits": integer_schema(0),
                                    "damagedUnits": integer_schema(0),
                                    "subtotal": money_schema()})}),
}


def event_schema_name(event):
    """order.status_changed: OrderStatusChangedPayload."""
    return "".join(word.capitalize() for word in re.split(r"[._]", event)) + "Payload"


# Operations

def single(schema):
    """{data: record}"""
    return object_schema({"data": schema_ref(schema)})


def list_of(schema):
    """The pagination envelope: {data: [record...], pagination: {hasMore, nextCursor}}."""
    return object_schema({"data": {"type": "array", "items": schema_ref(schema)},
                          "pagination": schema_ref("Pagination")})


def all_of(schema):
    """{data: [record...]}, not paginated."""
    return object_schema({"data": {"type": "array", "items": schema_ref(schema)}})


def query_param(name, schema, description):
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


def api_operation(response, errors, body=None, query=(), description="", messages=None):
    """What OPERATIONS says of a route: its query parameters, request body (a schema name),
    success body, error statuses, and the messages of some of them."""
    return {"query": list(query), "body": body, "response": response,
            "errors": tuple(sorted(set(errors))), "description": description,
            "messages": messages or {}}


AUTH_ERRORS = (401, 403, 429)
BODY_ERRORS = (400, 413)
PAGE_QUERY = (
    query_param("limit", dict(integer_schema(1, 100), default=50),
                "Page size. Read like JavaScript's parseInt: clamped to 1 to 100, 50 when it "
                "is not a number."),
    query_param("cursor", string_schema(),
                "nextCursor of the previous page; one that matches no record gives an empty "
                "last page."),
)
DATE_QUERY = string_schema(pattern=r"^\s*(?!0000)\d{4}(-\d{2}(-\d{2})?)?"
                                   r"([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?\s*$")
_VALIDATION = "Invalid JSON body. / Validation failed."

OPERATIONS = {
    ("GET", "/api/v1/products"): api_operation(
        list_of("Product"), AUTH_ERRORS, description="Newest first.", query=(
            *PAGE_QUERY,
            query_param("category", string_schema(), "Exact match on category."),
            query_param("search", string_schema(),
                        "Substring of name, sku or category, ignoring case (Unicode folding)."),
            query_param("active", enum_schema(("true", "false")),
                        "Filter on isActive; another value is ignored."))),
    ("GET", "/api/v1/products/<product_id>"): api_operation(
        single("Product"), AUTH_ERRORS + (404,), messages={404: "Product not found."}),
    ("GET", "/api/v1/orders"): api_operation(
        list_of("Order"), AUTH_ERRORS + (400,), query=(
            *PAGE_QUERY,
            query_param("status", enum_schema(ORDER_STATUSES), "Exact match."),
            query_param("customerId", string_schema(), "Orders of this customer only."),
            query_param("since", DATE_QUERY,
                        "createdAt >= since (inclusive): a date (UTC midnight), a year and "
                        "month, or an ISO 8601 date-time (UTC when it has no offset)."),
            query_param("until", DATE_QUERY, "createdAt <= until (inclusive), read as since.")),
        description="Newest first, each element the full Order (items and tracking included).",
        messages={400: "Invalid order status. / Validation failed. (since, until)"}),
    ("GET", "/api/v1/orders/<order_id>"): api_operation(
        single("Order"), AUTH_ERRORS + (404,), messages={404: "Order not found."}),
    ("POST", "/api/v1/orders"): api_operation(
        single("Order"), AUTH_ERRORS + BODY_ERRORS + (404, 409), body="OrderCreate",
        description="Checks the customer, then the products (active, of the company) and their "
                    "stock, and in the same transaction decrements the stock and stores the "
                    "order, SUBMITTED, at the catalog prices. Emits order.created.",
        messages={400: f"{_VALIDATION} / customerId is required / At least one item is "
                       "required / productId is required / quantity must be a number / "
                       "quantity must be a whole number / quantity must be at least 1 / "
                       "Product \"{id}\" not found or is inactive. / Insufficient stock for "
                       "product \"{name}\". Available: {N}, requested: {M}.",
                  404: "Customer not found."}),
    ("PATCH", "/api/v1/orders/<order_id>"): api_operation(
        single("Order"), AUTH_ERRORS + BODY_ERRORS + (404, 422), body="OrderUpdate",
        description="Any status may follow any other, except after CANCELLED. Emits "
                    "order.status_changed, and order.shipped or order.cancelled.",
        messages={400: f"{_VALIDATION} / Invalid order status. / Tracking info is only valid "
                       "when status is SHIPPED. / Tracking URL is required when carrier is "
                       "OTHER.",
                  404: "Order not found.", 422: "Cannot update a cancelled order."}),
    ("GET", "/api/v1/customers"): api_operation(
        list_of("Customer"), AUTH_ERRORS + (400,), description="Newest first.", query=(
            *PAGE_QUERY,
            query_param("status", enum_schema(CUSTOMER_STATUS_VALUES), "Exact match."),
            query_param("search", string_schema(),
                        "Substring of email or name, ignoring case (Unicode folding).")),
        messages={400: "Invalid status."}),
    ("GET", "/api/v1/customers/<customer_id>"): api_operation(
        single("Customer"), AUTH_ERRORS + (404,), messages={404: "Customer not found."}),
    ("POST", "/api/v1/customers"): api_operation(
        single("Customer"), AUTH_ERRORS + BODY_ERRORS + (409,), body="CustomerCreate",
        description="emailVerified is false. Emits customer.created (source api).",
        messages={400: f"{_VALIDATION} / Email is required. / Invalid email address. / "
                       f"{CREDIT_LIMIT_MESSAGE} / {TAX_RATE_MESSAGE} / Invalid status.",
                  409: "A customer with this email already exists."}),
    ("PATCH", "/api/v1/customers/<customer_id>"): api_operation(
        single("Customer"), AUTH_ERRORS + BODY_ERRORS + (404,), body="CustomerUpdate",
        description="Emits customer.updated when something changed.",
        messages={400: f"{_VALIDATION} / {CREDIT_LIMIT_MESSAGE} / {TAX_RATE_MESSAGE} / "
                       "Invalid status.",
                  404: "Customer not found."}),
    ("GET", "/api/v1/webhooks"): api_operation(
        all_of("Webhook"), AUTH_ERRORS,
        description=f"Not paginated (at most {MAX_WEBHOOKS}). Never includes the secret."),
    ("GET", "/api/v1/webhooks/<webhook_id>"): api_operation(
        single("Webhook"), AUTH_ERRORS + (404,), messages={404: "Webhook not found."}),
    ("POST", "/api/v1/webhooks"): api_operation(
        single("WebhookWithSecret"), AUTH_ERRORS + BODY_ERRORS + (409,), body="WebhookCreate",
        description="The only response that carries the secret.",
        messages={400: f"{_VALIDATION} / URL is required. / Invalid URL. / At least one event "
                       "is required. / Unknown event: \"{name}\".",
                  409: f"Maximum of {MAX_WEBHOOKS} webhooks per company."}),
    ("PATCH", "/api/v1/webhooks/<webhook_id>"): api_operation(
        single("Webhook"), AUTH_ERRORS + BODY_ERRORS + (404,), body="WebhookUpdate",
        messages={400: f"{_VALIDATION} / Invalid URL. / At least one event is required. / "
                       "Unknown event: \"{name}\".",
                  404: "Webhook not found."}),
    ("DELETE", "/api/v1/webhooks/<webhook_id>"): api_operation(
        single("WebhookDeleted"), AUTH_ERRORS + (404,),
        description="Also removes its delivery log and pending deliveries; no undo.",
        messages={404: "Webhook not found."}),
}

# Responses, headers and parameters every operation shares

ERROR_RESPONSES = {
    400: ("BadRequest", "Malformed JSON, failed validation (Validation failed. with details), "
                        "or a bad Content-Length or Idempotency-Key header."),
    401: ("Unauthorized", "Missing or invalid Authorization header. Use: Bearer <api_key> / "
                          "Invalid, expired, or revoked API key."),
    403: ("Forbidden", "Insufficient permissions. This key lacks the \"<scope>\" scope."),
    404: ("NotFound", "Not found: also a record of another company, a malformed ID, or an "
                      "unknown path (Not found.)."),
    405: ("MethodNotAllowed", "Method not allowed. (a known path, another method)"),
    409: ("Conflict", "Conflict."),
    413: ("ContentTooLarge", "Request body too large. (over 1 MiB, refused before reading)"),
    422: ("UnprocessableContent", "Refused by a business rule."),
    429: ("TooManyRequests", "Rate limit exceeded. Try again shortly. Per key, or per client "
                             "address before authentication; retryAfter is the Retry-After."),
}
_POST_MESSAGES = {
    400: "Idempotency-Key must be 1 to 255 printable ASCII characters.",
    409: "Idempotency-Key has already been used with a different request. / A request with "
         "this Idempotency-Key is still in progress.",
}


def _header(description, schema, required=False):
    return {"description": description, "required": required, "schema": schema}


def rate_limit_headers(required):
    """On every response to an authenticated request: not on 401, nor on a 429 of the
    per-address limit, which come before the key is known."""
    return {
        "X-RateLimit-Limit": _header("Requests per minute for this key.", integer_schema(1),
                                     required),
        "X-RateLimit-Remaining": _header("Requests left in this one-minute window.",
                                         integer_schema(0), required),
        "X-RateLimit-Reset": _header("Whole seconds until the window resets.",
                                     integer_schema(1, 60), required),
    }


def _json_content(schema):
    return {"application/json": {"schema": schema}}


def _error_response(status):
    headers = rate_limit_headers(required=False)
    if status == 429:
        headers["Retry-After"] = _header("Whole seconds until the window resets.",
                                         integer_schema(1), required=True)
    return {"description": ERROR_RESPONSES[status][1], "headers": headers,
            "content": _json_content(schema_ref("Error"))}


_BOTTLE_WILDCARD = re.compile(r"<(\w+)(?::[^>]*)?>")


def _operation_object(found, described):
    path_parameters = [{"name": name, "in": "path", "required": True, "schema": ID_SCHEMA,
                        "description": "An ID as the API returned it."}
                       for name in _BOTTLE_WILDCARD.findall(found.path)]
    headers = rate_limit_headers(required=True)
    if found.method == "POST":
        path_parameters.append({"$ref": "#/components/parameters/IdempotencyKey"})
        headers["Idempotent-Replayed"] = _header(
            "true on the stored response to an earlier request with the same Idempotency-Key "
            "(errors other than 5xx are replayed too).", enum_schema(("true",)))
    responses = {str(found.status): {"description": found.summary or "Success",
                                     "headers": headers,
                                     "content": _json_content(described["response"])}}
    for status in described["errors"]:
        response = {"$ref": "#/components/responses/" + ERROR_RESPONSES[status][0]}
        messages = [text for text in (described["messages"].get(status),
                                      found.method == "POST" and _POST_MESSAGES.get(status))
                    if text]
        if messages:
            response["description"] = " / ".join(messages)
        responses[str(status)] = response
    operation = {
        "operationId": found.handler.__name__,
        "summary": found.summary,
        "description": " ".join(filter(None, (f"Requires the `{found.scope}` scope.",
                                              described["description"]))),
        "tags": [found.path.split("/")[3]],
        "security": [{"bearer": []}],
        "x-required-scope": found.scope,
        "parameters": [*path_parameters, *described["query"]],
        "responses": responses,
    }
    if described["body"]:
        operation["requestBody"] = {"required": True,
                                    "content": _json_content(schema_ref(described["body"]))}
    return _BOTTLE_WILDCARD.sub(r"{\1}", found.path), operation


def _event_delivery(event):
    """The POST a subscriber receives for one event (an entry of the top-level webhooks)."""
    def header(name, description, schema, required=True):
        return {"name": name, "in": "header", "required": required, "schema": schema,
                "description": description}
    signature = string_schema(pattern="^sha256=[0-9a-f]{64}$")
    return {"post": {
        "operationId": "event_" + event.replace(".", "_"),
        "summary": event,
        "description": "One POST per delivery and a single attempt, 10 seconds for the whole "
                       "exchange: a 2xx answer is a success, anything else (a redirect too) a "
                       "failure, and it is not retried. A delivery may be repeated: "
                       "deduplicate on X-Webhook-Id.",
        "tags": ["events"],
        "security": [],
        "parameters": [
            header("X-Webhook-Event", "The event name.", {"const": event}),
            header("X-Webhook-Id", "The event's ID, the same on every delivery of it.",
                   ID_SCHEMA),
            header("X-Webhook-Signature", "sha256= and the lowercase hex HMAC-SHA256 of the "
                   "raw body, keyed with the whole secret (whsec_ included) as UTF-8.",
                   signature),
            header("X-Webhook-Signature-Old", "The same with the previous secret, while a "
                   "secret rotation grace window is open.", signature, required=False),
            header("User-Agent", "ordering-webhooks/<version>",
                   string_schema(pattern="^ordering-webhooks/")),
        ],
        "requestBody": {"required": True, "content": _json_content(object_schema({
            "event": {"const": event},
            "timestamp": TIMESTAMP_SCHEMA,
            "data": schema_ref(event_schema_name(event)),
        }))},
        "responses": {"2XX": {"description": "Delivered."},
                      "default": {"description": "Failed; not retried."}},
    }}


_UNAUTHENTICATED = {
    "/api/v1/openapi.json": {"get": {
        "operationId": "openapi_document",
        "summary": "This document",
        "tags": ["meta"],
        "security": [],
        "responses": {"200": {"description": "The OpenAPI 3.1 document.", "content": (
            _json_content(object_schema({"openapi": {"const": OPENAPI_VERSION}},
                                        closed=False)))}},
    }},
    "/healthz": {"get": {
        "operationId": "health",
        "summary": "Health check for load balancers and supervisors",
        "tags": ["meta"],
        "security": [],
        "responses": {
            "200": {"description": "The database answers.",
                    "content": _json_content(object_schema({"status": {"const": "ok"}}))},
            "503": {"description": "The database does not answer.", "content": _json_content(
                object_schema({"status": {"const": "unavailable"}}))},
        },
    }},
}

API_DESCRIPTION = """\
A multi-tenant wholesale ordering service: products (read only), orders, customers and \
webhook subscriptions; the events it delivers are under `webhooks`.

Every operation but the two under `meta` needs `Authorization: Bearer <API key>`. The key \
belongs to one company, which every read and write is limited to (another company's records \
are 404), and must hold the operation's scope (`x-required-scope`).

Errors are JSON `{"error": message}`; failed validation adds `details` ([{field, rule}]) and \
429 adds `retryAfter`. They are checked in this order: per-address rate limit, \
authentication (401), per-key rate limit (429), scope (403), body validation (400), \
existence (404), business rules (409, 422). Any unknown path is 404 \
`{"error": "Not found."}` and a known path with another method 405 \
`{"error": "Method not allowed."}`. A server failure is 500 with the plain text \
`Internal Server Error`.

Money is a JSON number of currency units with at most two decimal places. Timestamps are \
ISO 8601 UTC with milliseconds. IDs are opaque."""


def openapi_document():
    """The OpenAPI 3.1 document of the API (GET /api/v1/openapi.json)."""
    routes = {(found.method, found.path) for found in ROUTES}
    undescribed = ", ".join(f"{method} {path}" for method, path in sorted(routes - set(OPERATIONS)))
    if undescribed:
        raise KeyError(f"no entry in OPERATIONS for the route {undescribed}: describe it there "
                       f"so that the OpenAPI document covers it")
    stale = ", ".join(f"{method} {path}" for method, path in sorted(set(OPERATIONS) - routes))
    if stale:
        raise KeyError(f"OPERATIONS describes {stale}, which is not in ROUTES")
    paths = {}
    for found in ROUTES:
        path, operation = _operation_object(found, OPERATIONS[found.method, found.path])
        paths.setdefault(path, {})[found.method.lower()] = operation
    paths.update(_UNAUTHENTICATED)
    schemas = dict(COMPONENT_SCHEMAS)
    schemas.update((event_schema_name(event), EVENT_PAYLOADS[event]) for event in EVENT_CATALOG)
    return json.loads(json.dumps({     # a deep copy: callers may change it freely
        "openapi": OPENAPI_VERSION,
        "info": {"title": "ordering", "version": __version__, "description": API_DESCRIPTION},
        "servers": [{"url": "/"}],
        "tags": [{"name": "products"}, {"name": "orders"}, {"name": "customers"},
                 {"name": "webhooks"}, {"name": "meta"},
                 {"name": "events", "description": "Deliveries to webhook subscribers."}],
        "paths": paths,
        "webhooks": {event: _event_delivery(event) for event in EVENT_CATALOG},
        "components": {
            "schemas": schemas,
            "responses": {name: _error_response(status)
                          for status, (name, _) in ERROR_RESPONSES.items()},
            "parameters": {"IdempotencyKey": {
                "name": "Idempotency-Key", "in": "header", "required": False,
                "description": "Makes a POST safe to retry. 1 to 255 printable ASCII "
                               "characters, bare or in double quotes. Within 24 hours a retry "
                               "with the same key and request gets the stored response "
                               "(Idempotent-Replayed: true) and nothing is done again; the "
                               "same key with another request is 409.",
                "schema": string_schema(1, 255, pattern=r"^[!-~]([ -~]*[!-~])?$")}},
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "An API key (sk_...). The scope each operation needs is in its "
                               f"x-required-scope: one of {', '.join(SCOPES)}."}},
        },
    }))


class Service:
    """The running pieces behind one app: the database, the webhook sender, the rate-limit
    counters, the key cache and the idempotency keys in progress."""

    def __init__(self, settings, deliver=True):
        self.settings = settings
        self.db = Database(settings.db_path, settings)
        self.sender = Sender(self.db, settings)
        self.db.on_commit(self.sender.notify)
        self.key_windows = WindowCounter()
        self.ip_windows = WindowCounter()
        # The rate-limit windows read time from here, so a test can hold it still.
        self.clock = time.time
        self.key_cache = {}
        self.idempotency_lock = threading.Lock()
        self.idempotency_running = set()
        if deliver:
            self.sender.start()

    def close(self, grace=None):
        self.sender.stop(grace)

    def health(self):
        """GET /healthz, for load balancers and supervisors: 200 while the database answers."""
        bottle.response.content_type = "application/json"
        try:
            self.db.conn.execute("SELECT COUNT(*) FROM companies LIMIT 1").fetchone()
        except sqlite3.Error as error:
            log.error("health check failed: %s", error)
            bottle.response.status = 503
            return json_text({"status": "unavailable"})
        return json_text({"status": "ok"})

    # Who is calling

    def client_address(self, environ):
        if self.settings.trust_proxy and environ.get("HTTP_X_FORWARDED_FOR"):
            return environ["HTTP_X_FORWARDED_FOR"].split(",")[-1].strip()
        return environ.get("REMOTE_ADDR", "")

    def check_ip_rate(self, environ):
        limit = self.settings.ip_rate_limit
        if limit <= 0:
            return
        allowed, _, reset = self.ip_windows.hit(self.client_address(environ), limit,
                                                self.clock())
        if not allowed:
            raise rate_limited(reset, {})

    def authenticate(self, environ):
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, MISSING_AUTH)
        digest = hash_key(token)
        cached = self.key_cache.get(digest)
        if cached is None or cached[0] < time.monotonic():
            row = self.db.conn.execute(
                "SELECT id, company_id, key_hash, scopes, rate_limit, expires_at, revoked "
                "FROM api_keys WHERE key_hash = ?", (digest,)).fetchone()
            if row is None or not hmac.compare_digest(row["key_hash"], digest):
                raise ApiError(401, INVALID_KEY)
            key = Key(row["id"], row["company_id"], frozenset(row["scopes"].split()),
                      row["rate_limit"], row["expires_at"], bool(row["revoked"]))
            if len(self.key_cache) > 10_000:
                self.key_cache.clear()
            self.key_cache[digest] = (time.monotonic() + self.settings.key_cache_seconds, key)
        else:
            key = cached[1]
        if key.revoked or (key.expires_at and key.expires_at <= now_iso()):
            raise ApiError(401, INVALID_KEY)
        return key

    def revoke_key(self, key_id):
        """Revoke a key; through this process the revocation takes effect at once."""
        with self.db.write() as conn:
            result = revoke_api_key(conn, key_id)
        self.key_cache.clear()
        return result

    def check_key_rate(self, key):
        allowed, remaining, reset = self.key_windows.hit(key.id, key.rate_limit, self.clock())
        headers = {"X-RateLimit-Limit": str(key.rate_limit),
                   "X-RateLimit-Remaining": str(remaining),
                   "X-RateLimit-Reset": str(max(1, math.ceil(reset)))}
        if not allowed:
            raise rate_limited(reset, headers)
        return headers

    # Answering

    def respond(self, found, url_args):
        """Run one API call; returns (status, body bytes, headers)."""
        environ = bottle.request.environ
        headers = {}
        try:
            self.check_ip_rate(environ)
            key = self.authenticate(environ)
            headers.update(self.check_key_rate(key))
            if found.scope not in key.scopes:
                raise ApiError(403, f'Insufficient permissions. This key lacks the '
                                    f'"{found.scope}" scope.')
            text = environ.get("QUERY_STRING")
            # The first value of a repeated parameter wins, as URLSearchParams.get() has it.
            query = dict(urllib.parse.parse_qsl(text, keep_blank_values=True)[::-1]) if text else {}
            if found.method == "GET":
                call = Call(self.db.conn, key.company_id, query, None, self.settings)
                return found.status, json_text(found.handler(call, **url_args)).encode(), headers
            raw = self.read_body(environ) if found.method != "DELETE" else b"{}"
            idempotency_key = None
            if found.method == "POST":
                idempotency_key = parse_idempotency_key(environ.get("HTTP_IDEMPOTENCY_KEY"))
            if idempotency_key is None:
                call = Call(None, key.company_id, query, parse_json_body(raw), self.settings)
                with self.db.write() as conn:
                    call.conn = conn
                    result = found.handler(call, **url_args)
                return found.status, json_text(result).encode(), headers
            status, body, replayed = self.respond_once(
                found, url_args, key.company_id, idempotency_key, query, raw, environ)
            if replayed:
                headers["Idempotent-Replayed"] = "true"
            return status, body, headers
        except ApiError as error:
            headers.update(error.headers)
            return error.status, json_text(error.body()).encode(), headers

    def read_body(self, environ):
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            raise ApiError(400, "Invalid Content-Length header.") from None
        if length > self.settings.max_body_bytes:
            raise ApiError(413, "Request body too large.")
        return environ["wsgi.input"].read(length) if length > 0 else b""

    def respond_once(self, found, url_args, company_id, idempotency_key, query, raw, environ):
        """A POST with an Idempotency-Key: done once, its response stored in the same
        transaction as its changes and replayed to any retry of the same request."""
        fingerprint = request_fingerprint(found.method, environ.get("PATH_INFO", ""), raw)
        slot = (company_id, idempotency_key)
        with self.idempotency_lock:
            if slot in self.idempotency_running:
                raise ApiError(409, "A request with this Idempotency-Key is still in progress.")
            self.idempotency_running.add(slot)
        try:
            with self.db.write() as conn:
                stored = conn.execute(
                    "SELECT fingerprint, status, body FROM idempotency_keys "
                    "WHERE company_id = ? AND key = ? AND expires_at > ?",
                    (company_id, idempotency_key, now_iso())).fetchone()
                if stored is not None:
                    if stored["fingerprint"] != fingerprint:
                        raise ApiError(409, "Idempotency-Key has already been used with a "
                                            "different request.")
                    return stored["status"], bytes(stored["body"]), True
                conn.execute("SAVEPOINT operation")
                try:
                    call = Call(conn, company_id, query, parse_json_body(raw), self.settings)
                    status = found.status
                    body = json_text(found.handler(call, **url_args)).encode()
                    conn.execute("RELEASE operation")
                except ApiError as refusal:
                    conn.execute("ROLLBACK TO operation")
                    conn.execute("RELEASE operation")
                    status, body = refusal.status, json_text(refusal.body()).encode()
                expires = iso(int((time.time() + self.settings.idempotency_ttl) * 1000))
                conn.execute(
                    "INSERT OR REPLACE INTO idempotency_keys (company_id, key, fingerprint, "
                    "status, body, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (company_id, idempotency_key, fingerprint, status, body, expires))
                return status, body, False
        finally:
            with self.idempotency_lock:
                self.idempotency_running.discard(slot)


def parse_idempotency_key(header):
    """None when absent; the key, bare or in the quoted form of the IETF draft."""
    if header is None:
        return None
    value = header.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not 1 <= len(value) <= 255 or not all(32 <= ord(ch) < 127 for ch in value):
        raise ApiError(400, "Idempotency-Key must be 1 to 255 printable ASCII characters.")
    return value


def request_fingerprint(method, path, raw):
    try:
        canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except (UnicodeDecodeError, ValueError, RecursionError):
        canonical = raw
    return hashlib.sha256(method.encode() + b" " + path.encode() + b"\n" + canonical).hexdigest()


def _error_page(status, message):
    def page(error):
        bottle.response.content_type = "application/json"
        return json_text({"error": message})
    return page


def _internal_error_page(error):
    bottle.response.content_type = "text/plain; charset=utf-8"
    return "Internal Server Error"


def create_app(db_path=None, settings=None, deliver=True, **overrides):
    """The WSGI app. db_path or settings pick the database; deliver=False leaves webhook
    delivery to another process. app.service holds the database, sender and limits."""
    if settings is None:
        settings = Settings.from_environment(db_path=db_path, **overrides)
    elif db_path is not None:
        settings = dataclasses.replace(settings, db_path=db_path)
    service = Service(settings, deliver=deliver)
    app = bottle.Bottle()
    app.uninstall(True)  # routes return bytes: bottle's JSON and template plugins only cost time
    app.service = service

    def bind(found):
        def callback(**url_args):
            try:
                status, body, headers = service.respond(found, url_args)
                bottle.response.content_type = "application/json"
            except Exception:
                log.exception("%s %s failed", found.method, found.path)
                status, body, headers = 500, b"Internal Server Error", {}
                bottle.response.content_type = "text/plain; charset=utf-8"
            bottle.response.status = status
            for name, value in headers.items():
                bottle.response.set_header(name, value)
            return body
        return callback

    for found in ROUTES:
        app.route(found.path, found.method, bind(found))
    app.route("/healthz", "GET", service.health)
    document = json_text(openapi_document()).encode()

    def serve_openapi():
        bottle.response.content_type = "application/json"
        return document
    app.route("/api/v1/openapi.json", "GET", serve_openapi)
    app.error_handler.update({
        404: _error_page(404, "Not found."),
        405: _error_page(405, "Method not allowed."),
        500: _internal_error_page,
    })
    return app


# ---------------------------------------------------------------------------------------------
# 10. Command line
# ---------------------------------------------------------------------------------------------

class AccessLog:
    """One line per request on stderr. Lines are queued and written in batches by a thread of
    their own, so a request never waits on the terminal or a full pipe, and pays no logging
    framework overhead."""

    def __init__(self, app, stream=None):
        self.app = app
        self.stream = stream or sys.stderr
        self.lines = collections.deque()
        self.wake = threading.Event()
        self.writer = threading.Thread(target=self._write, name="ordering-access-log",
                                       daemon=True)
        self.writer.start()

    def __call__(self, environ, start_response):
        started = time.time()
        status = ["-"]

        def start(line, headers, exc_info=None):
            status[0] = line[:3]
            return start_response(line, headers, exc_info)
        try:
            return self.app(environ, start)
        finally:
            self.lines.append((started, environ.get("REMOTE_ADDR", "-"),
                               environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"),
                               status[0], (time.time() - started) * 1000))

    def _write(self):
        while not self.wake.wait(0.2):
            self.flush()
        self.flush()

    def flush(self):
        batch = []
        while self.lines:
            at, address, method, path, status, ms = self.lines.popleft()
            batch.append(f'{iso(int(at * 1000))} {address} "{method} {path}" {status} '
                         f'{ms:.1f}ms\n')
        if batch:
            self.stream.write("".join(batch))
            self.stream.flush()

    def close(self):
        self.wake.set()
        self.writer.join(5)


def serve(settings):
    import waitress
    app = create_app(settings=settings)
    access_log = AccessLog(app)
    # waitress buffers a body before the app sees it: bound that, well above the app's own
    # limit, which answers with the JSON 413.
    server = waitress.create_server(access_log, host=settings.host, port=settings.port,
                                    threads=settings.threads, ident="ordering",
                                    max_request_body_size=8 * settings.max_body_bytes)

    def stop(signum, frame):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("ordering %s serving %s on http://%s:%s", __version__, settings.db_path,
             settings.host, server.effective_port)
    try:
        server.run()
    finally:
        server.close()
        log.info("stopping: waiting up to %gs for webhook deliveries in flight",
                 settings.webhook_timeout)
        app.service.close()
        access_log.close()
        log.info("stopped")


def _active_flag(text):
    if text not in ("true", "false"):
        raise argparse.ArgumentTypeError("must be true or false")
    return text == "true"


def _amount(text):
    cents = cents_from_text(text)
    if cents is None:
        raise argparse.ArgumentTypeError("must be an amount such as 12.50")
    # Bounded here so that no amount reaches SQLite beyond its 64-bit integers.
    if cents > MAX_AMOUNT_CENTS:
        raise argparse.ArgumentTypeError(f"must be an amount from 0 to {money(MAX_AMOUNT_CENTS)}")
    return cents


def _moment(text):
    ms = js_parse_date(text)
    if ms is None:
        raise argparse.ArgumentTypeError("must be an ISO 8601 date or datetime")
    return iso(ms)


def _non_negative(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    if value > MAX_QUANTITY:
        raise argparse.ArgumentTypeError(f"must be {MAX_QUANTITY} or less")
    return value


def _non_empty(text):
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _positive(text):
    value = _non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


_PRODUCT_OPTIONS = (("name", "name", str), ("price", "price_cents", _amount),
                    ("stock", "stock", _non_negative), ("category", "category", str),
                    ("sku", "sku", str), ("unit", "unit", str),
                    ("description", "description", str), ("image-url", "image_url", str),
                    ("low-stock-threshold", "low_stock_threshold", _non_negative))


def _product_fields(args):
    fields = {}
    for option, column, _ in _PRODUCT_OPTIONS:
        value = getattr(args, option.replace("-", "_"))
        if value is not None:
            fields[column] = value
    return fields


def cmd_company_create(conn, args):
    return create_company(conn, args.name, args.slug)


def cmd_key_create(conn, args):
    scopes = [scope.strip() for scope in args.scopes.split(",") if scope.strip()]
    return create_api_key(conn, args.company, scopes, args.rate_limit, args.expires_at)


def cmd_key_revoke(conn, args):
    return revoke_api_key(conn, args.key_id)


def cmd_product_create(conn, args):
    fields = _product_fields(args)
    fields["is_active"] = not args.inactive
    return product_json(create_product(conn, args.company, **fields))


def cmd_product_update(conn, args):
    company_id = _company_of(conn, "products", "Product", args.id)
    fields = _product_fields(args)
    if args.active is not None:
        fields["is_active"] = args.active
    return product_json(update_product(conn, company_id, args.id, **fields))


def cmd_storefront_register(conn, args):
    return customer_json(storefront_register(conn, args.store, args.email, args.name,
                                             args.password))


def cmd_storefront_order(conn, args):
    items = []
    for text in args.item:
        product_id, _, quantity = text.rpartition(":")
        if not product_id or not quantity.isdigit():
            raise invalid("item", "must be PRODUCT_ID:QUANTITY")
        items.append({"productId": product_id, "quantity": int(quantity)})
    return storefront_place_order(conn, args.store, args.customer, items, args.po_number,
                                  args.notes)


def _company_of(conn, table, resource, row_id):
    """The company a record belongs to: operator commands name records by ID alone."""
    row = conn.execute(f"SELECT company_id FROM {table} WHERE id = ?", (row_id,)).fetchone()
    if row is None:
        raise not_found(resource)
    return row["company_id"]


def return_json(row):
    return {"id": row["id"], "orderId": row["order_id"], "customerId": row["customer_id"],
            "status": row["status"], "reason": row["reason"], "itemCount": row["item_count"],
            "actor": row["actor"], "createdAt": row["created_at"], "updatedAt": row["updated_at"]}


def cmd_return_open(conn, args):
    return return_json(open_return(conn, _company_of(conn, "orders", "Order", args.order), args.order,
                                   args.reason, args.item_count, "staff" if args.staff else None))


def cmd_return_approve(conn, args):
    return return_json(approve_return(conn, _company_of(conn, "returns", "Return", args.id), args.id))


def cmd_return_receive(conn, args):
    return return_json(receive_return(conn, _company_of(conn, "returns", "Return", args.id), args.id))


def cmd_return_refund(conn, args):
    return refund_return(conn, _company_of(conn, "returns", "Return", args.id), args.id, args.method,
                         args.good_units, args.damaged_units, args.subtotal, args.amount)


def cmd_invoice_paid(conn, args):
    return record_invoice_paid(conn, args.company, args.invoice_id, args.amount_paid,
                               args.currency, args.hosted_invoice_url, args.number,
                               args.period_start, args.period_end)


def cmd_webhook_rotate_secret(conn, args):
    return rotate_webhook_secret(conn, args.id, args.grace_hours)


def cmd_deliveries(conn, args):
    _company_of(conn, "webhooks", "Webhook", args.id)
    return {"webhookId": args.id, "deliveries": recent_deliveries(conn, args.id)}


DEMO_SLUG = "demo-wholesale"
DEMO_CATALOG = (
    # name, sku, category, unit, price (cents), stock, low-stock threshold, active
    ("Jasmine Rice 25kg", "GR-RICE-25", "Grains", "bag", 4250, 120, 20, True),
    ("Basmati Rice 10kg", "GR-BASM-10", "Grains", "bag", 2390, 80, 15, True),
    ("Bread Flour 16kg", "GR-FLOUR-16", "Grains", "bag", 1875, 60, 10, True),
    ("Extra Virgin Olive Oil 5l", "PA-OIL-5", "Pantry", "tin", 3899, 45, 10, True),
    ("Sea Salt 1kg", "PA-SALT-1", "Pantry", "each", 320, 200, 30, True),
    ("Canned Tomatoes 2.5kg", "PA-TOM-25", "Pantry", "case", 2160, 3, 5, True),
    ("Black Tea 500g", "BV-TEA-500", "Beverages", "each", 1150, 90, 10, True),
    ("Espresso Beans 1kg", "BV-ESP-1", "Beverages", "each", 2475, 70, 10, True),
    ("Sparkling Water 24x330ml", "BV-WAT-24", "Beverages", "case", 1399, 150, 20, True),
    ("Paper Napkins 1000", "SU-NAP-1000", "Supplies", "case", 2799, 40, 5, True),
    ("Takeaway Boxes 250", "SU-BOX-250", "Supplies", "case", 3450, 35, 5, True),
    ("Wooden Stirrers 5000", "SU-STIR-5000", "Supplies", "case", 990, 0, 5, False),
)


def demo(settings):
    """A demo company with a small catalog and two customers (made once), and a new key with
    all seven scopes on every run."""
    db = Database(settings.db_path, settings)
    with db.write() as conn:
        company = conn.execute("SELECT * FROM companies WHERE slug = ?", (DEMO_SLUG,)).fetchone()
        if company is None:
            company_id = create_company(conn, "Demo Wholesale", DEMO_SLUG)["id"]
            for name, sku, category, unit, price, stock, threshold, active in DEMO_CATALOG:
                create_product(conn, company_id, name=name, sku=sku, category=category, unit=unit,
                               price_cents=price, stock=stock, low_stock_threshold=threshold,
                               is_active=active)
            for email, name in (("orders@corner-cafe.example", "Corner Cafe"),
                                ("buyer@harbour-bistro.example", "Harbour Bistro")):
                create_customer(conn, company_id, {"email": email, "name": name})
        else:
            company_id = company["id"]
        key = create_api_key(conn, company_id, list(SCOPES))
        customer = conn.execute("SELECT id FROM customers WHERE company_id = ? ORDER BY id "
                                "LIMIT 1", (company_id,)).fetchone()
        product = conn.execute("SELECT id FROM products WHERE company_id = ? AND is_active = 1 "
                               "AND stock > 10 ORDER BY id LIMIT 1", (company_id,)).fetchone()
    base = f"http://{settings.host}:{settings.port}/api/v1"
    header = f'-H "Authorization: Bearer {key["key"]}"'
    order = json_text({"customerId": customer["id"],
                       "items": [{"productId": product["id"], "quantity": 2}]})
    return "\n".join([
        f"Demo company Demo Wholesale ({company_id}) in {settings.db_path}: "
        f"{len(DEMO_CATALOG)} products, 2 customers.",
        "API key with all seven scopes (shown once):",
        key["key"],
        "Start the server (python ordering.py), then try:",
        f"  curl -s {header} {base}/products",
        f"  curl -s {header} -H 'Content-Type: application/json' -d '{order}' {base}/orders",
        f"  curl -s {header} {base}/orders",
    ])


def backup(settings, destination):
    """An online, consistent copy of the database (SQLite's backup API), safe while the
    server runs."""
    if os.path.exists(destination):
        raise ApiError(409, f"{destination} already exists; choose a new file.")
    source = Database(settings.db_path, settings).conn
    target = sqlite3.connect(destination)
    try:
        source.backup(target)
        pages = target.execute("PRAGMA page_count").fetchone()[0]
        check = target.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        target.close()
    return {"backup": destination, "bytes": os.path.getsize(destination), "pages": pages,
            "integrity": check}


def build_parser():
    parser = argparse.ArgumentParser(
        prog="ordering", description="A multi-tenant wholesale ordering service on SQLite.")
    parser.add_argument("--db", help="database file (default: $ORDERING_DB or ordering.db)")
    parser.add_argument("--version", action="version", version=f"ordering {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name, handler, help_text):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    serve_cmd = command("serve", None, "serve the API with waitress (the default command)")
    serve_cmd.add_argument("--host", default=None, help="address to listen on (127.0.0.1)")
    serve_cmd.add_argument("--port", type=int, default=None, help="port (8080)")
    serve_cmd.add_argument("--threads", type=_positive, default=None, help="request threads (4)")
    serve_cmd.add_argument("--allow-private-webhooks", action="store_true", default=None,
                           help="deliver webhooks to loopback and private addresses too")
    serve_cmd.add_argument("--ip-rate-limit", type=_non_negative, default=None,
                           help="requests per minute per client address (600; 0 is off)")
    serve_cmd.add_argument("--trust-proxy", action="store_true", default=None,
                           help="take the client address from X-Forwarded-For")

    sub = command("company-create", cmd_company_create, "create a company")
    sub.add_argument("--name", required=True)
    sub.add_argument("--slug", help="storefront slug (default: from the name)")

    sub = command("key-create", cmd_key_create, "create an API key (printed once)")
    sub.add_argument("--company", required=True, help="company ID")
    sub.add_argument("--scopes", required=True, help="comma-separated, e.g. orders:read,orders:write")
    sub.add_argument("--rate-limit", type=_positive, default=60, help="requests per minute (60)")
    sub.add_argument("--expires-at", type=_moment, help="ISO 8601 expiry (may be in the past)")

    sub = command("key-revoke", cmd_key_revoke, "revoke an API key")
    sub.add_argument("key_id", metavar="KEY_ID")

    for name, handler, creating in (("product-create", cmd_product_create, True),
                                    ("product-update", cmd_product_update, False)):
        sub = command(name, handler, ("create" if creating else "edit") + " a product")
        if creating:
            sub.add_argument("--company", required=True, help="company ID")
            sub.add_argument("--inactive", action="store_true", help="create it inactive")
        else:
            sub.add_argument("id", metavar="ID", help="product ID")
            sub.add_argument("--active", type=_active_flag, help="true or false")
        for option, _, kind in _PRODUCT_OPTIONS:
            sub.add_argument("--" + option, type=kind,
                             required=creating and option in ("name", "price"))

    sub = command("storefront-register", cmd_storefront_register,
                  "register a customer as the storefront does (customer.created, storefront)")
    sub.add_argument("--store", required=True, help="company slug")
    sub.add_argument("--email", required=True)
    sub.add_argument("--name")
    sub.add_argument("--password")

    sub = command("storefront-order", cmd_storefront_order,
                  "place an order as the storefront does (order.created, storefront shape)")
    sub.add_argument("--store", required=True, help="company slug")
    sub.add_argument("--customer", required=True, help="customer ID")
    sub.add_argument("--item", action="append", required=True,
                     help="PRODUCT_ID:QUANTITY, repeat for more lines")
    sub.add_argument("--po-number")
    sub.add_argument("--notes")

    sub = command("return-open", cmd_return_open, "open a return on an order (return.created)")
    sub.add_argument("--order", required=True, help="order ID")
    sub.add_argument("--reason", required=True, help="3 to 2000 characters")
    sub.add_argument("--item-count", type=_positive, help="line items returned (default: all)")
    sub.add_argument("--staff", action="store_true", help="opened from the dashboard")

    for name, handler, help_text in (
            ("return-approve", cmd_return_approve, "approve a REQUESTED return (return.approved)"),
            ("return-receive", cmd_return_receive, "mark an APPROVED return RECEIVED")):
        sub = command(name, handler, help_text)
        sub.add_argument("id", metavar="RETURN_ID")

    sub = command("return-refund", cmd_return_refund,
                  "refund a RECEIVED return (refund.processed)")
    sub.add_argument("id", metavar="RETURN_ID")
    sub.add_argument("--method", required=True, choices=("CREDIT", "MANUAL"))
    sub.add_argument("--good-units", type=_non_negative, required=True)
    sub.add_argument("--damaged-units", type=_non_negative, required=True)
    sub.add_argument("--subtotal", type=_amount, required=True, help="e.g. 40.00")
    sub.add_argument("--amount", type=_amount, help="refunded amount (default: the subtotal)")

    sub = command("invoice-paid", cmd_invoice_paid,
                  "record a paid invoice of the company's subscription (invoice.paid)")
    sub.add_argument("--company", required=True, help="company ID")
    sub.add_argument("--invoice-id", required=True, help="billing provider's invoice ID")
    sub.add_argument("--amount-paid", type=_amount, required=True)
    sub.add_argument("--currency", required=True, help="lower-case code, e.g. usd")
    sub.add_argument("--hosted-invoice-url", required=True)
    sub.add_argument("--number", required=True)
    sub.add_argument("--period-start", required=True)
    sub.add_argument("--period-end", required=True)

    sub = command("webhook-rotate-secret", cmd_webhook_rotate_secret,
                  "give a webhook a new secret (printed once); the old one signs "
                  "X-Webhook-Signature-Old during the grace window")
    sub.add_argument("id", metavar="WEBHOOK_ID")
    sub.add_argument("--grace-hours", type=float, default=24.0, help="grace window (24)")

    command("demo", None, "create a demo company, catalog and customers (once) and print a "
                          "new key with all seven scopes and curl commands to try")
    sub = command("backup", None, "copy the database to DEST while the server may be running")
    sub.add_argument("destination", metavar="DEST", type=_non_empty)

    sub = command("deliveries", cmd_deliveries, "the 5 most recent delivery attempts of a webhook")
    sub.add_argument("id", metavar="WEBHOOK_ID")
    return parser


def run_command(handler, args, settings):
    """Run an operator command in one transaction, then deliver the events it emitted."""
    db = Database(settings.db_path, settings)
    emitted = []
    db.on_commit(emitted.extend)
    with db.write() as conn:
        result = handler(conn, args)
    if emitted:
        sender = Sender(db, settings)
        sender.start_workers()
        sender.deliver_events(emitted)
        sender.stop(grace=0)
    return result


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {"db_path": args.db}
    if args.command in (None, "serve"):
        for name in ("host", "port", "threads", "allow_private_webhooks", "ip_rate_limit",
                     "trust_proxy"):
            overrides[name] = getattr(args, name, None)
    try:
        settings = Settings.from_environment(**overrides)
    except (ValueError, TypeError) as error:
        parser.error(f"bad setting in the environment: {error}")
    try:
        if args.command in (None, "serve"):
            serve(settings)
            return 0
        if args.command == "demo":
            print(demo(settings))
            return 0
        if args.command == "backup":
            result = backup(settings, args.destination)
        else:
            result = run_command(args.handler, args, settings)
    except ApiError as error:
        details = "".join(f"\n  {d['field']}: {d['rule']}" for d in error.details or ())
        print(f"ordering {args.command}: {error.message}{details}", file=sys.stderr)
        return 1
    except sqlite3.Error as error:
        print(f"ordering {args.command}: database error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
