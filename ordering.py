"""ordering: a multi-tenant wholesale ordering service on SQLite or PostgreSQL.

Products, orders, customers and signed webhooks behind a small REST API (/api/v1), with a
staff dashboard, buyers' storefronts, outgoing email and Stripe's billing webhooks, in one
module you can run (``python ordering.py``), vendor, or embed (``create_app()`` returns a WSGI app; ``__all__``
names what embedders may rely on). The sections run in dependency order: each uses only the
ones above it.

  1. Settings      every tunable, read once from flags and environment, checked at start:
                   1.1 mail settings (the mail server URL, sender, base URL, CA file);
                   1.2 the settings
  2. Storage       2.1 schema and migrations (and copying a table); 2.2 claimers (which
                   process holds a claim, and whether it lives); 2.3 shared rate counters;
                   2.4 engines (SQLite, PostgreSQL: all that differs between them, one method
                   each); 2.5 the database and its write transaction (group commit, savepoints)
  3. Values        IDs, timestamps, money, JavaScript-like integer and date parsing, key and
                   password hashes (one scheme, scrypt), JSON text; 3.1 currencies (amounts in
                   their minor unit, for billing)
  4. Text and markup   escaping, Template and render(): every piece of markup is written
                   here; 4.1 the page kit (the layout, fields, forms, tables, tags, the
                   stylesheet); 4.2 email templates; 4.3 dashboard pages; 4.4 storefront
                   pages
  5. Errors and validation   ApiError; 5.1 messages, enumerations and limits (the spec's,
                   each once, and ours); 5.2 validators (and the refusals they raise)
  6. Records       rows to the JSON the API shows, one function per record type; no SQL
  7. Events and tenancy   the operations begin (sections 7 to 11: what the business
                   does, without HTTP): 7.1 events (the catalog, emit() into the outbox);
                   7.2 email (queue_email(), written like an event); 7.3 rows and tenancy
                   (load_row, the one "fetch or 404")
  8. Catalog and customers   8.1 companies (and their settings); 8.2 stock movements (the
                   ledger's rows: every change of stock is one); 8.3 products; 8.4 stock
                   changes (adjustments, counts: product edits); 8.5 customers; 8.6 customer
                   prices (a customer's own, for storefront and dashboard orders)
  9. Orders, returns and billing   9.1 orders (placing them, their emails); 9.2 invoices,
                   payments and credit (money owed: invoices, payments, credit notes, credit
                   limits, statements, aging, reminders); 9.3 status changes (invoicing a
                   shipped order, restocking a cancelled one); 9.4 returns and refunds
                   (returns' lines, the good units a refund puts back, its credit note);
                   9.5 billing (Stripe's events, the company's own invoices)
 10. Integrations and accounts   10.1 webhook subscriptions; 10.2 emails (what was sent,
                   sending again); 10.3 API keys and idempotency; 10.4 accounts and sessions
                   (any kind of account); 10.5 storefront accounts (a store's accounts are its
                   customers' contacts: registration, emailed links, password reset; staff
                   reset and are invited by the same links; a customer's changes, since
                   blocking one ends its contacts' sign-ins);
                   10.6 contacts (adding, inviting and changing a customer's people)
 11. Queries and storefront ordering   11.1 queries (the paginator, list filters, lookups);
                   11.2 storefront ordering (catalog, cart, quick order, reorder, addresses,
                   checkout, order requests above an approval limit, a buyer's orders);
                   11.3 records as the database writes them (the API's reads of products and
                   orders); 11.4 spreadsheets (CSV out, streamed; CSV in, all or nothing);
                   11.5 reports (a daily or weekly summary to the staff, once a period)
 12. Outbox        claims, leases, dead claimers, the dispatcher and its threads, retention,
                   for any channel; 12.1 webhooks (signing, address checks, the POST); 12.2 email
                   (SMTP, TLS, retries, message building); 12.3 channels (which ones an app's
                   outbox sends)
 13. HTTP API      13.1 routes (class Api: parse, call an operation, wrap); 13.2 billing
                   (Stripe's signed webhook, beside the API); 13.3 serving the API (the
                   Service: auth, scopes, rate limits, idempotency, housekeeping, errors)
 14. OpenAPI       the document built from the route table: 14.1 event payloads;
                   14.2 operations of the API; 14.3 responses, headers and parameters every
                   operation shares
 15. Web pages     the kit every HTML surface shares (forms, CSRF, the page registry, the
                   Surface: sign-in, sessions and security headers); 15.1 dashboard (the
                   staff's pages at /dashboard); 15.2 billing, emails and settings (the
                   company's own); 15.3 storefront (the buyers' pages at /store/{slug}:
                   register, sign in, reset; then ordering: catalog, cart and quick order,
                   checkout, orders, returns)
 16. App           create_app() installs every surface
 17. Server        serve and its workers, the access log
 18. Commands      the operator commands, each declared by @command above its handler:
                   18.1 the demo (its company, catalog, customers and keys); 18.2 copies
                   (backup, copy-to); 18.3 the commands (staff-create, demo, backup,
                   copy-to, ...), the parser and main(); 18.4 former names (kept one release
                   after a rename)
"""

import argparse
import base64
import collections
import contextlib
import copy
import csv
import ctypes
import dataclasses
import datetime
import fcntl
import functools
import decimal
import email.headerregistry
import email.message
import email.policy
import email.utils
import hashlib
import hmac
import html
import http.client
import io
import ipaddress
import itertools
import json
import logging
import math
import mmap
import os
import queue
import re
import resource
import secrets
import shlex
import signal
import smtplib
import socket
import sqlite3
import ssl
import string
import struct
import sys
import textwrap
import threading
import time
import unicodedata
import zoneinfo
import urllib.parse
import warnings

import bottle

__version__ = "0.1.0"

#: What embedders may rely on (see docs/embedding.md); the rest may change in any release. A
#: name that moves keeps its former name for one release, outside this list (see Former
#: names, at the end).
__all__ = [
    # The app and its settings
    "create_app", "Settings", "serve", "main",
    # The database: db.write() for every transaction that writes, db.conn for reads
    "Database",
    # Operations, each in the caller's transaction (with db.write() as conn)
    "create_company", "create_api_key", "revoke_api_key", "create_product", "update_product",
    "create_customer", "update_customer", "storefront_register", "register_customer",
    "verify_customer_email", "request_password_reset", "reset_password", "invite_customer",
    "change_contact_password", "add_contact", "update_contact", "customer_contacts",
    "place_order",
    "storefront_place_order", "parse_status_update", "update_order_status", "open_return",
    "approve_return", "receive_return", "refund_return", "record_invoice_paid",
    "create_webhook", "update_webhook", "delete_webhook", "rotate_webhook_secret",
    "recent_deliveries", "create_staff", "disable_staff", "emit",
    # The stock ledger: who moves stock, and the moves that are not an order's
    "Actor", "adjust_stock", "count_stock", "restock_order", "stock_history",
    # Records: rows to the JSON the API shows
    "product_json", "customer_json", "order_json", "webhook_json", "return_json",
    "movement_json",
    # Errors, the spec's enumerations, and the OpenAPI document
    "ApiError", "EVENT_CATALOG", "SCOPES", "ORDER_STATUSES", "CARRIERS", "CUSTOMER_STATUSES",
    "RETURN_STATUSES", "MOVEMENT_REASONS", "openapi_document",
    # For webhook receivers
    "verify_signature",
]

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

#: The schema version this module writes; older databases are migrated up to it at start.
SCHEMA_VERSION = 13

DEFAULT_TRACKING_URL_TEMPLATES = {
    "CARRIER_A": "https://tracking.carrier-a.example/track?number={number}",
    "CARRIER_B": "https://tracking.carrier-b.example/parcels/{number}",
    "CARRIER_C": "https://tracking.carrier-c.example/?tracknum={number}",
    "CARRIER_D": "https://tracking.carrier-d.example/track/{number}",
    "CARRIER_E": "https://tracking.carrier-e.example/status?id={number}",
}


# 1.1 Mail settings ---------------------------------------------------------------------------

#: smtp_url's schemes, each with its TLS mode and default port (see docs/mail.md).
SMTP_SCHEMES = {"smtp": 25, "smtp+starttls": 587, "smtps": 465}

MailServer = collections.namedtuple("MailServer", "scheme host port user password")


def mail_server(url):
    """smtp_url read as a MailServer; ValueError (its message without the password) when it is
    not one. User and password may be percent-encoded (an @ in a user name as %40)."""
    shown = describe_smtp_url(url)
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise ValueError(f"the mail server URL {shown!r} is not a URL with a valid port") from None
    scheme = parts.scheme.lower()
    if scheme not in SMTP_SCHEMES:
        raise ValueError(f"the mail server URL must begin with smtp://, smtp+starttls:// or "
                         f"smtps://, not {shown!r}")
    if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"the mail server URL must be {scheme}://[user[:password]@]host[:port], "
                         f"not {shown!r}")
    user = None if parts.username is None else urllib.parse.unquote(parts.username)
    password = None if parts.password is None else urllib.parse.unquote(parts.password)
    if scheme == "smtp" and password and not _loopback(parts.hostname):
        raise ValueError(f"{shown} would send the password unencrypted over the network; use "
                         "smtp+starttls:// or smtps:// (plain smtp:// is for a relay that needs "
                         "no password, or one on this machine)")
    return MailServer(scheme, parts.hostname, port or SMTP_SCHEMES[scheme], user, password)


def _loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def describe_smtp_url(url):
    """The mail server URL as logs and messages may show it: without its password."""
    parts = urllib.parse.urlsplit(url.strip())
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = user.split(":", 1)[0] + (":***" if ":" in user else "") + "@" + host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


_MAIL_ADDRESS = re.compile(r"[^@\s\x00-\x1f\x7f<>(),;:\"\[\]\\]+@[A-Za-z0-9.-]+\.[A-Za-z0-9-]{2,}")


def check_mail_settings(settings):
    """Stop a start with bad mail settings with a message, rather than fail at the first
    email: the URL, the sender address, the base URL and the CA file are checked here."""
    if settings.smtp_url:
        mail_server(settings.smtp_url)
        if not settings.mail_from:
            raise ValueError("a mail server needs a sender address: set ORDERING_MAIL_FROM "
                             "(orders@example.com)")
    if settings.mail_from and not _MAIL_ADDRESS.fullmatch(settings.mail_from):
        raise ValueError(f"the sender address (ORDERING_MAIL_FROM) must be an address such as "
                         f"orders@example.com, not {settings.mail_from!r}")
    if settings.base_url:
        check_base_url(settings.base_url)
    if settings.smtp_ca_file:
        mail_tls_context(settings)


def check_base_url(url):
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.query or parts.fragment or parts.username:
        raise ValueError(f"the base URL (ORDERING_BASE_URL) must be an http:// or https:// "
                         f"address such as https://orders.example.com, not {url!r}")
    return url


def mail_tls_context(settings):
    """The TLS settings for the mail server: certificates verified and the host name checked,
    against smtp_ca_file when set, else the system's authorities."""
    try:
        return ssl.create_default_context(cafile=settings.smtp_ca_file or None)
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"cannot read the mail server's CA file (ORDERING_SMTP_CA_FILE) "
                         f"{settings.smtp_ca_file!r}: {getattr(error, 'strerror', None) or error}"
                         ) from None


def proxy_address(text):
    """'*' or an IP address, written as the server reports peers (waitress compares text)."""
    text = text.strip()
    if text == "*":
        return text
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ValueError(f"proxy address must be an IP address or *, not {text!r}") from None


# 1.2 The settings ----------------------------------------------------------------------------

@dataclasses.dataclass
class Settings:
    #: Path of the SQLite database file (created if missing), or a postgresql:// URL of an
    #: existing PostgreSQL database (see docs/operations.md, PostgreSQL).
    db_path: str = "ordering.db"
    #: Address and port the server listens on.
    host: str = "127.0.0.1"
    port: int = 8080
    #: Request-handling threads of the server (waitress's default: more mostly add GIL contention).
    threads: int = 4
    #: Connections the server keeps open at once: slow clients holding half a request cost a
    #: socket each, not a thread, so this is set well above waitress's 100.
    connection_limit: int = 1000
    #: Seconds a connection may stay silent (half a request, or idle between requests) before
    #: the server closes it.
    idle_timeout: int = 30
    #: Server processes sharing the port (serve --workers); a parent starts and stops them.
    workers: int = 1
    #: SQLite PRAGMA synchronous: FULL puts every commit on disk before it is acknowledged;
    #: NORMAL survives a process crash but not an OS crash or power cut (see docs/operations.md).
    synchronous: str = "FULL"
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
    #: Days events and delivery-log entries are kept (each webhook keeps its most recent
    #: deliveries whatever their age; undelivered work is never removed); 0 keeps everything.
    retention_days: float = 30.0
    #: Allow webhook URLs that resolve to loopback, private or reserved addresses.
    allow_private_webhooks: bool = False
    #: Requests per minute from one client address, checked before authentication; 0 is off.
    ip_rate_limit: int = 600
    #: Take the client address from X-Forwarded-For (only behind a proxy you run).
    trust_proxy: bool = False
    #: Count rate limits in a file beside the database that every process of this machine
    #: shares (the database's path + "-rates"); off, each process counts alone (right only
    #: for a single process).
    shared_rate_limits: bool = True
    #: With trust_proxy: the address the proxy connects from ("*": any peer). serve tells
    #: waitress to honour X-Forwarded-For from this peer only and to drop it from any other.
    proxy_address: str = "127.0.0.1"
    #: Seconds an Idempotency-Key and its response are remembered.
    idempotency_ttl: int = 24 * 3600
    #: Seconds a looked-up API key is trusted before it is read again (revocation delay for
    #: other processes; revocations through this process take effect at once).
    key_cache_seconds: float = 5.0
    #: Serve the staff dashboard at /dashboard (and send a browser opening / there).
    dashboard: bool = True
    #: Serve every company's storefront at /store/{slug} (its buyers' accounts).
    storefront: bool = True
    #: Seconds a dashboard or storefront session may sit unused before it ends.
    session_idle_seconds: int = 12 * 3600
    #: Seconds a session lasts at most from its sign-in, however busy.
    session_max_seconds: int = 7 * 24 * 3600
    #: URL templates for the named carriers; {number} is replaced by the tracking number.
    tracking_url_templates: dict = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_TRACKING_URL_TEMPLATES))
    #: Stripe's webhook signing secrets (whsec_...): one, or two during a secret roll (either
    #: signature passes). POST /billing/stripe/webhook is served only when one is set. Kept
    #: out of repr(), which would show them.
    stripe_webhook_secrets: tuple = dataclasses.field(default=(), repr=False)
    #: Seconds a Stripe-Signature timestamp stays acceptable (Stripe's own libraries: 300).
    stripe_webhook_tolerance: int = 300
    #: The mail server outgoing email goes through: smtp://, smtp+starttls:// or smtps://, with
    #: an optional user:password@ (see docs/mail.md); empty: none, and email waits unsent.
    #: Kept out of repr(), which would show the password.
    smtp_url: str = dataclasses.field(default="", repr=False)
    #: A PEM file of the certificate authorities trusted for the mail server, in place of the
    #: system's (a private relay); empty: the system's.
    smtp_ca_file: str = ""
    #: Seconds the mail server may take to accept a connection or to answer one command.
    smtp_timeout: float = 30.0
    #: The sender address of every email; each company's mail name is its display name.
    mail_from: str = ""
    #: The address people reach this server at, which every link in an email is built from
    #: (never a request's Host header); empty: the address serve listens on.
    base_url: str = ""

    @classmethod
    def from_environment(cls, environ=os.environ, **overrides):
        """Settings from ORDERING_* variables; explicit keyword overrides win."""
        values = {}
        readers = {
            "ORDERING_DB": ("db_path", str),
            "ORDERING_SYNCHRONOUS": ("synchronous", str),
            "ORDERING_WEBHOOK_TIMEOUT": ("webhook_timeout", float),
            "ORDERING_DELIVERY_WORKERS": ("delivery_workers", int),
            "ORDERING_RETENTION_DAYS": ("retention_days", _non_negative_float),
            "ORDERING_ALLOW_PRIVATE_WEBHOOKS": ("allow_private_webhooks", _flag),
            "ORDERING_IP_RATE_LIMIT": ("ip_rate_limit", int),
            "ORDERING_TRUST_PROXY": ("trust_proxy", _flag),
            "ORDERING_WORKERS": ("workers", int),
            "ORDERING_SHARED_RATE_LIMITS": ("shared_rate_limits", _flag),
            "ORDERING_KEY_CACHE_SECONDS": ("key_cache_seconds", float),
            "ORDERING_PROXY_ADDRESS": ("proxy_address", proxy_address),
            "ORDERING_TRACKING_URL_TEMPLATES": ("tracking_url_templates", json.loads),
            "ORDERING_STRIPE_WEBHOOK_SECRET": ("stripe_webhook_secrets", stripe_webhook_secrets),
            "ORDERING_STRIPE_WEBHOOK_TOLERANCE": ("stripe_webhook_tolerance",
                                                  stripe_webhook_tolerance),
            "ORDERING_SMTP_URL": ("smtp_url", str),
            "ORDERING_SMTP_CA_FILE": ("smtp_ca_file", str),
            "ORDERING_SMTP_TIMEOUT": ("smtp_timeout", _positive_float),
            "ORDERING_MAIL_FROM": ("mail_from", str),
            "ORDERING_BASE_URL": ("base_url", str),
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

    def __post_init__(self):
        # Checked at start: in the PRAGMA, SQLite takes any unknown word for NORMAL without a
        # word, which would quietly drop the durability that FULL promises.
        level = str(self.synchronous).strip().upper()
        if level not in SYNCHRONOUS_LEVELS:
            raise ValueError(f"synchronous (ORDERING_SYNCHRONOUS) must be one of "
                             f"{', '.join(SYNCHRONOUS_LEVELS)}, not {self.synchronous!r}")
        self.synchronous = level
        self.stripe_webhook_secrets = stripe_webhook_secrets(self.stripe_webhook_secrets)
        self.stripe_webhook_tolerance = stripe_webhook_tolerance(self.stripe_webhook_tolerance)
        check_mail_settings(self)

    @property
    def mail_server(self):
        """The mail server of smtp_url as a MailServer, or None when none is set."""
        return mail_server(self.smtp_url) if self.smtp_url else None

    @property
    def link_base(self):
        """What every link in an email begins with: base_url, else the address serve listens
        on (a wildcard address by this machine's name)."""
        if self.base_url:
            return self.base_url.rstrip("/")
        host = this_host() if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"


#: The PRAGMA synchronous levels accepted; see docs/operations.md, Storage and durability.
SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")


@functools.lru_cache(maxsize=1)
def this_host():
    """This machine's name (a reverse lookup that can take seconds: asked once)."""
    return socket.getfqdn()


def _flag(text):
    return text.strip().lower() in ("1", "true", "yes", "on")


def _non_negative_float(text):
    value = float(text)
    if not 0 <= value < math.inf:
        raise ValueError(f"must be a number 0 or more, not {text!r}")
    return value


def stripe_webhook_secrets(value):
    """Stripe webhook secrets, from text (separated by a comma) or a sequence, as a tuple: none,
    one, or two during a roll. The refusal never repeats a secret (it would reach logs)."""
    parts = [str(part).strip() for part in (value.split(",") if isinstance(value, str)
                                            else value)]
    if parts in ([], [""]):
        return ()
    if len(parts) > 2 or not all(re.fullmatch(r"whsec_[!-~]+", part)
                                           for part in parts):
        raise ValueError("Stripe webhook secret (ORDERING_STRIPE_WEBHOOK_SECRET, serve "
                         "--stripe-webhook-secret) must be one whsec_... secret, or two "
                         "separated by a comma during a roll")
    return tuple(parts)


def stripe_webhook_tolerance(value):
    """Whole seconds, 1 or more, from text or a number."""
    text = str(value).strip()
    if isinstance(value, bool) or not re.fullmatch(r"[0-9]{1,9}", text) or int(text) < 1:
        raise ValueError(f"Stripe webhook tolerance (ORDERING_STRIPE_WEBHOOK_TOLERANCE) must be "
                         f"a whole number of seconds, 1 or more, not {value!r}")
    return int(text)
def _positive_float(text):
    value = float(text)
    if not 0 < value < math.inf:
        raise ValueError(f"must be a number above 0, not {text!r}")
    return value


# ---------------------------------------------------------------------------------------------
# 2. Storage
# ---------------------------------------------------------------------------------------------


# 2.1 Schema and migrations -------------------------------------------------------------------

def apply_schema(conn):
    """Create what is missing, then migrate by the schema version the engine keeps. Tables are
    made before the migrations and everything else after them, so that an index may name a
    column that a migration adds to an older file."""
    engine = conn.engine
    fresh = not engine.has_table(conn, "companies")
    statements = engine.schema_statements()
    for statement in statements:
        if "CREATE TABLE" in statement:
            conn.execute(statement)
    # schema.sql makes a new database current: only older databases take the migrations.
    version = SCHEMA_VERSION if fresh else engine.schema_version(conn)
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"database schema version {version} is newer than this program "
                           f"({SCHEMA_VERSION}); upgrade ordering")
    for target in range(version + 1, SCHEMA_VERSION + 1):
        for step in MIGRATIONS.get(target, ()):
            if callable(step):
                step(conn)
            else:
                conn.execute(engine.translate(step))
    for statement in statements:
        if "CREATE TABLE" not in statement:
            conn.execute(statement)
    engine.set_schema_version(conn, SCHEMA_VERSION)


def schema_statements():
    """schema.sql, one statement at a time, as SQLite reads it."""
    statements, pending = [], ""
    with open(SCHEMA_PATH, encoding="utf-8") as handle:
        for line in handle:
            pending += line
            if sqlite3.complete_statement(pending):
                statements.append(pending)
                pending = ""
    return statements


def table_statement(table):
    """schema.sql's CREATE TABLE statement of a table."""
    return next(statement for statement in schema_statements()
                if f"CREATE TABLE IF NOT EXISTS {table} (" in statement)


def column_check(table, column):
    """The CHECK clause of a column of schema.sql, as written there."""
    statement = table_statement(table)
    start = statement.index("CHECK (", statement.index(f"\n    {column} "))
    depth = 0
    for end in range(start + len("CHECK "), len(statement)):
        depth += {"(": 1, ")": -1}.get(statement[end], 0)
        if depth == 0:
            return statement[start:end + 1]
    raise ValueError(f"{table}.{column}: unbalanced CHECK in schema.sql")


def rebuild_table(table, statements=None):
    """A migration step for a change that ALTER TABLE cannot make (a new primary key): the
    table made again by statements (schema.sql's, unless given; its indexes come after the
    migrations, as always), every column of its rows copied across by name. The rows wait in
    a bare table, so that no name of the old table's indexes or constraints is still taken
    when the new one is made."""
    def rebuild(conn):
        conn.execute(f"CREATE TABLE {table}_rows AS SELECT * FROM {table}")
        columns = ", ".join(column[0] for column in conn.execute(
            f"SELECT * FROM {table}_rows LIMIT 0").description)
        conn.execute(f"DROP TABLE {table}")
        for statement in statements or (table_statement(table),):
            conn.execute(conn.engine.translate(statement))
        conn.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {table}_rows")
        conn.execute(f"DROP TABLE {table}_rows")
    return rebuild


def rewrite_check(table, column, old):
    """A migration step: a column's CHECK clause old, as an older schema.sql wrote it, becomes
    the one schema.sql writes now (the two must admit the same values)."""
    return lambda conn: conn.engine.replace_check(conn, table, column, old,
                                                  column_check(table, column))


def add_column(table, definition):
    """A migration step: the column of definition added to table, unless a database that
    tells an older version has it already (a later release's file, taken back)."""
    def add(conn):
        columns = conn.execute(f"SELECT * FROM {table} LIMIT 0").description
        if definition.split()[0] not in {column[0] for column in columns}:
            conn.execute(conn.engine.translate(f"ALTER TABLE {table} ADD COLUMN {definition}"))
    return add


def accounts_to_contacts(conn):
    """Version 10's step: each customer's own email becomes its first contact, an admin, with
    its password and confirmation, and its sessions, emailed links and cart (where the older
    database has them: one older than the storefront got the new tables from schema.sql);
    the customer keeps no password. Contact IDs follow their customer's."""
    engine = conn.engine
    customer_columns = {column[0] for column in conn.execute(
        "SELECT * FROM customers LIMIT 0").description}
    password = "password_hash" if "password_hash" in customer_columns else "NULL"
    conn.execute(
        f"INSERT INTO contacts (id, customer_id, company_id, email, email_key, name, role, "
        f"status, email_verified, password_hash, created_at, updated_at) SELECT "
        f"'con_' || substr(id, 5), id, company_id, email, email_key, name, 'admin', 'ACTIVE', "
        f"email_verified, {password}, created_at, updated_at FROM customers")
    contact_id = "'con_' || substr(customer_id, 5)"
    for old, new, rest in (("customer_sessions", "contact_sessions", "created_at, last_seen_at"),
                           ("customer_tokens", "contact_tokens",
                            "purpose, created_at, expires_at")):
        if engine.has_table(conn, old):
            conn.execute(f"INSERT INTO {new} (token_hash, contact_id, {rest}) "
                         f"SELECT token_hash, {contact_id}, {rest} FROM {old}")
            conn.execute(f"DROP TABLE {old}")
    if "customer_id" in {column[0] for column in conn.execute(
            "SELECT * FROM cart_lines LIMIT 0").description}:
        conn.execute("CREATE TABLE cart_rows AS SELECT * FROM cart_lines")
        conn.execute("DROP TABLE cart_lines")
        conn.execute(engine.translate(table_statement("cart_lines")))
        conn.execute(f"INSERT INTO cart_lines (contact_id, product_id, quantity, added_at) "
                     f"SELECT {contact_id}, product_id, quantity, added_at FROM cart_rows")
        conn.execute("DROP TABLE cart_rows")
    if password != "NULL":
        conn.execute("ALTER TABLE customers DROP COLUMN password_hash")


#: Statements that bring a database from version N-1 to N, beyond what schema.sql creates.
MIGRATIONS = {
    2: ("ALTER TABLE deliveries ADD COLUMN claimed_by TEXT",
        "ALTER TABLE idempotency_keys ADD COLUMN claimed_by TEXT"),
    # Billing: a company's Stripe customer; invoice amounts in their currency's minor unit
    # (the invoice-paid command used to store cents of every currency). The currencies are
    # Stripe's zero- and three-decimal lists as this version found them.
    3: ("ALTER TABLE companies ADD COLUMN stripe_customer_id TEXT",
        "ALTER TABLE invoices RENAME COLUMN amount_paid_cents TO amount_paid_minor",
        "UPDATE invoices SET amount_paid_minor = amount_paid_minor / 100 WHERE currency IN "
        "('bif', 'clp', 'djf', 'gnf', 'jpy', 'kmf', 'krw', 'mga', 'pyg', 'rwf', 'ugx', 'vnd', "
        "'vuv', 'xaf', 'xof', 'xpf')",
        "UPDATE invoices SET amount_paid_minor = amount_paid_minor * 10 WHERE currency IN "
        "('bhd', 'jod', 'kwd', 'omr', 'tnd')",
        # Email: the companies' mail settings (new tables come from schema.sql at every start).
        "ALTER TABLE companies ADD COLUMN mail_name TEXT",
        "ALTER TABLE companies ADD COLUMN reply_to TEXT",
        "ALTER TABLE companies ADD COLUMN staff_alerts TEXT"),
    # The storefront: whether new buyers wait for approval (its tables come from schema.sql).
    4: ("ALTER TABLE companies ADD COLUMN storefront_approval TEXT NOT NULL DEFAULT 'required'",),
    # Storefront ordering: an order's shipping address and checkout form, and the record of
    # status changes, which begins with each order's placement and (for an order that has
    # moved since) its status now: the steps between were not recorded.
    5: ("ALTER TABLE orders ADD COLUMN shipping_address TEXT",
        "ALTER TABLE orders ADD COLUMN checkout_token TEXT",
        "INSERT INTO order_status_changes (id, order_id, from_status, to_status, source, "
        "created_at) SELECT 'osc_' || substr(id, 5), id, NULL, 'SUBMITTED', source, created_at "
        "FROM orders",
        "INSERT INTO order_status_changes (id, order_id, from_status, to_status, source, "
        "tracking_number, created_at) SELECT 'osc_' || substr(id, 5) || 'n', id, NULL, status, "
        "NULL, tracking_number, updated_at FROM orders WHERE status <> 'SUBMITTED'"),
    # The stock ledger (its table comes from schema.sql): each product opens it with one
    # movement of its whole stock, dated when the product last changed, so that the sum of
    # every product's movements is its stock from the start.
    6: ("INSERT INTO stock_movements (id, company_id, product_id, change, level_after, reason, "
        "actor_type, created_at) SELECT 'mov_' || substr(id, 6), company_id, id, stock, stock, "
        "'initial', 'system', updated_at FROM products",),
    # Cheaper order placement (see schema.sql): newest-first indexes become ascending ones,
    # read backward, and indexes of values most rows lack become partial; the ledger and the
    # status record are kept in the order of their primary keys; the order checks compare.
    7: tuple(f"DROP INDEX IF EXISTS {index}" for index in (
        "products_by_company_newest", "products_by_company_category_newest",
        "products_by_company_active_newest", "products_by_company_active_category_newest",
        "customers_by_company_newest", "customers_by_company_status_newest",
        "orders_by_company_newest", "orders_by_company_status_newest",
        "orders_by_company_customer_newest", "orders_by_company_po_number",
        "orders_by_checkout", "returns_by_company_newest", "invoices_by_company_newest",
        "emails_by_company_newest")) + (
        rebuild_table("stock_movements"), rebuild_table("order_status_changes"),
        rewrite_check("orders", "status", "CHECK (status IN ('SUBMITTED', 'CONFIRMED', "
                                          "'SHIPPED', 'DELIVERED', 'CANCELLED'))"),
        rewrite_check("orders", "source", "CHECK (source IN ('api', 'storefront', "
                                          "'dashboard'))")),
    # Tax: the company's rate, and the rate and tax frozen on each order when it is placed
    # (orders placed before had none).
    8: (add_column("companies", "tax_rate REAL NOT NULL DEFAULT 0"),
        add_column("orders", "tax_rate REAL NOT NULL DEFAULT 0"),
        add_column("orders", "tax_cents INTEGER NOT NULL DEFAULT 0")),
    # Money owed: payment terms, the company's and a customer's own (the invoices, payments
    # and credit notes are new tables); the buyer emails a company turns off; a status
    # change's note.
    9: (add_column("companies", "payment_terms_days INTEGER NOT NULL DEFAULT 0"),
        add_column("customers", "payment_terms_days INTEGER"),
        # The buyer emails a company turns off, and a status change's note.
        add_column("companies", "buyer_emails_off TEXT"),
        add_column("order_status_changes", "note TEXT")),
    # Contacts: each customer's own email becomes its first contact, an admin, with its
    # password, confirmation, sessions, emailed links and cart (their IDs follow the
    # customer's); the customer keeps no password. An order records who placed and approved it.
    10: (accounts_to_contacts,
         add_column("orders", "placed_by TEXT"), add_column("orders", "approved_by TEXT")),
    # The wholesale catalog: a product's quantity rules and price breaks; a customer's group
    # (the groups and their prices are new tables).
    11: (add_column("customers", "group_id TEXT REFERENCES customer_groups(id)"),
         add_column("companies", "report_period TEXT"),
         add_column("products", "min_quantity INTEGER NOT NULL DEFAULT 1 CHECK "
                                "(min_quantity >= 1)"),
         add_column("products", "order_multiple INTEGER NOT NULL DEFAULT 1 CHECK "
                                "(order_multiple >= 1)"),
         add_column("products", "price_breaks TEXT")),
    # Order numbers: each company's orders numbered from 1001 in the order they were placed
    # (their IDs' order); the next order takes the number after its company's highest.
    # Staff roles: every account there was may do everything, as an owner may.
    12: (add_column("orders", "number INTEGER"),
         "UPDATE orders SET number = numbered.number FROM (SELECT id, 1000 + ROW_NUMBER() "
         "OVER (PARTITION BY company_id ORDER BY id) AS number FROM orders) AS numbered "
         "WHERE orders.id = numbered.id AND orders.number IS NULL",
         add_column("staff", "role TEXT NOT NULL DEFAULT 'owner' CHECK "
                             "(role IN ('owner', 'staff', 'read-only'))")),
    # The company's time zone, in which its pages show times. Staff reset their passwords
    # by email (staff_tokens is new), and their requests are kept with no company. Two-step
    # sign-in: a staff account's key, and whether a company's owners must use one.
    13: (add_column("companies", "time_zone TEXT"), rebuild_table("account_requests"),
         add_column("companies", "two_step TEXT"), add_column("staff", "totp_secret TEXT"),
         add_column("staff", "totp_pending TEXT"), add_column("staff", "totp_step INTEGER")),
}


def tables_in_order():
    """The tables of schema.sql in the order it creates them (each after those it refers to)."""
    return [re.search(r"CREATE TABLE IF NOT EXISTS (\w+)", statement).group(1)
            for statement in schema_statements() if "CREATE TABLE" in statement]


def primary_key(table):
    """The primary key columns of a table of schema.sql, as an ORDER BY list."""
    statement = table_statement(table)
    match = (re.search(r"PRIMARY KEY \(([^)]*)\)", statement)
             or re.search(r"(\w+) +\w+ +PRIMARY KEY", statement))
    return match.group(1)


#: Rows a table's copy or digest reads at a time: memory stays bounded whatever it holds.
COPY_BATCH = 1000


def first_table_with_rows(conn):
    """The first table of schema.sql that holds a row, or None (an empty database)."""
    return next((table for table in tables_in_order()
                 if conn.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone() is not None),
                None)


def copy_table(source, target, table):
    """Every row of a table read through the source connection, in primary key order,
    inserted through the target's, a batch at a time; returns its columns as a SELECT
    lists them. By name, not by position: the two databases need not order their columns
    alike."""
    rows = source.execute(f"SELECT * FROM {table} ORDER BY {primary_key(table)}")
    columns = ", ".join(column[0] for column in rows.description)
    insert = (f"INSERT INTO {table} ({columns}) "
              f"VALUES ({', '.join(['?'] * len(rows.description))})")
    while batch := rows.fetchmany(COPY_BATCH):
        target.executemany(insert, [tuple(row) for row in batch])
    return columns


def table_digest(conn, table, columns):
    """{"rows", "sha256"} of a table's rows in primary key order, each as the repr() of its
    values: both engines read an integer as int, text as str, a BLOB (BYTEA) as bytes and a
    REAL (DOUBLE PRECISION) as float, so equal rows give equal text."""
    digest, count = hashlib.sha256(), 0
    rows = conn.execute(f"SELECT {columns} FROM {table} ORDER BY {primary_key(table)}")
    while batch := rows.fetchmany(COPY_BATCH):
        for row in batch:
            digest.update(repr(tuple(row)).encode() + b"\n")
        count += len(batch)
    return {"rows": count, "sha256": digest.hexdigest()}


# 2.2 Claimers --------------------------------------------------------------------------------
# Work that one process takes on (an outbox row, an Idempotency-Key in progress) is
# claimed in the database under that process's identity: host, pid and the start time the
# kernel gave the process, so that a pid reused by a newer process is not taken for the
# claimer. Another process on the same host can then tell at once that a claimer is gone.

def _host():
    """This host, and the pid namespace within it (containers may share a hostname)."""
    try:
        return f"{socket.gethostname()}:{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


_HOST = _host()
_identity = {}


def _proc_stat(pid):
    """(state, start time in clock ticks since boot) from /proc, or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the name in parentheses may hold spaces
    return fields[0].decode(), fields[19].decode()


def process_identity():
    """This process as a claimer: "host/pid/start" (start is "-" without /proc)."""
    pid = os.getpid()
    if pid not in _identity:  # computed after a fork too: the child is another claimer
        stat = _proc_stat(pid)
        _identity.clear()
        _identity[pid] = f"{_HOST}/{pid}/{stat[1] if stat else '-'}"
    return _identity[pid]


def claimer_alive(identity):
    """False only when the claimer is surely gone: it ran on this host and its pid is free, a
    zombie, or another process's. A claimer on another host counts as alive (its lease ends
    its claim)."""
    try:
        host, pid, start = identity.rsplit("/", 2)
        pid = int(pid)
    except ValueError:
        return True
    if host != _HOST:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start == "-":
        return True
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X") and stat[1] == start


# 2.3 Shared rate counters --------------------------------------------------------------------
# Rate limits are counted per fixed one-minute window. Every counter has hit(client, limit,
# now=None) -> (allowed, remaining, seconds until the window resets) and close().
# WindowCounter counts in this process only; SharedWindowCounter counts in a small
# memory-mapped file beside the database, shared by every process of this machine that serves
# it, so that a GET costs no database write; TableWindowCounter counts in a table of an engine
# with a server of its own.

class WindowCounter:
    """Requests per fixed one-minute window in this process. Only the current window's counts
    are kept, so memory is bounded by the clients seen in one minute."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self.lock = threading.Lock()
        self.window = None
        self.counts = {}

    def hit(self, client, limit, now=None):
        now = self.clock() if now is None else now
        window = int(now // 60)
        with self.lock:
            if window != self.window:
                self.window, self.counts = window, {}
            count = self.counts.get(client, 0) + 1
            self.counts[client] = count
        return count <= limit, max(0, limit - count), (window + 1) * 60 - now

    def close(self):
        """Nothing to release: the counts live and die with this process."""


@functools.lru_cache(maxsize=4096)  # for every request, of a few clients (keys, addresses)
def _client_digest(client):
    return hashlib.blake2b(client.encode(), digest_size=16).digest()


class SharedWindowCounter:
    """Requests per fixed one-minute window, counted in a file that every process mapping it
    shares: a fixed table of slots (16-byte hash of the client, window, count), found by
    linear probing from the hash and changed under an exclusive fcntl lock on the file. A
    slot of an older window is reused, so the table holds only the current minute's clients;
    should SLOTS of them not fit, a client that finds no slot is counted in this process."""

    SLOT = struct.Struct("<16sqq")
    SLOTS = 65536
    PROBES = 64

    #: fcntl locks belong to the process, not to a thread or a file descriptor (closing any
    #: descriptor of the file drops them all): the threads of a process take turns here.
    lock = threading.Lock()

    def __init__(self, path, clock=time.time):
        self.clock = clock
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = self.SLOT.size * self.SLOTS
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)  # sparse, zero-filled: every slot empty
        self.table = mmap.mmap(self.fd, size)
        self.overflow = WindowCounter(clock)

    def hit(self, client, limit, now=None):
        now = self.clock() if now is None else now
        window = int(now // 60)
        digest = _client_digest(client)
        with self.lock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                count = self._count(digest, window)
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)
        if count is None:
            return self.overflow.hit(client, limit, now)
        return count <= limit, max(0, limit - count), (window + 1) * 60 - now

    def _count(self, digest, window):
        """The client's count in this window after this hit, or None if no slot is free."""
        start, free = int.from_bytes(digest[:8], "little"), None
        for probe in range(self.PROBES):
            offset = (start + probe) % self.SLOTS * self.SLOT.size
            held, held_window, count = self.SLOT.unpack_from(self.table, offset)
            if held == digest:
                count = count + 1 if held_window == window else 1
                self.SLOT.pack_into(self.table, offset, digest, window, count)
                return count
            if free is None and held_window != window:
                free = offset
            if held_window == 0:  # never used: the client is not further along
                break
        if free is None:
            return None
        self.SLOT.pack_into(self.table, free, digest, window, 1)
        return 1

    def close(self):
        with self.lock:
            if not self.table.closed:
                self.table.close()
                os.close(self.fd)


class TableWindowCounter:
    """Requests per fixed one-minute window, counted in the rate_windows table of a database
    with a server of its own (PostgreSQL), which every process and machine serving it shares.
    Each hit is one upsert on a connection of the counter's own (one per thread) that does
    not wait for the disk at commit: a count lost to a crash costs at most one minute's
    accuracy."""

    def __init__(self, db, clock=time.time):
        self.db = db
        self.clock = clock
        self._local = threading.local()
        self.pruned = None

    def connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.broken:
            conn = self._local.conn = self.db.engine.connect(self.db.path, self.db.settings)
            conn.execute("SET synchronous_commit = off")
        return conn

    def hit(self, client, limit, now=None):
        now = self.clock() if now is None else now
        minute = int(now // 60)
        conn = self.connection()
        count = conn.execute(
            "INSERT INTO rate_windows (subject, minute, hits) VALUES (?, ?, 1) "
            "ON CONFLICT (subject, minute) DO UPDATE SET hits = rate_windows.hits + 1 "
            "RETURNING hits", (client, minute)).fetchone()[0]
        if self.pruned != minute:  # once a minute per process, the windows before the last
            self.pruned = minute
            conn.execute("DELETE FROM rate_windows WHERE minute < ?", (minute - 1,))
        return count <= limit, max(0, limit - count), (minute + 1) * 60 - now

    def close(self):
        """Close this thread's connection; another thread's closes when that thread ends."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


# 2.4 Engines ---------------------------------------------------------------------------------
# ordering's SQL is written once, in the dialect SQLite and PostgreSQL share, with SQLite's
# ? and :name parameters. The few places where they differ are the methods of these two
# classes and nothing else: connecting, the write lock, the schema version, the schema's
# types (in schema.sql and in migrations), a prefix range that ignores ASCII case, the
# JSON text of a record and of a list of records (see "Records as the database writes them"),
# the rate counter, housekeeping, and for the commands whether a database exists, whether two
# names are one database, and an online backup. A connection names its engine (conn.engine), so code
# that builds one of those expressions asks the connection it holds.
#
# Errors: what a PostgreSQL connection raises reaches callers as sqlite3.DatabaseError (a
# broken constraint as sqlite3.IntegrityError), the DB-API's names for a database's failure,
# so that one except clause serves both engines.

def engine_for(path):
    return POSTGRES if str(path).startswith(("postgresql://", "postgres://")) else SQLITE


def describe_db(settings):
    """The database as logs may show it (a URL without its password)."""
    return engine_for(settings.db_path).describe(settings.db_path)


def contains_folded(haystack, needle):
    return haystack is not None and needle in haystack.casefold()


class SqliteConnection(sqlite3.Connection):
    engine = None  # set below, once the engine exists
    broken = False


class SqliteEngine:
    #: WAL size in bytes beyond which housekeeping truncates it.
    WAL_TRUNCATE_BYTES = 16 * 1024 * 1024

    def connect(self, path, settings):
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                               timeout=settings.busy_timeout_ms / 1000,
                               factory=SqliteConnection)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA busy_timeout = {int(settings.busy_timeout_ms)}")
        conn.execute(f"PRAGMA synchronous = {settings.synchronous}")
        conn.create_function("contains_folded", 2, contains_folded, deterministic=True)
        return conn

    def writer_connection(self, path, settings):
        """The write connection: its savepoints keep the pages they change in memory. Every
        write() body is a savepoint (see _WriteTransaction), and SQLite otherwise moves a
        savepoint's pages to a temporary file past 64 KiB, which an order's writes reach:
        opening and writing that file cost a placement about a tenth of its time."""
        conn = self.connect(path, settings)
        conn.execute("PRAGMA temp_store = MEMORY")
        return conn

    def begin(self, conn):
        # IMMEDIATE takes the write lock now, not at the first write.
        conn.execute("BEGIN IMMEDIATE")

    def has_table(self, conn, table):
        return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                            (table,)).fetchone() is not None

    def schema_statements(self):
        return schema_statements()

    def translate(self, statement):
        return statement

    def schema_version(self, conn):
        return conn.execute("PRAGMA user_version").fetchone()[0]

    def set_schema_version(self, conn, version):
        conn.execute(f"PRAGMA user_version = {version}")

    def replace_check(self, conn, table, column, old, new):
        # SQLite's ALTER TABLE cannot change a CHECK; its documented way for a change that
        # leaves the file's format alone is to edit the table's text in the schema table.
        version = conn.execute("PRAGMA schema_version").fetchone()[0]
        conn.execute("PRAGMA writable_schema = ON")
        try:
            conn.execute("UPDATE sqlite_master SET sql = replace(sql, ?, ?) "
                         "WHERE type = 'table' AND name = ?", (old, new, table))
            conn.execute(f"PRAGMA schema_version = {version + 1}")
        finally:
            conn.execute("PRAGMA writable_schema = OFF")

    def prefix_ignoring_ascii_case(self, column):
        return f"{column} >= ? COLLATE NOCASE AND {column} < ? COLLATE NOCASE"

    def json_object(self, fields):
        """SQL for the JSON text of an object, written by SQLite's JSON functions (in C).
        fields: (key, SQL, kind), kind one of "value" (text, an integer or NULL), "money"
        (whole cents, written as money() writes them), "flag" (0 or 1: false or true) and
        "json" (a json_object() or json_array(), or NULL)."""
        values = {"value": "{}",
                  # SQLite writes a REAL to 15 digits: Python's text for money below 10^13
                  # (see EXACT_MONEY_CENTS)
                  "money": "CASE WHEN {0} % 100 = 0 THEN {0} / 100 ELSE {0} / 100.0 END",
                  # json() marks the text as JSON; of a constant, SQLite makes it once.
                  "flag": "CASE WHEN {} THEN json('true') ELSE json('false') END",
                  # a json_object() or json_array() is kept as JSON by the one around it
                  "json": "{}"}
        return "json_object(" + ", ".join(f"'{key}', " + values[kind].format(sql)
                                          for key, sql, kind in fields) + ")"

    def json_array(self, element, rows, order):
        """SQL for the JSON text of an array: element (a json_object() of the columns of rows,
        a SELECT) for each of rows, in the order of its column named order."""
        # An aggregate reads an ordered subquery in its order (it is never flattened into it).
        return f"(SELECT json_group_array({element}) FROM ({rows} ORDER BY {order}))"

    def rate_counter(self, db, settings, clock):
        if settings.shared_rate_limits and settings.db_path not in ("", ":memory:"):
            return SharedWindowCounter(settings.db_path + "-rates", clock)
        return WindowCounter(clock)

    def housekeeping(self, db):
        """Keep the WAL file bounded: under constant reads SQLite's automatic checkpoints
        never get to restart it, so it would grow without end; TRUNCATE waits for a gap
        between readers."""
        wal = db.path + "-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > self.WAL_TRUNCATE_BYTES:
            db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def describe(self, path):
        return path

    def exists(self, path):
        """Opening a file that is missing would create it: commands that only read ask first."""
        return os.path.isfile(path)

    def same_database(self, path, other):
        return engine_for(other) is self and os.path.realpath(path) == os.path.realpath(other)

    def backup(self, path, destination, settings):
        """An online, consistent copy of the file (SQLite's backup API), safe while a server
        writes to it; returns its page count and integrity check."""
        # Not through Database, which would create a missing file and migrate an old one;
        # mode=rw never creates the file, should it vanish after the caller's check.
        source = sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=rw",
                                 uri=True, timeout=settings.busy_timeout_ms / 1000)
        target = sqlite3.connect(destination)
        try:
            source.backup(target)
            pages = target.execute("PRAGMA page_count").fetchone()[0]
            check = target.execute("PRAGMA integrity_check").fetchone()[0]
        finally:
            target.close()
            source.close()
        return pages, check


class PostgresConnection:
    """A psycopg 3 connection in autocommit mode that ordering's code uses as it uses a
    sqlite3 one: execute() with ? or :name parameters returns the cursor, rows are read by
    position or by column name, in_transaction tells whether a transaction is open."""

    engine = None  # set below
    # psycopg's error class and idle transaction status, set when the engine first imports
    # psycopg (an optional dependency, imported only for a postgresql:// database)
    raw_errors = ()
    integrity_errors = ()  # psycopg's broken constraints: sqlite3.IntegrityError, as on SQLite
    idle = None

    def __init__(self, raw):
        self.raw = raw

    def execute(self, sql, params=()):
        try:
            return self.raw.execute(_postgres_sql(sql), _postgres_params(params))
        except self.raw_errors as error:
            raise self.error(error) from error

    def executemany(self, sql, rows):
        cursor = self.raw.cursor()
        try:
            cursor.executemany(_postgres_sql(sql), [_postgres_params(row) for row in rows])
        except self.raw_errors as error:
            raise self.error(error) from error
        return cursor

    def error(self, error):
        """psycopg's error as sqlite3's, so that code above Storage catches either engine's."""
        kind = sqlite3.IntegrityError if isinstance(error, self.integrity_errors) \
            else sqlite3.DatabaseError
        return kind(str(error).strip())

    @property
    def in_transaction(self):
        return self.raw.info.transaction_status != self.idle

    @property
    def broken(self):
        """The server closed the connection (a restart, a failover): open another."""
        return self.raw.closed or self.raw.broken

    def close(self):
        self.raw.close()


_POSTGRES_TOKENS = re.compile(r"'(?:[^']|'')*'|\?|(?<!:):([A-Za-z_]\w*)|%")


@functools.lru_cache(maxsize=2048)
def _postgres_sql(sql):
    """SQLite's ? and :name parameters as psycopg's %s and %(name)s (string literals kept)."""
    def token(match):
        text = match.group(0)
        if text == "?":
            return "%s"
        if text == "%":
            return "%%"
        return f"%({match.group(1)})s" if match.group(1) else text
    return _POSTGRES_TOKENS.sub(token, sql)


def _postgres_params(params):
    """PostgreSQL text cannot hold U+0000, which SQLite keeps: it becomes U+FFFD, so that a
    lookup by such a value finds nothing (no ID holds either) and stored text keeps its
    place (see docs/operations.md, PostgreSQL)."""
    if isinstance(params, dict):
        if any(isinstance(value, str) and "\x00" in value for value in params.values()):
            return {name: _without_nul(value) for name, value in params.items()}
    elif any(isinstance(value, str) and "\x00" in value for value in params):
        return [_without_nul(value) for value in params]
    return params


def _without_nul(value):
    return value.replace("\x00", "\ufffd") if isinstance(value, str) else value


class _PostgresRow(tuple):
    """A row as sqlite3.Row gives it: by position or by column name."""
    __slots__ = ()
    names = {}

    def __getitem__(self, key):
        if key.__class__ is str:
            key = self.names[key]
        return tuple.__getitem__(self, key)

    def keys(self):
        return list(self.names)


@functools.lru_cache(maxsize=1024)
def _postgres_row_class(names):
    return type("Row", (_PostgresRow,),
                {"__slots__": (), "names": {name: i for i, name in enumerate(names)}})


def _postgres_rows(cursor):
    if cursor.description is None:
        return tuple
    return _postgres_row_class(tuple(column.name for column in cursor.description))


class PostgresEngine:
    """PostgreSQL 14 or newer through psycopg 3 (pip install 'ordering[postgres]').

    Writers take one transaction-scoped advisory lock, so that writes are serialized across
    every process and machine as SQLite serializes them within a file: each rule that reads
    and then writes (stock, status moves, refund caps, idempotency claims, the outbox's
    claims) holds exactly as it does on SQLite, and no two writers can deadlock. Reads take
    no lock and run in parallel; group commit batches each process's writes under one lock
    and one commit. IDs and timestamps sort as on SQLite because every text column uses the
    "C" collation (bytes), whatever the database's locale."""

    #: pg_advisory_xact_lock key of the write lock ("orde" in ASCII).
    WRITE_LOCK = 0x6F726465

    def connect(self, path, settings):
        psycopg = self._psycopg()
        try:
            raw = psycopg.connect(path, autocommit=True, row_factory=_postgres_rows)
        except psycopg.Error as error:
            raise sqlite3.DatabaseError(str(error).strip()) from error
        raw.adapters.register_dumper(bool, self._bool_dumper)
        raw.adapters.register_loader("numeric", self._numeric_loader)
        return PostgresConnection(raw)

    #: Its savepoints need nothing of the write connection's own (see SqliteEngine's).
    writer_connection = connect

    @functools.cached_property
    def _bool_dumper(self):
        # The schema keeps flags as integers 0 and 1, as SQLite does.
        psycopg = self._psycopg()

        class BoolAsInteger(psycopg.adapt.Dumper):
            oid = psycopg.postgres.types["int8"].oid

            def dump(self, value):
                return b"1" if value else b"0"
        return BoolAsInteger

    @functools.cached_property
    def _numeric_loader(self):
        # SUM() of integers is numeric in PostgreSQL; ordering sums only whole cents.
        psycopg = self._psycopg()

        class NumericAsInteger(psycopg.adapt.Loader):
            def load(self, data):
                number = decimal.Decimal(bytes(data).decode())
                return int(number) if number == number.to_integral_value() else number
        return NumericAsInteger

    def _psycopg(self):
        try:
            import psycopg
        except ImportError:
            raise SystemExit("ordering: a postgresql:// database needs psycopg 3: "
                             "pip install 'ordering[postgres]'") from None
        PostgresConnection.raw_errors = psycopg.Error
        PostgresConnection.integrity_errors = psycopg.errors.IntegrityError
        PostgresConnection.idle = psycopg.pq.TransactionStatus.IDLE
        return psycopg

    def begin(self, conn):
        conn.execute("BEGIN")
        conn.execute(f"SELECT pg_advisory_xact_lock({self.WRITE_LOCK})")

    def has_table(self, conn, table):
        return conn.execute("SELECT to_regclass(?)", (table,)).fetchone()[0] is not None

    @functools.lru_cache(maxsize=1)
    def schema_statements(self):
        return [self.translate(statement) for statement in schema_statements()] + [
            "CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)",
            # Folded with the database's own locale (Unicode in a UTF-8 database).
            "CREATE OR REPLACE FUNCTION contains_folded(haystack TEXT, needle TEXT) "
            "RETURNS BOOLEAN LANGUAGE sql IMMUTABLE AS "
            "$$ SELECT strpos(lower(haystack COLLATE \"default\"), needle) > 0 $$"]

    #: schema.sql's SQLite types as PostgreSQL's: 64-bit integers (cents, milliseconds),
    #: text compared as bytes, and the ASCII-case-folded index of the PO number search.
    SCHEMA_TYPES = (
        (r"\bINTEGER\b", "BIGINT"),
        (r"\bREAL\b", "DOUBLE PRECISION"),
        (r"\bBLOB\b", "BYTEA"),
        (r"\bTEXT\b", 'TEXT COLLATE "C"'),
        (r"\)\s*WITHOUT ROWID", ")"),
        (r"(\w+) COLLATE NOCASE", r"lower(\1)"),
    )

    def translate(self, statement):
        """A statement of schema.sql or of a migration, in PostgreSQL's types."""
        for pattern, replacement in self.SCHEMA_TYPES:
            statement = re.sub(pattern, replacement, statement)
        return statement

    def schema_version(self, conn):
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        return row[0] if row else 0

    def set_schema_version(self, conn, version):
        conn.execute("DELETE FROM schema_version")
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))

    def replace_check(self, conn, table, column, old, new):
        # A column's CHECK is the constraint PostgreSQL named after its table and column.
        name = f"{table}_{column}_check"
        conn.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {name}, "
                     f"ADD CONSTRAINT {name} {new}")

    def prefix_ignoring_ascii_case(self, column):
        # lower() of a "C" collated column folds ASCII only, as SQLite's NOCASE does.
        return f"lower({column}) >= lower(?) AND lower({column}) < lower(?)"

    def json_object(self, fields):
        """As SqliteEngine.json_object, written as text: PostgreSQL's json_build_object puts
        spaces around its colons and commas, which the API's JSON has not; to_json() escapes
        text as Python's encoder does."""
        values = {"value": "coalesce(to_json({})::text, 'null')",
                  # the exact decimal without trailing zeros: Python's text below 10^13
                  "money": "CASE WHEN {0} % 100 = 0 THEN CAST({0} / 100 AS TEXT) ELSE "
                           "CAST({0} / 100 AS TEXT) || '.' || "
                           "rtrim(substr(CAST(100 + {0} % 100 AS TEXT), 2), '0') END",
                  "flag": "CASE WHEN {} <> 0 THEN 'true' ELSE 'false' END",
                  "json": "coalesce({}, 'null')"}
        return "'{' || " + " || ',' || ".join(f"'\"{key}\":' || " + values[kind].format(sql)
                                               for key, sql, kind in fields) + " || '}'"

    def json_array(self, element, rows, order):
        """As SqliteEngine.json_array."""
        return (f"(SELECT '[' || coalesce(string_agg({element}, ',' ORDER BY {order}), '') "
                f"|| ']' FROM ({rows}) AS elements)")

    def rate_counter(self, db, settings, clock):
        if settings.shared_rate_limits:
            return TableWindowCounter(db, clock)
        return WindowCounter(clock)

    def housekeeping(self, db):
        """Nothing: the server keeps its own write-ahead log in check."""

    def exists(self, path):
        """A server's database cannot be created by opening it: it exists or fails to open."""
        return True

    #: No copy of its own: the server's tools (pg_dump) make one.
    backup = None

    def same_database(self, path, other):
        return path == other

    def describe(self, path):
        """The URL without its password, for logs."""
        parts = urllib.parse.urlsplit(path)
        if parts.password is None:
            return path
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


SQLITE = SqliteConnection.engine = SqliteEngine()
POSTGRES = PostgresConnection.engine = PostgresEngine()


# 2.5 The database and its write transaction --------------------------------------------------

class Database:
    """One database, SQLite or PostgreSQL (see Engines below): a read connection per thread,
    and write() for every transaction that writes, on one write connection shared by the
    process's writers.

    Group commit. With durable commits every commit waits for the disk, so writers that
    arrive while the write connection is busy queue up and then share one transaction and one
    commit: each write() body runs, one at a time and in the caller's own thread, in a
    SAVEPOINT of its own; the last body to finish with nobody queued behind it commits the
    batch. A body that raises rolls back only its savepoint, and no write() returns before
    the commit that holds its work has completed (so no response is sent before its data is
    on disk). If that commit fails, every body of the batch fails with it.

    Connections run in autocommit mode so that write() alone decides where a transaction
    begins (the engine's begin() takes the database's write lock up front: a read-then-write
    such as a stock check can then never be overtaken by another writer or process) and
    where it ends.
    """

    def __init__(self, path, settings=None):
        self.path = path
        self.settings = settings or Settings(db_path=path)
        self.engine = engine_for(path)
        self._local = threading.local()
        self._listeners = []
        #: Commits made on the write connection; each holds one or more write() bodies.
        self.commits = 0
        self._writer = None
        # Writers of this process queue on the condition _turn rather than in the engine's
        # lock wait (SQLite's busy handler sleeps in growing steps and turns lock contention
        # into long tails); bodies whose work waits for its commit wait on _done. Two
        # conditions on one lock, so that handing the connection on wakes one writer, not
        # every thread that waits for anything.
        lock = threading.Lock()
        self._turn = threading.Condition(lock)
        self._done = threading.Condition(lock)
        self._busy = False    # a body or a commit is using the write connection
        self._queued = 0      # writers waiting for the write connection
        self._batch = None    # the batch whose transaction is open, if any
        with self.write() as conn:
            apply_schema(conn)

    def connect(self):
        return self.engine.connect(self.path, self.settings)

    @property
    def conn(self):
        """This thread's connection, for reads outside a transaction."""
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.broken:
            conn = self._local.conn = self.connect()
        return conn

    def write(self):
        """A transaction for the body of a with statement, which gets the connection:
        ``with db.write() as conn: ...``. Raising in the body rolls back only its work."""
        return _WriteTransaction(self)

    def ping(self):
        """Read from the database (raises when it does not answer)."""
        self.conn.execute("SELECT COUNT(*) FROM companies LIMIT 1").fetchone()

    def on_commit(self, listener):
        """Call listener(event_ids) after each commit that emitted events."""
        self._listeners.append(listener)

    def close(self):
        """Close this thread's read connection, and the write connection when no write is in
        progress (it opens again on the next write)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
        with self._turn:
            if self._writer is not None and not self._busy and self._batch is None:
                self._writer.close()
                self._writer = None

    def _commit(self, conn):
        conn.execute("COMMIT")
        self.commits += 1


class _Batch:
    """The write() bodies sharing one transaction."""

    def __init__(self):
        self.bodies = 0       # bodies run in it, kept or rolled back
        self.kept = 0         # bodies whose work it holds
        self.done = False
        self.error = None     # why its commit failed


#: Bodies one batch takes at most, so that a stream of writers cannot postpone its commit.
GROUP_COMMIT_LIMIT = 64


class _WriteTransaction:
    def __init__(self, db):
        self.db = db
        self.batch = None

    def __enter__(self):
        db = self.db
        with db._turn:
            db._queued += 1
            while db._busy:
                db._turn.wait()
            db._queued -= 1
            db._busy = True
            if db._batch is None:
                db._batch = _Batch()
            self.batch = db._batch
        try:
            if db._writer is None or db._writer.broken:
                db._writer = db.engine.writer_connection(db.path, db.settings)
            if not db._writer.in_transaction:
                db.engine.begin(db._writer)
            db._writer.execute("SAVEPOINT write_body")
        except BaseException:
            self._finish(kept=False)
            raise
        _emitted.event_ids = []
        return db._writer

    def __exit__(self, kind, error, tb):
        conn, batch = self.db._writer, self.batch
        emitted, _emitted.event_ids = _emitted.event_ids, None
        kept = kind is None
        try:
            if kept:
                conn.execute("RELEASE write_body")
            elif conn.in_transaction:  # some errors (a full disk) end the transaction already
                conn.execute("ROLLBACK TO write_body")
                conn.execute("RELEASE write_body")
        except BaseException:
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            finally:
                self._finish(kept=False)
            raise
        self._finish(kept)
        if not kept:
            return False
        with self.db._done:
            while not batch.done:
                self.db._done.wait()
        if batch.error is not None:
            raise type(batch.error)(*batch.error.args) from batch.error
        if emitted:
            for listener in self.db._listeners:
                listener(emitted)
        return False

    def _finish(self, kept):
        """Hand the write connection to the next queued writer, or commit the batch when
        nobody is queued (or the batch is full, or its transaction has ended early)."""
        db, batch = self.db, self.batch
        alive = db._writer is not None and db._writer.in_transaction
        with db._turn:
            batch.bodies += 1
            batch.kept += kept
            if alive and db._queued and batch.bodies < GROUP_COMMIT_LIMIT:
                db._busy = False
                db._turn.notify()
                return
        error = None
        try:
            if not alive:
                error = sqlite3.OperationalError(
                    "the transaction was rolled back before its commit")
            elif batch.kept:
                db._commit(db._writer)
            else:
                db._writer.execute("ROLLBACK")
        except sqlite3.Error as failure:
            error = failure
            if db._writer.in_transaction:
                db._writer.execute("ROLLBACK")
        finally:
            with db._turn:
                batch.error, batch.done = error, True
                db._batch = None
                db._busy = False
                db._done.notify_all()
                db._turn.notify()


@contextlib.contextmanager
def savepoint(conn):
    """A part of the open transaction that is undone alone when its body raises."""
    conn.execute("SAVEPOINT part")
    try:
        yield conn
    except BaseException:
        if conn.in_transaction:  # some errors (a full disk) end the transaction already
            conn.execute("ROLLBACK TO part")
            conn.execute("RELEASE part")
        raise
    conn.execute("RELEASE part")


#: Event IDs emitted by the transaction open on this thread (see emit()).
_emitted = threading.local()


def announce(outbox_id):
    """Count an outbox row (an event, an email) among the IDs the open transaction emitted:
    after its commit the outbox looks for work at once, and an operator command sends it
    before it exits."""
    pending = getattr(_emitted, "event_ids", None)
    if pending is not None:
        pending.append(outbox_id)


# ---------------------------------------------------------------------------------------------
# 3. Values
# ---------------------------------------------------------------------------------------------

_id_lock = threading.Lock()
_id_last = [0, 0]


def new_id(prefix):
    """An opaque ID: 48 bits of milliseconds, then 72 bits of randomness that increase within
    one millisecond, in lower-case hex: IDs made in order sort in order, and records sorted by
    (createdAt, id) sort exactly as they were made in this process."""
    with _id_lock:
        ms = max(int(time.time() * 1000), _id_last[0])
        tail = _id_last[1] + 1 if ms == _id_last[0] else secrets.randbits(71)
        _id_last[0], _id_last[1] = ms, tail
    return f"{prefix}_{ms:012x}{tail:018x}"


def new_id_at(prefix):
    """A new ID and the creation time it encodes (ISO text)."""
    made = new_id(prefix)
    return made, iso(int(made[len(prefix) + 1:len(prefix) + 13], 16))


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


MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


@functools.cache
def time_zones():
    """The IANA names of the places this machine's time zone database knows (the system's
    tzdata; without one, UTC alone): Region/City, without the database's aliases of old
    (US/..., SystemV/...), its fixed offsets (Etc/GMT+5 is five hours behind, against
    reading) and the server's own "localtime"."""
    return frozenset(zone for zone in zoneinfo.available_timezones() if "/" in zone and
                     not zone.startswith(("Etc/", "US/", "SystemV/", "posix", "right/"))
                     ) | {"UTC"}


@functools.lru_cache(maxsize=256)
def zone_of(name):
    """A time zone by its IANA name; None is UTC (the default of every company)."""
    return datetime.timezone.utc if name in (None, "UTC") else zoneinfo.ZoneInfo(name)


def day_text(day):
    """A calendar day (ISO, or the day of an ISO timestamp) as pages write it: 26 Nov 2026.
    The books' days (an invoice's issue and due dates, a statement's lines) are UTC days."""
    year, month, day = day[:10].split("-")
    return f"{int(day)} {MONTHS[int(month) - 1]} {year}"


def local_moment(timestamp, zone):
    """An ISO timestamp in a company's time zone (an IANA name; None is UTC), a datetime."""
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).astimezone(
        zone_of(zone))


def local_time_text(timestamp, zone):
    """An ISO timestamp as pages write it, in a company's time zone: 26 Nov 2026, 15:05 CET."""
    moment = local_moment(timestamp, zone)
    return (f"{day_text(moment.date().isoformat())}, {moment.hour:02d}:{moment.minute:02d} "
            f"{moment.tzname()}")


def exact_time_text(timestamp):
    """An ISO timestamp to the millisecond, as a page's hover shows it: 2026-11-26
    14:05:07.123 UTC."""
    return timestamp[:23].replace("T", " ") + " UTC"


def money(cents):
    """Integer cents to the JSON number the API shows, as JSON.stringify writes it: 12.5 for
    1250, 45 for 4500."""
    if cents is None:
        return None
    return cents // 100 if cents % 100 == 0 else cents / 100


class JsonFloat(float):
    """A JSON number written with a fraction or an exponent: a float to every rule but money,
    which reads its exact decimal text (a double cannot tell 20000.005 from 20000.00500001)."""

    __slots__ = ("text",)

    def __new__(cls, text):
        number = super().__new__(cls, text)
        number.text = text
        return number


_CENT = decimal.Decimal("0.01")


def cents_from_number(value):
    """A number to integer cents, exactly; None when it is not a whole number of cents.

    JSON numbers are read from their text; a float from Python code by its shortest repr
    (0.1 is 0.1, not the double nearest to it). The caller checks the range first."""
    if isinstance(value, float):
        value = getattr(value, "text", None) or repr(value)
    exact = decimal.Decimal(value)
    cents = exact.quantize(_CENT)
    if cents != exact:
        return None
    return int(cents.scaleb(2))


def exact_rate(rate):
    """A tax rate (a fraction, stored as a double) as the decimal it was written as: 0.0825,
    not the double nearest to it."""
    return decimal.Decimal(getattr(rate, "text", None) or repr(float(rate or 0)))


def tax_cents(subtotal_cents, rate):
    """The tax on an order's subtotal at rate, rounded once for the whole order, half up to
    a cent (docs/billing.md)."""
    return int((subtotal_cents * exact_rate(rate)).quantize(1, decimal.ROUND_HALF_UP))


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
    r"(?P<zone>Z|[+-]\d{2}:?\d{2})?)?", re.ASCII)
#: What js_parse_date strips around a date (the ASCII whitespace of DATE_PATTERN).
_DATE_SPACE = " \t\n\v\f\r"
_DAY = ("((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
        "|02-(0[1-9]|1[0-9]|2[0-8]))")
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)"
#: Exactly the texts js_parse_date reads, or the empty text (a parameter given empty is
#: ignored), as a regular expression in the syntax Python and ECMA-262 share: the OpenAPI
#: document publishes it for since and until.
DATE_PATTERN = (
    rf"^([\t\n\v\f\r ]*(?!0000)({_LEAP_YEAR}-02-29|[0-9]{{4}}(-(0[1-9]|1[0-2])|-{_DAY})?)"
    r"([T ]([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]+)?)?"
    r"(Z|[+-]([01][0-9]|2[0-3]):?[0-5][0-9])?)?[\t\n\v\f\r ]*)?$")
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
#: Bounds of the dates stored (years 1 to 9999), as epoch milliseconds.
_FIRST_MS = (datetime.datetime(1, 1, 1, tzinfo=datetime.timezone.utc) - _EPOCH) \
    // datetime.timedelta(milliseconds=1)
_LAST_MS = (datetime.datetime.max.replace(tzinfo=datetime.timezone.utc) - _EPOCH) \
    // datetime.timedelta(milliseconds=1)


def js_parse_date(text):
    """The ISO forms a JavaScript Date parser accepts, as epoch milliseconds, or None.

    A date alone is UTC midnight, as in JavaScript. A date-time without an offset is read as
    UTC too (JavaScript would use the server's local zone, which would make results depend on
    where the server runs).
    """
    match = _DATE_FORMS.fullmatch((text or "").strip(_DATE_SPACE))
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
    ms = (moment - _EPOCH) // datetime.timedelta(milliseconds=1)
    zone = part["zone"]
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        hours, minutes = int(zone[1:3]), int(zone[-2:])
        if hours > 23 or minutes > 59:
            return None
        ms -= sign * (hours * 60 + minutes) * 60_000
    # An offset can carry a date just past year 1 or 9999; no stored date is beyond either,
    # so the nearest bound compares the same (and stays a four-digit year in text).
    return min(max(ms, _FIRST_MS), _LAST_MS)


@functools.lru_cache(maxsize=4096)  # parsed for every request, from few distinct addresses
def client_ip(text):
    """A client's address as an IP address in text, or "-" when it is not one: a forwarded
    header that a proxy let through unchecked must not become a log line or a rate-limit
    client of the sender's choosing."""
    try:
        return str(ipaddress.ip_address((text or "").strip()))
    except ValueError:
        return "-"


def moment_text(text):
    """A date or date-time as the operator or staff wrote it, as stored ISO text, or None."""
    ms = js_parse_date(text)
    return None if ms is None else iso(ms)


def hash_key(key):
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


#: scrypt cost (16 MiB of memory and some 50 ms per hash); the salt is the account's own.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2 ** 14, 8, 1


def hash_password(password, salt=None):
    """The one password scheme of every kind of account: scrypt with a salt of its own."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode("utf-8"), salt=salt, n=SCRYPT_N, r=SCRYPT_R,
                            p=SCRYPT_P, dklen=32)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${digest.hex()}"


def password_matches(password, stored):
    """Whether password is the one stored. Anything but a scrypt hash matches nothing: a
    customer's hash from an earlier release (PBKDF2, which nothing ever read) is no password,
    and its customer sets one through the storefront's reset flow (see docs/storefront.md)."""
    if not stored or not stored.startswith("scrypt$"):
        # The same work as a real hash, or a stranger could tell such accounts by the time.
        password_matches(password, _stand_in_hash())
        return False
    _, n, r, p, salt, digest = stored.split("$")
    candidate = hashlib.scrypt(password.encode("utf-8"), salt=bytes.fromhex(salt), n=int(n),
                               r=int(r), p=int(p), dklen=len(digest) // 2)
    return hmac.compare_digest(candidate.hex(), digest)


#: Time-based one-time passwords (RFC 6238, as authenticator apps make them): HMAC-SHA1 of
#: the 30-second step since the epoch, 6 digits.
TOTP_PERIOD, TOTP_DIGITS = 30, 6


def recovery_code_key(code):
    """What is kept of a recovery code, and looked up for one typed: its hash, as written
    with or without its hyphen, spaces or capitals."""
    return hash_key(re.sub(r"[\s-]", "", code or "").lower())


def new_totp_secret():
    """A new shared key: 160 random bits, in base32 as authenticator apps take it."""
    return base64.b32encode(secrets.token_bytes(20)).decode("ascii")


def totp_code(secret, step):
    """The code of a key (base32) for one time step."""
    digest = hmac.new(base64.b32decode(secret), struct.pack(">Q", step), hashlib.sha1).digest()
    offset = digest[-1] & 0x0F
    number = struct.unpack(">I", digest[offset:offset + 4])[0] & 0x7FFFFFFF
    return str(number % 10 ** TOTP_DIGITS).zfill(TOTP_DIGITS)


def totp_step(secret, code, now_ms, after=-1):
    """The time step whose code this is (the current one, or one either side of it, for a
    clock a little off), if that step is later than after (a code works once); else None."""
    code = re.sub(r"\s", "", code or "")
    now_step = now_ms // 1000 // TOTP_PERIOD
    for step in (now_step - 1, now_step, now_step + 1):
        if step > after and hmac.compare_digest(totp_code(secret, step), code):
            return step
    return None


def totp_uri(staff, issuer):
    """The key as the otpauth:// link authenticator apps take (label: issuer and email)."""
    label = urllib.parse.quote(f"{issuer}:{staff['email']}")
    return (f"otpauth://totp/{label}?secret={staff['totp_pending']}&issuer="
            f"{urllib.parse.quote(issuer)}&digits={TOTP_DIGITS}&period={TOTP_PERIOD}")


@functools.lru_cache(maxsize=1)
def _stand_in_hash():
    """Checked against when no account has the email, or its account no hash of this scheme,
    so that either takes as long to refuse as a wrong password."""
    return hash_password(secrets.token_urlsafe(16))


# Built once: json.dumps with options makes a new encoder per call. The API's values are trees
# of plain dicts and lists, so the circular-reference bookkeeping is skipped too.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                         check_circular=False)


class JsonText(str):
    """JSON already written (by the database: see "Records as the database writes them"),
    which json_text() passes on as it is."""

    __slots__ = ()


def json_text(value):
    if value.__class__ is JsonText:
        return value
    return _JSON.encode(value)


def json_envelope(data, pagination=None):
    """The API's {"data": ...} (and "pagination") around JSON text already written: one
    record's, or a list of records'."""
    data = data if isinstance(data, str) else "[" + ",".join(data) + "]"
    if pagination is None:
        return JsonText('{"data":' + data + "}")
    return JsonText('{"data":' + data + ',"pagination":' + _JSON.encode(pagination) + "}")


# 3.1 Currencies ------------------------------------------------------------------------------
# Stripe counts an amount in its currency's minor unit, and not every currency has two
# decimals. The lists are Stripe's published ones (docs.stripe.com/currencies); every other
# currency has two in Stripe's amounts, its special cases ISK, HUF and TWD included.

#: Decimal places of the currencies whose minor unit is not a hundredth, by lower-case code.
CURRENCY_DECIMALS = {
    **dict.fromkeys(("bif", "clp", "djf", "gnf", "jpy", "kmf", "krw", "mga", "pyg", "rwf", "ugx",
                     "vnd", "vuv", "xaf", "xof", "xpf"), 0),
    **dict.fromkeys(("bhd", "jod", "kwd", "omr", "tnd"), 3),
}


def currency_decimals(currency):
    return CURRENCY_DECIMALS.get(currency, 2)


def money_in(amount, currency):
    """An amount in the currency's minor unit to the JSON number the API shows, as money() does
    for cents: 1250 usd is 12.5, 1200 jpy is 1200, 12345 kwd is 12.345. The true division of
    two integers gives the double nearest the exact amount, whose shortest text (the one JSON
    writes) is that amount's decimals for every amount below 10**15 minor units."""
    scale = 10 ** currency_decimals(currency)
    return amount // scale if amount % scale == 0 else amount / scale


def minor_units_from_text(text, currency):
    """'12.345' in kwd to 12345, for the command line; None when the text is not a plain
    amount or has more decimals than the currency."""
    match = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", text or "")
    decimals = currency_decimals(currency)
    if not match or len(match.group(2) or "") > decimals:
        return None
    return int(match.group(1) + (match.group(2) or "").ljust(decimals, "0"))


# ---------------------------------------------------------------------------------------------
# 4. Text and markup
# ---------------------------------------------------------------------------------------------
# HTML is built from the templates below through render(), which escapes every value that is
# not markup already. Pages and messages of every surface use them; no script is served.

class Markup(str):
    """Text that is HTML already; anything else is escaped on its way into a template."""


_NEEDS_ESCAPING = re.compile(r"[&<>\"']")


def escaped_text(value):
    """value as text HTML may hold: Markup as it is, anything else escaped (most text needs
    nothing, which one search finds faster than html.escape's five replacements)."""
    if type(value) is not str:  # most values are plain text: one test for them
        if isinstance(value, Markup):
            return value
        value = "" if value is None else str(value)
    return html.escape(value, quote=True) if _NEEDS_ESCAPING.search(value) else value


def escape(value):
    return value if isinstance(value, Markup) else Markup(escaped_text(value))


class Template:
    """Markup with {placeholders}, each one declared: a template whose text and declared names
    differ stops the module from loading, and render() refuses a value missing or too many,
    so that a misspelt placeholder fails the tests rather than a request."""

    def __init__(self, names, text):
        self.names = frozenset(names.split())
        #: (literal text, the placeholder after it or None), as render_rows fills them in.
        self.pieces = [(text, name) for text, name, _, _ in string.Formatter().parse(text)]
        found = {name for _, name in self.pieces if name is not None}
        if found != self.names:
            raise ValueError(f"template declares {sorted(self.names)} but holds {sorted(found)}")
        self.text = text

    def partial(self, **values):
        """This template with some placeholders filled, the rest still to fill: for markup
        repeated on every row of a long page where one value changes (the rest are escaped,
        and their braces kept literal, once)."""
        rest = self.names - set(values)
        filled = {name: str(escape(value)).replace("{", "{{").replace("}", "}}")
                  for name, value in values.items()}
        return Template(" ".join(sorted(rest)),
                        self.text.format(**filled, **{name: "{" + name + "}" for name in rest}))


def render(template, **values):
    """template (a Template, or a short piece of markup written where it is used) with every
    value escaped that is not Markup already."""
    if isinstance(template, Template):
        if values.keys() != template.names:
            raise TypeError(f"template takes {sorted(template.names)}, not {sorted(values)}")
        template = template.text
    return Markup(template.format(**{name: escaped_text(value)
                                     for name, value in values.items()}))


def render_rows(rows, **values):
    """Rows made by Template.partial with all but the values every row of a page shares (a
    form's token), so that a row can be kept from one page to the next: their markup, those
    values filled in."""
    if any(row.names != values.keys() for row in rows):
        raise TypeError(f"rows take {sorted(rows[0].names)}, not {sorted(values)}")
    # Piece by piece, as the page's rows are long and format() would read them all again.
    filled = {name: escaped_text(value) for name, value in values.items()} | {None: ""}
    return Markup("".join(text + filled[name] for row in rows for text, name in row.pieces))


class Kept:
    """Markup kept from one page to the next under a key of everything that makes it, at most
    `most` of them (forgotten together when full): for rows a long page renders again and
    again. Each thread may make a missing one; the last made is kept."""

    def __init__(self, most):
        self.most = most
        self.kept = {}

    def get(self, key, make):
        found = self.kept.get(key)
        if found is None:
            if len(self.kept) >= self.most:
                self.kept.clear()
            found = self.kept[key] = make()
        return found


def join(pieces):
    return Markup("".join(escape(piece) for piece in pieces))


def amount_text(number):
    return "" if number is None else f"{number:,.2f}"


def cents_text(cents):
    return amount_text(money(cents))


def decimal_text(cents):
    """Cents as a form field holds an amount: 1234.50."""
    return f"{cents // 100}.{cents % 100:02d}"


def rate_text(rate):
    """A tax rate as a page shows it: 0.0825 as 8.25%."""
    return f"{(exact_rate(rate) * 100).normalize():f}%"


def rate_field_text(rate):
    """A tax rate as a form field holds it: 0.0825, 0 (not 0.0)."""
    return f"{exact_rate(rate).normalize():f}"


def terms_text(days):
    """Payment terms as a page shows them: due on receipt, net 30 days."""
    return f"net {days} days" if days else "due on receipt"


def minor_amount_text(amount, currency):
    """An amount in its currency's minor unit, as a page shows it: 1,200 JPY, 12.345 KWD."""
    decimals = currency_decimals(currency)
    return f"{decimal.Decimal(amount).scaleb(-decimals):,.{decimals}f} {currency.upper()}"
_LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]+")


def one_line(value):
    """A value as one line of text: control characters (CR and LF among them) become spaces."""
    return _LINE_BREAKS.sub(" ", "" if value is None else str(value)).strip()


# 4.1 The page kit ----------------------------------------------------------------------------
# What every surface's pages are made of; the pages' own templates follow the email's (4.3,
# 4.4). A page function fills them: no markup is written below this section (a test).

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · {site}</title>
<link rel="stylesheet" href="{prefix}/style.css">
</head>
<body>
<a class="skip" href="#main">Skip to content</a>
<header>{header}</header>
<main id="main">
<h1>{title}</h1>
{notice}{body}
</main>
</body>
</html>
"""
#: A page of a surface, for a signed-in visitor (header: navigation and sign-out).
LAYOUT = Template("prefix title site header notice body", _PAGE)
#: A page for a visitor who is not signed in.
BARE_LAYOUT = Template("prefix title site notice body", _PAGE.replace("<header>{header}</header>\n", ""))

HEADER = Template("company links prefix csrf email", """\
<nav aria-label="Sections"><strong class="brand">{company}</strong><ul>{links}</ul></nav>
<form class="account" method="post" action="{prefix}/sign-out">{csrf}\
<a href="{prefix}/account" title="Your account">{email}</a>
<button type="submit">Sign out</button></form>""")

#: A field of a form for a visitor who is not signed in (sign in, register, reset).
SIGNED_OUT_FIELD = Template("name label kind auto value invalid error", """\
<div><label for="{name}">{label}</label><input id="{name}" name="{name}" type="{kind}" \
autocomplete="{auto}" value="{value}"{invalid}>{error}</div>""")
#: The dashboard's way on from its sign-in form.
SIGN_IN_LINKS = Template("prefix", """\
<p class="narrow"><a href="{prefix}/reset">Forgot your password?</a></p>""")
#: What a signed-out form that sends an email answers, whoever the address belongs to.
MAIL_SENT = Template("what then", """\
<div class="card narrow" role="status"><p>A message is on its way to the address you gave \
{what}. It may take a few minutes; look in your spam folder too, and check the address if \
nothing comes.</p>{then}</div>""")
#: Where a dashboard's "Check your email" leads on.
BACK_TO_SIGN_IN = Template("prefix", '<p><a href="{prefix}/sign-in">Back to sign in</a></p>')

SIGNED_OUT = Template("prefix", """\
<p class="card narrow">Your session has ended. <a href="{prefix}/sign-in">Sign in again</a>.</p>""")
#: Where signing out leads: the visitor's own sign-out, said so.
SIGNED_OUT_BY_YOU = Template("prefix", """\
<p class="card narrow" role="status">You have signed out. <a href="{prefix}/sign-in">Sign in \
again</a>.</p>""")

#: A link of the header's navigation (current: CURRENT on the page it leads to).
NAV_LINK = Template("href current text", '<li><a href="{href}"{current}>{text}</a></li>')
CURRENT = Markup(' aria-current="page"')
#: What a page says once a form is saved (or a link emailed), above its body.
NOTICE = Template("message", '<div class="notice" role="status">{message}</div>')
#: Why a form was not saved, above its body, when no field it shows has the message; or
#: what a change could not do.
FORM_ALERT = Template("message", '<div class="alert" role="alert">{message}</div>')
#: A page's refusal, alone on it (not found, refused, too many requests).
ALERT = Template("message", '<p class="alert" role="alert">{message}</p>')
#: A refused field's message, under the field, which names it (FIELD_INVALID) as what
#: describes it; the page's ERROR_SUMMARY is the alert that lists every one.
FIELD_ERROR = Template("id message", '<p class="error" id="{id}-error">{message}</p>')
FIELD_INVALID = Template("id", ' aria-invalid="true" aria-describedby="{id}-error"')
#: Every refused field of a form, above it, each linked to its field (label: message).
ERROR_SUMMARY = Template("items", """\
<div class="alert" role="alert"><p>Please correct these, then send the form again:</p>\
<ul>{items}</ul></div>""")
ERROR_SUMMARY_ITEM = Template("id label message",
                              '<li><a href="#{id}">{label}</a>: {message}</li>')

#: A labelled form field: control is INPUT, TEXTAREA or SELECT.
FIELD = Template("id label control error",
                 '<div><label for="{id}">{label}</label>{control}{error}</div>')
INPUT = Template("id name kind value extra",
                 '<input id="{id}" name="{name}" type="{kind}" value="{value}"{extra}>')
TEXTAREA = Template("id name extra value",
                    '<textarea id="{id}" name="{name}"{extra}>{value}</textarea>')
SELECT = Template("id name extra options",
                  '<select id="{id}" name="{name}"{extra}>{options}</select>')
OPTION = Template("value selected text", '<option value="{value}"{selected}>{text}</option>')
#: One more attribute of a field (min, maxlength, autocomplete ...).
ATTRIBUTE = Template("name value", ' {name}="{value}"')
SELECTED, CHECKED = Markup(" selected"), Markup(" checked")
#: Fields that one message may refuse together (a return's lines), under their legend.
GROUP = Template("id legend invalid fields error",
                 '<fieldset id="{id}"{invalid}><legend>{legend}</legend>{fields}{error}</fieldset>')
#: One of a choice of radio buttons (see Visit.radios).
RADIO = Template("id name value checked text", '<label class="check" for="{id}"><input '
                 'type="radio" id="{id}" name="{name}" value="{value}"{checked}> {text}</label>')
#: Checkboxes of one name, one for each of its values.
CHECKS = Template("name invalid boxes error",
                  '<fieldset id="{name}"{invalid}><legend>{name}</legend>{boxes}{error}</fieldset>')
CHECK = Template("name value checked", '<label class="check"><input type="checkbox" '
                 'name="{name}" value="{value}"{checked}> {value}</label>')
#: The one checkbox of a form that sends isActive=on.
ACTIVE_CHECK = Template("checked", '<label class="check"><input type="checkbox" '
                        'name="isActive" value="on"{checked}> Active</label>')
HIDDEN = Template("name value", '<input type="hidden" name="{name}" value="{value}">')
#: A form that changes something (enctype: MULTIPART for one that may carry a file).
FORM = Template("css action enctype csrf body",
                '<form class="{css}" method="post" action="{action}"{enctype}>'
                '<input type="hidden" name="csrf" value="{csrf}">{body}</form>')
MULTIPART = Markup(' enctype="multipart/form-data"')
SUBMIT = Template("text", '<button type="submit">{text}</button>')
#: A form's submit button on a line of its own, below its fields.
SAVE = Template("text", '<div><button type="submit">{text}</button></div>')
#: A form that is one button (Visit.button), styled: "secondary", "danger" or "".
BUTTON = Template("css text", '<button type="submit" class="{css}">{text}</button>')
#: A search or filter form (GET): its fields, then the button and a link that clears them.
FILTERS = Template("path fields button",
                   '<form class="card filters" method="get" action="{path}">{fields}<div>'
                   '<button type="submit">{button}</button> <a href="{path}">Clear</a></div>'
                   '</form>')
PAGE_LINKS = Template("links", '<nav class="pager" aria-label="Pages">{links}</nav>')
NEXT_PAGE = Template("path query",
                     '<p class="pager"><a class="button" href="{path}?{query}">Next page</a></p>')
NEW_RECORD = Template("path noun", '<p><a class="button" href="{path}/new">New {noun}</a></p>')

TABLE = Template("head body", '<div class="table-wrap"><table><thead><tr>{head}</tr></thead>'
                 '<tbody>{body}</tbody></table></div>')
HEADING_CELL = Template("numeric text", "<th{numeric}>{text}</th>")
#: A cell names its column (data-label), which a phone's stacked rows show beside it.
CELL = Template("numeric label text", '<td{numeric} data-label="{label}">{text}</td>')
ROW = Template("cells", "<tr>{cells}</tr>")
NUMERIC = Markup(' class="num"')
NO_ROWS = Template("columns",
                   '<tr><td colspan="{columns}" class="muted">Nothing here yet.</td></tr>')
#: The last row of a table of lines: their total.
TOTAL_CELL = Template("text", "<strong>{text}</strong>")

LINK = Template("href text", '<a href="{href}">{text}</a>')
#: A link to another site (a tracking page, a hosted invoice): no Referer goes with it.
OUTSIDE_LINK = Template("href text", '<a href="{href}" rel="noreferrer">{text}</a>')
STATUS_TAG = Template("style text", '<span class="status status-{style}">{text}</span>')
#: A moment in the company's time zone; its exact UTC time shows on hover.
TIME_TAG = Template("at exact text", '<time datetime="{at}" title="{exact}">{text}</time>')
DAY_TAG = Template("day text", '<time datetime="{day}">{text}</time>')
MUTED = Template("text", '<span class="muted">{text}</span>')
NOTE = Template("text", '<p class="muted">{text}</p>')
PARAGRAPH = Template("text", "<p>{text}</p>")
CODE = Template("text", "<code>{text}</code>")
HEADING = Template("text", "<h2>{text}</h2>")
SUBHEADING = Template("text", "<h3>{text}</h3>")
CARD = Template("body", '<div class="card">{body}</div>')
GRID = Template("cells", '<div class="grid">{cells}</div>')
LIST = Template("items", "<ul>{items}</ul>")
LIST_ITEM = Template("text", "<li>{text}</li>")
#: What a page shows on screen only: its forms and buttons are not printed either.
SCREEN_ONLY = Template("body", '<div class="no-print">{body}</div>')

#: An invoice as it is printed, from the dashboard or the store: who sends it, to whom, its
#: dates and lines, and what is left to pay.
INVOICE_DOCUMENT = Template(
    "seller number status buyer ship_to issued due terms order po lines paid credited balance",
    """\
<article class="card invoice"><div class="invoice-head"><div><h2>{seller}</h2>\
<p>Invoice <strong>{number}</strong> {status}</p></div><dl class="facts"><dt>Billed to</dt>\
<dd>{buyer}</dd><dt>Ship to</dt><dd>{ship_to}</dd><dt>Issued</dt><dd>{issued}</dd><dt>Due</dt><dd>{due} ({terms})</dd>\
<dt>Order</dt><dd>{order}</dd><dt>PO number</dt><dd>{po}</dd></dl></div>{lines}\
<dl class="facts totals"><dt>Paid</dt><dd>{paid}</dd><dt>Credited</dt><dd>{credited}</dd>\
<dt>Balance due</dt><dd><strong>{balance}</strong></dd></dl></article>\
<p class="muted no-print">To print it or save it as a PDF, use the browser's Print (Ctrl+P \
or Cmd+P): only the invoice is printed.</p>""")
LINE_BREAK = Markup("<br>")

STYLESHEET = """\
:root { --ink: #1d2430; --muted: #5b6575; --line: #d7dce3; --paper: #ffffff;
  --wash: #f4f6f9; --accent: #1f5fbf; --danger: #b42318; --ok: #17713a; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: var(--ink); background: var(--wash); }
a { color: var(--accent); }
:focus-visible { outline: 3px solid #f5b400; outline-offset: 2px; }
.skip { position: absolute; left: -999px; }
.hidden-label { position: absolute; width: 1px; height: 1px; overflow: hidden;
  clip-path: inset(50%); white-space: nowrap; }
.skip:focus { left: 8px; top: 8px; background: var(--paper); padding: 6px; z-index: 1; }
header { display: flex; flex-wrap: wrap; align-items: center; justify-content: space-between;
  gap: 8px; padding: 8px 16px; background: var(--ink); color: #fff; }
header a { color: #fff; text-decoration: none; padding: 4px 8px; border-radius: 4px; }
header a[aria-current] { background: rgba(255,255,255,.18); }
nav { display: flex; flex-wrap: wrap; align-items: center; gap: 8px; }
nav ul { display: flex; flex-wrap: wrap; gap: 4px; margin: 0; padding: 0; list-style: none; }
.brand { margin-right: 8px; }
.account { display: flex; align-items: center; gap: 8px; margin: 0; }
.account a { color: #c9d1dc; font-size: 13px; }
code.key { overflow-wrap: anywhere; }
.codes { columns: 2; }
.account button { margin-top: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 16px; }
h1 { font-size: 22px; margin: 8px 0 16px; overflow-wrap: anywhere; }
h2 { font-size: 17px; margin: 24px 0 8px; }
.card { background: var(--paper); border: 1px solid var(--line); border-radius: 8px;
  padding: 16px; margin-bottom: 16px; }
.narrow { max-width: 420px; }
.table-wrap { overflow-x: auto; background: var(--paper); border: 1px solid var(--line);
  border-radius: 8px; margin-bottom: 16px; }
table { width: 100%; border-collapse: collapse; }
th, td { text-align: left; padding: 8px 10px; border-bottom: 1px solid var(--line);
  vertical-align: top; }
th { font-size: 13px; color: var(--muted); font-weight: 600; background: var(--wash); }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:last-child td { border-bottom: 0; }
label { display: block; font-weight: 600; margin: 10px 0 4px; font-size: 14px; }
label.check { display: inline-flex; gap: 6px; align-items: center; font-weight: 400;
  margin: 4px 12px 4px 0; }
input, select, textarea { font: inherit; padding: 7px 9px; border: 1px solid #aeb6c2;
  border-radius: 6px; width: 100%; max-width: 100%; background: #fff; color: var(--ink); }
input[type=checkbox] { width: auto; }
textarea { min-height: 70px; }
button, .button { font: inherit; display: inline-block; padding: 7px 14px; border-radius: 6px;
  border: 1px solid var(--accent); background: var(--accent); color: #fff; cursor: pointer;
  text-decoration: none; margin-top: 10px; }
button.secondary { background: #fff; color: var(--accent); }
button.danger { background: var(--danger); border-color: var(--danger); }
.inline { display: inline; margin: 0 6px 0 0; }
.inline button { margin-top: 0; }
.filters { display: grid; grid-template-columns: repeat(auto-fit, minmax(160px, 1fr));
  gap: 0 12px; align-items: end; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(220px, 1fr)); gap: 0 16px; }
.error { color: var(--danger); font-size: 14px; margin: 4px 0 0; }
.alert { border-left: 4px solid var(--danger); background: #fff1f0; padding: 10px 12px;
  margin-bottom: 16px; }
.notice { border-left: 4px solid var(--ok); background: #effaf3; padding: 10px 12px;
  margin-bottom: 16px; overflow-wrap: break-word; }
.status { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
  font-weight: 600; background: #e6ebf2; }
.status-SUBMITTED { background: #e8f0fe; } .status-CONFIRMED { background: #fff4d6; }
.status-SHIPPED { background: #e4f5ff; } .status-DELIVERED { background: #e3f6e8; }
.status-CANCELLED, .status-BLOCKED, .status-revoked { background: #fde7e5; }
.status-sent { background: #e3f6e8; } .status-failed, .status-unsent { background: #fde7e5; }
.muted { color: var(--muted); font-size: 13px; }
code { font-size: 13px; overflow-wrap: break-word; }
.pager { margin: 8px 0 24px; }
nav.pager a { display: inline-block; padding: 10px 0; margin-right: 20px; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 16px; margin: 0; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; }
.level-in { background: #e3f6e8; } .level-low { background: #fff4d6; }
.level-out { background: #fde7e5; }
.add { display: inline-flex; gap: 6px; align-items: center; flex-wrap: wrap; }
.add button { margin-top: 0; }
input.qty { width: 6.5em; }
img.thumb { float: left; margin: 0 10px 4px 0; object-fit: cover; background: var(--wash); }
img.photo { width: 240px; height: 240px; max-width: 100%; object-fit: contain;
  background: var(--wash); }
.tracking { border-left: 4px solid var(--accent); }
.tracking h2 { margin-top: 0; }
ol.timeline { margin: 0 0 16px; padding-left: 2.5em; }
ol.timeline li { margin: 2px 0; }
fieldset.address { border: 1px solid var(--line); border-radius: 6px; margin: 12px 0 0; }
.ship-to:has(input[value=""]:not(:checked)) + fieldset.address { display: none; }
.ship-to label.check { display: block; }
.invoice-head { display: flex; flex-wrap: wrap; justify-content: space-between; gap: 8px 24px; }
.invoice-head h2 { margin-top: 0; }
.invoice-head > * { min-width: 0; }
dl.facts dd { overflow-wrap: anywhere; min-width: 0; }
dl.totals { margin: 12px 0 0 auto; max-width: 320px; }
.status-OPEN { background: #fff4d6; } .status-PAID { background: #e3f6e8; }
.status-VOID { background: #fde7e5; }
@media print {
  @page { margin: 15mm; }
  body { background: #fff; font-size: 11pt; }
  header, .skip, .no-print, form, .notice, .alert { display: none !important; }
  main { max-width: none; padding: 0; }
  .card, .table-wrap { border: 0; padding: 0; margin-bottom: 8px; overflow: visible; }
  a { color: inherit; text-decoration: none; }
  tr { break-inside: avoid; }
}
@media (max-width: 640px) {
  main { padding: 10px; }
  th, td { padding: 6px; }
  .hide-narrow { display: none; }
  /* A table's rows stack as cards, each cell beside its column's name, so that a row's
     actions are on the screen, not past its right edge. */
  .table-wrap { overflow-x: visible; }
  .table-wrap thead { position: absolute; width: 1px; height: 1px; overflow: hidden;
    clip-path: inset(50%); }
  .table-wrap table, .table-wrap tbody, .table-wrap tr, .table-wrap td { display: block; }
  .table-wrap tr { border-bottom: 1px solid var(--line); padding: 6px 0; }
  .table-wrap td { border: 0; padding: 2px 10px; display: flex; flex-wrap: wrap;
    align-items: center; justify-content: space-between; gap: 0 12px; text-align: right; }
  .table-wrap td:empty { display: none; }
  .table-wrap td:not([data-label=""])::before { content: attr(data-label); color: var(--muted);
    font-size: 13px; font-weight: 600; text-align: left; }
  .table-wrap td form { margin: 0; }
  .table-wrap tr:has(td > strong:only-child) td::before { content: none; }  /* a total's row */
  /* Tap targets at least 44 px tall (WCAG 2.5.8 asks 24). */
  button, .button { min-height: 44px; }
  header a, nav.pager a, .table-wrap td a { min-height: 44px; display: inline-flex;
    align-items: center; }
}
"""


# 4.2 Email templates -------------------------------------------------------------------------
# Each kind of email the service sends: a subject, a plain-text body and an HTML body, filled
# from the data its operation recorded with queue_email() (a JSON object of text and numbers).
# In the subject and the text every value is put on one line, so that a line break in a name
# starts no header and no line of its own; in the HTML every value is escaped, as in the pages.
# Besides the data's own values a template may use {facts} (the data's "facts", [label, value]
# pairs, or [label, value, URL] for a link the service made, a path for one to this server:
# text somebody typed is never a link, whatever it looks like), {lines} (the data's order
# "lines" and "total" as a table) and {link} (the data's "path" on the base URL: every link
# to this server is built so). To send a new kind of email, add its template here and call
# queue_email() with its data.

class PlainText(str):
    """Plain text of several lines, built already; any other value is put on one line."""


def plain(template, **values):
    return PlainText(template.format(**{
        name: value if isinstance(value, PlainText) else one_line(value)
        for name, value in values.items()}))


EmailTemplate = collections.namedtuple("EmailTemplate", "subject text html")

#: An email's page: as wide as the phone it is read on, up to a column a desktop reads well,
#: its tables never wider than the screen (mail clients take inline styles only).
EMAIL_LAYOUT = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>{subject}</title></head>
<body style="margin:0;padding:12px;font-family:sans-serif;line-height:1.5">
<div style="max-width:600px;margin:0 auto;overflow-wrap:break-word">
{body}
<p>{sender}</p>
</div>
</body>
</html>
"""

EMAIL_TEMPLATES = {
    "order_shipped": EmailTemplate(
        subject="Your order {orderNumber} has shipped",
        text="Hello {customerName},\n\nYour order {orderNumber} has shipped.\n\n{facts}\n",
        html="<p>Hello {customerName},</p>\n<p>Your order <strong>{orderNumber}</strong> has "
             "shipped.</p>\n{facts}"),
    "order_confirmation": EmailTemplate(
        subject="We received your order {orderNumber}",
        text="Hello {customerName},\n\nThank you for your order {orderNumber}.\n\n{facts}\n\n"
             "{lines}\n",
        html="<p>Hello {customerName},</p>\n<p>Thank you for your order <strong>{orderNumber}"
             "</strong>.</p>\n{facts}\n{lines}"),
    "order_alert": EmailTemplate(
        subject="New storefront order {orderNumber} from {customerName}",
        text="A new order came in from the storefront.\n\n{facts}\n\n{lines}\n\n"
             "Open it in the dashboard: {link}\n",
        html="<p>A new order came in from the storefront.</p>\n{facts}\n{lines}\n"
             '<p><a href="{link}">Open it in the dashboard</a></p>'),
    "account_verify": EmailTemplate(
        subject="Confirm your email address for {store}",
        text="Hello {customerName},\n\nThank you for registering with {store}. Confirm your "
             "email address with this link (it works once, for an hour):\n\n{link}\n",
        html="<p>Hello {customerName},</p>\n<p>Thank you for registering with {store}. "
             '<a href="{link}">Confirm your email address</a> (the link works once, for an '
             "hour).</p>"),
    "account_exists": EmailTemplate(
        subject="Someone tried to register with your address at {store}",
        text="Hello {customerName},\n\nSomeone tried to register a new account at {store} with "
             "this email address, which has an account already. If it was you, sign in, or set "
             "a new password here:\n\n{link}\n\nIf it was not you, there is nothing to do.\n",
        html="<p>Hello {customerName},</p>\n<p>Someone tried to register a new account at "
             "{store} with this email address, which has an account already. If it was you, "
             '<a href="{link}">sign in or set a new password</a>.</p>\n<p>If it was not you, '
             "there is nothing to do.</p>"),
    "account_approved": EmailTemplate(
        subject="Your account at {store} is approved",
        text="Hello {customerName},\n\nYour account at {store} is approved: sign in and order "
             "at\n\n{link}\n",
        html="<p>Hello {customerName},</p>\n<p>Your account at {store} is approved: "
             '<a href="{link}">sign in and order</a>.</p>'),
    "account_reset": EmailTemplate(
        subject="Set your password for {store}",
        text="Hello {customerName},\n\nSomeone asked to set a new password for your account "
             "at {store}. Set it with this link (it works once, for an hour):\n\n{link}\n\n"
             "If it was not you, ignore this email: your password stays as it is.\n",
        html="<p>Hello {customerName},</p>\n<p>Someone asked to set a new password for your "
             'account at {store}. <a href="{link}">Set your password</a> (the link works once, '
             "for an hour).</p>\n<p>If it was not you, ignore this email: your password stays "
             "as it is.</p>"),
    "account_invite": EmailTemplate(
        subject="Your account at {store}",
        text="Hello {customerName},\n\n{store} opened an account for you in its store. Set "
             "your password with this link (it works once, for an hour):\n\n{link}\n",
        html="<p>Hello {customerName},</p>\n<p>{store} opened an account for you in its store. "
             '<a href="{link}">Set your password</a> (the link works once, for an hour).</p>'),
    "contact_invite": EmailTemplate(
        subject="{invitedBy} invited you to order for {business} at {store}",
        text="Hello {customerName},\n\n{invitedBy} invited you to the account of {business} "
             "at {store}. Set your password with this link (it works once, for an hour):\n\n"
             "{link}\n",
        html="<p>Hello {customerName},</p>\n<p>{invitedBy} invited you to the account of "
             '{business} at {store}. <a href="{link}">Set your password</a> (the link works '
             "once, for an hour).</p>"),
    "approval_requested": EmailTemplate(
        subject="{buyer} asks you to approve an order of {total}",
        text="Hello {customerName},\n\n{buyer} checked out an order above their approval "
             "limit at {store}. It is not placed until an admin approves it.\n\n{facts}\n\n"
             "Approve or decline it: {link}\n",
        html="<p>Hello {customerName},</p>\n<p>{buyer} checked out an order above their "
             "approval limit at {store}. It is not placed until an admin approves it.</p>\n"
             '{facts}\n<p><a href="{link}">Approve or decline it</a></p>'),
    "request_declined": EmailTemplate(
        subject="Your order request at {store} was declined",
        text="Hello {customerName},\n\n{admin} declined your order request of {total}, "
             "and no order was placed.\n\nTheir reason: {reason}\n\nSee it in the store: "
             "{link}\n",
        html="<p>Hello {customerName},</p>\n<p>{admin} declined your order request of {total}, "
             "and no order was placed.</p>\n<p>Their reason: {reason}</p>\n"
             '<p><a href="{link}">See it in the store</a></p>'),
    "password_changed": EmailTemplate(
        subject="Your password for {store} was changed",
        text="Hello {customerName},\n\nThe password of your account at {store} was just "
             "changed, and every other signed-in browser signed out. If it was not you, set a "
             "new one at once:\n\n{link}\n",
        html="<p>Hello {customerName},</p>\n<p>The password of your account at {store} was "
             "just changed, and every other signed-in browser signed out. If it was not you, "
             '<a href="{link}">set a new one at once</a>.</p>'),
    "staff_reset": EmailTemplate(
        subject="Set your dashboard password for {company}",
        text="Hello,\n\nSomeone asked to set a new password for your staff account at "
             "{company}. Set it with this link (it works once, for an hour):\n\n{link}\n\n"
             "If it was not you, ignore this email: your password stays as it is.\n",
        html="<p>Hello,</p>\n<p>Someone asked to set a new password for your staff account at "
             '{company}. <a href="{link}">Set your password</a> (the link works once, for an '
             "hour).</p>\n<p>If it was not you, ignore this email: your password stays as it "
             "is.</p>"),
    "staff_invite": EmailTemplate(
        subject="You are invited to the dashboard of {company}",
        text="Hello,\n\n{company} opened a staff account for you on its dashboard. Set your "
             "password with this link (it works once, for an hour; after that, ask for a new "
             "one with \"Forgot your password?\" on the sign-in page):\n\n{link}\n",
        html="<p>Hello,</p>\n<p>{company} opened a staff account for you on its dashboard. "
             '<a href="{link}">Set your password</a> (the link works once, for an hour; after '
             'that, ask for a new one with "Forgot your password?" on the sign-in page).</p>'),
    "staff_password_changed": EmailTemplate(
        subject="Your dashboard password for {company} was changed",
        text="Hello,\n\nThe password of your staff account at {company} was just changed, "
             "and every signed-in browser signed out. If it was not you, set a new one at "
             "once:\n\n{link}\n",
        html="<p>Hello,</p>\n<p>The password of your staff account at {company} was just "
             "changed, and every signed-in browser signed out. If it was not you, "
             '<a href="{link}">set a new one at once</a>.</p>'),
    "order_cancelled": EmailTemplate(
        subject="Your order {orderNumber} is cancelled",
        text="Hello {customerName},\n\n{store} cancelled your order {orderNumber}.\n\n{facts}\n\n"
             "See it in the store: {link}\n",
        html="<p>Hello {customerName},</p>\n<p>{store} cancelled your order <strong>{orderNumber}"
             '</strong>.</p>\n{facts}\n<p><a href="{link}">See it in the store</a></p>'),
    "return_approved": EmailTemplate(
        subject="Your return for order {orderNumber} is approved",
        text="Hello {customerName},\n\n{store} approved your return. Send the goods back as "
             "agreed; we will write again when they are refunded.\n\n{facts}\n\n"
             "See it in the store: {link}\n",
        html="<p>Hello {customerName},</p>\n<p>{store} approved your return. Send the goods "
             "back as agreed; we will write again when they are refunded.</p>\n{facts}\n"
             '<p><a href="{link}">See it in the store</a></p>'),
    "return_refunded": EmailTemplate(
        subject="Your return for order {orderNumber} is refunded",
        text="Hello {customerName},\n\n{store} refunded your return.\n\n{facts}\n\n"
             "See it in the store: {link}\n",
        html="<p>Hello {customerName},</p>\n<p>{store} refunded your return.</p>\n{facts}\n"
             '<p><a href="{link}">See it in the store</a></p>'),
    "invoice_issued": EmailTemplate(
        subject="Invoice {number} from {store}",
        text="Hello {customerName},\n\n{store} invoiced you for your order.\n\n{facts}\n\n"
             "{lines}\n\nSee and print the invoice: {link}\n",
        html="<p>Hello {customerName},</p>\n<p>{store} invoiced you for your order.</p>\n"
             '{facts}\n{lines}\n<p><a href="{link}">See and print the invoice</a></p>'),
    "report": EmailTemplate(
        subject="{store}: {title}",
        text="{title}\n\n{facts}\n\nThe dashboard: {link}\n",
        html="<p>{title}</p>\n{facts}\n<p><a href=\"{link}\">Open the dashboard</a></p>"),
    "invoice_reminder": EmailTemplate(
        subject="Reminder: invoice {number} from {store} is overdue",
        text="Hello {customerName},\n\nInvoice {number} is past its due date and has a "
             "balance left to pay.\n\n{facts}\n\nSee the invoice: {link}\n\nIf you paid it "
             "already, thank you, and please ignore this reminder.\n",
        html="<p>Hello {customerName},</p>\n<p>Invoice <strong>{number}</strong> is past its "
             "due date and has a balance left to pay.</p>\n{facts}\n"
             '<p><a href="{link}">See the invoice</a></p>\n<p>If you paid it already, thank '
             "you, and please ignore this reminder.</p>"),
    "mail_test": EmailTemplate(
        subject="Test email from ordering",
        text="This test email was sent by ordering mail-test through {server}.\n"
             "If you can read it, outgoing email works.\n",
        html="<p>This test email was sent by ordering mail-test through {server}.</p>\n"
             "<p>If you can read it, outgoing email works.</p>"),
}


def email_bodies(kind, data, link_base, sender):
    """(text, HTML) of an email of this kind from its data; sender signs it."""
    template = EMAIL_TEMPLATES[kind]
    # A fact's link to a page of this server is its path, on the base URL.
    facts = [fact if len(fact) < 3 or not fact[2].startswith("/") else
             [fact[0], fact[1], link_base + fact[2]] for fact in data.get("facts", ())]
    lines = data.get("lines", ())
    totals = email_totals(data) if lines else ()
    text_values = dict(data, link=link_base + data.get("path", "/"), facts=PlainText(
        "\n".join(f"{one_line(fact[0])}: {one_line(fact[1])}" + (
            f" ({fact[2]})" if len(fact) > 2 and fact[2] != fact[1] else "") for fact in facts)),
        lines=PlainText("\n".join(
            [f"{line['quantity']} x {one_line(line['name'])} ({one_line(line['sku'] or '-')}) at "
             f"{amount_text(line['unitPrice'])} = {amount_text(line['lineTotal'])}"
             for line in lines] + [f"{label}: {amount}" for label, amount in totals])))
    html_values = dict({name: one_line(value) for name, value in data.items()},
                       link=text_values["link"], facts=render('<table>{rows}</table>', rows=join(
        render('<tr><th align="left">{label}</th><td>{value}</td></tr>', label=fact[0],
               value=render('<a href="{u}">{v}</a>', u=fact[2], v=one_line(fact[1]))
               if len(fact) > 2 else one_line(fact[1]))
        for fact in facts)) if facts else "", lines=render(
        '<table><tr><th align="left">Product</th><th align="left">SKU</th>'
        '<th align="right">Quantity</th><th align="right">Unit price</th>'
        '<th align="right">Line total</th></tr>{rows}{totals}</table>', rows=join(
            render('<tr><td>{name}</td><td>{sku}</td><td align="right">{quantity}</td>'
                   '<td align="right">{price}</td><td align="right">{line_total}</td></tr>',
                   name=line["name"], sku=line["sku"] or "-", quantity=line["quantity"],
                   price=amount_text(line["unitPrice"]),
                   line_total=amount_text(line["lineTotal"])) for line in lines),
        totals=join(render('<tr><th align="left" colspan="4">{label}</th>'
                           '<th align="right">{amount}</th></tr>', label=label, amount=amount)
                    for label, amount in totals)) if lines else "")
    text = plain(template.text + "\n{sender}\n", **text_values, sender=sender)
    html = render(EMAIL_LAYOUT, subject=plain(template.subject, **data), sender=sender,
                  body=render(template.html, **html_values))
    return str(text), str(html)


def email_totals(data):
    """[(label, amount)] under an email's lines: the total; or, where tax is charged, the
    subtotal, the tax at its rate and the total due."""
    total, tax, rate = data.get("total"), data.get("tax") or 0, data.get("taxRate") or 0
    if not tax and not rate:
        return [("Total", amount_text(total))]
    return [("Subtotal", amount_text(total)), (f"Tax ({rate_text(rate)})", amount_text(tax)),
            ("Total due", cents_text(cents_from_number(total) + cents_from_number(tax)))]


# 4.3 Dashboard pages -------------------------------------------------------------------------

ORDER_PAGE = Template("facts ships_to actions lines history returns open_return", """\
{facts}{ships_to}<h2>Status</h2><div class="card">{actions}</div><h2>Lines</h2>{lines}\
<h2>History</h2>{history}<h2>Returns</h2>{returns}{open_return}""")

ORDER_FACTS = Template("status customer people po notes created updated tracking invoice", """\
<div class="card"><dl class="facts"><dt>Status</dt><dd>{status}</dd><dt>Customer</dt>\
<dd>{customer}</dd><dt>Placed by</dt><dd>{people}</dd><dt>PO number</dt><dd>{po}</dd>\
<dt>Notes</dt><dd>{notes}</dd>\
<dt>Created</dt><dd>{created}</dd><dt>Updated</dt><dd>{updated}</dd><dt>Tracking</dt>\
<dd>{tracking}</dd><dt>Invoice</dt><dd>{invoice}</dd></dl></div>""")
ORDER_TRACKING = Template("carrier number url",
                          '{carrier} {number} <a href="{url}" rel="noreferrer">{url}</a>')
SHIPS_TO = Template("address", '<h2>Ships to</h2><address class="card">{address}</address>')

NEW_ORDER = Template("customer lines count error address po notes", """\
<p class="muted">Each line takes the customer's own price where one is set (on the customer's \
page), else the catalog price; lines left at "(none)" are skipped.</p>\
{customer}<input type="hidden" name="lineCount" value="{count}">{lines}{error}\
<div><button type="submit" name="addLine" value="yes" class="secondary" formnovalidate>\
Add a line</button></div>\
<fieldset class="address"><legend>Ship to</legend>{address}</fieldset>{po}{notes}\
<button type="submit">Create order</button>""")

SHIP_FORM = Template("carrier number url", """\
<h3>Ship</h3><input type="hidden" name="status" value="SHIPPED">\
<div class="grid">{carrier}{number}{url}</div><button type="submit">Mark SHIPPED</button>""")
CANCEL_FORM = Template("reason invalid error", """\
<h3>Cancel</h3><input type="hidden" name="status" value="CANCELLED">{reason}<label class="check">\
<input type="checkbox" name="restock" value="on"> Put its units back in stock</label> \
<label class="check"><input type="checkbox" id="confirm" name="confirm" value="yes" \
required{invalid}> Yes, cancel \
this order (its buyer is emailed, with the reason)</label>{error}\
<div><button type="submit" class="danger">Cancel the order</button></div>""")
FINAL_STATUS = Template("status", '<p class="muted">{status} is final: no further status.</p>')
RESTOCKED = Template("", '<p class="muted">Its units are back in stock.</p>')

OPEN_RETURN_FORM = Template("reason units", """\
<h3>Open a return</h3>{reason}{units}\
<button type="submit" class="secondary">Open return</button>""")
#: A return's line as a cell of the returns' tables shows it, one a line.
RETURN_LINE = Template("name sku units", "{name} ({sku}): {units}<br>")
REFUND_FORM = Template("method units subtotal amount", """\
{method}{units}{subtotal}{amount}<button type="submit">Refund</button>""")
RETURNS_FOOT = Template("", '<p class="muted">Open a return from its order\'s page.</p>')

PRODUCT_STOCK = Template("level link movements", """\
<h2>Stock</h2><div class="card"><p>{level} in stock. {link}</p></div>\
<h3>Recent movements</h3>{movements}""")
STOCK_FORMS = Template("level adjust count movements", """\
<div class="card"><p>{level} in stock now. An adjustment changes it by an amount, saying why; \
a count records the level found on the shelf (the difference is the movement).</p></div>\
<div class="grid">{adjust}{count}</div><h2>Recent movements</h2>{movements}""")
#: A form of a few fields under its own heading (Adjust, Count, Set a price).
TITLED_FORM = Template("title fields button",
                       '<h3>{title}</h3>{fields}<button type="submit">{button}</button>')

#: A customer's status on its dashboard page, with the buttons that change it.
CUSTOMER_STATUS_CARD = Template("tag verified approve button invite", """\
<div class="card"><p>Status: {tag}</p><p>Email address: {verified}</p>\
{approve}{button}{invite}</div>""")
#: Where Approve would be, for a customer whose address is not confirmed yet.
VOID_FORM = Template("number invalid error", """\
<h2>Void</h2><label class="check"><input type="checkbox" id="confirm-void" name="confirm" value="yes" \
required{invalid}> \
Void {number}: its number stays used, nothing more can be paid or credited to it, and its \
order can be invoiced again</label>{error}<div><button type="submit" class="danger">Void \
this invoice</button></div>""")
BUYER_EMAILS = Template("switches", """\
<fieldset><legend>Email buyers when</legend><input type="hidden" name="buyerEmailsShown" \
value="1">{switches}</fieldset>""")
BUYER_EMAIL_SWITCH = Template("value checked text", """\
<label class="check"><input type="checkbox" name="buyerEmails" value="{value}"{checked}> \
{text}</label>""")
CREDIT_STANDING = Template("limit exposure available terms statement", """\
<h2>Credit and invoices</h2><div class="card"><dl class="facts"><dt>Credit limit</dt>\
<dd>{limit}</dd><dt>Exposure</dt><dd>{exposure}</dd><dt>Available</dt><dd>{available}</dd>\
<dt>Payment terms</dt><dd>{terms}</dd></dl><p class="muted">Exposure: the balances of open \
invoices and the totals of orders not yet invoiced (tax included, cancelled ones aside), less \
unapplied credit. A store checkout that would take it past the limit is refused; orders \
from the API and the dashboard are not.</p><p>{statement}</p></div>""")
AWAITS_CONFIRMATION = Template("", '<span class="muted">Once the email address is confirmed</span>')
CUSTOMER_PRICES = Template("prices form", """\
<h2 id="prices">Prices</h2><p class="muted">This customer's own prices: orders placed at the \
storefront and here in the dashboard use them; orders placed through the API always use the \
catalog price.</p>{prices}{form}""")

GROUP_PRICES = Template("prices form", """\
<h2 id="prices">Prices</h2><p class="muted">This group's own prices: they replace its discount \
for these products. A customer of the group pays the lowest of the catalog price, its own \
price, its group's and a price break.</p>{prices}{form}""")
GROUP_PAGE_NOTE = Template("members", """\
<p class="muted">{members} customers in this group; a customer's page puts it in a group.</p>""")

WEBHOOK_CARD = Template("url state events grace toggle rotate deliveries", """\
<section class="card"><h2>{url}</h2><p>{state} &middot; {events}</p>{grace}\
<p>{toggle}{rotate}</p><h3>Recent deliveries</h3>{deliveries}</section>""")
WEBHOOK_GRACE = Template("until", """\
<p class="muted">Old secret still signs X-Webhook-Signature-Old until {until}.</p>""")
NEW_WEBHOOK = Template("url events active", """\
<h2>New webhook</h2>{url}{events}{active}\
<div><button type="submit">Create webhook</button></div>""")
WEBHOOK_CREATED = Template("secret", """\
Webhook created. Its signing secret, shown this once: <code>{secret}</code>""")
SECRET_ROTATED = Template("secret until", """\
New signing secret, shown this once: <code>{secret}</code>. Until {until} deliveries also \
carry X-Webhook-Signature-Old.""")

NEW_KEY = Template("scopes limit expires", """\
<h2>New key</h2>{scopes}<div class="grid">{limit}{expires}</div>\
<div><button type="submit">Create key</button></div>""")
KEY_CREATED = Template("id key", "Key {id} created. The key, shown this once: <code>{key}</code>")

BILLING_FOOT = Template("", """\
<p class="muted">The paid invoices of the company's subscription, newest first, as Stripe \
reports them (invoice.paid). Stripe finds the company by its Stripe customer ID: see \
<a href="/dashboard/settings">Settings</a>.</p>""")
EMAIL_FACTS = Template("to subject state written next why again", """\
<div class="card"><dl class="facts"><dt>Recipient</dt><dd>{to}</dd><dt>Subject</dt>\
<dd>{subject}</dd><dt>State</dt><dd>{state}</dd><dt>Written</dt><dd>{written}</dd>\
<dt>Next attempt</dt><dd>{next}</dd><dt>Last reply</dt><dd><code>{why}</code></dd>\
</dl>{again}</div>""")
SETTINGS_FORM = Template(
    "time_zone two_step server mail_name reply_to alerts reports buyer_emails approval tax_rate "
    "terms stripe", """\
<h2>Company</h2>{time_zone}{two_step}\
<h2>Email</h2><p class="muted">{server}</p>{mail_name}{reply_to}{alerts}{reports}{buyer_emails}\
<h2>Storefront</h2>{approval}<h2>Tax and invoices</h2>{tax_rate}{terms}\
<h2>Carriers</h2><p><a href="/dashboard/settings/carriers">Carriers' names and tracking links\
</a></p>\
<h2>Billing</h2><p>Stripe customer: <code>{stripe}</code></p>\
<p class="muted">The company as a customer of the service's Stripe account: its paid invoices \
are listed under Billing once the operator of the service links this company to its Stripe \
customer: ask the operator to do so.</p><div><button type="submit">Save</button></div>""")

#: The Carriers page (Settings): a name and a tracking link for each carrier, in one form.
CARRIERS_FORM = Template("carriers", """\
<p class="muted">Buyers read a carrier's name on their order and in the shipping email, and \
follow its tracking link, where {{number}} stands for the tracking number (as in \
https://tracking.example/track?n={{number}}). For another carrier, staff give the link as they \
ship.</p>{carriers}<div><button type="submit">Save</button></div>""")
CARRIER_FIELDS = Template("code fields", "<fieldset><legend>{code}</legend>{fields}</fieldset>")

#: The dashboard's account page: who is signed in, and two-step sign-in in each of its states.
STAFF_ACCOUNT = Template("email role company", """\
<div class="card"><p>Signed in as <strong>{email}</strong>, {role} of {company}.</p></div>\
<h2>Two-step sign-in</h2>""")
TWO_STEP_OFF = Template("start", """\
<p>Off: you sign in with your password alone. With it on, a sign-in also asks for the code an \
authenticator app on your phone shows (any app of time-based codes, RFC 6238).</p>{start}""")
TWO_STEP_SETUP = Template("key uri form", """\
<div class="card"><p>Add this key to your authenticator app (as a time-based key, typed in or \
pasted):</p><p><code class="key">{key}</code></p><p class="muted">Or, where the app takes a \
link: <code class="key">{uri}</code></p>{form}</div>""")
TWO_STEP_ON = Template("left renew off", """\
<p>On: a sign-in asks for your app's code. Recovery codes left: {left}.</p>{renew}{off}""")
RECOVERY_CODES_SHOWN = Template("codes", """\
<div class="notice" role="status"><p>Two-step sign-in is on. These recovery codes sign you in \
once each if your phone is lost; keep them somewhere safe: this page shows them once.</p>\
<ul class="codes">{codes}</ul></div>""")
LIST_ITEM = Template("text", "<li><code>{text}</code></li>")


# 4.4 Storefront pages ------------------------------------------------------------------------

#: The storefront's header for a visitor who is not signed in: the store's name, and the way in.
STORE_BAR = Template("store prefix", """\
<nav aria-label="Store"><a class="brand" href="{prefix}">{store}</a><ul>\
<li><a href="{prefix}/sign-in">Sign in</a></li><li><a href="{prefix}/register">Register</a></li>\
</ul></nav>""")

#: The storefront's ways on from its sign-in form.
STORE_SIGN_IN_LINKS = Template("prefix", """\
<p class="narrow"><a href="{prefix}/reset">Forgot your password?</a> &middot; \
<a href="{prefix}/register">Register a new account</a></p>""")

#: What comes after a registration's confirmation at a store that approves its buyers.
STORE_APPROVAL_NEXT = Markup("<p>Once the address is confirmed, the store approves new "
                             "accounts before they order: an email tells you when yours is.</p>")

#: What a buyer whose address is not confirmed yet sees where ordering would be.
STORE_UNVERIFIED = Template("email form", """\
<div class="card" role="status"><p>Confirm your email address before you order: open the link \
we sent to {email}. It works for an hour; if it has expired, ask for a new one.</p>{form}</div>""")

#: What a buyer awaiting approval sees where prices and ordering would be.
STORE_AWAITING = Template("store", """\
<div class="card" role="status"><p>Your account awaits approval by {store}. We will email you \
when it is approved; until then prices and ordering stay closed.</p></div>""")

_ADD_FORM = """\
<form class="inline add" method="post" action="{cart}"><input type="hidden" name="csrf" \
value="{csrf}"><input type="hidden" name="productId" value="{id}"><label class="hidden-label" \
for="qty-{id}">Quantity of {name}</label><input class="qty" id="qty-{id}" name="quantity" \
type="number" min="1" max="{most}" value="{start}"> <button type="submit">Add\
<span class="hidden-label"> {name}</span> to cart</button></form>"""

#: The form that puts a product in the cart (POST cart: productId, quantity).
STORE_ADD_FORM = Template("cart csrf id name most start", _ADD_FORM)

#: A product's row in the storefront's catalog, with its form: one template a row, for a page
#: of many (see catalog_row).
_CATALOG_ROW = """\
<tr><td>{image}<a href="{href}">{name}</a><br><span class="muted">{sku} {unit}</span>{terms}</td>\
<td class="num">{price}</td><td>{level}</td><td>ADD</td></tr>"""
STORE_CATALOG_ROW = Template("image href name sku unit terms price level cart csrf id most "
                             "start",
                             _CATALOG_ROW.replace("ADD", _ADD_FORM))
#: The same row for a contact whose role places no orders (a bookkeeper): no form.
STORE_CATALOG_ROW_VIEW = Template("image href name sku unit terms price level",
                                  _CATALOG_ROW.replace("ADD", ""))

#: A product of the storefront's catalog, with the form that puts it in the cart.
STORE_PRODUCT = Template("image sku category unit price terms level description add", """\
<div class="card">{image}<dl class="facts"><dt>SKU</dt><dd>{sku}</dd><dt>Category</dt><dd>{category}</dd>\
<dt>Unit</dt><dd>{unit}</dd><dt>Your price</dt><dd>{price}</dd><dt>Sold</dt><dd>{terms}</dd>\
<dt>Availability</dt><dd>{level}</dd></dl>{description}</div>{add}""")
#: A product's picture, loaded as it scrolls into view; its name stands in when it does not
#: load (the fixed box keeps the row's height either way).
PRODUCT_IMAGE = Template("css url name", """\
<img class="{css}" src="{url}" alt="{name}" loading="lazy" width="64" height="64">""")
#: How a product is sold (its quantity rule and price breaks), under its catalog row's name.
TERMS = Template("text", '<br><span class="muted">{text}</span>')

#: A storefront order's facts, for its buyer.
STORE_ORDER_FACTS = Template("status placed people po notes total invoice", """\
<div class="card"><dl class="facts"><dt>Status</dt><dd>{status}</dd><dt>Placed</dt>\
<dd>{placed}</dd><dt>Placed by</dt><dd>{people}</dd><dt>PO number</dt><dd>{po}</dd>\
<dt>Notes</dt><dd>{notes}</dd><dt>Total</dt>\
<dd>{total}</dd><dt>Invoice</dt><dd>{invoice}</dd></dl></div>""")

#: An order request awaiting, or after, its approval.
REQUEST_FACTS = Template("status asked total po notes ship_to decision lines", """\
<div class="card"><dl class="facts"><dt>Status</dt><dd>{status}</dd><dt>Asked</dt>\
<dd>{asked}</dd><dt>Total when asked, tax included</dt><dd>{total}</dd><dt>PO number</dt>\
<dd>{po}</dd><dt>Notes</dt><dd>{notes}</dd><dt>Ship to</dt><dd>{ship_to}</dd>{decision}</dl>\
</div><h2>Lines at today's prices</h2>{lines}""")
#: What became of a decided order request: (term, value).
DECISION = Template("term value", "<dt>{term}</dt><dd>{value}</dd>")

#: The tracking card of a shipped order, as its buyer sees it.
STORE_TRACKING = Template("carrier number track", """\
<section class="card tracking" aria-labelledby="tracking"><h2 id="tracking">Tracking</h2>\
<dl class="facts"><dt>Carrier</dt><dd>{carrier}</dd><dt>Tracking number</dt><dd>{number}</dd></dl>\
{track}</section>""")

#: One return of an order, as its buyer sees it.
STORE_RETURN = Template("opened status lines reason refund", """\
<section class="card"><p>Opened {opened} &middot; {status}{refund}</p>{lines}\
<p class="muted">Reason: {reason}</p></section>""")

#: The page of a store address that has no store.
NO_STORE = Template("message", '<p class="card narrow">{message}</p>')
STORE_WELCOME = Template("store prefix", """\
<div class="card"><p>Welcome to the wholesale store of {store}. Sign in to see prices and order, \
or register an account.</p><p><a class="button" href="{prefix}/sign-in">Sign in</a> \
<a href="{prefix}/register">Register</a></p></div>""")
STORE_REGISTER_LINKS = Template("prefix", """\
<p class="narrow">Have an account? <a href="{prefix}/sign-in">Sign in</a>.</p>""")

ACCOUNT_STATUS = Template("tag", '<div class="card"><p>Status: {tag}</p></div>')
PASSWORD_FORM = Template("current new", """\
<h2>Password</h2>{current}{new}<button type="submit">Change password</button>""")
ADDRESS_CARD = Template("address remove", '<div class="card"><p>{address}</p>{remove}</div>')
NO_ADDRESSES = Template("", """\
<p class="muted">None yet: checkout saves each new address you ship to.</p>""")

LEVEL_TAG = Template("style level", '<span class="status level-{style}">{level}</span>')
#: What a quick order or a reorder put in the cart.

NO_LONGER_SOLD = Template("name", '{name} <span class="status level-out">No longer sold</span>')
CART_QUANTITY = Template("id most quantity name invalid error", """\
<label class="hidden-label" for="{id}">Quantity of {name}</label><input class="qty" id="{id}" \
name="quantity" type="number" min="0" max="{most}" value="{quantity}"{invalid}> \
<button type="submit" class="secondary">Update<span class="hidden-label"> the quantity of \
{name}</span></button>{error}""")
#: A cart line's Remove, named for its product.
REMOVE_LINE = Template("name", 'Remove<span class="hidden-label"> {name}</span>')
CHECK_OUT = Template("prefix", '<p><a class="button" href="{prefix}/checkout">Check out</a></p>')
CART_EMPTY_CARD = Template("message prefix", """\
<div class="card"><p>{message}</p><p><a href="{prefix}/products">Browse the catalog</a></p>\
</div>""")
QUICK_ORDER_FORM = Template("lines file", """\
<h2>Quick order</h2><p class="muted">One SKU and quantity a line, such as \
<code>GR-RICE-25 3</code>, or a CSV file of the same.</p>{lines}{file}\
<button type="submit">Add to cart</button>""")

CHECKOUT_FORM = Template("token address po notes button", """\
<input type="hidden" name="token" value="{token}">{address}{po}{notes}\
<button type="submit">{button}</button>""")
#: A new address's fields, which the stylesheet hides while a saved address is chosen above
#: them (SHIP_TO_CHOICE), without a script.
NEW_ADDRESS = Template("fields", """\
<fieldset class="address"><legend>New address (saved for next time)</legend>{fields}</fieldset>""")
SHIP_TO_CHOICE = Template("choice", '<div class="ship-to">{choice}</div>')

STORE_ORDER_PAGE = Template("facts tracking ship_to lines again timeline returns", """\
{facts}{tracking}{ship_to}<h2>Lines</h2>{lines}<p>{again}</p>{timeline}{returns}""")
TRACK_PARCEL = Template("url", """\
<p><a class="button" href="{url}" rel="noreferrer">Track the parcel</a></p>""")
SHIP_TO = Template("address", '<h2>Ship to</h2><p class="card">{address}</p>')
TIMELINE = Template("steps", '<h2>Status</h2><ol class="card timeline">{steps}</ol>')
TIMELINE_STEP = Template("tag at", '<li>{tag} <span class="muted">{at}</span></li>')
REFUNDED = Template("amount", " &middot; refunded {amount}")
RETURN_FORM = Template("units reason", """\
<h3>Return goods</h3>{units}{reason}<button type="submit">Request a return</button>""")


# ---------------------------------------------------------------------------------------------
# 5. Errors and validation
# ---------------------------------------------------------------------------------------------

class ApiError(Exception):
    """Every refusal the API makes: an HTTP status and the spec's message, character for
    character. details (field and rule) is added for the generic VALIDATION_FAILED."""

    def __init__(self, status, message, details=None, extra=None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details
        self.extra = extra or {}
        self.headers = headers or {}
        self.others = []  # the refusals of a form's other fields (see Refusals)

    def body(self):
        body = {"error": self.message}
        if self.details:
            body["details"] = self.details
        body.update(self.extra)
        return body


VALIDATION_FAILED = "Validation failed."


def invalid(field, rule):
    return ApiError(400, VALIDATION_FAILED, details=[{"field": field, "rule": rule}])


# 5.1 Messages, enumerations and limits -------------------------------------------------------

# Each message appears here once, character for character as the spec gives it, and is used
# by the validators, the OpenAPI document and the pages alike. {Placeholders} are filled in
# where the message is raised; the OpenAPI document shows them as they are.

INVALID_JSON = "Invalid JSON body."
INVALID_CONTENT_LENGTH = "Invalid Content-Length header."
BODY_TOO_LARGE = "Request body too large."
UNKNOWN_PATH = "Not found."
METHOD_NOT_ALLOWED = "Method not allowed."
NOT_FOUND = "{resource} not found."
RATE_LIMITED = "Rate limit exceeded. Try again shortly."
MISSING_AUTH = "Missing or invalid Authorization header. Use: Bearer <api_key>"
INVALID_KEY = "Invalid, expired, or revoked API key."
MISSING_SCOPE = 'Insufficient permissions. This key lacks the "{scope}" scope.'
IDEMPOTENCY_KEY_REUSED = "Idempotency-Key has already been used with a different request."
IDEMPOTENCY_KEY_IN_PROGRESS = "A request with this Idempotency-Key is still in progress."
CUSTOMER_ID_REQUIRED = "customerId is required"
ITEMS_REQUIRED = "At least one item is required"
PRODUCT_ID_REQUIRED = "productId is required"
QUANTITY_NOT_A_NUMBER = "quantity must be a number"
QUANTITY_NOT_WHOLE = "quantity must be a whole number"
QUANTITY_TOO_SMALL = "quantity must be at least 1"
PRODUCT_UNAVAILABLE = 'Product "{id}" not found or is inactive.'
INSUFFICIENT_STOCK = 'Insufficient stock for product "{name}". Available: {N}, requested: {M}.'
#: The storefront's word for a shortage: buyers see stock as a level, never the count.
STORE_STOCK_SHORT = ('Not enough stock of "{name}": fewer are available than you asked for. '
                     "Lower the quantity and try again.")
INVALID_ORDER_STATUS = "Invalid order status."
TRACKING_ONLY_WHEN_SHIPPED = "Tracking info is only valid when status is SHIPPED."
TRACKING_URL_REQUIRED = "Tracking URL is required when carrier is OTHER."
ORDER_CANCELLED = "Cannot update a cancelled order."
EMAIL_REQUIRED = "Email is required."
INVALID_EMAIL = "Invalid email address."
CUSTOMER_EXISTS = "A customer with this email already exists."
INVALID_STATUS = "Invalid status."
URL_REQUIRED = "URL is required."
INVALID_URL = "Invalid URL."
EVENTS_REQUIRED = "At least one event is required."
UNKNOWN_EVENT = 'Unknown event: "{name}".'

SCOPES = ("products:read", "orders:read", "orders:write", "customers:read", "customers:write",
          "webhooks:read", "webhooks:write", "inventory:read", "returns:read")
ORDER_STATUSES = ("SUBMITTED", "CONFIRMED", "SHIPPED", "DELIVERED", "CANCELLED")
#: What the dashboard's button that moves an order to a status says.
STATUS_ACTIONS = {"CONFIRMED": "Confirm order", "SHIPPED": "Mark shipped",
                  "DELIVERED": "Mark delivered", "CANCELLED": "Cancel order"}
CARRIERS = ("CARRIER_A", "CARRIER_B", "CARRIER_C", "CARRIER_D", "CARRIER_E", "OTHER")
#: Every status a customer is stored with; PENDING (awaiting approval) is never set through
#: the API, which sets the others.
CUSTOMER_STATUSES = ("ACTIVE", "BLOCKED", "PENDING")
SETTABLE_CUSTOMER_STATUSES = ("ACTIVE", "BLOCKED")
REFUND_METHODS = ("CREDIT", "MANUAL")
RETURN_STATUSES = ("REQUESTED", "APPROVED", "RECEIVED", "REFUNDED")
INVALID_RETURN_STATUS = "Invalid return status."
#: Why a product's stock moved (docs/stock.md says what each means).
MOVEMENT_REASONS = ("order", "adjustment", "count", "return", "cancellation", "import",
                    "initial")
INVALID_MOVEMENT_REASON = "Invalid movement reason."
#: Who made a movement: staff, an API key, a buyer (with their IDs), a command, the program.
ACTOR_TYPES = ("staff", "key", "buyer", "command", "system")
#: Characters a movement's note holds at most.
MAX_MOVEMENT_NOTE = 500
#: Movements a product's page shows, and stock-history prints unless told otherwise.
MOVEMENTS_SHOWN = 20
STOCK_BELOW_ZERO = 'Stock of "{name}" cannot go below zero: it is {N}, the change is {M}.'
RESTOCK_NOT_CANCELLED = "Only a cancelled order's units can be put back in stock."
ALREADY_RESTOCKED = "This order's units are already back in stock."
REFUND_LINES_NEEDED = ("say for each line how many of its units are good and how many "
                       "damaged")

#: Page sizes of the list endpoints: the default, and the most a page holds.
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 100
MAX_ORDER_LINES = 100
MAX_QUANTITY = 1_000_000_000
MAX_PO_NUMBER = 100
MAX_ORDER_NOTES = 2000
MAX_CUSTOMER_NAME = 200
MAX_CUSTOMER_NOTES = 2000
MAX_EMAIL = 254
#: A customer's credit limit, in currency units, and its tax rate override.
MAX_CREDIT_LIMIT = 100_000_000
MAX_TAX_RATE = 0.3
#: A tracking number's length after trimming, and a return reason's.
TRACKING_NUMBER_LENGTH = (3, 64)
RETURN_REASON_LENGTH = (3, 2000)
MAX_URL = 2048
MAX_WEBHOOKS = 10
MAX_IDEMPOTENCY_KEY = 255
#: The shortest password an account may have.
PASSWORD_MIN = 12
#: Whether a company's new storefront accounts wait for approval (the first is the default).
STOREFRONT_APPROVALS = ("required", "automatic")
STOREFRONT_APPROVAL_MESSAGE = "Storefront approval must be required or automatic."
#: Seconds an emailed link (verify an address, set a password: a store's or the dashboard's)
#: works.
ACCOUNT_LINK_SECONDS = 3600
#: Emails with a link one account gets per hour at most (however often asked).
ACCOUNT_MAILS_PER_HOUR = 3
#: Registrations and reset requests (of any store and the dashboard) one client address may
#: send per minute: ip_rate_limit divided by this (10 at the default 600).
SIGNED_OUT_FORMS_SHARE = 60
LINK_EXPIRED = "This link has expired or was already used. Ask for a new one below."
CURRENT_PASSWORD_WRONG = "is not the account's current password"
CUSTOMER_BLOCKED_INVITE = "A blocked customer cannot be invited to set a password."
CUSTOMER_PENDING = "Customer awaits approval."
REFUND_UNITS = ("good and damaged units together must be from 1 to {units}, the units that "
                "came back")
CUSTOMER_UNVERIFIED = "Customer has not confirmed the email address yet."
VERIFICATION_SENT = "A new link is on its way to your email address."
VERIFICATION_NOT_SENT = ("No new link was sent: the address is confirmed already, or several "
                         "links went to it within the hour. Look for the last one we sent.")
APPROVE_UNVERIFIED = ("This customer has not confirmed the email address yet: approve once "
                      "the emailed link was used.")
CUSTOMER_BLOCKED = "Customer is blocked."
CART_EMPTY = "Your cart is empty."
#: Characters a quick order's pasted or uploaded lines may hold at most.
MAX_QUICK_ORDER = 20_000
QUICK_ORDER_FORMAT = "line {n}: write a SKU and a quantity, such as GR-RICE-25 3"
QUICK_ORDER_TOO_LONG = f"must be at most {MAX_QUICK_ORDER} characters"
QUICK_ORDER_NOT_TEXT = "must be a text file (UTF-8), such as a spreadsheet saves as CSV"
CART_FULL = f"must stay within {MAX_ORDER_LINES} products, what one order may hold"
#: Saved shipping addresses a customer may keep.
MAX_ADDRESSES = 20
ADDRESSES_FULL = (f"must stay within {MAX_ADDRESSES} saved addresses: remove one on your "
                  "account page")
#: A shipping address's fields: (form and JSON name, label, most characters, required).
ADDRESS_FIELDS = (("name", "Recipient", 200, True), ("line1", "Address", 200, True),
                  ("line2", "Address line 2", 200, False), ("city", "City", 100, True),
                  ("region", "Region or state", 100, False),
                  ("postalCode", "Postal code", 20, True), ("country", "Country", 100, True))
COUNTRY_RULE = "must be a country of the list (its ISO 3166-1 code, such as GB)"
#: The countries an address is shipped to (ISO 3166-1 alpha-2 code: English name), in the
#: order of their names: checkout's list, whose codes a new address keeps as its country
#: (an address saved before keeps the text it was given, and shows it).
COUNTRIES = {"AF": "Afghanistan", "AX": "Åland Islands", "AL": "Albania", "DZ": "Algeria",
             "AS": "American Samoa", "AD": "Andorra", "AO": "Angola", "AI": "Anguilla",
             "AQ": "Antarctica", "AG": "Antigua and Barbuda", "AR": "Argentina", "AM": "Armenia",
             "AW": "Aruba", "AU": "Australia", "AT": "Austria", "AZ": "Azerbaijan",
             "BS": "Bahamas", "BH": "Bahrain", "BD": "Bangladesh", "BB": "Barbados",
             "BY": "Belarus", "BE": "Belgium", "BZ": "Belize", "BJ": "Benin", "BM": "Bermuda",
             "BT": "Bhutan", "BO": "Bolivia", "BQ": "Bonaire, Sint Eustatius and Saba",
             "BA": "Bosnia and Herzegovina", "BW": "Botswana", "BV": "Bouvet Island",
             "BR": "Brazil", "IO": "British Indian Ocean Territory", "BN": "Brunei Darussalam",
             "BG": "Bulgaria", "BF": "Burkina Faso", "BI": "Burundi", "CV": "Cabo Verde",
             "KH": "Cambodia", "CM": "Cameroon", "CA": "Canada", "KY": "Cayman Islands",
             "CF": "Central African Republic", "TD": "Chad", "CL": "Chile", "CN": "China",
             "CX": "Christmas Island", "CC": "Cocos (Keeling) Islands", "CO": "Colombia",
             "KM": "Comoros", "CG": "Congo", "CD": "Congo, The Democratic Republic of the",
             "CK": "Cook Islands", "CR": "Costa Rica", "CI": "Côte d'Ivoire", "HR": "Croatia",
             "CU": "Cuba", "CW": "Curaçao", "CY": "Cyprus", "CZ": "Czechia", "DK": "Denmark",
             "DJ": "Djibouti", "DM": "Dominica", "DO": "Dominican Republic", "EC": "Ecuador",
             "EG": "Egypt", "SV": "El Salvador", "GQ": "Equatorial Guinea", "ER": "Eritrea",
             "EE": "Estonia", "SZ": "Eswatini", "ET": "Ethiopia",
             "FK": "Falkland Islands (Malvinas)", "FO": "Faroe Islands", "FJ": "Fiji",
             "FI": "Finland", "FR": "France", "GF": "French Guiana", "PF": "French Polynesia",
             "TF": "French Southern Territories", "GA": "Gabon", "GM": "Gambia", "GE": "Georgia",
             "DE": "Germany", "GH": "Ghana", "GI": "Gibraltar", "GR": "Greece", "GL": "Greenland",
             "GD": "Grenada", "GP": "Guadeloupe", "GU": "Guam", "GT": "Guatemala",
             "GG": "Guernsey", "GN": "Guinea", "GW": "Guinea-Bissau", "GY": "Guyana",
             "HT": "Haiti", "HM": "Heard Island and McDonald Islands",
             "VA": "Holy See (Vatican City State)", "HN": "Honduras", "HK": "Hong Kong",
             "HU": "Hungary", "IS": "Iceland", "IN": "India", "ID": "Indonesia", "IR": "Iran",
             "IQ": "Iraq", "IE": "Ireland", "IM": "Isle of Man", "IL": "Israel", "IT": "Italy",
             "JM": "Jamaica", "JP": "Japan", "JE": "Jersey", "JO": "Jordan", "KZ": "Kazakhstan",
             "KE": "Kenya", "KI": "Kiribati", "KW": "Kuwait", "KG": "Kyrgyzstan", "LA": "Laos",
             "LV": "Latvia", "LB": "Lebanon", "LS": "Lesotho", "LR": "Liberia", "LY": "Libya",
             "LI": "Liechtenstein", "LT": "Lithuania", "LU": "Luxembourg", "MO": "Macao",
             "MG": "Madagascar", "MW": "Malawi", "MY": "Malaysia", "MV": "Maldives", "ML": "Mali",
             "MT": "Malta", "MH": "Marshall Islands", "MQ": "Martinique", "MR": "Mauritania",
             "MU": "Mauritius", "YT": "Mayotte", "MX": "Mexico",
             "FM": "Micronesia, Federated States of", "MD": "Moldova", "MC": "Monaco",
             "MN": "Mongolia", "ME": "Montenegro", "MS": "Montserrat", "MA": "Morocco",
             "MZ": "Mozambique", "MM": "Myanmar", "NA": "Namibia", "NR": "Nauru", "NP": "Nepal",
             "NL": "Netherlands", "NC": "New Caledonia", "NZ": "New Zealand", "NI": "Nicaragua",
             "NE": "Niger", "NG": "Nigeria", "NU": "Niue", "NF": "Norfolk Island",
             "KP": "North Korea", "MK": "North Macedonia", "MP": "Northern Mariana Islands",
             "NO": "Norway", "OM": "Oman", "PK": "Pakistan", "PW": "Palau",
             "PS": "Palestine, State of", "PA": "Panama", "PG": "Papua New Guinea",
             "PY": "Paraguay", "PE": "Peru", "PH": "Philippines", "PN": "Pitcairn", "PL": "Poland",
             "PT": "Portugal", "PR": "Puerto Rico", "QA": "Qatar", "RE": "Réunion",
             "RO": "Romania", "RU": "Russian Federation", "RW": "Rwanda", "BL": "Saint Barthélemy",
             "SH": "Saint Helena, Ascension and Tristan da Cunha", "KN": "Saint Kitts and Nevis",
             "LC": "Saint Lucia", "MF": "Saint Martin (French part)",
             "PM": "Saint Pierre and Miquelon", "VC": "Saint Vincent and the Grenadines",
             "WS": "Samoa", "SM": "San Marino", "ST": "Sao Tome and Principe",
             "SA": "Saudi Arabia", "SN": "Senegal", "RS": "Serbia", "SC": "Seychelles",
             "SL": "Sierra Leone", "SG": "Singapore", "SX": "Sint Maarten (Dutch part)",
             "SK": "Slovakia", "SI": "Slovenia", "SB": "Solomon Islands", "SO": "Somalia",
             "ZA": "South Africa", "GS": "South Georgia and the South Sandwich Islands",
             "KR": "South Korea", "SS": "South Sudan", "ES": "Spain", "LK": "Sri Lanka",
             "SD": "Sudan", "SR": "Suriname", "SJ": "Svalbard and Jan Mayen", "SE": "Sweden",
             "CH": "Switzerland", "SY": "Syria", "TW": "Taiwan", "TJ": "Tajikistan",
             "TZ": "Tanzania", "TH": "Thailand", "TL": "Timor-Leste", "TG": "Togo",
             "TK": "Tokelau", "TO": "Tonga", "TT": "Trinidad and Tobago", "TN": "Tunisia",
             "TR": "Türkiye", "TM": "Turkmenistan", "TC": "Turks and Caicos Islands",
             "TV": "Tuvalu", "UG": "Uganda", "UA": "Ukraine", "AE": "United Arab Emirates",
             "GB": "United Kingdom", "US": "United States",
             "UM": "United States Minor Outlying Islands", "UY": "Uruguay", "UZ": "Uzbekistan",
             "VU": "Vanuatu", "VE": "Venezuela", "VN": "Vietnam", "VG": "Virgin Islands, British",
             "VI": "Virgin Islands, U.S.", "WF": "Wallis and Futuna", "EH": "Western Sahara",
             "YE": "Yemen", "ZM": "Zambia", "ZW": "Zimbabwe"}
RETURN_NOT_SHIPPED = "Only a shipped or delivered order can be returned."
#: The statuses of an order its buyer may return goods of.
RETURNABLE_ORDER_STATUSES = ("SHIPPED", "DELIVERED")
RATE_LIMITED_PAGE = "Too many requests from your address. Wait a minute and try again."
PASSWORD_SET = "Your password is set. Sign in with it."
EMAIL_VERIFIED = "Thank you: your email address is confirmed."
EMAIL_VERIFIED_ALREADY = "Your email address is confirmed already: sign in below."
#: Hours the old secret of a rotated webhook still signs, unless told otherwise.
WEBHOOK_SECRET_GRACE_HOURS = 24
#: Requests per minute of a new API key, unless told otherwise.
DEFAULT_KEY_RATE_LIMIT = 60
#: Delivery attempts shown per webhook (and kept, however old: see retention).
DELIVERIES_SHOWN = 5
MAX_CENTS = 2 ** 63 - 1
MAX_AMOUNT_CENTS = 10 ** 12  # a product price, and any amount an operator command takes
                            # (an invoice's: in its currency's minor unit)

#: A Stripe customer ID as Stripe writes them: cus_ and letters and digits, 255 at most.
STRIPE_CUSTOMER_PATTERN = r"cus_[A-Za-z0-9]{1,251}"
STRIPE_CUSTOMER_RULE = "must be a Stripe customer ID such as cus_NffrFeUfNV2Hib, or empty"
STRIPE_CUSTOMER_TAKEN = "This Stripe customer ID is already another company's."
STRIPE_SIGNATURE_MISSING = "Missing Stripe-Signature header."
STRIPE_SIGNATURE_MALFORMED = "Malformed Stripe-Signature header."
STRIPE_SIGNATURE_MISMATCH = "No v1 signature in Stripe-Signature matches the body."
STRIPE_SIGNATURE_EXPIRED = "Stripe-Signature timestamp is older than the tolerance."

CREDIT_LIMIT_MESSAGE = f"Credit limit must be between 0 and {MAX_CREDIT_LIMIT}."
TAX_RATE_MESSAGE = f"Tax rate override must be between 0 and {MAX_TAX_RATE}."
#: The company-wide rate's refusal (ours: the spec bounds only the customer's override).
COMPANY_TAX_RATE_MESSAGE = f"Tax rate must be a fraction between 0 and {MAX_TAX_RATE}."
TOO_MANY_WEBHOOKS = f"Maximum of {MAX_WEBHOOKS} webhooks per company."
IDEMPOTENCY_KEY_INVALID = (f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII "
                           "characters.")

#: A company's mail settings (company-update, the dashboard's Settings page).
MAX_MAIL_NAME = 100
MAX_STAFF_ALERTS = 10
MAIL_NAME_MESSAGE = f"Mail name must be 1 to {MAX_MAIL_NAME} characters on one line."
REPLY_TO_MESSAGE = "Reply-to must be an email address."
STAFF_ALERTS_MESSAGE = (f"Staff alerts must be at most {MAX_STAFF_ALERTS} email addresses, "
                        "separated by commas.")

#: A company's carriers (Settings, Carriers): each of the spec's codes but OTHER has a name
#: and a tracking-link template, whose {number} the tracking number replaces.
NAMED_CARRIERS = CARRIERS[:-1]
MAX_CARRIER_NAME = 60
CARRIER_NAME_RULE = f"must be 1 to {MAX_CARRIER_NAME} characters on one line"
CARRIER_TEMPLATE_RULE = ("must be an https:// or http:// address with {number} where the "
                         "tracking number goes")

#: The dashboard's webhook form, when the server delivers to no private address (the
#: allow-private-webhooks setting off): nothing is saved.
WEBHOOK_ADDRESS_REFUSED = ("this server never delivers there: {reason} Give an address "
                           "reachable from the internet")

#: Money owed (docs/money.md). Payment terms: an invoice falls due this many days after it is
#: issued (0: on receipt), the company's default or a customer's own.
MAX_PAYMENT_TERMS = 365
PAYMENT_TERMS_MESSAGE = (f"Payment terms must be a whole number of days from 0 to "
                         f"{MAX_PAYMENT_TERMS}.")
#: How invoices and credit notes are numbered, each in its own sequence per company.
INVOICE_NUMBER = "INV-{:06d}"
#: A company's first order's number (people say "order 1001", not "order 1").
FIRST_ORDER_NUMBER = 1001
CREDIT_NOTE_NUMBER = "CN-{:06d}"
INVOICE_STATUSES = ("OPEN", "PAID", "VOID")
#: A payment's method and reference, as staff type them.
MAX_PAYMENT_METHOD = 50
MAX_PAYMENT_REFERENCE = 100
#: Reminders of an overdue invoice: the first the day after its due date, then one a week,
#: this many at most.
MAX_REMINDERS = 3
REMINDER_INTERVAL_DAYS = 7
#: The receivables' aging: (label, fewest days past due, most), "current" not yet due; and
#: the open invoices (those due longest ago) and the customers (those owing most) its page
#: lists at most.
AGING_BUCKETS = (("Current", None, 0), ("1-30", 1, 30), ("31-60", 31, 60), ("61-90", 61, 90),
                 ("Over 90", 91, None))
RECEIVABLES_SHOWN = 100
CANCELLED_NOT_INVOICED = "A cancelled order is not invoiced."
#: The emails to buyers a company may turn off (Settings), with what each is about.
BUYER_NOTICES = {"order_cancelled": "an order is cancelled",
                 "return_approved": "a return is approved",
                 "return_refunded": "a return is refunded"}
BUYER_EMAILS_MESSAGE = f"Buyer emails off must be among {', '.join(BUYER_NOTICES)}."
#: Contacts, the people of a customer who sign in to its store (docs/contacts.md): what each
#: role may do there. The storefront's pages and the operations ask this one table.
CONTACT_ROLES = ("admin", "buyer", "bookkeeper")
ROLE_RIGHTS = {"admin": frozenset({"order", "statements", "manage"}),
               "buyer": frozenset({"order"}),
               "bookkeeper": frozenset({"statements"})}
CONTACT_ROLE_MESSAGE = f"Role must be one of {', '.join(CONTACT_ROLES)}."
#: Staff accounts (docs/dashboard.md): what each role may do on the dashboard. Each dashboard
#: form names the right it needs (page(..., right=)): it is refused to, and not shown to, a
#: role without it. work: the daily work; money: refunds, invoices, payments, credit;
#: company: settings, API keys, webhooks and staff.
STAFF_ROLES = ("owner", "staff", "read-only")
STAFF_RIGHTS = {"owner": frozenset({"own", "work", "money", "company"}),
                "staff": frozenset({"own", "work"}),
                "read-only": frozenset({"own"})}
STAFF_ROLE_MESSAGE = f"Role must be one of {', '.join(STAFF_ROLES)}."
STAFF_ROLE_REFUSED = ("Your role does not allow this: an owner of the company can do it, or "
                      "change your role on the Staff page.")
LAST_OWNER = "A company keeps at least one owner: make another staff member an owner first."
CONTACT_STATUS_MESSAGE = "Status must be ACTIVE or BLOCKED."
CONTACT_EXISTS = "An account with this email already exists at this store."
CONTACT_BLOCKED_INVITE = "A blocked contact cannot be invited to set a password."
ROLE_REFUSED = "Your role at this business does not allow this. Ask one of its admins."
LAST_ADMIN = "A business keeps at least one active admin."
APPROVAL_LIMIT_MESSAGE = f"Approval limit must be between 0 and {MAX_CREDIT_LIMIT}."
APPROVAL_LIMIT_ROLE = "only a buyer has one: admins approve orders, bookkeepers place none"
#: What became of a checkout above its buyer's approval limit.
REQUEST_STATUSES = ("PENDING", "APPROVED", "DECLINED")
REQUEST_DECIDED = "This request is decided already."
REQUEST_TOTAL_CHANGED = ("Prices or tax changed since this page was shown: the order would now "
                         "total {total}. Look at it again, then approve it or decline it.")
REQUEST_ASKER_BLOCKED = "The buyer who asked is blocked: decline the request instead."
#: Contacts a business's admins may invite within an hour (each invitation is an email).
INVITES_PER_HOUR = 20
TOO_MANY_INVITES = (f"At most {INVITES_PER_HOUR} invitations an hour: try again later.")
MAX_DECLINE_REASON = 500
#: The wholesale catalog (docs/catalog.md): quantity rules and price breaks, which storefront
#: and dashboard orders keep (the API keeps the spec's rules: any whole number, the catalog
#: price).
MAX_PRICE_BREAKS = 10
PRICE_BREAKS_RULE = (f"must be at most {MAX_PRICE_BREAKS} price breaks, each units (from 2, "
                     f"more than the one before) and a price, such as 10 40.00")
QUANTITY_RULE = "{name} is sold {rule}: {quantity} is not a quantity it is sold in."
QUANTITY_FITTED = "{name} is sold {rule}: your cart holds {quantity}."
#: Scheduled reports: their periods (days and ISO weeks, in UTC), how many missed periods a
#: process that starts after downtime catches up at most, and what the commands say.
REPORT_PERIODS = ("daily", "weekly")
REPORT_PERIOD_MESSAGE = "Report period must be daily, weekly or off."
TWO_STEP_MESSAGE = "Two-step sign-in must be owners or off."
TIME_ZONE_MESSAGE = "Time zone must be a name from the time zone database, such as Europe/Paris."
REPORT_CATCH_UP = 7
REPORT_SENT = "The {period} report of the period from {start} was sent already."
REPORT_NOWHERE = "The company has no staff alert addresses to send its report to."
#: How a store's catalog is sorted: newest first, by name, by catalog price (lowest first).
CATALOG_SORTS = ("newest", "name", "price")
CATALOG_ORDERS = {"newest": ("created_at", True), "name": ("name", False),
                  "price": ("price_cents", False)}
CATALOG_SORT_MESSAGE = f"Sort must be one of {', '.join(CATALOG_SORTS)}."
MAX_GROUP_NAME = 100
GROUP_EXISTS = "A group with this name already exists."
DISCOUNT_MESSAGE = "Discount must be a percentage from 0 to 100, with at most two decimals."
EXPORT_KINDS = ("orders", "products", "customers", "prices", "invoices")
EXPORT_KIND_MESSAGE = f"Export one of {', '.join(EXPORT_KINDS)}."
IMPORT_KINDS = ("products", "stock", "customers", "prices")
IMPORT_KIND_MESSAGE = f"Import one of {', '.join(IMPORT_KINDS)}."
#: An imported file's characters at most (some 20,000 products' rows).
MAX_IMPORT_CHARACTERS = 5_000_000
IMPORT_TOO_LONG = f"must be at most {MAX_IMPORT_CHARACTERS} characters"
IMPORT_COLUMNS_MISSING = "The first line must name the columns; missing: {columns}."
IMPORT_NOTE = ("A file in the columns export writes (the first line names them). Checking it "
               "writes nothing: you see what each line would do, then apply it.")
IMPORT_REFUSED = ("Nothing is written until every line is right: correct the file and check it "
                  "again.")
APPROVAL_NEEDED = ("Above your approval limit of {limit}, this order goes to your business's "
                   "admins: it is placed once one of them approves it.")
ROLE_NOTE = "You sign in for {business} as its {role}."
MAX_CANCEL_REASON = 500
INVOICE_STATUS_FILTER = f"Status must be one of {', '.join(INVOICE_STATUSES)}."
INVOICE_NOT_OPEN = "Invoice {number} is {status}: nothing more can be paid or credited to it."
INVOICE_SETTLED = "Invoice {number} has payments or credit applied: it cannot be voided."
CREDIT_OTHER_CUSTOMER = "A credit note applies only to invoices of its own customer."
CREDIT_USED_UP = "Credit note {number} has no credit left."
CREDIT_LIMIT_REACHED = ("This order ({total}) would take your account past its credit limit: "
                        "{available} is available. Pay open invoices, or order less.")


# 5.2 Validators ------------------------------------------------------------------------------

class Undone(Exception):
    """Raised in a transaction to undo it and still answer what its work found (a dry run, a
    file with refused lines); code: a command's exit code."""

    def __init__(self, result, code):
        super().__init__(result)
        self.result, self.code = result, code


class Refusals:
    """The checks of one form, each run whatever the one before it refused, so that a page
    can show every refusal at once: what a check() raises is kept, and raise_any() raises the
    first with the rest as its others. first=True raises each at once, as the API answers
    (the spec's first refusal, whatever else is wrong)."""

    def __init__(self, first=False):
        self.first = first
        self.refused = []

    @contextlib.contextmanager
    def check(self):
        try:
            yield
        except ApiError as error:
            if self.first:
                raise
            self.refused.extend([error, *error.others])

    def raise_any(self):
        if self.refused:
            first, *self.refused[0].others = self.refused
            raise first


class StockShortage(ApiError):
    """INSUFFICIENT_STOCK, with the product's name for the pages that show no counts."""

    def __init__(self, name, available, requested):
        super().__init__(400, INSUFFICIENT_STOCK.format(name=name, N=available, M=requested))
        self.product_name = name


def not_found(resource):
    return ApiError(404, NOT_FOUND.format(resource=resource))


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


def chosen_from(value, allowed, message):
    """value, if it is one of allowed; else refused with message."""
    if value not in allowed:
        raise ApiError(400, message)
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
    if len(email) > MAX_EMAIL or not _EMAIL.fullmatch(email):
        return False
    local, domain = email.rsplit("@", 1)
    labels = domain.split(".")
    return (len(local) <= 64 and len(labels) >= 2 and len(labels[-1]) >= 2
            and all(labels) and not local.startswith(".") and not local.endswith(".")
            and ".." not in local
            and all(not label.startswith("-") and not label.endswith("-") for label in labels))


def _ipv6_pattern():
    """Every text form of an IPv6 address (RFC 4291: groups, :: once, a dotted IPv4 tail), as
    ipaddress reads them; no zone."""
    group, octet = "[0-9A-Fa-f]{1,4}", "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    ipv4 = rf"{octet}(\.{octet}){{3}}"

    def groups(count, tail=""):   # count groups joined by colons, then tail
        if count == 0:
            return tail
        return f"({group}:){{{count - 1}}}{group}" + (f":{tail}" if tail else "")
    forms = [groups(8), groups(6, ipv4)]
    for left in range(8):
        for right in range(8 - left):
            forms.append(f"{groups(left)}::{groups(right)}")
            if left + right <= 5:
                forms.append(f"{groups(left)}::{groups(right, ipv4)}" if right else
                             f"{groups(left)}::{ipv4}")
    return "(" + "|".join(forms) + ")"


_LABEL = "[A-Za-z0-9]([A-Za-z0-9_-]*[A-Za-z0-9])?"
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
#: The URLs the service accepts (webhooks, tracking links, images), in the regular-expression
#: syntax shared by Python and ECMA-262, so that the OpenAPI document publishes this very
#: rule: http or https in any case; a host that is a DNS name (letters, digits, hyphens and
#: underscores, no label starting or ending with a hyphen, an optional final dot, at most 253
#: characters), or an IPv6 address in brackets (an IPv4 address is a name of digits); no user
#: or password; an optional port up to 65535; then any printable ASCII.
HTTP_URL_PATTERN = (rf"^[Hh][Tt][Tt][Pp][Ss]?://(?![^:/?#]{{254}})"
                    rf"({_LABEL}(\.{_LABEL})*\.?|\[{_ipv6_pattern()}\])"
                    rf"(:{_PORT})?([/?#][!-~]*)?$")
_HTTP_URL = re.compile(HTTP_URL_PATTERN)


def valid_http_url(url):
    return isinstance(url, str) and len(url) <= MAX_URL and _HTTP_URL.fullmatch(url) is not None


# ---------------------------------------------------------------------------------------------
# 6. Records
# ---------------------------------------------------------------------------------------------
# product_json and order_json have twins that the database runs for the API's reads (see
# 11.3, "Records as the database writes them"): change a field in both, and the
# byte-for-byte test of the reads tells whether they still agree.

#: A record's fields as the API shows them, in order: (API name, column, kind). Kinds:
#: "value" (as stored), "money" (cents, shown as money()), "flag" (0 or 1, shown as a
#: boolean), "json" (JSON text, shown as the value it holds), "list" (JSON text of a list,
#: NULL for none: shown as [] then), "words" (text of words separated by spaces, shown as
#: their list), "minor" (an amount in the minor unit of the row's currency, shown as
#: money_in()) and "record" (its column is another field table, read from the same row: a
#: record within the record). The record's function here and, for products and orders, the
#: SQL that has the database write the same JSON (11.3) are both made from its table: a
#: field is one line.
PRODUCT_FIELDS = (
    ("id", "id", "value"), ("name", "name", "value"), ("sku", "sku", "value"),
    ("description", "description", "value"), ("category", "category", "value"),
    ("unit", "unit", "value"), ("price", "price_cents", "money"), ("stock", "stock", "value"),
    ("imageUrl", "image_url", "value"), ("isActive", "is_active", "flag"),
    ("createdAt", "created_at", "value"), ("updatedAt", "updated_at", "value"))
CUSTOMER_FIELDS = (
    ("id", "id", "value"), ("email", "email", "value"), ("name", "name", "value"),
    ("status", "status", "value"), ("notes", "notes", "value"),
    ("creditLimit", "credit_limit_cents", "money"),
    ("taxRateOverride", "tax_rate_override", "value"),
    ("emailVerified", "email_verified", "flag"), ("createdAt", "created_at", "value"),
    ("updatedAt", "updated_at", "value"))
CONTACT_FIELDS = (
    ("id", "id", "value"), ("customerId", "customer_id", "value"), ("email", "email", "value"),
    ("name", "name", "value"), ("role", "role", "value"), ("status", "status", "value"),
    ("approvalLimit", "approval_limit_cents", "money"),
    ("emailVerified", "email_verified", "flag"))
ORDER_ITEM_FIELDS = (
    ("id", "id", "value"), ("quantity", "quantity", "value"),
    ("unitPrice", "unit_price_cents", "money"), ("productId", "product_id", "value"),
    ("productName", "product_name", "value"), ("productSku", "product_sku", "value"))
#: An order's own fields; its tracking (TRACKING_FIELDS, or null without a carrier) and
#: its items follow them.
ORDER_FIELDS = (
    ("id", "id", "value"), ("status", "status", "value"), ("poNumber", "po_number", "value"),
    ("notes", "notes", "value"), ("total", "total_cents", "money"),
    ("createdAt", "created_at", "value"), ("updatedAt", "updated_at", "value"),
    ("customerId", "customer_id", "value"))
TRACKING_FIELDS = (("carrier", "tracking_carrier", "value"),
                   ("number", "tracking_number", "value"), ("url", "tracking_url", "value"))
#: A webhook's secretRotationGraceExpiresAt is shown only while it is to come (webhook_json).
WEBHOOK_FIELDS = (
    ("id", "id", "value"), ("url", "url", "value"), ("events", "events", "json"),
    ("isActive", "is_active", "flag"),
    ("secretRotationGraceExpiresAt", "grace_expires_at", "value"),
    ("createdAt", "created_at", "value"), ("updatedAt", "updated_at", "value"))
#: A webhook's new secret, as rotate_webhook_secret answers (shown this once), and until when
#: the old one still signs.
WEBHOOK_SECRET_FIELDS = (
    ("id", "id", "value"), ("secret", "secret", "value"),
    ("secretRotationGraceExpiresAt", "grace_expires_at", "value"))
#: A delivery attempt, read with its event's name (event) and body.
DELIVERY_FIELDS = (
    ("id", "id", "value"), ("event", "event", "value"), ("payload", "body", "json"),
    ("statusCode", "status_code", "value"), ("responseBody", "response_body", "value"),
    ("durationMs", "duration_ms", "value"), ("success", "success", "flag"),
    ("createdAt", "attempted_at", "value"))
#: A return's own fields; its lines and its refund follow them (return_json).
RETURN_FIELDS = (
    ("id", "id", "value"), ("orderId", "order_id", "value"),
    ("customerId", "customer_id", "value"), ("status", "status", "value"),
    ("reason", "reason", "value"), ("itemCount", "item_count", "value"),
    ("actor", "actor", "value"), ("createdAt", "created_at", "value"),
    ("updatedAt", "updated_at", "value"))
REFUND_BREAKDOWN_FIELDS = (
    ("goodUnits", "good_units", "value"), ("damagedUnits", "damaged_units", "value"),
    ("subtotal", "subtotal_cents", "money"))
REFUND_FIELDS = (
    ("id", "id", "value"), ("amount", "amount_cents", "money"), ("method", "method", "value"),
    ("breakdown", REFUND_BREAKDOWN_FIELDS, "record"), ("createdAt", "created_at", "value"))
#: A refund as refund_return answers and refund.processed carries it: read with its return's
#: order_id and customer_id.
PROCESSED_REFUND_FIELDS = (
    ("id", "id", "value"), ("returnId", "return_id", "value"),
    ("orderId", "order_id", "value"), ("customerId", "customer_id", "value"),
    ("amount", "amount_cents", "money"), ("method", "method", "value"),
    ("breakdown", REFUND_BREAKDOWN_FIELDS, "record"))
#: Who made a movement (see Actor).
ACTOR_FIELDS = (("type", "actor_type", "value"), ("id", "actor_id", "value"))
#: A stock movement: signed change, the level after it, why, what it belongs to, who.
MOVEMENT_FIELDS = (
    ("id", "id", "value"), ("productId", "product_id", "value"),
    ("change", "change", "value"), ("levelAfter", "level_after", "value"),
    ("reason", "reason", "value"), ("orderId", "order_id", "value"),
    ("returnId", "return_id", "value"), ("note", "note", "value"),
    ("actor", ACTOR_FIELDS, "record"), ("createdAt", "created_at", "value"))
CUSTOMER_PRICE_FIELDS = (
    ("customerId", "customer_id", "value"), ("productId", "product_id", "value"),
    ("price", "price_cents", "money"), ("updatedAt", "updated_at", "value"))
STAFF_FIELDS = (("id", "id", "value"), ("email", "email", "value"),
                ("companyId", "company_id", "value"), ("role", "role", "value"))
COMPANY_FIELDS = (
    ("id", "id", "value"), ("name", "name", "value"), ("slug", "slug", "value"),
    ("stripeCustomerId", "stripe_customer_id", "value"), ("mailName", "mail_name", "value"),
    ("replyTo", "reply_to", "value"), ("staffAlerts", "staff_alerts", "list"),
    ("storefrontApproval", "storefront_approval", "value"), ("taxRate", "tax_rate", "value"),
    ("paymentTermsDays", "payment_terms_days", "value"),
    ("buyerEmailsOff", "buyer_emails_off", "list"), ("reportPeriod", "report_period", "value"),
    ("timeZone", "time_zone", "value"), ("twoStep", "two_step", "value"),
    ("createdAt", "created_at", "value"))
#: A new company as create_company answers (it has no settings yet).
NEW_COMPANY_FIELDS = COMPANY_FIELDS[:3]
#: A new API key as create_api_key answers: the key itself, which only its creation has (the
#: table keeps its hash), and what it may do.
NEW_KEY_FIELDS = (
    ("id", "id", "value"), ("key", "key", "value"), ("companyId", "company_id", "value"),
    ("scopes", "scopes", "words"), ("rateLimit", "rate_limit", "value"),
    ("expiresAt", "expires_at", "value"))
#: An invoice of an order to its customer (money owed, not the company's subscription), read
#: with its balance (customer_invoice_json).
CUSTOMER_INVOICE_FIELDS = (
    ("id", "id", "value"), ("number", "number", "value"), ("orderId", "order_id", "value"),
    ("customerId", "customer_id", "value"), ("status", "status", "value"),
    ("issuedAt", "issued_at", "value"), ("dueAt", "due_at", "value"),
    ("paymentTermsDays", "terms_days", "value"), ("subtotal", "subtotal_cents", "money"),
    ("taxRate", "tax_rate", "value"), ("tax", "tax_cents", "money"),
    ("total", "total_cents", "money"), ("paid", "paid_cents", "money"),
    ("credited", "credited_cents", "money"), ("balance", "balance_cents", "money"),
    ("remindersSent", "reminders_sent", "value"), ("updatedAt", "updated_at", "value"))
PAYMENT_FIELDS = (
    ("id", "id", "value"), ("invoiceId", "invoice_id", "value"),
    ("amount", "amount_cents", "money"), ("paidAt", "paid_at", "value"),
    ("method", "method", "value"), ("reference", "reference", "value"),
    ("createdAt", "created_at", "value"))
CREDIT_NOTE_FIELDS = (
    ("id", "id", "value"), ("number", "number", "value"),
    ("customerId", "customer_id", "value"), ("refundId", "refund_id", "value"),
    ("amount", "amount_cents", "money"), ("remaining", "remaining_cents", "money"),
    ("createdAt", "created_at", "value"))
CREDIT_APPLICATION_FIELDS = (
    ("id", "id", "value"), ("creditNoteId", "credit_note_id", "value"),
    ("invoiceId", "invoice_id", "value"), ("amount", "amount_cents", "money"),
    ("createdAt", "created_at", "value"))
#: A paid invoice of the company's subscription, as invoice.paid carries it.
INVOICE_FIELDS = (
    ("stripeInvoiceId", "stripe_invoice_id", "value"),
    ("amountPaid", "amount_paid_minor", "minor"), ("currency", "currency", "value"),
    ("hostedInvoiceUrl", "hosted_invoice_url", "value"), ("number", "number", "value"),
    ("periodStart", "period_start", "value"), ("periodEnd", "period_end", "value"))

#: How each kind of field is read: (row, column) to the value shown.
_SHOWN_AS = {
    "value": lambda row, column: row[column],
    "money": lambda row, column: money(row[column]),
    "flag": lambda row, column: bool(row[column]),
    "json": lambda row, column: json.loads(row[column]),
    "list": lambda row, column: json.loads(row[column] or "[]"),
    "words": lambda row, column: row[column].split(),
    "minor": lambda row, column: money_in(row[column], row["currency"]),
    "record": lambda row, fields: record_json(fields, row),
}


def record_json(fields, row):
    """A row, read by column name, as the record its field table describes."""
    return {name: _SHOWN_AS[kind](row, column) for name, column, kind in fields}


def product_json(row):
    return record_json(PRODUCT_FIELDS, row)


def customer_json(row):
    return record_json(CUSTOMER_FIELDS, row)


def contact_json(row):
    return record_json(CONTACT_FIELDS, row)


def order_item_json(row):
    """row: an order item's columns and its product's name and SKU (product_name,
    product_sku)."""
    return record_json(ORDER_ITEM_FIELDS, row)


def line_total_cents(item):
    """An order item's (as order_item_json shows it) unitPrice times its quantity, in cents."""
    return cents_from_number(item["unitPrice"]) * item["quantity"]


def order_json(row, items):
    record = record_json(ORDER_FIELDS, row)
    record["tracking"] = None if row["tracking_carrier"] is None else record_json(
        TRACKING_FIELDS, row)
    record["items"] = [order_item_json(item) for item in items]
    return record


def webhook_json(row, with_secret=False, at=None):
    """A webhook; with_secret, its secret too (its creation's answer). Its grace window is
    shown while it is to come at at (ISO text; now by default)."""
    record = record_json(WEBHOOK_FIELDS + (("secret", "secret", "value"),) if with_secret
                         else WEBHOOK_FIELDS, row)
    grace = record["secretRotationGraceExpiresAt"]
    if not (grace and grace > (at or now_iso())):
        record["secretRotationGraceExpiresAt"] = None  # its place in the record stays
    return record


def delivery_json(row):
    return record_json(DELIVERY_FIELDS, row)


def return_json(row, lines=(), refund=None):
    """A return with its lines (rows: order item ID, product ID, units; none for a return
    opened before lines were recorded) and its refund's row, or None before it."""
    record = record_json(RETURN_FIELDS, row)
    record["lines"] = [{"orderItemId": item_id, "productId": product_id, "units": units}
                       for item_id, product_id, units in lines]
    record["refund"] = None if refund is None else refund_json(refund)
    return record


def refund_json(row):
    return record_json(REFUND_FIELDS, row)


def movement_json(row):
    return record_json(MOVEMENT_FIELDS, row)


def customer_price_json(row):
    return record_json(CUSTOMER_PRICE_FIELDS, row)


def staff_json(row):
    return record_json(STAFF_FIELDS, row)


def company_json(row):
    return record_json(COMPANY_FIELDS, row)


def invoice_json(row):
    return record_json(INVOICE_FIELDS, row)


def balance_cents(invoice):
    """What an invoice (a row) still owes: its total less its payments and applied credit;
    nothing, once void."""
    if invoice["status"] == "VOID":
        return 0
    return invoice["total_cents"] - invoice["paid_cents"] - invoice["credited_cents"]


def customer_invoice_json(row):
    return record_json(CUSTOMER_INVOICE_FIELDS, dict(row, balance_cents=balance_cents(row)))


def payment_json(row):
    return record_json(PAYMENT_FIELDS, row)


def credit_note_json(row):
    return record_json(CREDIT_NOTE_FIELDS, row)


def credit_application_json(row):
    return record_json(CREDIT_APPLICATION_FIELDS, row)


def orders_json(order_rows, item_rows):
    """Orders with their items; item_rows are those of all of them, each ending with its
    order's ID, in order."""
    items = collections.defaultdict(list)
    for item in item_rows:
        items[item["order_id"]].append(item)
    return [order_json(row, items[row["id"]]) for row in order_rows]


# ---------------------------------------------------------------------------------------------
# 7. Events and tenancy
# ---------------------------------------------------------------------------------------------
# Sections 7 to 11 are the operations: what the business does, callable without HTTP. Each
# takes a connection inside a write transaction that its caller opened (so a route can store
# its idempotency record in the same one), checks tenancy through load_row and emits its
# events. They are peers: none reaches forward to a later one.
#
# What they return is one rule. An operation that creates, changes or deletes something
# returns what is answered for it: the record as its field table in Records shows it (what
# the API answers, or where the API has no route what a command prints; or a list of them,
# as a restock's movements), or, for what leaves no record to show (a delete, a revocation, a
# disabled account, a cleared price, an email sent again), a small answer in the API's words
# ({"id": ..., "deleted": true}); a change with nothing to show (a cart line's quantity, an
# address) and a request whose answer must not tell whether an address has an account return
# None. Lookups and queries (load_*, find_*, require_*, *_of, the paginator, the cart, a
# stock history) return rows; the reads that need more than a row to make a record
# (order_with_items, return_record, returns_json, recent_deliveries, the api_* of 11.3)
# return records. The writers beneath the operations (insert_row, record_movements, emit,
# queue_email; the idempotency keys, sessions, sign-in throttle and emailed links of 10.3 to
# 10.5) return what their callers need: an ID, a token, a wait. So routes, pages and commands
# never make a record of an operation's answer again: a route puts it in its envelope, a page
# reads it by the API's names, a command prints it.


# 7.1 Events ----------------------------------------------------------------------------------

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
    announce(event_id)
    return event_id


# 7.2 Email -----------------------------------------------------------------------------------
# An email is written like an event, in the caller's transaction, to one recipient; the
# outbox's email channel sends it after the commit (see Outbox, Email). Its ID joins the
# transaction's emitted IDs, so that an operator command sends its emails before it exits as
# it delivers its events.

def queue_email(conn, company_id, kind, to_address, data, to_name=None):
    """Write an email of a kind of EMAIL_TEMPLATES to one address; returns its ID."""
    assert kind in EMAIL_TEMPLATES, kind
    email_id, at = new_id_at("eml")
    conn.execute(
        "INSERT INTO emails (id, company_id, kind, to_address, to_name, subject, data, "
        "queued_at, next_attempt_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (email_id, company_id, kind, to_address, to_name,
         plain(EMAIL_TEMPLATES[kind].subject, **data), json_text(data), at, at, at))
    announce(email_id)
    return email_id


# 7.3 Rows and tenancy ------------------------------------------------------------------------

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


#: The table of each kind of record an operator command may name by its ID alone.
_TABLE_OF = {"Product": "products", "Customer": "customers", "Order": "orders",
             "Return": "returns", "Webhook": "webhooks", "API key": "api_keys",
             "Staff account": "staff", "Invoice": "customer_invoices", "Contact": "contacts",
             "Credit note": "credit_notes"}


def company_of(conn, resource, row_id):
    """The company a record belongs to, for the operator commands, which name records by ID
    alone (the operations then check tenancy as for everyone else)."""
    row = conn.execute(f"SELECT company_id FROM {_TABLE_OF[resource]} WHERE id = ?",
                       (row_id,)).fetchone()
    if row is None:
        raise not_found(resource)
    return row["company_id"]


# ---------------------------------------------------------------------------------------------
# 8. Catalog and customers
# ---------------------------------------------------------------------------------------------

# 8.1 Companies -------------------------------------------------------------------------------

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
    row = {"id": company_id, "name": name, "slug": slug, "created_at": at}
    insert_row(conn, "companies", row)
    return record_json(NEW_COMPANY_FIELDS, row)


def _stripe_customer(value):
    value = (value or "").strip() or None
    if value is not None and not re.fullmatch(STRIPE_CUSTOMER_PATTERN, value):
        raise invalid("stripeCustomerId", STRIPE_CUSTOMER_RULE)
    return value


def _mail_name(value):
    value = (value or "").strip() or None
    if value is not None and (len(value) > MAX_MAIL_NAME or one_line(value) != value):
        raise ApiError(400, MAIL_NAME_MESSAGE)
    return value


def _reply_to(value):
    value = (value or "").strip() or None
    if value is not None and not valid_email(value):
        raise ApiError(400, REPLY_TO_MESSAGE)
    return value


def _staff_alerts(value):
    """A list of addresses, each once however its case is written, stored as JSON."""
    unique = {}
    for address in value or ():
        if address.strip():
            unique.setdefault(address.strip().casefold(), address.strip())
    addresses = list(unique.values())
    if len(addresses) > MAX_STAFF_ALERTS or not all(map(valid_email, addresses)):
        raise ApiError(400, STAFF_ALERTS_MESSAGE)
    return json_text(addresses) if addresses else None


def _storefront_approval(value):
    if value not in STOREFRONT_APPROVALS:
        raise ApiError(400, STOREFRONT_APPROVAL_MESSAGE)
    return value


def _tax_rate(value):
    """A fraction from 0 to MAX_TAX_RATE, given as a number or its text (empty: 0, no tax)."""
    text = "0" if value is None else str(getattr(value, "text", value)).strip() or "0"
    try:
        rate = decimal.Decimal(text)
    except decimal.InvalidOperation:
        raise ApiError(400, COMPANY_TAX_RATE_MESSAGE) from None
    if not rate.is_finite() or not 0 <= rate <= decimal.Decimal(repr(MAX_TAX_RATE)):
        raise ApiError(400, COMPANY_TAX_RATE_MESSAGE)
    return float(rate)


def payment_terms(value):
    """Days from an invoice's issue to its due date, 0 (on receipt) to MAX_PAYMENT_TERMS, given
    as a whole number or its text."""
    text = str(value).strip() if value is not None else ""
    if isinstance(value, bool) or not re.fullmatch(r"\d{1,3}", text) or \
            int(text) > MAX_PAYMENT_TERMS:
        raise ApiError(400, PAYMENT_TERMS_MESSAGE)
    return int(text)


def _buyer_emails_off(value):
    """The buyer emails a company does not send: a list of BUYER_NOTICES' kinds."""
    value = [] if value is None else value
    if not isinstance(value, (list, tuple)) or not set(value) <= set(BUYER_NOTICES):
        raise ApiError(400, BUYER_EMAILS_MESSAGE)
    kinds = sorted(set(value))
    return json_text(kinds) if kinds else None


def _time_zone(value):
    """An IANA time zone name this machine knows (Europe/Paris); empty is UTC."""
    value = (value or "").strip() or None
    if value is not None and value not in time_zones():
        raise ApiError(400, TIME_ZONE_MESSAGE)
    return None if value == "UTC" else value


def _two_step(value):
    if value in (None, "", "off"):
        return None
    if value != "owners":
        raise ApiError(400, TWO_STEP_MESSAGE)
    return value


def _report_period(value):
    if value in (None, "", "off"):
        return None
    if value not in REPORT_PERIODS:
        raise ApiError(400, REPORT_PERIOD_MESSAGE)
    return value


#: The company's settings update_company changes: column, and the check that returns the value
#: to store (None clears it). A new setting is a column and a line here.
COMPANY_SETTINGS = {"stripe_customer_id": _stripe_customer, "mail_name": _mail_name,
                    "reply_to": _reply_to, "staff_alerts": _staff_alerts,
                    "storefront_approval": _storefront_approval, "tax_rate": _tax_rate,
                    "payment_terms_days": payment_terms, "buyer_emails_off": _buyer_emails_off,
                    "report_period": _report_period, "time_zone": _time_zone,
                    "two_step": _two_step}


def update_company(conn, company_id, changes):
    """Change some of a company's settings ({column of COMPANY_SETTINGS: value}; None or empty
    clears one); returns the company (company_json). Of mail: mail_name (the display name of
    its emails' From), reply_to and staff_alerts (the addresses that get staff alerts, a
    list); of the storefront: storefront_approval (required or automatic). A Stripe customer
    is at most one company's (its paid invoices are that company's invoice.paid)."""
    unknown = sorted(set(changes) - set(COMPANY_SETTINGS))
    if unknown:
        raise invalid(unknown[0], "is not a company setting")
    refusals, checked = Refusals(), {}  # Settings' every refusal at once
    for column, value in changes.items():
        with refusals.check():
            checked[column] = COMPANY_SETTINGS[column](value)
    refusals.raise_any()
    before = load_company(conn, company_id)
    customer = checked.get("stripe_customer_id")
    if customer is not None and conn.execute(
            "SELECT 1 FROM companies WHERE stripe_customer_id = ? AND id <> ?",
            (customer, company_id)).fetchone():
        raise ApiError(409, STRIPE_CUSTOMER_TAKEN)
    changed = {column: value for column, value in checked.items() if before[column] != value}
    if changed:
        conn.execute(f"UPDATE companies SET {', '.join(f'{c} = ?' for c in changed)} "
                     "WHERE id = ?", [*changed.values(), company_id])
    return company_json(load_company(conn, company_id))


def company_carriers(conn, company_id, templates=DEFAULT_TRACKING_URL_TEMPLATES):
    """{code: {"name", "template"}} of each of the spec's carrier codes: the company's own
    name and template where Settings set them, else "Carrier A" (and so on) and templates'
    (the server's: ORDERING_TRACKING_URL_TEMPLATES). OTHER has no template: its URL is given
    with each shipment."""
    carriers = {code: {"name": code.replace("_", " ").title(), "template": templates.get(code)}
                for code in CARRIERS}
    carriers["OTHER"]["name"] = "Other carrier"
    for row in conn.execute("SELECT code, name, url_template FROM carriers WHERE "
                            "company_id = ?", (company_id,)):
        carriers[row["code"]] = {"name": row["name"], "template": row["url_template"]}
    return carriers


def set_company_carriers(conn, company_id, carriers, templates=DEFAULT_TRACKING_URL_TEMPLATES):
    """Names and tracking-link templates of some of the company's carriers ({code: {"name",
    "template"}}, codes of NAMED_CARRIERS); every refusal at once, each at its field
    (CODE.name, CODE.template). A carrier set to its defaults (company_carriers', of
    templates) keeps no row, so that it follows the server's template if that changes."""
    defaults = company_carriers(conn, None, templates)
    details, rows = [], []
    for code, carrier in carriers.items():
        if code not in NAMED_CARRIERS:
            raise invalid("code", f"must be one of {', '.join(NAMED_CARRIERS)}")
        name = one_line(carrier.get("name"))
        template = (carrier.get("template") or "").strip()
        if not 1 <= len(name) <= MAX_CARRIER_NAME:
            details.append({"field": f"{code}.name", "rule": CARRIER_NAME_RULE})
        if not valid_http_url(template) or "{number}" not in template:
            details.append({"field": f"{code}.template", "rule": CARRIER_TEMPLATE_RULE})
        rows.append((company_id, code, name, template))
    if details:
        raise ApiError(400, VALIDATION_FAILED, details=details)
    conn.executemany("DELETE FROM carriers WHERE company_id = ? AND code = ?",
                     [row[:2] for row in rows])
    conn.executemany("INSERT INTO carriers (company_id, code, name, url_template) "
                     "VALUES (?, ?, ?, ?)", [row for row in rows if defaults[row[1]] != {
                         "name": row[2], "template": row[3]}])
    return company_carriers(conn, company_id, templates)


def company_with_slug(conn, slug):
    """The company whose storefront is at this slug, or None."""
    return conn.execute("SELECT * FROM companies WHERE slug = ?", (slug,)).fetchone()


def company_by_slug(conn, store_slug):
    row = company_with_slug(conn, store_slug)
    if row is None:
        raise not_found("Store")
    return row


# 8.2 Stock movements -------------------------------------------------------------------------
# Every change of a product's stock is a movement, written in the transaction that changes the
# stock, so that the sum of a product's movements is its stock (the write lock makes each
# read of a level and the write after it one step). Order placement writes its own (all
# its lines at once); every other change is a product edit and goes through
# move_stock: product.updated, and product.low_stock (triggeringOrderId null) when the level
# reaches the threshold, re-armed when it rises above it.

#: Who made a change: a type of ACTOR_TYPES and, for staff, a key or a buyer, its ID.
Actor = collections.namedtuple("Actor", "type id")
SYSTEM = Actor("system", None)
COMMAND = Actor("command", None)

MOVEMENT_COLUMNS = ("id", "company_id", "product_id", "change", "level_after", "reason",
                    "order_id", "return_id", "note", "actor_type", "actor_id", "created_at")
_INSERT_MOVEMENT = (f"INSERT INTO stock_movements ({', '.join(MOVEMENT_COLUMNS)}) VALUES "
                    f"({', '.join('?' * len(MOVEMENT_COLUMNS))})")


def record_movements(conn, company_id, movements, at):
    """Write movements, (product ID, change, level after, reason, order ID, return ID, note,
    actor) each; returns their rows (values in MOVEMENT_COLUMNS order)."""
    rows = [(new_id("mov"), company_id, product_id, change, level, reason, order_id,
             return_id, note, actor.type, actor.id, at)
            for product_id, change, level, reason, order_id, return_id, note, actor in movements]
    conn.executemany(_INSERT_MOVEMENT, rows)
    return rows


# 8.3 Products --------------------------------------------------------------------------------
# Written by the dashboard and the operator commands; read-only over the API.

def load_product(conn, company_id, product_id):
    return load_row(conn, "products", "Product", company_id, product_id)


_PRODUCT_FIELDS = ("name", "sku", "description", "category", "unit", "price_cents", "stock",
                   "image_url", "is_active", "low_stock_threshold", "min_quantity",
                   "order_multiple", "price_breaks")


def check_price_breaks(breaks):
    """A product's price breaks, [[units, price in cents], ...] by units ascending, checked
    (None for none)."""
    if not isinstance(breaks, list) or len(breaks) > MAX_PRICE_BREAKS:
        raise invalid("priceBreaks", PRICE_BREAKS_RULE)
    last = 1
    for pair in breaks:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
                and last < pair[0] <= MAX_QUANTITY and 0 <= pair[1] <= MAX_AMOUNT_CENTS):
            raise invalid("priceBreaks", PRICE_BREAKS_RULE)
        last = pair[0]
    return [list(pair) for pair in breaks] or None


def parse_price_breaks(text):
    """Price breaks as people write them, one a line or separated by ";": units and a price,
    such as "10 40.00; 50: 38.00"."""
    breaks = []
    for entry in filter(None, (e.strip() for e in re.split(r"[;\n]", text or ""))):
        parts = re.split(r"[\s:=]+", entry)
        cents = cents_from_text(parts[1]) if len(parts) == 2 else None
        if cents is None or not re.fullmatch(r"\d{1,10}", parts[0]):
            raise invalid("priceBreaks", PRICE_BREAKS_RULE)
        breaks.append([int(parts[0]), cents])
    return check_price_breaks(breaks)


def price_breaks_of(product):
    """[(units, price in cents)] of a product (a row), by units ascending."""
    stored = product["price_breaks"]  # most products have none: no JSON to read, per row
    return [tuple(pair) for pair in json.loads(stored)] if stored else []


def price_breaks_text(product):
    """A product's price breaks as parse_price_breaks reads them ("10 40.00; 50 38.00")."""
    return "; ".join(f"{units} {decimal_text(cents)}" for units, cents in price_breaks_of(product))


def quantity_rule_text(product):
    """A product's quantity rule in words ("from 12 units, in cases of 6"), "" for none."""
    words = []
    if product["min_quantity"] > 1:
        words.append(f"from {product['min_quantity']} units")
    if product["order_multiple"] > 1:
        words.append(f"in cases of {product['order_multiple']}")
    return ", ".join(words)


def fitted_quantity(product, quantity):
    """The least quantity at or above quantity that the product's rules allow."""
    least = max(quantity, product["min_quantity"])
    return -(-least // product["order_multiple"]) * product["order_multiple"]


def _check_product_fields(fields):
    """Refuses what no product may hold, every field's refusal at once (see Refusals)."""
    refusals, price = Refusals(), fields.get("price_cents")
    for field, refused, rule in (
            ("name", "name" in fields and not (fields["name"] or "").strip(), "is required"),
            ("unit", "unit" in fields and not (fields["unit"] or "").strip(), "must not be empty"),
            ("price", "price_cents" in fields and not (
                isinstance(price, int) and 0 <= price <= MAX_AMOUNT_CENTS),
             f"must be an amount from 0 to {money(MAX_AMOUNT_CENTS)}"),
            ("stock", "stock" in fields and not (
                isinstance(fields["stock"], int) and 0 <= fields["stock"] <= MAX_QUANTITY),
             f"must be a whole number from 0 to {MAX_QUANTITY}"),
            ("lowStockThreshold", fields.get("low_stock_threshold") is not None and not (
                isinstance(fields["low_stock_threshold"], int)
                and fields["low_stock_threshold"] >= 0), "must be a whole number >= 0"),
            ("imageUrl", fields.get("image_url") is not None
             and not valid_http_url(fields["image_url"]), "must be an http or https URL"),
            *((field, column in fields and not (isinstance(fields[column], int)
                                                and 1 <= fields[column] <= MAX_QUANTITY),
               f"must be a whole number from 1 to {MAX_QUANTITY}")
              for column, field in (("min_quantity", "minQuantity"),
                                    ("order_multiple", "orderMultiple")))):
        with refusals.check():
            if refused:
                raise invalid(field, rule)
    with refusals.check():
        if fields.get("price_breaks") is not None:
            breaks = check_price_breaks(fields["price_breaks"])
            fields["price_breaks"] = breaks and json_text(breaks)
    refusals.raise_any()
    unknown = set(fields) - set(_PRODUCT_FIELDS)
    if unknown:
        raise invalid(sorted(unknown)[0], "is not a product field")


def create_product(conn, company_id, actor=None, opening="initial", **fields):
    """A new product (no event); its stock opens its ledger with one movement of reason
    opening (initial, or import for a catalog loaded in bulk), made by actor."""
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
    record_movements(conn, company_id, [(product_id, row["stock"], row["stock"], opening, None,
                                         None, None, actor or SYSTEM)], at)
    return product_json(load_product(conn, company_id, product_id))


#: The note of the adjustment a product edit that changes its stock records.
PRODUCT_EDIT_NOTE = "stock set by editing the product"


def update_product(conn, company_id, product_id, actor=None, **changes):
    """A dashboard edit: emits product.updated (the lighter payload for an active toggle alone)
    and product.low_stock when the new stock reaches the threshold. A new stock is an
    adjustment movement (PRODUCT_EDIT_NOTE) made by actor."""
    _check_product_fields(changes)
    before = load_product(conn, company_id, product_id)
    if "is_active" in changes:
        changes["is_active"] = int(bool(changes["is_active"]))
    changed = update_changed(conn, "products", before, changes)
    if not changed:
        return product_json(before)
    after = load_product(conn, company_id, product_id)
    if "stock" in changed:
        record_movements(conn, company_id, [
            (product_id, after["stock"] - before["stock"], after["stock"], "adjustment", None,
             None, PRODUCT_EDIT_NOTE, actor or SYSTEM)], after["updated_at"])
    if set(changed) == {"is_active"}:
        emit(conn, company_id, "product.updated", {
            "id": after["id"], "sku": after["sku"], "name": after["name"],
            "isActive": bool(after["is_active"])})
    else:
        emit(conn, company_id, "product.updated", product_updated(after))
    check_low_stock(conn, company_id, after, triggering_order_id=None)
    return product_json(after)


def product_updated(product):
    """product.updated's payload (but for an active toggle alone)."""
    return {"id": product["id"], "sku": product["sku"], "name": product["name"],
            "price": money(product["price_cents"]), "stock": product["stock"],
            "isActive": bool(product["is_active"]), "category": product["category"]}


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


# 8.4 Stock changes ---------------------------------------------------------------------------
# Every change of stock that is not an order's placement is a product edit (see Stock
# movements, above Products).

def move_stock(conn, company_id, changes, reason, actor, note=None, order_id=None,
               return_id=None):
    """Stock changes as product edits: changes, [(product ID, signed units)], one movement
    each, in order (a product may come twice). No level may go below zero. Returns the
    movements as records."""
    products = {}
    for product_id, _ in changes:
        if product_id not in products:
            products[product_id] = dict(load_product(conn, company_id, product_id))
    before = {product_id: product["stock"] for product_id, product in products.items()}
    movements = []
    for product_id, change in changes:
        product = products[product_id]
        if product["stock"] + change < 0:
            raise ApiError(422, STOCK_BELOW_ZERO.format(name=product["name"],
                                                        N=product["stock"], M=change))
        product["stock"] += change
        movements.append((product_id, change, product["stock"], reason, order_id, return_id,
                          note, actor))
    at = now_iso()
    rows = record_movements(conn, company_id, movements, at)
    for product_id, product in products.items():
        if product["stock"] == before[product_id]:
            continue
        conn.execute("UPDATE products SET stock = ?, updated_at = ? WHERE id = ?",
                     (product["stock"], at, product_id))
        product["updated_at"] = at
        emit(conn, company_id, "product.updated", product_updated(product))
        check_low_stock(conn, company_id, product, triggering_order_id=None)
    return [movement_json(dict(zip(MOVEMENT_COLUMNS, row))) for row in rows]


def _movement_note(note, required):
    note = (note or "").strip() or None
    if (note is None and required) or (note is not None and len(note) > MAX_MOVEMENT_NOTE):
        raise invalid("reason", f"must be 1 to {MAX_MOVEMENT_NOTE} characters")
    return note


def adjust_stock(conn, company_id, product_id, by, note, actor=None):
    """Staff change a product's stock by a signed amount, saying why (note, required): an
    adjustment movement."""
    if not isinstance(by, int) or by == 0 or abs(by) > MAX_QUANTITY:
        raise invalid("by", f"must be a whole number from -{MAX_QUANTITY} to {MAX_QUANTITY}, "
                            "not 0")
    note = _movement_note(note, required=True)
    return move_stock(conn, company_id, [(product_id, by)], "adjustment", actor or SYSTEM,
                      note)[0]


def count_stock(conn, company_id, product_id, level, note=None, actor=None):
    """Staff record a count, the level found on the shelf: a count movement of the
    difference (0 when the count agrees, which changes nothing else)."""
    if not isinstance(level, int) or not 0 <= level <= MAX_QUANTITY:
        raise invalid("to", f"must be a whole number from 0 to {MAX_QUANTITY}")
    note = _movement_note(note, required=False)
    current = load_product(conn, company_id, product_id)["stock"]
    return move_stock(conn, company_id, [(product_id, level - current)], "count",
                      actor or SYSTEM, note)[0]


def stock_history(conn, company_id, product_id, limit=MOVEMENTS_SHOWN):
    """A product's most recent movements (rows), newest first."""
    load_product(conn, company_id, product_id)
    return conn.execute("SELECT * FROM stock_movements WHERE product_id = ? "
                        "ORDER BY created_at DESC, id DESC LIMIT ?", (product_id, limit)).fetchall()


# 8.5 Customers -------------------------------------------------------------------------------

def load_customer(conn, company_id, customer_id):
    return load_row(conn, "customers", "Customer", company_id, customer_id)


def tax_rate_of(conn, company_id, customer):
    """The tax rate an order of this customer (a row) pays: its override, else the company's
    (an override of 0 is an exempt customer)."""
    if customer["tax_rate_override"] is not None:
        return customer["tax_rate_override"]
    return conn.execute("SELECT tax_rate FROM companies WHERE id = ?", (company_id,)).fetchone()[0]


def terms_of(conn, company_id, customer):
    """The payment terms (days) of this customer's invoices (a row, or None for an order
    without a customer): its own, else the company's."""
    if customer is not None and customer["payment_terms_days"] is not None:
        return customer["payment_terms_days"]
    return conn.execute("SELECT payment_terms_days FROM companies WHERE id = ?",
                        (company_id,)).fetchone()[0]


def set_customer_terms(conn, company_id, customer_id, days):
    """A customer's own payment terms in days (None: the company's again); returns the
    customer's terms in force, {"customerId", "paymentTermsDays", "own"}."""
    customer = load_customer(conn, company_id, customer_id)
    days = None if days is None else payment_terms(days)
    if customer["payment_terms_days"] != days:
        conn.execute("UPDATE customers SET payment_terms_days = ? WHERE id = ?",
                     (days, customer_id))
    return {"customerId": customer_id, "own": days is not None,
            "paymentTermsDays": terms_of(conn, company_id, load_customer(conn, company_id,
                                                                         customer_id))}


def require_buyer(conn, company_id, customer_id):
    """The customer, who may order at the store: neither blocked nor awaiting approval."""
    customer = load_customer(conn, company_id, customer_id)
    if customer["status"] == "BLOCKED":
        raise ApiError(403, CUSTOMER_BLOCKED)
    if customer["status"] == "PENDING":
        raise ApiError(403, CUSTOMER_PENDING)
    return customer


def load_contact(conn, company_id, contact_id):
    return load_row(conn, "contacts", "Contact", company_id, contact_id)


def contact_by_email(conn, company_id, email):
    """The company's contact with this email (in any case), whichever customer's, or None."""
    return conn.execute("SELECT * FROM contacts WHERE company_id = ? AND email_key = ?",
                        (company_id, (email or "").strip().casefold())).fetchone()


def own_contact(conn, customer):
    """The contact of the customer's own email: its first, made with it."""
    return conn.execute("SELECT * FROM contacts WHERE customer_id = ? AND email_key = ?",
                        (customer["id"], customer["email_key"])).fetchone()


def customer_contacts(conn, customer_id):
    """The customer's contacts, its own first, in the order they were added (rows)."""
    return conn.execute("SELECT * FROM contacts WHERE customer_id = ? ORDER BY created_at, id",
                        (customer_id,)).fetchall()


def require_contact(conn, company_id, contact_id, right=None, verified=True):
    """The contact, who may act at the store signed in as itself: its customer a buyer as
    above, its own address confirmed (or anyone could order in the name of an address that is
    not theirs; staff and the operator's commands vouch for the customers they order for; a
    cart may fill before, as verified=False lets it), and, for a right of ROLE_RIGHTS, a role
    that has it."""
    contact = load_contact(conn, company_id, contact_id)
    require_buyer(conn, company_id, contact["customer_id"])
    if verified and not contact["email_verified"]:
        raise ApiError(403, CUSTOMER_UNVERIFIED)
    if right is not None and right not in ROLE_RIGHTS[contact["role"]]:
        raise ApiError(403, ROLE_REFUSED)
    return contact


def insert_contact(conn, customer, email, role, name=None, password=None, email_verified=False,
                   approval_limit_cents=None):
    """A new contact of the customer (a row, returned as the table keeps it); an email signs
    in to one account at a store."""
    email_key = email.casefold()
    if conn.execute("SELECT 1 FROM contacts WHERE company_id = ? AND email_key = ?",
                    (customer["company_id"], email_key)).fetchone():
        raise ApiError(409, CONTACT_EXISTS)
    contact_id, at = new_id_at("con")
    insert_row(conn, "contacts", {
        "id": contact_id, "customer_id": customer["id"], "company_id": customer["company_id"],
        "email": email, "email_key": email_key, "name": name, "role": role, "status": "ACTIVE",
        "approval_limit_cents": approval_limit_cents, "email_verified": int(email_verified),
        "password_hash": password and hash_password(password), "created_at": at,
        "updated_at": at})
    return load_contact(conn, customer["company_id"], contact_id)


def _customer_changes(body, refusals=None):
    """The validated fields of a create or update body that it actually sends; refusals: a
    form's (see Refusals), which gathers each field's refusal (by default the first is
    raised, as the API answers)."""
    refusals, changes = refusals or Refusals(first=True), {}
    for field, column, read in (
            ("name", "name", lambda: optional_text(body, "name", MAX_CUSTOMER_NAME,
                                                   min_length=1, strip=True)),
            ("notes", "notes", lambda: optional_text(body, "notes", MAX_CUSTOMER_NOTES)),
            ("creditLimit", "credit_limit_cents", lambda: optional_money(
                body, "creditLimit", 0, MAX_CREDIT_LIMIT, CREDIT_LIMIT_MESSAGE)),
            ("taxRateOverride", "tax_rate_override", lambda: optional_bounded_number(
                body, "taxRateOverride", 0, MAX_TAX_RATE, TAX_RATE_MESSAGE)),
            ("status", "status", lambda: chosen_from(
                body["status"], SETTABLE_CUSTOMER_STATUSES, INVALID_STATUS))):
        if field in body:
            with refusals.check():
                changes[column] = read()
    return changes


def customer_by_email(conn, company_id, email):
    """The company's customer with this email (in any case), or None."""
    return conn.execute("SELECT * FROM customers WHERE company_id = ? AND email_key = ?",
                        (company_id, (email or "").strip().casefold())).fetchone()


def create_customer(conn, company_id, body, source="api", store_slug=None, password=None,
                    status="ACTIVE", email_verified=False, every=False):
    """every: gather every field's refusal (see Refusals) for a form; the API's answer is
    the first."""
    require_object(body)
    refusals, email = Refusals(first=not every), body.get("email")
    with refusals.check():
        if email is not None and not isinstance(email, str):
            raise invalid("email", "must be a string")
        email = (email or "").strip()
        if not email:
            raise ApiError(400, EMAIL_REQUIRED)
        if not valid_email(email):
            raise ApiError(400, INVALID_EMAIL)
    fields = _customer_changes(body, refusals)
    refusals.raise_any()
    email_key = email.casefold()
    if contact_by_email(conn, company_id, email_key):  # any customer's, or any contact's
        raise ApiError(409, CUSTOMER_EXISTS)
    customer_id, at = new_id_at("cus")
    row = {"id": customer_id, "company_id": company_id, "email": email, "email_key": email_key,
           "status": status, "created_at": at, "updated_at": at,
           "email_verified": int(email_verified)}
    row.update(fields)
    insert_row(conn, "customers", row)
    customer = load_customer(conn, company_id, customer_id)
    insert_contact(conn, customer, email, "admin", customer["name"], password, email_verified)
    payload = {"id": customer_id, "email": email, "name": customer["name"]}
    if source == "api":
        payload.update(status=customer["status"], source="api")
    elif source == "storefront":
        payload.update(storeSlug=store_slug, source="storefront")
    else:  # staff creating a customer in the dashboard: no customer.created (spec)
        return customer_json(customer)
    emit(conn, company_id, "customer.created", payload)
    return customer_json(customer)


def storefront_register(conn, store_slug, email, name=None, password=None):
    """The operator's registration of a buyer (storefront-register): customer.created with
    source storefront, the address counted as confirmed (the operator vouches for it)."""
    company = company_by_slug(conn, store_slug)
    body = {"email": email} if name is None else {"email": email, "name": name}
    return create_customer(conn, company["id"], body, source="storefront",
                           store_slug=store_slug, password=password, email_verified=True)


# 8.6 Customer prices -------------------------------------------------------------------------
# A customer's own price for a product, set by staff (the dashboard's customer page, price-set
# and price-clear). Storefront and dashboard orders use it; API orders use the catalog price,
# as the spec says.

def unit_price(product, special, units):
    """(cents, why) a unit of the product costs in a storefront or dashboard order of units
    of it: the lowest of the catalog price ("catalog"), the customer's (special: its own or
    its group's, as special_prices gives it, or None) and the price break units reach
    ("from N"). The lowest wins, so a buyer never pays more for a price list of its own."""
    best = (product["price_cents"], "catalog")
    if special is not None and special[0] < best[0]:
        best = special
    for at, cents in reversed(price_breaks_of(product)):
        if at <= units:  # the highest break reached
            return (cents, f"from {at}") if cents < best[0] else best
    return best


def next_break(product, units, paid_cents):
    """(units more, price in cents) of the nearest price break above units that pays less
    than paid_cents, in quantities the product's rules allow; None without one."""
    for at, cents in price_breaks_of(product):
        if at > units and cents < paid_cents:
            return fitted_quantity(product, at) - units, cents
    return None


def special_prices(conn, customer_id, products):
    """{product ID: (cents, why)} of the customer's price for each of products (rows) that it
    has one for: the lower of its own ("your price") and its group's ("group price": the
    group's price for the product, else the catalog price less the group's discount, rounded
    to the cent, half up)."""
    own = customer_prices_of(conn, customer_id, [product["id"] for product in products])
    group = conn.execute("SELECT g.* FROM customers c JOIN customer_groups g ON g.id = "
                         "c.group_id WHERE c.id = ?", (customer_id,)).fetchone()
    found = {product_id: (cents, "your price") for product_id, cents in own.items()}
    if group is None:
        return found
    listed = group_prices_of(conn, group["id"], [product["id"] for product in products])
    for product in products:
        cents = listed.get(product["id"])
        if cents is None and group["discount_bp"]:
            cents = (product["price_cents"] * (10000 - group["discount_bp"]) + 5000) // 10000
        if cents is not None and cents < found.get(product["id"], (cents + 1,))[0]:
            found[product["id"]] = (cents, "group price")
    return found


def group_prices_of(conn, group_id, product_ids):
    """{product ID: the group's price in cents}, for those of product_ids it lists."""
    if not product_ids:
        return {}
    return dict(tuple(row) for row in conn.execute(
        f"SELECT product_id, price_cents FROM group_prices WHERE group_id = ? AND "
        f"product_id IN ({','.join('?' * len(product_ids))})", [group_id, *product_ids]))


def customer_prices_of(conn, customer_id, product_ids):
    """{product ID: the customer's own price in cents}, for those of product_ids that have one."""
    if not product_ids:  # PostgreSQL has no empty IN ()
        return {}
    return dict(tuple(row) for row in conn.execute(
        f"SELECT product_id, price_cents FROM customer_prices WHERE customer_id = ? AND "
        f"product_id IN ({','.join('?' * len(product_ids))})", [customer_id, *product_ids]))


def set_customer_price(conn, company_id, customer_id, product_id, price_cents):
    load_customer(conn, company_id, customer_id)
    load_product(conn, company_id, product_id)
    if not (isinstance(price_cents, int) and 0 <= price_cents <= MAX_AMOUNT_CENTS):
        raise invalid("price", f"must be an amount from 0 to {money(MAX_AMOUNT_CENTS)}")
    at = now_iso()
    conn.execute(
        "INSERT INTO customer_prices (customer_id, product_id, company_id, price_cents, "
        "updated_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (customer_id, product_id) DO UPDATE "
        "SET price_cents = excluded.price_cents, updated_at = excluded.updated_at",
        (customer_id, product_id, company_id, price_cents, at))
    return customer_price_json({"customer_id": customer_id, "product_id": product_id,
                                "price_cents": price_cents, "updated_at": at})


def clear_customer_price(conn, company_id, customer_id, product_id):
    """The customer pays the catalog price again; clearing a price it does not have is no
    error (cleared says whether there was one)."""
    load_customer(conn, company_id, customer_id)
    load_product(conn, company_id, product_id)
    cleared = conn.execute("DELETE FROM customer_prices WHERE customer_id = ? AND product_id = ?",
                           (customer_id, product_id)).rowcount
    return {"customerId": customer_id, "productId": product_id, "cleared": cleared > 0}


def price_list(conn, company_id, customer_id):
    """The customer's own prices, each with its product (name, SKU, catalog price), by name."""
    load_customer(conn, company_id, customer_id)
    return conn.execute(
        "SELECT p.id, p.name, p.sku, p.price_cents AS catalog_cents, p.is_active, "
        "c.price_cents, c.updated_at FROM customer_prices c JOIN products p ON p.id = "
        "c.product_id WHERE c.customer_id = ? ORDER BY p.name, p.id", (customer_id,)).fetchall()


# Customer groups: a price list a group of customers shares (see special_prices).

def load_group(conn, company_id, group_id):
    return load_row(conn, "customer_groups", "Group", company_id, group_id)


def discount_bp(text):
    """A percentage as typed (12.5) in hundredths of a percent (1250), read exactly."""
    try:
        value = decimal.Decimal(str(text or "0").strip().rstrip("%"))
    except decimal.InvalidOperation:
        raise invalid("discount", DISCOUNT_MESSAGE) from None
    if not value.is_finite() or not 0 <= value <= 100 or value != value.quantize(
            decimal.Decimal("0.01")):
        raise invalid("discount", DISCOUNT_MESSAGE)
    return int(value * 100)


def save_group(conn, company_id, name, discount, group_id=None):
    """A new group (group_id None) or a group's new name and discount; returns its ID."""
    load_company(conn, company_id)
    name = (name or "").strip()
    if not 1 <= len(name) <= MAX_GROUP_NAME:
        raise invalid("name", f"must be 1 to {MAX_GROUP_NAME} characters")
    bp = discount_bp(discount)
    taken = conn.execute("SELECT id FROM customer_groups WHERE company_id = ? AND name_key = ?",
                         (company_id, name.casefold())).fetchone()
    if taken is not None and taken["id"] != group_id:
        raise ApiError(409, GROUP_EXISTS)
    if group_id is None:
        group_id, at = new_id_at("grp")
        insert_row(conn, "customer_groups", {"id": group_id, "company_id": company_id,
                                             "name": name, "name_key": name.casefold(),
                                             "discount_bp": bp, "created_at": at})
        return group_id
    load_group(conn, company_id, group_id)
    conn.execute("UPDATE customer_groups SET name = ?, name_key = ?, discount_bp = ? "
                 "WHERE id = ?", (name, name.casefold(), bp, group_id))
    return group_id


def group_size(conn, group_id):
    """How many customers the group has."""
    return conn.execute("SELECT COUNT(*) FROM customers WHERE group_id = ?",
                        (group_id,)).fetchone()[0]


def company_groups(conn, company_id):
    """The company's groups by name, each with how many customers it has (members)."""
    return conn.execute(
        "SELECT g.*, (SELECT COUNT(*) FROM customers c WHERE c.group_id = g.id) AS members "
        "FROM customer_groups g WHERE g.company_id = ? ORDER BY g.name_key", (company_id,)
    ).fetchall()


def set_group_price(conn, company_id, group_id, product_id, price_cents):
    """The group's own price for a product (None: the group's discount applies again)."""
    load_group(conn, company_id, group_id)
    load_product(conn, company_id, product_id)
    if price_cents is None:
        conn.execute("DELETE FROM group_prices WHERE group_id = ? AND product_id = ?",
                     (group_id, product_id))
        return
    if not (isinstance(price_cents, int) and 0 <= price_cents <= MAX_AMOUNT_CENTS):
        raise invalid("price", f"must be an amount from 0 to {money(MAX_AMOUNT_CENTS)}")
    conn.execute("INSERT INTO group_prices (group_id, product_id, company_id, price_cents, "
                 "updated_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (group_id, product_id) DO "
                 "UPDATE SET price_cents = excluded.price_cents, updated_at = excluded.updated_at",
                 (group_id, product_id, company_id, price_cents, now_iso()))


def group_price_list(conn, company_id, group_id):
    """The group's own prices, each with its product (name, SKU, catalog price), by name."""
    load_group(conn, company_id, group_id)
    return conn.execute(
        "SELECT p.id, p.name, p.sku, p.price_cents AS catalog_cents, g.price_cents FROM "
        "group_prices g JOIN products p ON p.id = g.product_id WHERE g.group_id = ? "
        "ORDER BY p.name, p.id", (group_id,)).fetchall()


def set_customer_group(conn, company_id, customer_id, group_id):
    """The customer's group (None: none); no event (the API shows no groups)."""
    load_customer(conn, company_id, customer_id)
    if group_id is not None:
        load_group(conn, company_id, group_id)
    conn.execute("UPDATE customers SET group_id = ? WHERE id = ?", (group_id, customer_id))


# ---------------------------------------------------------------------------------------------
# 9. Orders, returns and billing
# ---------------------------------------------------------------------------------------------

# 9.1 Orders ----------------------------------------------------------------------------------

#: The dashboard's stricter workflow; the API itself enforces only the CANCELLED lock.
DASHBOARD_TRANSITIONS = {
    "SUBMITTED": ("CONFIRMED", "CANCELLED"),
    "CONFIRMED": ("SHIPPED", "CANCELLED"),
    "SHIPPED": ("DELIVERED",),
    "DELIVERED": (),
    "CANCELLED": (),
}


def load_order(conn, company_id, order_id):
    return load_row(conn, "orders", "Order", company_id, order_id)


def buyer_order(conn, company_id, customer_id, order_id):
    """One of the customer's own orders (whatever its source); another's is not found."""
    order = load_order(conn, company_id, order_id)
    if order["customer_id"] != customer_id:
        raise not_found("Order")
    return order


_ITEMS_OF_ORDERS = """
    SELECT i.id, i.quantity, i.unit_price_cents, i.product_id, p.name AS product_name,
           p.sku AS product_sku, i.order_id
    FROM order_items i JOIN products p ON p.id = i.product_id
    WHERE i.order_id IN ({})
    ORDER BY i.order_id, i.position"""


def orders_with_items(conn, order_rows):
    """Orders as the API shows them, their items read in one query however many they are."""
    if not order_rows:  # PostgreSQL has no empty IN ()
        return []
    ids = [row[0] for row in order_rows]
    items = conn.execute(_ITEMS_OF_ORDERS.format(",".join("?" * len(ids))), ids).fetchall()
    return orders_json(order_rows, items)


def order_with_items(conn, company_id, order_id):
    return orders_with_items(conn, [load_order(conn, company_id, order_id)])[0]


def order_quantity(value, field="quantity"):
    """A line's quantity, read as order placement reads it, with the spec's messages (a cart's
    lines are read alike)."""
    if not is_number(value):
        raise ApiError(400, QUANTITY_NOT_A_NUMBER)
    if isinstance(value, float) and not math.isinf(value):
        if not value.is_integer():
            raise ApiError(400, QUANTITY_NOT_WHOLE)
        value = int(value)
    if value < 1:
        raise ApiError(400, QUANTITY_TOO_SMALL)
    if value > MAX_QUANTITY:
        raise invalid(field, f"must be at most {MAX_QUANTITY}")
    return value


def parse_order_request(body):
    """Step 1 of order placement: the body's shape, with the spec's messages."""
    require_object(body)
    customer_id = body.get("customerId")
    if customer_id is None or customer_id == "":
        raise ApiError(400, CUSTOMER_ID_REQUIRED)
    if not isinstance(customer_id, str):
        raise invalid("customerId", "must be a string")
    items = body.get("items")
    if items is not None and not isinstance(items, list):
        raise invalid("items", "must be an array")
    if not items:
        raise ApiError(400, ITEMS_REQUIRED)
    if len(items) > MAX_ORDER_LINES:
        raise invalid("items", f"at most {MAX_ORDER_LINES} items")
    lines = []
    for index, item in enumerate(items):
        require_object(item, f"items[{index}]")
        product_id = item.get("productId")
        if product_id is None or product_id == "":
            raise ApiError(400, PRODUCT_ID_REQUIRED)
        if not isinstance(product_id, str):
            raise invalid(f"items[{index}].productId", "must be a string")
        lines.append((product_id, order_quantity(item.get("quantity"),
                                                 f"items[{index}].quantity")))
    po_number = optional_text(body, "poNumber", MAX_PO_NUMBER)
    notes = optional_text(body, "notes", MAX_ORDER_NOTES)
    return customer_id, lines, po_number, notes


def order_prices(conn, source, customer_id, products, wanted):
    """{product ID: unit price in cents} of an order of wanted ({product ID: units}) of
    products (rows): the catalog's through the API (the spec); for storefront and dashboard
    orders, unit_price's, once each product's quantity rules are met."""
    if source == "api":
        return {product_id: product["price_cents"] for product_id, product in products.items()}
    for product_id, quantity in wanted.items():
        product = products[product_id]
        if fitted_quantity(product, quantity) != quantity:
            raise ApiError(400, QUANTITY_RULE.format(
                name=product["name"], rule=quantity_rule_text(product), quantity=quantity))
    special = special_prices(conn, customer_id, [products[pid] for pid in wanted])
    return {product_id: unit_price(products[product_id], special.get(product_id), units)[0]
            for product_id, units in wanted.items()}


def order_number(conn, order_id):
    """The number people call an order by (1001, 1002, ... in its company)."""
    return conn.execute("SELECT number FROM orders WHERE id = ?", (order_id,)).fetchone()[0]


def next_in_sequence(conn, table, company_id, column="sequence", first=1):
    """The company's next number in table's sequence (first, for its first): the write lock
    of the caller's transaction keeps two writers from taking the same one."""
    return conn.execute(f"SELECT COALESCE(MAX({column}), ?) + 1 FROM {table} "
                        "WHERE company_id = ?", (first - 1, company_id)).fetchone()[0]


def place_order(conn, company_id, body, source="api", shipping_address=None,
                checkout_token=None, actor=None, placed_by=None, approved_by=None):
    """POST /api/v1/orders in the spec's processing order, and the dashboard's and the
    storefront's orders, which take the customer's own prices where there are any (API orders
    never do). The write lock the caller's transaction holds makes the stock check and the
    decrement one step: stock never goes below zero. Each line is an order movement made by
    actor (a storefront order's: its buyer). placed_by: the contact or staff account who placed
    it; approved_by: the admin contact who approved its request (neither is in the API's
    record, whose shape is the spec's)."""
    customer_id, lines, po_number, notes = parse_order_request(body)
    customer = load_customer(conn, company_id, customer_id)
    wanted = {}
    for product_id, quantity in lines:
        wanted[product_id] = wanted.get(product_id, 0) + quantity
    ids = list(wanted)
    # By primary key alone, then tenancy and activity in Python: with company_id or
    # is_active in the WHERE, SQLite (without table statistics) would rather scan the
    # company's active products than look the few IDs up.
    products = {row["id"]: row for row in conn.execute(
        f"SELECT * FROM products WHERE id IN ({','.join('?' * len(ids))})", ids)
        if row["company_id"] == company_id and row["is_active"]}
    for product_id in ids:
        if product_id not in products:
            raise ApiError(400, PRODUCT_UNAVAILABLE.format(id=product_id))
    prices = order_prices(conn, source, customer_id, products, wanted)
    for product_id, quantity in wanted.items():
        product = products[product_id]
        if product["stock"] < quantity:
            raise StockShortage(product["name"], max(product["stock"], 0), quantity)
    total = sum(prices[product_id] * quantity for product_id, quantity in lines)
    if total > MAX_CENTS:
        raise invalid("items", "order total is too large")
    rate = tax_rate_of(conn, company_id, customer)  # frozen on the order, whatever comes later
    order_id, at = new_id_at("ord")
    number = next_in_sequence(conn, "orders", company_id, "number", FIRST_ORDER_NUMBER)
    conn.execute(
        "INSERT INTO orders (id, company_id, customer_id, status, po_number, notes, total_cents, "
        "source, shipping_address, checkout_token, tax_rate, tax_cents, placed_by, approved_by, "
        "number, created_at, updated_at) "
        "VALUES (?, ?, ?, 'SUBMITTED', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (order_id, company_id, customer_id, po_number, notes, total, source,
         shipping_address and json_text(shipping_address), checkout_token, rate,
         tax_cents(total, rate), placed_by, approved_by, number, at, at))
    items = [{"id": new_id("oi"), "quantity": quantity, "unit_price_cents": prices[product_id],
              "product_id": product_id, "product_name": products[product_id]["name"],
              "product_sku": products[product_id]["sku"]} for product_id, quantity in lines]
    conn.executemany(
        "INSERT INTO order_items (id, order_id, position, product_id, quantity, "
        "unit_price_cents) VALUES (?, ?, ?, ?, ?, ?)",
        [(item["id"], order_id, position, item["product_id"], item["quantity"],
          item["unit_price_cents"]) for position, item in enumerate(items)])
    conn.executemany("UPDATE products SET stock = stock - ?, updated_at = ? WHERE id = ?",
                     [(quantity, at, product_id) for product_id, quantity in wanted.items()])
    if actor is None:
        actor = Actor("buyer", customer_id) if source == "storefront" else SYSTEM
    levels = {product_id: product["stock"] for product_id, product in products.items()}
    movements = []
    for product_id, quantity in lines:
        levels[product_id] -= quantity
        movements.append((product_id, -quantity, levels[product_id], "order", order_id, None,
                          None, actor))
    record_movements(conn, company_id, movements, at)
    record_status_change(conn, order_id, None, "SUBMITTED", source, None, at)
    order = order_json({"id": order_id, "status": "SUBMITTED", "po_number": po_number,
                        "notes": notes, "total_cents": total, "created_at": at,
                        "updated_at": at, "customer_id": customer_id,
                        "tracking_carrier": None}, items)
    if source == "api":
        emit(conn, company_id, "order.created",
             {k: v for k, v in order.items() if k != "tracking"})
    elif source == "storefront":  # dashboard-created orders emit no order.created (spec)
        emit(conn, company_id, "order.created", {
            "id": order_id, "status": "SUBMITTED", "total": order["total"],
            "customerId": customer_id, "poNumber": po_number, "itemCount": len(lines)})
    for product_id, quantity in wanted.items():
        product = dict(products[product_id])
        product["stock"] -= quantity
        check_low_stock(conn, company_id, product, order_id)
    return order


def storefront_place_order(conn, store_slug, customer_id, items, po_number=None, notes=None,
                           shipping_address=None, checkout_token=None, contact=None,
                           approved_by=None):
    """An order placed for a customer of the storefront (order.created carries the storefront
    shape, with itemCount and no items), at the customer's own prices, by one of its contacts
    (a row; none: the operator's command). A blocked customer cannot order there, nor one
    awaiting approval."""
    company = company_by_slug(conn, store_slug)
    customer = require_buyer(conn, company["id"], customer_id)
    body = {"customerId": customer_id, "items": items, "poNumber": po_number, "notes": notes}
    try:
        order = place_order(conn, company["id"], body, "storefront", shipping_address,
                            checkout_token, placed_by=contact and contact["id"],
                            approved_by=approved_by)
    except StockShortage as error:
        raise ApiError(400, STORE_STOCK_SHORT.format(name=error.product_name)) from None
    queue_order_emails(conn, company, customer, order, contact)
    return order


def record_status_change(conn, order_id, from_status, to_status, source, tracking_number, at,
                         note=None):
    conn.execute(
        "INSERT INTO order_status_changes (id, order_id, from_status, to_status, source, "
        "tracking_number, note, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (new_id("osc"), order_id, from_status, to_status, source, tracking_number, note, at))


def status_changes(conn, company_id, order_id):
    """The order's status changes, oldest first, from its placement on (see
    order_status_changes in schema.sql)."""
    load_order(conn, company_id, order_id)
    return conn.execute("SELECT * FROM order_status_changes WHERE order_id = ? "
                        "ORDER BY created_at, id", (order_id,)).fetchall()


def shipping_address_of(order_row):
    """The address an order ships to ({field: text}), or None (API and dashboard orders)."""
    text = order_row["shipping_address"]
    return json.loads(text) if text else None


def email_lines(items):
    """An order's items as an email's "lines" (see Email templates)."""
    return [{"name": item["productName"], "sku": item["productSku"],
             "quantity": item["quantity"], "unitPrice": item["unitPrice"],
             "lineTotal": money(line_total_cents(item))} for item in items]


def queue_order_emails(conn, company, customer, order, contact=None):
    """A storefront order's emails: the confirmation to the contact who placed it (the
    customer's own address, for the operator's command), and an alert to each of the company's
    staff addresses (orders from the API or the dashboard send neither)."""
    lines = email_lines(order["items"])
    rate, tax, number = conn.execute("SELECT tax_rate, tax_cents, number FROM orders "
                                     "WHERE id = ?", (order["id"],)).fetchone()
    # the customer's own contact is the customer, by its (business) name
    other = contact is not None and contact["email_key"] != customer["email_key"]
    to = contact if other else customer
    common = {"orderId": order["id"], "orderNumber": number, "customerName": to["name"] or to["email"],
              "lines": lines, "total": order["total"], "taxRate": rate, "tax": money(tax)}
    po_number = ["PO number", order["poNumber"] or "none"]
    queue_email(conn, company["id"], "order_confirmation", to["email"], dict(
        common, facts=[["Order", number, f"/store/{company['slug']}/orders/{order['id']}"],
                       po_number]), to_name=to["name"])
    alert = dict(common, path=f"/dashboard/orders/{order['id']}", facts=[
        ["Order", number], ["Customer", f"{customer['name'] or ''} <{customer['email']}>"],
        po_number] + ([["Placed by", f"{contact['name'] or ''} <{contact['email']}>"]]
                      if other else []))
    for address in json.loads(company["staff_alerts"] or "[]"):
        queue_email(conn, company["id"], "order_alert", address, alert)


def order_people(conn, order):
    """(who placed the order, who approved its request): each a contact's or staff account's
    name and email; None where no one is recorded (API orders, and orders placed before
    contacts were)."""
    def who(account_id):
        row = account_id and (
            conn.execute("SELECT name, email FROM contacts WHERE id = ?", (account_id,)
                         ).fetchone() or
            conn.execute("SELECT NULL AS name, email FROM staff WHERE id = ?", (account_id,)
                         ).fetchone())
        return row and (f"{row['name']} <{row['email']}>" if row["name"] else row["email"])
    return who(order["placed_by"]), who(order["approved_by"])


def queue_buyer_notice(conn, company_id, customer_id, order_id, kind, facts):
    """An email of one of BUYER_NOTICES' kinds about an order to its customer (facts after the
    order's number), with a link to the order in the store, unless the company turned that
    kind off (or there is no one to tell)."""
    company = load_company(conn, company_id)
    if not customer_id or kind in json.loads(company["buyer_emails_off"] or "[]"):
        return None
    customer = load_customer(conn, company_id, customer_id)
    number = order_number(conn, order_id)
    return queue_email(conn, company_id, kind, customer["email"], {
        "orderId": order_id, "orderNumber": number,
        "customerName": customer["name"] or customer["email"], "store": company["name"],
        "facts": [["Order", number]] + facts,
        "path": f"/store/{company['slug']}/orders/{order_id}"}, to_name=customer["name"])


# 9.2 Invoices, payments and credit -----------------------------------------------------------
# Money a customer owes (docs/money.md). An order is invoiced once, when it first ships (or by
# staff earlier), at the lines, tax and total frozen on it when it was placed; its invoice is
# OPEN until payments and applied credit bring its balance to 0 (PAID), or staff void it
# while nothing is settled (VOID: its number stays used). A CREDIT refund issues a credit
# note, which staff apply to the same customer's open invoices. Numbers come from one
# sequence per company and kind, taken in the write transaction that issues them: one writer
# at a time holds it (on both engines), so numbers neither repeat nor skip.

DAY_MS = 86_400_000


def load_invoice(conn, company_id, invoice_id):
    return load_row(conn, "customer_invoices", "Invoice", company_id, invoice_id)


def buyer_invoice(conn, company_id, customer_id, invoice_id):
    """One of the customer's own invoices; another's is not found (as buyer_order)."""
    invoice = load_invoice(conn, company_id, invoice_id)
    if invoice["customer_id"] != customer_id:
        raise not_found("Invoice")
    return invoice


def load_credit_note(conn, company_id, credit_note_id):
    return load_row(conn, "credit_notes", "Credit note", company_id, credit_note_id)


def first_reminder_at(due_at):
    """When an invoice due at due_at (ISO text) is first reminded of: the start of the day
    (UTC) after its due date."""
    return iso(js_parse_date(due_at[:10]) + DAY_MS)


def order_invoice(conn, order_id):
    """The order's invoice that is not void (a row), or None."""
    return conn.execute("SELECT * FROM customer_invoices WHERE order_id = ? AND "
                        "status <> 'VOID'", (order_id,)).fetchone()


def invoice_order(conn, company_id, order_id, now_ms=None, announce=True):
    """The order's invoice, issued now (epoch ms) on the customer's payment terms unless it
    has one already (then that one, unchanged: a void one does not count, so an order whose
    invoice was voided is invoiced again, under a new number); a cancelled order is not
    invoiced. The
    buyer is emailed a link to it (unless announce is false: the shipping email that goes
    with it carries it)."""
    order = load_order(conn, company_id, order_id)
    existing = order_invoice(conn, order_id)
    if existing is not None:
        return customer_invoice_json(existing)
    if order["status"] == "CANCELLED":
        raise ApiError(422, CANCELLED_NOT_INVOICED)
    customer = order["customer_id"] and load_customer(conn, company_id, order["customer_id"])
    terms = terms_of(conn, company_id, customer or None)
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    total = order["total_cents"] + order["tax_cents"]
    sequence = next_in_sequence(conn, "customer_invoices", company_id)
    due_at = iso(now_ms + terms * DAY_MS)
    row = {"id": new_id("cin"), "company_id": company_id, "order_id": order_id,
           "customer_id": order["customer_id"], "sequence": sequence,
           "number": INVOICE_NUMBER.format(sequence), "status": "OPEN" if total else "PAID",
           "subtotal_cents": order["total_cents"], "tax_rate": order["tax_rate"],
           "tax_cents": order["tax_cents"], "total_cents": total, "paid_cents": 0,
           "credited_cents": 0, "terms_days": terms, "issued_at": iso(now_ms),
           "due_at": due_at, "reminders_sent": 0,
           "next_reminder_at": first_reminder_at(due_at) if total else None,
           "created_at": now_iso(), "updated_at": iso(now_ms)}
    insert_row(conn, "customer_invoices", row)
    if customer and announce:
        queue_invoice_email(conn, company_id, customer, row, "invoice_issued")
    return customer_invoice_json(row)


def invoice_facts(conn, invoice, total=True):
    """An invoice's facts in its buyer's emails: its number linked to it in the store, the
    total (unless lines show it) and balance due, when it is due."""
    slug = conn.execute("SELECT slug FROM companies WHERE id = ?",
                        (invoice["company_id"],)).fetchone()[0]
    balance = balance_cents(invoice)
    return [["Invoice", invoice["number"], f"/store/{slug}/invoices/{invoice['id']}"],
            *([["Total due", amount_text(money(invoice["total_cents"]))]] if total else []),
            ["Balance due", amount_text(money(balance))], ["Due", invoice["due_at"][:10]]]


def invoice_lines(conn, invoice):
    """The invoice's order lines at their frozen prices, as the order shows its items."""
    return order_with_items(conn, invoice["company_id"], invoice["order_id"])["items"]


def queue_invoice_email(conn, company_id, customer, invoice, kind):
    """An invoice's email to its buyer (invoice_issued, invoice_reminder): its lines, totals
    and balance, and a link to it in the store."""
    company = load_company(conn, company_id)
    lines = email_lines(invoice_lines(conn, invoice))
    queue_email(conn, company_id, kind, customer["email"], {
        "number": invoice["number"], "customerName": customer["name"] or customer["email"],
        "store": company["name"], "path": f"/store/{company['slug']}/invoices/{invoice['id']}",
        "lines": lines, "total": money(invoice["subtotal_cents"]),
        "taxRate": invoice["tax_rate"], "tax": money(invoice["tax_cents"]),
        "facts": [["Order", order_number(conn, invoice["order_id"])],
                  ["Issued", invoice["issued_at"][:10]],
                  *invoice_facts(conn, invoice, total=False)]}, to_name=customer["name"])


def require_open(invoice):
    if invoice["status"] != "OPEN":
        raise ApiError(422, INVOICE_NOT_OPEN.format(number=invoice["number"],
                                                    status=invoice["status"]))


def _settle(conn, invoice, paid=0, credited=0, at=None):
    """Payments or credit added to an invoice; PAID once its balance is 0 (then no reminder
    is to come). Returns the invoice as it is now."""
    balance = balance_cents(invoice)
    settled = balance - paid - credited == 0
    conn.execute(
        "UPDATE customer_invoices SET paid_cents = paid_cents + ?, credited_cents = "
        "credited_cents + ?, status = ?, next_reminder_at = ?, updated_at = ? WHERE id = ?",
        (paid, credited, "PAID" if settled else "OPEN",
         None if settled else invoice["next_reminder_at"], at or now_iso(), invoice["id"]))
    return customer_invoice_json(load_invoice(conn, invoice["company_id"], invoice["id"]))


def _settling_amount(amount_cents, most, what):
    if not isinstance(amount_cents, int) or isinstance(amount_cents, bool) or amount_cents < 1:
        raise invalid("amount", "must be an amount > 0")
    if amount_cents > most:
        raise invalid("amount", f"must be at most {amount_text(money(most))}, {what}")
    return amount_cents


def _payment_text(value, field, most):
    text = one_line(value)
    if len(text) > most:
        raise invalid(field, f"must be at most {most} characters")
    return text or None


def record_payment(conn, company_id, invoice_id, amount_cents, method=None, reference=None,
                   paid_at=None, now_ms=None):
    """A payment staff received against an open invoice (partial or whole; never more than its
    balance), paid at paid_at (ISO text, not in the future; now by default). Returns the
    invoice."""
    invoice = load_invoice(conn, company_id, invoice_id)
    require_open(invoice)
    balance = balance_cents(invoice)
    _settling_amount(amount_cents, balance, "the invoice's balance")
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    paid_ms = now_ms if paid_at is None else js_parse_date(paid_at)
    issued_on = invoice["issued_at"][:10]
    if paid_ms is None or paid_ms > now_ms or iso(paid_ms)[:10] < issued_on:
        raise invalid("paidAt", f"must be an ISO 8601 date or time from the invoice's issue "
                                f"date ({issued_on}) to now")
    insert_row(conn, "payments", {
        "id": new_id("pay"), "company_id": company_id, "invoice_id": invoice_id,
        "amount_cents": amount_cents, "paid_at": iso(paid_ms),
        "method": _payment_text(method, "method", MAX_PAYMENT_METHOD),
        "reference": _payment_text(reference, "reference", MAX_PAYMENT_REFERENCE),
        "created_at": iso(now_ms)})
    return _settle(conn, invoice, paid=amount_cents, at=iso(now_ms))


def void_invoice(conn, company_id, invoice_id):
    """An open invoice voided while nothing is paid or credited to it; its number stays used
    and nothing more can be paid or credited to it. Returns the invoice."""
    invoice = load_invoice(conn, company_id, invoice_id)
    require_open(invoice)
    if invoice["paid_cents"] or invoice["credited_cents"]:
        raise ApiError(422, INVOICE_SETTLED.format(number=invoice["number"]))
    conn.execute("UPDATE customer_invoices SET status = 'VOID', next_reminder_at = NULL, "
                 "updated_at = ? WHERE id = ?", (now_iso(), invoice_id))
    return customer_invoice_json(load_invoice(conn, company_id, invoice_id))


def issue_credit_note(conn, company_id, customer_id, refund_id, amount_cents, at):
    """The credit note of a CREDIT refund, for its amount (a refund of nothing issues none)."""
    if not customer_id or not amount_cents:
        return None
    sequence = next_in_sequence(conn, "credit_notes", company_id)
    row = {"id": new_id("crn"), "company_id": company_id, "customer_id": customer_id,
           "refund_id": refund_id, "sequence": sequence,
           "number": CREDIT_NOTE_NUMBER.format(sequence), "amount_cents": amount_cents,
           "remaining_cents": amount_cents, "created_at": at}
    insert_row(conn, "credit_notes", row)
    return credit_note_json(row)


def apply_credit(conn, company_id, credit_note_id, invoice_id, amount_cents=None):
    """Credit from a credit note applied to an open invoice of the same customer: amount_cents,
    or as much as both allow. Returns {"creditNote", "invoice"} as they are now."""
    note = load_credit_note(conn, company_id, credit_note_id)
    invoice = load_invoice(conn, company_id, invoice_id)
    require_open(invoice)
    if invoice["customer_id"] != note["customer_id"]:
        raise ApiError(422, CREDIT_OTHER_CUSTOMER)
    if not note["remaining_cents"]:
        raise ApiError(422, CREDIT_USED_UP.format(number=note["number"]))
    balance = balance_cents(invoice)
    if amount_cents is None:
        amount_cents = min(note["remaining_cents"], balance)
    _settling_amount(amount_cents, note["remaining_cents"], "what the credit note has left")
    _settling_amount(amount_cents, balance, "the invoice's balance")
    application_id, at = new_id_at("cap")
    insert_row(conn, "credit_applications", {
        "id": application_id, "company_id": company_id, "credit_note_id": credit_note_id,
        "invoice_id": invoice_id, "amount_cents": amount_cents, "created_at": at})
    conn.execute("UPDATE credit_notes SET remaining_cents = remaining_cents - ? WHERE id = ?",
                 (amount_cents, credit_note_id))
    invoice = _settle(conn, invoice, credited=amount_cents, at=at)
    return {"creditNote": credit_note_json(load_credit_note(conn, company_id, credit_note_id)),
            "invoice": invoice}


def invoice_details(conn, company_id, invoice_id):
    """An invoice with its lines, its payments and the credit applied to it (invoice-show,
    the invoice's pages)."""
    invoice = load_invoice(conn, company_id, invoice_id)
    return dict(customer_invoice_json(invoice), lines=invoice_lines(conn, invoice), payments=[
        payment_json(row) for row in conn.execute(
            "SELECT * FROM payments WHERE invoice_id = ? ORDER BY paid_at, id", (invoice_id,))],
        credits=[dict(credit_application_json(row), creditNoteNumber=row["number"])
                 for row in conn.execute(
            "SELECT a.*, n.number FROM credit_applications a JOIN credit_notes n ON n.id = "
            "a.credit_note_id WHERE a.invoice_id = ? ORDER BY a.created_at, a.id",
            (invoice_id,))])


def find_customer_invoices(conn, company_id, status=None, customer_id=None, overdue_at=None,
                           open_or_since=None):
    """The company's invoices, newest first: of a status, of a customer, overdue at a time
    (ISO text: open, and due before that day began), or open or issued since a time."""
    if status is not None and status not in INVOICE_STATUSES:
        raise ApiError(400, INVOICE_STATUS_FILTER)
    filters, params = ["company_id = ?"], [company_id]
    for column, value in (("status", status), ("customer_id", customer_id)):
        if value is not None:
            filters.append(f"{column} = ?")
            params.append(value)
    if overdue_at is not None:
        filters.append("status = 'OPEN' AND due_at < ?")
        params.append(overdue_at[:10])
    if open_or_since is not None:
        filters.append("(status = 'OPEN' OR issued_at >= ?)")
        params.append(open_or_since)
    return conn.execute(f"SELECT * FROM customer_invoices WHERE {' AND '.join(filters)} "
                        "ORDER BY sequence DESC", params).fetchall()


def customer_credit_notes(conn, company_id, customer_id):
    load_customer(conn, company_id, customer_id)
    return conn.execute("SELECT * FROM credit_notes WHERE customer_id = ? "
                        "ORDER BY sequence DESC", (customer_id,)).fetchall()


def credit_standing(conn, company_id, customer):
    """A customer's (a row) exposure, in cents: its open invoices' balances and the totals,
    tax included, of its orders neither invoiced nor cancelled, less its unapplied credit;
    with its credit limit and what is available under it (None: no limit)."""
    ((exposure,),) = conn.execute(
        "SELECT COALESCE((SELECT SUM(total_cents - paid_cents - credited_cents) FROM "
        "customer_invoices WHERE company_id = ? AND customer_id = ? AND status = 'OPEN'), 0) "
        "+ COALESCE((SELECT SUM(o.total_cents + o.tax_cents) FROM orders o WHERE "
        "o.company_id = ? AND o.customer_id = ? AND o.status <> 'CANCELLED' AND NOT EXISTS "
        "(SELECT 1 FROM customer_invoices i WHERE i.order_id = o.id AND i.status <> 'VOID')), "
        "0) - COALESCE((SELECT "
        "SUM(remaining_cents) FROM credit_notes WHERE customer_id = ?), 0)",
        (company_id, customer["id"], company_id, customer["id"], customer["id"]))
    limit = customer["credit_limit_cents"]
    return {"exposure": exposure, "limit": limit,
            "available": None if limit is None else max(limit - exposure, 0)}


def require_credit(conn, company_id, customer_id, order_id):
    """Refuses a storefront order just placed (and so all its transaction wrote) that takes
    its customer's exposure past its credit limit, saying how much was available. The API
    never does: there the limit is informational (the spec)."""
    customer = load_customer(conn, company_id, customer_id)
    if customer["credit_limit_cents"] is None:
        return
    standing = credit_standing(conn, company_id, customer)
    if standing["exposure"] <= standing["limit"]:
        return
    order = load_order(conn, company_id, order_id)
    total = order["total_cents"] + order["tax_cents"]
    available = max(standing["limit"] - standing["exposure"] + total, 0)
    raise ApiError(400, CREDIT_LIMIT_REACHED.format(total=amount_text(money(total)),
                                                    available=amount_text(money(available))))


#: The kinds of a statement's lines, in the order a day's lines of each kind come.
STATEMENT_LINE_KINDS = ("INVOICE", "PAYMENT", "CREDIT_NOTE")
#: A statement's period on the pages, unless the reader asks for another: its last this many
#: days (what came before is its opening balance), so that the page does not grow with an
#: account's history.
STATEMENT_DAYS = 90


def statement(conn, company_id, customer_id, since=None):
    """A customer's account: its invoices (void ones aside), payments and credit notes by
    day (an invoice before what settles it on the same day), each line's amount (what it
    adds to what the customer owes, or takes off), the balance after it and the invoice it
    concerns (invoiceId; none for a credit note); the balance is what its open invoices owe
    less its unapplied credit. From since (ISO text, the start of a day) if given: the lines
    from then on, after the opening balance that those before it add up to (since, opening);
    else the whole history."""
    load_customer(conn, company_id, customer_id)
    start = since or ""  # the empty text sorts before every time
    entries = [(row["issued_at"], "INVOICE", row["number"], row["total_cents"], row["id"])
               for row in conn.execute("SELECT * FROM customer_invoices WHERE company_id = ? AND "
                                       "customer_id = ? AND status <> 'VOID' AND issued_at >= ?",
                                       (company_id, customer_id, start))]
    entries += [(row["paid_at"], "PAYMENT", " ".join(filter(None, [
        row["number"], row["method"], row["reference"]])), -row["amount_cents"],
        row["invoice_id"]) for row in conn.execute(
            "SELECT p.*, i.number FROM customer_invoices i JOIN payments p ON p.invoice_id = "
            "i.id WHERE i.company_id = ? AND i.customer_id = ? AND p.paid_at >= ?",
            (company_id, customer_id, start))]
    entries += [(row["created_at"], "CREDIT_NOTE", row["number"], -row["amount_cents"], None)
                for row in conn.execute("SELECT * FROM credit_notes WHERE customer_id = ? AND "
                                        "created_at >= ?", (customer_id, start))]
    account = {"customerId": customer_id}
    balance = 0
    if since:
        # What is owed now, less what the period's lines add: the open invoices and the
        # credit notes, not the whole history, are read (every line's amount is what it
        # adds to the balance, so the two agree to the cent).
        (now_owed,) = conn.execute(
            "SELECT COALESCE((SELECT SUM(total_cents - paid_cents - credited_cents) FROM "
            "customer_invoices WHERE company_id = ? AND status = 'OPEN' AND customer_id = ?), "
            "0) - COALESCE((SELECT SUM(remaining_cents) FROM credit_notes WHERE customer_id = "
            "?), 0)", (company_id, customer_id, customer_id)).fetchone()
        balance = now_owed - sum(entry[3] for entry in entries)
        account.update(since=since, opening=money(balance))
    lines = []
    for at, kind, reference, cents, invoice_id in sorted(entries, key=lambda entry: (
            entry[0][:10], STATEMENT_LINE_KINDS.index(entry[1]), entry[0])):
        balance += cents
        lines.append({"date": at, "kind": kind, "reference": reference, "amount": money(cents),
                      "balance": money(balance), "invoiceId": invoice_id})
    return dict(account, lines=lines, balance=money(balance))


def aging_sql(now_ms):
    """SQL for the index in AGING_BUCKETS of an open invoice (i) at now_ms, and its
    parameters: one due on or after the day `high` days before today is at most `high` days
    past due (ISO dates compare as text, alike on both engines)."""
    limits = [high for _, _, high in AGING_BUCKETS[:-1]]
    cases = " ".join(f"WHEN substr(i.due_at, 1, 10) >= ? THEN {index}"
                     for index in range(len(limits)))
    return (f"CASE {cases} ELSE {len(limits)} END",
            [iso(now_ms - high * DAY_MS)[:10] for high in limits])


def receivables(conn, company_id, now_ms, shown=RECEIVABLES_SHOWN):
    """What the company's open invoices owe at now_ms: ([{"customer_id", "name", "email",
    "buckets": [cents owed in each of AGING_BUCKETS], "total"}], most owed first; the `shown`
    invoices due longest ago, each with its customer's email and name and its bucket; how
    many are open). The database sums, so the page costs about the same at any number of
    invoices."""
    bucket, params = aging_sql(now_ms)
    customers = {}
    for row in conn.execute(
            f"SELECT g.customer_id, c.name, c.email, g.bucket, g.owed FROM (SELECT "
            f"i.customer_id, {bucket} AS bucket, SUM(i.total_cents - i.paid_cents - "
            "i.credited_cents) AS owed FROM customer_invoices i WHERE i.company_id = ? AND "
            "i.status = 'OPEN' GROUP BY 1, 2) g LEFT JOIN customers c ON c.id = g.customer_id",
            [*params, company_id]):
        owed = customers.setdefault(row["customer_id"], {
            "customer_id": row["customer_id"], "name": row["name"], "email": row["email"],
            "buckets": [0] * len(AGING_BUCKETS), "total": 0})
        owed["buckets"][row["bucket"]] += row["owed"]
        owed["total"] += row["owed"]
    invoices = [dict(row, balance_cents=balance_cents(row)) for row in conn.execute(
        f"SELECT i.*, c.email, c.name, {bucket} AS bucket FROM customer_invoices i LEFT JOIN "
        "customers c ON c.id = i.customer_id WHERE i.company_id = ? AND i.status = 'OPEN' "
        "ORDER BY i.due_at, i.id LIMIT ?", [*params, company_id, shown])]
    (count,) = conn.execute("SELECT COUNT(*) FROM customer_invoices WHERE company_id = ? AND "
                            "status = 'OPEN'", (company_id,)).fetchone()
    return (sorted(customers.values(), key=lambda owed: (-owed["total"], owed["email"] or "")),
            invoices, count)


def send_reminders(conn, now_ms, batch=100):
    """The reminders due at now_ms (epoch ms): one email to the buyer of each open invoice
    whose next reminder is due, the next a week from now (so an invoice found long overdue
    gets one, not a backlog), MAX_REMINDERS at most. Each is claimed by a conditional update
    in the caller's write transaction: however many processes run this, each reminder is
    written once. Returns how many reminders it claimed."""
    rows = conn.execute(
        "SELECT * FROM customer_invoices WHERE next_reminder_at IS NOT NULL AND "
        "next_reminder_at <= ? ORDER BY next_reminder_at LIMIT ?", (iso(now_ms), batch)
    ).fetchall()
    sent = 0
    for row in rows:
        count = row["reminders_sent"] + 1
        next_at = iso(now_ms + REMINDER_INTERVAL_DAYS * DAY_MS) if count < MAX_REMINDERS \
            else None
        claimed = conn.execute(
            "UPDATE customer_invoices SET reminders_sent = ?, next_reminder_at = ? WHERE id = ? "
            "AND reminders_sent = ? AND status = 'OPEN'",
            (count, next_at, row["id"], row["reminders_sent"])).rowcount
        if claimed and row["customer_id"]:
            customer = load_customer(conn, row["company_id"], row["customer_id"])
            queue_invoice_email(conn, row["company_id"], customer, row, "invoice_reminder")
        sent += claimed
    return sent


# 9.3 Status changes --------------------------------------------------------------------------

def queue_shipping_email(conn, company_id, order):
    """The shipping email to the order's customer: the order, its PO number, its invoice (the
    one a shipment issues: no email of its own goes with it) and, when the order has
    tracking, the carrier, the tracking number and the tracking URL."""
    customer = load_customer(conn, company_id, order["customerId"])
    number = order_number(conn, order["id"])
    slug = load_company(conn, company_id)["slug"]
    facts = [["Order", number, f"/store/{slug}/orders/{order['id']}"],
             ["PO number", order["poNumber"] or "none"]]
    if order["tracking"]:
        carrier = company_carriers(conn, company_id)[order["tracking"]["carrier"]]["name"]
        facts += [["Carrier", carrier],
                  ["Tracking number", order["tracking"]["number"]],
                  ["Track it", order["tracking"]["url"], order["tracking"]["url"]]]
    invoice = order_invoice(conn, order["id"])
    if invoice is not None:
        facts += invoice_facts(conn, invoice)
    queue_email(conn, company_id, "order_shipped", customer["email"], {
        "orderId": order["id"], "orderNumber": number,
        "customerName": customer["name"] or customer["email"], "facts": facts},
        to_name=customer["name"])


def parse_status_update(body, carriers):
    """The body of PATCH /api/v1/orders/{id}: (status, tracking or None). A named carrier's
    URL, unless given, comes from its template in carriers (company_carriers')."""
    require_object(body)
    status = body.get("status")
    if status not in ORDER_STATUSES:
        raise ApiError(400, INVALID_ORDER_STATUS)
    tracking = body.get("tracking")
    if tracking is None:
        return status, None
    if status != "SHIPPED":
        raise ApiError(400, TRACKING_ONLY_WHEN_SHIPPED)
    require_object(tracking, "tracking")
    carrier = tracking.get("carrier")
    if carrier not in CARRIERS:
        raise invalid("tracking.carrier", f"must be one of {', '.join(CARRIERS)}")
    number = tracking.get("number")
    shortest, longest = TRACKING_NUMBER_LENGTH
    if not isinstance(number, str) or not shortest <= len(number.strip()) <= longest:
        raise invalid("tracking.number", f"must be {shortest} to {longest} characters")
    number = number.strip()
    url = tracking.get("url")
    if url is None or url == "":
        if carrier == "OTHER":
            raise ApiError(400, TRACKING_URL_REQUIRED)
        url = carriers[carrier]["template"].replace(
            "{number}", urllib.parse.quote(number, safe=""))
    elif not valid_http_url(url):
        raise invalid("tracking.url", f"must be an http or https URL of at most {MAX_URL} characters")
    return status, {"carrier": carrier, "number": number, "url": url}


#: An order is invoiced as it first reaches one of these (DELIVERED: one that skipped SHIPPED).
INVOICED_STATUSES = ("SHIPPED", "DELIVERED")


def update_order_status(conn, company_id, order_id, status, tracking=None, source="api",
                        reason=None):
    """The API's rule: any status to any status, except out of CANCELLED. Tracking, once set,
    stays through later transitions. Cancelling touches neither stock, returns nor an
    invoice (staff void or credit it); the buyer is emailed (order_cancelled, with reason,
    which the change records too). The order is invoiced as it first ships. source (api or
    dashboard) is recorded with the change."""
    before = load_order(conn, company_id, order_id)
    if before["status"] == "CANCELLED":
        raise ApiError(422, ORDER_CANCELLED)
    reason = one_line(reason) or None
    if reason is not None and len(reason) > MAX_CANCEL_REASON:
        raise invalid("reason", f"must be at most {MAX_CANCEL_REASON} characters")
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
    record_status_change(conn, order_id, previous, status, source,
                         order["tracking"] and order["tracking"]["number"], at, reason)
    emit(conn, company_id, "order.status_changed", dict(order, previousStatus=previous))
    summary = {"id": order_id, "previousStatus": previous, "total": order["total"],
               "customerId": order["customerId"]}
    # once, as it becomes SHIPPED
    shipping_email = status == "SHIPPED" and previous != "SHIPPED" and order["customerId"]
    if status in INVOICED_STATUSES and order_invoice(conn, order_id) is None:
        invoice_order(conn, company_id, order_id, announce=not shipping_email)
    if status == "SHIPPED":
        emit(conn, company_id, "order.shipped", dict(summary, tracking=order["tracking"]))
        if shipping_email:
            queue_shipping_email(conn, company_id, order)
    elif status == "CANCELLED":
        emit(conn, company_id, "order.cancelled", summary)
        queue_buyer_notice(conn, company_id, order["customerId"], order_id, "order_cancelled", [
            ["PO number", order["poNumber"] or "none"], ["Reason", reason or "none given"]])
    return order


def restock_order(conn, company_id, order_id, actor=None):
    """A cancelled order's units back in stock, once: a cancellation movement for each of its
    lines. Cancelling through the API never does this (the spec); staff choose to as they
    cancel in the dashboard, or later (order-restock, the order's page)."""
    order = load_order(conn, company_id, order_id)
    if order["status"] != "CANCELLED":
        raise ApiError(422, RESTOCK_NOT_CANCELLED)
    if order_restocked(conn, order_id):
        raise ApiError(422, ALREADY_RESTOCKED)
    items = conn.execute("SELECT product_id, quantity FROM order_items WHERE order_id = ? "
                         "ORDER BY position", (order_id,)).fetchall()
    return move_stock(conn, company_id, [tuple(item) for item in items], "cancellation",
                      actor or SYSTEM, order_id=order_id)


def order_restocked(conn, order_id):
    """Whether a cancelled order's units are back in stock."""
    return conn.execute("SELECT 1 FROM stock_movements WHERE order_id = ? AND "
                        "reason = 'cancellation' LIMIT 1", (order_id,)).fetchone() is not None


def dashboard_allows(from_status, to_status):
    return to_status in DASHBOARD_TRANSITIONS.get(from_status, ())


def dashboard_update_order_status(conn, company_id, order_id, status, tracking=None,
                                  reason=None, confirmed=True):
    """A status change on the dashboard's behalf, held to its stricter workflow; cancelling
    only once confirmed (the form's box)."""
    current = load_order(conn, company_id, order_id)["status"]
    if current == "CANCELLED" or not dashboard_allows(current, status):
        if current == "CANCELLED":
            raise ApiError(422, ORDER_CANCELLED)
        raise ApiError(422, f"The dashboard does not move an order from {current} to {status}.")
    if status == "CANCELLED" and not confirmed:
        raise invalid("confirm", "tick the box to cancel the order")
    return update_order_status(conn, company_id, order_id, status, tracking, "dashboard",
                               reason)


# 9.4 Returns and refunds ---------------------------------------------------------------------

def load_return(conn, company_id, return_id):
    return load_row(conn, "returns", "Return", company_id, return_id)


def check_return_lines(returnable, lines):
    """Refuses lines ({order item ID: units}) that are not some of returnable's units
    (returnable_units())."""
    if not lines:
        raise invalid("lines", "choose at least one line and how many of its units go back")
    for item_id, units in lines.items():
        if item_id not in returnable:
            raise invalid("lines", f"{item_id} is not a line of this order")
        name, left = returnable[item_id]
        if not isinstance(units, int) or not 1 <= units <= left:
            raise invalid("lines", f"at most {left} units of {name} can go back" if left
                          else f"every unit of {name} is already in a return")


def open_return(conn, company_id, order_id, reason, item_count=None, actor=None, lines=None,
                customer_id=None):
    """A return opened by a customer (actor None) or from the dashboard (actor 'staff').

    lines, {order item ID: units}, are what goes back (itemCount is then their number), each
    at most the units of the line not already in another return of the order; without lines,
    item_count says how many of the order's lines go back (the older form, which records no
    lines). customer_id is the buyer opening it at the storefront: the order must be theirs,
    and shipped or delivered."""
    if customer_id is None:
        order = load_order(conn, company_id, order_id)
    else:
        order = buyer_order(conn, company_id, customer_id, order_id)
        if order["status"] not in RETURNABLE_ORDER_STATUSES:
            raise ApiError(422, RETURN_NOT_SHIPPED)
    if actor not in (None, "staff"):
        raise invalid("actor", "must be staff or absent")
    reason, refusals = (reason or "").strip(), Refusals()
    shortest, longest = RETURN_REASON_LENGTH
    with refusals.check():
        if not shortest <= len(reason) <= longest:
            raise invalid("reason", f"must be {shortest} to {longest} characters")
    returnable = returnable_units(conn, order_id)
    with refusals.check():
        if lines is not None:
            check_return_lines(returnable, lines)
            item_count = len(lines)
        elif item_count is None:
            item_count = len(returnable)
        if not 1 <= item_count <= len(returnable):
            raise invalid("itemCount", f"must be 1 to {len(returnable)}, the order's line items")
    refusals.raise_any()
    return_id, at = new_id_at("ret")
    conn.execute(
        "INSERT INTO returns (id, company_id, order_id, customer_id, status, reason, item_count, "
        "actor, created_at, updated_at) VALUES (?, ?, ?, ?, 'REQUESTED', ?, ?, ?, ?, ?)",
        (return_id, company_id, order_id, order["customer_id"], reason, item_count, actor, at, at))
    conn.executemany("INSERT INTO return_lines (return_id, order_item_id, quantity) "
                     "VALUES (?, ?, ?)", [(return_id, item_id, units)
                                          for item_id, units in (lines or {}).items()])
    payload = {"id": return_id, "orderId": order_id, "customerId": order["customer_id"],
               "itemCount": item_count, "reason": reason, "status": "REQUESTED"}
    if actor:
        payload["actor"] = actor
    emit(conn, company_id, "return.created", payload)
    return return_record(conn, company_id, return_id)


def returnable_units(conn, order_id):
    """{order item ID: (product name, units not yet in a return of the order)}."""
    return {row[0]: (row[1], row[2] - row[3]) for row in conn.execute(
        "SELECT i.id, p.name, i.quantity, COALESCE((SELECT SUM(l.quantity) FROM return_lines l "
        "WHERE l.order_item_id = i.id), 0) FROM order_items i JOIN products p ON p.id = "
        "i.product_id WHERE i.order_id = ? ORDER BY i.position", (order_id,))}


def returns_of_order(conn, company_id, order_id):
    """The order's returns, oldest first, each with its refund's amount (None before it)."""
    return conn.execute(
        "SELECT r.*, f.amount_cents FROM returns r LEFT JOIN refunds f ON f.return_id = r.id "
        "WHERE r.order_id = ? AND r.company_id = ? ORDER BY r.created_at, r.id",
        (order_id, company_id)).fetchall()


def return_lines_of(conn, return_ids):
    """{return ID: [(product name, SKU, units)]} for these returns (in order line order)."""
    lines = collections.defaultdict(list)
    if return_ids:  # PostgreSQL has no empty IN ()
        for row in conn.execute(
                "SELECT l.return_id, p.name, p.sku, l.quantity FROM return_lines l JOIN "
                "order_items i ON i.id = l.order_item_id JOIN products p ON p.id = i.product_id "
                f"WHERE l.return_id IN ({','.join('?' * len(return_ids))}) "
                "ORDER BY l.return_id, i.position", list(return_ids)):
            lines[row[0]].append(tuple(row[1:]))
    return lines


def returns_json(conn, rows):
    """Returns as the API shows them (return_json), with their lines and refunds read in two
    queries however many they are."""
    if not rows:  # PostgreSQL has no empty IN ()
        return []
    ids = [row["id"] for row in rows]
    marks = ",".join("?" * len(ids))
    lines = collections.defaultdict(list)
    for row in conn.execute(
            "SELECT l.return_id, l.order_item_id, i.product_id, l.quantity FROM return_lines l "
            f"JOIN order_items i ON i.id = l.order_item_id WHERE l.return_id IN ({marks}) "
            "ORDER BY l.return_id, i.position", ids):
        lines[row[0]].append(tuple(row[1:]))
    refunds = {row["return_id"]: row for row in conn.execute(
        f"SELECT * FROM refunds WHERE return_id IN ({marks})", ids)}
    return [return_json(row, lines[row["id"]], refunds.get(row["id"])) for row in rows]


def return_record(conn, company_id, return_id):
    """One return as the API shows it, or its 404."""
    return returns_json(conn, [load_return(conn, company_id, return_id)])[0]


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
    queue_buyer_notice(conn, company_id, row["customer_id"], row["order_id"],
                       "return_approved", [["Reason given", row["reason"]]])
    return returns_json(conn, [row])[0]


def receive_return(conn, company_id, return_id):
    return returns_json(conn, [_move_return(conn, company_id, return_id, "APPROVED",
                                            "RECEIVED")])[0]


def refund_return(conn, company_id, return_id, method, good_units, damaged_units,
                  subtotal_cents, amount_cents=None, lines=None, actor=None):
    """The refund that moves a return RECEIVED to REFUNDED (PROCESSED_REFUND_FIELDS, as
    refund.processed carries it); amount defaults to the subtotal and may be overridden. The
    good units of each line go back to its product's stock (a return movement, made by
    actor), the damaged ones do not: lines, {order item ID: (good, damaged)}, say so for the
    return's lines (the breakdown's goodUnits and damagedUnits are then their sums, and may
    be None); without lines the two are split over the return's lines where that can be done
    one way only (see refund_restock). A return that records no lines (the older form) moves
    no stock."""
    if method not in REFUND_METHODS:
        raise invalid("method", f"must be {' or '.join(REFUND_METHODS)}")
    if lines is not None:
        good_units, damaged_units = refund_line_sums(lines, good_units, damaged_units)
    for field, value in (("goodUnits", good_units), ("damagedUnits", damaged_units),
                         ("subtotal", subtotal_cents)):
        if not isinstance(value, int) or value < 0:
            raise invalid(field, "must be a whole number >= 0")
    amount_cents = subtotal_cents if amount_cents is None else amount_cents
    if not isinstance(amount_cents, int) or amount_cents < 0:
        raise invalid("amount", "must be an amount >= 0")
    row = _move_return(conn, company_id, return_id, "RECEIVED", "REFUNDED")
    # An order is never refunded more than it cost (tax included: a refund, or its credit
    # note, gives back the tax paid on what came back), over all of its returns together.
    left = conn.execute(
        "SELECT o.total_cents + o.tax_cents - COALESCE((SELECT SUM(f.amount_cents) FROM "
        "refunds f JOIN "
        "returns r ON r.id = f.return_id WHERE r.order_id = o.id), 0) FROM orders o "
        "WHERE o.id = ?", (row["order_id"],)).fetchone()[0]
    if amount_cents > left:
        raise invalid("amount", f"must be at most {money(max(left, 0))}, what the order has "
                                f"left to refund")
    restock = refund_restock(conn, return_id, lines, good_units, damaged_units)
    came_back = units_returned(conn, row)
    if not 1 <= good_units + damaged_units <= came_back:
        raise invalid("goodUnits", REFUND_UNITS.format(units=came_back))
    refund_id, at = new_id_at("ref")
    refund = {"id": refund_id, "company_id": company_id, "return_id": return_id,
              "amount_cents": amount_cents, "method": method, "good_units": good_units,
              "damaged_units": damaged_units, "subtotal_cents": subtotal_cents,
              "created_at": at}
    insert_row(conn, "refunds", refund)
    note = issue_credit_note(conn, company_id, row["customer_id"], refund_id, amount_cents,
                             at) if method == "CREDIT" else None
    queue_buyer_notice(conn, company_id, row["customer_id"], row["order_id"], "return_refunded",
                       [["Refund", amount_text(money(amount_cents))],
                        ["How", f"credit note {note['number']}, for your invoices" if note else
                         "as a credit toward your invoices" if method == "CREDIT" else
                         "paid back outside the store, as agreed with you"]])
    move_stock(conn, company_id, restock, "return", actor or SYSTEM, order_id=row["order_id"],
               return_id=return_id)
    processed = record_json(PROCESSED_REFUND_FIELDS, dict(
        refund, order_id=row["order_id"], customer_id=row["customer_id"]))
    emit(conn, company_id, "refund.processed", processed)
    return processed


def units_returned(conn, return_row):
    """The units a return brought back, which its refund counts at most: those of its lines,
    or, for a return that records none (the older form), those of its order that no other
    refund counted."""
    (units,) = conn.execute("SELECT SUM(quantity) FROM return_lines WHERE return_id = ?",
                            (return_row["id"],)).fetchone()
    if units is not None:
        return units
    return conn.execute(
        "SELECT (SELECT SUM(quantity) FROM order_items WHERE order_id = ?) - COALESCE((SELECT "
        "SUM(f.good_units + f.damaged_units) FROM refunds f JOIN returns r ON r.id = "
        "f.return_id WHERE r.order_id = ?), 0)",
        (return_row["order_id"], return_row["order_id"])).fetchone()[0]


def return_subtotal_cents(conn, return_id):
    """What a return's lines cost at their frozen prices (the refund form proposes it)."""
    return conn.execute(
        "SELECT COALESCE(SUM(l.quantity * i.unit_price_cents), 0) FROM return_lines l JOIN "
        "order_items i ON i.id = l.order_item_id WHERE l.return_id = ?", (return_id,)
    ).fetchone()[0]


def refund_line_sums(lines, good_units, damaged_units):
    """A refund's goodUnits and damagedUnits from its lines ({order item ID: (good,
    damaged)}): their sums, which a total given as well must equal."""
    for item_id, split in lines.items():
        if not (isinstance(split, tuple) and len(split) == 2
                and all(isinstance(units, int) and units >= 0 for units in split)):
            raise invalid("lines", f"{item_id}: good and damaged units must be whole numbers "
                                   ">= 0")
    sums = []
    for field, given, index in (("goodUnits", good_units, 0), ("damagedUnits", damaged_units, 1)):
        total = sum(split[index] for split in lines.values())
        if given is not None and given != total:
            raise invalid(field, f"must be {total}, the sum over the lines, or left out")
        sums.append(total)
    return sums


def refund_restock(conn, return_id, lines, good_units, damaged_units):
    """[(product ID, good units)] a refund puts back, line by line: as lines say ({order item
    ID: (good, damaged)}, each at most the line's units in the return), or else from the
    totals where only one split is possible (one line; no good unit; every unit good). A
    return without recorded lines puts nothing back."""
    recorded = conn.execute(
        "SELECT l.order_item_id, i.product_id, p.name, l.quantity FROM return_lines l JOIN "
        "order_items i ON i.id = l.order_item_id JOIN products p ON p.id = i.product_id "
        "WHERE l.return_id = ? ORDER BY i.position", (return_id,)).fetchall()
    if not recorded:
        if lines:
            raise invalid("lines", "this return records no lines: give the good and damaged "
                                   "units alone")
        return []
    if lines is None:
        if len(recorded) == 1:
            lines = {recorded[0][0]: (good_units, damaged_units)}
        elif good_units == 0:
            lines = {}
        elif damaged_units == 0 and good_units == sum(row[3] for row in recorded):
            lines = {row[0]: (row[3], 0) for row in recorded}
        else:
            raise invalid("lines", REFUND_LINES_NEEDED)
    unknown = sorted(set(lines) - {row[0] for row in recorded})
    if unknown:
        raise invalid("lines", f"{unknown[0]} is not a line of this return")
    restock = []
    for item_id, product_id, name, units in recorded:
        good, damaged = lines.get(item_id, (0, 0))
        if good + damaged > units:
            raise invalid("lines", f"at most {units} units of {name} came back")
        if good:
            restock.append((product_id, good))
    return restock


# 9.5 Billing ---------------------------------------------------------------------------------
# An event whose signature passed (HTTP API, Billing) is acted on here, in the caller's write
# transaction: an invoice.paid of a company's Stripe customer is recorded through
# record_invoice_paid together with Stripe's event ID, so that a repeat of the event (Stripe
# may send one twice, and retries until it is answered) finds the ID and does nothing. Other
# events, and invoices no company can take, are answered and ignored, and leave no ID behind:
# Stripe can send them again (its dashboard's "Resend") once the company is mapped.

def check_currency(currency):
    """A currency code as Stripe writes it: three lower-case letters."""
    if not re.fullmatch(r"[a-z]{3}", currency or ""):
        raise invalid("currency", "must be a three-letter lower-case code")


def record_invoice_paid(conn, company_id, stripe_invoice_id, amount_paid, currency,
                        hosted_invoice_url, number, period_start, period_end):
    """A paid invoice of the company's own subscription, as the billing provider reports it;
    amount_paid is in the currency's minor unit (see money_in). Stripe's webhook and the
    invoice-paid command both record through here. Returns the invoice as invoice.paid
    carries it."""
    load_company(conn, company_id)
    for field, value in (("stripeInvoiceId", stripe_invoice_id), ("number", number)):
        if not value:
            raise invalid(field, "is required")
    check_currency(currency)
    if not valid_http_url(hosted_invoice_url):
        raise invalid("hostedInvoiceUrl", "must be an http or https URL")
    if not (isinstance(amount_paid, int) and not isinstance(amount_paid, bool)
            and 0 <= amount_paid <= MAX_AMOUNT_CENTS):
        raise invalid("amountPaid", f"must be a whole number of minor units from 0 to "
                                    f"{MAX_AMOUNT_CENTS}")
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
    row = {"id": invoice_id, "company_id": company_id, "stripe_invoice_id": stripe_invoice_id,
           "amount_paid_minor": amount_paid, "currency": currency,
           "hosted_invoice_url": hosted_invoice_url, "number": number,
           "period_start": period[0], "period_end": period[1], "created_at": at}
    insert_row(conn, "invoices", row)
    invoice = invoice_json(row)
    emit(conn, company_id, "invoice.paid", invoice)
    return invoice


def parse_stripe_event(body):
    """The event object of a verified body, checked for what receive_stripe_event reads."""
    require_object(body, "event")
    for field in ("id", "type"):
        if not isinstance(body.get(field), str) or not body[field]:
            raise invalid(field, "must be a non-empty string")
    data = body.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("object"), dict):
        raise invalid("data.object", "must be an object")
    return body


def receive_stripe_event(conn, event):
    """What became of a Stripe event: {"result": "recorded"}, {"result": "duplicate"}, or
    {"result": "ignored", "reason": ...}."""
    if event["type"] != "invoice.paid":
        return {"result": "ignored", "reason": f"{event['type']} is not acted on"}
    if conn.execute("SELECT 1 FROM stripe_events WHERE id = ?", (event["id"],)).fetchone():
        return {"result": "duplicate"}
    invoice = event["data"]["object"]
    customer = invoice.get("customer")
    customer = customer.get("id") if isinstance(customer, dict) else customer
    company = conn.execute("SELECT id FROM companies WHERE stripe_customer_id = ?",
                           (customer,)).fetchone() if isinstance(customer, str) else None
    if company is None:
        log.warning("Stripe event %s: invoice %s is of Stripe customer %s, which is no "
                    "company's: map it (company-update COMPANY_ID --stripe-customer %s) and "
                    "resend the event from Stripe", event["id"], invoice.get("id"), customer,
                    customer)
        return {"result": "ignored", "reason": f"Stripe customer {customer} is no company's"}
    try:
        start, end = invoice_period(invoice)
        currency = invoice.get("currency")
        record_invoice_paid(
            conn, company["id"], _text(invoice.get("id")), invoice.get("amount_paid"),
            currency.lower() if isinstance(currency, str) else None,
            _text(invoice.get("hosted_invoice_url")), _text(invoice.get("number")),
            iso(start * 1000), iso(end * 1000))
    except ApiError as refusal:
        # Nothing is written before a refusal; a retry would be refused alike.
        reason = "; ".join(f"{d['field']}: {d['rule']}" for d in refusal.details or ()) \
            or refusal.message
        log.warning("Stripe event %s: invoice %s not recorded: %s", event["id"],
                    invoice.get("id"), reason)
        return {"result": "ignored", "reason": reason}
    conn.execute("INSERT INTO stripe_events (id, company_id, event_type, received_at) "
                 "VALUES (?, ?, ?, ?)", (event["id"], company["id"], event["type"], now_iso()))
    return {"result": "recorded"}


def _text(value):
    return value if isinstance(value, str) else None


#: Unix times iso() can write (years 1970 to 9999).
_LAST_UNIX_SECOND = 253402300799


def invoice_period(invoice):
    """(start, end) in Unix seconds of what a paid invoice paid for: the service period of its
    subscription lines (the earliest start to the latest end; prorations only when the invoice
    has nothing else), and the invoice's own period_start and period_end only for an invoice
    without one. Those two fields bound the invoice items the invoice may take, not the service
    it charges for: a renewal's are the period that just ended while its line is the one paid
    in advance, and a subscription's first invoice has the same moment in both. Lines are read
    as the event carries them."""
    lines = list(_subscription_lines(invoice))
    kept = [line for line, proration in lines if not proration] or [line for line, _ in lines]
    periods = [line.get("period") if isinstance(line.get("period"), dict) else {}
               for line in kept]
    starts = [period.get("start") for period in periods] or [invoice.get("period_start")]
    ends = [period.get("end") for period in periods] or [invoice.get("period_end")]
    if not all(isinstance(value, int) and not isinstance(value, bool)
               and 0 <= value <= _LAST_UNIX_SECOND for value in starts + ends):
        raise invalid("period", "must be Unix times")
    return min(starts), max(ends)


def _subscription_lines(invoice):
    """(line, whether it is a proration) of each subscription line: in the current shape of
    Stripe's API (parent.subscription_item_details) and the older one (type "subscription")."""
    lines = invoice.get("lines")
    data = lines.get("data") if isinstance(lines, dict) else None
    for line in data if isinstance(data, list) else ():
        if not isinstance(line, dict):
            continue
        parent = line.get("parent")
        details = parent.get("subscription_item_details") if isinstance(parent, dict) else None
        if isinstance(details, dict):
            yield line, bool(details.get("proration"))
        elif line.get("type") == "subscription":
            yield line, bool(line.get("proration"))


# ---------------------------------------------------------------------------------------------
# 10. Integrations and accounts
# ---------------------------------------------------------------------------------------------

# 10.1 Webhook subscriptions ------------------------------------------------------------------

def load_webhook(conn, company_id, webhook_id):
    return load_row(conn, "webhooks", "Webhook", company_id, webhook_id)


def new_webhook_secret():
    return "whsec_" + base64.urlsafe_b64encode(secrets.token_bytes(24)).decode("ascii")


def _webhook_changes(body, creating, every=False):
    """every: gather the url's and the events' refusals (see Refusals) for a form; the API's
    answer is the first."""
    require_object(body)
    changes, refusals = {}, Refusals(first=not every)
    if creating or "url" in body:
        with refusals.check():
            changes["url"] = webhook_url(body.get("url"), creating)
    if creating or "events" in body:
        with refusals.check():
            changes["events"] = webhook_events(body.get("events"))
    refusals.raise_any()
    if "isActive" in body:
        if not isinstance(body["isActive"], bool):
            raise invalid("isActive", "must be true or false")
        changes["is_active"] = int(body["isActive"])
    return changes


def webhook_url(url, creating):
    if creating and (url is None or url == ""):
        raise ApiError(400, URL_REQUIRED)
    if not valid_http_url(url):
        raise ApiError(400, INVALID_URL)
    return url


def webhook_events(events):
    """A webhook's events as the column keeps them (JSON, each once)."""
    if events is not None and not isinstance(events, list):
        raise invalid("events", "must be an array of event names")
    if not events:
        raise ApiError(400, EVENTS_REQUIRED)
    for name in events:
        if not isinstance(name, str):
            raise invalid("events", "must be an array of event names")
        if name not in EVENT_CATALOG:
            raise ApiError(400, UNKNOWN_EVENT.format(name=name))
    return json_text(list(dict.fromkeys(events)))


def create_webhook(conn, company_id, body, every=False):
    """A new webhook, answered with its secret (the only answer that carries it); every: see
    _webhook_changes."""
    changes = _webhook_changes(body, creating=True, every=every)
    count = conn.execute("SELECT COUNT(*) FROM webhooks WHERE company_id = ?",
                         (company_id,)).fetchone()[0]
    if count >= MAX_WEBHOOKS:
        raise ApiError(409, TOO_MANY_WEBHOOKS)
    webhook_id, at = new_id_at("wh")
    conn.execute(
        "INSERT INTO webhooks (id, company_id, url, events, is_active, secret, created_at, "
        "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (webhook_id, company_id, changes["url"], changes["events"], changes.get("is_active", 1),
         new_webhook_secret(), at, at))
    return webhook_json(load_webhook(conn, company_id, webhook_id), with_secret=True)


def company_webhooks(conn, company_id):
    """The company's webhooks, newest first (at most MAX_WEBHOOKS: no pages)."""
    return conn.execute("SELECT * FROM webhooks WHERE company_id = ? "
                        "ORDER BY created_at DESC, id DESC", (company_id,)).fetchall()


def update_webhook(conn, company_id, webhook_id, body):
    changes = _webhook_changes(body, creating=False)
    update_changed(conn, "webhooks", load_webhook(conn, company_id, webhook_id), changes)
    return webhook_json(load_webhook(conn, company_id, webhook_id))


def delete_webhook(conn, company_id, webhook_id):
    """Removes the webhook, its delivery log and its pending deliveries."""
    load_webhook(conn, company_id, webhook_id)
    conn.execute("DELETE FROM webhooks WHERE id = ?", (webhook_id,))
    return {"id": webhook_id, "deleted": True}


def rotate_webhook_secret(conn, company_id, webhook_id, grace_hours=WEBHOOK_SECRET_GRACE_HOURS):
    """A new secret; for grace_hours the old one still signs X-Webhook-Signature-Old."""
    row = load_webhook(conn, company_id, webhook_id)
    if not isinstance(grace_hours, (int, float)) or not 0 <= grace_hours <= 24 * 30:
        raise invalid("graceHours", "must be 0 to 720")
    secret = new_webhook_secret()
    grace = iso(int((time.time() + grace_hours * 3600) * 1000)) if grace_hours else None
    conn.execute("UPDATE webhooks SET secret = ?, old_secret = ?, grace_expires_at = ?, "
                 "updated_at = ? WHERE id = ?",
                 (secret, row["secret"] if grace else None, grace, now_iso(), webhook_id))
    return record_json(WEBHOOK_SECRET_FIELDS, {"id": webhook_id, "secret": secret,
                                               "grace_expires_at": grace})


def recent_deliveries(conn, webhook_id, count=DELIVERIES_SHOWN):
    """The delivery log as the dashboard shows it: the most recent attempts first."""
    return [delivery_json(row) for row in conn.execute(
        "SELECT d.*, e.name AS event, e.body FROM deliveries d JOIN events e ON e.id = d.event_id "
        "WHERE d.webhook_id = ? AND d.state = 'done' ORDER BY d.attempted_at DESC, d.id DESC "
        "LIMIT ?", (webhook_id, count))]


# 10.2 Emails ---------------------------------------------------------------------------------
# What the staff see of the mail outbox, and sending a failed email again.

#: The states an email can be sent again from: it was not delivered, and nothing is trying.
SENDABLE_AGAIN = ("failed", "unsent")
NOT_SENDABLE_AGAIN = "Only a failed or unsent email can be sent again."


def load_email(conn, company_id, email_id):
    return load_row(conn, "emails", "Email", company_id, email_id)


def email_attempts(conn, email_id):
    """Every attempt to send the email, oldest first, with the server's reply."""
    return conn.execute("SELECT * FROM email_attempts WHERE email_id = ? "
                        "ORDER BY attempted_at, id", (email_id,)).fetchall()


def send_email_again(conn, company_id, email_id):
    """A failed or unsent email waits again, at once, with retries of its own (backing off
    from a minute again, for MAIL_RETRY_SECONDS; its Message-ID stays). No field table shows
    an email: the answer is small."""
    row = load_email(conn, company_id, email_id)
    if row["state"] not in SENDABLE_AGAIN:
        raise ApiError(422, NOT_SENDABLE_AGAIN)
    at = now_iso()
    conn.execute("UPDATE emails SET state = 'pending', queued_at = ?, next_attempt_at = ?, "
                 "finished_at = NULL WHERE id = ?", (at, at, email_id))
    announce(email_id)
    return {"id": email_id, "queued": True}


# 10.3 API keys and idempotency ---------------------------------------------------------------

def key_expired(expires_at, now):
    """A key with an expiry is refused from that moment on (now: ISO text)."""
    return bool(expires_at) and expires_at <= now


def create_api_key(conn, company_id, scopes, rate_limit=DEFAULT_KEY_RATE_LIMIT, expires_at=None):
    """A new key; the returned "key" is shown this once and only its hash is kept."""
    load_company(conn, company_id)
    unknown = [scope for scope in scopes if scope not in SCOPES]
    if unknown or not scopes:
        raise invalid("scopes", f"must be some of {', '.join(SCOPES)}")
    if not isinstance(rate_limit, int) or rate_limit < 1:
        raise invalid("rateLimit", "must be a positive whole number")
    key = "sk_" + secrets.token_urlsafe(32)
    key_id, at = new_id_at("key")
    row = {"id": key_id, "company_id": company_id, "key_hash": hash_key(key),
           "scopes": " ".join(scopes), "rate_limit": rate_limit, "expires_at": expires_at,
           "created_at": at}
    insert_row(conn, "api_keys", row)
    return record_json(NEW_KEY_FIELDS, dict(row, key=key))


def revoke_api_key(conn, company_id, key_id):
    load_row(conn, "api_keys", "API key", company_id, key_id)
    conn.execute("UPDATE api_keys SET revoked = 1 WHERE id = ?", (key_id,))
    return {"id": key_id, "revoked": True}


def find_api_key(conn, key_hash):
    """The row of the key with this hash, or None."""
    return conn.execute(
        "SELECT id, company_id, key_hash, scopes, rate_limit, expires_at, revoked "
        "FROM api_keys WHERE key_hash = ?", (key_hash,)).fetchone()


def claim_idempotency_key(conn, company_id, key, fingerprint, expires_at):
    """Claim a company's Idempotency-Key for one request (its fingerprint) in this process:
    None once claimed, or the (status, body) stored for the same request, to replay. The key
    used with another request, or held by a process that still lives, is refused."""
    stored = conn.execute(
        "SELECT fingerprint, status, body, claimed_by FROM idempotency_keys "
        "WHERE company_id = ? AND key = ? AND expires_at > ?",
        (company_id, key, now_iso())).fetchone()
    if stored is not None and stored["claimed_by"] is None:
        if stored["fingerprint"] != fingerprint:
            raise ApiError(409, IDEMPOTENCY_KEY_REUSED)
        return stored["status"], bytes(stored["body"])
    if stored is not None and claimer_alive(stored["claimed_by"]):
        raise ApiError(409, IDEMPOTENCY_KEY_IN_PROGRESS)
    conn.execute(
        "INSERT INTO idempotency_keys (company_id, key, fingerprint, status, body, "
        "expires_at, claimed_by) VALUES (?, ?, ?, 0, ?, ?, ?) "
        "ON CONFLICT (company_id, key) DO UPDATE SET fingerprint = excluded.fingerprint, "
        "status = 0, body = excluded.body, expires_at = excluded.expires_at, "
        "claimed_by = excluded.claimed_by",
        (company_id, key, fingerprint, b"", expires_at, process_identity()))
    return None


def store_idempotent_response(conn, company_id, key, status, body):
    """The response to a claimed key's request, kept to be replayed; the claim ends."""
    conn.execute("UPDATE idempotency_keys SET status = ?, body = ?, claimed_by = NULL "
                 "WHERE company_id = ? AND key = ?", (status, body, company_id, key))


def release_idempotency_key(conn, company_id, key):
    """Let go of a key this process claimed, so that a retry runs the request."""
    conn.execute("DELETE FROM idempotency_keys WHERE company_id = ? AND key = ? "
                 "AND claimed_by = ?", (company_id, key, process_identity()))


def expire_idempotency_keys(conn, now):
    """Forget Idempotency-Keys (and their stored responses) whose time is over."""
    conn.execute("DELETE FROM idempotency_keys WHERE expires_at < ?", (now,))


def company_api_keys(conn, company_id):
    return conn.execute("SELECT id, scopes, rate_limit, expires_at, revoked, created_at "
                        "FROM api_keys WHERE company_id = ? ORDER BY created_at DESC, id DESC",
                        (company_id,)).fetchall()


# 10.4 Accounts and sessions ------------------------------------------------------------------

#: Failed sign-ins per email and per address that cost nothing; then each further try waits
#: twice as long as the one before (2, 4, ... 128 seconds), and from the lockout count on a
#: client address is refused for SIGN_IN_LOCKOUT_SECONDS after its last failure. An account's
#: own wait never grows past SIGN_IN_ACCOUNT_MAX_WAIT: its failures may come from strangers,
#: who must not keep the owner out (a completed reset or a verified link clears them).
SIGN_IN_FREE_FAILURES = 3
SIGN_IN_LOCKOUT_FAILURES = 10
SIGN_IN_LOCKOUT_SECONDS = 15 * 60
SIGN_IN_ACCOUNT_MAX_WAIT = 60
#: Live sessions an account keeps at most: a new sign-in ends the oldest beyond it.
MAX_SESSIONS = 10
SIGN_IN_REFUSED = "Wrong email or password."
STAFF_EMAIL_TAKEN = "A staff account with this email already exists in the company."
#: Two-step sign-in: recovery codes a set-up gives, and how long a sign-in waits for its code.
RECOVERY_CODES = 10
SIGN_IN_STEP_SECONDS = 5 * 60
SIGN_IN_CODE_REFUSED = "Wrong code. Enter the code your app shows now, or a recovery code."
SIGN_IN_STEP_EXPIRED = "The sign-in waited too long for its code: sign in again."
TOTP_CODE_WRONG = "is not the code your app shows now"
TWO_STEP_NOT_STARTED = "Set-up has not begun: start it again."
TWO_STEP_KEPT = ("The company requires two-step sign-in of its owners: an owner keeps it on "
                 "(another owner may change the setting).")
SIGN_IN_THROTTLED = "Too many failed sign-ins. Try again in {seconds} seconds."


def check_password(password):
    if len(password) < PASSWORD_MIN:
        raise invalid("password", f"must be at least {PASSWORD_MIN} characters")


@dataclasses.dataclass(frozen=True)
class Accounts:
    """One kind of account that signs in to a web surface: its table, the table of its
    sessions and the column there that names the account, and the condition an account must
    meet to sign in. Every function below serves any kind; staff are the first."""
    noun: str
    table: str
    sessions: str
    account_column: str
    enabled: str  # a condition on the account's columns, each written {a}column
    actor: str  # the type of Actor its accounts are as they change stock
    links: str  # the table of its emailed links' tokens
    session_columns: str = ""  # what else a session tells of its account (a.column, ...)

    def enabled_in(self, alias=None):
        """The condition an account must meet, its columns qualified by alias (by default the
        table's name)."""
        return self.enabled.format(a=(alias or self.table) + ".")


#: A session tells the account's role and whether it signs in with a code (and whether its
#: company requires that of owners), read afresh at every request.
STAFF = Accounts("Staff account", "staff", "staff_sessions", "staff_id", "{a}disabled = 0",
                 "staff", "staff_tokens",
                 "a.role, a.totp_secret IS NOT NULL AS two_step_on, c.two_step, ")
#: The people of a storefront's customers: neither the contact nor its customer blocked (one
#: whose customer awaits approval may sign in, and sees that it does). A session tells the
#: contact's customer and role, read afresh at every request. The customer is looked up by
#: its key: written "customer_id IN (SELECT ... WHERE status <> 'BLOCKED')", SQLite listed
#: every customer of every company at each request.
CONTACTS = Accounts("Contact", "contacts", "contact_sessions", "contact_id",
                    "{a}status = 'ACTIVE' AND EXISTS (SELECT 1 FROM customers k WHERE "
                    "k.id = {a}customer_id AND k.status <> 'BLOCKED')", "buyer",
                    "contact_tokens", "a.customer_id, a.role, a.approval_limit_cents, ")


def create_staff(conn, company_id, email, password, role="owner"):
    load_company(conn, company_id)
    email = (email or "").strip()
    if not valid_email(email):
        raise ApiError(400, INVALID_EMAIL)
    check_staff_role(role)
    check_password(password)
    if conn.execute("SELECT 1 FROM staff WHERE company_id = ? AND email_key = ?",
                    (company_id, email.casefold())).fetchone():
        raise ApiError(409, STAFF_EMAIL_TAKEN)
    staff_id, at = new_id_at("stf")
    row = {"id": staff_id, "company_id": company_id, "email": email,
           "email_key": email.casefold(), "password_hash": hash_password(password),
           "role": role, "created_at": at}
    insert_row(conn, "staff", row)
    return staff_json(row)


def load_staff(conn, company_id, staff_id):
    return load_row(conn, "staff", STAFF.noun, company_id, staff_id)


def check_staff_role(role):
    if role not in STAFF_ROLES:
        raise invalid("role", STAFF_ROLE_MESSAGE)


def list_staff(conn, company_id):
    """The company's staff accounts that may sign in, by email (rows)."""
    return conn.execute("SELECT * FROM staff WHERE company_id = ? AND disabled = 0 "
                        "ORDER BY email_key, id", (company_id,)).fetchall()


def update_staff_role(conn, company_id, staff_id, role):
    """A staff member's new role; the company keeps an owner (LAST_OWNER)."""
    check_staff_role(role)
    row = load_staff(conn, company_id, staff_id)
    if role != "owner":
        _keep_an_owner(conn, company_id, staff_id)
    conn.execute("UPDATE staff SET role = ? WHERE id = ?", (role, staff_id))
    return staff_json({**row, "role": role})


def _keep_an_owner(conn, company_id, staff_id):
    """Refuses a change that would leave the company no owner who can sign in."""
    others = conn.execute("SELECT COUNT(*) FROM staff WHERE company_id = ? AND role = 'owner' "
                          "AND disabled = 0 AND id <> ?", (company_id, staff_id)).fetchone()[0]
    if not others:
        raise ApiError(409, LAST_OWNER)


def set_password(conn, accounts, account_id, password):
    """A new password, and an end to every session of the account."""
    check_password(password)
    conn.execute(f"UPDATE {accounts.table} SET password_hash = ? WHERE id = ?",
                 (hash_password(password), account_id))
    end_sessions(conn, accounts, account_id)


def disable_staff(conn, company_id, staff_id):
    """Ends the account and every session of it at once."""
    load_staff(conn, company_id, staff_id)
    conn.execute("UPDATE staff SET disabled = 1 WHERE id = ?", (staff_id,))
    end_sessions(conn, STAFF, staff_id)
    return {"id": staff_id, "disabled": True}


# Two-step sign-in (staff): a key set up from the dashboard's account page, confirmed by a
# code from it, with recovery codes for a lost phone; a sign-in whose password was right waits
# for a code in a sign-in step (a cookie of its own, minutes long) before it is a session.

def start_two_step(conn, company_id, staff_id, password):
    """A new key for the account to set up, proven by the password (a session alone must not
    lock its owner out); its current key, if any, works until then."""
    staff = load_staff(conn, company_id, staff_id)
    if not password_matches(password or "", staff["password_hash"]):
        raise invalid("password", CURRENT_PASSWORD_WRONG)
    secret = new_totp_secret()
    conn.execute("UPDATE staff SET totp_pending = ? WHERE id = ?", (secret, staff_id))
    return secret


def confirm_two_step(conn, company_id, staff_id, code, now_ms):
    """The key being set up is the account's, once a code from it is right; returns the new
    recovery codes (shown once: only their hashes are kept)."""
    staff = load_staff(conn, company_id, staff_id)
    if staff["totp_pending"] is None:
        raise ApiError(409, TWO_STEP_NOT_STARTED)
    step = totp_step(staff["totp_pending"], code, now_ms)
    if step is None:
        raise invalid("code", TOTP_CODE_WRONG)
    conn.execute("UPDATE staff SET totp_secret = totp_pending, totp_pending = NULL, "
                 "totp_step = ? WHERE id = ?", (step, staff_id))
    codes = ["-".join(secrets.token_hex(5)[i:i + 5] for i in (0, 5))
             for _ in range(RECOVERY_CODES)]
    conn.execute("DELETE FROM staff_recovery_codes WHERE staff_id = ?", (staff_id,))
    conn.executemany("INSERT INTO staff_recovery_codes (staff_id, code_hash) VALUES (?, ?)",
                     [(staff_id, recovery_code_key(code)) for code in codes])
    return codes


def end_two_step(conn, company_id, staff_id, password):
    """Password only again, proven by the password; an owner keeps it while the company
    requires it."""
    staff = load_staff(conn, company_id, staff_id)
    if not password_matches(password or "", staff["password_hash"]):
        raise invalid("password", CURRENT_PASSWORD_WRONG)
    if staff["role"] == "owner" and load_company(conn, company_id)["two_step"] == "owners":
        raise ApiError(409, TWO_STEP_KEPT)
    reset_two_step(conn, company_id, staff_id)


def reset_two_step(conn, company_id, staff_id):
    """The operator's way back in for a lost phone and lost recovery codes: the account's key
    and codes go (an owner whom the company requires it of sets a new one up at once)."""
    staff = load_staff(conn, company_id, staff_id)
    conn.execute("UPDATE staff SET totp_secret = NULL, totp_pending = NULL, totp_step = NULL "
                 "WHERE id = ?", (staff_id,))
    conn.execute("DELETE FROM staff_recovery_codes WHERE staff_id = ?", (staff_id,))
    return staff_json(staff)


def recovery_codes_left(conn, staff_id):
    return conn.execute("SELECT COUNT(*) FROM staff_recovery_codes WHERE staff_id = ?",
                        (staff_id,)).fetchone()[0]


def open_sign_in_step(conn, staff, now_ms):
    """A sign-in that waits for its code: returns its cookie's value (kept only hashed)."""
    token = secrets.token_urlsafe(32)
    conn.execute("DELETE FROM staff_sign_in_steps WHERE expires_at < ?", (iso(now_ms),))
    conn.execute("INSERT INTO staff_sign_in_steps (token_hash, staff_id, expires_at) "
                 "VALUES (?, ?, ?)", (hash_key(token), staff["id"],
                                      iso(now_ms + SIGN_IN_STEP_SECONDS * 1000)))
    return token


def sign_in_step(conn, token, now_ms):
    """The account (one that may sign in, with its key) whose sign-in waits on this cookie's
    value; None once it is over or unknown."""
    return conn.execute(
        "SELECT a.* FROM staff_sign_in_steps s JOIN staff a ON a.id = s.staff_id WHERE "
        "s.token_hash = ? AND s.expires_at > ? AND a.disabled = 0 AND a.totp_secret IS NOT "
        "NULL", (hash_key(token or ""), iso(now_ms))).fetchone()


def begin_sign_in(conn, accounts, account, subjects, now_ms, idle_seconds, second_step):
    """A sign-in whose password was checked: for no account, a failure counted (None); with
    second_step, a sign-in step that waits for a code; else a session. Returns the cookie's
    value."""
    if account is None:
        record_sign_in_failure(conn, subjects, now_ms)
        return None
    if second_step:
        return open_sign_in_step(conn, account, now_ms)
    return start_session(conn, accounts, account, subjects, now_ms, idle_seconds)


def finish_sign_in(conn, staff, token, code, subjects, now_ms, idle_seconds):
    """The sign-in step of this cookie's value, ended by a code: the account's current TOTP
    code (not used before) or one of its recovery codes, which it uses up. Returns the new
    session's cookie value; None, after counting a failed sign-in, for a wrong code."""
    step = totp_step(staff["totp_secret"], code, now_ms, staff["totp_step"] or -1)
    if step is not None:
        conn.execute("UPDATE staff SET totp_step = ? WHERE id = ?", (step, staff["id"]))
    elif not conn.execute("DELETE FROM staff_recovery_codes WHERE staff_id = ? AND "
                          "code_hash = ?", (staff["id"], recovery_code_key(code))).rowcount:
        record_sign_in_failure(conn, subjects, now_ms)
        return None
    conn.execute("DELETE FROM staff_sign_in_steps WHERE token_hash = ?", (hash_key(token),))
    return start_session(conn, STAFF, staff, subjects, now_ms, idle_seconds)


def sign_in_subjects(email, address, scope=""):
    """The throttle's subjects of a sign-in: the email (within a scope: a store's customers are
    not its staff, nor another store's) and the client address."""
    return ("email:" + scope + email.strip().casefold()[:MAX_EMAIL], "address:" + address)


def sign_in_wait(conn, subjects, now_ms):
    """Seconds before the next sign-in attempt for these subjects may be tried (0: now)."""
    wait = 0.0
    for row in conn.execute(
            f"SELECT subject, failures, last_failure_at FROM sign_in_failures "
            f"WHERE subject IN ({','.join('?' * len(subjects))})", subjects):
        failures = row["failures"]
        if failures < SIGN_IN_FREE_FAILURES:
            continue
        delay = (SIGN_IN_LOCKOUT_SECONDS if failures >= SIGN_IN_LOCKOUT_FAILURES
                 else 2 ** min(failures - SIGN_IN_FREE_FAILURES + 1, 16))
        if row["subject"].startswith("email:"):
            delay = min(delay, SIGN_IN_ACCOUNT_MAX_WAIT)
        wait = max(wait, js_parse_date(row["last_failure_at"]) / 1000 + delay - now_ms / 1000)
    return wait


def record_sign_in_failure(conn, subjects, now_ms):
    """One more failure for each subject; a subject quiet for the lockout time starts over."""
    at, forgotten = iso(now_ms), iso(now_ms - SIGN_IN_LOCKOUT_SECONDS * 1000)
    # counts that would start over anyway go, so guessed emails cannot grow the table forever
    conn.execute("DELETE FROM sign_in_failures WHERE last_failure_at < ?", (forgotten,))
    for subject in subjects:
        conn.execute(
            "INSERT INTO sign_in_failures (subject, failures, last_failure_at) VALUES (?, 1, ?) "
            "ON CONFLICT (subject) DO UPDATE SET last_failure_at = excluded.last_failure_at, "
            "failures = CASE WHEN sign_in_failures.last_failure_at < ? THEN 1 "
            "ELSE sign_in_failures.failures + 1 END",
            (subject, at, forgotten))


def clear_sign_in_failures(conn, email, scope=""):
    """An account's failed sign-ins forgotten: its owner proved the address (a reset, a
    verified link)."""
    conn.execute("DELETE FROM sign_in_failures WHERE subject = ?",
                 (sign_in_subjects(email, "", scope)[0],))


def find_account(conn, accounts, email, password, company_id=None):
    """The account of this kind with this email and password that may sign in, or None. An
    email may belong to accounts of several companies: the password picks the account, unless
    company_id names the one company to look in (a store's customers). An account without a
    password (a customer created through the API) costs the same work and matches nothing."""
    scoped = "" if company_id is None else " AND company_id = ?"
    rows = conn.execute(f"SELECT * FROM {accounts.table} WHERE email_key = ? AND "
                        f"{accounts.enabled_in()} AND password_hash IS NOT NULL{scoped} "
                        f"ORDER BY created_at, id", (email.strip().casefold(),)
                        + (() if company_id is None else (company_id,))).fetchall()
    if not rows:
        password_matches(password, _stand_in_hash())
    return next((row for row in rows if password_matches(password, row["password_hash"])),
                None)


def start_session(conn, accounts, account, subjects, now_ms, idle_seconds):
    """A new session for a successful sign-in; returns the cookie value (kept only hashed).
    Sessions left idle past the limit by browsers that never came back end here, and so do
    the account's oldest beyond MAX_SESSIONS."""
    conn.execute("DELETE FROM sign_in_failures WHERE subject = ?", (subjects[0],))
    conn.execute(f"DELETE FROM {accounts.sessions} WHERE last_seen_at < ?",
                 (iso(now_ms - idle_seconds * 1000),))
    token = secrets.token_urlsafe(32)
    conn.execute(f"INSERT INTO {accounts.sessions} (token_hash, {accounts.account_column}, "
                 f"created_at, last_seen_at) VALUES (?, ?, ?, ?)",
                 (hash_key(token), account["id"], iso(now_ms), iso(now_ms)))
    conn.execute(f"DELETE FROM {accounts.sessions} WHERE {accounts.account_column} = ? AND "
                 f"token_hash NOT IN (SELECT token_hash FROM {accounts.sessions} WHERE "
                 f"{accounts.account_column} = ? ORDER BY created_at DESC, token_hash DESC "
                 f"LIMIT ?)", (account["id"], account["id"], MAX_SESSIONS))
    return token


def load_session(conn, accounts, token):
    """The session of this cookie value with its account's ID, email and company, while the
    account may sign in; None otherwise."""
    return conn.execute(
        f"SELECT s.token_hash, s.created_at, s.last_seen_at, a.id AS account_id, a.email, "
        f"a.company_id, {accounts.session_columns}"
        f"c.name AS company_name, c.time_zone "
        f"FROM {accounts.sessions} s JOIN {accounts.table} a "
        f"ON a.id = s.{accounts.account_column} JOIN companies c ON c.id = a.company_id "
        f"WHERE s.token_hash = ? AND {accounts.enabled_in('a')}", (hash_key(token),)).fetchone()


def touch_session(conn, accounts, token_hash, now_ms):
    conn.execute(f"UPDATE {accounts.sessions} SET last_seen_at = ? WHERE token_hash = ?",
                 (iso(now_ms), token_hash))


def end_session(conn, accounts, token_hash):
    conn.execute(f"DELETE FROM {accounts.sessions} WHERE token_hash = ?", (token_hash,))


def end_sessions(conn, accounts, account_id):
    """Every session of an account ends at once."""
    conn.execute(f"DELETE FROM {accounts.sessions} WHERE {accounts.account_column} = ?",
                 (account_id,))


def staff_account(conn, company_id, email):
    """The company's staff account with this email, or None."""
    return conn.execute("SELECT * FROM staff WHERE company_id = ? AND email_key = ?",
                        (company_id, email.strip().casefold())).fetchone()


# 10.5 Storefront accounts --------------------------------------------------------------------
# A store's accounts are its customers' contacts (CONTACTS): they register (a new customer and
# its first contact), sign in and set their passwords at their store (see Web pages,
# Storefront). What a visitor is shown never depends on whether an address has an account: the
# difference is in the emails, which only the address's owner reads. An emailed link carries a
# random token (256 bits) of which only the hash is kept; it works once, for
# ACCOUNT_LINK_SECONDS, and using one ends every other link of its kind that its contact has.
# A new password and a block end the contact's password links. Links are built on the base URL
# setting.

def queue_account_email(conn, company, contact, kind, path="", **facts):
    """An email about a contact's account, with a link to path within its store."""
    return queue_email(conn, company["id"], kind, contact["email"], {
        "customerName": contact["name"] or contact["email"], "store": company["name"],
        "path": f"/store/{company['slug']}{path}", **facts}, to_name=contact["name"])


def account_mail_allowed(conn, company, contact, now_ms):
    """Whether one more email with a link may go to this contact within the hour."""
    (sent,) = conn.execute(
        "SELECT COUNT(*) FROM emails WHERE company_id = ? AND to_address = ? AND kind IN "
        "('account_verify', 'account_exists', 'account_reset', 'account_invite', "
        "'contact_invite') "
        "AND created_at > ?", (company["id"], contact["email"], iso(now_ms - 3600 * 1000))
    ).fetchone()
    return sent < ACCOUNT_MAILS_PER_HOUR


def issue_account_link(conn, account, purpose, now_ms, accounts=CONTACTS):
    """A new link of this purpose (verify or reset) for an account (a contact, unless accounts
    says which kind): its path on its surface (the store, the dashboard)."""
    token = secrets.token_urlsafe(32)
    conn.execute(f"INSERT INTO {accounts.links} (token_hash, {accounts.account_column}, "
                 f"purpose, created_at, expires_at) VALUES (?, ?, ?, ?, ?)",
                 (hash_key(token), account["id"], purpose, iso(now_ms),
                  iso(now_ms + ACCOUNT_LINK_SECONDS * 1000)))
    return f"/{purpose}/{token}"


def account_link(conn, company_id, purpose, token, now_ms, use=False):
    """The contact of the store whose link this is; with use, every link of this purpose of
    that contact ends. An unknown, used, expired or other store's link is LINK_EXPIRED."""
    row = account_link_row(conn, company_id, purpose, token)
    if row["expires_at"] <= iso(now_ms):
        raise ApiError(400, LINK_EXPIRED)
    if use:
        end_account_links(conn, row["contact_id"], (purpose,))
    return load_contact(conn, company_id, row["contact_id"])


def account_link_row(conn, company_id, purpose, token):
    """(contact_id, expires_at) of a link of the store, expired or not; LINK_EXPIRED when
    there is none."""
    row = conn.execute(
        "SELECT t.contact_id, t.expires_at FROM contact_tokens t JOIN contacts c "
        "ON c.id = t.contact_id WHERE t.token_hash = ? AND t.purpose = ? AND c.company_id = ?",
        (hash_key(token), purpose, company_id)).fetchone()
    if row is None:
        raise ApiError(400, LINK_EXPIRED)
    return row


def end_account_links(conn, account_id, purposes=("reset",), accounts=CONTACTS):
    conn.execute(f"DELETE FROM {accounts.links} WHERE {accounts.account_column} = ? AND "
                 f"purpose IN ({','.join('?' * len(purposes))})", (account_id, *purposes))


def register_customer(conn, store_slug, email, name, password, now_ms):
    """Self-registration at a store: a new customer (PENDING when the store approves its buyers,
    else ACTIVE) and its first contact, customer.created with source storefront, and an email
    whose link verifies the address; for an address that has an account already, only an
    email to its owner. Returns nothing either way, after the same work."""
    company = company_by_slug(conn, store_slug)
    email, refusals = (email or "").strip(), Refusals()  # the form's every refusal at once
    with refusals.check():
        if not email:
            raise ApiError(400, EMAIL_REQUIRED)
        if not valid_email(email):
            raise ApiError(400, INVALID_EMAIL)
    body = {"email": email, "name": name} if (name or "").strip() else {"email": email}
    _customer_changes(body, refusals)
    with refusals.check():
        check_password(password)
    refusals.raise_any()
    record_account_request(conn, company["id"], email, now_ms)
    existing = contact_by_email(conn, company["id"], email)
    if existing is not None:
        hash_password(password)  # what a new account costs
        if account_mail_allowed(conn, company, existing, now_ms):
            queue_account_email(conn, company, existing, "account_exists", "/reset")
        return
    status = "PENDING" if company["storefront_approval"] == "required" else "ACTIVE"
    created = create_customer(conn, company["id"], body, source="storefront",
                              store_slug=store_slug, password=password, status=status)
    contact = own_contact(conn, load_customer(conn, company["id"], created["id"]))
    queue_account_email(conn, company, contact, "account_verify",
                        issue_account_link(conn, contact, "verify", now_ms))


def verify_customer_email(conn, store_slug, token, now_ms):
    """The verification link of a registration: the address is the contact's. A used link
    stays (until its contact is blocked) so that using it again says the address is
    confirmed already (409), even past its hour, rather than that it expired."""
    company = company_by_slug(conn, store_slug)
    row = account_link_row(conn, company["id"], "verify", token)
    if load_contact(conn, company["id"], row["contact_id"])["email_verified"]:
        raise ApiError(409, EMAIL_VERIFIED_ALREADY)
    contact = account_link(conn, company["id"], "verify", token, now_ms)
    _mark_email_verified(conn, contact)
    clear_sign_in_failures(conn, contact["email"], f"{company['id']} ")
    return contact_json(load_contact(conn, company["id"], contact["id"]))


def _mark_email_verified(conn, contact):
    """The contact's address confirmed; the customer's own contact confirms the customer's
    (its emailVerified). emailVerified is no field of customer.updated's payload (spec): no
    event."""
    if contact["email_verified"]:
        return
    conn.execute("UPDATE contacts SET email_verified = 1, updated_at = ? WHERE id = ?",
                 (now_iso(), contact["id"]))
    conn.execute("UPDATE customers SET email_verified = 1, updated_at = ? WHERE id = ? AND "
                 "email_key = ?", (now_iso(), contact["customer_id"], contact["email_key"]))


def resend_verification(conn, company_id, contact_id, now_ms):
    """A new verification link for a signed-in contact whose address is not confirmed yet
    (within the hourly emails of its address); returns whether one was written."""
    company = load_company(conn, company_id)
    contact = load_contact(conn, company_id, contact_id)
    if contact["email_verified"] or not account_mail_allowed(conn, company, contact, now_ms):
        return False
    queue_account_email(conn, company, contact, "account_verify",
                        issue_account_link(conn, contact, "verify", now_ms))
    return True


def record_account_request(conn, company_id, email, now_ms):
    """A registration or reset request, written whether or not the address has an account, so
    that both answers take a commit: a stranger timing them cannot tell (what only an account
    adds, its link and email rows, costs microseconds beside the commit). Requests older than
    an hour go."""
    conn.execute("DELETE FROM account_requests WHERE created_at < ?",
                 (iso(now_ms - 3600 * 1000),))
    conn.execute("INSERT INTO account_requests (id, company_id, email_key, created_at) "
                 "VALUES (?, ?, ?, ?)", (new_id("acr"), company_id,
                                         (email or "").strip().casefold()[:MAX_EMAIL],
                                         iso(now_ms)))


def request_password_reset(conn, store_slug, email, now_ms):
    """A link to set a password, emailed to the store's contact with this email (neither it
    nor its customer blocked, and not past its hourly emails); nothing otherwise. Returns
    nothing either way, after the same commit."""
    company = company_by_slug(conn, store_slug)
    record_account_request(conn, company["id"], email, now_ms)
    contact = contact_by_email(conn, company["id"], email)
    if (contact is None or contact["status"] == "BLOCKED"
            or load_customer(conn, company["id"], contact["customer_id"])["status"] == "BLOCKED"
            or not account_mail_allowed(conn, company, contact, now_ms)):
        return
    queue_account_email(conn, company, contact, "account_reset",
                        issue_account_link(conn, contact, "reset", now_ms))


def invite_contact(conn, company_id, contact_id, now_ms, invited_by=None):
    """A set-password invitation: the reset flow's link, in an email that says who opened the
    account (the store, or invited_by, an admin contact of the business)."""
    company = load_company(conn, company_id)
    contact = load_contact(conn, company_id, contact_id)
    customer = load_customer(conn, company_id, contact["customer_id"])
    if customer["status"] == "BLOCKED":
        raise ApiError(409, CUSTOMER_BLOCKED_INVITE)
    if contact["status"] == "BLOCKED":
        raise ApiError(409, CONTACT_BLOCKED_INVITE)
    queue_account_email(conn, company, contact,
                        "account_invite" if invited_by is None else "contact_invite",
                        issue_account_link(conn, contact, "reset", now_ms),
                        business=customer["name"] or customer["email"],
                        invitedBy=invited_by and (invited_by["name"] or invited_by["email"]))
    return contact_json(contact)


def invite_customer(conn, company_id, customer_id, now_ms):
    """Staff's invitation of a customer made through the API or the dashboard: its own
    contact's."""
    customer = load_customer(conn, company_id, customer_id)
    invite_contact(conn, company_id, own_contact(conn, customer)["id"], now_ms)
    return customer_json(customer)


def reset_password(conn, store_slug, token, password, now_ms):
    """The reset link's form: the password is set, the address verified (the link reached it),
    every session of the contact ends, and an email says so."""
    company = company_by_slug(conn, store_slug)
    check_password(password)
    contact = account_link(conn, company["id"], "reset", token, now_ms, use=True)
    set_password(conn, CONTACTS, contact["id"], password)
    _mark_email_verified(conn, contact)
    clear_sign_in_failures(conn, contact["email"], f"{company['id']} ")
    queue_account_email(conn, company, contact, "password_changed", "/reset")
    return contact_json(load_contact(conn, company["id"], contact["id"]))


def change_contact_password(conn, company_id, contact_id, current, password):
    """A signed-in contact's new password: the current one first; every session ends."""
    contact = load_contact(conn, company_id, contact_id)
    check_password(password)
    if not password_matches(current or "", contact["password_hash"]):
        raise invalid("currentPassword", CURRENT_PASSWORD_WRONG)
    set_password(conn, CONTACTS, contact_id, password)
    end_account_links(conn, contact_id)
    queue_account_email(conn, load_company(conn, company_id), contact, "password_changed",
                        "/reset")
    return contact_json(contact)


def end_contact_access(conn, contact_ids):
    """Every session and emailed link of these contacts ends: they are blocked, or their
    customer is."""
    for contact_id in contact_ids:
        end_sessions(conn, CONTACTS, contact_id)
        end_account_links(conn, contact_id, ("verify", "reset"))


# Staff set a forgotten password, and an invited one their first, by the same emailed links
# (STAFF's), at /dashboard/reset. A dashboard address may have an account in several
# companies: each gets its own link, in an email that names its company.

#: The purposes of a staff account's emailed links: both set its password.
STAFF_LINKS = ("reset", "invite")


def queue_staff_email(conn, staff, kind, path):
    """An email about a staff account, with a link to path on the dashboard."""
    company = load_company(conn, staff["company_id"])
    return queue_email(conn, company["id"], kind, staff["email"], {
        "company": company["name"], "path": "/dashboard" + path})


def staff_mail_allowed(conn, staff, now_ms):
    """Whether one more email with a link may go to this staff account within the hour."""
    (sent,) = conn.execute(
        "SELECT COUNT(*) FROM emails WHERE company_id = ? AND to_address = ? AND kind IN "
        "('staff_reset', 'staff_invite') AND created_at > ?",
        (staff["company_id"], staff["email"], iso(now_ms - 3600 * 1000))).fetchone()
    return sent < ACCOUNT_MAILS_PER_HOUR


def request_staff_password_reset(conn, email, now_ms):
    """A link to set a password, emailed to each staff account with this email that may sign
    in (within its hourly emails); nothing otherwise. Returns nothing either way, after the
    same commit."""
    record_account_request(conn, None, email, now_ms)
    for staff in conn.execute("SELECT * FROM staff WHERE email_key = ? AND disabled = 0 "
                              "ORDER BY created_at, id",
                              ((email or "").strip().casefold(),)).fetchall():
        if staff_mail_allowed(conn, staff, now_ms):
            queue_staff_email(conn, staff, "staff_reset",
                              issue_account_link(conn, staff, "reset", now_ms, STAFF))


def staff_link(conn, token, now_ms, use=False):
    """(the staff account that may sign in whose password link this is, the link's purpose:
    reset or invite); with use, its every password link ends. An unknown, used or expired
    link is LINK_EXPIRED."""
    row = conn.execute(
        "SELECT t.staff_id, t.purpose, t.expires_at FROM staff_tokens t JOIN staff s ON "
        "s.id = t.staff_id WHERE t.token_hash = ? AND s.disabled = 0",
        (hash_key(token),)).fetchone()
    if row is None or row["expires_at"] <= iso(now_ms):
        raise ApiError(400, LINK_EXPIRED)
    if use:
        end_account_links(conn, row["staff_id"], STAFF_LINKS, STAFF)
    return conn.execute("SELECT * FROM staff WHERE id = ?", (row["staff_id"],)).fetchone(), \
        row["purpose"]


def reset_staff_password(conn, token, password, now_ms):
    """The link's form: the password is set, every session of the account ends and its
    failed sign-ins are forgotten; but for an invitation's first password, an email says
    so."""
    check_password(password)
    staff, purpose = staff_link(conn, token, now_ms, use=True)
    set_password(conn, STAFF, staff["id"], password)
    clear_sign_in_failures(conn, staff["email"])
    if purpose == "reset":
        queue_staff_email(conn, staff, "staff_password_changed", "/reset")
    return staff_json(staff)


def invite_staff(conn, company_id, email, role, now_ms):
    """A new staff account of this role, with a password nobody knows until the invited
    person sets one through the emailed link (the reset's)."""
    created = create_staff(conn, company_id, email, secrets.token_urlsafe(32), role)
    staff = load_staff(conn, company_id, created["id"])
    queue_staff_email(conn, staff, "staff_invite",
                      issue_account_link(conn, staff, "invite", now_ms, STAFF))
    return created


# A customer's changes end here, after the accounts: blocking one ends its sessions and
# emailed links, and approving one emails it.

def update_customer(conn, company_id, customer_id, body, every=False):
    """every: gather every field's refusal (see Refusals) for a form; the API's answer is
    the first."""
    require_object(body)
    if "email" in body:
        raise invalid("email", "cannot be changed")
    refusals = Refusals(first=not every)
    changes = _customer_changes(body, refusals)
    refusals.raise_any()
    before = load_customer(conn, company_id, customer_id)
    changed = update_changed(conn, "customers", before, changes)
    if not changed:
        return customer_json(before)
    after = load_customer(conn, company_id, customer_id)
    payload = {"id": after["id"], "email": after["email"], "name": after["name"],
               "status": after["status"]}
    if "status" in changed:
        payload["previousStatus"] = before["status"]
    emit(conn, company_id, "customer.updated", payload)
    if changed.get("status") == "BLOCKED":  # a blocked customer cannot sign in (spec)
        end_contact_access(conn, [row["id"] for row in customer_contacts(conn, customer_id)])
    if before["status"] == "PENDING" and after["status"] == "ACTIVE":
        queue_account_email(conn, load_company(conn, company_id), own_contact(conn, after),
                            "account_approved")
    return customer_json(after)


def set_customer_status(conn, company_id, customer_id, status):
    """Staff's approval, block and unblock: as PATCH, except that a customer awaiting approval
    is approved only once its address is confirmed (the API keeps the spec's rule)."""
    customer = load_customer(conn, company_id, customer_id)
    if customer["status"] == "PENDING" and status == "ACTIVE" and not customer["email_verified"]:
        raise ApiError(409, APPROVE_UNVERIFIED)
    return update_customer(conn, company_id, customer_id, {"status": status})


# 10.6 Contacts -------------------------------------------------------------------------------
# The people of a customer (docs/contacts.md). Staff (the dashboard, contact-add) and the
# customer's admins (its store's Contacts page) add them; each is invited at once with the
# reset flow's link, which verifies the address. No change leaves a business without an active
# admin.

def _contact_changes(body, refusals):
    """The validated fields of a contact's body that it sends, each field's refusal kept in
    refusals (see Refusals)."""
    changes = {}
    for field, column, read in (
            ("name", "name", lambda: optional_text(body, "name", MAX_CUSTOMER_NAME,
                                                   min_length=1, strip=True)),
            ("role", "role", lambda: chosen_from(body["role"], CONTACT_ROLES,
                                                 CONTACT_ROLE_MESSAGE)),
            ("approvalLimit", "approval_limit_cents", lambda: optional_money(
                body, "approvalLimit", 0, MAX_CREDIT_LIMIT, APPROVAL_LIMIT_MESSAGE)),
            ("status", "status", lambda: chosen_from(
                body["status"], SETTABLE_CUSTOMER_STATUSES, CONTACT_STATUS_MESSAGE))):
        if field in body:
            with refusals.check():
                changes[column] = read()
    return changes


def _check_limit(role, limit_cents):
    if limit_cents is not None and role != "buyer":
        raise invalid("approvalLimit", APPROVAL_LIMIT_ROLE)


def add_contact(conn, company_id, customer_id, body, now_ms, invited_by=None):
    """A new contact of the customer (email, name, role: buyer unless given, approvalLimit),
    invited at once. invited_by: the admin contact adding it at the store, who is told nothing
    of an address that has an account there already (nothing is added; returns None)."""
    require_object(body)
    customer = load_customer(conn, company_id, customer_id)
    email, refusals = body.get("email"), Refusals()  # the form's every refusal at once
    email = email.strip() if isinstance(email, str) else ""
    with refusals.check():
        if not email:
            raise ApiError(400, EMAIL_REQUIRED)
        if not valid_email(email):
            raise ApiError(400, INVALID_EMAIL)
    changes = _contact_changes({name: body[name] for name in ("name", "role", "approvalLimit")
                                if name in body}, refusals)
    role = changes.get("role", "buyer")
    with refusals.check():
        _check_limit(role, changes.get("approval_limit_cents"))
    refusals.raise_any()
    if invited_by is not None:
        (recent,) = conn.execute(
            "SELECT COUNT(*) FROM contacts WHERE customer_id = ? AND created_at > ?",
            (customer_id, iso(now_ms - 3600 * 1000))).fetchone()
        if recent >= INVITES_PER_HOUR:
            raise ApiError(429, TOO_MANY_INVITES)
        if contact_by_email(conn, company_id, email) is not None:
            return None
    contact = insert_contact(conn, customer, email, role, changes.get("name"),
                             approval_limit_cents=changes.get("approval_limit_cents"))
    invite_contact(conn, company_id, contact["id"], now_ms, invited_by)
    return contact_json(contact)


def customer_contact(conn, company_id, customer_id, contact_id):
    """A contact of this customer; another customer's is not found, as another company's is."""
    contact = load_contact(conn, company_id, contact_id)
    if contact["customer_id"] != customer_id:
        raise not_found("Contact")
    return contact


def update_contact(conn, company_id, contact_id, body, customer_id=None):
    """A contact's name, role, approval limit and status (a block ends its sessions and links
    at once). customer_id: the business whose admin asks, whose contacts alone it may change."""
    require_object(body)
    before = load_contact(conn, company_id, contact_id)
    if customer_id is not None:
        before = customer_contact(conn, company_id, customer_id, contact_id)
    refusals = Refusals()  # the form's every refusal at once
    changes = _contact_changes(body, refusals)
    after = dict(before) | changes
    with refusals.check():
        _check_limit(after["role"], after["approval_limit_cents"])
    refusals.raise_any()
    if before["role"] == "admin" and before["status"] == "ACTIVE" and (
            after["role"] != "admin" or after["status"] != "ACTIVE"):
        (admins,) = conn.execute(
            "SELECT COUNT(*) FROM contacts WHERE customer_id = ? AND role = 'admin' AND "
            "status = 'ACTIVE'", (before["customer_id"],)).fetchone()
        if admins <= 1:
            raise ApiError(409, LAST_ADMIN)
    if update_changed(conn, "contacts", before, changes).get("status") == "BLOCKED":
        end_contact_access(conn, [contact_id])
    return contact_json(load_contact(conn, company_id, contact_id))


# ---------------------------------------------------------------------------------------------
# 11. Queries and storefront ordering
# ---------------------------------------------------------------------------------------------

# 11.1 Queries --------------------------------------------------------------------------------
# What lists and pages read: one paginator, the lists' filters, the dashboard's lookups.

def page_limit(text):
    """limit as the spec reads it: parseInt, default 50 when not a number, clamped to 1..100."""
    number = js_parse_int(text)
    return DEFAULT_PAGE_SIZE if number is None else min(MAX_PAGE_SIZE, max(1, number))


def paginate(conn, table, company_id, query, filters=(), params=(), columns="*",
             order=("created_at", True), before=None, back=False):
    """One page of rows of a list, in order ((column, descending): newest first unless told),
    by (column, id) so that equal values never skip or repeat a record. The cursor is the last
    ID of the previous page; before, the first ID of the next page (a page back). An anchor
    that is not the company's gives an empty last page. columns: what to read of each row
    (its id among them). With back (never the API's, whose answer is the spec's), also
    "previous": the ID that before takes for the page before this one, or None at the first
    page."""
    column, descending = order
    backward = before is not None
    limit = page_limit(query.get("limit"))
    where, args = ["company_id = ?", *filters], [company_id, *params]
    anchor_id = before or query.get("cursor")
    if anchor_id:
        anchor = conn.execute(f"SELECT {column}, id FROM {table} WHERE id = ? AND company_id = ?",
                              (anchor_id, company_id)).fetchone()
        if anchor is None:
            return {"data": [], "pagination": {"hasMore": False, "nextCursor": None},
                    **({"previous": None} if back else {})}
        where.append(f"({column}, id) {'<' if descending != backward else '>'} (?, ?)")
        args += [anchor[column], anchor["id"]]
    way = "DESC" if descending != backward else "ASC"
    rows = conn.execute(
        f"SELECT {columns} FROM {table} WHERE {' AND '.join(where)} "
        f"ORDER BY {column} {way}, id {way} LIMIT ?", [*args, limit + 1]).fetchall()
    more = len(rows) > limit
    rows = rows[:limit][::-1] if backward else rows[:limit]
    has_more = backward or more
    earlier = more if backward else bool(anchor_id)
    page = {"data": rows,
            "pagination": {"hasMore": has_more, "nextCursor": rows[-1]["id"] if has_more and rows
                           else None}}
    if back:
        page["previous"] = rows[0]["id"] if earlier and rows else None
    return page


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


def find_products(conn, company_id, query, columns="*", order=("created_at", True),
                  before=None, back=False):
    """A page of the company's products: category, search (name, SKU, category) and active;
    in order, and before, as paginate takes them."""
    filters, params = [], []
    if query.get("category"):
        filters.append("category = ?")
        params.append(query["category"])
    if query.get("search"):
        clause, values = search_filter(("name", "sku", "category"), query["search"])
        filters.append(clause)
        params += values
    active = query.get("active")
    if active in ("true", "false"):
        filters.append("is_active = ?")
        params.append(int(active == "true"))
    return paginate(conn, "products", company_id, query, filters, params, columns, order,
                    before, back)


def find_customers(conn, company_id, query):
    """A page of the company's customers: status and search (email, name)."""
    filters, params = [], []
    status = query.get("status")
    if status:
        if status not in CUSTOMER_STATUSES:
            raise ApiError(400, INVALID_STATUS)
        filters.append("status = ?")
        params.append(status)
    if query.get("search"):
        clause, values = search_filter(("email_key", "name"), query["search"])
        filters.append(clause)
        params += values
    return paginate(conn, "customers", company_id, query, filters, params)


def find_orders(conn, company_id, query, search=None, columns="*"):
    """A page of the company's orders (rows): status, customerId, since and until, and the
    dashboard's search."""
    filters, params = order_filters(query)
    if search:
        clause, values = order_search(conn, company_id, search)
        filters.append(clause)
        params += values
    return paginate(conn, "orders", company_id, query, filters, params, columns)


def find_emails(conn, company_id, query):
    """A page of the emails written for the company (rows), newest first."""
    return paginate(conn, "emails", company_id, query)


def find_invoices(conn, company_id, query):
    """A page of the company's paid invoices (rows)."""
    return paginate(conn, "invoices", company_id, query)


def find_customer_invoices_page(conn, company_id, query):
    """A page of the company's invoices to its customers, newest first: of a status, of a
    customer (query's status, customerId)."""
    filters, params = equal_filters(query, (
        ("status", "status", INVOICE_STATUSES, INVOICE_STATUS_FILTER),
        ("customerId", "customer_id", None, None)))
    return paginate(conn, "customer_invoices", company_id, query, filters, params)


def find_returns(conn, company_id, query):
    """A page of the company's returns (rows): status, orderId and customerId."""
    filters, params = equal_filters(query, (("status", "status", RETURN_STATUSES,
                                                INVALID_RETURN_STATUS),
                                               ("orderId", "order_id", None, None),
                                               ("customerId", "customer_id", None, None)))
    return paginate(conn, "returns", company_id, query, filters, params)


def find_movements(conn, company_id, query):
    """A page of the company's stock movements (rows): productId, reason, since and until."""
    filters, params = equal_filters(query, (("productId", "product_id", None, None),
                                               ("reason", "reason", MOVEMENT_REASONS,
                                                INVALID_MOVEMENT_REASON)))
    filters += date_filters(query, params)
    return paginate(conn, "stock_movements", company_id, query, filters, params)


def equal_filters(query, known):
    """Filters of exact matches: known, (parameter, column, the values it may take or None,
    the 400 message of another), each a filter when given a value."""
    filters, params = [], []
    for name, column, values, refusal in known:
        value = query.get(name)
        if value:
            if values is not None and value not in values:
                raise ApiError(400, refusal)
            filters.append(f"{column} = ?")
            params.append(value)
    return filters, params


def date_filters(query, params):
    """since (createdAt >= since) and until (createdAt <= until) as filters; their values are
    added to params."""
    filters = []
    for name, operator in (("since", ">="), ("until", "<=")):
        bound = date_filter(query, name)
        if bound is not None:
            filters.append(f"created_at {operator} ?")
            params.append(bound)
    return filters


def order_filters(query):
    """The order list's filters (status, customerId, since, until) as SQL and parameters."""
    filters, params = equal_filters(query, (("status", "status", ORDER_STATUSES,
                                                INVALID_ORDER_STATUS),
                                               ("customerId", "customer_id", None, None)))
    return filters + date_filters(query, params), params


#: Records a form's select offers at most, newest first.
CHOICES_SHOWN = 500


def customer_choices(conn, company_id):
    """(id, email) of the company's customers, for a form's select."""
    return [tuple(row) for row in conn.execute(
        "SELECT id, email FROM customers WHERE company_id = ? ORDER BY created_at DESC, id DESC "
        "LIMIT ?", (company_id, CHOICES_SHOWN))]


def product_choices(conn, company_id):
    """(id, name, sku, stock) of the company's active products, for a form's select."""
    return conn.execute(
        "SELECT id, name, sku, stock FROM products WHERE company_id = ? AND is_active = 1 "
        "ORDER BY created_at DESC, id DESC LIMIT ?", (company_id, CHOICES_SHOWN)).fetchall()


def product_in_stock(conn, company_id, more_than):
    """The company's first active product (by ID: the oldest) with more than more_than units
    in stock, or None."""
    return conn.execute("SELECT * FROM products WHERE company_id = ? AND is_active = 1 "
                        "AND stock > ? ORDER BY id LIMIT 1", (company_id, more_than)).fetchone()


def pending_customers(conn, company_id):
    """The company's customers awaiting approval, oldest first."""
    return conn.execute("SELECT * FROM customers WHERE company_id = ? AND status = 'PENDING' "
                        "ORDER BY created_at, id LIMIT ?", (company_id, CHOICES_SHOWN)).fetchall()


def customer_emails(conn, company_id, ids):
    """{customer ID: email} for these IDs of the company's customers."""
    ids = list(set(filter(None, ids)))
    if not ids:  # PostgreSQL has no empty IN ()
        return {}
    # By primary key, the company checked here: given company_id too, SQLite walks the
    # company's index, every customer of it, to find a page's few.
    return {row["id"]: row["email"] for row in conn.execute(
        f"SELECT id, email, company_id FROM customers WHERE id IN ({','.join('?' * len(ids))})",
        ids) if row["company_id"] == company_id}


def order_numbers(conn, company_id, ids):
    """{order ID: number} for these IDs of the company's orders (by primary key, the company
    checked here, as customer_emails)."""
    ids = list(set(ids))
    if not ids:  # PostgreSQL has no empty IN ()
        return {}
    return {row["id"]: row["number"] for row in conn.execute(
        f"SELECT id, number, company_id FROM orders WHERE id IN ({','.join('?' * len(ids))})",
        ids) if row["company_id"] == company_id}


def order_search(conn, company_id, text):
    """The orders list's search as a filter and its parameters: the order of that number
    (1042 or #1042), else the order with that ID, else the orders whose PO number begins with
    the text, ignoring ASCII case (each served by an index, so a search costs the same at any
    number of orders)."""
    text = text.strip()
    if re.fullmatch(r"#?[0-9]{1,9}", text) and conn.execute(
            "SELECT 1 FROM orders WHERE company_id = ? AND number = ?",
            (company_id, int(text.lstrip("#")))).fetchone():
        return "number = ?", [int(text.lstrip("#"))]
    if conn.execute("SELECT 1 FROM orders WHERE id = ? AND company_id = ?",
                    (text, company_id)).fetchone():
        return "id = ?", [text]
    return (conn.engine.prefix_ignoring_ascii_case("po_number"),
            [text, text + chr(0x10FFFF)])


# 11.2 Storefront ordering --------------------------------------------------------------------
# What a signed-in buyer does at the store (see Web pages, Storefront): the catalog at their
# own prices, a cart kept on the server, quick order by SKU, reorder, saved addresses, checkout
# (one order per checkout form, however often it is sent), their orders and returns. Only an
# ACTIVE customer orders; a buyer's order of another customer is "not found", as another
# company's is.

#: How a buyer sees stock: never the count, which is the company's business.
STOCK_LEVELS = ("In stock", "Low stock", "Out of stock")


def stock_level(product):
    """Low at or below the product's low-stock threshold (never, without one)."""
    if product["stock"] <= 0:
        return STOCK_LEVELS[2]
    threshold = product["low_stock_threshold"]
    return STOCK_LEVELS[1] if threshold is not None and product["stock"] <= threshold \
        else STOCK_LEVELS[0]


#: What the catalog's rows show of a product and price it by (the rest, a description say, is
#: the product page's).
CATALOG_COLUMNS = ("id, name, sku, unit, image_url, price_cents, price_breaks, min_quantity, "
                   "order_multiple, stock, low_stock_threshold")


def catalog(conn, company_id, customer_id, query):
    """A page of the store's active products (search, category, sort: one of CATALOG_SORTS,
    cursor or before, limit) and {product ID: the customer's price in cents for the fewest
    units it may order}."""
    sort = query.get("sort") or CATALOG_SORTS[0]
    if sort not in CATALOG_SORTS:
        raise ApiError(400, CATALOG_SORT_MESSAGE)
    result = find_products(conn, company_id, {
        name: query.get(name) for name in ("search", "category", "cursor", "limit")} | {
        "active": "true"}, CATALOG_COLUMNS, CATALOG_ORDERS[sort],
        before=query.get("before") or None, back=True)
    special = special_prices(conn, customer_id, result["data"])
    return result, {row["id"]: unit_price(row, special.get(row["id"]), row["min_quantity"])[0]
                    for row in result["data"]}


def store_categories(conn, company_id):
    """The categories of the store's active products, in order: one index seek a category
    (each the least greater than the last), whatever the number of products."""
    return [row[0] for row in conn.execute(
        "WITH RECURSIVE c(category) AS (SELECT MIN(category) FROM products WHERE company_id = ? "
        "AND is_active = 1 UNION ALL SELECT (SELECT MIN(category) FROM products WHERE "
        "company_id = ? AND is_active = 1 AND category > c.category) FROM c WHERE c.category "
        "IS NOT NULL) SELECT category FROM c WHERE category IS NOT NULL LIMIT ?",
        (company_id, company_id, CHOICES_SHOWN))]


def store_product(conn, company_id, customer_id, product_id):
    """(product, the customer's price in cents for the fewest units it may order) of an active
    product; an inactive one is not found, as at the API's order placement."""
    product = load_product(conn, company_id, product_id)
    if not product["is_active"]:
        raise not_found("Product")
    special = special_prices(conn, customer_id, [product]).get(product_id)
    return product, unit_price(product, special, product["min_quantity"])[0]


def cart_of(conn, company_id, contact_id):
    """The contact's cart at its customer's prices today: {"lines": [{product, quantity,
    unitPrice, lineTotal (cents), why (the price's reason: see unit_price), next (see
    next_break), sold (false once the product is inactive)}], "total" (cents, of the lines
    still sold), "taxRate" (the customer's today) and "tax" (cents, on the total)}."""
    customer = load_customer(conn, company_id,
                             load_contact(conn, company_id, contact_id)["customer_id"])
    rows = conn.execute(
        "SELECT p.*, c.quantity AS cart_quantity FROM cart_lines c JOIN products p ON p.id = "
        "c.product_id WHERE c.contact_id = ? AND p.company_id = ? ORDER BY c.added_at, p.id",
        (contact_id, company_id)).fetchall()
    special = special_prices(conn, customer["id"], rows)
    lines = []
    for row in rows:
        cents, why = unit_price(row, special.get(row["id"]), row["cart_quantity"])
        lines.append({"product": row, "quantity": row["cart_quantity"], "unitPrice": cents,
                      "lineTotal": cents * row["cart_quantity"], "why": why,
                      "next": next_break(row, row["cart_quantity"], cents),
                      "sold": bool(row["is_active"])})
    total = sum(line["lineTotal"] for line in lines if line["sold"])
    rate = tax_rate_of(conn, company_id, customer)
    return {"lines": lines, "total": total, "taxRate": rate, "tax": tax_cents(total, rate)}


def cart_size(conn, contact_id):
    """How many lines the contact's cart holds (the storefront's navigation shows it)."""
    return conn.execute("SELECT COUNT(*) FROM cart_lines WHERE contact_id = ?",
                        (contact_id,)).fetchone()[0]


def add_to_cart(conn, company_id, contact_id, product_id, quantity):
    """Put quantity more of an active product in the contact's cart, raised to the least its
    rules allow. Returns (the product, the quantity the cart holds now, the note that says
    the cart holds other than was asked, or None)."""
    require_contact(conn, company_id, contact_id, "order", verified=False)
    quantity = order_quantity(quantity)
    product = conn.execute("SELECT * FROM products WHERE id = ? AND company_id = ? AND "
                           "is_active = 1", (product_id, company_id)).fetchone()
    if product is None:
        raise ApiError(400, PRODUCT_UNAVAILABLE.format(id=product_id))
    line = conn.execute("SELECT quantity FROM cart_lines WHERE contact_id = ? AND "
                        "product_id = ?", (contact_id, product_id)).fetchone()
    if line is None:
        if cart_size(conn, contact_id) >= MAX_ORDER_LINES:
            raise invalid("cart", CART_FULL)
        held = fitted_quantity(product, quantity)
        conn.execute("INSERT INTO cart_lines (contact_id, product_id, quantity, added_at) "
                     "VALUES (?, ?, ?, ?)", (contact_id, product_id, held, now_iso()))
        return product_json(product), held, _fitted_note(product, quantity, held)
    held, note = set_cart_quantity(conn, company_id, contact_id, product_id, line[0] + quantity)
    return product_json(product), held, note


def _fitted_note(product, asked, held):
    if asked == held:
        return None
    return QUANTITY_FITTED.format(name=product["name"], rule=quantity_rule_text(product),
                                  quantity=held)


def set_cart_quantity(conn, company_id, contact_id, product_id, quantity):
    """A cart line's new quantity, raised to the least the product's rules allow; 0 removes
    the line (as does removing it). Returns (the quantity held, the note that says it is
    other than asked, or None)."""
    load_contact(conn, company_id, contact_id)
    if quantity == 0:
        conn.execute("DELETE FROM cart_lines WHERE contact_id = ? AND product_id = ?",
                     (contact_id, product_id))
        return 0, None
    quantity = order_quantity(quantity)
    product = conn.execute("SELECT * FROM products WHERE id = ? AND company_id = ?",
                           (product_id, company_id)).fetchone()
    held = quantity if product is None else fitted_quantity(product, quantity)
    if not conn.execute("UPDATE cart_lines SET quantity = ? WHERE contact_id = ? AND "
                        "product_id = ?", (held, contact_id, product_id)).rowcount:
        raise not_found("Cart line")
    return held, _fitted_note(product, quantity, held)


def parse_quick_order(text):
    """[(SKU, quantity)] from lines of "SKU quantity" (or "SKU,quantity", as a spreadsheet
    saves them as CSV); blank lines and a first line "sku,quantity" are skipped."""
    if len(text) > MAX_QUICK_ORDER:
        raise invalid("lines", QUICK_ORDER_TOO_LONG)
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = [field.strip().strip('"') for field in re.split(r"[,;\t ]+", line.strip())]
        fields = [field for field in fields if field]
        if not fields or (number == 1 and [f.casefold() for f in fields] == ["sku", "quantity"]):
            continue
        if len(fields) != 2 or not re.fullmatch(r"\d{1,10}", fields[1]):
            raise invalid("lines", QUICK_ORDER_FORMAT.format(n=number))
        entries.append((fields[0], int(fields[1])))
    if not entries:
        raise invalid("lines", QUICK_ORDER_FORMAT.format(n=1))
    return entries


def quick_order(conn, company_id, contact_id, text):
    """Lines of SKUs and quantities into the contact's cart. Returns {"added": [(product,
    quantity)], "unknown": [each SKU that names no active product of the store, once],
    "fitted": [the note of each product whose rules made the cart hold other than asked]}."""
    require_contact(conn, company_id, contact_id, "order", verified=False)
    entries = parse_quick_order(text)
    skus = list(dict.fromkeys(sku for sku, _ in entries))
    found = {}
    # By company and SKU alone (products_by_company_sku), activity and order in Python: with
    # either in the SQL, SQLite (without table statistics) would scan the company's products.
    rows = conn.execute(f"SELECT * FROM products WHERE company_id = ? AND sku IN "
                        f"({','.join('?' * len(skus))})", [company_id, *skus]).fetchall()
    for row in sorted(rows, key=lambda row: (row["created_at"], row["id"])):
        if row["is_active"]:
            found.setdefault(row["sku"], row)  # a SKU two products share: the older one
    added = [(product_json(found[sku]), quantity) for sku, quantity in entries if sku in found]
    wanted = collections.Counter()
    for product, quantity in added:  # a product once however many lines name it
        wanted[product["id"]] += quantity
    fitted = [add_to_cart(conn, company_id, contact_id, product_id, quantity)[2]
              for product_id, quantity in wanted.items()]
    return {"added": added, "unknown": [sku for sku in skus if sku not in found],
            "fitted": [note for note in fitted if note]}


def buyer_orders(conn, company_id, customer_id, query):
    """A page of the customer's orders, newest first (status, cursor, limit). A cursor that
    is not one of the customer's orders gives the empty last page, as an unknown one does: the
    pages tell no one whether another customer's order exists, nor when it was placed."""
    cursor = query.get("cursor")
    if cursor and not conn.execute("SELECT 1 FROM orders WHERE id = ? AND customer_id = ?",
                                   (cursor, customer_id)).fetchone():
        cursor = "-"  # no order's ID
    return find_orders(conn, company_id, {"status": query.get("status"), "cursor": cursor,
                                          "limit": query.get("limit"),
                                          "customerId": customer_id})


def reorder(conn, company_id, contact_id, order_id):
    """A past order of the contact's customer, its lines into the contact's cart. Returns
    {"added": [(product, quantity)], "skipped": [names of the products no longer sold],
    "fitted": [notes, as quick_order's]}."""
    buyer_order(conn, company_id, load_contact(conn, company_id, contact_id)["customer_id"],
                order_id)
    added, skipped, fitted = [], [], []
    for row in conn.execute(
            "SELECT p.*, i.quantity AS ordered FROM order_items i JOIN products p ON p.id = "
            "i.product_id WHERE i.order_id = ? ORDER BY i.position", (order_id,)).fetchall():
        if row["is_active"]:
            product, _, note = add_to_cart(conn, company_id, contact_id, row["id"],
                                           row["ordered"])
            added.append((product, row["ordered"]))
            fitted += [note] if note else []
        elif row["name"] not in skipped:
            skipped.append(row["name"])
    return {"added": added, "skipped": skipped, "fitted": fitted}


def parse_address(form):
    """A shipping address from a form or a body: {field: text}, each field of ADDRESS_FIELDS
    trimmed, on one line, within its length; every refusal at once."""
    address, details = {}, []
    for name, _, longest, required in ADDRESS_FIELDS:
        value = form.get(name)
        value = value.strip() if isinstance(value, str) else ""
        if required and not value:
            details.append({"field": name, "rule": "is required"})
        elif len(value) > longest or any(unicodedata.category(c)[0] == "C" for c in value):
            details.append({"field": name, "rule": f"must be at most {longest} characters "
                                                   "on one line"})
        elif name == "country" and value.upper() not in COUNTRIES:
            details.append({"field": name, "rule": COUNTRY_RULE})
        address[name] = (value.upper() if name == "country" else value) or None
    if details:
        raise ApiError(400, VALIDATION_FAILED, details)
    return address


def customer_addresses(conn, customer_id):
    """The customer's saved addresses, newest first, as rows."""
    return conn.execute("SELECT * FROM addresses WHERE customer_id = ? ORDER BY created_at DESC, "
                        "id DESC", (customer_id,)).fetchall()


def address_of(row):
    """A saved address row as {field: text}, the shape an order keeps."""
    return {"name": row["name"], "line1": row["line1"], "line2": row["line2"],
            "city": row["city"], "region": row["region"], "postalCode": row["postal_code"],
            "country": row["country"]}


def save_address(conn, customer_id, address):
    """Save a new address (one already saved, field for field, is not saved twice)."""
    rows = customer_addresses(conn, customer_id)
    if any(address_of(row) == address for row in rows):
        return
    if len(rows) >= MAX_ADDRESSES:
        raise invalid("address", ADDRESSES_FULL)
    conn.execute(
        "INSERT INTO addresses (id, customer_id, name, line1, line2, city, region, postal_code, "
        "country, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (new_id("addr"), customer_id, address["name"], address["line1"], address["line2"],
         address["city"], address["region"], address["postalCode"], address["country"],
         now_iso()))


def delete_address(conn, customer_id, address_id):
    if not conn.execute("DELETE FROM addresses WHERE id = ? AND customer_id = ?",
                        (address_id, customer_id)).rowcount:
        raise not_found("Address")


def checkout_result(conn, contact, token):
    """Where the contact's checkout form led, if it was sent already: ("orders", the order's
    ID) or ("requests", the order request's ID); None."""
    placed = conn.execute("SELECT id FROM orders WHERE customer_id = ? AND checkout_token = ?",
                          (contact["customer_id"], token)).fetchone()
    if placed is not None:
        return "orders", placed["id"]
    asked = conn.execute("SELECT id FROM order_requests WHERE contact_id = ? AND "
                         "checkout_token = ?", (contact["id"], token)).fetchone()
    return asked and ("requests", asked["id"])


def checkout(conn, store_slug, contact_id, token, address_id=None, address=None,
             po_number=None, notes=None):
    """The contact's cart becomes an order (storefront_place_order: stock, events and emails
    as for any storefront order) shipped to a saved address of its customer (address_id) or a
    new one (address, then saved), and the cart is emptied, in the caller's transaction;
    above the contact's approval limit (tax included), an order request instead (see
    request_approval). token is the checkout form's: sent again, it finds what it made
    instead of making another. Returns ("orders" or "requests", the ID)."""
    company = company_by_slug(conn, store_slug)
    if not isinstance(token, str) or not re.fullmatch(r"[A-Za-z0-9_-]{16,64}", token):
        raise invalid("form", "is not a checkout form")
    done = checkout_result(conn, load_contact(conn, company["id"], contact_id), token)
    if done is not None:
        return done
    contact = require_contact(conn, company["id"], contact_id, "order")
    customer_id, cart = contact["customer_id"], cart_of(conn, company["id"], contact_id)
    if not cart["lines"]:
        raise ApiError(400, CART_EMPTY)
    if address_id:
        row = conn.execute("SELECT * FROM addresses WHERE id = ? AND customer_id = ?",
                           (address_id, customer_id)).fetchone()
        if row is None:
            raise not_found("Address")
        address = address_of(row)
    else:
        address = parse_address(address or {})
        save_address(conn, customer_id, address)
    items = [{"productId": line["product"]["id"], "quantity": line["quantity"]}
             for line in cart["lines"]]
    limit = contact["approval_limit_cents"]
    if limit is not None and cart["total"] + cart["tax"] > limit:
        done = "requests", request_approval(conn, company, contact, cart, items, address,
                                            po_number, notes, token)
    else:
        order = storefront_place_order(conn, store_slug, customer_id, items, po_number, notes,
                                       shipping_address=address, checkout_token=token,
                                       contact=contact)
        require_credit(conn, company["id"], customer_id, order["id"])
        done = "orders", order["id"]
    conn.execute("DELETE FROM cart_lines WHERE contact_id = ?", (contact_id,))
    return done


# Order requests: a checkout above its buyer's approval limit waits, with no order, no stock
# taken and no event, for one of the customer's admins, who are emailed. Approved, it is placed
# as any storefront order at that moment (prices, stock, credit limit, order.created); declined,
# its buyer is emailed the admin's reason.

def request_approval(conn, company, contact, cart, items, address, po_number, notes, token):
    """A new order request of the contact's cart (checked as an order would be, but for stock,
    which counts when it is approved); its customer's active admins are emailed. Returns its
    ID."""
    body = {"customerId": contact["customer_id"], "items": items, "poNumber": po_number,
            "notes": notes}
    _, _, po_number, notes = parse_order_request(body)
    for line in cart["lines"]:
        if not line["sold"]:
            raise ApiError(400, PRODUCT_UNAVAILABLE.format(id=line["product"]["id"]))
    request_id, at = new_id_at("req")
    total = cart["total"] + cart["tax"]
    insert_row(conn, "order_requests", {
        "id": request_id, "company_id": company["id"], "customer_id": contact["customer_id"],
        "contact_id": contact["id"], "status": "PENDING", "lines": json_text(items),
        "shipping_address": json_text(address), "po_number": po_number, "notes": notes,
        "total_cents": total, "checkout_token": token, "created_at": at})
    asker = f"{contact['name'] or contact['email']}"
    for admin in customer_contacts(conn, contact["customer_id"]):
        if admin["role"] == "admin" and admin["status"] == "ACTIVE":
            queue_account_email(conn, company, admin, "approval_requested",
                                f"/requests/{request_id}", buyer=asker,
                                total=amount_text(money(total)), facts=[
                                    ["Asked by", f"{asker} <{contact['email']}>"],
                                    ["Total, tax included", amount_text(money(total))],
                                    ["PO number", po_number or "none"]])
    return request_id


def load_request(conn, company_id, request_id, customer_id):
    """An order request of the customer; another's is not found, as another company's is."""
    row = load_row(conn, "order_requests", "Order request", company_id, request_id)
    if row["customer_id"] != customer_id:
        raise not_found("Order request")
    return row


def customer_requests(conn, company_id, customer_id, contact_id=None, status=None):
    """The customer's order requests, newest first (contact_id: only that contact's; status:
    only those of it), each with its asker's email and name (asker_email, asker_name)."""
    where, values = "r.company_id = ? AND r.customer_id = ?", [company_id, customer_id]
    for column, value in (("r.contact_id", contact_id), ("r.status", status)):
        if value is not None:
            where, values = f"{where} AND {column} = ?", values + [value]
    return conn.execute(
        f"SELECT r.*, c.email AS asker_email, c.name AS asker_name FROM order_requests r "
        f"JOIN contacts c ON c.id = r.contact_id WHERE {where} "
        f"ORDER BY r.created_at DESC, r.id DESC LIMIT {CHOICES_SHOWN}", values).fetchall()


def request_quote(conn, company_id, request):
    """An order request at today's prices, as its approval would place it: {"lines":
    [(product name, SKU, quantity, unit price, line total (cents))], "total" (cents),
    "taxRate", "tax" (cents)}."""
    lines = json.loads(request["lines"])
    wanted = collections.Counter()
    for line in lines:
        wanted[line["productId"]] += line["quantity"]
    products = {row["id"]: row for row in conn.execute(
        f"SELECT * FROM products WHERE id IN ({','.join('?' * len(wanted))})", list(wanted))}
    special = special_prices(conn, request["customer_id"], list(products.values()))
    quoted = []
    for line in lines:
        product = products[line["productId"]]
        cents = unit_price(product, special.get(product["id"]), wanted[product["id"]])[0]
        quoted.append((product["name"], product["sku"] or "", line["quantity"], cents,
                       cents * line["quantity"]))
    total = sum(line[4] for line in quoted)
    rate = tax_rate_of(conn, company_id, load_customer(conn, company_id, request["customer_id"]))
    return {"lines": quoted, "total": total, "taxRate": rate, "tax": tax_cents(total, rate)}


def pending_requests(conn, company_id):
    """Every order request of the company's customers that awaits an admin (staff see them),
    oldest first, with its asker's email and its customer's email and name."""
    return conn.execute(
        f"SELECT r.*, c.email AS asker_email, u.email AS customer_email, "
        f"u.name AS customer_name FROM order_requests r JOIN contacts c ON c.id = r.contact_id "
        f"JOIN customers u ON u.id = r.customer_id WHERE r.company_id = ? AND "
        f"r.status = 'PENDING' ORDER BY r.created_at, r.id LIMIT {CHOICES_SHOWN}",
        (company_id,)).fetchall()


def _decide(conn, company_id, request_id, admin_id):
    """(the admin, the request) of a decision: the admin's right to make it, the request its
    customer's and still pending."""
    admin = require_contact(conn, company_id, admin_id, "manage")
    request = load_request(conn, company_id, request_id, admin["customer_id"])
    if request["status"] != "PENDING":
        raise ApiError(409, REQUEST_DECIDED)
    return admin, request


def approve_request(conn, company_id, request_id, admin_id, seen_total_cents=None):
    """An admin approves: the order is placed now, as by its buyer, approved by the admin,
    unless its buyer is blocked since, or it would total other than seen_total_cents (tax
    included: what the admin's page showed). Returns the order's ID."""
    admin, request = _decide(conn, company_id, request_id, admin_id)
    if load_contact(conn, company_id, request["contact_id"])["status"] == "BLOCKED":
        raise ApiError(409, REQUEST_ASKER_BLOCKED)
    company = load_company(conn, company_id)
    order = storefront_place_order(
        conn, company["slug"], request["customer_id"], json.loads(request["lines"]),
        request["po_number"], request["notes"],
        shipping_address=json.loads(request["shipping_address"]),
        checkout_token=request["checkout_token"],
        contact=load_contact(conn, company_id, request["contact_id"]), approved_by=admin["id"])
    require_credit(conn, company_id, request["customer_id"], order["id"])
    placed = load_order(conn, company_id, order["id"])
    if seen_total_cents is not None and \
            placed["total_cents"] + placed["tax_cents"] != seen_total_cents:
        raise ApiError(409, REQUEST_TOTAL_CHANGED.format(
            total=amount_text(money(placed["total_cents"] + placed["tax_cents"]))))
    conn.execute("UPDATE order_requests SET status = 'APPROVED', decided_by = ?, decided_at = ?, "
                 "order_id = ? WHERE id = ?", (admin["id"], now_iso(), order["id"], request_id))
    return order["id"]


def decline_request(conn, company_id, request_id, admin_id, reason):
    """An admin declines, saying why: nothing is placed, and the buyer is emailed the reason."""
    admin, request = _decide(conn, company_id, request_id, admin_id)
    reason = reason.strip() if isinstance(reason, str) else ""
    if not reason:
        raise invalid("reason", "is required")
    if len(reason) > MAX_DECLINE_REASON:
        raise invalid("reason", f"must be at most {MAX_DECLINE_REASON} characters")
    conn.execute("UPDATE order_requests SET status = 'DECLINED', decided_by = ?, decided_at = ?, "
                 "reason = ? WHERE id = ?", (admin["id"], now_iso(), reason, request_id))
    queue_account_email(conn, load_company(conn, company_id),
                        load_contact(conn, company_id, request["contact_id"]),
                        "request_declined", f"/requests/{request_id}",
                        admin=admin["name"] or admin["email"], reason=reason,
                        total=amount_text(money(request["total_cents"])))


def staff_order(conn, company_id, customer_id, items, address, po_number=None, notes=None,
                actor=None, placed_by=None):
    """The dashboard's new order: for a customer staff chose, of items (the API's), shipped to
    address (ADDRESS_FIELDS'), every refusal of the three at once, each at its field; placed as
    place_order places it (no order.created)."""
    details = [] if customer_id else [{"field": "customerId", "rule": "choose a customer"}]
    if not items:
        details.append({"field": "items", "rule": "choose at least one product"})
    try:
        address = parse_address(address)
    except ApiError as error:
        details += error.details
    if details:
        raise ApiError(400, VALIDATION_FAILED, details)
    return place_order(conn, company_id, {"customerId": customer_id, "items": items,
                                          "poNumber": po_number, "notes": notes},
                       source="dashboard", shipping_address=address, actor=actor,
                       placed_by=placed_by)


# 11.3 Records as the database writes them ----------------------------------------------------
# The API's reads of products and orders have the database write each record's JSON text (in
# C, on either engine: see the engines' json_object), rather than reading every column into
# Python, building dicts and encoding them: the same bytes as the Records section's
# product_json and order_json, which everything else uses (a test compares the two for every
# read). Product names and SKUs of an order's items are read with the order, as there.

#: Money of this many cents or more, unless whole, is written by the Records' functions:
#: Python writes it as the nearest double (1.000000999999e+16), which neither engine's SQL
#: writes alike; below it that text is the exact decimal. Only an order's total gets there:
#: prices, and so unit prices, stop at MAX_AMOUNT_CENTS.
EXACT_MONEY_CENTS = 10 ** 15

_ITEM_ROWS_OF_ORDER = (
    "SELECT i.id, i.quantity, i.unit_price_cents, i.product_id, p.name AS product_name, "
    "p.sku AS product_sku, i.position FROM order_items i JOIN products p ON p.id = i.product_id "
    "WHERE i.order_id = orders.id")


@functools.lru_cache(maxsize=None)
def record_json_sql(engine, table):
    """SQL for the JSON text of a row of products or orders as the API shows it; NULL where
    its money is not the database's to write (see EXACT_MONEY_CENTS)."""
    if table == "products":
        fields = PRODUCT_FIELDS
    else:
        tracking = engine.json_object(TRACKING_FIELDS)
        items = engine.json_array(engine.json_object(ORDER_ITEM_FIELDS),
                                  _ITEM_ROWS_OF_ORDER, "position")
        fields = ORDER_FIELDS + (
            ("tracking", f"CASE WHEN tracking_carrier IS NULL THEN NULL ELSE {tracking} END",
             "json"),
            ("items", items, "json"))
    exact = " AND ".join(f"({column} % 100 = 0 OR {column} < {EXACT_MONEY_CENTS})"
                         for _, column, kind in fields if kind == "money")
    return f"CASE WHEN {exact} THEN {engine.json_object(fields)} END"


def record_columns(conn, table):
    """The columns to read rows of products or orders with for records_json: id, JSON text."""
    return f"id, {record_json_sql(conn.engine, table)}"


def records_json(conn, company_id, table, rows):
    """The JSON texts of rows read with record_columns; where the database wrote none, the
    Records' function writes it."""
    if table == "products":
        def written(row_id):
            return product_json(load_product(conn, company_id, row_id))
    else:
        def written(row_id):
            return order_with_items(conn, company_id, row_id)
    return [row[1] if row[1] is not None else json_text(written(row[0])) for row in rows]


def api_record(conn, company_id, table, resource, record_id):
    """One record of products or orders as the JSON text the API shows, or its 404."""
    row = conn.execute(f"SELECT {record_columns(conn, table)} FROM {table} "
                       "WHERE id = ? AND company_id = ?", (record_id, company_id)).fetchone()
    if row is None:
        raise not_found(resource)
    return records_json(conn, company_id, table, [row])[0]


def api_product(conn, company_id, product_id):
    return api_record(conn, company_id, "products", "Product", product_id)


def api_order(conn, company_id, order_id):
    return api_record(conn, company_id, "orders", "Order", order_id)


def api_products(conn, company_id, query):
    """A page of find_products, its records as JSON texts."""
    page = find_products(conn, company_id, query, columns=record_columns(conn, "products"))
    return dict(page, data=records_json(conn, company_id, "products", page["data"]))


def api_orders(conn, company_id, query):
    """A page of find_orders, its records (with their items) as JSON texts."""
    page = find_orders(conn, company_id, query, columns=record_columns(conn, "orders"))
    return dict(page, data=records_json(conn, company_id, "orders", page["data"]))


# 11.4 Spreadsheets ---------------------------------------------------------------------------
# CSV out (docs/spreadsheets.md): a company's orders (a row per line), products, customers,
# customer prices and invoices, as Excel and LibreOffice open them (UTF-8 with a byte-order
# mark). Rows are read a batch at a time, after the last one's (created_at, id), and written as
# they are read: memory holds one batch whatever the rows. A cell that a spreadsheet would take
# for a formula is neutralised (OWASP, CSV injection).

#: What export writes, and the columns of each (the products' are what an import reads).
EXPORT_COLUMNS = {
    "orders": ("order_number", "order_id", "placed_at", "status", "customer_email", "customer_name",
               "po_number", "sku", "product", "quantity", "unit_price", "line_total",
               "order_subtotal", "order_tax", "order_total"),
    "products": ("sku", "name", "category", "unit", "price", "stock", "low_stock_threshold",
                 "active", "min_quantity", "order_multiple", "price_breaks", "image_url",
                 "description", "id"),
    "customers": ("email", "name", "status", "credit_limit", "tax_rate_override",
                  "payment_terms_days", "notes", "id"),
    "prices": ("customer_email", "group", "sku", "product", "price"),
    "invoices": ("number", "issued", "due", "status", "customer_email", "order_number",
                 "order_id", "subtotal", "tax", "total", "paid", "credited", "balance"),
}
EXPORT_BATCH = 500
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def csv_cell(value):
    """A value as a cell: nothing for None; text that starts as a formula would (=, +, -, @, a
    tab or a carriage return) after an apostrophe, unless it is a plain number."""
    if value is None:
        return ""
    text = str(value)
    if text[:1] in ("=", "+", "-", "@", "\t", "\r") and not _PLAIN_NUMBER.fullmatch(text):
        return "'" + text
    return text


def csv_text(rows):
    """The CSV text of rows (a header first), a row at a time, after a byte-order mark."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    yield "\ufeff"
    for row in rows:
        out.seek(0)
        out.truncate()
        writer.writerow([csv_cell(value) for value in row])
        yield out.getvalue()


def in_batches(conn, select, params, since=None, until=None):
    """The rows of select (a statement of one table, aliased t, ending in its WHERE clause),
    made from since until before until (ISO text), oldest first: a batch at a time."""
    after, where = ("", ""), ""
    for bound, test in ((since, ">="), (until, "<")):
        if bound is not None:
            where, params = f"{where} AND t.created_at {test} ?", [*params, bound]
    while True:
        rows = conn.execute(
            f"{select}{where} AND (t.created_at > ? OR (t.created_at = ? AND t.id > ?)) "
            f"ORDER BY t.created_at, t.id LIMIT {EXPORT_BATCH}",
            [*params, after[0], after[0], after[1]]).fetchall()
        yield rows
        if len(rows) < EXPORT_BATCH:
            return
        after = (rows[-1]["created_at"], rows[-1]["id"])


def _order_rows(conn, company_id, since, until):
    for orders in in_batches(conn, "SELECT t.*, c.email, c.name AS customer_name FROM orders t "
                                   "LEFT JOIN customers c ON c.id = t.customer_id "
                                   "WHERE t.company_id = ?", [company_id], since, until):
        items = collections.defaultdict(list)
        ids = [order["id"] for order in orders]
        for item in conn.execute(_ITEMS_OF_ORDERS.format(",".join("?" * len(ids))),
                                 ids).fetchall() if ids else ():
            items[item["order_id"]].append(item)
        for order in orders:
            total = order["total_cents"]
            for item in items[order["id"]]:
                yield (order["number"], order["id"], order["created_at"], order["status"],
                       order["email"], order["customer_name"], order["po_number"],
                       item["product_sku"], item["product_name"], item["quantity"],
                       decimal_text(item["unit_price_cents"]),
                       decimal_text(item["unit_price_cents"] * item["quantity"]),
                       decimal_text(total), decimal_text(order["tax_cents"]),
                       decimal_text(total + order["tax_cents"]))


def _product_rows(conn, company_id, since, until):
    for products in in_batches(conn, "SELECT t.* FROM products t WHERE t.company_id = ?",
                               [company_id], since, until):
        for p in products:
            yield (p["sku"], p["name"], p["category"], p["unit"], decimal_text(p["price_cents"]),
                   p["stock"], p["low_stock_threshold"], "yes" if p["is_active"] else "no",
                   p["min_quantity"], p["order_multiple"], price_breaks_text(p),
                   p["image_url"], p["description"], p["id"])


def _customer_rows(conn, company_id, since, until):
    for customers in in_batches(conn, "SELECT t.* FROM customers t WHERE t.company_id = ?",
                                [company_id], since, until):
        for c in customers:
            yield (c["email"], c["name"], c["status"],
                   None if c["credit_limit_cents"] is None else decimal_text(
                       c["credit_limit_cents"]), c["tax_rate_override"],
                   c["payment_terms_days"], c["notes"], c["id"])


def _price_rows(conn, company_id, since, until):
    """Customers' own prices (of customers made from since until before until), then every
    price group's."""
    for customers in in_batches(conn, "SELECT t.id, t.email, t.created_at FROM customers t "
                                      "WHERE t.company_id = ?", [company_id], since, until):
        for c in customers:
            for row in price_list(conn, company_id, c["id"]):
                yield c["email"], None, row["sku"], row["name"], decimal_text(row["price_cents"])
    for group in company_groups(conn, company_id):
        for row in group_price_list(conn, company_id, group["id"]):
            yield None, group["name"], row["sku"], row["name"], decimal_text(row["price_cents"])


def _invoice_rows(conn, company_id, since, until):
    for invoices in in_batches(conn, "SELECT t.*, c.email, o.number AS order_number FROM "
                                     "customer_invoices t LEFT JOIN customers c ON "
                                     "c.id = t.customer_id JOIN orders o ON o.id = t.order_id "
                                     "WHERE t.company_id = ?", [company_id], since, until):
        for i in invoices:
            yield (i["number"], i["issued_at"][:10], i["due_at"][:10], i["status"], i["email"],
                   i["order_number"], i["order_id"], decimal_text(i["subtotal_cents"]),
                   decimal_text(i["tax_cents"]), decimal_text(i["total_cents"]),
                   decimal_text(i["paid_cents"]), decimal_text(i["credited_cents"]),
                   decimal_text(balance_cents(i)))


_EXPORT_ROWS = {"orders": _order_rows, "products": _product_rows,
                "customers": _customer_rows, "prices": _price_rows,
                "invoices": _invoice_rows}


def export_csv(conn, company_id, kind, since=None, until=None):
    """The CSV text of one of EXPORT_COLUMNS' kinds of the company's records made from since
    until before until (ISO text; orders: placed), a row at a time. The company and the kind
    are checked before the first row."""
    load_company(conn, company_id)
    if kind not in EXPORT_KINDS:
        raise ApiError(400, EXPORT_KIND_MESSAGE)
    rows = _EXPORT_ROWS[kind](conn, company_id, since, until)
    return csv_text(itertools.chain([EXPORT_COLUMNS[kind]], rows))


# CSV in: products (created, or updated when a row's id or SKU names one), stock counts,
# customers (staff-created: no customer.created) and customers' own prices, from files in the
# columns export writes (a file export wrote imports back unchanged: each row "unchanged",
# nothing written, no event). All or nothing: the caller undoes the transaction when any line
# is refused, and every line is checked, so the answer names them all (the header is line 1).

#: The columns each kind of import must have (export's give them and more).
IMPORT_REQUIRED = {"products": ("name", "price"), "stock": ("sku", "counted"),
                   "customers": ("email",), "prices": ("sku", "price")}


def cell_text(text):
    """A cell as typed: export's apostrophe before a formula-like text is dropped again."""
    text = text.strip()
    if text[:1] == "'" and text[1:2] in ("=", "+", "-", "@", "\t", "\r"):
        return text[1:]
    return text


def _cell_whole(row, column, low=0, blank=None):
    text = row.get(column, "")
    if not text:
        return blank
    if not re.fullmatch(r"\d{1,10}", text) or int(text) < low:
        raise invalid(column, f"must be a whole number from {low}")
    return int(text)


def _cell_amount(row, column):
    cents = cents_from_text(row.get(column, ""))
    if cents is None:
        raise invalid(column, "must be an amount such as 12.50")
    return cents


def _product_of(conn, company_id, row):
    """The product a row names by its id, else by its SKU (the oldest with it), or None."""
    if row.get("id"):
        found = conn.execute("SELECT * FROM products WHERE id = ? AND company_id = ?",
                             (row["id"], company_id)).fetchone()
        if found is not None:
            return found
    if not row.get("sku"):
        return None
    return conn.execute("SELECT * FROM products WHERE company_id = ? AND sku = ? "
                        "ORDER BY created_at, id LIMIT 1", (company_id, row["sku"])).fetchone()


def _import_product(conn, company_id, row, actor):
    fields = {column: row[column] or None for column in
              ("name", "sku", "category", "unit", "image_url", "description") if column in row}
    for column, parse in (("price", lambda: _cell_amount(row, "price")),
                          ("stock", lambda: _cell_whole(row, "stock", blank=0)),
                          ("low_stock_threshold",
                           lambda: _cell_whole(row, "low_stock_threshold")),
                          ("min_quantity", lambda: _cell_whole(row, "min_quantity", 1, 1)),
                          ("order_multiple", lambda: _cell_whole(row, "order_multiple", 1, 1)),
                          ("price_breaks", lambda: parse_price_breaks(row["price_breaks"]))):
        if column in row:
            fields["price_cents" if column == "price" else column] = parse()
    if "active" in row:
        if row["active"].casefold() not in ("yes", "no"):
            raise invalid("active", "must be yes or no")
        fields["is_active"] = int(row["active"].casefold() == "yes")
    existing = _product_of(conn, company_id, row)
    if existing is None:
        create_product(conn, company_id, actor, opening="import", **fields)
        return "created"
    stored = dict(fields, price_breaks=fields["price_breaks"] and json_text(
        fields["price_breaks"])) if "price_breaks" in fields else fields
    changes = {column: fields[column] for column, value in stored.items()
               if existing[column] != value}
    if not changes:
        return "unchanged"
    update_product(conn, company_id, existing["id"], actor, **changes)
    return "updated"


def _import_stock(conn, company_id, row, actor):
    product = _product_of(conn, company_id, row)
    if product is None:
        raise not_found("Product")
    counted = _cell_whole(row, "counted")
    if counted is None:
        raise invalid("counted", "is required")
    if counted == product["stock"]:
        return "unchanged"
    count_stock(conn, company_id, product["id"], counted, row.get("note") or "import", actor)
    return "updated"


def _import_customer(conn, company_id, row, actor):
    body = {name: row[column] or None for name, column in (("name", "name"), ("notes", "notes"))
            if column in row}
    if row.get("status"):
        body["status"] = row["status"]
    if "credit_limit" in row:
        body["creditLimit"] = row["credit_limit"] and money(
            _cell_amount(row, "credit_limit"))
    if "tax_rate_override" in row:
        rate = row["tax_rate_override"]
        body["taxRateOverride"] = float(rate) if re.fullmatch(r"\d+(\.\d+)?", rate) else (
            rate or None)
    terms = row.get("payment_terms_days") or None
    existing = customer_by_email(conn, company_id, row["email"])
    if existing is None:
        created = create_customer(conn, company_id, dict(body, email=row["email"]),
                                  source="dashboard")
        set_customer_terms(conn, company_id, created["id"], terms)
        return "created"
    before = customer_json(existing)
    changed = {name: value for name, value in body.items() if before[name] != value}
    own_terms = None if terms is None else payment_terms(terms)
    if not changed and existing["payment_terms_days"] == own_terms:
        return "unchanged"
    if changed:
        update_customer(conn, company_id, existing["id"], changed)
    set_customer_terms(conn, company_id, existing["id"], own_terms)
    return "updated"


def _import_price(conn, company_id, row, actor):
    """A customer's own price (customer_email) or a price group's (group, by name)."""
    product = _product_of(conn, company_id, {"sku": row["sku"]})
    if product is None:
        raise not_found("Product")
    cents = _cell_amount(row, "price")
    if row.get("group"):
        group = next((g for g in company_groups(conn, company_id)
                      if g["name_key"] == row["group"].casefold()), None)
        if group is None:
            raise not_found("Group")
        before = group_prices_of(conn, group["id"], [product["id"]]).get(product["id"])
        if before != cents:
            set_group_price(conn, company_id, group["id"], product["id"], cents)
    else:
        customer = customer_by_email(conn, company_id, row.get("customer_email"))
        if customer is None:
            raise not_found("Customer")
        before = customer_prices_of(conn, customer["id"], [product["id"]]).get(product["id"])
        if before != cents:
            set_customer_price(conn, company_id, customer["id"], product["id"], cents)
    return "unchanged" if before == cents else "created" if before is None else "updated"


_IMPORTERS = {"products": _import_product, "stock": _import_stock,
              "customers": _import_customer, "prices": _import_price}


def import_file(db, company_id, kind, text, actor, apply):
    """import_rows in a transaction of its own, committed only when apply and no line is
    refused: returns its answer either way."""
    try:
        with db.write() as conn:
            result = import_rows(conn, company_id, kind, text, actor)
            if result["errors"] or not apply:
                raise Undone(result, 1 if result["errors"] else 0)
    except Undone as undone:
        return undone.result
    return result


def import_rows(conn, company_id, kind, text, actor=COMMAND):
    """A CSV file's rows into the company's records of a kind of IMPORT_KINDS, in the caller's
    transaction, every line tried. Returns {"created", "updated", "unchanged", "errors":
    [{"line", "message"}], "lines": [(line, what it did or its error)]}; with errors, the
    caller must not commit."""
    load_company(conn, company_id)
    if kind not in IMPORT_KINDS:
        raise ApiError(400, IMPORT_KIND_MESSAGE)
    if len(text) > MAX_IMPORT_CHARACTERS:
        raise invalid("file", IMPORT_TOO_LONG)
    result = {"created": 0, "updated": 0, "unchanged": 0, "errors": [], "lines": []}
    rows = csv.reader(io.StringIO(text.lstrip("\ufeff")))
    header = [cell.strip().casefold() for cell in next(rows, [])]
    missing = [column for column in IMPORT_REQUIRED[kind] if column not in header]
    if missing:
        result["errors"].append({"line": 1, "message": IMPORT_COLUMNS_MISSING.format(
            columns=", ".join(missing))})
        return result
    for number, cells in enumerate(rows, 2):
        if not any(cell.strip() for cell in cells):
            continue
        row = dict(zip(header, map(cell_text, cells)))
        try:
            with savepoint(conn):
                done = _IMPORTERS[kind](conn, company_id, row, actor)
        except ApiError as error:
            message = error.message + "".join(f" {d['field']}: {d['rule']}."
                                              for d in error.details or ())
            result["errors"].append({"line": number, "message": message})
            result["lines"].append((number, message))
            continue
        result[done] += 1
        result["lines"].append((number, done))
    return result


# 11.5 Reports --------------------------------------------------------------------------------
# A daily or weekly summary emailed to a company's staff alert addresses (docs/operations.md,
# Scheduled reports): days and ISO weeks in UTC; each period's report is claimed by a row of
# report_runs written with its emails, so that however many processes look, it is sent once,
# and a process that starts after downtime sends the periods missed since the last one.

def period_bounds(period, ms):
    """(start, end) in epoch ms of the UTC day, or ISO week (from Monday), that holds ms."""
    day = ms - ms % DAY_MS
    if period == "daily":
        return day, day + DAY_MS
    start = day - datetime.datetime.fromtimestamp(day / 1000, datetime.timezone.utc).weekday() \
        * DAY_MS
    return start, start + 7 * DAY_MS


def report_facts(conn, company_id, start, end, before):
    """A report's facts of the period [start, end) (epoch ms), against the one from before."""
    def sales(since, until):
        return conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(total_cents + tax_cents), 0) FROM orders WHERE "
            "company_id = ? AND status <> 'CANCELLED' AND created_at >= ? AND created_at < ?",
            (company_id, iso(since), iso(until))).fetchone()
    (count, revenue), (count_before, revenue_before) = sales(start, end), sales(before, start)
    top = conn.execute(
        "SELECT p.name, SUM(i.quantity) AS units FROM order_items i JOIN orders o ON o.id = "
        "i.order_id JOIN products p ON p.id = i.product_id WHERE o.company_id = ? AND "
        "o.status <> 'CANCELLED' AND o.created_at >= ? AND o.created_at < ? GROUP BY p.id, "
        "p.name ORDER BY units DESC, p.name LIMIT 5", (company_id, iso(start), iso(end)))
    low = conn.execute(
        "SELECT name, stock FROM products WHERE company_id = ? AND is_active = 1 AND "
        "low_stock_threshold IS NOT NULL AND stock <= low_stock_threshold ORDER BY stock, name "
        "LIMIT 10", (company_id,))
    overdue = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(total_cents - paid_cents - credited_cents), 0) FROM "
        "customer_invoices WHERE company_id = ? AND status = 'OPEN' AND due_at < ?",
        (company_id, iso(end))).fetchone()
    return [["Orders", f"{count} (the period before: {count_before})"],
            ["Revenue, tax included", f"{cents_text(revenue)} (the period before: "
                                      f"{cents_text(revenue_before)})"],
            ["Top products", "; ".join(f"{name}: {units} units" for name, units in top)
             or "none"],
            ["At or below their low-stock threshold",
             "; ".join(f"{name}: {stock} left" for name, stock in low) or "none"],
            ["Overdue invoices", f"{overdue[0]}, {cents_text(overdue[1])} owed"]]


def send_report(conn, company, period, start):
    """The company's report of the period from start (epoch ms), to each of its staff alert
    addresses, unless it was sent already (then False)."""
    claimed = conn.execute(
        "INSERT INTO report_runs (company_id, period, starts_at, sent_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (company_id, period, starts_at) DO NOTHING",
        (company["id"], period, iso(start), now_iso())).rowcount
    if not claimed:
        return False
    end = period_bounds(period, start)[1]
    title = (f"Daily report for {iso(start)[:10]}" if period == "daily"
             else f"Weekly report for the week of {iso(start)[:10]}")
    facts = report_facts(conn, company["id"], start, end, period_bounds(period, start - 1)[0])
    for address in json.loads(company["staff_alerts"] or "[]"):
        queue_email(conn, company["id"], "report", address, {
            "store": company["name"], "title": title, "facts": facts,
            "path": "/dashboard/orders"})
    return True


def last_period(period, now_ms):
    """The start (epoch ms) of the last complete period at now_ms."""
    return period_bounds(period, period_bounds(period, now_ms)[0] - 1)[0]


def send_due_reports(conn, now_ms):
    """Each company's reports due at now_ms: its last complete period's, and those it missed
    since its last report (REPORT_CATCH_UP at most), oldest first. Returns how many it sent."""
    sent = 0
    for company in conn.execute("SELECT * FROM companies WHERE report_period IS NOT NULL "
                                "AND staff_alerts IS NOT NULL").fetchall():
        period = company["report_period"]
        (last,) = conn.execute("SELECT MAX(starts_at) FROM report_runs WHERE company_id = ? "
                               "AND period = ?", (company["id"], period)).fetchone()
        starts = [last_period(period, now_ms)]
        while last is not None and len(starts) < REPORT_CATCH_UP and \
                iso(period_bounds(period, starts[-1] - 1)[0]) > last:
            starts.append(period_bounds(period, starts[-1] - 1)[0])
        sent += sum(send_report(conn, company, period, start) for start in reversed(starts))
    return sent


# ---------------------------------------------------------------------------------------------
# 12. Outbox
# ---------------------------------------------------------------------------------------------
# Work that must reach someone outside (a webhook delivery, and any other channel) is written
# as outbox rows in the transaction of the change that caused it, and sent afterwards by a
# dispatcher thread and a bounded pool of sender threads. A row is claimed under a lease and
# the claimer's identity, so a process that dies mid-send leaves it to be claimed again: at
# once by a process of the same host, which can tell the claimer is gone, else when the lease
# ends. That makes duplicates possible, never losses.
#
# A channel is an object with: noun (for logs), table (its outbox rows: id, state 'pending',
# 'sending' or a final state of its own, lease_until, claimed_by), ready (an SQL condition a
# pending row must also meet to be claimed now, :now being the time; "" for none),
# event_column (the column naming the event a row carries, or None), timeout (seconds one
# send may take), batch (rows one send carries at most), clock() (the time its ready condition
# and leases go by: tests move it), jobs(conn, ids) (the claimed rows, in sends of at most
# batch rows, with what sending needs), send(db, job) (send one and record the outcome in its
# rows), row_ids(job) (the rows a job holds: released if send fails unexpectedly) and
# prune(conn, before, batch) (one batch of retention). To add a channel, write such
# a class below and list it in outbox_channels().

#: Rows retention deletes per subject (a webhook's log, events) in one write transaction, so
#: that a first prune of a large file never holds the write lock for long.
PRUNE_BATCH = 1000


class Outbox:
    """The outbox's sender: a dispatcher thread that claims rows of every channel and a
    bounded pool of threads that send them. housekeeping(), if given, is the app's own,
    run off the request path by the dispatcher about once a minute."""

    def __init__(self, db, settings, channels, housekeeping=None):
        self.db = db
        self.settings = settings
        self.channels = list(channels)
        self.app_housekeeping = housekeeping
        self.jobs = queue.Queue()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.busy = 0
        self.busy_changed = threading.Condition()
        self.threads = []
        self.dispatcher = None
        self.next_housekeeping = 0.0

    @property
    def timeout(self):
        """The longest any channel's send may take."""
        return max(channel.timeout for channel in self.channels)

    # Life cycle

    def start(self):
        """Workers and the dispatcher, which also picks up what other processes recorded and
        what a crash left behind."""
        self.start_workers()
        dispatcher = threading.Thread(target=self._dispatch, name="ordering-dispatch",
                                      daemon=True)
        dispatcher.start()
        self.threads.append(dispatcher)
        self.dispatcher = dispatcher

    def start_workers(self):
        for number in range(self.settings.delivery_workers):
            worker = threading.Thread(target=self._work, name=f"ordering-deliver-{number}",
                                      daemon=True)
            worker.start()
            self.threads.append(worker)

    def notify(self, event_ids=None):
        self.wake.set()

    def stop(self, grace=None):
        """Stop claiming; give sends in flight up to grace seconds (default: the longest send
        timeout). Whatever is not sent stays in the outbox for the next start."""
        self.stopping.set()
        self.wake.set()
        if self.dispatcher is not None:  # done with the database once it has seen stopping
            self.dispatcher.join(self.timeout)
        grace = self.timeout if grace is None else grace
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
        """Atomically take up to limit sends' rows of the channels, in their order, under a
        lease (with event_ids: only the rows of those events, of channels that carry events);
        returns the sends (jobs)."""
        jobs = []
        for channel in self.channels:
            if len(jobs) >= limit:
                break
            if event_ids is None or channel.event_column:
                jobs += self._claim(channel, limit - len(jobs), event_ids)
        return jobs

    def _claim(self, channel, limit, event_ids):
        conn, table = self.db.conn, channel.table
        now, limit = channel.clock(), limit * channel.batch
        if event_ids is None:
            # A lease that has run out frees a row only from a claimer that may be gone: one
            # on this host that still lives is still sending it (it is stalled, not dead).
            args = {"now": iso(int(now * 1000)), "limit": limit}
            living = {f"living{number}": claimer for number, claimer in enumerate(
                row[0] for row in conn.execute(
                    f"SELECT DISTINCT claimed_by FROM {table} WHERE state = 'sending' AND "
                    "lease_until < :now", args)
                if row[0] and row[0].startswith(_HOST + "/") and claimer_alive(row[0]))}
            stalled = (f" AND COALESCE(claimed_by, '') NOT IN ({', '.join(':' + n for n in living)})"
                       if living else "")
            ready = f" AND {channel.ready}" if channel.ready else ""
            waiting = (f"SELECT id FROM {table} WHERE (state = 'pending'{ready}) OR (state = "
                       f"'sending' AND lease_until < :now{stalled}) ORDER BY id LIMIT :limit")
            args.update(living)
            if conn.execute(waiting, args).fetchone() is None:
                return []
        else:
            events = {f"event{number}": event_id for number, event_id in enumerate(event_ids)}
            waiting = (f"SELECT id FROM {table} WHERE state = 'pending' AND "
                       f"{channel.event_column} IN ({', '.join(':' + name for name in events)}) "
                       "LIMIT :limit")
            args = dict(events, limit=limit)
        # A send is bounded by the timeout (DNS included); the slack covers writing its result.
        lease = iso(int((now + 2 * channel.timeout + 5) * 1000))
        with self.db.write() as writing:
            ids = [row[0] for row in writing.execute(
                f"UPDATE {table} SET state = 'sending', lease_until = :lease, "
                f"claimed_by = :claimer WHERE id IN ({waiting}) RETURNING id",
                dict(args, lease=lease, claimer=process_identity()))]
        if not ids:
            return []
        return [dict(job, channel=channel) for job in channel.jobs(conn, ids)]

    def release_the_dead(self):
        """Rows claimed by processes that are gone are pending again, lease or not."""
        for channel in self.channels:
            claimers = [row[0] for row in self.db.conn.execute(
                f"SELECT DISTINCT claimed_by FROM {channel.table} WHERE state = 'sending'")]
            dead = [c for c in claimers if c is not None and not claimer_alive(c)]
            if not dead:
                continue
            with self.db.write() as conn:
                released = conn.execute(
                    f"UPDATE {channel.table} SET state = 'pending', lease_until = NULL, "
                    f"claimed_by = NULL WHERE state = 'sending' AND claimed_by IN "
                    f"({','.join('?' * len(dead))})", dead).rowcount
            log.warning("%d %s claimed by %s, which is gone, are pending again",
                        released, channel.noun, ", ".join(dead))

    def release(self, job):
        """After a send failed unexpectedly: the job's rows that it left claimed wait again.
        This process lives on, so no one else would take them before it restarts."""
        channel, ids = job["channel"], job["channel"].row_ids(job)
        try:
            with self.db.write() as conn:
                conn.execute(
                    f"UPDATE {channel.table} SET state = 'pending', lease_until = NULL, "
                    f"claimed_by = NULL WHERE state = 'sending' AND claimed_by = ? AND id IN "
                    f"({','.join('?' * len(ids))})", [process_identity(), *ids])
        except sqlite3.DatabaseError:  # the database itself fails: a restart releases them
            log.exception("%s %s stay claimed", channel.noun, job["id"])

    def submit(self, jobs):
        with self.busy_changed:
            self.busy += len(jobs)
        for job in jobs:
            self.jobs.put(job)

    def deliver_events(self, event_ids):
        """Send the rows of these events now and wait (the operator commands use this so that
        their events go out before they exit)."""
        if event_ids:
            self.submit(self.claim(10_000, event_ids))
        return self.wait_idle(self.timeout + 5)

    def _dispatch(self):
        names = " and ".join(channel.noun.split()[0] for channel in self.channels)
        while not self.stopping.is_set():
            self.wake.wait(self.settings.delivery_poll_interval)
            self.wake.clear()
            if self.stopping.is_set():
                break
            try:
                self.release_the_dead()
                free = self.settings.delivery_workers - self.busy
                if free > 0:
                    self.submit(self.claim(free))
                self._housekeeping()
            except Exception:  # whatever it is, the thread must live: it alone claims work
                log.exception("%s dispatcher failed; will try again", names)

    def _housekeeping(self):
        """Off the request path: the engine's own (SQLite's WAL file), and once a minute the
        app's housekeeping and the retention of every channel."""
        self.db.engine.housekeeping(self.db)
        if time.monotonic() < self.next_housekeeping:
            return
        self.next_housekeeping = time.monotonic() + 60
        if self.app_housekeeping is not None:
            self.app_housekeeping()
        self.prune()

    def prune(self, now=None):
        """Retention (settings.retention_days before now, epoch seconds), batch by batch."""
        days = self.settings.retention_days
        if days <= 0:
            return
        before = iso(int(((time.time() if now is None else now) - days * 86400) * 1000))
        for channel in self.channels:
            while not self.stopping.is_set():
                with self.db.write() as conn:
                    if not channel.prune(conn, before, PRUNE_BATCH):
                        break

    # Sending

    def _work(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job["channel"].send(self.db, job)
            except Exception:
                log.exception("%s %s failed unexpectedly", job["channel"].noun, job["id"])
                self.release(job)
            finally:
                with self.busy_changed:
                    self.busy -= 1
                    self.busy_changed.notify_all()
                self.wake.set()


# 12.1 Webhooks -------------------------------------------------------------------------------
# One attempt per delivery, as the spec says: the outbox's claims make sure an attempt is
# never forgotten, and receivers dedupe a repeat on X-Webhook-Id.

USER_AGENT = f"ordering-webhooks/{__version__}"
MAX_LOGGED_BODY = 2000


def sign(secret, body):
    """X-Webhook-Signature: sha256=<hex HMAC-SHA256 of the raw body, keyed by the whole secret>."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def verify_signature(secret, body, header):
    """For receivers: True when header is the signature of body (bytes) under secret."""
    if isinstance(body, str):
        body = body.encode("utf-8")
    return isinstance(header, str) and hmac.compare_digest(sign(secret, body), header.strip())


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


def refused_address(host, infos):
    """Why a delivery to host, which resolved to infos (getaddrinfo's), is refused, or None:
    one of its addresses is loopback, private, link-local or reserved."""
    for info in infos:
        if not address_allowed(info[4][0]):
            return (f"{host} resolves to {info[4][0]}, a loopback, private, link-local or "
                    f"reserved address.")
    return None


def webhook_url_refused(url, timeout):
    """Why this server will refuse every delivery to url, or None: its host resolves to an
    address it does not deliver to (a host that does not resolve yet may later)."""
    parts = urllib.parse.urlsplit(url)
    try:
        infos = resolve(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                        timeout)
    except (OSError, ValueError):
        return None
    return refused_address(parts.hostname, infos)


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
    refused = None if allow_private else refused_address(parts.hostname, infos)
    if refused:
        raise DeliveryRefused(f"Refused: {refused}")
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


def prune_history(conn, before, batch=PRUNE_BATCH):
    """One batch of retention: delivery-log entries attempted before `before` (ISO text) except
    each webhook's DELIVERIES_SHOWN most recent, then events created before it that no delivery
    refers to any more (an event still pending or being sent keeps its row). Returns the
    number of rows deleted; 0 when nothing is left to prune."""
    deleted = 0
    for (webhook_id,) in conn.execute("SELECT id FROM webhooks").fetchall():
        kept = conn.execute(
            "SELECT attempted_at, id FROM deliveries WHERE webhook_id = ? AND state = 'done' "
            "ORDER BY attempted_at DESC, id DESC LIMIT 1 OFFSET ?",
            (webhook_id, DELIVERIES_SHOWN - 1)).fetchone()
        if kept is None:
            continue
        deleted += conn.execute(
            "DELETE FROM deliveries WHERE id IN (SELECT id FROM deliveries WHERE webhook_id = ? "
            "AND state = 'done' AND attempted_at < ? AND (attempted_at, id) < (?, ?) LIMIT ?)",
            (webhook_id, before, kept[0], kept[1], batch)).rowcount
    deleted += conn.execute(
        "DELETE FROM events WHERE id IN (SELECT id FROM events e WHERE created_at < ? AND NOT "
        "EXISTS (SELECT 1 FROM deliveries d WHERE d.event_id = e.id) LIMIT ?)",
        (before, batch)).rowcount
    return deleted


class WebhookChannel:
    """Deliveries: each event POSTed, signed, to each subscribed webhook of its company."""

    noun = "webhook deliveries"
    table = "deliveries"
    ready = ""
    event_column = "event_id"
    batch = 1

    def __init__(self, settings):
        self.settings = settings
        self.timeout = settings.webhook_timeout
        self.clock = time.time

    def jobs(self, conn, ids):
        return conn.execute(
            "SELECT d.id, d.event_id, e.name AS event, e.body, w.url, w.secret, w.old_secret, "
            "w.grace_expires_at FROM deliveries d JOIN events e ON e.id = d.event_id "
            "JOIN webhooks w ON w.id = d.webhook_id "
            f"WHERE d.id IN ({','.join('?' * len(ids))}) ORDER BY d.id", ids).fetchall()

    def prune(self, conn, before, batch):
        return prune_history(conn, before, batch)

    def row_ids(self, job):
        return [job["id"]]

    def send(self, db, job):
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
            status, text = post_webhook(job["url"], body, headers, self.timeout,
                                        self.settings.allow_private_webhooks)
        except Exception as error:  # every failure of the one attempt is logged, never raised
            status, text = None, describe_failure(error, self.timeout)
        duration_ms = int((time.monotonic() - started) * 1000)
        success = status is not None and 200 <= status < 300
        with db.write() as conn:
            conn.execute(
                "UPDATE deliveries SET state = 'done', lease_until = NULL, claimed_by = NULL, "
                "status_code = ?, response_body = ?, duration_ms = ?, success = ?, "
                "attempted_at = ? WHERE id = ?",
                (status, text, duration_ms, int(success), now_iso(), job["id"]))


# 12.2 Email ----------------------------------------------------------------------------------
# Emails go to the one mail server of the settings (smtp_url), in batches: one connection
# carries up to MAIL_BATCH emails, each recorded as it is answered (so a crash repeats at most
# the one in flight, under the same Message-ID). Unlike webhooks, email is retried: a
# connection that fails (refused, timed out, TLS, login), a dropped connection and any 4xx
# reply back off and try again until MAIL_RETRY_SECONDS after the email began to wait; a 5xx
# reply (a refused recipient among them) fails it at once. Without a mail server the channel
# is not listed: emails wait, and the dashboard shows them as not sent and why (see
# docs/mail.md).

#: Seconds from an attempt that failed for now to the next: growing, then every eight hours.
MAIL_RETRY_DELAYS = (60, 5 * 60, 15 * 60, 30 * 60, 3600, 2 * 3600, 4 * 3600, 8 * 3600)
#: Seconds an email is tried after it began to wait (then it fails with the last reply); an
#: email still unsent by then, for want of a mail server, is not sent at all.
MAIL_RETRY_SECONDS = 2 * 86400
#: Emails one SMTP connection carries at most.
MAIL_BATCH = 50
#: Finished emails each company keeps whatever their age (the Emails page's most recent).
KEEP_EMAILS = 5
MAIL_POLICY = email.policy.SMTP  # CRLF line ends; non-ASCII header text as RFC 2047 words


def mail_retry_delay(attempts):
    """Seconds to wait after the attempts-th attempt failed for now."""
    return MAIL_RETRY_DELAYS[min(attempts, len(MAIL_RETRY_DELAYS)) - 1]


def retries_end(row):
    """ISO time after which the email is tried no more."""
    return iso(js_parse_date(row["queued_at"]) + MAIL_RETRY_SECONDS * 1000)


def build_message(row, settings):
    """The email of a row (with its company's name, mail_name and reply_to) as the bytes of
    SMTP DATA: multipart/alternative, plain text then HTML. The email package builds only the
    body: the headers that carry text somebody typed (names, the subject) are written here,
    as plain atoms or as base64 encoded-words, so that no version of the package decodes and
    refolds them (CVE-2024-6923, and display names that lose their quotes when folded). The
    bytes are then read back, and a message whose headers are not exactly the ones written
    (one To address, the row's) is refused (MessageRefused)."""
    sender = one_line(row["mail_name"] or row["company_name"])
    text, html = email_bodies(row["kind"], json.loads(row["data"]), settings.link_base, sender)
    utf8 = not (settings.mail_from + row["to_address"]).isascii()  # needs SMTPUTF8
    body = email.message.EmailMessage(policy=MAIL_POLICY)
    body.set_content(text, cte="quoted-printable")
    body.add_alternative(html, subtype="html", cte="quoted-printable")
    headers = [
        ("Message-ID", f"<{row['id']}@{settings.mail_from.rpartition('@')[2]}>"),
        ("Date", email.utils.format_datetime(
            datetime.datetime.fromisoformat(row["created_at"].replace("Z", "+00:00")))),
        ("From", header_address(sender, settings.mail_from)),
        ("To", header_address(row["to_name"], row["to_address"])),
        *([("Reply-To", header_address(None, row["reply_to"]))] if row["reply_to"] else []),
        ("Subject", header_text(row["subject"])),
        ("Auto-Submitted", "auto-generated"),  # RFC 3834: no auto-replies, please
    ]
    message = "".join(f"{name}: {value}\r\n" for name, value in headers).encode() + \
        body.as_bytes()
    check_message(message, row, settings, sender, [name for name, _ in headers])
    return message, utf8


class MessageRefused(Exception):
    """A built message that does not read back as it was written: it is not sent."""


#: A subject that goes into its header as it is: printable ASCII words one space apart. Any
#: other (a name beyond ASCII, "=?") is written as encoded-words, which a reader decodes and
#: nothing reads as syntax.
_PLAIN_HEADER_TEXT = re.compile(r"[!-~]+( [!-~]+)*")
#: UTF-8 bytes per encoded-word, so that each stays within 75 characters (RFC 2047).
_ENCODED_WORD_BYTES = 45


def encoded_words(text):
    """Text as base64 encoded-words of whole characters, folded one a line."""
    words, word = [], ""
    for character in text:
        if len((word + character).encode()) > _ENCODED_WORD_BYTES:
            words.append(word)
            word = ""
        word += character
    words.append(word)
    return "\r\n ".join("=?utf-8?b?" + base64.b64encode(word.encode()).decode() + "?="
                         for word in words)


def header_text(value):
    """One line of text as an unstructured header's value (the subject)."""
    value = one_line(value)
    return value if _PLAIN_HEADER_TEXT.fullmatch(value) and "=?" not in value \
        else encoded_words(value)


def header_address(name, address):
    """A checked address with an optional display name, as a header value: the name as a
    quoted string when it is printable ASCII, as encoded-words otherwise."""
    name = one_line(name)
    if not name:
        return address
    if name.isascii() and name.isprintable() and "=?" not in name:
        phrase = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    else:
        phrase = encoded_words(name)
    return f"{phrase} <{address}>"


def check_message(message, row, settings, sender, names):
    """Raise MessageRefused unless the message's bytes read back to exactly these headers,
    in this order, with the row's one recipient, and to a plain text and an HTML part."""
    parsed = email.message_from_bytes(message, policy=email.policy.default) if message.isascii() \
        else email.message_from_string(message.decode("utf-8"), policy=email.policy.default)
    expected = {"From": (sender, settings.mail_from), "To": (one_line(row["to_name"]),
                                                             row["to_address"])}
    if row["reply_to"]:
        expected["Reply-To"] = ("", row["reply_to"])
    problems = []
    if [name.lower() for name in parsed.keys()] != [
            name.lower() for name in names + ["MIME-Version", "Content-Type"]]:
        problems.append("headers " + ", ".join(parsed.keys()))
    for name, (display_name, address) in expected.items():
        # without white space: in a name, some readers put a space between encoded-words
        found = [("".join(one.display_name.split()), one.addr_spec)
                 for one in parsed[name].addresses] if parsed[name] is not None else []
        if found != [("".join(display_name.split()), address)]:
            problems.append(f"{name} {found!r}")
    if str(parsed["Subject"]) != one_line(row["subject"]):
        problems.append("Subject")
    if parsed.get_content_type() != "multipart/alternative" or [
            part.get_content_type() for part in parsed.iter_parts()] != ["text/plain",
                                                                         "text/html"]:
        problems.append("parts")
    if problems:
        raise MessageRefused("the message does not read back as it was written: "
                             + "; ".join(problems))


class MailServerError(Exception):
    """The mail server could not be used (connection, greeting, TLS or login), in plain
    words."""


def connect_smtp(settings, server, context):
    """An SMTP connection ready to send: TLS as the scheme asks, certificates verified,
    logged in when the URL has a user. Raises MailServerError."""
    host = urllib.parse.urlsplit(settings.link_base).hostname
    ehlo_name = (f"[IPv6:{host}]" if ":" in host else f"[{host}]"
                 if re.fullmatch(r"[\d.]+", host) else host)
    stage, smtp = "connect", None
    try:
        if server.scheme == "smtps":
            smtp = smtplib.SMTP_SSL(server.host, server.port, local_hostname=ehlo_name,
                                    timeout=settings.smtp_timeout, context=context)
        else:
            smtp = smtplib.SMTP(server.host, server.port, local_hostname=ehlo_name,
                                timeout=settings.smtp_timeout)
        stage = "ehlo"
        smtp.ehlo()
        if server.scheme == "smtp+starttls":
            stage = "starttls"
            smtp.starttls(context=context)
            smtp.ehlo()
        if server.user is not None:
            stage = "login"
            smtp.login(server.user, server.password or "")
    except Exception as error:
        if smtp is not None:
            smtp.close()
        raise MailServerError(smtp_failure(error, stage, server, settings.smtp_timeout)) from None
    return smtp


_WRONG_TLS = ("WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE",
              "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST", "TLSV1_ALERT_PROTOCOL_VERSION")


def smtp_failure(error, stage, server, timeout):
    """What went wrong at a stage of connecting to the mail server, in plain words."""
    where = f"{server.host}:{server.port}"
    if isinstance(error, ssl.SSLCertVerificationError):
        if "mismatch" in (error.verify_message or ""):
            return (f"Certificate not for this name: the certificate of {where} "
                    f"({error.verify_message}) names another host; use the host name it was "
                    "issued for in ORDERING_SMTP_URL.")
        return (f"Certificate not trusted: the certificate of {where} failed verification "
                f"({error.verify_message}). A private relay's certificate authority can be "
                "trusted with ORDERING_SMTP_CA_FILE.")
    if isinstance(error, ssl.SSLError) and error.reason in _WRONG_TLS:
        return (f"Wrong TLS mode for port {server.port}: {where} does not begin with TLS, as "
                f"{server.scheme}:// expects. smtps:// is for implicit TLS (usually port 465); "
                "use smtp+starttls:// there (usually port 587), or smtp:// for a relay without "
                "TLS.")
    if isinstance(error, ssl.SSLError):
        return f"TLS with {where} failed: {error.reason or error}."
    if stage == "connect":
        if isinstance(error, ConnectionRefusedError):
            return (f"Connection refused by {where}: no mail server listens there (is it "
                    "running, and is that its port?).")
        if isinstance(error, socket.gaierror):
            return f"Cannot find the mail server {server.host}: {error.strerror or error}."
        if isinstance(error, smtplib.SMTPServerDisconnected):
            return (f"{where} sent no greeting within {timeout:g} seconds: it probably "
                    f"expects TLS from the first byte. Wrong TLS mode for port {server.port}? "
                    "Use smtps:// there (usually port 465).")
        if isinstance(error, TimeoutError):
            return (f"No answer from {where} within {timeout:g} seconds (a firewall, or the "
                    "wrong host or port).")
        if isinstance(error, smtplib.SMTPConnectError):
            return f"{where} refused the connection: {_reply(error.smtp_code, error.smtp_error)}"
    if stage == "starttls" and isinstance(error, smtplib.SMTPNotSupportedError):
        return (f"{where} does not offer STARTTLS, which smtp+starttls:// requires: use "
                "smtps:// if it expects TLS from the first byte (usually port 465), or smtp:// "
                "for a relay without TLS.")
    if stage == "login":
        if isinstance(error, smtplib.SMTPAuthenticationError):
            return (f"Authentication refused by {where}: "
                    f"{_reply(error.smtp_code, error.smtp_error)} (check the user and password "
                    "of ORDERING_SMTP_URL).")
        if isinstance(error, smtplib.SMTPNotSupportedError):
            return (f"{where} offers no login (AUTH) on this connection" +
                    (": many servers offer it only after STARTTLS (smtp+starttls://)."
                     if server.scheme == "smtp" else "."))
        if isinstance(error, smtplib.SMTPException):
            return f"{where} offers no login method this client has: {error}."
    if isinstance(error, smtplib.SMTPResponseException):
        return f"{where} answered {_reply(error.smtp_code, error.smtp_error)}"
    if isinstance(error, (smtplib.SMTPServerDisconnected, OSError)):
        return f"The connection to {where} failed: {error or type(error).__name__}."
    return f"{type(error).__name__}: {error}"


def _reply(code, text):
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return one_line(f"{code} {text}")[:MAX_LOGGED_BODY]


def hang_up(smtp):
    """QUIT; a connection the server dropped, or that fails at QUIT, is just closed (what was
    sent was answered already)."""
    if smtp.sock is not None:
        try:
            smtp.quit()
        except (smtplib.SMTPException, OSError):
            smtp.close()


def transmit(smtp, sender, recipient, message, utf8):
    """One email over an open connection: ("sent", "deferred" or "failed", the server's
    reply). A 2xx is sent, a 5xx failed at once; anything else (a 4xx, a dropped connection)
    is deferred, to be tried again."""
    if utf8 and not smtp.has_extn("smtputf8"):
        return "failed", ("Not sent: the address is not ASCII, and the mail server does not "
                          "offer SMTPUTF8.")
    step = "MAIL FROM"
    try:
        code, text = smtp.mail(sender, ["SMTPUTF8"] if utf8 else [])
        if code == 250:
            step = "RCPT TO"
            code, text = smtp.rcpt(recipient)
            if code in (250, 251):
                step = "DATA"
                code, text = smtp.data(message)
    except smtplib.SMTPResponseException as error:  # DATA itself refused
        code, text = error.smtp_code, error.smtp_error
    except OSError as error:  # smtplib's errors, a dropped connection among them, are OSErrors
        smtp.close()
        return "deferred", f"The connection was lost at {step}: {error or 'closed'}."
    if code == 421:  # the server is closing the connection
        smtp.close()
    elif not 200 <= code < 300:
        try:  # the connection serves the next email of the batch, a DATA refused before
            smtp.rset()  # the message included (its MAIL and RCPT would still stand)
        except OSError:
            smtp.close()
    reply = _reply(code, text)
    if 200 <= code < 300:
        return "sent", reply
    return ("failed" if 500 <= code < 600 else "deferred"), f"{step}: {reply}"


def prune_emails(conn, before, batch=PRUNE_BATCH):
    """One batch of retention: finished emails (sent, failed, unsent) that finished before
    `before`, with their attempts, except each company's KEEP_EMAILS most recent; an email
    still waiting is never removed. Returns the number of emails deleted."""
    deleted = 0
    for (company_id,) in conn.execute("SELECT DISTINCT company_id FROM emails WHERE "
                                      "finished_at < ?", (before,)).fetchall():
        kept = conn.execute(
            "SELECT finished_at, id FROM emails WHERE company_id = ? AND finished_at IS NOT "
            "NULL ORDER BY finished_at DESC, id DESC LIMIT 1 OFFSET ?",
            (company_id, KEEP_EMAILS - 1)).fetchone()
        if kept is None:
            continue
        deleted += conn.execute(
            "DELETE FROM emails WHERE id IN (SELECT id FROM emails WHERE company_id = ? AND "
            "finished_at < ? AND (finished_at, id) < (?, ?) LIMIT ?)",
            (company_id, before, kept[0], kept[1], batch)).rowcount
    return deleted


class EmailChannel:
    """Emails, through the mail server of the settings, up to MAIL_BATCH per connection."""

    noun = "email messages"
    table = "emails"
    ready = "next_attempt_at <= :now"
    event_column = "id"  # an email is its own event: run_command sends the ones it wrote
    batch = MAIL_BATCH

    def __init__(self, settings):
        self.settings = settings
        self.server = settings.mail_server
        self.context = mail_tls_context(settings)
        # A batch starts no new email after smtp_timeout seconds (the rest wait for the next
        # send), so a send takes about that plus one email's exchange.
        self.timeout = 2 * settings.smtp_timeout
        self.clock = time.time

    def jobs(self, conn, ids):
        rows = conn.execute(
            "SELECT e.*, c.name AS company_name, c.mail_name, c.reply_to FROM emails e "
            f"JOIN companies c ON c.id = e.company_id WHERE e.id IN ({','.join('?' * len(ids))}) "
            "ORDER BY e.id", ids).fetchall()
        return [{"id": rows[start]["id"], "emails": rows[start:start + self.batch]}
                for start in range(0, len(rows), self.batch)]

    def prune(self, conn, before, batch):
        return prune_emails(conn, before, batch)

    def row_ids(self, job):
        return [row["id"] for row in job["emails"]]

    def send(self, db, job):
        started = time.monotonic()
        now = iso(int(self.clock() * 1000))
        emails = []
        for row in job["emails"]:
            if now < retries_end(row):
                emails.append(row)
            elif row["attempts"]:
                self.finish(db, row, "failed", f"Gave up after {row['attempts']} attempts: "
                                               f"{row['last_reply']}")
            else:
                self.finish(db, row, "unsent", f"Not sent: no mail server was set within "
                                               f"{MAIL_RETRY_SECONDS // 3600} hours of it "
                                               "being written.")
        if not emails:
            return
        try:
            smtp = connect_smtp(self.settings, self.server, self.context)
        except MailServerError as error:
            log.warning("mail server %s: %s", describe_smtp_url(self.settings.smtp_url), error)
            for row in emails:
                self.record(db, row, "deferred", str(error),
                            int((time.monotonic() - started) * 1000))
            return
        try:
            for index, row in enumerate(emails):
                if smtp.sock is None or (
                        index and time.monotonic() - started > self.settings.smtp_timeout):
                    self.release(db, emails[index:])
                    return
                sent_at = time.monotonic()
                try:
                    message, utf8 = build_message(row, self.settings)
                except Exception as error:  # no attempt would do better: it fails at once
                    log.exception("email %s cannot be built", row["id"])
                    self.record(db, row, "failed", f"Not sent: the message cannot be built "
                                                   f"({type(error).__name__}: {error}).", 0)
                    continue
                try:
                    outcome, reply = transmit(smtp, self.settings.mail_from, row["to_address"],
                                              message, utf8)
                except Exception as error:
                    # Counted as an attempt, so that an email that always fails this way backs
                    # off and its retries end; the outbox releases the emails after it.
                    self.record(db, row, "deferred", f"Not sent: {type(error).__name__}: "
                                                     f"{error}", 0)
                    raise
                self.record(db, row, outcome, reply, int((time.monotonic() - sent_at) * 1000))
        finally:
            hang_up(smtp)

    def record(self, db, row, outcome, reply, duration_ms):
        """An attempt and its reply; the email is then sent, failed, or waits for its next
        attempt (failed when that would come after its retries end)."""
        clock = self.clock()
        at, attempts, state, next_at = iso(int(clock * 1000)), row["attempts"] + 1, outcome, None
        if outcome == "deferred":  # backing off from the attempts since it began to wait
            tried = db.conn.execute("SELECT COUNT(*) FROM email_attempts WHERE email_id = ? AND "
                                    "attempted_at >= ?", (row["id"], row["queued_at"])
                                    ).fetchone()[0] + 1
            next_at = iso(int((clock + mail_retry_delay(tried)) * 1000))
            state = "pending"
            if next_at >= retries_end(row):
                state = outcome = "failed"
                reply = f"Gave up after {attempts} attempts: {reply}"
        with db.write() as conn:
            conn.execute("INSERT INTO email_attempts (id, email_id, attempted_at, outcome, "
                         "reply, duration_ms) VALUES (?, ?, ?, ?, ?, ?)",
                         (new_id("att"), row["id"], at, outcome, reply, duration_ms))
            conn.execute(
                "UPDATE emails SET state = ?, attempts = ?, last_reply = ?, next_attempt_at = "
                "COALESCE(?, next_attempt_at), finished_at = ?, lease_until = NULL, "
                "claimed_by = NULL WHERE id = ?",
                (state, attempts, reply, next_at, None if state == "pending" else at, row["id"]))

    def finish(self, db, row, state, reason):
        """An email tried no more, without an attempt."""
        with db.write() as conn:
            conn.execute("UPDATE emails SET state = ?, last_reply = ?, finished_at = ?, "
                         "lease_until = NULL, claimed_by = NULL WHERE id = ?",
                         (state, reason, iso(int(self.clock() * 1000)), row["id"]))

    def release(self, db, rows):
        """Emails a send did not get to: waiting again at once, no attempt counted."""
        with db.write() as conn:
            conn.execute("UPDATE emails SET state = 'pending', lease_until = NULL, claimed_by "
                         f"= NULL WHERE id IN ({','.join('?' * len(rows))})",
                         [row["id"] for row in rows])


def send_test_email(settings, to_address):
    """mail-test: one email to to_address at once, not queued; returns the server's reply.
    Raises MailServerError, with the trouble in plain words."""
    if settings.mail_server is None:
        raise MailServerError("No mail server is set: give --smtp-url or ORDERING_SMTP_URL.")
    now = now_iso()
    row = {"id": new_id("eml"), "kind": "mail_test", "company_name": "ordering",
           "mail_name": None, "reply_to": None, "to_address": to_address, "to_name": None,
           "created_at": now, "subject": plain(EMAIL_TEMPLATES["mail_test"].subject),
           "data": json_text({"server": describe_smtp_url(settings.smtp_url)})}
    smtp = connect_smtp(settings, settings.mail_server, mail_tls_context(settings))
    try:
        message, utf8 = build_message(row, settings)
        outcome, reply = transmit(smtp, settings.mail_from, to_address, message, utf8)
    finally:
        hang_up(smtp)
    if outcome != "sent":
        raise MailServerError(f"The mail server did not take the email: {reply}")
    return reply


# 12.3 Channels -------------------------------------------------------------------------------

def outbox_channels(settings):
    """The channels an app's outbox sends, in the order it claims from them (email only with
    a mail server: without one, emails wait)."""
    channels = [WebhookChannel(settings)]
    if settings.smtp_url:
        channels.append(EmailChannel(settings))
    return channels


# ---------------------------------------------------------------------------------------------
# 13. HTTP API
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
    the key's company, the query parameters and the parsed body, and the key as the actor of
    what it changes."""
    __slots__ = ("conn", "company_id", "query", "body", "settings", "actor")

    def __init__(self, conn, company_id, query, body, settings, actor=None):
        self.conn = conn
        self.company_id = company_id
        self.query = query
        self.body = body
        self.settings = settings
        self.actor = actor


Key = collections.namedtuple("Key", "id company_id scopes rate_limit expires_at revoked")


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
                           parse_int=_json_int, parse_float=JsonFloat)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ApiError(400, INVALID_JSON) from None
    # A \ud800-style escape decodes to a lone surrogate, which is not text: no UTF-8 form.
    if b"\\u" in raw and _has_lone_surrogate(value):
        raise ApiError(400, INVALID_JSON)
    return value


# 13.1 Routes ---------------------------------------------------------------------------------
# Each parses, calls an operation and wraps the result. They are the functions of a class only
# so that each can carry the name the OpenAPI document publishes as its operationId
# (create_customer) while the operation of that name stays the module's: inside a function,
# create_customer is the module's operation, never the route.


class Api:
    """The REST API's routes, named as their operationIds."""

    @route("GET", "/api/v1/products", "products:read")
    def list_products(call):
        """List products"""
        page = api_products(call.conn, call.company_id, call.query)
        return json_envelope(page["data"], page["pagination"])


    @route("GET", "/api/v1/products/<product_id>", "products:read")
    def get_product(call, product_id):
        """Fetch one product"""
        return json_envelope(api_product(call.conn, call.company_id, product_id))


    @route("GET", "/api/v1/orders", "orders:read")
    def list_orders(call):
        """List orders"""
        page = api_orders(call.conn, call.company_id, call.query)
        return json_envelope(page["data"], page["pagination"])


    @route("GET", "/api/v1/orders/<order_id>", "orders:read")
    def get_order(call, order_id):
        """Fetch one order"""
        return json_envelope(api_order(call.conn, call.company_id, order_id))


    @route("POST", "/api/v1/orders", "orders:write", status=201)
    def create_order(call):
        """Place an order"""
        return {"data": place_order(call.conn, call.company_id, call.body, actor=call.actor)}


    @route("PATCH", "/api/v1/orders/<order_id>", "orders:write")
    def update_order(call, order_id):
        """Update an order's status and tracking"""
        status, tracking = parse_status_update(call.body, company_carriers(
            call.conn, call.company_id, call.settings.tracking_url_templates))
        return {"data": update_order_status(call.conn, call.company_id, order_id, status, tracking)}


    @route("GET", "/api/v1/customers", "customers:read")
    def list_customers(call):
        """List customers"""
        page = find_customers(call.conn, call.company_id, call.query)
        return dict(page, data=[customer_json(row) for row in page["data"]])


    @route("GET", "/api/v1/customers/<customer_id>", "customers:read")
    def get_customer(call, customer_id):
        """Fetch one customer"""
        return {"data": customer_json(load_customer(call.conn, call.company_id, customer_id))}


    @route("POST", "/api/v1/customers", "customers:write", status=201)
    def create_customer(call):
        """Create a customer"""
        return {"data": create_customer(call.conn, call.company_id, call.body)}


    @route("PATCH", "/api/v1/customers/<customer_id>", "customers:write")
    def update_customer(call, customer_id):
        """Update a customer"""
        return {"data": update_customer(call.conn, call.company_id, customer_id, call.body)}


    @route("GET", "/api/v1/webhooks", "webhooks:read")
    def list_webhooks(call):
        """List webhook subscriptions"""
        at = now_iso()
        return {"data": [webhook_json(row, at=at)
                         for row in company_webhooks(call.conn, call.company_id)]}


    @route("GET", "/api/v1/webhooks/<webhook_id>", "webhooks:read")
    def get_webhook(call, webhook_id):
        """Fetch one webhook subscription"""
        return {"data": webhook_json(load_webhook(call.conn, call.company_id, webhook_id))}


    @route("POST", "/api/v1/webhooks", "webhooks:write", status=201)
    def create_webhook(call):
        """Create a webhook subscription (the only response that carries its secret)"""
        return {"data": create_webhook(call.conn, call.company_id, call.body)}


    @route("PATCH", "/api/v1/webhooks/<webhook_id>", "webhooks:write")
    def update_webhook(call, webhook_id):
        """Update a webhook subscription"""
        return {"data": update_webhook(call.conn, call.company_id, webhook_id, call.body)}


    @route("DELETE", "/api/v1/webhooks/<webhook_id>", "webhooks:write")
    def delete_webhook(call, webhook_id):
        """Delete a webhook subscription and its delivery log"""
        return {"data": delete_webhook(call.conn, call.company_id, webhook_id)}


    @route("GET", "/api/v1/inventory", "inventory:read")
    def list_inventory(call):
        """List stock movements"""
        page = find_movements(call.conn, call.company_id, call.query)
        return dict(page, data=[movement_json(row) for row in page["data"]])


    @route("GET", "/api/v1/returns", "returns:read")
    def list_returns(call):
        """List returns"""
        page = find_returns(call.conn, call.company_id, call.query)
        return dict(page, data=returns_json(call.conn, page["data"]))


    @route("GET", "/api/v1/returns/<return_id>", "returns:read")
    def get_return(call, return_id):
        """Fetch one return"""
        return {"data": return_record(call.conn, call.company_id, return_id)}


# 13.2 Billing --------------------------------------------------------------------------------
# POST /billing/stripe/webhook lives beside the API, not in it: no API key (Stripe signs every
# body instead), no rate limit, not in ROUTES or the OpenAPI document, and no route at all (a
# 404) unless a Stripe webhook secret is set. The raw body is verified before it is parsed.

STRIPE_WEBHOOK_PATH = "/billing/stripe/webhook"


def verify_stripe_signature(signing_secrets, body, header, now, tolerance):
    """Refuse (400) a body unless header, Stripe-Signature: t=<Unix time>,v1=<hex>[,v1=...],
    carries a v1 that is the HMAC-SHA256 of "<t>.<body>" keyed with one of the secrets, each
    compared in constant time, and t is at most tolerance seconds before now. Other schemes
    (v0) are ignored, as Stripe's own libraries ignore them."""
    if not header:
        raise ApiError(400, STRIPE_SIGNATURE_MISSING)
    timestamp, signatures = None, []
    for item in header.split(","):
        name, equals, value = item.strip().partition("=")
        if not equals or (name == "t" and (timestamp is not None
                                           or not re.fullmatch(r"[0-9]{1,15}", value))):
            raise ApiError(400, STRIPE_SIGNATURE_MALFORMED)
        if name == "t":
            timestamp = int(value)
        elif name == "v1":
            signatures.append(value.encode("utf-8", "replace"))
    if timestamp is None:
        raise ApiError(400, STRIPE_SIGNATURE_MALFORMED)
    signed = b"%d." % timestamp + body
    expected = [hmac.new(secret.encode("utf-8"), signed, hashlib.sha256).hexdigest().encode()
                for secret in signing_secrets]
    if not any(hmac.compare_digest(mine, theirs) for mine in expected for theirs in signatures):
        raise ApiError(400, STRIPE_SIGNATURE_MISMATCH)
    if timestamp < now - tolerance:
        raise ApiError(400, STRIPE_SIGNATURE_EXPIRED)


def stripe_webhook(service):
    """200 once an event is acted on or ignored (a repeat too), so that Stripe stops sending
    it; 400 and nothing recorded for a body not signed as it should be; 413 for one over the
    size limit; a failure of ours is a 500, which Stripe retries."""
    environ, settings = bottle.request.environ, service.settings
    try:
        raw = service.read_body(environ)
        verify_stripe_signature(settings.stripe_webhook_secrets, raw,
                                environ.get("HTTP_STRIPE_SIGNATURE"), service.clock(),
                                settings.stripe_webhook_tolerance)
        event = parse_stripe_event(parse_json_body(raw))
        with service.db.write() as conn:
            status, body = 200, receive_stripe_event(conn, event)
    except ApiError as error:
        status, body = error.status, error.body()
    except Exception:
        log.exception("POST %s failed", STRIPE_WEBHOOK_PATH)
        bottle.response.status = 500
        bottle.response.content_type = "text/plain; charset=utf-8"
        return b"Internal Server Error"
    bottle.response.status = status
    bottle.response.content_type = "application/json"
    return json_text(body).encode()


def install_stripe_webhook(app):
    service = app.service
    if service.settings.stripe_webhook_secrets:
        app.route(STRIPE_WEBHOOK_PATH, "POST", lambda: stripe_webhook(service))


# 13.3 Serving the API ------------------------------------------------------------------------

_warned = set()


def warn_former_name(former, current):
    if former not in _warned:
        _warned.add(former)
        warnings.warn(f"ordering: {former} is now {current}; the former name goes in the next "
                      "release", DeprecationWarning, stacklevel=3)


class Service:
    """The running pieces behind one app: the database, the outbox, the rate-limit counter
    and the key cache (whose clock tests may replace)."""

    def __init__(self, settings, deliver=True):
        self.settings = settings
        self.db = Database(settings.db_path, settings)
        self.outbox = Outbox(self.db, settings, outbox_channels(settings),
                             housekeeping=self.housekeeping)
        self.db.on_commit(self.outbox.notify)
        self.windows = self.db.engine.rate_counter(self.db, settings, time.time)
        self.key_cache = {}
        # The rate-limit windows and the key cache read time from here, so a test can hold it
        # still.
        self.clock = time.time
        if deliver:
            self.outbox.start()

    def close(self, grace=None):
        self.outbox.stop(grace)
        self.windows.close()
        self.db.close()

    @property
    def sender(self):
        """The outbox, by its former name (until the next release)."""
        warn_former_name("Service.sender", "Service.outbox")
        return self.outbox

    def housekeeping(self):
        """The app's own, run by the outbox's dispatcher as it starts and about once a minute:
        expired idempotency keys, the reminders of overdue invoices that are due, and the
        scheduled reports."""
        with self.db.write() as conn:
            expire_idempotency_keys(conn, now_iso())
        while True:
            with self.db.write() as conn:
                if not send_reminders(conn, int(self.clock() * 1000)):
                    break
        with self.db.write() as conn:
            send_due_reports(conn, int(self.clock() * 1000))

    def health(self):
        """GET /healthz, for load balancers and supervisors: 200 while the database answers.
        X-Worker-Pid names the process that answered (which worker, under serve --workers)."""
        bottle.response.content_type = "application/json"
        bottle.response.set_header("X-Worker-Pid", str(os.getpid()))
        try:
            self.db.ping()
        except sqlite3.Error as error:
            log.error("health check failed: %s", error)
            bottle.response.status = 503
            return json_text({"status": "unavailable"})
        return json_text({"status": "ok"})

    # Who is calling

    def client_address(self, environ):
        # The last hop is the one the proxy appended; earlier ones are whatever the client
        # sent. (Under serve, waitress has already done the same and checked the peer.)
        if self.settings.trust_proxy and environ.get("HTTP_X_FORWARDED_FOR"):
            return client_ip(environ["HTTP_X_FORWARDED_FOR"].split(",")[-1])
        return client_ip(environ.get("REMOTE_ADDR"))

    def check_ip_rate(self, environ):
        limit = self.settings.ip_rate_limit
        if limit <= 0:
            return
        allowed, _, reset = self.windows.hit("ip " + self.client_address(environ), limit,
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
        if cached is None or cached[0] < self.clock():
            row = find_api_key(self.db.conn, digest)
            if row is None or not hmac.compare_digest(row["key_hash"], digest):
                raise ApiError(401, INVALID_KEY)
            key = Key(row["id"], row["company_id"], frozenset(row["scopes"].split()),
                      row["rate_limit"], row["expires_at"], bool(row["revoked"]))
            if len(self.key_cache) > 10_000:
                self.key_cache.clear()
            self.key_cache[digest] = (self.clock() + self.settings.key_cache_seconds, key)
        else:
            key = cached[1]
        if key.revoked or (key.expires_at and key_expired(key.expires_at, now_iso())):
            raise ApiError(401, INVALID_KEY)
        return key

    def revoke_key(self, company_id, key_id):
        """Revoke a key; through this process the revocation takes effect at once."""
        with self.db.write() as conn:
            result = revoke_api_key(conn, company_id, key_id)
        self.key_cache.clear()
        return result

    def check_key_rate(self, key):
        allowed, remaining, reset = self.windows.hit("key " + key.id, key.rate_limit,
                                                     self.clock())
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
                raise ApiError(403, MISSING_SCOPE.format(scope=found.scope))
            text = environ.get("QUERY_STRING")
            # The first value of a repeated parameter wins, as URLSearchParams.get() has it.
            query = dict(urllib.parse.parse_qsl(text, keep_blank_values=True)[::-1]) if text else {}
            actor = Actor("key", key.id)
            if found.method == "GET":
                call = Call(self.db.conn, key.company_id, query, None, self.settings, actor)
                return found.status, json_text(found.handler(call, **url_args)).encode(), headers
            raw = self.read_body(environ) if found.method != "DELETE" else b"{}"
            idempotency_key = None
            if found.method == "POST":
                idempotency_key = parse_idempotency_key(environ.get("HTTP_IDEMPOTENCY_KEY"))
            if idempotency_key is None:
                call = Call(None, key.company_id, query, parse_json_body(raw), self.settings,
                            actor)
                with self.db.write() as conn:
                    call.conn = conn
                    result = found.handler(call, **url_args)
                return found.status, json_text(result).encode(), headers
            status, body, replayed = self.respond_once(
                found, url_args, key.company_id, idempotency_key, query, raw, environ, actor)
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
            raise ApiError(400, INVALID_CONTENT_LENGTH) from None
        if length > self.settings.max_body_bytes:
            raise ApiError(413, BODY_TOO_LARGE)
        return environ["wsgi.input"].read(length) if length > 0 else b""

    def respond_once(self, found, url_args, company_id, idempotency_key, query, raw, environ,
                     actor=None):
        """A POST with an Idempotency-Key: done once across every process of the database. The
        key is first claimed in a transaction of its own, so that a duplicate arriving at any
        process meanwhile is told it is in progress; the response is then stored in the same
        transaction as the changes and replayed to any retry of the same request. A claim whose
        process is gone (see claimer_alive) is taken over by the next retry."""
        fingerprint = request_fingerprint(found.method, environ.get("PATH_INFO", ""), raw)
        expires = iso(int((time.time() + self.settings.idempotency_ttl) * 1000))
        with self.db.write() as conn:
            stored = claim_idempotency_key(conn, company_id, idempotency_key, fingerprint,
                                           expires)
        if stored is not None:
            return *stored, True
        try:
            with self.db.write() as conn:
                try:
                    with savepoint(conn):
                        call = Call(conn, company_id, query, parse_json_body(raw), self.settings,
                                    actor)
                        status = found.status
                        body = json_text(found.handler(call, **url_args)).encode()
                except ApiError as refusal:
                    status, body = refusal.status, json_text(refusal.body()).encode()
                store_idempotent_response(conn, company_id, idempotency_key, status, body)
                return status, body, False
        except BaseException:
            # Not done (a server error): let go of the key, so a retry runs the request.
            with self.db.write() as conn:
                release_idempotency_key(conn, company_id, idempotency_key)
            raise


def parse_idempotency_key(header):
    """None when absent; the key, bare or in the quoted form of the IETF draft."""
    if header is None:
        return None
    value = header.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not 1 <= len(value) <= MAX_IDEMPOTENCY_KEY or not all(32 <= ord(ch) < 127 for ch in value):
        raise ApiError(400, IDEMPOTENCY_KEY_INVALID)
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
    """A page's unexpected failure (the API's are logged where they are caught)."""
    log.error("%s %s failed\n%s", bottle.request.method, bottle.request.path,
              error.traceback or error.exception)
    bottle.response.content_type = "text/plain; charset=utf-8"
    return "Internal Server Error"


# ---------------------------------------------------------------------------------------------
# 14. OpenAPI
# ---------------------------------------------------------------------------------------------
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
    have more than two decimal places (400, VALIDATION_FAILED)."""
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
URL_SCHEMA = string_schema(1, MAX_URL, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[!-~]+$")
#: A URL a client sends: exactly what the service accepts.
URL_INPUT_SCHEMA = string_schema(
    1, MAX_URL, pattern=HTTP_URL_PATTERN,
    description=f"An http or https URL, at most {MAX_URL} characters, without credentials; the host "
                "a DNS name or an IPv6 address in brackets.")
TAX_RATE = {"type": "number", "minimum": 0, "maximum": MAX_TAX_RATE}
CREDIT_LIMIT = money_schema(MAX_CREDIT_LIMIT)
CUSTOMER_NAME = string_schema(1, MAX_CUSTOMER_NAME)
CUSTOMER_NOTES = string_schema(0, MAX_CUSTOMER_NOTES)
TRACKING_NUMBER = string_schema(*TRACKING_NUMBER_LENGTH)
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
    "notes": nullable(CUSTOMER_NOTES),
    "creditLimit": nullable(money_schema(MAX_CREDIT_LIMIT, exact=True)),
    "taxRateOverride": nullable(dict(TAX_RATE, description="null: the company's rate.")),
    "status": enum_schema(SETTABLE_CUSTOMER_STATUSES),
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
        "price": money_schema(money(MAX_AMOUNT_CENTS)),
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
        "number": TRACKING_NUMBER,
        "url": nullable(string_schema()),
    }),
    "Order": object_schema(_ORDER_FIELDS),
    "Customer": object_schema({
        "id": ID_SCHEMA,
        "email": string_schema(3, MAX_EMAIL),
        "name": nullable(CUSTOMER_NAME),
        "status": enum_schema(CUSTOMER_STATUSES),
        "notes": nullable(CUSTOMER_NOTES),
        "creditLimit": nullable(CREDIT_LIMIT),
        "taxRateOverride": nullable(TAX_RATE),
        "emailVerified": BOOLEAN,
        "createdAt": TIMESTAMP_SCHEMA,
        "updatedAt": TIMESTAMP_SCHEMA,
    }),
    "StockMovement": object_schema({
        "id": ID_SCHEMA,
        "productId": ID_SCHEMA,
        "change": dict(integer_schema(), description="Signed: units in (+) or out (-)."),
        "levelAfter": dict(integer_schema(), description="The product's stock once it was made."),
        "reason": enum_schema(MOVEMENT_REASONS),
        "orderId": nullable(ID_SCHEMA),
        "returnId": nullable(ID_SCHEMA),
        "note": nullable(string_schema(max_length=MAX_MOVEMENT_NOTE)),
        "actor": object_schema({"type": enum_schema(ACTOR_TYPES), "id": nullable(ID_SCHEMA)},
                               description="Who made it: staff, key and buyer carry their ID."),
        "createdAt": TIMESTAMP_SCHEMA,
    }),
    "Return": object_schema({
        "id": ID_SCHEMA,
        "orderId": ID_SCHEMA,
        "customerId": nullable(ID_SCHEMA),
        "status": enum_schema(RETURN_STATUSES),
        "reason": string_schema(*RETURN_REASON_LENGTH),
        "itemCount": integer_schema(1),
        "actor": nullable({"const": "staff"}),
        "createdAt": TIMESTAMP_SCHEMA,
        "updatedAt": TIMESTAMP_SCHEMA,
        "lines": {"type": "array", "description": "Empty for a return opened before its lines "
                                                  "were recorded (itemCount says how many).",
                  "items": object_schema({"orderItemId": ID_SCHEMA, "productId": ID_SCHEMA,
                                          "units": integer_schema(1, MAX_QUANTITY)})},
        "refund": nullable(object_schema({
            "id": ID_SCHEMA, "amount": money_schema(), "method": enum_schema(REFUND_METHODS),
            "breakdown": object_schema({"goodUnits": integer_schema(0),
                                        "damagedUnits": integer_schema(0),
                                        "subtotal": money_schema()}),
            "createdAt": TIMESTAMP_SCHEMA})),
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
        "number": string_schema(*TRACKING_NUMBER_LENGTH, pattern=r"\S[\s\S]+\S",
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
        "email": string_schema(3, MAX_EMAIL, format="email", description=(
            "Trimmed; unique within the company, ignoring case (409).")),
        **_CUSTOMER_INPUT,
    }, optional=tuple(_CUSTOMER_INPUT), closed=False),
    # email is left out rather than described as the schema `false`, which client generators
    # refuse; the description says what sending it does.
    "CustomerUpdate": object_schema(
        _CUSTOMER_INPUT, optional=tuple(_CUSTOMER_INPUT), closed=False,
        description="Only what changes; null clears name, notes, creditLimit and "
                    "taxRateOverride. Sending email is 400: it cannot be changed."),
    "WebhookCreate": object_schema(_WEBHOOK_INPUT, optional=("isActive",), closed=False),
    "WebhookUpdate": object_schema(_WEBHOOK_INPUT, optional=tuple(_WEBHOOK_INPUT),
                                   closed=False),
}


# 14.1 Event payloads -------------------------------------------------------------------------
# The `data` of each event, exactly as emit() is given it.

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
        object_schema({**_CUSTOMER_NAMES, "status": enum_schema(CUSTOMER_STATUSES),
                       "source": {"const": "api"}}),
        object_schema({**_CUSTOMER_NAMES, "storeSlug": string_schema(1),
                       "source": {"const": "storefront"}}),
    ]},
    "customer.updated": object_schema({
        **_CUSTOMER_NAMES, "status": enum_schema(CUSTOMER_STATUSES),
        "previousStatus": enum_schema(CUSTOMER_STATUSES),
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
        "stripeInvoiceId": string_schema(1),
        "amountPaid": dict(money_schema(), description=(
            "In the invoice's currency, as many decimals as its minor unit has: 49 for 49.00 "
            "usd, 1200 for 1200 jpy, 12.345 for 12.345 kwd.")),
        "currency": string_schema(pattern="^[a-z]{3}$"), "hostedInvoiceUrl": URL_SCHEMA,
        "number": string_schema(1), "periodStart": TIMESTAMP_SCHEMA,
        "periodEnd": TIMESTAMP_SCHEMA}),
    "return.created": object_schema({
        **_RETURN_NAMES, "itemCount": integer_schema(1), "reason": string_schema(*RETURN_REASON_LENGTH),
        "status": {"const": "REQUESTED"}, "actor": {"const": "staff"},
    }, optional=("actor",), description="actor: only when opened from the dashboard."),
    "return.approved": object_schema({**_RETURN_NAMES, "status": {"const": "APPROVED"}}),
    "refund.processed": object_schema({
        "id": ID_SCHEMA, "returnId": ID_SCHEMA, "orderId": ID_SCHEMA,
        "customerId": nullable(ID_SCHEMA), "amount": money_schema(),
        "method": enum_schema(REFUND_METHODS),
        "breakdown": object_schema({"goodUnits": integer_schema(0),
                                    "damagedUnits": integer_schema(0),
                                    "subtotal": money_schema()})}),
}


def event_schema_name(event):
    """order.status_changed: OrderStatusChangedPayload."""
    return "".join(word.capitalize() for word in re.split(r"[._]", event)) + "Payload"


# 14.2 Operations of the API ------------------------------------------------------------------

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
    # No minimum or maximum: the server clamps rather than refuses (101 is read as 100).
    # Any text is read (parseInt), so the parameter is an integer or any string.
    query_param("limit", {"anyOf": [integer_schema(), string_schema()],
                          "default": DEFAULT_PAGE_SIZE},
                f"Page size, clamped to 1 to {MAX_PAGE_SIZE} (0 or less is 1, more than "
                f"{MAX_PAGE_SIZE} is {MAX_PAGE_SIZE}). Read like JavaScript's parseInt (10abc "
                f"is 10); {DEFAULT_PAGE_SIZE} when it is not a number."),
    query_param("cursor", string_schema(),
                "nextCursor of the previous page; one that matches no record gives an empty "
                "last page."),
)
DATE_QUERY = string_schema(pattern=DATE_PATTERN)


def either(*messages):
    """The messages one status may carry, as the OpenAPI document lists them."""
    return " / ".join(messages)


_VALIDATION = either(INVALID_JSON, VALIDATION_FAILED)

OPERATIONS = {
    ("GET", "/api/v1/products"): api_operation(
        list_of("Product"), AUTH_ERRORS, description="Newest first.", query=(
            *PAGE_QUERY,
            query_param("category", string_schema(), "Exact match on category."),
            query_param("search", string_schema(),
                        "Substring of name, sku or category, ignoring case (Unicode folding)."),
            query_param("active", string_schema(),
                        "true or false: filter on isActive; another value is ignored."))),
    ("GET", "/api/v1/products/<product_id>"): api_operation(
        single("Product"), AUTH_ERRORS + (404,),
        messages={404: NOT_FOUND.format(resource="Product")}),
    ("GET", "/api/v1/orders"): api_operation(
        list_of("Order"), AUTH_ERRORS + (400,), query=(
            *PAGE_QUERY,
            query_param("status", enum_schema((*ORDER_STATUSES, "")),
                        "Exact match; empty is no filter."),
            query_param("customerId", string_schema(), "Orders of this customer only."),
            query_param("since", DATE_QUERY,
                        "createdAt >= since (inclusive): a date (UTC midnight), a year and "
                        "month, or an ISO 8601 date-time (UTC when it has no offset)."),
            query_param("until", DATE_QUERY, "createdAt <= until (inclusive), read as since.")),
        description="Newest first, each element the full Order (items and tracking included).",
        messages={400: either(INVALID_ORDER_STATUS, f"{VALIDATION_FAILED} (since, until)")}),
    ("GET", "/api/v1/orders/<order_id>"): api_operation(
        single("Order"), AUTH_ERRORS + (404,), messages={404: NOT_FOUND.format(resource="Order")}),
    ("POST", "/api/v1/orders"): api_operation(
        single("Order"), AUTH_ERRORS + BODY_ERRORS + (404, 409), body="OrderCreate",
        description="Checks the customer, then the products (active, of the company) and their "
                    "stock, and in the same transaction decrements the stock and stores the "
                    "order, SUBMITTED, at the catalog prices. Emits order.created.",
        messages={400: either(_VALIDATION, CUSTOMER_ID_REQUIRED, ITEMS_REQUIRED,
                              PRODUCT_ID_REQUIRED, QUANTITY_NOT_A_NUMBER, QUANTITY_NOT_WHOLE,
                              QUANTITY_TOO_SMALL, PRODUCT_UNAVAILABLE, INSUFFICIENT_STOCK),
                  404: NOT_FOUND.format(resource="Customer")}),
    ("PATCH", "/api/v1/orders/<order_id>"): api_operation(
        single("Order"), AUTH_ERRORS + BODY_ERRORS + (404, 422), body="OrderUpdate",
        description="Any status may follow any other, except after CANCELLED. Emits "
                    "order.status_changed, and order.shipped or order.cancelled.",
        messages={400: either(_VALIDATION, INVALID_ORDER_STATUS, TRACKING_ONLY_WHEN_SHIPPED,
                              TRACKING_URL_REQUIRED),
                  404: NOT_FOUND.format(resource="Order"), 422: ORDER_CANCELLED}),
    ("GET", "/api/v1/customers"): api_operation(
        list_of("Customer"), AUTH_ERRORS + (400,), description="Newest first.", query=(
            *PAGE_QUERY,
            query_param("status", enum_schema((*CUSTOMER_STATUSES, "")),
                        "Exact match; empty is no filter."),
            query_param("search", string_schema(),
                        "Substring of email or name, ignoring case (Unicode folding).")),
        messages={400: INVALID_STATUS}),
    ("GET", "/api/v1/customers/<customer_id>"): api_operation(
        single("Customer"), AUTH_ERRORS + (404,),
        messages={404: NOT_FOUND.format(resource="Customer")}),
    ("POST", "/api/v1/customers"): api_operation(
        single("Customer"), AUTH_ERRORS + BODY_ERRORS + (409,), body="CustomerCreate",
        description="emailVerified is false. Emits customer.created (source api).",
        messages={400: either(_VALIDATION, EMAIL_REQUIRED, INVALID_EMAIL, CREDIT_LIMIT_MESSAGE,
                              TAX_RATE_MESSAGE, INVALID_STATUS),
                  409: CUSTOMER_EXISTS}),
    ("PATCH", "/api/v1/customers/<customer_id>"): api_operation(
        single("Customer"), AUTH_ERRORS + BODY_ERRORS + (404,), body="CustomerUpdate",
        description="Emits customer.updated when something changed.",
        messages={400: either(_VALIDATION, CREDIT_LIMIT_MESSAGE, TAX_RATE_MESSAGE,
                              INVALID_STATUS),
                  404: NOT_FOUND.format(resource="Customer")}),
    ("GET", "/api/v1/inventory"): api_operation(
        list_of("StockMovement"), AUTH_ERRORS + (400,), query=(
            *PAGE_QUERY,
            query_param("productId", string_schema(), "Movements of this product only."),
            query_param("reason", enum_schema((*MOVEMENT_REASONS, "")),
                        "Exact match; empty is no filter."),
            query_param("since", DATE_QUERY, "createdAt >= since, read as the orders list "
                                             "reads it."),
            query_param("until", DATE_QUERY, "createdAt <= until, read as since.")),
        description="Every change of a product's stock, newest first: for each product the "
                    "sum of its movements' change is its stock.",
        messages={400: either(INVALID_MOVEMENT_REASON, f"{VALIDATION_FAILED} (since, until)")}),
    ("GET", "/api/v1/returns"): api_operation(
        list_of("Return"), AUTH_ERRORS + (400,), description="Newest first.", query=(
            *PAGE_QUERY,
            query_param("status", enum_schema((*RETURN_STATUSES, "")),
                        "Exact match; empty is no filter."),
            query_param("orderId", string_schema(), "Returns of this order only."),
            query_param("customerId", string_schema(), "Returns of this customer only.")),
        messages={400: INVALID_RETURN_STATUS}),
    ("GET", "/api/v1/returns/<return_id>"): api_operation(
        single("Return"), AUTH_ERRORS + (404,),
        messages={404: NOT_FOUND.format(resource="Return")}),
    ("GET", "/api/v1/webhooks"): api_operation(
        all_of("Webhook"), AUTH_ERRORS,
        description=f"Not paginated (at most {MAX_WEBHOOKS}). Never includes the secret."),
    ("GET", "/api/v1/webhooks/<webhook_id>"): api_operation(
        single("Webhook"), AUTH_ERRORS + (404,),
        messages={404: NOT_FOUND.format(resource="Webhook")}),
    ("POST", "/api/v1/webhooks"): api_operation(
        single("WebhookWithSecret"), AUTH_ERRORS + BODY_ERRORS + (409,), body="WebhookCreate",
        description="The only response that carries the secret.",
        messages={400: either(_VALIDATION, URL_REQUIRED, INVALID_URL, EVENTS_REQUIRED,
                              UNKNOWN_EVENT),
                  409: TOO_MANY_WEBHOOKS}),
    ("PATCH", "/api/v1/webhooks/<webhook_id>"): api_operation(
        single("Webhook"), AUTH_ERRORS + BODY_ERRORS + (404,), body="WebhookUpdate",
        messages={400: either(_VALIDATION, INVALID_URL, EVENTS_REQUIRED, UNKNOWN_EVENT),
                  404: NOT_FOUND.format(resource="Webhook")}),
    ("DELETE", "/api/v1/webhooks/<webhook_id>"): api_operation(
        single("WebhookDeleted"), AUTH_ERRORS + (404,),
        description="Also removes its delivery log and pending deliveries; no undo.",
        messages={404: NOT_FOUND.format(resource="Webhook")}),
}


# 14.3 Responses, headers and parameters every operation shares -------------------------------

ERROR_RESPONSES = {
    400: ("BadRequest", f"Malformed JSON, failed validation ({VALIDATION_FAILED} with details), "
                        "or a bad Content-Length or Idempotency-Key header."),
    401: ("Unauthorized", either(MISSING_AUTH, INVALID_KEY)),
    403: ("Forbidden", MISSING_SCOPE.format(scope="<scope>")),
    404: ("NotFound", "Not found: also a record of another company, a malformed ID, or an "
                      f"unknown path ({UNKNOWN_PATH})."),
    405: ("MethodNotAllowed", f"{METHOD_NOT_ALLOWED} (a known path, another method)"),
    409: ("Conflict", "Conflict."),
    413: ("ContentTooLarge", f"{BODY_TOO_LARGE} (over 1 MiB, refused before reading)"),
    422: ("UnprocessableContent", "Refused by a business rule."),
    429: ("TooManyRequests", f"{RATE_LIMITED} Per key, or per client address before "
                             "authentication; retryAfter is the Retry-After."),
}
_POST_MESSAGES = {
    400: IDEMPOTENCY_KEY_INVALID,
    409: either(IDEMPOTENCY_KEY_REUSED, IDEMPOTENCY_KEY_IN_PROGRESS),
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

API_DESCRIPTION = f"""\
A multi-tenant wholesale ordering service: products (read only), orders, customers, \
stock movements and returns (read only) and webhook subscriptions; the events it delivers \
are under `webhooks`.

Every operation but the two under `meta` needs `Authorization: Bearer <API key>`. The key \
belongs to one company, which every read and write is limited to (another company's records \
are 404), and must hold the operation's scope (`x-required-scope`).

Errors are JSON `{{"error": message}}`; failed validation adds `details` ([{{field, rule}}]) \
and 429 adds `retryAfter`. They are checked in this order: per-address rate limit, \
authentication (401), per-key rate limit (429), scope (403), body validation (400), \
existence (404), business rules (409, 422). Any unknown path is 404 \
`{{"error": "{UNKNOWN_PATH}"}}` and a known path with another method 405 \
`{{"error": "{METHOD_NOT_ALLOWED}"}}`. A server failure is 500 with the plain text \
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
                 {"name": "inventory"}, {"name": "returns"}, {"name": "webhooks"},
                 {"name": "meta"},
                 {"name": "events", "description": "Deliveries to webhook subscribers."}],
        "paths": paths,
        "webhooks": {event: _event_delivery(event) for event in EVENT_CATALOG},
        "components": {
            "schemas": schemas,
            "responses": {name: _error_response(status)
                          for status, (name, _) in ERROR_RESPONSES.items()},
            "parameters": {"IdempotencyKey": {
                "name": "Idempotency-Key", "in": "header", "required": False,
                "description": f"Makes a POST safe to retry. 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII "
                               "characters, bare or in double quotes. Within 24 hours a retry "
                               "with the same key and request gets the stored response "
                               "(Idempotent-Replayed: true) and nothing is done again; the "
                               "same key with another request is 409.",
                "schema": string_schema(1, MAX_IDEMPOTENCY_KEY,
                                        pattern=r"^[!-~]([ -~]*[!-~])?$")}},
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "An API key (sk_...). The scope each operation needs is in its "
                               f"x-required-scope: one of {', '.join(SCOPES)}."}},
        },
    }))


# ---------------------------------------------------------------------------------------------
# 15. Web pages
# ---------------------------------------------------------------------------------------------
# The kit every HTML surface shares: the page registry, forms and their fields, CSRF, the
# session cookie and the sign-in throttle, the security headers. A page is thin: it parses a
# form, calls the operation the API and the commands call (one rule, one place), and renders
# a template of Text and markup (4.1 to 4.4).

SESSION_COOKIE = "ordering_session"
#: A page's form body: at most this many bytes and fields (parts, for a file upload), checked
#: before anything parses it (a body of many tiny parts costs seconds to parse).
MAX_FORM_BYTES = 1024 * 1024
MAX_FORM_FIELDS = 1000
FORM_TOO_LARGE = (f"This form is larger than the server takes: at most "
                  f"{MAX_FORM_BYTES // 1024} KiB and {MAX_FORM_FIELDS} fields.")
#: A session's last_seen_at is written at most this often (seconds): not on every page.
SESSION_TOUCH_SECONDS = 60
CSRF_REFUSED = ("This form has expired or did not come from this site. Reload the page "
                "and try again.")
SECURITY_HEADERS = {
    # product images come from wherever the merchant keeps them, over https only
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self' https:; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


#: Form field each field-less message of the operations belongs to (a message with
#: {placeholders} matches whatever fills them).
FIELD_OF_MESSAGE = {
    EMAIL_REQUIRED: "email", INVALID_EMAIL: "email", STAFF_EMAIL_TAKEN: "email",
    CUSTOMER_EXISTS: "email",
    CREDIT_LIMIT_MESSAGE: "creditLimit", TAX_RATE_MESSAGE: "taxRateOverride",
    INVALID_STATUS: "status", INVALID_ORDER_STATUS: "status",
    CUSTOMER_ID_REQUIRED: "customerId", NOT_FOUND.format(resource="Customer"): "customerId",
    ITEMS_REQUIRED: "items", PRODUCT_ID_REQUIRED: "items",
    QUANTITY_NOT_A_NUMBER: "items", QUANTITY_NOT_WHOLE: "items",
    QUANTITY_TOO_SMALL: "items", QUANTITY_RULE: "items",
    TRACKING_URL_REQUIRED: "tracking.url",
    URL_REQUIRED: "url", INVALID_URL: "url",
    EVENTS_REQUIRED: "events", UNKNOWN_EVENT: "events",
    PRODUCT_UNAVAILABLE: "items", INSUFFICIENT_STOCK: "items", STORE_STOCK_SHORT: "items",
    MAIL_NAME_MESSAGE: "mailName", REPLY_TO_MESSAGE: "replyTo",
    STAFF_ALERTS_MESSAGE: "staffAlerts", STOREFRONT_APPROVAL_MESSAGE: "storefrontApproval",
    COMPANY_TAX_RATE_MESSAGE: "taxRate", TIME_ZONE_MESSAGE: "timeZone",
    TWO_STEP_MESSAGE: "twoStep",
    APPROVAL_LIMIT_MESSAGE: "approvalLimit", CONTACT_ROLE_MESSAGE: "role",
    CONTACT_STATUS_MESSAGE: "status",
}
_FILLED_MESSAGES = [(re.compile(".*".join(map(re.escape, re.split(r"\{\w+\}", message)))), field)
                    for message, field in FIELD_OF_MESSAGE.items() if "{" in message]


def form_errors(error):
    """{form field: message} for an operation's refusal, the API's own words, and for the
    other fields it refused at once (see Refusals): the first message of each field."""
    errors = {}
    for refusal in reversed([error, *error.others]):
        errors.update(field_errors(refusal))
    return errors


def field_errors(error):
    if error.details:
        return {detail["field"].split("[")[0]: detail["rule"]
                for detail in reversed(error.details)}
    field = FIELD_OF_MESSAGE.get(error.message)
    if field is None:
        field = next((field for pattern, field in _FILLED_MESSAGES
                      if pattern.fullmatch(error.message)), None)
    return {field or "form": error.message}


class Visit:
    """What a page gets: the signed-in account, the query and form, and what a refused form
    left behind to show again (errors by field, the values sent)."""

    def __init__(self, surface, session, token):
        self.surface = surface
        self.settings = surface.service.settings
        self.service = surface.service
        self.session = session
        self.company_id = session["company_id"]
        self.csrf = hmac.new(token.encode(), b"csrf", hashlib.sha256).hexdigest()
        query = bottle.request.query.decode()
        self.query = {name: query.get(name) for name in query}
        self.form = bottle.request.forms.decode() if bottle.request.method == "POST" else {}
        self.errors = {}
        self.kept = False  # a form shown again as it was sent, without errors
        self.shown = {}  # {field: (its ID, label)} of the messages shown beside fields
        self.notice = None
        self.id_suffix = ""

    @property
    def conn(self):
        return self.service.db.conn

    @property
    def actor(self):
        """The signed-in account, as the actor of the stock it moves."""
        return Actor(self.surface.accounts.actor, self.session["account_id"])

    def for_form(self, action, key):
        """This visit for one of several like forms on a page: its fields get IDs of their
        own, and only the form that was sent (to action) shows what was sent and refused."""
        view = copy.copy(self)
        view.id_suffix = "-" + key
        if bottle.request.path != action:
            view.errors, view.form = {}, {}
        return view

    def when(self, timestamp):
        """A timestamp in the signed-in account's company's time zone (time_tag)."""
        return time_tag(timestamp, self.session["time_zone"])

    def day(self, timestamp):
        """The day of a timestamp in the company's time zone (for when something began, not
        the books' days, which day_tag shows as they are)."""
        return day_tag(local_moment(timestamp, self.session["time_zone"]).date().isoformat())

    def csrf_matches(self):
        sent = str(self.form.get("csrf", "")).encode("utf-8", "replace")
        return hmac.compare_digest(sent, self.csrf.encode())

    def write(self):
        return self.service.db.write()

    @contextlib.contextmanager
    def proving_password(self, field):
        """A write transaction for a change the account's password (the form's field) must
        allow: a wrong one counts as a failed sign-in, and waits as one does, since a browser
        whose session was taken could otherwise guess the password at the page's speed."""
        subjects = self.surface.throttle_subjects(self.session["email"])
        now_ms = self.surface.now_ms()
        if (wait := sign_in_wait(self.conn, subjects, now_ms)) > 0:
            raise ApiError(429, SIGN_IN_THROTTLED.format(seconds=math.ceil(wait)))
        try:
            with self.write() as conn:
                yield conn
        except ApiError as error:
            if form_errors(error).get(field) == CURRENT_PASSWORD_WRONG:
                with self.write() as conn:
                    record_sign_in_failure(conn, subjects, now_ms)
            raise

    def filters(self):
        """The query parameters given a value (an empty one is no filter, as in the API)."""
        return {name: value for name, value in self.query.items() if value}

    def value(self, name, default=""):
        if (self.errors or self.kept) and name in self.form:
            return self.form.get(name)
        return "" if default is None else default

    def field(self, name, label, default="", kind="text", **attributes):
        field_id = name + self.id_suffix
        extra = join([render(ATTRIBUTE, name=key.replace("_", "-"), value=value)
                      for key, value in attributes.items()] + [self.invalid(name, field_id)])
        if kind == "textarea":
            control = render(TEXTAREA, id=field_id, name=name, extra=extra,
                             value=self.value(name, default))
        else:  # a refused form shows again what was sent, never a password
            control = render(INPUT, id=field_id, name=name, kind=kind, extra=extra,
                             value="" if kind == "password" else self.value(name, default))
        return render(FIELD, id=field_id, label=label, control=control,
                      error=self.error(name, field_id, label))

    def select(self, name, label, options, default="", **attributes):
        chosen, field_id = str(self.value(name, default)), name + self.id_suffix
        options = join(render(OPTION, value=value, text=text,
                              selected=SELECTED if str(value) == chosen else "")
                       for value, text in options)
        extra = join([render(ATTRIBUTE, name=key.replace("_", "-"), value=value)
                      for key, value in attributes.items()] + [self.invalid(name, field_id)])
        return render(FIELD, id=field_id, label=label, error=self.error(name, field_id, label),
                      control=render(SELECT, id=field_id, name=name, options=options,
                                     extra=extra))

    def radios(self, name, legend, options, default=""):
        """One choice of options [(value, text)], a radio button each, under legend."""
        chosen = str(self.value(name, default))
        return self.group(name, legend, join(
            render(RADIO, name=name, value=value, text=text, id=f"{name}-{index}",
                   checked=CHECKED if str(value) == chosen else "")
            for index, (value, text) in enumerate(options)))

    def checks(self, name, values, chosen):
        chosen = set(self.form.getall(name)) if self.errors and self.form else set(chosen)
        return render(CHECKS, name=name, invalid=self.invalid(name, name),
                      error=self.error(name, name, name), boxes=join(
            render(CHECK, name=name, value=value, checked=CHECKED if value in chosen else "")
            for value in values))

    def group(self, name, legend, fields):
        """fields under legend, refused together as name."""
        group_id = name + self.id_suffix
        return render(GROUP, id=group_id, legend=legend, fields=fields,
                      invalid=self.invalid(name, group_id),
                      error=self.error(name, group_id, legend))

    def error(self, name, field_id=None, label=None):
        """The message of a refused field, under it (field_id: its control's ID, which the
        control names with invalid(); label: how the page's summary names it)."""
        target = field_id or name + self.id_suffix + "-error"  # no control: the message
        field_id = field_id or name + self.id_suffix
        self.shown[name] = target, label
        message = self.errors.get(name)
        return render(FIELD_ERROR, id=field_id, message=message) if message else ""

    def invalid(self, name, field_id):
        """The attributes that mark a refused field's control and tie its message to it."""
        return render(FIELD_INVALID, id=field_id) if name in self.errors else ""

    def may_send(self, right):
        """Whether the signed-in account's role has this right (None: any account)."""
        return right is None or right in STAFF_RIGHTS[self.session["role"]]

    def form_tag(self, action, body, css="card", files=False):
        """A form that changes something (files: it may carry a file, as multipart); none for
        a role that may not send it."""
        if not self.may_send(form_right(action)):
            return ""
        return render(FORM, css=css, action=action, csrf=self.csrf, body=body,
                      enctype=MULTIPART if files else "")

    def button(self, action, text, css="", **hidden):
        fields = join(render(HIDDEN, name=name, value=value) for name, value in hidden.items())
        return self.form_tag(action, join([fields, render(BUTTON, css=css, text=text)]),
                             css="inline")

    def page(self, title, body, status=200):
        here = bottle.request.path
        links = join(render(NAV_LINK, href=href, text=text,
                            current=CURRENT if here.startswith(href) else "")
                     for text, href in self.surface.navigation_of(self))
        header = render(HEADER, company=self.session["company_name"], links=links,
                        email=self.session["email"], prefix=self.surface.prefix,
                        csrf=render(HIDDEN, name="csrf", value=self.csrf))
        message = self.notice or DONE.get(self.query.get("done"))
        notice = render(NOTICE, message=message) if message else ""
        if self.errors:
            notice = join([notice, self.error_summary()])
        bottle.response.status = status
        return render(LAYOUT, prefix=self.surface.prefix, title=title,
                      site=self.session["company_name"], header=header,
                      notice=notice, body=body)

    def error_summary(self):
        """Above a refused form: a message that belongs to no field the page shows, and a
        list of every field's message, each linked to its field."""
        elsewhere = [message for field, message in self.errors.items()
                     if field not in self.shown and field != "form"]
        message = self.errors.get("form") or " ".join(elsewhere)
        items = join(render(ERROR_SUMMARY_ITEM, id=field_id, label=label or name,
                            message=self.errors[name])
                     for name, (field_id, label) in self.shown.items() if name in self.errors)
        return join([render(FORM_ALERT, message="Not saved: " + message) if message else "",
                     render(ERROR_SUMMARY, items=items) if items else ""])

    def refusal(self, error):
        self.errors = {}  # the page says why alone, whatever a form sent before
        title = "Not found" if error.status == 404 else "Refused"
        # A query's bad value (a filter's date) is named with its rule: the generic message
        # alone would not say what to change.
        message = "; ".join(f"{detail['field']} {detail['rule']}" for detail in
                            error.details) + "." if error.details else error.message
        return self.page(title, render(ALERT, message=message), error.status)


#: What a page says once the form that led to it did its work (the redirect's ?done=KEY,
#: see redirect()): every change on the dashboard, and the store's orders and returns,
#: answer so, in their reader's words.
DONE = {
    "placed": "Thank you: your order is placed. A confirmation is on its way to your email "
              "address.",
    "returned": "Your return is requested. This page shows its progress.",
    "order": "Saved: the order is placed.",
    "status": "Saved: the order's status is changed (its history below says so).",
    "restocked": "Saved: its units are back in stock.",
    "return": "Saved: the return is opened; its next step is in the list below.",
    "approve": "Saved: the return is approved.",
    "receive": "Saved: the return is marked received.",
    "refund": "Saved: the refund is recorded.",
    "created": "Saved: it is created.",
    "saved": "Saved: the changes are in force.",
    "stock": "Saved: the movement is at the top of the list below.",
    "price": "Saved: the customer's price is set.",
    "price-cleared": "Saved: the catalog price applies to the customer again.",
    "ACTIVE": "Saved: the customer is active and may order at the store.",
    "BLOCKED": "Saved: the customer is blocked, and signed out everywhere.",
    "issued": "Invoiced: the buyer is emailed a link to this invoice.",
    "invoiced": "The order was invoiced already: this is its invoice.",
    "payment": "Saved: the payment is recorded.",
    "credit": "Saved: the credit is applied.",
    "void": "Saved: the invoice is void.",
    "webhook": "Saved: the webhook is switched.",
    "revoked": "Saved: the key is revoked; requests with it are refused from now on.",
    "again": "Saved: the email waits to be sent again.",
    "imported": "Saved: the file is imported.",
    "fitted": "Saved, raised to the least quantity the product is sold in (its line says how "
              "it is sold).",
    "requested": "Your order waits for approval: your business's admins are emailed, and this "
                 "page shows what they decide.",
    "approved": "Approved: the order is placed.",
    "declined": "Declined: the buyer is emailed your reason.",
    "invited": "Saved: unless the address has an account at this store already, an invitation "
               "to set a password is on its way to it.",
    "contact": "Saved: the contact's changes are in force.",
    "contact-added": "Saved: the contact is added and emailed an invitation to set a password.",
    "invite": "Saved: a link to set a password is on its way.",
    "added": "Added to your cart: its lines are below.",
    "nothing-added": "Nothing was added to your cart.",
    "link-sent": VERIFICATION_SENT,
    "link-not-sent": VERIFICATION_NOT_SENT,
    "role": "Saved: the staff member's role is changed; it applies at their next page.",
    "two-step-required": "The company requires two-step sign-in of its owners: set it up "
                         "below to open the other pages.",
    "two-step-off": "Saved: two-step sign-in is off; you sign in with your password alone.",
    "staff-invited": "Saved: the account is made, and an email with a link to set its "
                     "password is on its way.",
}


#: What the sign-in page says after a signed-out form led there (?done=KEY).
SIGNED_OUT_DONE = {"password-set": PASSWORD_SET}


def redirect(location, done=None):
    """303 to location; done: a key of DONE, which the page there says."""
    if done is not None:
        path, mark, fragment = location.partition("#")
        location = f"{path}{'&' if '?' in path else '?'}done={done}{mark}{fragment}"
    bottle.response.status = 303
    bottle.response.set_header("Location", location)
    return ""


#: (method, path, handler, the page a refused form is shown again on, the right of
#: STAFF_RIGHTS a dashboard form needs).
PAGES = []


def page(method, path, refused=None, right=None):
    def register(handler):
        PAGES.append((method, path, handler, refused, right))
        return handler
    return register


def form_right(action):
    """The right of STAFF_RIGHTS the form sent to action needs (None: none)."""
    for method, path, _, _, right in PAGES:
        if method == "POST" and re.fullmatch(re.sub(r"<\w+>", "[^/]+", path), action):
            return right
    return None


def uploaded_text(name, limit=MAX_QUICK_ORDER, too_long=QUICK_ORDER_TOO_LONG):
    """The text of the file uploaded as name (UTF-8, with or without a byte-order mark), or
    None without one. What cannot be limit characters is refused unread."""
    upload = bottle.request.files.get(name)
    if upload is None:
        return None
    data = upload.file.read(limit * 4 + 1)
    if len(data) > limit * 4:
        raise invalid(name, too_long)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise invalid(name, QUICK_ORDER_NOT_TEXT) from None
    if len(text) > limit:
        raise invalid(name, too_long)
    return text


def pager(visit, result, path):
    cursor = result["pagination"]["nextCursor"]
    if not cursor:
        return ""
    query = dict(visit.filters(), cursor=cursor)
    return render(NEXT_PAGE, path=path, query=urllib.parse.urlencode(query))


def listing(visit, title, noun, filter_fields, listed, result):
    """A list page: a button for a new record, the filters, the table and the next page."""
    path = bottle.request.path
    return visit.page(title, join([
        render(NEW_RECORD, path=path, noun=noun),
        render(FILTERS, path=path, fields=join(filter_fields), button="Filter"),
        listed, pager(visit, result, path)]))


def table(headings, rows, numeric=()):
    """A table of rows, each its cells or (a long list's, rendered from one template per row)
    its <tr> as Markup already."""
    head = join(render(HEADING_CELL, text=h, numeric=NUMERIC if h in numeric else "")
                for h in headings)
    body = join(row if isinstance(row, Markup) else render(ROW, cells=join(
        render(CELL, text=v, label=h, numeric=NUMERIC if h in numeric else "")
        for h, v in zip(headings, row))) for row in rows)
    if not rows:
        body = render(NO_ROWS, columns=len(headings))
    return render(TABLE, head=head, body=body)


def total_rows(total, rate, tax):
    """(label, amount) of the last rows of a table of lines: the total; or, where tax is
    charged, the subtotal, the tax at its rate and the total due (cents)."""
    if not rate and not tax:
        return [(render(TOTAL_CELL, text="Total"), render(TOTAL_CELL, text=cents_text(total)))]
    return [("Subtotal", cents_text(total)), (f"Tax ({rate_text(rate)})", cents_text(tax)),
            (render(TOTAL_CELL, text="Total due"),
             render(TOTAL_CELL, text=cents_text(total + tax)))]


def placed_by_text(conn, order):
    """Who placed an order (a row) and who approved it, as both surfaces say it."""
    placed, approved = order_people(conn, order)
    if approved:
        return f"{placed}, approved by {approved}"
    return placed or "not recorded"


def contacts_table(visit, contacts, path):
    """A customer's contacts; each one's email leads to its page at path/{id}."""
    return table(("Email", "Name", "Role", "Status", "Approval limit", "Confirmed"), [
        (link(f"{path}/{row['id']}", row["email"]), row["name"] or "", row["role"],
         status_tag(row["status"]), amount_text(money(row["approval_limit_cents"])),
         "Yes" if row["email_verified"] else "Not yet") for row in contacts],
        numeric=("Approval limit",))


def contact_fields(visit, contact, email=False):
    """A contact's form fields (email too, for a new one)."""
    limit = contact.get("approval_limit_cents")
    return join([
        visit.field("email", "Email", kind="email", required="required") if email else "",
        render(GRID, cells=join([
            visit.field("name", "Name", contact.get("name")),
            visit.select("role", "Role", [(r, r) for r in CONTACT_ROLES],
                         contact.get("role", "buyer")),
            visit.field("approvalLimit", "Approval limit (buyers; empty: none)",
                        "" if limit is None else decimal_text(limit), inputmode="decimal"),
            "" if email else visit.select("status", "Status", [(s, s) for s in
                                                               SETTABLE_CUSTOMER_STATUSES],
                                          contact.get("status"))]))])


def contact_body(form):
    """A contact's form as the operations' body (an emptied limit clears it)."""
    body = {"name": form_text(form, "name"), "role": form.get("role"),
            "approvalLimit": form_number(form, "approvalLimit")}
    for name in ("email", "status"):
        if name in form:
            body[name] = form.get(name)
    return body


def invoice_document(visit, invoice, order_href):
    """An invoice (a row) as it prints, on the dashboard and in the store; order_href: where
    its order number leads."""
    conn, company_id = visit.conn, invoice["company_id"]
    order = load_order(conn, company_id, invoice["order_id"])
    customer = invoice["customer_id"] and load_customer(conn, company_id, invoice["customer_id"])
    return render(
        INVOICE_DOCUMENT, seller=load_company(conn, company_id)["name"],
        number=invoice["number"], status=status_tag(invoice["status"]),
        buyer=f"{customer['name'] or ''} <{customer['email']}>" if customer else "none",
        ship_to=address_lines(shipping_address_of(order)) if order["shipping_address"] else
        "none given",
        issued=day_tag(invoice["issued_at"]), due=day_tag(invoice["due_at"]),
        terms=terms_text(invoice["terms_days"]), order=link(order_href, order["number"]),
        po=order["po_number"] or "none", lines=invoice_lines_table(conn, invoice),
        paid=cents_text(invoice["paid_cents"]),
        credited=cents_text(invoice["credited_cents"]), balance=cents_text(
            balance_cents(invoice)))


def invoice_lines_table(conn, invoice):
    return table(("Product", "SKU", "Quantity", "Unit price", "Line total"),
                 [(item["productName"], item["productSku"] or "", item["quantity"],
                   amount_text(item["unitPrice"]), cents_text(line_total_cents(item)))
                  for item in invoice_lines(conn, invoice)] +
                 [("", "", "", label, amount) for label, amount in total_rows(
                     invoice["subtotal_cents"], invoice["tax_rate"], invoice["tax_cents"])],
                 numeric=("Quantity", "Unit price", "Line total"))


#: How a statement names each kind of line.
STATEMENT_KINDS = {"INVOICE": "Invoice", "PAYMENT": "Payment", "CREDIT_NOTE": "Credit note"}


def statement_since(visit):
    """The start of the statement's period that the query asks for (since, a date; empty: the
    whole history, None): by default the day STATEMENT_DAYS before today."""
    if "since" not in visit.query:
        return iso(visit.surface.now_ms() - STATEMENT_DAYS * DAY_MS)[:10] + "T00:00:00.000Z"
    bound = date_filter(visit.query, "since")
    return bound and bound[:10] + "T00:00:00.000Z"


def statement_section(visit, customer_id, path, invoice_path):
    """A customer's statement of the period the query asks for, with the form that asks."""
    since = statement_since(visit)
    return join([render(FILTERS, path=path, fields=visit.field(
        "since", "From", (since or "")[:10], kind="date"), button="Show"),
        render(PARAGRAPH, text=link(path + "?since=", "The whole history")),
        statement_table(statement(visit.conn, visit.company_id, customer_id, since),
                        invoice_path)])


def statement_table(account, invoice_path):
    """A statement (statement()): its opening balance (of a period), its lines by date, each
    invoice's and payment's linked to the invoice (invoice_path and its ID), and the balance
    under them."""
    rows = [(day_tag(account["since"]), "", render(TOTAL_CELL, text="Opening balance"), "",
             render(TOTAL_CELL, text=amount_text(account["opening"])))
            ] if "since" in account else []
    rows += [(day_tag(line["date"]), STATEMENT_KINDS[line["kind"]],
              link(invoice_path + line["invoiceId"], line["reference"]) if line["invoiceId"]
              else line["reference"], amount_text(line["amount"]), amount_text(line["balance"]))
             for line in account["lines"]]
    rows.append(("", "", render(TOTAL_CELL, text="Balance"), "",
                 render(TOTAL_CELL, text=amount_text(account["balance"]))))
    return table(("Date", "Kind", "Reference", "Amount", "Balance"), rows,
                 numeric=("Amount", "Balance"))


def address_lines(address):
    """A shipping address's fields that are filled, a line each."""
    return Markup(LINE_BREAK.join(escape(country_text(address, name))
                                  for name, *_ in ADDRESS_FIELDS if address[name]))


def country_text(address, name):
    """A field of an address as a reader reads it: a country's code by its name."""
    value = address[name]
    return COUNTRIES.get(value, value) if name == "country" else value


def form_units(form, prefix):
    """{order item ID: units} of a return form's fields prefix + item ID (none: 0 or empty)."""
    units = {name[len(prefix):]: form_int(form, name, required=False)
             for name in form if name.startswith(prefix)}
    return {item_id: count for item_id, count in units.items() if count}


def link(href, text):
    return render(LINK, href=href, text=text)


def status_tag(status):
    return render(STATUS_TAG, style=status, text=status)


def time_tag(timestamp, zone):
    """A timestamp as every page shows one: in the company's time zone (zone, an IANA name),
    the exact UTC time on hover; nothing for none."""
    if not timestamp:
        return ""
    return render(TIME_TAG, at=timestamp, exact=exact_time_text(timestamp),
                  text=local_time_text(timestamp, zone))


def day_tag(day):
    """A calendar day (or the UTC day of a timestamp) as every page shows one."""
    return render(DAY_TAG, day=day[:10], text=day_text(day)) if day else ""


def form_int(form, field, required=True):
    text = (form.get(field) or "").strip()
    if not text and not required:
        return None
    if not re.fullmatch(r"-?\d{1,18}", text):
        raise invalid(field, "must be a whole number")
    return int(text)


def form_amount(form, field, required=True):
    text = (form.get(field) or "").strip()
    if not text and not required:
        return None
    cents = cents_from_text(text)
    if cents is None:
        raise invalid(field, "must be an amount such as 12.50")
    return cents


def form_number(form, field):
    """A form's number as the API's JSON would carry it (a fraction keeps its text, so money
    is read exactly, as from a body): empty is null, and what is not a number stays text, for
    the operation to refuse in its own words."""
    text = (form.get(field) or "").strip()
    if not text:
        return None
    for kind in (int, JsonFloat):
        try:
            value = kind(text)
        except ValueError:
            continue
        return value if math.isfinite(value) else text
    return text


def form_text(form, field):
    return (form.get(field) or "").strip() or None


class Surface:
    """One HTML surface of the app: the pages of PAGES under its prefix, the kind of accounts
    that sign in to it (at prefix/sign-in, out at prefix/sign-out), and their sessions in a
    cookie of its own, scoped to its path. clock() gives the time sessions and the sign-in
    throttle go by (tests move it)."""

    def __init__(self, service, prefix, cookie, accounts, home, navigation):
        self.service = service
        self.prefix = prefix
        self.cookie = cookie
        self.form_cookie = cookie + "_form"
        self.accounts = accounts
        self.home = home
        self.navigation = navigation
        self.clock = time.time

    def install(self, app):
        def bind(handler, refused, right):
            return lambda **url_args: self.serve(handler, refused, url_args, right)
        for method, path, handler, refused, right in PAGES:
            if path.startswith(self.prefix + "/"):
                app.route(path, method, bind(handler, refused, right))
        app.route(self.prefix + "/style.css", "GET", self.stylesheet)
        for method, path, callback in self.signed_out_routes() + [
                ("GET", "/sign-in/code", self.code_step_page),
                ("GET", "/invite/<token>", self.new_password_page),
                ("POST", "/sign-in/code", self.sign_in_with_code)]:
            app.route(self.prefix + path, method, callback)
        app.route(self.prefix, "GET", lambda: redirect(self.home))

    def signed_out_routes(self):
        """(method, path under the prefix, callback) of the pages a visitor who is not signed
        in may open: the way in and out, and a forgotten password's."""
        return [("GET", "/sign-in", lambda: self.sign_in_page()), ("POST", "/sign-in", self.sign_in),
                ("POST", "/sign-out", self.sign_out), ("GET", "/signed-out", self.signed_out_page),
                ("GET", "/reset", lambda: self.reset_page()), ("POST", "/reset", self.request_reset),
                ("GET", "/check-email", self.check_email_page),
                ("GET", "/reset/<token>", self.new_password_page),
                ("POST", "/reset/<token>", self.new_password)]

    def now_ms(self):
        return int(self.clock() * 1000)

    def navigation_of(self, visit):
        """(text, path) of the header's links for this visit."""
        return self.navigation

    def secure_request(self, environ):
        if self.service.settings.trust_proxy and environ.get("HTTP_X_FORWARDED_PROTO"):
            return environ["HTTP_X_FORWARDED_PROTO"].split(",")[0].strip().lower() == "https"
        return environ.get("wsgi.url_scheme") == "https"

    def set_session_cookie(self, token, **expiry):
        """A browser-session cookie: the server ends idle sessions, the browser need not."""
        bottle.response.set_cookie(
            self.cookie, token, path=self.prefix, httponly=True, samesite="lax",
            secure=self.secure_request(bottle.request.environ), **expiry)

    def session(self):
        """(session row, token) of the signed-in browser, or (None, None); an idle session
        ends here."""
        token = bottle.request.get_cookie(self.cookie)
        found = token and load_session(self.service.db.conn, self.accounts, token)
        if not found:
            return None, None
        now_ms = self.now_ms()
        if self.session_ended(found, now_ms):
            with self.service.db.write() as conn:
                end_session(conn, self.accounts, found["token_hash"])
            return None, None
        if found["last_seen_at"] < iso(now_ms - SESSION_TOUCH_SECONDS * 1000):
            with self.service.db.write() as conn:
                touch_session(conn, self.accounts, found["token_hash"], now_ms)
        return found, token

    def session_ended(self, found, now_ms):
        """Whether a session has been idle, or has lived, longer than a session may."""
        settings = self.service.settings
        return (found["last_seen_at"] < iso(now_ms - settings.session_idle_seconds * 1000)
                or found["created_at"] < iso(now_ms - settings.session_max_seconds * 1000))

    def headers(self, content_type="text/html; charset=utf-8"):
        for name, value in SECURITY_HEADERS.items():
            bottle.response.set_header(name, value)
        bottle.response.content_type = content_type

    def serve(self, handler, refused, url_args, right=None):
        self.headers()
        found, token = self.session()
        if found is None:
            if bottle.request.method == "POST":
                return self.public_page("Signed out", render(SIGNED_OUT, prefix=self.prefix),
                                        403)
            return redirect(self.prefix + "/sign-in")
        visit = Visit(self, found, token)
        if (stopped := self.stopped(visit, right)) is not None:
            return stopped
        try:
            return handler(visit, **url_args)
        except ApiError as error:
            if refused is None:
                return visit.refusal(error)
            return self.show_again(visit, refused, url_args, error)

    def stopped(self, visit, right):
        """The answer to a visit that may not go on, or None: a form without this browser's
        token, one its role may not send (right), or any page but the account's for an owner
        who must set up two-step sign-in first."""
        posted = bottle.request.method == "POST"
        if posted and not visit.csrf_matches():
            return visit.page("Refused", render(ALERT, message=CSRF_REFUSED), 403)
        if self.must_set_up_two_step(visit.session) and not bottle.request.path.startswith(
                self.prefix + "/account"):
            return redirect(self.prefix + "/account", "two-step-required")
        if posted and not visit.may_send(right):
            return visit.page("Refused", render(ALERT, message=STAFF_ROLE_REFUSED), 403)
        return None

    @staticmethod
    def show_again(visit, refused, url_args, error):
        """The page a refused form was sent from (refused), again: what was sent, and why
        it was refused, beside each field."""
        visit.errors = form_errors(error)
        takes = refused.__code__.co_varnames[1:refused.__code__.co_argcount]
        try:
            body = refused(visit, **{k: v for k, v in url_args.items() if k in takes})
        except ApiError as missing:
            return visit.refusal(missing)
        bottle.response.status = error.status
        return body

    def site(self):
        """Whose pages these are, as their titles end."""
        return "ordering"

    def account_company(self):
        """The one company whose accounts sign in here (None: any)."""
        return None

    def public_page(self, title, body, status=200, notice=""):
        """A page for a visitor who may not be signed in."""
        self.headers()
        bottle.response.status = status
        return render(BARE_LAYOUT, prefix=self.prefix, title=title, site=self.site(),
                      notice=notice, body=body)

    def form_page(self, title, action, fields, button, errors=None, status=200, after="",
                  notice=""):
        """A signed-out form: its fields as (name, label, kind, autocomplete, value), each
        message next to its field."""
        errors = errors or {}
        controls = join(render(
            SIGNED_OUT_FIELD, name=name, label=label, kind=kind, auto=auto, value=value,
            invalid=render(FIELD_INVALID, id=name) if name in errors else "",
            error=render(FIELD_ERROR, id=name, message=errors[name]) if name in errors else "")
            for name, label, kind, auto, value in fields)
        notice = render(NOTICE, message=notice) if notice else ""
        if "form" in errors:
            notice = render(FORM_ALERT, message=errors["form"])
        elif errors:
            notice = render(ERROR_SUMMARY, items=join(
                render(ERROR_SUMMARY_ITEM, id=name, label=label, message=errors[name])
                for name, label, *_ in fields if name in errors))
        form = render(FORM, css="card narrow", action=action, enctype="", csrf=self.form_token(),
                      body=join([controls, render(SUBMIT, text=button)]))
        return self.public_page(title, join([form, after]), status, notice)

    def sign_in_page(self, error="", email="", notice=""):
        """The sign-in form; notice (or the query's ?done=, a key of SIGNED_OUT_DONE) says
        what a signed-out form did."""
        notice = notice or SIGNED_OUT_DONE.get(bottle.request.query.get("done"), "")
        return self.form_page("Sign in", self.prefix + "/sign-in", (
            ("email", "Email", "email", "username", email),
            ("password", "Password", "password", "current-password", "")), "Sign in",
            {"form": error} if error else None, bottle.response.status_code,
            self.sign_in_links(), notice)

    def sign_in_links(self):
        return render(SIGN_IN_LINKS, prefix=self.prefix)

    def throttle_subjects(self, email):
        """The sign-in throttle's subjects of this email from this browser's address (see
        sign_in_subjects), which every check of an account's password counts against."""
        address = self.service.client_address(bottle.request.environ)
        company_id = self.account_company()
        return sign_in_subjects(email, address, f"{company_id} " if company_id else "")

    def form_token(self):
        """The CSRF token of a signed-out form: an HMAC of a random cookie of the browser's,
        set with the first form, so that no other site can send the form in its name."""
        secret = (bottle.request.get_cookie(self.form_cookie)
                  or bottle.request.environ.get("ordering.form_secret"))
        if not secret:
            secret = bottle.request.environ["ordering.form_secret"] = secrets.token_urlsafe(32)
            bottle.response.set_cookie(
                self.form_cookie, secret, path=self.prefix, httponly=True, samesite="lax",
                secure=self.secure_request(bottle.request.environ))
        return hmac.new(secret.encode(), b"signed-out form", hashlib.sha256).hexdigest()

    def form_matches(self):
        secret = bottle.request.get_cookie(self.form_cookie)
        sent = str(bottle.request.forms.get("csrf", "")).encode("utf-8", "replace")
        return bool(secret) and hmac.compare_digest(sent, self.form_token().encode())

    def refused_form(self):
        return self.public_page("Refused", render(ALERT, message=CSRF_REFUSED), 403)

    def address_allowed(self):
        """Registrations and reset requests of this client address within its share of the
        per-address limit (ip_rate_limit; 0 is off)."""
        limit = self.service.settings.ip_rate_limit
        if limit <= 0:
            return True
        address = self.service.client_address(bottle.request.environ)
        allowed, _, reset = self.service.windows.hit(
            "signed-out " + address, max(1, limit // SIGNED_OUT_FORMS_SHARE), self.clock())
        if not allowed:
            bottle.response.set_header("Retry-After", str(math.ceil(reset)))
        return allowed

    def too_many(self, title):
        return self.public_page(title, render(ALERT, message=RATE_LIMITED_PAGE), 429)

    def reset_page(self, error=""):
        return self.form_page("Set a password", self.prefix + "/reset", (
            ("email", "Email", "email", "username", ""),), "Email me a link",
            {"form": error} if error else None, bottle.response.status_code)

    def request_reset(self):
        if not self.form_matches():
            return self.refused_form()
        if not self.address_allowed():
            return self.too_many("Set a password")
        email = (bottle.request.forms.decode().get("email") or "").strip()
        with self.service.db.write() as conn:
            self.send_reset_link(conn, email, self.now_ms())
        return redirect(self.prefix + "/check-email?sent=reset")

    def check_email_page(self):
        """Where a signed-out form that emails a link leads (?sent= names which form)."""
        if bottle.request.query.get("sent") == "register":
            return self.public_page("Check your email", render(
                MAIL_SENT, what="with a link to confirm it (or, if it has an account here "
                "already, to sign in)", then=self.after_registration()))
        return self.public_page("Check your email", render(
            MAIL_SENT, what="with a link that sets your password, if it has an account here",
            then=render(BACK_TO_SIGN_IN, prefix=self.prefix)))

    def new_password_page(self, token, errors=None, status=200):
        if errors is None:
            try:
                self.password_link(self.service.db.conn, token, self.now_ms())
            except ApiError as error:
                bottle.response.status = error.status
                return self.reset_page(error.message)
        return self.form_page("Choose a password", f"{self.prefix}/reset/{token}", (
            ("password", f"New password (at least {PASSWORD_MIN} characters)", "password",
             "new-password", ""),), "Set password", errors, status)

    def new_password(self, token):
        if not self.form_matches():
            return self.refused_form()
        password = bottle.request.forms.decode().get("password", "")
        try:
            with self.service.db.write() as conn:
                self.set_password_by_link(conn, token, password, self.now_ms())
        except ApiError as error:
            if error.message == LINK_EXPIRED:
                bottle.response.status = error.status
                return self.reset_page(error.message)
            return self.new_password_page(token, form_errors(error), error.status)
        self.set_session_cookie("", max_age=0)
        return redirect(self.prefix + "/sign-in?done=password-set")

    # The staff's links; the storefront's are its contacts'.

    def send_reset_link(self, conn, email, now_ms):
        request_staff_password_reset(conn, email, now_ms)

    def password_link(self, conn, token, now_ms):
        return staff_link(conn, token, now_ms)

    def set_password_by_link(self, conn, token, password, now_ms):
        reset_staff_password(conn, token, password, now_ms)

    def after_registration(self):
        return ""

    def sign_in(self):
        if not self.form_matches():  # no other site may sign a browser in to its account
            return self.refused_form()
        form = bottle.request.forms.decode()
        email, password = form.get("email", ""), form.get("password", "")
        subjects, db, now_ms = self.throttle_subjects(email), self.service.db, self.now_ms()
        if (wait := sign_in_wait(db.conn, subjects, now_ms)) > 0:
            return self.throttled(wait, lambda error: self.sign_in_page(error, email))
        account = find_account(db.conn, self.accounts, email, password, self.account_company())
        step = self.second_step_needed(account)
        with db.write() as conn:
            token = begin_sign_in(conn, self.accounts, account, subjects, now_ms,
                                  self.service.settings.session_idle_seconds, step)
        if account is None:
            bottle.response.status = 401
            return self.sign_in_page(SIGN_IN_REFUSED, email)
        (self.set_step_cookie if step else self.set_session_cookie)(token)
        return redirect(self.prefix + "/sign-in/code" if step else self.home)

    def second_step_needed(self, account):
        """Whether a sign-in of this account (None: none) waits for a code (staff who set
        one up)."""
        return account is not None and account["totp_secret"] is not None

    @staticmethod
    def must_set_up_two_step(session):
        """An owner without two-step sign-in in a company that requires it of owners: such
        a session opens only the account page, where it is set up."""
        return (session["role"] == "owner" and session["two_step"] == "owners"
                and not session["two_step_on"])

    step_cookie = property(lambda self: self.cookie + "_step")

    def set_step_cookie(self, token, **expiry):
        bottle.response.set_cookie(
            self.step_cookie, token, path=self.prefix + "/sign-in", httponly=True,
            samesite="lax", secure=self.secure_request(bottle.request.environ), **expiry)

    def code_page(self, error=""):
        return self.form_page("Sign in: your code", self.prefix + "/sign-in/code", (
            ("code", "Code from your authenticator app (or a recovery code)", "text",
             "one-time-code", ""),), "Sign in", {"form": error} if error else None,
            bottle.response.status_code, render(SIGN_IN_LINKS, prefix=self.prefix))

    def code_step_page(self):
        """The code's form, while a sign-in waits for one; the sign-in form otherwise."""
        if sign_in_step(self.service.db.conn, bottle.request.get_cookie(self.step_cookie),
                        self.now_ms()) is None:
            return redirect(self.prefix + "/sign-in")
        return self.code_page()

    def sign_in_with_code(self):
        if not self.form_matches():
            return self.refused_form()
        db, token, now_ms = self.service.db, bottle.request.get_cookie(self.step_cookie), self.now_ms()
        if (staff := sign_in_step(db.conn, token, now_ms)) is None:
            bottle.response.status = 400
            return self.sign_in_page(SIGN_IN_STEP_EXPIRED)
        subjects = self.throttle_subjects(staff["email"])
        if (wait := sign_in_wait(db.conn, subjects, now_ms)) > 0:
            return self.throttled(wait, self.code_page)
        with db.write() as conn:
            session = finish_sign_in(conn, staff, token, bottle.request.forms.get("code"),
                                     subjects, now_ms, self.service.settings.session_idle_seconds)
        if session is None:
            bottle.response.status = 401
            return self.code_page(SIGN_IN_CODE_REFUSED)
        self.set_step_cookie("", max_age=0)
        self.set_session_cookie(session)
        return redirect(self.home)

    def throttled(self, wait, form):
        """A sign-in's form (form: the page that shows it with an error), refused for wait
        seconds more."""
        bottle.response.status = 429
        bottle.response.set_header("Retry-After", str(math.ceil(wait)))
        return form(SIGN_IN_THROTTLED.format(seconds=math.ceil(wait)))

    def start_session(self, account):
        """A new session for this browser (after its old ones ended, at a password change)."""
        address = self.service.client_address(bottle.request.environ)
        with self.service.db.write() as conn:
            token = start_session(conn, self.accounts, account,
                                  sign_in_subjects(account["email"], address, "-"),
                                  self.now_ms(), self.service.settings.session_idle_seconds)
        self.set_session_cookie(token)

    def sign_out(self):
        found, token = self.session()
        if found is not None:
            visit = Visit(self, found, token)
            if not visit.csrf_matches():
                self.headers()
                return visit.page("Refused", render(ALERT, message=CSRF_REFUSED), 403)
            with self.service.db.write() as conn:
                end_session(conn, self.accounts, found["token_hash"])
        self.set_session_cookie("", max_age=0)
        return redirect(self.prefix + "/signed-out")

    def signed_out_page(self):
        return self.public_page("Signed out", render(SIGNED_OUT_BY_YOU, prefix=self.prefix))

    def stylesheet(self):
        self.headers("text/css; charset=utf-8")
        bottle.response.set_header("Cache-Control", "max-age=3600")
        return STYLESHEET


#: The autocomplete token of each of a shipping address's fields (HTML's autofill names).
ADDRESS_AUTOCOMPLETE = {
    "name": "shipping name", "line1": "shipping address-line1",
    "line2": "shipping address-line2", "city": "shipping address-level2",
    "region": "shipping address-level1", "postalCode": "shipping postal-code",
    "country": "shipping country"}


def address_controls(visit):
    """A new shipping address's fields, each with its autofill token; the country a list."""
    return join(
        visit.select(name, label, [("", "Choose a country")] + list(COUNTRIES.items()),
                     autocomplete=ADDRESS_AUTOCOMPLETE[name]) if name == "country" else
        visit.field(name, label if required else label + " (optional)", maxlength=longest,
                    autocomplete=ADDRESS_AUTOCOMPLETE[name])
        for name, label, longest, required in ADDRESS_FIELDS)


# 15.1 Dashboard ------------------------------------------------------------------------------
# The staff's pages, under /dashboard on the same app.

NAVIGATION = (("Orders", "/dashboard/orders"), ("Products", "/dashboard/products"),
              ("Customers", "/dashboard/customers"), ("Returns", "/dashboard/returns"),
              ("Receivables", "/dashboard/receivables"),
              ("Spreadsheets", "/dashboard/spreadsheets"), ("Webhooks", "/dashboard/webhooks"), ("API keys", "/dashboard/keys"),
              ("Billing", "/dashboard/billing"), ("Emails", "/dashboard/emails"),
              ("Staff", "/dashboard/staff"), ("Settings", "/dashboard/settings"))


@page("GET", "/dashboard/orders")
def orders_page(visit):
    query = visit.filters()
    result = find_orders(visit.conn, visit.company_id, query, query.get("search"))
    customers = customer_emails(visit.conn, visit.company_id,
                                [row["customer_id"] for row in result["data"]])
    rows = [(link(f"/dashboard/orders/{row['id']}", row["number"]), visit.when(row["created_at"]),
             customers.get(row["customer_id"], ""), row["po_number"] or "",
             status_tag(row["status"]), cents_text(row["total_cents"] + row["tax_cents"]))
            for row in result["data"]]
    statuses = [("", "Any status")] + [(s, s) for s in ORDER_STATUSES]
    choices = [("", "Any customer")] + customer_choices(visit.conn, visit.company_id)
    return listing(visit, "Orders", "order", [
        visit.field("search", "Order number, ID or start of PO number", query.get("search", "")),
        visit.select("status", "Status", statuses, query.get("status", "")),
        visit.select("customerId", "Customer", choices, query.get("customerId", "")),
        visit.field("since", "Created from", query.get("since", ""), kind="date"),
        visit.field("until", "Created until", query.get("until", ""), kind="date")],
        join([pending_requests_table(visit), table(
            ("Order", "Created", "Customer", "PO number", "Status", "Total"), rows,
            numeric=("Total",))]), result)


#: The lines a new order's form starts with; its "Add a line" button adds one at a time.
LINES_ON_NEW_ORDER = 3


def new_order_lines(visit):
    """How many lines the new order's form has: as many as it was sent with (one more after
    "Add a line"), within the API's limit."""
    sent = visit.form.get("lineCount", "") if visit.form else ""
    count = int(sent) if sent.isdigit() else LINES_ON_NEW_ORDER
    return max(1, min(count + (visit.form.get("addLine") == "yes"), MAX_ORDER_LINES))


@page("GET", "/dashboard/orders/new")
def new_order_page(visit):
    customers = [("", "Choose a customer")] + customer_choices(visit.conn, visit.company_id)
    products = [("", "(none)")] + [
        (product_id, f"{name} ({sku or '-'}, stock {stock})")
        for product_id, name, sku, stock in product_choices(visit.conn, visit.company_id)]
    count = new_order_lines(visit)
    lines = join(render(GRID, cells=join([
        visit.select(f"productId{n}", f"Product {n + 1}", products),
        visit.field(f"quantity{n}", "Quantity", "1" if n == 0 else "", kind="number", min="1")]))
        for n in range(count))
    return visit.page("New order", visit.form_tag("/dashboard/orders", render(
        NEW_ORDER, customer=visit.select("customerId", "Customer", customers), lines=lines,
        count=count, error=visit.error("items"), address=address_controls(visit),
        po=visit.field("poNumber", "PO number"),
        notes=visit.field("notes", "Notes", kind="textarea"))))


@page("POST", "/dashboard/orders", refused=new_order_page, right="work")
def create_order_action(visit):
    if visit.form.get("addLine") == "yes":  # the same form, one line longer, as it was typed
        visit.kept = True
        return new_order_page(visit)
    items = [{"productId": visit.form[f"productId{n}"],
              "quantity": form_number(visit.form, f"quantity{n}")}
             for n in range(new_order_lines(visit)) if visit.form.get(f"productId{n}")]
    with visit.write() as conn:
        order = staff_order(conn, visit.company_id, visit.form.get("customerId"), items,
                            visit.form, form_text(visit.form, "poNumber"),
                            form_text(visit.form, "notes"), visit.actor,
                            visit.session["account_id"])
    return redirect(f"/dashboard/orders/{order['id']}", "order")


@page("GET", "/dashboard/orders/<order_id>")
def order_page(visit, order_id):
    row = load_order(visit.conn, visit.company_id, order_id)
    order = orders_with_items(visit.conn, [row])[0]
    address = shipping_address_of(row)
    return visit.page(f"Order {row['number']}", render(
        ORDER_PAGE, facts=order_facts(visit, order, row),
        ships_to=render(SHIPS_TO, address=address_lines(address)) if address else "",
        actions=join(order_actions(visit, order)), lines=order_lines(order, row),
        history=order_history(visit, order_id), returns=order_returns(visit, order_id),
        open_return=open_return_form(visit, order_id)))


def order_facts(visit, order, row):
    customer = order["customerId"] and load_customer(visit.conn, visit.company_id,
                                                     order["customerId"])
    return render(
        ORDER_FACTS, status=status_tag(order["status"]),
        customer=link(f"/dashboard/customers/{customer['id']}",
                      f"{customer['name'] or ''} <{customer['email']}>") if customer else "none",
        people=placed_by_text(visit.conn, row),
        po=order["poNumber"] or "", notes=order["notes"] or "", created=visit.when(order["createdAt"]),
        updated=visit.when(order["updatedAt"]), invoice=order_invoice_cell(visit, order),
        tracking=order_tracking_cell(visit, order["tracking"]))


def order_tracking_cell(visit, tracking):
    """A shipment's carrier by its name, its number and its link (none: "none")."""
    if not tracking:
        return "none"
    names = company_carriers(visit.conn, visit.company_id)
    return render(ORDER_TRACKING, **dict(tracking, carrier=names[tracking["carrier"]]["name"]))


def order_invoice_cell(visit, order):
    """The order's invoice, or the button that issues it now (a cancelled order: none)."""
    invoice = order_invoice(visit.conn, order["id"])
    if invoice is not None:
        return join([link(f"/dashboard/invoices/{invoice['id']}", invoice["number"]), " ",
                     status_tag(invoice["status"])])
    if order["status"] == "CANCELLED":
        return "none"
    return visit.button(f"/dashboard/orders/{order['id']}/invoice", "Invoice now", "secondary")


def order_lines(order, row):
    return table(("Product", "SKU", "Quantity", "Unit price", "Line total"),
                 [(item["productName"], item["productSku"] or "", item["quantity"],
                   amount_text(item["unitPrice"]), cents_text(line_total_cents(item)))
                  for item in order["items"]] +
                 [("", "", "", label, amount) for label, amount in total_rows(
                     row["total_cents"], row["tax_rate"], row["tax_cents"])],
                 numeric=("Quantity", "Unit price", "Line total"))


def order_history(visit, order_id):
    return table(("When", "From", "To", "By", "Tracking", "Note"),
                 [(visit.when(change["created_at"]), change["from_status"] or "", change["to_status"],
                   change["source"] or render(MUTED, text="not recorded"),
                   change["tracking_number"] or "", change["note"] or "")
                  for change in status_changes(visit.conn, visit.company_id, order_id)])


def status_form(visit, action, status):
    """The form that moves an order on to status: shipping asks for the tracking, cancelling
    whether to put the units back."""
    if status == "SHIPPED":
        return visit.form_tag(action, render(
            SHIP_FORM, carrier=visit.select("tracking.carrier", "Carrier", [
                (code, carrier["name"]) for code, carrier in company_carriers(
                    visit.conn, visit.company_id).items()]),
            number=visit.field("tracking.number", "Tracking number", required="required"),
            url=visit.field("tracking.url", "Tracking URL (for another carrier, or to "
                                            "override the carrier's link)", kind="url")))
    if status == "CANCELLED":
        return visit.form_tag(action, render(
            CANCEL_FORM, reason=visit.field("reason", "Reason (optional; its buyer reads it)",
                                            maxlength=MAX_CANCEL_REASON),
            invalid=visit.invalid("confirm", "confirm"),
            error=visit.error("confirm", "confirm", "Yes, cancel this order")), css="")
    return visit.button(action, STATUS_ACTIONS[status], "", status=status)


def order_actions(visit, order):
    """What can be done with the order: its next statuses, or putting a cancelled one's units
    back."""
    order_id = order["id"]
    actions = [status_form(visit, f"/dashboard/orders/{order_id}/status", status)
               for status in DASHBOARD_TRANSITIONS[order["status"]]]
    if not actions:
        actions.append(render(FINAL_STATUS, status=order["status"]))
    if order["status"] == "CANCELLED":
        actions.append(render(RESTOCKED) if order_restocked(visit.conn, order_id) else
                       visit.button(f"/dashboard/orders/{order_id}/restock",
                                    "Put its units back in stock"))
    return actions


def open_return_form(visit, order_id):
    returnable = returnable_units(visit.conn, order_id)
    return visit.form_tag(f"/dashboard/orders/{order_id}/returns", render(
        OPEN_RETURN_FORM, reason=visit.field(
            "reason", "Reason ({} to {} characters)".format(*RETURN_REASON_LENGTH),
            kind="textarea"),
        units=visit.group("lines", "Units going back", render(GRID, cells=join(
            visit.field(f"units.{item_id}", f"{name} (at most {left})", left, kind="number",
                        min="0", max=left) for item_id, (name, left) in returnable.items())))))


def return_lines_text(lines, item_count):
    """A return's lines as a cell shows them: product (SKU) and units, one a line; a return
    opened before lines were recorded shows how many line items it named."""
    if not lines:
        return render(MUTED, text=f"{item_count} line item(s), units not recorded")
    return join(render(RETURN_LINE, name=name, sku=sku or "-", units=units)
                for name, sku, units in lines)


def order_returns(visit, order_id):
    returns = returns_of_order(visit.conn, visit.company_id, order_id)
    lines = return_lines_of(visit.conn, [row["id"] for row in returns])
    return table(("Return", "Opened", "Status", "Reason", "Lines", "Refunded"), [
        (row["id"], visit.when(row["created_at"]), status_tag(row["status"]), row["reason"],
         return_lines_text(lines.get(row["id"]), row["item_count"]),
         amount_text(money(row["amount_cents"])) if row["amount_cents"] is not None else "")
        for row in returns], numeric=("Refunded",))


@page("POST", "/dashboard/orders/<order_id>/status", refused=order_page, right="work")
def order_status_action(visit, order_id):
    body = {"status": visit.form.get("status")}
    if body["status"] == "SHIPPED":
        body["tracking"] = {"carrier": visit.form.get("tracking.carrier"),
                            "number": visit.form.get("tracking.number", ""),
                            "url": form_text(visit.form, "tracking.url")}
    status, tracking = parse_status_update(body, company_carriers(
        visit.conn, visit.company_id, visit.settings.tracking_url_templates))
    with visit.write() as conn:
        dashboard_update_order_status(conn, visit.company_id, order_id, status, tracking,
                                      visit.form.get("reason"),
                                      confirmed=visit.form.get("confirm") == "yes")
        if status == "CANCELLED" and visit.form.get("restock"):
            restock_order(conn, visit.company_id, order_id, visit.actor)
    return redirect(f"/dashboard/orders/{order_id}", "status")


@page("POST", "/dashboard/orders/<order_id>/restock", refused=order_page, right="work")
def restock_order_action(visit, order_id):
    with visit.write() as conn:
        restock_order(conn, visit.company_id, order_id, visit.actor)
    return redirect(f"/dashboard/orders/{order_id}", "restocked")


@page("GET", "/dashboard/products")
def products_page(visit):
    query = visit.filters()
    result = find_products(visit.conn, visit.company_id, query)
    rows = [(link(f"/dashboard/products/{p['id']}", p["name"]), p["sku"] or "",
             p["category"] or "", amount_text(money(p["price_cents"])), p["stock"],
             "active" if p["is_active"] else "inactive") for p in result["data"]]
    return listing(visit, "Products", "product", [
        visit.field("search", "Name, SKU or category", query.get("search", "")),
        visit.select("active", "Active", [("", "All"), ("true", "Active"),
                                          ("false", "Inactive")], query.get("active"))],
        table(("Name", "SKU", "Category", "Price", "Stock", "State"), rows,
              numeric=("Price", "Stock")), result)


def product_form(visit, action, product=None):
    product = product or {}
    threshold, price = product.get("low_stock_threshold"), product.get("price_cents")
    fields = [
        visit.field("name", "Name", product.get("name"), required="required"),
        visit.field("sku", "SKU", product.get("sku")),
        visit.field("category", "Category", product.get("category")),
        visit.field("unit", "Unit", product.get("unit", "each")),
        visit.field("price", "Price", "" if price is None else decimal_text(price),
                    inputmode="decimal"),
        visit.field("stock", "Stock", product.get("stock", 0), kind="number"),
        visit.field("lowStockThreshold", "Low-stock threshold",
                    "" if threshold is None else threshold, kind="number", min="0"),
        visit.field("imageUrl", "Image URL", product.get("image_url"), kind="url"),
        *selling_fields(visit, product)]
    active = "isActive" in visit.form if visit.errors else product.get("is_active", 1)
    return visit.form_tag(action, join([
        render(GRID, cells=join(fields)),
        visit.field("description", "Description", product.get("description"), kind="textarea"),
        render(ACTIVE_CHECK, checked=CHECKED if active else ""), render(SAVE, text="Save")]))


def selling_fields(visit, product):
    """A product's quantity rules and price breaks, as its form's fields (docs/catalog.md)."""
    return [visit.field("minQuantity", "Fewest units a store or dashboard order may take",
                        product.get("min_quantity", 1), kind="number", min="1"),
            visit.field("orderMultiple", "Sold in cases of (units)",
                        product.get("order_multiple", 1), kind="number", min="1"),
            visit.field("priceBreaks", "Price breaks (units and price: 10 40.00; 50 38.00)",
                        price_breaks_text(product) if product.get("price_breaks") else "")]


#: How the product form's fields that may be refused are read: (column, read(form)).
PRODUCT_FORM_READS = (
    ("name", lambda form: (form.get("name") or "").strip()),
    ("unit", lambda form: (form.get("unit") or "").strip()),
    ("price_cents", lambda form: form_amount(form, "price")),
    ("stock", lambda form: form_int(form, "stock")),
    ("low_stock_threshold", lambda form: form_int(form, "lowStockThreshold", required=False)),
    ("min_quantity", lambda form: form_int(form, "minQuantity", required=False) or 1),
    ("order_multiple", lambda form: form_int(form, "orderMultiple", required=False) or 1),
    ("price_breaks", lambda form: parse_price_breaks(form.get("priceBreaks"))))


def product_fields(form):
    """A product's form as create_product's fields, refused with every field's refusal at
    once: what cannot be read, and what no product may hold."""
    refusals, fields = Refusals(), {"is_active": int("isActive" in form)}
    for column, read in PRODUCT_FORM_READS:
        with refusals.check():
            fields[column] = read(form)
    for name, column in (("sku", "sku"), ("category", "category"), ("imageUrl", "image_url"),
                         ("description", "description")):
        fields[column] = form_text(form, name)
    with refusals.check():
        _check_product_fields(dict(fields))
    refusals.raise_any()
    return fields


@page("GET", "/dashboard/products/new")
def new_product_page(visit):
    return visit.page("New product", join([
        render(NOTE, text="Creating a product emits no event."),
        product_form(visit, "/dashboard/products")]))


@page("POST", "/dashboard/products", refused=new_product_page, right="work")
def create_product_action(visit):
    fields = product_fields(visit.form)
    with visit.write() as conn:
        product = create_product(conn, visit.company_id, visit.actor, **fields)
    return redirect(f"/dashboard/products/{product['id']}", "created")


@page("GET", "/dashboard/products/<product_id>")
def product_page(visit, product_id):
    product = load_product(visit.conn, visit.company_id, product_id)
    path = f"/dashboard/products/{product_id}"
    stock = render(PRODUCT_STOCK, level=product["stock"],
                   link=link(path + "/stock", "Adjust or count stock"),
                   movements=movements_table(visit, product_id))
    return visit.page(product["name"], join([product_form(visit, path, dict(product)), stock]))


def movements_table(visit, product_id):
    """A product's most recent stock movements, newest first, with what each belongs to."""
    rows, movements = [], list(map(movement_json, stock_history(visit.conn, visit.company_id,
                                                                 product_id)))
    numbers = order_numbers(visit.conn, visit.company_id,
                            [movement["orderId"] for movement in movements if movement["orderId"]])
    for movement in movements:
        of = (link(f"/dashboard/orders/{movement['orderId']}",
                   f"order {numbers[movement['orderId']]}") if movement["orderId"] else "")
        if movement["returnId"]:
            of = join([of, render(" return {r}", r=movement["returnId"])])
        actor = movement["actor"]
        rows.append((visit.when(movement["createdAt"]), f"{movement['change']:+d}", movement["levelAfter"],
                     movement["reason"], of, movement["note"] or "",
                     " ".join(filter(None, (actor["type"], actor["id"])))))
    return table(("When", "Change", "Level after", "Reason", "For", "Note", "By"), rows,
                 numeric=("Change", "Level after"))


@page("GET", "/dashboard/products/<product_id>/stock")
def stock_page(visit, product_id):
    product = load_product(visit.conn, visit.company_id, product_id)
    path = f"/dashboard/products/{product_id}/stock"
    adjust, count = (visit.for_form(f"{path}/{kind}", kind) for kind in ("adjust", "count"))
    adjust_form = adjust.form_tag(path + "/adjust", render(
        TITLED_FORM, title="Adjust", button="Adjust stock", fields=join([
            adjust.field("by", "Change by (units; negative takes out)", kind="number",
                         required="required"),
            adjust.field("reason", "Why", required="required", maxlength=MAX_MOVEMENT_NOTE)])))
    count_form = count.form_tag(path + "/count", render(
        TITLED_FORM, title="Count", button="Record count", fields=join([
            count.field("to", "Level found on the shelf", kind="number", min="0",
                        required="required"),
            count.field("reason", "Note (optional)", maxlength=MAX_MOVEMENT_NOTE)])))
    return visit.page(f"Stock of {product['name']}", render(
        STOCK_FORMS, level=product["stock"], adjust=adjust_form, count=count_form,
        movements=movements_table(visit, product_id)))


@page("POST", "/dashboard/products/<product_id>/stock/<kind>", refused=stock_page, right="work")
def stock_action(visit, product_id, kind):
    with visit.write() as conn:
        if kind == "adjust":
            adjust_stock(conn, visit.company_id, product_id, form_int(visit.form, "by"),
                         visit.form.get("reason"), visit.actor)
        elif kind == "count":
            count_stock(conn, visit.company_id, product_id, form_int(visit.form, "to"),
                        visit.form.get("reason"), visit.actor)
        else:
            raise not_found("Page")
    return redirect(f"/dashboard/products/{product_id}/stock", "stock")


@page("POST", "/dashboard/products/<product_id>", refused=product_page, right="work")
def update_product_action(visit, product_id):
    fields = product_fields(visit.form)
    with visit.write() as conn:
        update_product(conn, visit.company_id, product_id, visit.actor, **fields)
    return redirect(f"/dashboard/products/{product_id}", "saved")


@page("GET", "/dashboard/customers")
def customers_page(visit):
    query = visit.filters()
    result = find_customers(visit.conn, visit.company_id, query)
    rows = [(link(f"/dashboard/customers/{c['id']}", c["email"]), c["name"] or "",
             status_tag(c["status"]), amount_text(money(c["credit_limit_cents"])),
             visit.day(c["created_at"])) for c in result["data"]]
    waiting = awaiting_approval_table(visit)
    return listing(visit, "Customers", "customer", [
        visit.field("search", "Email or name", query.get("search", "")),
        visit.select("status", "Status",
                     [("", "Any")] + [(s, s) for s in SETTABLE_CUSTOMER_STATUSES],
                     query.get("status"))],
        join([render(PARAGRAPH, text=link("/dashboard/groups", "Price groups")), waiting,
              render(HEADING, text="All customers") if waiting else "",
              table(("Email", "Name", "Status", "Credit limit", "Since"), rows,
                    numeric=("Credit limit",))]), result)


def awaiting_approval_table(visit):
    """The customers awaiting approval, each with its Approve button (none: nothing)."""
    pending = [(link(f"/dashboard/customers/{c['id']}", c["email"]), c["name"] or "",
                visit.day(c["created_at"]), "Yes" if c["email_verified"] else "Not yet",
                approve_button(visit.for_form(f"/dashboard/customers/{c['id']}/status", c["id"]),
                               c))
               for c in pending_customers(visit.conn, visit.company_id)]
    if not pending:
        return ""
    return join([render(HEADING, text="Awaiting approval"), table(
        ("Email", "Name", "Registered", "Email confirmed", "Approve"), pending)])


def approve_button(visit, customer):
    """Approve, for a customer awaiting approval whose address is confirmed."""
    if customer["status"] != "PENDING":
        return ""
    if not customer["email_verified"]:
        return render(AWAITS_CONFIRMATION)
    return visit.button(f"/dashboard/customers/{customer['id']}/status", "Approve",
                        status="ACTIVE")


def customer_body(form):
    body = {"name": form_text(form, "name"), "notes": form_text(form, "notes"),
            "creditLimit": form_number(form, "creditLimit"),
            "taxRateOverride": form_number(form, "taxRateOverride")}
    return body


def customer_fields(visit, customer):
    credit = customer.get("credit_limit_cents")
    return join([render(GRID, cells=join([
        visit.field("name", "Name", customer.get("name")),
        visit.field("creditLimit", "Credit limit", "" if credit is None else
                    decimal_text(credit), inputmode="decimal"),
        visit.field("taxRateOverride", f"Tax rate override (0 to {MAX_TAX_RATE})",
                    customer.get("tax_rate_override"), inputmode="decimal"),
        visit.field("paymentTermsDays", "Payment terms in days (empty: the company's)",
                    customer.get("payment_terms_days"), inputmode="numeric")])),
        visit.field("notes", "Internal notes", customer.get("notes"), kind="textarea")])


@page("GET", "/dashboard/customers/new")
def new_customer_page(visit):
    return visit.page("New customer", visit.form_tag("/dashboard/customers", join([
        visit.field("email", "Email", kind="email", required="required"),
        customer_fields(visit, {}), render(SUBMIT, text="Create customer")])))


@page("POST", "/dashboard/customers", refused=new_customer_page, right="work")
def create_customer_action(visit):
    body = dict(customer_body(visit.form), email=visit.form.get("email", ""))
    with visit.write() as conn:
        customer = create_customer(conn, visit.company_id, body, source="dashboard", every=True)
        save_customer_terms(visit, conn, customer["id"])
    return redirect(f"/dashboard/customers/{customer['id']}", "created")


@page("GET", "/dashboard/customers/<customer_id>")
def customer_page(visit, customer_id):
    customer = load_customer(visit.conn, visit.company_id, customer_id)
    blocked = customer["status"] == "BLOCKED"
    status_path = f"/dashboard/customers/{customer_id}/status"
    invite = "" if blocked else visit.button(
        f"/dashboard/customers/{customer_id}/invite", "Email a set-password link", "secondary")
    status = render(CUSTOMER_STATUS_CARD,
                    tag=status_tag(customer["status"]), approve=approve_button(visit, customer),
                    invite=invite, verified="confirmed" if customer["email_verified"]
                    else "not confirmed yet",
                    button=visit.button(status_path, "Unblock" if blocked else "Block",
                                        "" if blocked else "danger",
                                        status="ACTIVE" if blocked else "BLOCKED"))
    edit = visit.form_tag(f"/dashboard/customers/{customer_id}", join([
        customer_fields(visit, dict(customer)), render(SUBMIT, text="Save")]))
    orders = link(f"/dashboard/orders?customerId={customer_id}", "Orders of this customer")
    return visit.page(customer["email"], join([
        status, edit, render(PARAGRAPH, text=orders), customer_contacts_section(visit, customer_id),
        credit_section(visit, customer), group_form(visit, customer),
        customer_prices_section(visit, customer_id)]))


def group_form(visit, customer):
    """The customer's price group, and the form that changes it."""
    path = f"/dashboard/customers/{customer['id']}/group"
    choices = [("", "None")] + [(g["id"], g["name"])
                                for g in company_groups(visit.conn, visit.company_id)]
    view = visit.for_form(path, "group")
    return view.form_tag(path, render(TITLED_FORM, title="Price group", button="Save group",
                                      fields=view.select("groupId", "Group", choices,
                                                         customer["group_id"] or "")))


def customer_prices_section(visit, customer_id):
    """The customer's own prices, each with its Remove button, and the form that sets one."""
    return prices_section(visit, f"/dashboard/customers/{customer_id}/prices",
                          price_list(visit.conn, visit.company_id, customer_id),
                          CUSTOMER_PRICES)


def prices_section(visit, path, listed, template):
    """A price list's prices (listed: rows of a product and a price), each with its Remove
    button, and the form at path that sets one, under template's heading."""
    rows = [(row["name"], row["sku"] or "", amount_text(money(row["catalog_cents"])),
             amount_text(money(row["price_cents"])),
             visit.button(f"{path}/{row['id']}/clear", "Remove", "secondary"))
            for row in listed]
    products = [("", "(choose)")] + [(product_id, f"{name} ({sku or '-'})")
                                     for product_id, name, sku, _ in
                                     product_choices(visit.conn, visit.company_id)]
    form = visit.for_form(path, "price")
    return render(template, prices=table(
        ("Product", "SKU", "Catalog price", "Their price", "Remove"), rows,
        numeric=("Catalog price", "Their price")), form=form.form_tag(path, render(
            TITLED_FORM, title="Set a price", button="Set price", fields=render(GRID, cells=join([
                form.select("productId", "Product", products),
                form.field("price", "Their price", inputmode="decimal")])))))


@page("POST", "/dashboard/customers/<customer_id>/prices", refused=customer_page, right="work")
def set_customer_price_action(visit, customer_id):
    if not visit.form.get("productId"):
        raise invalid("productId", "choose a product")
    with visit.write() as conn:
        set_customer_price(conn, visit.company_id, customer_id, visit.form["productId"],
                           form_amount(visit.form, "price"))
    return redirect(f"/dashboard/customers/{customer_id}#prices", "price")


@page("POST", "/dashboard/customers/<customer_id>/prices/<product_id>/clear",
      refused=customer_page, right="work")
def clear_customer_price_action(visit, customer_id, product_id):
    with visit.write() as conn:
        clear_customer_price(conn, visit.company_id, customer_id, product_id)
    return redirect(f"/dashboard/customers/{customer_id}#prices", "price-cleared")


@page("POST", "/dashboard/customers/<customer_id>", refused=customer_page, right="work")
def update_customer_action(visit, customer_id):
    refusals = Refusals()
    with visit.write() as conn:
        with refusals.check():
            update_customer(conn, visit.company_id, customer_id, customer_body(visit.form),
                            every=True)
        with refusals.check():
            save_customer_terms(visit, conn, customer_id)
        refusals.raise_any()
    return redirect(f"/dashboard/customers/{customer_id}", "saved")


def save_customer_terms(visit, conn, customer_id):
    """The customer form's payment terms (empty: the company's), where the form has them."""
    if "paymentTermsDays" in visit.form:
        set_customer_terms(conn, visit.company_id, customer_id,
                           form_text(visit.form, "paymentTermsDays"))


@page("POST", "/dashboard/customers/<customer_id>/status", refused=customer_page, right="work")
def customer_status_action(visit, customer_id):
    with visit.write() as conn:
        customer = set_customer_status(conn, visit.company_id, customer_id,
                                       visit.form.get("status"))
    return redirect(f"/dashboard/customers/{customer_id}", customer["status"])


@page("POST", "/dashboard/customers/<customer_id>/invite", refused=customer_page, right="work")
def invite_customer_action(visit, customer_id):
    with visit.write() as conn:
        invite_customer(conn, visit.company_id, customer_id, visit.surface.now_ms())
    return redirect(f"/dashboard/customers/{customer_id}", "invite")


def customer_contacts_section(visit, customer_id):
    """The customer's contacts, and the way to add one."""
    path = f"/dashboard/customers/{customer_id}/contacts"
    return join([render(HEADING, text="Contacts"),
                 contacts_table(visit, customer_contacts(visit.conn, customer_id),
                                "/dashboard/contacts"),
                 render(NEW_RECORD, path=path, noun="contact")])


@page("GET", "/dashboard/customers/<customer_id>/contacts/new")
def new_contact_page(visit, customer_id):
    customer = load_customer(visit.conn, visit.company_id, customer_id)
    return visit.page(f"New contact of {customer['email']}", visit.form_tag(
        f"/dashboard/customers/{customer_id}/contacts", join([
            contact_fields(visit, {}, email=True), render(SUBMIT, text="Add and invite")])))


@page("POST", "/dashboard/customers/<customer_id>/contacts", refused=new_contact_page,
      right="work")
def add_contact_action(visit, customer_id):
    with visit.write() as conn:
        add_contact(conn, visit.company_id, customer_id, contact_body(visit.form),
                    visit.surface.now_ms())
    return redirect(f"/dashboard/customers/{customer_id}", "contact-added")


@page("GET", "/dashboard/contacts/<contact_id>")
def contact_page(visit, contact_id):
    contact = load_contact(visit.conn, visit.company_id, contact_id)
    path = f"/dashboard/contacts/{contact_id}"
    return visit.page(contact["email"], join([
        render(PARAGRAPH, text=link(f"/dashboard/customers/{contact['customer_id']}",
                                    "The contact's customer")),
        visit.form_tag(path, join([contact_fields(visit, dict(contact)),
                                   render(SUBMIT, text="Save")])),
        visit.button(path + "/invite", "Email a set-password link", "secondary")]))


@page("POST", "/dashboard/contacts/<contact_id>", refused=contact_page, right="work")
def update_contact_action(visit, contact_id):
    with visit.write() as conn:
        update_contact(conn, visit.company_id, contact_id, contact_body(visit.form))
    return redirect(f"/dashboard/contacts/{contact_id}", "contact")


@page("POST", "/dashboard/contacts/<contact_id>/invite", refused=contact_page, right="work")
def invite_contact_action(visit, contact_id):
    with visit.write() as conn:
        invite_contact(conn, visit.company_id, contact_id, visit.surface.now_ms())
    return redirect(f"/dashboard/contacts/{contact_id}", "invite")


def pending_requests_table(visit):
    """The order requests that wait for a customer's admin (none: nothing): staff see them,
    the decision is the business's."""
    rows = [(link(f"/dashboard/customers/{row['customer_id']}", row["customer_email"]),
             row["asker_email"], visit.when(row["created_at"]),
             cents_text(row["total_cents"]))
            for row in pending_requests(visit.conn, visit.company_id)]
    if not rows:
        return ""
    return join([render(HEADING, text="Order requests awaiting a buyer's admin"), table(
        ("Customer", "Asked by", "Asked", "Total"), rows, numeric=("Total",)),
        render(HEADING, text="Orders")])


# Customer groups: their price lists (docs/catalog.md).

def group_fields(visit, group):
    bp = group.get("discount_bp")
    return render(GRID, cells=join([
        visit.field("name", "Name", group.get("name"), required="required"),
        visit.field("discount", "Discount off the catalog price (%)",
                    "" if bp is None else decimal_text(bp), inputmode="decimal")]))


@page("GET", "/dashboard/groups")
def groups_page(visit):
    rows = [(link(f"/dashboard/groups/{g['id']}", g["name"]),
             decimal_text(g["discount_bp"]) + "%", g["members"])
            for g in company_groups(visit.conn, visit.company_id)]
    return visit.page("Price groups", join([
        table(("Group", "Discount", "Customers"), rows, numeric=("Customers",)),
        visit.form_tag("/dashboard/groups", render(TITLED_FORM, title="New group",
                                                   button="Create group",
                                                   fields=group_fields(visit, {})))]))


@page("POST", "/dashboard/groups", refused=groups_page, right="work")
def create_group_action(visit):
    with visit.write() as conn:
        group_id = save_group(conn, visit.company_id, visit.form.get("name"),
                              visit.form.get("discount"))
    return redirect(f"/dashboard/groups/{group_id}", "created")


@page("GET", "/dashboard/groups/<group_id>")
def group_page(visit, group_id):
    group = load_group(visit.conn, visit.company_id, group_id)
    path = f"/dashboard/groups/{group_id}"
    return visit.page(group["name"], join([
        render(GROUP_PAGE_NOTE, members=group_size(visit.conn, group_id)),
        visit.form_tag(path, join([group_fields(visit, dict(group)),
                                   render(SUBMIT, text="Save")])),
        prices_section(visit, path + "/prices", group_price_list(
            visit.conn, visit.company_id, group_id), GROUP_PRICES)]))


@page("POST", "/dashboard/groups/<group_id>", refused=group_page, right="work")
def update_group_action(visit, group_id):
    with visit.write() as conn:
        save_group(conn, visit.company_id, visit.form.get("name"), visit.form.get("discount"),
                   group_id)
    return redirect(f"/dashboard/groups/{group_id}", "saved")


@page("POST", "/dashboard/groups/<group_id>/prices", refused=group_page, right="work")
def set_group_price_action(visit, group_id):
    if not visit.form.get("productId"):
        raise invalid("productId", "choose a product")
    with visit.write() as conn:
        set_group_price(conn, visit.company_id, group_id, visit.form["productId"],
                        form_amount(visit.form, "price"))
    return redirect(f"/dashboard/groups/{group_id}#prices", "price")


@page("POST", "/dashboard/groups/<group_id>/prices/<product_id>/clear", refused=group_page,
      right="work")
def clear_group_price_action(visit, group_id, product_id):
    with visit.write() as conn:
        set_group_price(conn, visit.company_id, group_id, product_id, None)
    return redirect(f"/dashboard/groups/{group_id}#prices", "price-cleared")


@page("POST", "/dashboard/customers/<customer_id>/group", refused=customer_page, right="work")
def customer_group_action(visit, customer_id):
    with visit.write() as conn:
        set_customer_group(conn, visit.company_id, customer_id,
                           visit.form.get("groupId") or None)
    return redirect(f"/dashboard/customers/{customer_id}", "saved")


RETURN_STEPS = {"REQUESTED": ("approve", "Approve"), "APPROVED": ("receive", "Mark received")}
REFUND_METHOD_CHOICES = [(method, f"{method} ({meaning})") for method, meaning
                         in zip(REFUND_METHODS, ("credit note", "out of band"))]


@page("GET", "/dashboard/returns")
def returns_page(visit):
    result = find_returns(visit.conn, visit.company_id, visit.filters())
    lines = return_lines_of(visit.conn, [row["id"] for row in result["data"]])
    records = {record["id"]: record for record in returns_json(visit.conn, result["data"])}
    numbers = order_numbers(visit.conn, visit.company_id,
                            [row["order_id"] for row in result["data"]])
    rows = [(row["id"], link(f"/dashboard/orders/{row['order_id']}", numbers[row["order_id"]]),
             row["reason"], return_lines_text(lines.get(row["id"]), row["item_count"]),
             status_tag(row["status"]),
             return_next_step(visit, row, records[row["id"]], lines.get(row["id"], ())))
            for row in result["data"]]
    return visit.page("Returns", join([
        table(("Return", "Order", "Reason", "Lines", "Status", "Next step"), rows),
        pager(visit, result, "/dashboard/returns"), render(RETURNS_FOOT)]))


def return_next_step(visit, row, record, lines):
    """The form of a return's next step: approve it, mark it received, refund it."""
    action = f"/dashboard/returns/{row['id']}"
    if row["status"] in RETURN_STEPS:
        step, text = RETURN_STEPS[row["status"]]
        return visit.button(f"{action}/{step}", text)
    if row["status"] != "RECEIVED":
        return ""
    form = visit.for_form(f"{action}/refund", row["id"])
    # (Both lists are in the order's line order.)
    per_line = [(line["orderItemId"], name, units)
                for line, (name, _, units) in zip(record["lines"], lines)]
    subtotal = decimal_text(return_subtotal_cents(visit.conn, row["id"])) if per_line else ""
    return form.form_tag(f"{action}/refund", render(
        REFUND_FORM, method=form.select("method", "Method", REFUND_METHOD_CHOICES),
        units=refund_units_fields(form, per_line), subtotal=form.field(
            "subtotal", "Subtotal (the lines at their prices)" if per_line else "Subtotal",
            subtotal, inputmode="decimal"),
        amount=form.field("amount", "Amount (default: subtotal)", inputmode="decimal")),
        css="refund")


def refund_units_fields(form, per_line):
    """A refund form's units: for a return with lines, (order item ID, product name, units)
    each, its good units (back in stock) and damaged units, the totals then optional (their
    sums); for one without, the totals alone."""
    default_sum = " (default: the lines' sum)" if per_line else ""
    return join([
        join(render(GRID, cells=join([form.field(
            f"good.{item_id}", f"{name}: good units, back in stock (of {units})", kind="number",
            min="0", max=units), form.field(
            f"damaged.{item_id}", f"{name}: damaged units", kind="number", min="0", max=units)]))
            for item_id, name, units in per_line),
        form.error("lines"),
        form.field("goodUnits", "Good units" + default_sum, "" if per_line else "0",
                   kind="number", min="0"),
        form.field("damagedUnits", "Damaged units" + default_sum, "" if per_line else "0",
                   kind="number", min="0")])


@page("POST", "/dashboard/orders/<order_id>/returns", refused=order_page, right="work")
def open_return_action(visit, order_id):
    with visit.write() as conn:
        open_return(conn, visit.company_id, order_id, visit.form.get("reason"), actor="staff",
                    lines=form_units(visit.form, "units."))
    return redirect("/dashboard/returns", "return")


# A refund moves money: its route comes before the other steps', which it would match too.
@page("POST", "/dashboard/returns/<return_id>/refund", refused=returns_page, right="money")
def refund_action(visit, return_id):
    good, damaged = form_units(visit.form, "good."), form_units(visit.form, "damaged.")
    lines = {item_id: (good.get(item_id, 0), damaged.get(item_id, 0))
             for item_id in {**good, **damaged}} or None
    with visit.write() as conn:
        refund_return(conn, visit.company_id, return_id, visit.form.get("method"),
                      form_int(visit.form, "goodUnits", required=lines is None),
                      form_int(visit.form, "damagedUnits", required=lines is None),
                      form_amount(visit.form, "subtotal"),
                      form_amount(visit.form, "amount", required=False), lines=lines,
                      actor=visit.actor)
    return redirect("/dashboard/returns", "refund")


@page("POST", "/dashboard/returns/<return_id>/<step>", refused=returns_page, right="work")
def return_step_action(visit, return_id, step):
    with visit.write() as conn:
        if step == "approve":
            approve_return(conn, visit.company_id, return_id)
        elif step == "receive":
            receive_return(conn, visit.company_id, return_id)
        else:
            raise not_found("Page")
    return redirect("/dashboard/returns", step)


@page("GET", "/dashboard/invoices/<invoice_id>")
def invoice_page(visit, invoice_id):
    invoice = load_invoice(visit.conn, visit.company_id, invoice_id)
    return visit.page(f"Invoice {invoice['number']}", join([
        invoice_document(visit, invoice, f"/dashboard/orders/{invoice['order_id']}"),
        render(SCREEN_ONLY, body=join([invoice_settlements(visit, invoice_id),
                                       *invoice_actions(visit, invoice)]))]))


def invoice_settlements(visit, invoice_id):
    """The payments recorded against an invoice and the credit applied to it."""
    details = invoice_details(visit.conn, visit.company_id, invoice_id)
    rows = [(day_tag(payment["paidAt"]), "Payment", " ".join(filter(None, (
        payment["method"], payment["reference"]))), amount_text(payment["amount"]))
        for payment in details["payments"]] + [
        (day_tag(credit["createdAt"]), "Credit", credit["creditNoteNumber"],
         amount_text(credit["amount"])) for credit in details["credits"]]
    return join([render(HEADING, text="Payments and credit"), table(
        ("Date", "Kind", "Reference", "Amount"), rows, numeric=("Amount",))])


def invoice_actions(visit, invoice):
    """The forms that settle an open invoice: a payment, credit from the customer's notes,
    and (while nothing is settled) voiding it."""
    if invoice["status"] != "OPEN":
        return []
    path = f"/dashboard/invoices/{invoice['id']}"
    paying = visit.for_form(path + "/payments", "payment")
    actions = [paying.form_tag(path + "/payments", render(
        TITLED_FORM, title="Record a payment", button="Record payment", fields=render(
            GRID, cells=join([
                paying.field("amount", "Amount", inputmode="decimal", required="required"),
                paying.field("paidAt", "Paid on (empty: today)", kind="date"),
                paying.field("method", "Method", maxlength=MAX_PAYMENT_METHOD),
                paying.field("reference", "Reference", maxlength=MAX_PAYMENT_REFERENCE)]))))]
    actions.append(credit_form(visit, invoice, path))
    if not invoice["paid_cents"] and not invoice["credited_cents"]:
        actions.append(void_form(visit, invoice, path))
    return actions


def void_form(visit, invoice, path):
    voiding = visit.for_form(path + "/void", "void")
    return voiding.form_tag(path + "/void", render(
        VOID_FORM, number=invoice["number"], invalid=voiding.invalid("confirm", "confirm-void"),
        error=voiding.error("confirm", "confirm-void", "Void")))


def credit_form(visit, invoice, path):
    """The form that applies one of the customer's credit notes (none with credit left: "")."""
    notes = [note for note in customer_credit_notes(visit.conn, visit.company_id,
                                                    invoice["customer_id"])
             if note["remaining_cents"]] if invoice["customer_id"] else []
    if not notes:
        return ""
    crediting = visit.for_form(path + "/credit", "credit")
    return crediting.form_tag(path + "/credit", render(
        TITLED_FORM, title="Apply credit", button="Apply credit", fields=render(
            GRID, cells=join([crediting.select("creditNoteId", "Credit note", [
                (note["id"], f"{note['number']} ({cents_text(note['remaining_cents'])} left)")
                for note in notes]), crediting.field(
                "amount", "Amount (empty: as much as both allow)", inputmode="decimal")]))))


@page("POST", "/dashboard/orders/<order_id>/invoice", refused=order_page, right="money")
def invoice_order_action(visit, order_id):
    with visit.write() as conn:
        invoiced = order_invoice(conn, order_id)  # (a form sent twice finds it)
        invoice = invoice_order(conn, visit.company_id, order_id, visit.surface.now_ms())
    return redirect(f"/dashboard/invoices/{invoice['id']}", "invoiced" if invoiced else "issued")


@page("POST", "/dashboard/invoices/<invoice_id>/payments", refused=invoice_page, right="money")
def record_payment_action(visit, invoice_id):
    form = visit.form
    with visit.write() as conn:
        record_payment(conn, visit.company_id, invoice_id, form_amount(form, "amount"),
                       form.get("method"), form.get("reference"),
                       form_text(form, "paidAt"), visit.surface.now_ms())
    return redirect(f"/dashboard/invoices/{invoice_id}", "payment")


@page("POST", "/dashboard/invoices/<invoice_id>/credit", refused=invoice_page, right="money")
def apply_credit_action(visit, invoice_id):
    with visit.write() as conn:
        apply_credit(conn, visit.company_id, visit.form.get("creditNoteId"), invoice_id,
                     form_amount(visit.form, "amount", required=False))
    return redirect(f"/dashboard/invoices/{invoice_id}", "credit")


@page("POST", "/dashboard/invoices/<invoice_id>/void", refused=invoice_page, right="money")
def void_invoice_action(visit, invoice_id):
    if visit.form.get("confirm") != "yes":
        raise invalid("confirm", "tick the box to void the invoice")
    with visit.write() as conn:
        void_invoice(conn, visit.company_id, invoice_id)
    return redirect(f"/dashboard/invoices/{invoice_id}", "void")


@page("GET", "/dashboard/invoices")
def invoices_page(visit):
    query = visit.filters()
    result = find_customer_invoices_page(visit.conn, visit.company_id, query)
    customers = customer_emails(visit.conn, visit.company_id,
                                [row["customer_id"] for row in result["data"]])
    rows = [(link(f"/dashboard/invoices/{row['id']}", row["number"]),
             customers.get(row["customer_id"], ""), day_tag(row["issued_at"]),
             day_tag(row["due_at"]),
             status_tag(row["status"]), cents_text(row["total_cents"]),
             cents_text(balance_cents(row))) for row in result["data"]]
    return visit.page("Invoices", join([render(FILTERS, path="/dashboard/invoices", fields=join([
        visit.select("status", "Status", [("", "Any status")] + [
            (status, status) for status in INVOICE_STATUSES], query.get("status")),
        visit.select("customerId", "Customer", [("", "Any customer")] + customer_choices(
            visit.conn, visit.company_id), query.get("customerId"))]), button="Filter"),
        table(("Invoice", "Customer", "Issued", "Due", "Status", "Total", "Balance"), rows,
              numeric=("Total", "Balance")), pager(visit, result, "/dashboard/invoices")]))


#: The aging buckets' labels, as the Receivables page heads its columns.
AGING_LABELS = [label for label, _, _ in AGING_BUCKETS]


@page("GET", "/dashboard/receivables")
def receivables_page(visit):
    customers, invoices, count = receivables(visit.conn, visit.company_id,
                                             visit.surface.now_ms())
    listed = "Open invoices" if count <= len(invoices) else \
        f"The {len(invoices)} open invoices due longest ago, of {count}"
    owing = "Owed by customer, by days past due" if len(customers) <= RECEIVABLES_SHOWN else \
        f"The {RECEIVABLES_SHOWN} customers who owe most, of {len(customers)}, by days past due"
    return visit.page("Receivables", join([
        render(PARAGRAPH, text=link("/dashboard/invoices", "Every invoice, paid and void too")),
        render(HEADING, text=owing), owed_table(customers),
        render(HEADING, text=listed), table(
            ("Invoice", "Customer", "Issued", "Due", "Past due", "Balance"),
            [(link(f"/dashboard/invoices/{i['id']}", i["number"]), i["email"] or "",
              day_tag(i["issued_at"]), day_tag(i["due_at"]), AGING_LABELS[i["bucket"]],
              cents_text(i["balance_cents"])) for i in invoices], numeric=("Balance",))]))


def owed_table(customers):
    """The open balances by aging bucket of the RECEIVABLES_SHOWN customers who owe most
    (rows for them all would make the page grow with the business), and the totals of every
    customer's."""
    rows = [(link(f"/dashboard/customers/{owed['customer_id']}/statement",
                  owed["name"] or owed["email"]) if owed["customer_id"] else "no customer",
             *map(cents_text, owed["buckets"]), cents_text(owed["total"]))
            for owed in customers[:RECEIVABLES_SHOWN]]
    sums = [sum(owed["buckets"][index] for owed in customers)
            for index in range(len(AGING_LABELS))]
    rows.append((render(TOTAL_CELL, text="Total"), *map(cents_text, sums),
                 render(TOTAL_CELL, text=cents_text(sum(sums)))))
    return table(("Customer", *AGING_LABELS, "Total"), rows,
                 numeric=(*AGING_LABELS, "Total"))


@page("GET", "/dashboard/customers/<customer_id>/statement")
def customer_statement_page(visit, customer_id):
    customer = load_customer(visit.conn, visit.company_id, customer_id)
    return visit.page(f"Statement of {customer['name'] or customer['email']}", join([
        statement_section(visit, customer_id, f"/dashboard/customers/{customer_id}/statement",
                          "/dashboard/invoices/"),
        render(PARAGRAPH, text=link(f"/dashboard/customers/{customer_id}",
                                    "Back to the customer"))]))


def credit_section(visit, customer):
    """A customer's exposure and what its credit limit leaves available, its payment terms,
    and a link to its statement."""
    standing = credit_standing(visit.conn, visit.company_id, customer)
    return render(
        CREDIT_STANDING, exposure=cents_text(standing["exposure"]),
        limit="none" if standing["limit"] is None else cents_text(standing["limit"]),
        available="no limit" if standing["available"] is None else
        cents_text(standing["available"]),
        terms=terms_text(terms_of(visit.conn, visit.company_id, customer)),
        statement=link(f"/dashboard/customers/{customer['id']}/statement", "Statement"))


@page("GET", "/dashboard/webhooks")
def webhooks_page(visit):
    now = now_iso()
    cards = [webhook_card(visit, webhook_json(row, at=now))
             for row in company_webhooks(visit.conn, visit.company_id)]
    create = visit.form_tag("/dashboard/webhooks", render(
        NEW_WEBHOOK, url=visit.field("url", "URL", kind="url", required="required"),
        events=visit.checks("events", EVENT_CATALOG, ()),
        active=render(ACTIVE_CHECK, checked=CHECKED)))
    return visit.page("Webhooks", join(cards + [create]))


def webhook_card(visit, hook):
    """A subscription with its buttons and its recent deliveries."""
    action, grace = f"/dashboard/webhooks/{hook['id']}", hook["secretRotationGraceExpiresAt"]
    deliveries = table(
        ("When", "Event", "Status code", "Duration", "Success", "Response"),
        [(visit.when(d["createdAt"]), d["event"], d["statusCode"] or "", f"{d['durationMs']} ms",
          "yes" if d["success"] else "no", render(CODE, text=(d["responseBody"] or "")[:300]))
         for d in recent_deliveries(visit.conn, hook["id"])])
    return render(
        WEBHOOK_CARD, url=hook["url"], events=", ".join(hook["events"]),
        state=status_tag("active" if hook["isActive"] else "inactive"),
        grace=render(WEBHOOK_GRACE, until=grace) if grace else "",
        toggle=visit.button(f"{action}/toggle", "Deactivate" if hook["isActive"]
                            else "Activate", "secondary"),
        rotate=visit.button(f"{action}/rotate",
                            f"Rotate secret ({WEBHOOK_SECRET_GRACE_HOURS} h grace)", "secondary"),
        deliveries=deliveries)


@page("POST", "/dashboard/webhooks", refused=webhooks_page, right="company")
def create_webhook_action(visit):
    body = {"url": visit.form.get("url", ""), "events": visit.form.getall("events"),
            "isActive": "isActive" in visit.form}
    refused = valid_http_url(body["url"]) and not visit.settings.allow_private_webhooks and \
        webhook_url_refused(body["url"], visit.settings.webhook_timeout)
    if refused:  # saved, it would only ever fail: say so now, and save nothing
        raise invalid("url", WEBHOOK_ADDRESS_REFUSED.format(reason=refused))
    with visit.write() as conn:
        hook = create_webhook(conn, visit.company_id, body, every=True)
    visit.notice = render(WEBHOOK_CREATED, secret=hook["secret"])
    return webhooks_page(visit)


@page("POST", "/dashboard/webhooks/<webhook_id>/toggle", refused=webhooks_page, right="company")
def toggle_webhook_action(visit, webhook_id):
    with visit.write() as conn:
        hook = load_webhook(conn, visit.company_id, webhook_id)
        update_webhook(conn, visit.company_id, webhook_id, {"isActive": not hook["is_active"]})
    return redirect("/dashboard/webhooks", "webhook")


@page("POST", "/dashboard/webhooks/<webhook_id>/rotate", refused=webhooks_page, right="company")
def rotate_webhook_action(visit, webhook_id):
    with visit.write() as conn:
        rotated = rotate_webhook_secret(conn, visit.company_id, webhook_id)
    visit.notice = render(SECRET_ROTATED, secret=rotated["secret"],
                          until=visit.when(rotated["secretRotationGraceExpiresAt"]))
    return webhooks_page(visit)


@page("GET", "/dashboard/keys")
def keys_page(visit):
    now = now_iso()
    rows = [(key["id"], key["scopes"].replace(" ", ", "), key["rate_limit"],
             visit.when(key["expires_at"]) or "never", visit.day(key["created_at"]),
             status_tag("revoked") if key["revoked"] else
             status_tag("expired") if key_expired(key["expires_at"], now) else
             visit.button(f"/dashboard/keys/{key['id']}/revoke", "Revoke", "danger"))
            for key in company_api_keys(visit.conn, visit.company_id)]
    create = visit.form_tag("/dashboard/keys", render(
        NEW_KEY, scopes=visit.checks("scopes", SCOPES, SCOPES),
        limit=visit.field("rateLimit", "Requests per minute", DEFAULT_KEY_RATE_LIMIT,
                          kind="number", min="1"),
        expires=visit.field("expiresAt", "Expires (date or ISO 8601 time, empty: never)")))
    return visit.page("API keys", join([
        table(("Key", "Scopes", "Per minute", "Expires", "Created", "State"), rows), create]))


@page("POST", "/dashboard/keys", refused=keys_page, right="company")
def create_key_action(visit):
    expires = form_text(visit.form, "expiresAt")
    if expires is not None:
        expires = moment_text(expires)
        if expires is None:
            raise invalid("expiresAt", "must be a date (2026-11-22) or an ISO 8601 datetime")
    with visit.write() as conn:
        key = create_api_key(conn, visit.company_id, visit.form.getall("scopes"),
                             form_int(visit.form, "rateLimit"), expires)
    visit.notice = render(KEY_CREATED, id=key["id"], key=key["key"])
    return keys_page(visit)


@page("POST", "/dashboard/keys/<key_id>/revoke", refused=keys_page, right="company")
def revoke_key_action(visit, key_id):
    visit.service.revoke_key(visit.company_id, key_id)
    return redirect("/dashboard/keys", "revoked")


#: Each spreadsheet's name on the Spreadsheets page.
EXPORT_TITLES = {"orders": "Orders, a row per line", "products": "Products",
                 "customers": "Customers", "prices": "Customers' own prices",
                 "invoices": "Invoices"}


@page("GET", "/dashboard/spreadsheets")
def spreadsheets_page(visit):
    """Each kind of export, as a link carrying the dates chosen (docs/spreadsheets.md)."""
    query = visit.filters()
    dates = urllib.parse.urlencode({k: v for k, v in query.items() if k in ("since", "until")})
    links = join(render(LIST_ITEM, text=link(
        f"/dashboard/spreadsheets/{kind}{'?' + dates if dates else ''}", title))
        for kind, title in EXPORT_TITLES.items())
    return visit.page("Spreadsheets", join([
        render(FILTERS, path="/dashboard/spreadsheets", button="Choose dates", fields=join([
            visit.field("since", "Made from", query.get("since", ""), kind="date"),
            visit.field("until", "Made before", query.get("until", ""), kind="date")])),
        render(HEADING, text="Download as CSV"), render(LIST, items=links),
        render(HEADING, text="Import a CSV file"),
        visit.form_tag("/dashboard/spreadsheets/import", join([
            render(NOTE, text=IMPORT_NOTE),
            visit.select("kind", "What the file holds", [(k, k) for k in IMPORT_KINDS]),
            visit.field("file", "File", kind="file", accept=".csv,text/csv,text/plain"),
            render(SUBMIT, text="Check the file")]), files=True)]))


@page("POST", "/dashboard/spreadsheets/import", refused=spreadsheets_page, right="work")
def import_preview_action(visit):
    """What the file would do, line by line, written only when the staff apply it."""
    text = uploaded_text("file", MAX_IMPORT_CHARACTERS, IMPORT_TOO_LONG)
    if text is None:
        raise invalid("file", "choose a file")
    kind = visit.form.get("kind", "")
    return import_result_page(visit, kind, text, import_file(
        visit.service.db, visit.company_id, kind, text, visit.actor, apply=False))


@page("POST", "/dashboard/spreadsheets/import/apply", refused=spreadsheets_page, right="work")
def import_apply_action(visit):
    kind, text = visit.form.get("kind", ""), visit.form.get("text", "")
    result = import_file(visit.service.db, visit.company_id, kind, text, visit.actor,
                         apply=True)
    if result["errors"]:  # the records changed since the check: say so, line by line
        return import_result_page(visit, kind, text, result, status=400)
    return redirect("/dashboard/spreadsheets", "imported")


def import_result_page(visit, kind, text, result, status=200):
    counts = (f"{result['created']} to create, {result['updated']} to change, "
              f"{result['unchanged']} unchanged, {len(result['errors'])} refused.")
    apply = "" if result["errors"] else visit.form_tag(
        "/dashboard/spreadsheets/import/apply", join([
            render(HIDDEN, name="kind", value=kind), render(HIDDEN, name="text", value=text),
            render(SUBMIT, text="Apply: write these changes")]))
    return visit.page("Import " + kind, join([
        render(PARAGRAPH, text=counts + ("" if apply else " " + IMPORT_REFUSED)),
        table(("Line", "What it does"), result["lines"]), apply]), status)


@page("GET", "/dashboard/spreadsheets/<kind>")
def spreadsheet_download(visit, kind):
    query = visit.filters()
    since, until = (moment_text(query[name]) if query.get(name) else None
                    for name in ("since", "until"))
    rows = export_csv(visit.conn, visit.company_id, kind, since, until)
    bottle.response.content_type = "text/csv; charset=utf-8"
    bottle.response.set_header("Content-Disposition", f'attachment; filename="{kind}.csv"')
    return (text.encode("utf-8") for text in rows)


# 15.2 Billing, emails and settings -----------------------------------------------------------
# The company's own subscription to the service (its paid invoices), the emails the service
# wrote for it, and the Settings page (the settings of update_company: mail and Stripe).

@page("GET", "/dashboard/billing")
def billing_page(visit):
    result = find_invoices(visit.conn, visit.company_id, visit.filters())
    rows = [(row["number"], render("{start} to {end}", start=day_tag(row["period_start"]),
                                   end=day_tag(row["period_end"])),
             minor_amount_text(row["amount_paid_minor"], row["currency"]),
             visit.when(row["created_at"]),
             render(OUTSIDE_LINK, href=row["hosted_invoice_url"], text="View invoice"))
            for row in result["data"]]
    return visit.page("Billing", join([
        table(("Number", "Period", "Amount", "Recorded", "Invoice"), rows,
              numeric=("Amount",)),
        pager(visit, result, "/dashboard/billing"), render(BILLING_FOOT)]))


#: An email's state as the staff see it.
EMAIL_STATES = {"pending": "waiting", "sending": "waiting", "sent": "sent",
                "failed": "failed", "unsent": "not sent"}
NO_MAIL_SERVER = (f"No mail server is set (ORDERING_SMTP_URL): emails wait, and each is sent "
                  f"once one is set, if that is within {MAIL_RETRY_SECONDS // 3600} hours of it "
                  "being written.")


def email_state(row, settings):
    """(state, why) of an email as the staff see it: one that waits where no mail server is
    set is not sent, and says why."""
    if row["state"] in ("pending", "sending") and not settings.smtp_url:
        return render(STATUS_TAG, style="unsent", text="not sent"), NO_MAIL_SERVER
    return (render(STATUS_TAG, style=row["state"], text=EMAIL_STATES[row["state"]]),
            row["last_reply"] or "")


def send_again_button(visit, row):
    if row["state"] not in SENDABLE_AGAIN:
        return ""
    return visit.button(f"/dashboard/emails/{row['id']}/send-again", "Send again", "secondary")


@page("GET", "/dashboard/emails")
def emails_page(visit):
    result = find_emails(visit.conn, visit.company_id, visit.filters())
    rows = []
    for row in result["data"]:
        state, why = email_state(row, visit.settings)
        rows.append((link(f"/dashboard/emails/{row['id']}", visit.when(row["created_at"])),
                     row["to_address"], row["subject"], state, row["attempts"],
            render(CODE, text=why[:300]), send_again_button(visit, row)))
    return visit.page("Emails", join([
        table(("Written", "Recipient", "Subject", "State", "Attempts", "Last reply", ""),
              rows, numeric=("Attempts",)), pager(visit, result, "/dashboard/emails")]))


@page("GET", "/dashboard/emails/<email_id>")
def email_page(visit, email_id):
    row = load_email(visit.conn, visit.company_id, email_id)
    state, why = email_state(row, visit.settings)
    facts = render(
        EMAIL_FACTS, to=row["to_address"], subject=row["subject"], state=state,
        written=visit.when(row["created_at"]), why=why, again=send_again_button(visit, row),
        next=visit.when(row["next_attempt_at"]) if row["state"] == "pending" else "none")
    attempts = table(("When", "Outcome", "Server's reply", "Duration"),
                     [(visit.when(attempt["attempted_at"]), attempt["outcome"],
                       render(CODE, text=attempt["reply"]), f"{attempt['duration_ms']} ms")
                      for attempt in email_attempts(visit.conn, email_id)])
    return visit.page(f"Email to {row['to_address']}", join([
        facts, render(HEADING, text="Attempts"), attempts]))


@page("POST", "/dashboard/emails/<email_id>/send-again", refused=email_page, right="work")
def send_email_again_action(visit, email_id):
    with visit.write() as conn:
        send_email_again(conn, visit.company_id, email_id)
    return redirect(f"/dashboard/emails/{email_id}", "again")


@page("GET", "/dashboard/settings")
def settings_page(visit):
    company = load_company(visit.conn, visit.company_id)
    settings = visit.settings
    server = render("Emails go through {url}, from {sender}; links in them begin with {base}.",
                    url=describe_smtp_url(settings.smtp_url), sender=settings.mail_from,
                    base=settings.link_base) if settings.smtp_url else NO_MAIL_SERVER
    return visit.page("Settings", visit.form_tag("/dashboard/settings", render(
        SETTINGS_FORM, server=server, stripe=company["stripe_customer_id"] or "none",
        time_zone=visit.select("timeZone", "Time zone (of the times pages show)", [
            (zone, zone) for zone in sorted(time_zones())], company["time_zone"] or "UTC"),
        two_step=visit.select("twoStep", "Two-step sign-in", TWO_STEP_CHOICES,
                              company["two_step"] or ""),
        **settings_fields(visit, company))))


#: The store catalog's orders, as its Order select names them.
CATALOG_SORT_CHOICES = (("newest", "Newest first"), ("name", "Name"),
                        ("price", "Price, lowest first"))


#: The Settings page's choices of new storefront accounts and of a scheduled report.
APPROVAL_CHOICES = (("required", "wait for approval by staff (required)"),
                    ("automatic", "are active at once (automatic)"))
TWO_STEP_CHOICES = (("", "optional: each staff member chooses on their account page"),
                    ("owners", "required of owners (each sets it up at their next page)"))
REPORT_CHOICES = (("", "none"), ("daily", "every day (the day before)"),
                  ("weekly", "every Monday (the week before)"))


def settings_fields(visit, company):
    """The fields of the Settings form, by their place in SETTINGS_FORM (but the time zone)."""
    return dict(
        mail_name=visit.field("mailName", "Mail name (the sender's name on emails; empty: the "
                                          "company name)", company["mail_name"]),
        reply_to=visit.field("replyTo", "Reply-to address", company["reply_to"], kind="email"),
        alerts=visit.field("staffAlerts", "Staff alert addresses (separated by commas)",
                           ", ".join(json.loads(company["staff_alerts"] or "[]"))),
        reports=visit.select("reportPeriod", "A report to the staff alert addresses",
                             REPORT_CHOICES, company["report_period"] or ""),
        buyer_emails=buyer_email_switches(company),
        approval=visit.select("storefrontApproval", "New storefront accounts",
                              APPROVAL_CHOICES, company["storefront_approval"]),
        tax_rate=visit.field("taxRate", f"Tax rate: a fraction from 0 to {MAX_TAX_RATE} (0.0825 "
                             "is 8.25%; a customer's own rate wins)",
                             rate_field_text(company["tax_rate"]), inputmode="decimal"),
        terms=visit.field("paymentTerms", f"Payment terms: days from an invoice to its due "
                          f"date, 0 (due on receipt) to {MAX_PAYMENT_TERMS}; a customer's own "
                          f"terms win", company["payment_terms_days"], inputmode="numeric"))


def buyer_email_switches(company):
    """A box for each email to buyers a company may turn off, ticked while it sends it."""
    off = json.loads(company["buyer_emails_off"] or "[]")
    return render(BUYER_EMAILS, switches=join(
        render(BUYER_EMAIL_SWITCH, value=kind, text=text, checked="" if kind in off else CHECKED)
        for kind, text in BUYER_NOTICES.items()))


@page("POST", "/dashboard/settings", refused=settings_page, right="company")
def update_settings_action(visit):
    changes = {"mail_name": form_text(visit.form, "mailName"),
               "reply_to": form_text(visit.form, "replyTo"),
               "staff_alerts": (visit.form.get("staffAlerts") or "").split(",")}
    for field, column in (("storefrontApproval", "storefront_approval"),
                          ("taxRate", "tax_rate"), ("paymentTerms", "payment_terms_days"),
                          ("reportPeriod", "report_period"), ("timeZone", "time_zone"),
                          ("twoStep", "two_step")):
        if field in visit.form:  # (a form of an older page may not have it)
            changes[column] = visit.form.get(field)
    if "buyerEmailsShown" in visit.form:
        sent = visit.form.getall("buyerEmails")
        changes["buyer_emails_off"] = [kind for kind in BUYER_NOTICES if kind not in sent]
    with visit.write() as conn:
        update_company(conn, visit.company_id, changes)
    return redirect("/dashboard/settings", "saved")


@page("GET", "/dashboard/settings/carriers")
def carriers_page(visit):
    carriers = company_carriers(visit.conn, visit.company_id,
                                visit.settings.tracking_url_templates)
    return visit.page("Carriers", visit.form_tag("/dashboard/settings/carriers", render(
        CARRIERS_FORM, carriers=join(render(CARRIER_FIELDS, code=code, fields=join([
            visit.field(f"{code}.name", "Name", carriers[code]["name"]),
            visit.field(f"{code}.template", "Tracking link", carriers[code]["template"],
                        kind="url")])) for code in NAMED_CARRIERS))))


@page("POST", "/dashboard/settings/carriers", refused=carriers_page,
      right="company")
def update_carriers_action(visit):
    with visit.write() as conn:
        set_company_carriers(conn, visit.company_id, {code: {
            "name": visit.form.get(f"{code}.name"),
            "template": visit.form.get(f"{code}.template")} for code in NAMED_CARRIERS},
            visit.settings.tracking_url_templates)
    return redirect("/dashboard/settings/carriers", "saved")


@page("GET", "/dashboard/staff")
def staff_page(visit):
    rows = []
    for member in list_staff(visit.conn, visit.company_id):
        action = f"/dashboard/staff/{member['id']}"
        form = visit.for_form(action, member["id"])
        rows.append((member["email"], member["role"], form.form_tag(action, join([
            form.select("role", "Role", [(role, role) for role in STAFF_ROLES],
                        member["role"]), render(SUBMIT, text="Change role")]), css="inline")))
    invite = visit.form_tag("/dashboard/staff/invite", join([
        render(HEADING, text="Invite a staff member"),
        visit.field("email", "Email", kind="email", autocomplete="off"),
        visit.select("role", "Role", [(role, role) for role in STAFF_ROLES], "staff"),
        render(SUBMIT, text="Email an invitation")]), css="card")
    return visit.page("Staff", join([table(("Email", "Role", "Change"), rows), invite]))


@page("POST", "/dashboard/staff/invite", refused=staff_page, right="company")
def invite_staff_action(visit):
    with visit.write() as conn:
        invite_staff(conn, visit.company_id, visit.form.get("email"), visit.form.get("role"),
                     visit.surface.now_ms())
    return redirect("/dashboard/staff", "staff-invited")


@page("POST", "/dashboard/staff/<staff_id>", refused=staff_page, right="company")
def update_staff_action(visit, staff_id):
    with visit.write() as conn:
        update_staff_role(conn, visit.company_id, staff_id, visit.form.get("role"))
    return redirect("/dashboard/staff", "role")


@page("GET", "/dashboard/account")
def staff_account_page(visit):
    staff = load_staff(visit.conn, visit.company_id, visit.session["account_id"])
    return visit.page("Your account", join([render(
        STAFF_ACCOUNT, email=staff["email"], role=staff["role"],
        company=visit.session["company_name"]), two_step_state(visit, staff)]))


def two_step_state(visit, staff):
    """The account's two-step sign-in: off, being set up (the key, and the code that turns it
    on), or on (and the ways to a new key or off)."""
    start = password_form(visit, "/dashboard/account/two-step/start", render(
        SUBMIT, text="Set up a new key" if staff["totp_secret"] else "Set up two-step sign-in"))
    if staff["totp_pending"]:
        return render(TWO_STEP_SETUP, key=" ".join(textwrap.wrap(staff["totp_pending"], 4)),
                      uri=totp_uri(staff, visit.session["company_name"]),
                      form=visit.form_tag("/dashboard/account/two-step", join([
                          visit.field("code", "The code the app shows now",
                                      autocomplete="one-time-code", inputmode="numeric"),
                          render(SUBMIT, text="Turn on")]), css=""))
    if staff["totp_secret"]:
        return render(TWO_STEP_ON, left=recovery_codes_left(visit.conn, staff["id"]),
                      renew=start, off=password_form(visit, "/dashboard/account/two-step/off",
                                                     render(BUTTON, css="danger",
                                                            text="Turn off")))
    return render(TWO_STEP_OFF, start=start)


def password_form(visit, action, button):
    """A form whose one field is the account's password, which allows its change (its
    field's ID its own, and what was refused shown only on it)."""
    view = visit.for_form(action, action.rsplit("/", 1)[-1])
    return view.form_tag(action, join([view.field(
        "password", "Your password", kind="password", autocomplete="current-password"), button]))


@page("POST", "/dashboard/account/two-step/start", refused=staff_account_page, right="own")
def start_two_step_action(visit):
    with visit.proving_password("password") as conn:
        start_two_step(conn, visit.company_id, visit.session["account_id"],
                       visit.form.get("password"))
    return redirect("/dashboard/account")


@page("POST", "/dashboard/account/two-step", refused=staff_account_page, right="own")
def confirm_two_step_action(visit):
    """Answers with the page itself: the recovery codes are shown once."""
    with visit.write() as conn:
        codes = confirm_two_step(conn, visit.company_id, visit.session["account_id"],
                                 visit.form.get("code"), visit.surface.now_ms())
    visit.notice = render(RECOVERY_CODES_SHOWN, codes=join(
        render(LIST_ITEM, text=code) for code in codes))
    visit.session = {**visit.session, "two_step_on": True}
    return staff_account_page(visit)


@page("POST", "/dashboard/account/two-step/off", refused=staff_account_page, right="own")
def end_two_step_action(visit):
    with visit.proving_password("password") as conn:
        end_two_step(conn, visit.company_id, visit.session["account_id"],
                     visit.form.get("password"))
    return redirect("/dashboard/account", "two-step-off")


def refuse_greedy_forms():
    """before_request: a page's POST whose body is over MAX_FORM_BYTES, or has more than
    MAX_FORM_FIELDS fields, is answered 413 before anything parses it."""
    request = bottle.request
    if request.method != "POST" or not request.path.startswith(("/dashboard/", "/store/")):
        return
    if request.content_length > MAX_FORM_BYTES:
        raise bottle.HTTPResponse(FORM_TOO_LARGE, 413, {"Content-Type": "text/plain"})
    content_type = request.content_type
    body = request.body.read(MAX_FORM_BYTES + 1)
    request.body.seek(0)
    if len(body) > MAX_FORM_BYTES:  # a body sent in chunks has no length to check first
        raise bottle.HTTPResponse(FORM_TOO_LARGE, 413, {"Content-Type": "text/plain"})
    if content_type.startswith("multipart/"):
        boundary = content_type.partition("boundary=")[2].split(";")[0].strip('" ')
        fields = body.count(b"--" + boundary.encode("latin-1", "replace")) - 1
    else:
        fields = body.count(b"&") + 1
    if fields > MAX_FORM_FIELDS:
        raise bottle.HTTPResponse(FORM_TOO_LARGE, 413, {"Content-Type": "text/plain"})


def install_dashboard(app):
    if not app.service.settings.dashboard:
        return
    app.dashboard = Surface(app.service, "/dashboard", SESSION_COOKIE, STAFF,
                            "/dashboard/orders", NAVIGATION)
    app.dashboard.install(app)
    app.route("/", "GET", lambda: redirect("/dashboard"))


# 15.3 Storefront -----------------------------------------------------------------------------
# Every company's store, at /store/{slug}, where its buyers (customers, the second kind of
# account) register, sign in, and set their passwords through emailed links. One StoreSurface
# serves every store: its prefix, cookie path and accounts are those of the slug in the request
# (an unknown slug is a 404 page), and a session of one store is worth nothing in another. The
# signed-out forms (register, sign-in, reset) answer the same page whether or not an address
# has an account; what differs goes by email, to the address's owner.

STORE_SESSION_COOKIE = "ordering_store_session"
#: A random value of the browser's, set with a signed-out form, that its CSRF token is made of.
STORE_FORM_COOKIE = "ordering_store_form"
STORE_NOT_FOUND = "There is no store at this address."


def may(visit, right):
    """Whether the signed-in contact's role has this right (of ROLE_RIGHTS)."""
    return right in ROLE_RIGHTS[visit.session["role"]]


def signed_in_contact(visit):
    return load_contact(visit.conn, visit.company_id, visit.session["account_id"])


class StoreSurface(Surface):
    """The storefront: a Surface whose prefix is the store of the request."""

    def __init__(self, service):  # prefix, home and navigation are the request's, below
        self.service, self.cookie, self.accounts = service, STORE_SESSION_COOKIE, CONTACTS
        self.form_cookie = STORE_FORM_COOKIE
        self.clock = time.time

    prefix = property(lambda self: "/store/" + self.store()["slug"])
    home = property(lambda self: self.prefix + "/products")  # where a sign-in leads

    def navigation_of(self, visit):
        """The links of the contact's role: each page it may open."""
        prefix, links = self.prefix, [("Catalog", self.prefix + "/products")]
        if may(visit, "order"):
            lines = cart_size(visit.conn, visit.session["account_id"])
            links.append((f"Cart ({lines})", prefix + "/cart"))
        links.append(("Orders", prefix + "/orders"))
        if may(visit, "manage") or visit.session["approval_limit_cents"] is not None:
            links.append(("Requests", prefix + "/requests"))
        if may(visit, "statements"):
            links.append(("Statement", prefix + "/statement"))
        if may(visit, "manage"):
            links.append(("Contacts", prefix + "/contacts"))
        return links + [("Account", prefix + "/account")]

    def store(self):
        return bottle.request.environ["ordering.store"]

    def site(self):
        return self.store()["name"]

    def account_company(self):
        return self.store()["id"]

    def install(self, app):
        def bind(handler, refused):
            return self.in_store(lambda **url_args: self.serve(handler, refused, url_args))
        base = "/store/<slug>"
        for method, path, handler, refused, _ in PAGES:
            if path.startswith(base + "/"):
                app.route(path, method, bind(handler, refused))
        for method, path, callback in self.signed_out_routes() + [
                ("GET", "", self.front_page), ("GET", "/verify/<token>", self.verify),
                ("GET", "/register", self.register_page), ("POST", "/register", self.register)]:
            app.route(base + path, method, self.in_store(callback))
        app.route(base + "/style.css", "GET", lambda slug: self.stylesheet())

    def in_store(self, callback):
        """callback, answering for the store of the URL's slug (an unknown one: a 404 page)."""
        def handler(slug, **url_args):
            try:
                bottle.request.environ["ordering.store"] = company_by_slug(
                    self.service.db.conn, slug)
            except ApiError:
                self.headers()
                bottle.response.status = 404
                return render(BARE_LAYOUT, prefix="/store/" + slug, title="Not found",
                              site="ordering", notice="",
                              body=render(NO_STORE, message=STORE_NOT_FOUND))
            return callback(**url_args)
        return handler

    def session(self):
        found, token = super().session()
        if found is None or found["company_id"] != self.store()["id"]:
            return None, None
        return found, token

    def refused_form(self):
        return self.public_page("Refused", render(ALERT, message=CSRF_REFUSED), 403)

    def public_page(self, title, body, status=200, notice=""):
        """A page for a visitor who may not be signed in: the store's name, and the way in."""
        self.headers()
        bottle.response.status = status
        return render(LAYOUT, prefix=self.prefix, title=title, site=self.site(),
                      header=render(STORE_BAR, store=self.site(), prefix=self.prefix),
                      notice=notice, body=body)

    def sign_in_links(self):
        return render(STORE_SIGN_IN_LINKS, prefix=self.prefix)

    def second_step_needed(self, account):
        return False

    @staticmethod
    def must_set_up_two_step(session):
        return False

    def front_page(self):
        """Signed out, a welcome without prices; signed in, the catalog (or, awaiting
        approval, the page that says so)."""
        self.headers()
        found, token = self.session()
        if found is None:
            return self.public_page("Welcome", render(STORE_WELCOME, store=self.site(),
                                                      prefix=self.prefix))
        visit = Visit(self, found, token)
        if load_customer(visit.conn, visit.company_id, found["customer_id"])["status"] != "ACTIVE":
            return awaiting_approval(visit)
        return redirect(self.prefix + "/products")

    def register_page(self, errors=None, status=200):
        form = bottle.request.forms.decode() if errors else {}
        return self.form_page("Register", self.prefix + "/register", (
            ("email", "Email", "email", "username", form.get("email", "")),
            ("name", "Name (your business)", "text", "organization", form.get("name", "")),
            ("password", f"Password (at least {PASSWORD_MIN} characters)", "password",
             "new-password", "")), "Register", errors, status,
            render(STORE_REGISTER_LINKS, prefix=self.prefix))

    def register(self):
        if not self.form_matches():
            return self.refused_form()
        if not self.address_allowed():
            return self.too_many("Register")
        form = bottle.request.forms.decode()
        try:
            with self.service.db.write() as conn:
                register_customer(conn, self.store()["slug"], form.get("email"),
                                  form.get("name"), form.get("password", ""), self.now_ms())
        except ApiError as error:
            return self.register_page(form_errors(error), error.status)
        return redirect(self.prefix + "/check-email?sent=register")

    def after_registration(self):
        return STORE_APPROVAL_NEXT if self.store()["storefront_approval"] == "required" else ""

    def send_reset_link(self, conn, email, now_ms):
        request_password_reset(conn, self.store()["slug"], email, now_ms)

    def password_link(self, conn, token, now_ms):
        return account_link(conn, self.store()["id"], "reset", token, now_ms)

    def set_password_by_link(self, conn, token, password, now_ms):
        reset_password(conn, self.store()["slug"], token, password, now_ms)

    def verify(self, token):
        try:
            with self.service.db.write() as conn:
                verify_customer_email(conn, self.store()["slug"], token, self.now_ms())
        except ApiError as error:
            if error.message == EMAIL_VERIFIED_ALREADY:
                return self.sign_in_page(notice=error.message)
            bottle.response.status = error.status
            return self.reset_page(error.message)
        return self.sign_in_page(notice=EMAIL_VERIFIED)


@page("GET", "/store/<slug>/account")
def account_page(visit):
    customer = load_customer(visit.conn, visit.company_id, visit.session["customer_id"])
    prefix = visit.surface.prefix
    password = visit.for_form(prefix + "/account/password", "password")
    business = visit.form_tag(prefix + "/account", join([
        visit.field("name", "Name (your business)", customer["name"],
                    autocomplete="organization"), render(SUBMIT, text="Save")]))
    return visit.page("Your account", join([
        render(ACCOUNT_STATUS, tag=status_tag(customer["status"])),
        render(NOTE, text=ROLE_NOTE.format(business=customer["name"] or customer["email"],
                                            role=visit.session["role"])),
        business if may(visit, "manage") else "",
        password.form_tag(prefix + "/account/password", render(
            PASSWORD_FORM, current=visit.field("currentPassword", "Current password",
                                               kind="password", autocomplete="current-password"),
            new=visit.field("password", f"New password (at least {PASSWORD_MIN} characters)",
                            kind="password", autocomplete="new-password"))),
        render(HEADING, text="Shipping addresses"), addresses_section(visit, customer["id"])]))


def addresses_section(visit, customer_id):
    """The business's saved addresses, each with its Remove button for its admins."""
    prefix = visit.surface.prefix
    return join(render(ADDRESS_CARD, address=address_text(address_of(row)),
                       remove=visit.button(f"{prefix}/account/addresses/{row['id']}/delete",
                                           "Remove", "secondary") if may(visit, "manage") else "")
                for row in customer_addresses(visit.conn, customer_id)) or render(NO_ADDRESSES)


@page("POST", "/store/<slug>/account", refused=account_page)
def update_account_action(visit):
    if not may(visit, "manage"):
        raise ApiError(403, ROLE_REFUSED)
    with visit.write() as conn:
        update_customer(conn, visit.company_id, visit.session["customer_id"],
                        {"name": form_text(visit.form, "name")})
    return redirect(visit.surface.prefix + "/account")


@page("POST", "/store/<slug>/account/verify")
def resend_verification_action(visit):
    with visit.write() as conn:
        sent = resend_verification(conn, visit.company_id, visit.session["account_id"],
                                   visit.surface.now_ms())
    return redirect(visit.surface.prefix + "/products", "link-sent" if sent else "link-not-sent")


@page("POST", "/store/<slug>/account/password", refused=account_page)
def change_password_action(visit):
    with visit.proving_password("currentPassword") as conn:
        change_contact_password(conn, visit.company_id, visit.session["account_id"],
                                visit.form.get("currentPassword"),
                                visit.form.get("password", ""))
    visit.surface.start_session(signed_in_contact(visit))
    return redirect(visit.surface.prefix + "/account")


# Ordering at the store: the catalog at the buyer's own prices, the cart (kept on the server),
# quick order and reorder, checkout, the buyer's orders with their timeline, tracking and
# returns. These pages are for ACTIVE buyers (buyer_page): one awaiting approval sees that it
# does, and no prices. Buyers see how much stock there is as a level, never the count.

def awaiting_approval(visit, status=200):
    return visit.page("Awaiting approval", render(STORE_AWAITING, store=visit.surface.site()),
                      status)


def awaiting_confirmation(visit, status=200):
    path = visit.surface.prefix + "/account/verify"
    return visit.page("Confirm your email address", render(
        STORE_UNVERIFIED, email=visit.session["email"],
        form=visit.button(path, "Email me a new link", "secondary")), status)


def buyer_page(method, path, refused=None, right=None):
    """A page of the store's prices or ordering, for the contacts of ACTIVE customers whose
    role has right (of ROLE_RIGHTS; None: any role): one awaiting approval sees that it does
    (and a form it sends changes nothing), any other is refused."""
    def register(handler):
        @functools.wraps(handler)
        def for_buyers(visit, **url_args):
            try:
                require_contact(visit.conn, visit.company_id, visit.session["account_id"],
                                right)
            except ApiError as error:
                if error.message == CUSTOMER_PENDING:
                    return awaiting_approval(visit, 403 if method == "POST" else 200)
                if error.message == CUSTOMER_UNVERIFIED:
                    return awaiting_confirmation(visit, 403 if method == "POST" else 200)
                return visit.refusal(error)
            return handler(visit, **url_args)
        page(method, path, refused)(for_buyers)
        return handler
    return register


#: Each stock level's style (see stock_level()).
LEVEL_STYLES = dict(zip(STOCK_LEVELS, ("in", "low", "out")))


_LEVEL_TAGS = {level: render(LEVEL_TAG, style=style, level=level)
               for level, style in LEVEL_STYLES.items()}


def level_tag(product):
    return _LEVEL_TAGS[stock_level(product)]


#: The catalog's rows kept rendered (see catalog_row): about 4 KiB each with its key, so at
#: most some 4 MiB a process, twenty pages of 50.
CATALOG_ROWS_KEPT = 1024
_CATALOG_ROWS = Kept(CATALOG_ROWS_KEPT)


def catalog_row(prefix, product, price, adds):
    """A product's row of the catalog (adds: with the form that puts it in the cart, its CSRF
    token left to fill: see render_rows). The row is all its product (a row of CATALOG_COLUMNS),
    price and form make it, so it is kept under them: a product or price that changed is
    another key."""
    return _CATALOG_ROWS.get((prefix, adds, price, tuple(product)),
                             lambda: new_catalog_row(prefix, product, price, adds))


def new_catalog_row(prefix, product, price, adds):
    terms = selling_text(product)
    values = dict(image=product_image(product, "thumb"),
                  href=f"{prefix}/products/{product['id']}", name=product["name"],
                  sku=product["sku"] or "", unit=product["unit"] or "",
                  terms=render(TERMS, text=terms) if terms else "", price=cents_text(price),
                  level=level_tag(product))
    if adds:
        values.update(cart=prefix + "/cart", most=MAX_QUANTITY, id=product["id"],
                      start=fitted_quantity(product, 1))
    return (STORE_CATALOG_ROW if adds else STORE_CATALOG_ROW_VIEW).partial(**values)


def product_image(product, css):
    """A product's image, when it has one at an https address (the only kind the pages'
    Content-Security-Policy lets a browser load); "" otherwise."""
    url = product["image_url"]
    if not url or not url.lower().startswith("https://"):
        return ""
    return render(PRODUCT_IMAGE, css=css, url=url, name=product["name"])


def selling_text(product):
    """How a product is sold, in a buyer's words: its quantity rule and its price breaks ("" for
    neither)."""
    rule = quantity_rule_text(product)
    breaks = "; ".join(f"{units} or more: {cents_text(cents)} each"
                       for units, cents in price_breaks_of(product))
    return ". ".join(filter(None, ["Sold " + rule if rule else "", breaks]))


#: What the cart warns of after a quick order (unknown SKUs) or a reorder (products no
#: longer sold): the redirect's query parameter, and the words before its values.
NOT_ADDED = {"unknown": "Not found or no longer sold (SKU):",
             "skipped": "No longer sold, so not added:"}
#: Values of a NOT_ADDED parameter the redirect names (the rest it counts), so that its
#: address stays short.
MAX_NOT_ADDED_NAMED = 20


def added_redirect(visit, result, kind, missing):
    """To the cart, once a quick order or a reorder (its result) put in it what it could:
    the cart says so, and warns of what it could not add (missing, of NOT_ADDED's kind)."""
    done = "fitted" if result["fitted"] else "added" if result["added"] else "nothing-added"
    named = missing[:MAX_NOT_ADDED_NAMED]
    if len(missing) > len(named):
        named.append(f"and {len(missing) - len(named)} more")
    query = "?" + urllib.parse.urlencode({kind: named}, doseq=True) if named else ""
    return redirect(f"{visit.surface.prefix}/cart{query}", done)


def not_added_warnings():
    """The cart's warnings of what a quick order or a reorder could not add (see
    added_redirect), each in an element of its own, apart from the notice of what it did."""
    query = bottle.request.query.decode()
    return join(render(FORM_ALERT, message=f"{words} {', '.join(query.getall(kind))}")
                for kind, words in NOT_ADDED.items() if query.getall(kind))


def address_text(address):
    return ", ".join(country_text(address, name) for name, *_ in ADDRESS_FIELDS
                     if address.get(name))


def lines_table(lines, total, rate, tax):
    """A cart's or an order's lines: [(product, quantity, unit price, line total)], cents,
    and their total (see total_rows)."""
    return table(("Product", "Quantity", "Unit price", "Line total"),
                 [*lines, *((label, "", "", amount)
                            for label, amount in total_rows(total, rate, tax))],
                 numeric=("Quantity", "Unit price", "Line total"))


@buyer_page("GET", "/store/<slug>/products")
def catalog_page(visit):
    query, prefix = visit.filters(), visit.surface.prefix
    result, prices = catalog(visit.conn, visit.company_id, visit.session["customer_id"], query)
    adds = may(visit, "order")
    rows = [catalog_row(prefix, product, prices[product["id"]], adds)
            for product in result["data"]]
    rows = [render_rows(rows, **{"csrf": visit.csrf} if adds else {})] if rows else []
    return visit.page("Catalog", join([
        catalog_filters(visit, query),
        table(("Product", "Your price", "Availability", ""), rows, numeric=("Your price",)),
        catalog_pages(visit, result, prefix + "/products")]))


def catalog_filters(visit, query):
    """The catalog's search, category and order."""
    categories = store_categories(visit.conn, visit.company_id)
    return render(FILTERS, path=visit.surface.prefix + "/products", button="Search",
                  fields=join([
                      visit.field("search", "Search", query.get("search"), kind="search"),
                      visit.select("category", "Category",
                                   [("", "All categories")] + [(c, c) for c in categories],
                                   query.get("category")),
                      visit.select("sort", "Order", CATALOG_SORT_CHOICES, query.get("sort"))]))


def catalog_pages(visit, result, path):
    """First, previous and next pages of the catalog, keeping its search, category and order."""
    kept = {name: value for name, value in visit.filters().items()
            if name in ("search", "category", "sort", "limit")}
    pages = [("First page", kept if result["previous"] else None),
             ("Previous page", kept | {"before": result["previous"]} if result["previous"]
              else None),
             ("Next page", kept | {"cursor": result["pagination"]["nextCursor"]}
              if result["pagination"]["nextCursor"] else None)]
    links = [link(f"{path}?{urllib.parse.urlencode(query)}", text)
             for text, query in pages if query is not None]
    return render(PAGE_LINKS, links=join(links)) if links else ""


@buyer_page("GET", "/store/<slug>/products/<product_id>")
def store_product_page(visit, product_id):
    product, price = store_product(visit.conn, visit.company_id, visit.session["customer_id"],
                                   product_id)
    return visit.page(product["name"], render(
        STORE_PRODUCT, image=product_image(product, "photo"), sku=product["sku"] or "",
        category=product["category"] or "",
        unit=product["unit"] or "", price=cents_text(price), level=level_tag(product),
        terms=selling_text(product) or "in any quantity",
        description=render(PARAGRAPH, text=product["description"])
        if product["description"] else "",
        add=render(STORE_ADD_FORM, cart=visit.surface.prefix + "/cart", csrf=visit.csrf,
                   most=MAX_QUANTITY, id=product_id, name=product["name"],
                   start=fitted_quantity(product, 1)) if may(visit, "order") else ""))


@buyer_page("GET", "/store/<slug>/cart", right="order")
def cart_page(visit):
    prefix = visit.surface.prefix
    cart = cart_of(visit.conn, visit.company_id, visit.session["account_id"])
    rows = [cart_row(visit, line) for line in cart["lines"]]
    listed = join([lines_table(rows, cart["total"], cart["taxRate"], cart["tax"]),
                   render(CHECK_OUT, prefix=prefix)]) \
        if rows else render(CART_EMPTY_CARD, message=CART_EMPTY, prefix=prefix)
    quick = visit.form_tag(prefix + "/cart/quick-order", render(
        QUICK_ORDER_FORM,
        lines=visit.field("lines", "SKUs and quantities", kind="textarea", rows="5"),
        file=visit.field("file", "Or a CSV file", kind="file",
                         accept=".csv,text/csv,text/plain")), files=True)
    return visit.page("Your cart", join([not_added_warnings(), visit.error("cart"), listed,
                                         quick]))


def cart_row(visit, line):
    """A line of the cart: its product (with Remove), its quantity's form, its prices."""
    prefix, product = visit.surface.prefix, line["product"]
    action = f"{prefix}/cart/lines/{product['id']}"
    view = visit.for_form(action, product["id"])
    name = link(f"{prefix}/products/{product['id']}", product["name"]) if line["sold"] \
        else render(NO_LONGER_SOLD, name=product["name"])
    field_id, label = "quantity" + view.id_suffix, "Quantity of " + product["name"]
    quantity = view.form_tag(action, render(
        CART_QUANTITY, id=field_id, most=MAX_QUANTITY, name=product["name"],
        quantity=view.value("quantity", line["quantity"]),
        invalid=view.invalid("quantity", field_id),
        error=view.error("quantity", field_id, label)), css="inline")
    remove = visit.button(action + "/remove", render(REMOVE_LINE, name=product["name"]),
                          "secondary")
    terms = selling_text(product)
    return (join([name, render(TERMS, text=terms) if terms else "", LINE_BREAK, remove]),
            quantity, join([cents_text(line["unitPrice"]), price_reason(line)]),
            cents_text(line["lineTotal"]))


def price_reason(line):
    """Under a cart line's unit price: which price applied, and what one more case saves."""
    why = "" if line["why"] == "catalog" else line["why"] + (
        " units" if line["why"].startswith("from ") else "")
    more = line["next"] and (f"{line['next'][0]} more: {cents_text(line['next'][1])} each")
    return join(render(TERMS, text=text) for text in (why, more) if text)


@buyer_page("POST", "/store/<slug>/cart", refused=cart_page, right="order")
def add_to_cart_action(visit):
    quantity = form_number(visit.form, "quantity")
    with visit.write() as conn:
        _, _, note = add_to_cart(conn, visit.company_id, visit.session["account_id"],
                                 visit.form.get("productId", ""), quantity)
    return redirect(visit.surface.prefix + "/cart", "fitted" if note else "added")


@buyer_page("POST", "/store/<slug>/cart/lines/<product_id>", refused=cart_page, right="order")
def cart_quantity_action(visit, product_id):
    with visit.write() as conn:
        _, note = set_cart_quantity(conn, visit.company_id, visit.session["account_id"],
                                    product_id, form_number(visit.form, "quantity"))
    return redirect(visit.surface.prefix + "/cart", "fitted" if note else None)


@buyer_page("POST", "/store/<slug>/cart/lines/<product_id>/remove", refused=cart_page,
            right="order")
def remove_from_cart_action(visit, product_id):
    with visit.write() as conn:
        set_cart_quantity(conn, visit.company_id, visit.session["account_id"], product_id, 0)
    return redirect(visit.surface.prefix + "/cart")


@buyer_page("POST", "/store/<slug>/cart/quick-order", refused=cart_page, right="order")
def quick_order_action(visit):
    text = uploaded_text("file")
    with visit.write() as conn:
        result = quick_order(conn, visit.company_id, visit.session["account_id"],
                             visit.form.get("lines", "") if text is None else text)
    return added_redirect(visit, result, "unknown", result["unknown"])


@buyer_page("POST", "/store/<slug>/cart/reorder", refused=cart_page, right="order")
def reorder_action(visit):
    with visit.write() as conn:
        result = reorder(conn, visit.company_id, visit.session["account_id"],
                         visit.form.get("orderId", ""))
    return added_redirect(visit, result, "skipped", result["skipped"])


@buyer_page("GET", "/store/<slug>/checkout", right="order")
def checkout_page(visit):
    prefix, cart = visit.surface.prefix, cart_of(visit.conn, visit.company_id,
                                                 visit.session["account_id"])
    if not cart["lines"]:
        return visit.page("Checkout", render(CART_EMPTY_CARD, message=CART_EMPTY, prefix=prefix))
    limit = visit.session["approval_limit_cents"]
    above = limit is not None and cart["total"] + cart["tax"] > limit
    form = visit.form_tag(prefix + "/checkout", render(
        CHECKOUT_FORM, token=visit.value("token", secrets.token_urlsafe(24)),
        address=address_fields(visit, customer_addresses(visit.conn,
                                                         visit.session["customer_id"])),
        po=visit.field("poNumber", "PO number (optional)", maxlength=MAX_PO_NUMBER),
        notes=visit.field("notes", "Notes (optional)", kind="textarea",
                          maxlength=MAX_ORDER_NOTES),
        button="Ask for approval" if above else "Place order"))
    note = render(CARD, body=render(PARAGRAPH, text=APPROVAL_NEEDED.format(
        limit=cents_text(limit)))) if above else ""
    return visit.page("Checkout", join([cart_summary(cart), note, form]))


def cart_summary(cart):
    """A cart's lines and totals, as checkout shows them above its form."""
    return lines_table([(line["product"]["name"], line["quantity"],
                         cents_text(line["unitPrice"]), cents_text(line["lineTotal"]))
                        for line in cart["lines"]], cart["total"], cart["taxRate"], cart["tax"])


def address_fields(visit, saved):
    """Where an order ships: one of the buyer's saved addresses, or a new one, whose fields
    show only while it is the one chosen."""
    fields = render(NEW_ADDRESS, fields=address_controls(visit))
    if not saved:
        return fields
    return join([render(SHIP_TO_CHOICE, choice=visit.radios("addressId", "Ship to", [
        (row["id"], address_text(address_of(row))) for row in saved] + [
        ("", "A new address")], saved[0]["id"])), fields])


@buyer_page("POST", "/store/<slug>/checkout", refused=checkout_page, right="order")
def checkout_action(visit):
    form, me = visit.form, visit.session["account_id"]
    address_id = form.get("addressId") or None
    address = None if address_id else {name: form.get(name) for name, *_ in ADDRESS_FIELDS}
    try:
        with visit.write() as conn:
            kind, made = checkout(conn, visit.surface.store()["slug"], me, form.get("token"),
                                  address_id, address, form_text(form, "poNumber"),
                                  form_text(form, "notes"))
    except sqlite3.IntegrityError:  # the same form, sent twice at once: the other placed it
        done = checkout_result(visit.conn, signed_in_contact(visit), form.get("token"))
        if done is None:
            raise
        kind, made = done
    return redirect(f"{visit.surface.prefix}/{kind}/{made}",
                    "placed" if kind == "orders" else "requested")


@buyer_page("GET", "/store/<slug>/orders")
def store_orders_page(visit):
    query, prefix = visit.filters(), visit.surface.prefix
    result = buyer_orders(visit.conn, visit.company_id, visit.session["customer_id"], query)
    rows = [(link(f"{prefix}/orders/{row['id']}", row["number"]), visit.when(row["created_at"]),
             status_tag(row["status"]), row["po_number"] or "",
             cents_text(row["total_cents"] + row["tax_cents"])) for row in result["data"]]
    filters = render(FILTERS, path=prefix + "/orders", button="Filter", fields=visit.select(
        "status", "Status", [("", "Any")] + [(s, s) for s in ORDER_STATUSES],
        query.get("status")))
    return visit.page("Your orders", join([
        filters, table(("Order", "Placed", "Status", "PO number", "Total"), rows,
                       numeric=("Total",)), pager(visit, result, prefix + "/orders")]))




@buyer_page("GET", "/store/<slug>/orders/<order_id>")
def store_order_page(visit, order_id):
    conn, prefix, me = visit.conn, visit.surface.prefix, visit.session["customer_id"]
    row = buyer_order(conn, visit.company_id, me, order_id)
    order = orders_with_items(conn, [row])[0]
    address = shipping_address_of(row)
    return visit.page(f"Order {row['number']}", render(
        STORE_ORDER_PAGE, facts=render(
            STORE_ORDER_FACTS, status=status_tag(order["status"]),
            placed=visit.when(order["createdAt"]), po=order["poNumber"] or "none",
            notes=order["notes"] or "none", invoice=buyer_invoice_link(visit, order_id),
            people=placed_by_text(conn, row),
            total=cents_text(row["total_cents"] + row["tax_cents"])),
        tracking=tracking_card(order["tracking"], company_carriers(conn, visit.company_id)),
        ship_to=render(SHIP_TO, address=address_lines(address)) if address else "",
        lines=buyer_order_lines(order, row),
        timeline=order_timeline(visit, order_id),
        again=visit.button(prefix + "/cart/reorder", "Order these again", "secondary",
                           orderId=order_id) if may(visit, "order") else "",
        returns=buyer_order_returns(visit, row)))


def buyer_invoice_link(visit, order_id):
    invoice = order_invoice(visit.conn, order_id)
    if invoice is None:
        return "not yet: an order is invoiced as it ships"
    return join([link(f"{visit.surface.prefix}/invoices/{invoice['id']}", invoice["number"]),
                 " ", status_tag(invoice["status"])])


@buyer_page("GET", "/store/<slug>/invoices/<invoice_id>", right="statements")
def store_invoice_page(visit, invoice_id):
    invoice = buyer_invoice(visit.conn, visit.company_id, visit.session["customer_id"],
                            invoice_id)
    return visit.page(f"Invoice {invoice['number']}", invoice_document(
        visit, invoice, f"{visit.surface.prefix}/orders/{invoice['order_id']}"))


@buyer_page("GET", "/store/<slug>/statement", right="statements")
def store_statement_page(visit):
    conn, me, prefix = visit.conn, visit.session["customer_id"], visit.surface.prefix
    since = statement_since(visit)
    invoices = find_customer_invoices(conn, visit.company_id, customer_id=me,
                                      open_or_since=since)
    rows = [(link(f"{prefix}/invoices/{row['id']}", row["number"]), day_tag(row["issued_at"]),
             day_tag(row["due_at"]), status_tag(row["status"]), cents_text(row["total_cents"]),
             cents_text(balance_cents(row)))
            for row in invoices]
    return visit.page("Statement", join([
        statement_section(visit, me, prefix + "/statement", prefix + "/invoices/"),
        render(HEADING, text="Open invoices and the period's" if since else "Invoices"), table(
            ("Invoice", "Issued", "Due", "Status", "Total", "Balance"), rows,
            numeric=("Total", "Balance"))]))


def tracking_card(tracking, carriers):
    """A shipped order's carrier (by its name in carriers, company_carriers') and tracking
    number, with a link to track it (none: "")."""
    if not tracking:
        return ""
    return render(STORE_TRACKING, carrier=carriers[tracking["carrier"]]["name"],
                  number=tracking["number"],
                  track=render(TRACK_PARCEL, url=tracking["url"]) if tracking["url"] else "")


def buyer_order_lines(order, row):
    return lines_table([(join([item["productName"], " ",
                               render(MUTED, text=item["productSku"] or "")]),
                         item["quantity"], amount_text(item["unitPrice"]),
                         cents_text(line_total_cents(item)))
                        for item in order["items"]], row["total_cents"], row["tax_rate"],
                       row["tax_cents"])


def order_timeline(visit, order_id):
    return render(TIMELINE, steps=join(
        render(TIMELINE_STEP, tag=status_tag(change["to_status"]),
               at=visit.when(change["created_at"]))
        for change in status_changes(visit.conn, visit.company_id, order_id)))


def buyer_order_returns(visit, order):
    """The order's returns as their buyer sees them, and the form that opens one (for a
    shipped or delivered order with units not yet in a return)."""
    conn, order_id = visit.conn, order["id"]
    returns = returns_of_order(conn, visit.company_id, order_id)
    lines = return_lines_of(conn, [r["id"] for r in returns])
    shown = [render(STORE_RETURN, opened=visit.when(r["created_at"]), status=status_tag(r["status"]),
                    refund=render(REFUNDED, amount=cents_text(r["amount_cents"]))
                    if r["amount_cents"] is not None else "",
                    lines=render(LIST, items=join(render(LIST_ITEM, text=f"{units} x {name}")
                                                  for name, _, units in lines[r["id"]])),
                    reason=r["reason"])
             for r in returns]
    form = return_request_form(visit, order) if may(visit, "order") else ""
    if not shown and not form:
        return ""
    return join([render(HEADING, text="Returns"), *shown, form])


def return_request_form(visit, order):
    """The form that opens a return, for a shipped or delivered order with units not yet in
    a return ("" for any other)."""
    if order["status"] not in RETURNABLE_ORDER_STATUSES:
        return ""
    returnable = {item_id: found for item_id, found in
                  returnable_units(visit.conn, order["id"]).items() if found[1] > 0}
    if not returnable:
        return ""
    return visit.form_tag(f"{visit.surface.prefix}/orders/{order['id']}/returns", render(
        RETURN_FORM, units=visit.group(
            "lines", "How many units of each line go back (0: none of that line)", join(
                visit.field("units-" + item_id, f"{name} (up to {left})", "0", kind="number",
                            min="0", max=str(left))
                for item_id, (name, left) in returnable.items())),
        reason=visit.field("reason", "Reason", kind="textarea",
                           maxlength=RETURN_REASON_LENGTH[1])))


@buyer_page("POST", "/store/<slug>/orders/<order_id>/returns", refused=store_order_page,
            right="order")
def request_return_action(visit, order_id):
    with visit.write() as conn:
        open_return(conn, visit.company_id, order_id, visit.form.get("reason"),
                    lines=form_units(visit.form, "units-"),
                    customer_id=visit.session["customer_id"])
    return redirect(f"{visit.surface.prefix}/orders/{order_id}", "returned")


@buyer_page("POST", "/store/<slug>/account/addresses/<address_id>/delete",
            refused=account_page, right="manage")
def delete_address_action(visit, address_id):
    with visit.write() as conn:
        delete_address(conn, visit.session["customer_id"], address_id)
    return redirect(visit.surface.prefix + "/account")


# A business's people and its order requests: its admins invite and change its contacts, and
# approve or decline what its buyers asked for above their limits (docs/contacts.md).

@buyer_page("GET", "/store/<slug>/contacts", right="manage")
def store_contacts_page(visit):
    prefix, customer_id = visit.surface.prefix, visit.session["customer_id"]
    return visit.page("Contacts", join([
        contacts_table(visit, customer_contacts(visit.conn, customer_id), prefix + "/contacts"),
        render(HEADING, text="Invite a contact"),
        visit.form_tag(prefix + "/contacts", join([
            contact_fields(visit, {}, email=True), render(SUBMIT, text="Send the invitation")]))]))


@buyer_page("POST", "/store/<slug>/contacts", refused=store_contacts_page, right="manage")
def store_add_contact_action(visit):
    with visit.write() as conn:
        add_contact(conn, visit.company_id, visit.session["customer_id"],
                    contact_body(visit.form), visit.surface.now_ms(),
                    invited_by=signed_in_contact(visit))
    return redirect(visit.surface.prefix + "/contacts", "invited")


@buyer_page("GET", "/store/<slug>/contacts/<contact_id>", right="manage")
def store_contact_page(visit, contact_id):
    contact = customer_contact(visit.conn, visit.company_id, visit.session["customer_id"],
                               contact_id)
    return visit.page(contact["email"], visit.form_tag(
        f"{visit.surface.prefix}/contacts/{contact_id}",
        join([contact_fields(visit, dict(contact)), render(SUBMIT, text="Save")])))


@buyer_page("POST", "/store/<slug>/contacts/<contact_id>", refused=store_contact_page,
            right="manage")
def store_update_contact_action(visit, contact_id):
    with visit.write() as conn:
        update_contact(conn, visit.company_id, contact_id, contact_body(visit.form),
                       customer_id=visit.session["customer_id"])
    return redirect(visit.surface.prefix + "/contacts", "contact")


def request_facts(visit, request, quote):
    """An order request's lines at today's prices (quote: request_quote's), its total when
    asked and its state, as both its buyer and its admins see it."""
    asker = load_contact(visit.conn, request["company_id"], request["contact_id"])
    decision, order_id = "", request["order_id"]
    if order_id:
        decision = render(DECISION, term="Order", value=link(
            f"{visit.surface.prefix}/orders/{order_id}", order_number(visit.conn, order_id)))
    elif request["reason"]:
        decision = render(DECISION, term="Reason declined", value=request["reason"])
    blocked = " (blocked)" if asker["status"] == "BLOCKED" else ""
    return render(REQUEST_FACTS, status=status_tag(request["status"]), asked=render(
        "{at} by {email}{blocked}", at=visit.when(request["created_at"]), email=asker["email"],
        blocked=blocked), total=cents_text(request["total_cents"]),
                  po=request["po_number"] or "none", notes=request["notes"] or "none",
                  ship_to=address_lines(json.loads(request["shipping_address"])),
                  decision=decision, lines=lines_table(
                      [(name, quantity, cents_text(unit), cents_text(line))
                       for name, _, quantity, unit, line in quote["lines"]],
                      quote["total"], quote["taxRate"], quote["tax"]))


def my_requests(visit, status=None):
    """The order requests the contact sees: all of its business's for an admin, else its own."""
    return customer_requests(visit.conn, visit.company_id, visit.session["customer_id"],
                             None if may(visit, "manage") else visit.session["account_id"],
                             status)


@buyer_page("GET", "/store/<slug>/requests")
def store_requests_page(visit):
    prefix = visit.surface.prefix
    rows = [(link(f"{prefix}/requests/{row['id']}", visit.when(row["created_at"])),
             row["asker_email"], status_tag(row["status"]), cents_text(row["total_cents"]))
            for row in my_requests(visit)]
    return visit.page("Order requests", table(("Asked", "By", "Status", "Total"), rows,
                                              numeric=("Total",)))


@buyer_page("GET", "/store/<slug>/requests/<request_id>")
def store_request_page(visit, request_id):
    request = load_request(visit.conn, visit.company_id, request_id,
                           visit.session["customer_id"])
    if not may(visit, "manage") and request["contact_id"] != visit.session["account_id"]:
        raise not_found("Order request")
    path, quote = f"{visit.surface.prefix}/requests/{request_id}", request_quote(
        visit.conn, visit.company_id, request)
    decide = "" if request["status"] != "PENDING" or not may(visit, "manage") else join([
        visit.button(path + "/approve", "Approve and place the order",
                     total=quote["total"] + quote["tax"]),
        visit.form_tag(path + "/decline", join([
            visit.field("reason", "Why it is declined (the buyer is emailed this)",
                        kind="textarea", maxlength=MAX_DECLINE_REASON),
            render(SUBMIT, text="Decline")]))])
    return visit.page("Order request", join([request_facts(visit, request, quote), decide]))


@buyer_page("POST", "/store/<slug>/requests/<request_id>/approve", refused=store_request_page,
            right="manage")
def approve_request_action(visit, request_id):
    with visit.write() as conn:
        order_id = approve_request(conn, visit.company_id, request_id,
                                   visit.session["account_id"],
                                   form_int(visit.form, "total", required=False))
    return redirect(f"{visit.surface.prefix}/orders/{order_id}", "approved")


@buyer_page("POST", "/store/<slug>/requests/<request_id>/decline", refused=store_request_page,
            right="manage")
def decline_request_action(visit, request_id):
    with visit.write() as conn:
        decline_request(conn, visit.company_id, request_id, visit.session["account_id"],
                        visit.form.get("reason"))
    return redirect(f"{visit.surface.prefix}/requests/{request_id}", "declined")


def install_storefront(app):
    if not app.service.settings.storefront:
        return
    app.storefront = StoreSurface(app.service)
    app.storefront.install(app)


# ---------------------------------------------------------------------------------------------
# 16. App
# ---------------------------------------------------------------------------------------------

def create_app(db_path=None, settings=None, deliver=True, **overrides):
    """The WSGI app. db_path or settings pick the database; deliver=False leaves webhook
    delivery to another process. app.service holds the database, outbox and limits."""
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
            if status != 200:  # each request's response starts at 200
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
    install_stripe_webhook(app)
    app.add_hook("before_request", refuse_greedy_forms)
    install_dashboard(app)
    install_storefront(app)
    app.error_handler.update({
        404: _error_page(404, UNKNOWN_PATH),
        405: _error_page(405, METHOD_NOT_ALLOWED),
        500: _internal_error_page,
    })
    return app


# ---------------------------------------------------------------------------------------------
# 17. Server
# ---------------------------------------------------------------------------------------------

class OverloadLog:
    """Takes the place of waitress's queue logger, which warns once per request that has to
    wait for a free thread: under load that is a line per request, drowning every other line
    and costing the request path. Here waiting requests are only counted, and reported at
    most once per interval as one line with their number and the peak queue depth."""

    def __init__(self, interval=10.0, clock=time.monotonic):
        self.interval = interval
        self.clock = clock
        self.lock = threading.Lock()
        self.waited = 0
        self.peak = 0
        self.since = None
        self.next_report = -math.inf

    def warning(self, message, depth, *args):
        """Called by waitress for each request queued behind busy threads."""
        with self.lock:
            if self.waited == 0:
                self.since = self.clock()
            self.waited += 1
            self.peak = max(self.peak, depth)
        self.tick()

    def tick(self):
        """Report what waited, if anything did and the interval since the last report is over."""
        with self.lock:
            now = self.clock()
            if self.waited == 0 or now < self.next_report:
                return
            waited, peak, since = self.waited, self.peak, self.since
            self.waited = self.peak = 0
            self.next_report = now + self.interval
        log.warning("overloaded: %d requests waited for a free thread over %.1fs "
                    "(peak queue depth %d)", waited, max(now - since, 0.0), peak)


#: The token of an emailed storefront link in a path: kept only hashed, never in a log line
#: (whoever reads it could set the customer's password within the hour).
_LINK_TOKEN = re.compile(r"^(/store/[^/]+/(?:reset|verify)/)[^/]+")


def _hidden_token(match):
    # A function, not r"\1-": a template costs its parsing on every request, matched or not.
    return match.group(1) + "-"


class AccessLog:
    """One line per request on stderr. Lines are queued and written in batches by a thread of
    their own, so a request never waits on the terminal or a full pipe, and pays no logging
    framework overhead. The same thread reports overload (see OverloadLog)."""

    def __init__(self, app, stream=None):
        self.app = app
        self.stream = stream or sys.stderr
        self.lines = collections.deque()
        self.overload = OverloadLog()
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
            self.lines.append((started, client_ip(environ.get("REMOTE_ADDR")),
                               environ.get("REQUEST_METHOD"),
                               _LINK_TOKEN.sub(_hidden_token, environ.get("PATH_INFO") or ""),
                               status[0], (time.time() - started) * 1000))

    def _write(self):
        while not self.wake.wait(0.2):
            self.flush()
            self.overload.tick()
        self.flush()

    def flush(self):
        batch, second, second_text = [], None, ""
        while self.lines:
            at, address, method, path, status, ms = self.lines.popleft()
            at = int(at * 1000)
            if at // 1000 != second:  # a line's time is iso(at): its second's text is shared
                second, second_text = at // 1000, iso(at)[:-5]
            batch.append(f'{second_text}.{at % 1000:03d}Z {address} "{method} {path}" '
                         f'{status} {ms:.1f}ms\n')
        if batch:
            self.stream.write("".join(batch))
            self.stream.flush()

    def close(self):
        self.wake.set()
        self.writer.join(5)


def cannot_listen(settings, error):
    """The refusal of serve when its address is taken or not this machine's: a message, not a
    traceback (running the quick start twice is the usual way to meet it)."""
    return SystemExit(f"ordering serve: cannot listen on {settings.host}:{settings.port}: "
                      f"{os.strerror(error.errno) if error.errno else error}")


#: The signals that stop a server gracefully.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def raise_open_files_limit(wanted):
    """The soft limit of open files raised toward wanted, as far as the hard limit allows (a
    connection costs a descriptor)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))


def serve(settings, sockets=None):
    """Serve until SIGTERM or SIGINT; on the host and port of settings, or on sockets already
    listening (a worker of serve_workers)."""
    import waitress
    app = create_app(settings=settings)
    access_log = AccessLog(app)
    where = {"sockets": sockets} if sockets else {"host": settings.host, "port": settings.port}
    proxy = {}
    if settings.trust_proxy:
        # waitress drops X-Forwarded-For unless the peer is a proxy it was told to trust;
        # from that peer it keeps only the last hop and makes it REMOTE_ADDR, and it turns
        # X-Forwarded-Proto into wsgi.url_scheme (the dashboard's Secure cookie).
        proxy = dict(trusted_proxy=settings.proxy_address, trusted_proxy_count=1,
                     trusted_proxy_headers={"x-forwarded-for", "x-forwarded-proto"})
    # waitress buffers a body before the app sees it: bound that, well above the app's own
    # limit, which answers with the JSON 413.
    try:
        raise_open_files_limit(settings.connection_limit + 256)
        server = waitress.create_server(access_log, threads=settings.threads, ident="ordering",
                                        max_request_body_size=8 * settings.max_body_bytes,
                                        connection_limit=settings.connection_limit,
                                        channel_timeout=settings.idle_timeout,
                                        cleanup_interval=min(10, settings.idle_timeout),
                                        **where, **proxy)
    except OSError as error:
        app.service.close(grace=0)
        raise cannot_listen(settings, error) from None
    server.task_dispatcher.queue_logger = access_log.overload

    def stop(signum, frame):
        # Once: a second signal (a terminal's SIGINT reaches workers and their parent, which
        # passes on SIGTERM) must not cut short the wait for deliveries in flight.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("ordering %s serving %s on http://%s:%s", __version__, describe_db(settings),
             settings.host, server.effective_port)
    if settings.smtp_url:
        log.info("mail through %s from %s; links begin with %s",
                 describe_smtp_url(settings.smtp_url), settings.mail_from, settings.link_base)
    else:
        log.info("no mail server set (ORDERING_SMTP_URL): emails wait, shown as not sent")
    if settings.stripe_webhook_secrets:
        log.info("Stripe's webhook at POST %s, with %d signing secret%s", STRIPE_WEBHOOK_PATH,
                 len(settings.stripe_webhook_secrets),
                 "s" if len(settings.stripe_webhook_secrets) > 1 else "")
    try:
        # A worker starts with the stop signals blocked (see serve_workers): one sent while it
        # was starting is held until here, where it stops this server as it should.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        server.run()
    finally:
        server.close()
        log.info("stopping: waiting up to %gs for webhook deliveries and emails in flight",
                 app.service.outbox.timeout)
        app.service.close()
        access_log.close()
        log.info("stopped")


def serve_workers(settings):
    """serve --workers N: the parent makes the listening socket and forks N workers that each
    serve() on it (the kernel hands each connection to one of them). A worker that dies is
    replaced; SIGTERM or SIGINT is passed on to every worker, and the parent returns when all
    have stopped. The parent starts no thread and keeps no connection open, so forking is
    safe: it opens the database once, before the first fork, to create or migrate it and turn
    on its journal mode (workers doing that at the same moment would find the file locked)."""
    Database(settings.db_path, settings).close()
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    try:
        listener = socket.create_server((settings.host, settings.port), family=family,
                                        backlog=1024)
    except OSError as error:
        raise cannot_listen(settings, error) from None
    parent = os.getpid()
    workers = {}
    stopping = []

    def start_worker():
        # Until serve() has its own handlers, the child would run the parent's stop() (a copy
        # that signals its siblings and then serves on): the signals wait, blocked, instead.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = os.fork()
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if pid == 0:
            code = 1
            try:
                _stop_with_parent(parent)
                serve(settings, sockets=[listener])
                code = 0
            except BaseException:
                log.exception("worker %d failed", os.getpid())
            finally:
                logging.shutdown()
                os._exit(code)
        workers[pid] = time.monotonic()
        log.info("worker %d started", pid)

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("ordering %s serving %s on http://%s:%s with %d workers", __version__,
             describe_db(settings), settings.host, listener.getsockname()[1], settings.workers)
    for _ in range(settings.workers):
        start_worker()
    while workers:
        pid, status = os.wait()
        started = workers.pop(pid, None)
        if started is None:
            continue
        if stopping:
            log.info("worker %d stopped", pid)
            continue
        log.warning("worker %d died (%s); starting another", pid, _wait_status(status))
        if time.monotonic() - started < 1:
            time.sleep(1)  # a worker that cannot even start must not be forked in a tight loop
        if not stopping:
            start_worker()
    listener.close()
    log.info("stopped")


def _stop_with_parent(parent):
    """Linux: a worker gets SIGTERM when its parent dies, even by SIGKILL, so that no worker is
    left serving without a supervisor."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 is PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _wait_status(status):
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


# ---------------------------------------------------------------------------------------------
# 18. Commands
# ---------------------------------------------------------------------------------------------

def _active_flag(text):
    if text not in ("true", "false"):
        raise argparse.ArgumentTypeError("must be true or false")
    return text == "true"


def _amount(text):
    cents = cents_from_text(text)
    if cents is None:
        raise argparse.ArgumentTypeError("must be an amount such as 12.50")
    # The operations' own bound on any amount (a product price), checked as the option is read.
    if cents > MAX_AMOUNT_CENTS:
        raise argparse.ArgumentTypeError(f"must be an amount from 0 to {money(MAX_AMOUNT_CENTS)}")
    return cents


def _invoice_amount(text):
    """A plain amount with up to three decimals; how many its currency allows, and how large
    it may be in its minor unit, are checked once the currency is known (cmd_invoice_paid,
    record_invoice_paid)."""
    if not re.fullmatch(r"\s*\d+(\.\d{1,3})?\s*", text):
        raise argparse.ArgumentTypeError("must be an amount such as 12.50")
    return text


def _setting(check):
    """An option read by a setting's own check, its refusal argparse's."""
    def parse(text):
        try:
            return check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return parse


def _recipient(text):
    if not valid_email(text.strip()):
        raise argparse.ArgumentTypeError("must be an email address such as you@example.com")
    return text.strip()


_proxy_address = _setting(proxy_address)
_stripe_webhook_secrets = _setting(stripe_webhook_secrets)
_smtp_url = _setting(lambda text: mail_server(text) and text)
_base_url = _setting(check_base_url)


def _moment(text):
    moment = moment_text(text)
    if moment is None:
        raise argparse.ArgumentTypeError("must be an ISO 8601 date or datetime")
    return moment


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


def _port(text):
    value = _non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError("must be a port from 0 to 65535")
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


# Commands are declared like routes: @command(name, help, *options) above the handler that
# runs it, and build_parser makes the parser from the declarations in their order. A handler
# of (conn, args) runs in one transaction (run_command); one declared alone=True gets
# (settings, args) and opens what it needs itself. Either returns what main prints as JSON,
# or None when it has printed its own answer.

Command = collections.namedtuple("Command", "name help options handler alone overrides")
COMMANDS = []


def option(*flags, **settings):
    """An option of a command, as argparse's add_argument takes it."""
    return ("option", flags, settings)


def one_of(*options):
    """Options of which a command takes one at most."""
    return ("one of", options)


def command(name, help_text, *options, alone=False, overrides=False):
    """Declare the command that the decorated function runs. overrides: its options are
    Settings of the same names (serve's)."""
    def register(handler):
        COMMANDS.append(Command(name, help_text, options, handler, alone, overrides))
        return handler
    return register


def option_dest(flags, settings):
    """The attribute of args an option sets, as argparse names it."""
    return settings.get("dest") or flags[0].lstrip("-").replace("-", "_")


# 18.1 The demo -------------------------------------------------------------------------------

DEMO_SLUG = "demo-wholesale"
DEMO_STAFF_EMAIL = "staff@demo-wholesale.example"
DEMO_BUYER_EMAIL = "orders@corner-cafe.example"
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
#: The demo buyer's own prices (SKU, cents): its catalog shows them, the other buyer's does not.
DEMO_BUYER_PRICES = (("GR-RICE-25", 3990), ("BV-ESP-1", 2290))


def prepare_demo(conn):
    """A demo company with a small catalog (its stock opens with import movements), two
    customers (the first with prices of its own) and a staff account (made once), and on every
    call a new key with every scope and new passwords for the staff account and the first
    customer (the storefront's demo buyer)."""
    company = company_with_slug(conn, DEMO_SLUG)
    if company is None:
        company_id = create_company(conn, "Demo Wholesale", DEMO_SLUG)["id"]
        # Staff alerts (a new buyer to approve, low stock, reports) go to the demo's staff.
        update_company(conn, company_id, {"staff_alerts": [DEMO_STAFF_EMAIL]})
        products = {sku: create_product(
            conn, company_id, opening="import", name=name, sku=sku, category=category,
            unit=unit, price_cents=price, stock=stock, low_stock_threshold=threshold,
            is_active=active)["id"]
            for name, sku, category, unit, price, stock, threshold, active in DEMO_CATALOG}
        for address, name in ((DEMO_BUYER_EMAIL, "Corner Cafe"),
                              ("buyer@harbour-bistro.example", "Harbour Bistro")):
            create_customer(conn, company_id, {"email": address, "name": name},
                            email_verified=True)  # the operator vouches for them
        buyer = customer_by_email(conn, company_id, DEMO_BUYER_EMAIL)["id"]
        for sku, price in DEMO_BUYER_PRICES:
            set_customer_price(conn, company_id, buyer, products[sku], price)
    else:
        company_id = company["id"]
    key = create_api_key(conn, company_id, list(SCOPES))
    password = secrets.token_urlsafe(12)
    staff = staff_account(conn, company_id, DEMO_STAFF_EMAIL)
    if staff is None:
        create_staff(conn, company_id, DEMO_STAFF_EMAIL, password)
    else:
        set_password(conn, STAFF, staff["id"], password)
    # The example order of demo's curl commands is the demo buyer's (the first customer).
    customer = customer_by_email(conn, company_id, DEMO_BUYER_EMAIL)
    buyer_password = secrets.token_urlsafe(12)
    set_password(conn, CONTACTS, own_contact(conn, customer)["id"], buyer_password)
    product = product_in_stock(conn, company_id, more_than=10)
    return {"companyId": company_id, "key": key["key"], "password": password,
            "buyerPassword": buyer_password,
            "customerId": customer["id"], "productId": product["id"]}


def demo(settings):
    """Prepare the demo (see prepare_demo) and say how to try it, at the base URL when one
    is set (the server's own address, else)."""
    db = Database(settings.db_path, settings)
    with db.write() as conn:
        made = prepare_demo(conn)
    site = settings.base_url.rstrip("/") or f"http://{settings.host}:{settings.port}"
    base = f"{site}/api/v1"
    start = "python ordering.py" + ("" if settings.db_path == Settings.db_path
                                    else f" --db {shlex.quote(settings.db_path)}")
    header = f'-H "Authorization: Bearer {made["key"]}"'
    order = json_text({"customerId": made["customerId"],
                       "items": [{"productId": made["productId"], "quantity": 2}]})
    return "\n".join([
        f"Demo company Demo Wholesale ({made['companyId']}) in {describe_db(settings)}: "
        f"{len(DEMO_CATALOG)} products, 2 customers.",
        f"API key with all {len(SCOPES)} scopes (shown once):",
        made["key"],
        f"Start the server ({start}), then try:",
        f"  curl -s {header} {base}/products",
        f"  curl -s {header} -H 'Content-Type: application/json' -d '{order}' {base}/orders",
        f"  curl -s {header} {base}/orders",
        f"Storefront: {site}/store/{DEMO_SLUG}, sign in as "
        f"{DEMO_BUYER_EMAIL} with the password (new on every run) {made['buyerPassword']}, "
        "or register a buyer and approve it under the dashboard's Customers.",
        f"Dashboard: {site}/dashboard, sign in as "
        f"{DEMO_STAFF_EMAIL} with the password (new on every run):",
        made["password"],
    ])


# 18.2 Copies ---------------------------------------------------------------------------------
# backup and copy-to, for the operator commands.

def backup(settings, destination):
    """An online, consistent copy of the database (SQLite's backup API), safe while the
    server runs."""
    engine = engine_for(settings.db_path)
    if engine.backup is None:
        raise ApiError(400, "backup copies a SQLite file; back up a PostgreSQL database with "
                            "pg_dump.")
    if os.path.exists(destination):
        raise ApiError(409, f"{destination} already exists; choose a new file.")
    if not engine.exists(settings.db_path):
        raise ApiError(404, f"{settings.db_path} does not exist; nothing to back up.")
    pages, check = engine.backup(settings.db_path, destination, settings)
    return {"backup": destination, "bytes": os.path.getsize(destination), "pages": pages,
            "integrity": check}


def copy_to(settings, target):
    """Copy every table of the database into target, an empty database of either engine, in
    one transaction on the target, then read both back and compare them table by table."""
    source_path = settings.db_path
    source_engine = engine_for(source_path)
    if source_engine.same_database(source_path, target):
        raise ApiError(409, f"{target} is the database being copied; name another target.")
    # Checked before Database opens it, which would create a missing file.
    if not source_engine.exists(source_path):
        raise ApiError(404, f"{source_path} does not exist; nothing to copy.")
    source_db = Database(source_path, settings)
    try:
        target_db = Database(target, dataclasses.replace(settings, db_path=target))
        try:
            described = target_db.engine.describe(target)
            return {"copiedTo": described,
                    "tables": _copy_tables(source_db, target_db, described)}
        finally:
            target_db.close()
    finally:
        source_db.close()


def _copy_tables(source_db, target_db, described):
    # One transaction: a copy that fails at any row leaves the target as empty as it was, and
    # nothing can write to the target between the check that it is empty and the copy.
    with target_db.write() as conn:
        holding = first_table_with_rows(conn)
        if holding is not None:
            raise ApiError(409, f"{described} already holds rows in {holding}; copy-to "
                                "needs an empty database.")
        columns = {table: copy_table(source_db.conn, conn, table)
                   for table in tables_in_order()}
    # Both sides are read again after the commit, which also catches a server that was still
    # writing to the source.
    tables = {}
    for table in tables_in_order():
        copied = table_digest(source_db.conn, table, columns[table])
        found = table_digest(target_db.conn, table, columns[table])
        if found != copied:
            raise ApiError(500, f"{table} in {described} does not match the source after the "
                                f"copy (rows: {copied['rows']} in the source, {found['rows']} "
                                "in the copy): a server still writing to the source, or a value "
                                "the target cannot hold? Empty the target before copying again.")
        tables[table] = copied
    return tables


# 18.3 The commands ---------------------------------------------------------------------------
# Each declared by @command above its handler, in the order --help lists them; then the
# parser, running a command, and main().

_PRODUCT_OPTIONS = (("name", "name", str), ("price", "price_cents", _amount),
                    ("stock", "stock", _non_negative), ("category", "category", str),
                    ("sku", "sku", str), ("unit", "unit", str),
                    ("description", "description", str), ("image-url", "image_url", str),
                    ("low-stock-threshold", "low_stock_threshold", _non_negative),
                    ("min-quantity", "min_quantity", _positive),
                    ("order-multiple", "order_multiple", _positive),
                    ("price-breaks", "price_breaks", str))


def _product_options(creating):
    return tuple(option("--" + name, type=kind, required=creating and name in ("name", "price"))
                 for name, _, kind in _PRODUCT_OPTIONS)


def _product_fields(args):
    fields = {}
    for option, column, _ in _PRODUCT_OPTIONS:
        value = getattr(args, option.replace("-", "_"))
        if value is not None:
            fields[column] = parse_price_breaks(value) if column == "price_breaks" else value
    return fields


@command("serve", "serve the API with waitress (the default command)",
         option("--host", default=None, help="address to listen on (127.0.0.1)"),
         option("--port", type=_port, default=None, help="port (8080)"),
         option("--threads", type=_positive, default=None, help="request threads (4)"),
         option("--workers", type=_positive, default=None,
                help="server processes sharing the port (1)"),
         option("--allow-private-webhooks", action="store_true", default=None,
                help="deliver webhooks to loopback and private addresses too"),
         option("--ip-rate-limit", type=_non_negative, default=None,
                help="requests per minute per client address (600; 0 is off)"),
         option("--trust-proxy", action="store_true", default=None,
                help="take the client address from X-Forwarded-For"),
         option("--no-dashboard", dest="dashboard", action="store_false", default=None,
                help="serve the API only, no /dashboard"),
         option("--no-storefront", dest="storefront", action="store_false", default=None,
                help="no storefronts at /store/{slug}"),
         option("--proxy-address", type=_proxy_address, default=None,
                help="with --trust-proxy: the proxy's IP address, or * for any peer "
                     "(127.0.0.1)"),
         option("--stripe-webhook-secret", dest="stripe_webhook_secrets",
                type=_stripe_webhook_secrets, default=None, metavar="WHSEC",
                help="Stripe's webhook signing secret (two, comma-separated, during a roll): "
                     "serves POST /billing/stripe/webhook"),
         option("--base-url", type=_base_url, default=None,
                help="the address people reach this server at, for links in emails "
                     "(default: $ORDERING_BASE_URL, else http://HOST:PORT)"),
         alone=True, overrides=True)
def cmd_serve(settings, args):
    if settings.workers > 1:
        serve_workers(settings)
    else:
        serve(settings)


@command("company-create", "create a company", option("--name", required=True),
         option("--slug", help="storefront slug (default: from the name)"))
def cmd_company_create(conn, args):
    return create_company(conn, args.name, args.slug)


#: company-update's options and the company settings they change.
_COMPANY_OPTIONS = (("stripe_customer", "stripe_customer_id"), ("mail_name", "mail_name"),
                    ("reply_to", "reply_to"), ("storefront_approval", "storefront_approval"),
                    ("tax_rate", "tax_rate"), ("payment_terms", "payment_terms_days"),
                    ("report", "report_period"), ("time_zone", "time_zone"),
                    ("two_step", "two_step"))


@command("company-update", "change a company's settings and print the company",
         option("id", metavar="COMPANY_ID"),
         option("--stripe-customer", metavar="CUSTOMER_ID",
                help="the company's Stripe customer (cus_...), whose paid invoices Stripe's "
                     "webhook turns into invoice.paid; '' removes it"),
         option("--mail-name", help="the sender's name on its emails ('' for the company "
                                    "name)"),
         option("--reply-to", help="the Reply-To address of its emails ('' for none)"),
         option("--staff-alerts", metavar="E1,E2",
                help="addresses that get staff alerts, separated by commas ('' for none)"),
         option("--storefront-approval", metavar="|".join(STOREFRONT_APPROVALS),
                help="whether new storefront accounts wait for the staff's approval "
                     "(required, the default) or are active at once (automatic)"),
         option("--tax-rate", metavar="RATE",
                help=f"the company-wide tax rate, a fraction from 0 to {MAX_TAX_RATE} "
                     "(0.0825 is 8.25%%; 0 charges none); a customer's override wins"),
         option("--payment-terms", metavar="DAYS",
                help=f"days from an invoice's issue to its due date, 0 (on receipt, the "
                     f"default) to {MAX_PAYMENT_TERMS}; a customer's own terms win"),
         option("--report", metavar="daily|weekly|off",
                help="a summary emailed to the staff alert addresses each day or week"),
         option("--time-zone", metavar="ZONE",
                help="the time zone its pages show times in, a name such as Europe/Paris "
                     "(UTC, the default, or '')"),
         option("--two-step", metavar="owners|off",
                help="whether its owners must sign in with a code too (two-step sign-in)"))
def cmd_company_update(conn, args):
    changes = {column: getattr(args, option) for option, column in _COMPANY_OPTIONS
               if getattr(args, option) is not None}
    if args.staff_alerts is not None:
        changes["staff_alerts"] = args.staff_alerts.split(",")
    return update_company(conn, args.id, changes)


@command("mail-test", "send one test email at once through the mail server and print its "
                      "answer", option("--to", required=True, metavar="ADDRESS", type=_recipient),
         alone=True)
def cmd_mail_test(settings, args):
    reply = send_test_email(settings, args.to)
    print(f"Sent to {args.to} through {describe_smtp_url(settings.smtp_url)} from "
          f"{settings.mail_from}. The server answered: {reply}")


@command("key-create", "create an API key (printed once)",
         option("--company", required=True, help="company ID"),
         option("--scopes", required=True, help="comma-separated, e.g. orders:read,orders:write"),
         option("--rate-limit", type=_positive, default=DEFAULT_KEY_RATE_LIMIT,
                help=f"requests per minute ({DEFAULT_KEY_RATE_LIMIT})"),
         option("--expires-at", type=_moment, help="ISO 8601 expiry (may be in the past)"))
def cmd_key_create(conn, args):
    scopes = [scope.strip() for scope in args.scopes.split(",") if scope.strip()]
    return create_api_key(conn, args.company, scopes, args.rate_limit, args.expires_at)


@command("key-revoke", "revoke an API key", option("key_id", metavar="KEY_ID"))
def cmd_key_revoke(conn, args):
    return revoke_api_key(conn, company_of(conn, "API key", args.key_id), args.key_id)


@command("product-create", "create a product",
         option("--company", required=True, help="company ID"),
         option("--inactive", action="store_true", help="create it inactive"),
         *_product_options(creating=True))
def cmd_product_create(conn, args):
    fields = _product_fields(args)
    fields["is_active"] = not args.inactive
    return create_product(conn, args.company, COMMAND, **fields)


@command("product-update", "edit a product", option("id", metavar="ID", help="product ID"),
         option("--active", type=_active_flag, help="true or false"),
         *_product_options(creating=False))
def cmd_product_update(conn, args):
    company_id = company_of(conn, "Product", args.id)
    fields = _product_fields(args)
    if args.active is not None:
        fields["is_active"] = args.active
    return update_product(conn, company_id, args.id, COMMAND, **fields)


@command("storefront-register",
         "register a customer as the storefront does (customer.created, storefront)",
         option("--store", required=True, help="company slug"),
         option("--email", required=True), option("--name"), option("--password"))
def cmd_storefront_register(conn, args):
    return storefront_register(conn, args.store, args.email, args.name, args.password)


def _id_counts(texts, option, shape):
    """[(ID, whole number)] from an option's ID:N values."""
    pairs = []
    for text in texts:
        record_id, _, count = text.rpartition(":")
        if not record_id or not count.isdigit():
            raise invalid(option, f"must be {shape}")
        pairs.append((record_id, int(count)))
    return pairs


@command("storefront-order",
         "place an order as the storefront does (order.created, storefront shape; refused "
         "past the customer's credit limit)",
         option("--store", required=True, help="company slug"),
         option("--customer", required=True, help="customer ID"),
         option("--item", action="append", required=True,
                help="PRODUCT_ID:QUANTITY, repeat for more lines"),
         option("--po-number"), option("--notes"))
def cmd_storefront_order(conn, args):
    items = [{"productId": product_id, "quantity": quantity} for product_id, quantity
             in _id_counts(args.item, "item", "PRODUCT_ID:QUANTITY")]
    order = storefront_place_order(conn, args.store, args.customer, items, args.po_number,
                                   args.notes)
    require_credit(conn, company_of(conn, "Order", order["id"]), args.customer, order["id"])
    return order


_CUSTOMER_PRODUCT = (option("--customer", required=True, help="customer ID"),
                     option("--product", required=True, help="product ID"))


@command("price-set", "set a customer's own price for a product (storefront and dashboard "
                      "orders use it; API orders never do)", *_CUSTOMER_PRODUCT,
         option("--price", type=_amount, required=True, help="e.g. 9.50"))
def cmd_price_set(conn, args):
    return set_customer_price(conn, company_of(conn, "Customer", args.customer), args.customer,
                              args.product, args.price)


@command("price-clear", "remove a customer's own price for a product: the catalog price "
                        "applies again", *_CUSTOMER_PRODUCT)
def cmd_price_clear(conn, args):
    return clear_customer_price(conn, company_of(conn, "Customer", args.customer),
                                args.customer, args.product)


@command("return-open", "open a return on an order (return.created)",
         option("--order", required=True, help="order ID"),
         option("--reason", required=True, help="{} to {} characters".format(
             *RETURN_REASON_LENGTH)),
         one_of(option("--line", action="append", metavar="ORDER_ITEM_ID:UNITS",
                       help="a line and how many of its units go back (recorded with the "
                            "return); repeat for more lines"),
                option("--item-count", type=_positive,
                       help="line items returned, without recording which (default: all)")),
         option("--staff", action="store_true", help="opened from the dashboard"))
def cmd_return_open(conn, args):
    lines = None
    if args.line:
        pairs = _id_counts(args.line, "line", "ORDER_ITEM_ID:UNITS")
        lines = dict(pairs)
        if len(lines) < len(pairs):
            raise invalid("line", "must name each order item once")
    return open_return(conn, company_of(conn, "Order", args.order), args.order, args.reason,
                       args.item_count, "staff" if args.staff else None, lines)


@command("return-approve", "approve a REQUESTED return (return.approved)",
         option("id", metavar="RETURN_ID"))
def cmd_return_approve(conn, args):
    return approve_return(conn, company_of(conn, "Return", args.id), args.id)


@command("return-receive", "mark an APPROVED return RECEIVED",
         option("id", metavar="RETURN_ID"))
def cmd_return_receive(conn, args):
    return receive_return(conn, company_of(conn, "Return", args.id), args.id)


def _refund_lines(texts):
    """{order item ID: (good, damaged)} from --line ORDER_ITEM_ID:GOOD:DAMAGED values."""
    lines = {}
    for text in texts:
        match = re.fullmatch(r"(.+):(\d{1,10}):(\d{1,10})", text)
        if not match:
            raise invalid("line", "must be ORDER_ITEM_ID:GOOD:DAMAGED")
        if match.group(1) in lines:
            raise invalid("line", "must name each order item once")
        lines[match.group(1)] = (int(match.group(2)), int(match.group(3)))
    return lines


@command("return-refund", "refund a RECEIVED return (refund.processed)",
         option("id", metavar="RETURN_ID"),
         option("--method", required=True, choices=REFUND_METHODS),
         option("--good-units", type=_non_negative,
                help="units that came back good (required without --line)"),
         option("--damaged-units", type=_non_negative,
                help="units that came back damaged (required without --line)"),
         option("--subtotal", type=_amount, required=True, help="e.g. 40.00"),
         option("--amount", type=_amount, help="refunded amount (default: the subtotal)"),
         option("--line", action="append", metavar="ORDER_ITEM_ID:GOOD:DAMAGED",
                help="a line of the return and how many of its units came back good (back "
                     "in stock) and damaged; repeat for more lines"))
def cmd_return_refund(conn, args):
    if args.line is None and None in (args.good_units, args.damaged_units):
        raise invalid("goodUnits", "--good-units and --damaged-units are required without "
                                   "--line")
    return refund_return(conn, company_of(conn, "Return", args.id), args.id, args.method,
                         args.good_units, args.damaged_units, args.subtotal, args.amount,
                         lines=None if args.line is None else _refund_lines(args.line),
                         actor=COMMAND)


@command("stock-adjust", "change a product's stock by N, saying why (an adjustment movement; "
                         "product.updated)", option("id", metavar="PRODUCT_ID"),
         option("--by", type=int, required=True, help="signed units, e.g. -3 or 12"),
         option("--reason", required=True, help="why, kept as the movement's note"))
def cmd_stock_adjust(conn, args):
    return adjust_stock(conn, company_of(conn, "Product", args.id), args.id, args.by,
                        args.reason, COMMAND)


@command("stock-count", "record a count, the level found on the shelf (a count movement of "
                        "the difference; product.updated)", option("id", metavar="PRODUCT_ID"),
         option("--to", type=_non_negative, required=True, help="the level counted"),
         option("--reason", help="a note kept with the movement"))
def cmd_stock_count(conn, args):
    return count_stock(conn, company_of(conn, "Product", args.id), args.id, args.to,
                       args.reason, COMMAND)


@command("stock-history", "a product's most recent stock movements, newest first",
         option("id", metavar="PRODUCT_ID"),
         option("--limit", type=_positive, default=MOVEMENTS_SHOWN,
                help=f"how many ({MOVEMENTS_SHOWN})"))
def cmd_stock_history(conn, args):
    return {"data": [movement_json(row) for row in stock_history(
        conn, company_of(conn, "Product", args.id), args.id, args.limit)]}


@command("order-restock", "put a cancelled order's units back in stock, once (a cancellation "
                          "movement per line)", option("id", metavar="ORDER_ID"))
def cmd_order_restock(conn, args):
    return {"orderId": args.id, "data": restock_order(
        conn, company_of(conn, "Order", args.id), args.id, COMMAND)}


@command("invoice-create", "invoice an order now and print the invoice (an order invoiced "
                           "already: its invoice, unchanged)", option("order_id", metavar="ORDER_ID"))
def cmd_invoice_create(conn, args):
    return invoice_order(conn, company_of(conn, "Order", args.order_id), args.order_id)


@command("invoice-list", 'print a company\'s invoices, newest first, as {"data": [...]}',
         option("--company", required=True, help="company ID"),
         option("--status", choices=INVOICE_STATUSES, metavar="|".join(INVOICE_STATUSES)),
         option("--customer", metavar="CUSTOMER_ID", help="one customer's"),
         option("--overdue", action="store_true", help="open and past their due date"))
def cmd_invoice_list(conn, args):
    load_company(conn, args.company)
    if args.customer:
        load_customer(conn, args.company, args.customer)
    rows = find_customer_invoices(conn, args.company, args.status, args.customer,
                                  now_iso() if args.overdue else None)
    return {"data": [customer_invoice_json(row) for row in rows]}


@command("invoice-show", "print an invoice with its lines, its payments and the credit applied "
                         "to it", option("id", metavar="INVOICE_ID"))
def cmd_invoice_show(conn, args):
    return invoice_details(conn, company_of(conn, "Invoice", args.id), args.id)


@command("payment-record", "record a payment against an open invoice and print the invoice",
         option("id", metavar="INVOICE_ID"),
         option("--amount", type=_amount, required=True,
                help="such as 10.00: more than 0, at most the invoice's balance"),
         option("--method", help=f"how it was paid, such as bank transfer (at most "
                                 f"{MAX_PAYMENT_METHOD} characters)"),
         option("--reference", help=f"the payment's reference (at most {MAX_PAYMENT_REFERENCE} "
                                    f"characters)"),
         option("--paid-at", type=_moment, metavar="ISO",
                help="when it was paid, not in the future (default: now)"))
def cmd_payment_record(conn, args):
    return record_payment(conn, company_of(conn, "Invoice", args.id), args.id, args.amount,
                          args.method, args.reference, args.paid_at)


@command("invoice-void", "void an open invoice nothing was paid or credited to (its number "
                         "stays used) and print it", option("id", metavar="INVOICE_ID"))
def cmd_invoice_void(conn, args):
    return void_invoice(conn, company_of(conn, "Invoice", args.id), args.id)


@command("credit-list", 'print a customer\'s credit notes, newest first, as {"data": [...]}',
         option("--customer", required=True, metavar="CUSTOMER_ID"))
def cmd_credit_list(conn, args):
    return {"data": [credit_note_json(row) for row in customer_credit_notes(
        conn, company_of(conn, "Customer", args.customer), args.customer)]}


@command("credit-apply", "apply a credit note to an open invoice of its customer and print "
                         "both", option("id", metavar="CREDIT_NOTE_ID"),
         option("--invoice", required=True, metavar="INVOICE_ID"),
         option("--amount", type=_amount,
                help="such as 5.00 (default: as much as the note and the invoice allow)"))
def cmd_credit_apply(conn, args):
    return apply_credit(conn, company_of(conn, "Credit note", args.id), args.id, args.invoice,
                        args.amount)


@command("statement", "print a customer's statement: invoices, payments and credit notes, "
                      "and the balance", option("id", metavar="CUSTOMER_ID"),
         option("--since", type=_moment, help="from this day on, after the opening balance "
                                              "(default: the whole history)"))
def cmd_statement(conn, args):
    since = args.since and args.since[:10] + "T00:00:00.000Z"
    return statement(conn, company_of(conn, "Customer", args.id), args.id, since)


@command("customer-terms", "set a customer's own payment terms, or give it the company's "
                           "again, and print the terms in force",
         option("id", metavar="CUSTOMER_ID"),
         one_of(option("--days", help=f"its invoices fall due N days after issue (0 to "
                                      f"{MAX_PAYMENT_TERMS}; 0: on receipt)"),
                option("--default", action="store_true", help="the company's terms")))
def cmd_customer_terms(conn, args):
    if args.days is None and not args.default:
        raise invalid("days", "give --days N or --default")
    return set_customer_terms(conn, company_of(conn, "Customer", args.id), args.id,
                              None if args.default else args.days)


def _approval_limit(text):
    """An approval limit: an amount such as 500.00, or none (no limit)."""
    return "none" if text.strip().casefold() == "none" else _amount(text)


def _contact_options(body, args):
    """The body of contact-add and contact-update from their options (those given)."""
    for name, value in (("name", args.name), ("role", args.role)):
        if value is not None:
            body[name] = value
    if args.approval_limit is not None:
        body["approvalLimit"] = (None if args.approval_limit == "none"
                                 else money(args.approval_limit))
    return body


_CONTACT_OPTIONS = (option("--name"), option("--role", help="admin, buyer or bookkeeper"),
                    option("--approval-limit", type=_approval_limit, metavar="AMOUNT",
                           help="a buyer's, such as 500.00; none: no limit"))


@command("contact-add", "add a contact to a customer, email it an invitation to set a "
                        "password, and print it", option("id", metavar="CUSTOMER_ID"),
         option("--email", required=True), *_CONTACT_OPTIONS)
def cmd_contact_add(conn, args):
    return add_contact(conn, company_of(conn, "Customer", args.id), args.id,
                       _contact_options({"email": args.email}, args), int(time.time() * 1000))


@command("contact-list", 'print a customer\'s contacts, its own first, as {"data": [...]}',
         option("id", metavar="CUSTOMER_ID"))
def cmd_contact_list(conn, args):
    company_id = company_of(conn, "Customer", args.id)
    load_customer(conn, company_id, args.id)
    return {"data": [contact_json(row) for row in customer_contacts(conn, args.id)]}


@command("contact-update", "change a contact's name, role, approval limit or status (BLOCKED "
                           "signs it out everywhere) and print it",
         option("id", metavar="CONTACT_ID"), *_CONTACT_OPTIONS,
         option("--status", help="ACTIVE or BLOCKED"))
def cmd_contact_update(conn, args):
    body = _contact_options({} if args.status is None else {"status": args.status}, args)
    return update_contact(conn, company_of(conn, "Contact", args.id), args.id, body)


@command("export", "write a company's orders (a row per line), products, customers, prices "
                   "or invoices as CSV (UTF-8 with a byte-order mark) on standard output",
         option("kind", choices=EXPORT_KINDS), option("--company", required=True),
         option("--since", type=_moment, help="made from (orders: placed), ISO 8601"),
         option("--until", type=_moment, help="made before, ISO 8601"), alone=True)
def cmd_export(settings, args):
    db = Database(settings.db_path, settings)
    try:
        for text in export_csv(db.conn, args.company, args.kind, args.since, args.until):
            sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()
    finally:
        db.close()


@command("import", "read a CSV file of products, stock counts, customers or customers' prices "
                   "(the columns export writes) and print what each line did; any refused line "
                   "writes nothing (exit 1)",
         option("kind", choices=IMPORT_KINDS), option("--company", required=True),
         option("--file", required=True, type=argparse.FileType("r", encoding="utf-8-sig")),
         option("--dry-run", action="store_true", help="check and count, write nothing"))
def cmd_import(conn, args):
    with args.file:
        result = import_rows(conn, args.company, args.kind, args.file.read())
    del result["lines"]
    if result["errors"] or args.dry_run:
        raise Undone(result, 1 if result["errors"] else 0)
    return result


@command("report-send", "email the company's report of the last complete day or week to its "
                        "staff alert addresses now (each period's once)",
         option("--company", required=True), option("--period", required=True,
                                                     choices=REPORT_PERIODS))
def cmd_report_send(conn, args):
    company = load_company(conn, args.company)
    if not company["staff_alerts"]:
        raise ApiError(409, REPORT_NOWHERE)
    start = last_period(args.period, int(time.time() * 1000))
    if not send_report(conn, company, args.period, start):
        raise ApiError(409, REPORT_SENT.format(period=args.period, start=iso(start)[:10]))
    return {"companyId": company["id"], "period": args.period, "startsAt": iso(start),
            "sentTo": json.loads(company["staff_alerts"])}


@command("invoice-paid", "record a paid invoice of the company's subscription (invoice.paid)",
         option("--company", required=True, help="company ID"),
         option("--invoice-id", required=True, help="billing provider's invoice ID"),
         option("--amount-paid", type=_invoice_amount, required=True,
                help="in the currency: 49.00 usd, 4900 jpy, 12.345 kwd"),
         option("--currency", required=True, help="lower-case code, e.g. usd"),
         option("--hosted-invoice-url", required=True), option("--number", required=True),
         option("--period-start", required=True), option("--period-end", required=True))
def cmd_invoice_paid(conn, args):
    currency = args.currency
    check_currency(currency)  # before its decimals are counted
    amount_paid = minor_units_from_text(args.amount_paid, currency)
    if amount_paid is None:
        raise invalid("amountPaid", f"must have at most {currency_decimals(currency)} "
                                    f"decimal places in {currency}")
    return record_invoice_paid(conn, args.company, args.invoice_id, amount_paid, currency,
                               args.hosted_invoice_url, args.number, args.period_start,
                               args.period_end)


@command("webhook-rotate-secret", "give a webhook a new secret (printed once); the old one "
                                  "signs X-Webhook-Signature-Old during the grace window",
         option("id", metavar="WEBHOOK_ID"),
         option("--grace-hours", type=float, default=float(WEBHOOK_SECRET_GRACE_HOURS),
                help=f"grace window ({WEBHOOK_SECRET_GRACE_HOURS})"))
def cmd_webhook_rotate_secret(conn, args):
    return rotate_webhook_secret(conn, company_of(conn, "Webhook", args.id), args.id,
                                 args.grace_hours)


@command("demo", "create a demo company, catalog and customers (once) and print a new key "
                 f"with all {len(SCOPES)} scopes and curl commands to try", alone=True)
def cmd_demo(settings, args):
    print(demo(settings))


@command("backup", "copy the database to DEST while the server may be running",
         option("destination", metavar="DEST", type=_non_empty), alone=True)
def cmd_backup(settings, args):
    return backup(settings, args.destination)


@command("copy-to", "copy every table into TARGET, an empty database (a file or "
                    "postgresql://...), and verify the copy; stop the server first",
         option("target", metavar="TARGET", type=_non_empty), alone=True)
def cmd_copy_to(settings, args):
    return copy_to(settings, args.target)


@command("deliveries", f"the {DELIVERIES_SHOWN} most recent delivery attempts of a webhook",
         option("id", metavar="WEBHOOK_ID"))
def cmd_deliveries(conn, args):
    company_of(conn, "Webhook", args.id)
    return {"webhookId": args.id, "deliveries": recent_deliveries(conn, args.id)}


def read_password(stream):
    """A password piped on standard input: one line, its line ending not part of it."""
    return stream.read().rstrip("\r\n")


@command("staff-create", "create a dashboard staff account; the password (at least "
                         f"{PASSWORD_MIN} characters) is read from standard input",
         option("--company", required=True, help="company ID"), option("--email", required=True),
         option("--password-stdin", action="store_true", required=True,
                help="read the password from standard input (required: never a flag)"),
         option("--role", choices=STAFF_ROLES, default="owner",
                help="what the account may do on the dashboard (default: owner)"))
def cmd_staff_create(conn, args):
    return create_staff(conn, args.company, args.email, read_password(sys.stdin), args.role)


@command("staff-invite", "create a dashboard staff account and email it a link to set its "
                         "password (it works for an hour)",
         option("--company", required=True, help="company ID"), option("--email", required=True),
         option("--role", choices=STAFF_ROLES, default="staff",
                help="what the account may do on the dashboard (default: staff)"))
def cmd_staff_invite(conn, args):
    return invite_staff(conn, args.company, args.email, args.role, int(time.time() * 1000))


@command("staff-two-step-off", "turn off a staff account's two-step sign-in (a lost phone "
                               "and lost recovery codes): its password signs in alone",
         option("id", metavar="STAFF_ID"))
def cmd_staff_two_step_off(conn, args):
    return reset_two_step(conn, company_of(conn, "Staff account", args.id), args.id)


@command("staff-update", "change a staff account's role (a company keeps an owner)",
         option("id", metavar="STAFF_ID"),
         option("--role", choices=STAFF_ROLES, required=True))
def cmd_staff_update(conn, args):
    return update_staff_role(conn, company_of(conn, "Staff account", args.id), args.id,
                             args.role)


@command("staff-disable", "disable a staff account and end its sessions at once",
         option("id", metavar="STAFF_ID"))
def cmd_staff_disable(conn, args):
    return disable_staff(conn, company_of(conn, "Staff account", args.id), args.id)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="ordering",
        description="A multi-tenant wholesale ordering service on SQLite or PostgreSQL.")
    parser.add_argument("--db", help="SQLite database file or postgresql:// URL "
                                     "(default: $ORDERING_DB or ordering.db)")
    parser.add_argument("--smtp-url", type=_smtp_url,
                        help="mail server, smtp://, smtp+starttls:// or smtps://"
                             "[user[:password]@]host[:port] (default: $ORDERING_SMTP_URL; "
                             "prefer it for a password, which a flag shows to ps)")
    parser.add_argument("--version", action="version", version=f"ordering {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for declared in COMMANDS:
        sub = commands.add_parser(declared.name, help=declared.help, description=declared.help)
        sub.set_defaults(declared=declared)
        for kind, *parts in declared.options:
            if kind == "one of":
                group = sub.add_mutually_exclusive_group()
                for _, flags, settings in parts[0]:
                    group.add_argument(*flags, **settings)
            else:
                flags, settings = parts
                sub.add_argument(*flags, **settings)
    return parser


def run_command(handler, args, settings):
    """Run an operator command in one transaction, then deliver the events it emitted."""
    db = Database(settings.db_path, settings)
    emitted = []
    db.on_commit(emitted.extend)
    with db.write() as conn:
        result = handler(conn, args)
    if emitted:
        if settings.smtp_url and not settings.base_url:
            log.warning("links in the emails this command sends begin with %s; set "
                        "ORDERING_BASE_URL to the address people reach the server at",
                        settings.link_base)
        outbox = Outbox(db, settings, outbox_channels(settings))
        outbox.start_workers()
        outbox.deliver_events(emitted)
        outbox.stop(grace=0)
    return result


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    declared = getattr(args, "declared", None) or next(
        declared for declared in COMMANDS if declared.name == "serve")
    overrides = {"db_path": args.db, "smtp_url": args.smtp_url}
    if declared.overrides:
        for kind, flags, settings in declared.options:
            name = option_dest(flags, settings)
            overrides[name] = getattr(args, name, None)
    try:
        settings = Settings.from_environment(**overrides)
    except (ValueError, TypeError) as error:
        parser.error(f"bad setting in the environment: {error}")
    try:
        if declared.alone:
            result = declared.handler(settings, args)
        else:
            result = run_command(declared.handler, args, settings)
    except ApiError as error:
        details = "".join(f"\n  {d['field']}: {d['rule']}" for d in error.details or ())
        print(f"ordering {declared.name}: {error.message}{details}", file=sys.stderr)
        return 1
    except sqlite3.Error as error:
        print(f"ordering {declared.name}: database error: {error}", file=sys.stderr)
        return 1
    except MailServerError as error:
        print(f"ordering {declared.name}: {error}", file=sys.stderr)
        return 1
    except Undone as undone:
        print(json.dumps(undone.result, ensure_ascii=False))
        return undone.code
    if result is not None:
        print(json.dumps(result, ensure_ascii=False))
    return 0


# 18.4 Former names ---------------------------------------------------------------------------
# Kept for one release after a rename; CHANGELOG.md lists them with their new names.
# Reading one warns (DeprecationWarning), once per name, saying what replaced it.

#: A former name of the module: the name that replaced it.
FORMER_NAMES = {
    "hash_staff_password": "hash_password",
    "staff_password_matches": "password_matches",
    "STAFF_PASSWORD_MIN": "PASSWORD_MIN",
}
def change_customer_password(conn, company_id, customer_id, current, password):
    """The former change_customer_password: a customer's password is its own contact's now
    (change_contact_password, which takes the contact)."""
    warn_former_name("change_customer_password", "change_contact_password")
    contact = own_contact(conn, load_customer(conn, company_id, customer_id))
    return change_contact_password(conn, company_id, contact["id"], current, password)


def __getattr__(name):
    """A former name (PEP 562: the module's own names never come here)."""
    if name not in FORMER_NAMES:
        raise AttributeError(f"module 'ordering' has no attribute {name!r}")
    warn_former_name(name, FORMER_NAMES[name])
    return globals()[FORMER_NAMES[name]]


if __name__ == "__main__":
    sys.exit(main())
