-- The tables of ordering. Applied at every start; every statement is idempotent.
-- Money columns end in _cents (integers), or in _minor for an amount in its own currency's
-- minor unit (cents, but yen for JPY and fils for KWD, as Stripe counts them). Times are ISO
-- 8601 UTC strings with milliseconds, which sort as text. IDs begin with their creation time,
-- so they sort by it as well.
-- The schema version is kept by the engine (PRAGMA user_version on SQLite, the schema_version
-- table on PostgreSQL); ordering.py migrates older databases.
-- In products, customers and orders the columns the API shows come first, in the order the
-- serializers of ordering.py (product_json, customer_json, order_json) read them.
-- Lists shown newest first read ascending indexes backward: an index whose newest key is its
-- smallest takes each new row at its left edge, where SQLite rebalances two or three pages for
-- an insert instead of adding one. The CHECKs of the rows an order writes compare with each
-- value rather than test IN: SQLite builds a temporary index for an IN list of more than two
-- values every time it checks a row.

CREATE TABLE IF NOT EXISTS companies (
    id                  TEXT PRIMARY KEY,
    name                TEXT NOT NULL,
    slug                TEXT NOT NULL UNIQUE,
    created_at          TEXT NOT NULL,
    stripe_customer_id  TEXT,               -- the company as Stripe's customer (cus_...)
    mail_name           TEXT,               -- the display name of its emails' From (default: name)
    reply_to            TEXT,               -- the Reply-To of its emails
    staff_alerts        TEXT,               -- JSON array of the addresses that get staff alerts
    storefront_approval TEXT NOT NULL DEFAULT 'required', -- or 'automatic': new buyers ACTIVE at once
    tax_rate            REAL NOT NULL DEFAULT 0, -- a fraction; a customer's override wins
    payment_terms_days  INTEGER NOT NULL DEFAULT 0, -- invoices fall due N days after issue (0: on receipt)
    buyer_emails_off    TEXT,               -- JSON array of the buyer emails it does not send
    report_period       TEXT,               -- daily or weekly: its staff get a report (null: none)
    time_zone           TEXT,               -- IANA name its pages show times in (null: UTC)
    two_step            TEXT                -- 'owners': its owners sign in with a code too (null: optional)
);
-- Stripe's invoice.paid names a customer: it is at most one company's.
CREATE UNIQUE INDEX IF NOT EXISTS companies_by_stripe_customer ON companies (stripe_customer_id);

-- Only the SHA-256 of a key is kept; the key itself is shown once, when it is made.
CREATE TABLE IF NOT EXISTS api_keys (
    id          TEXT PRIMARY KEY,
    company_id  TEXT NOT NULL REFERENCES companies(id),
    key_hash    TEXT NOT NULL UNIQUE,
    scopes      TEXT NOT NULL,              -- space separated
    rate_limit  INTEGER NOT NULL DEFAULT 60 CHECK (rate_limit > 0),
    expires_at  TEXT,
    revoked     INTEGER NOT NULL DEFAULT 0,
    created_at  TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS products (
    id                   TEXT PRIMARY KEY,
    name                 TEXT NOT NULL,
    sku                  TEXT,
    description          TEXT,
    category             TEXT,
    unit                 TEXT NOT NULL DEFAULT 'each',
    price_cents          INTEGER NOT NULL CHECK (price_cents >= 0),
    stock                INTEGER NOT NULL DEFAULT 0,
    image_url            TEXT,
    is_active            INTEGER NOT NULL DEFAULT 1,
    created_at           TEXT NOT NULL,
    updated_at           TEXT NOT NULL,
    company_id           TEXT NOT NULL REFERENCES companies(id),
    low_stock_threshold  INTEGER,
    low_stock_alerted    INTEGER NOT NULL DEFAULT 0,  -- product.low_stock fired and not re-armed yet
    min_quantity         INTEGER NOT NULL DEFAULT 1 CHECK (min_quantity >= 1),
    order_multiple       INTEGER NOT NULL DEFAULT 1 CHECK (order_multiple >= 1),
    price_breaks         TEXT
);
-- A product's quantity rules (the fewest units an order's line takes, the case pack its
-- units come in) and price breaks hold for storefront and dashboard orders only: the API
-- takes any whole number from 1, at the catalog price (the spec). price_breaks is JSON: a list
-- of [units from, price in cents] pairs, by units ascending.
CREATE INDEX IF NOT EXISTS products_by_company_newest
    ON products (company_id, created_at, id);
CREATE INDEX IF NOT EXISTS products_by_company_category_newest
    ON products (company_id, category, created_at, id);
CREATE INDEX IF NOT EXISTS products_by_company_active_newest
    ON products (company_id, is_active, created_at, id);
CREATE INDEX IF NOT EXISTS products_by_company_sku ON products (company_id, sku);   -- quick order
CREATE INDEX IF NOT EXISTS products_by_company_active_category_newest  -- the store's catalog
    ON products (company_id, is_active, category, created_at, id);   -- and categories

-- A customer group's price list (docs/catalog.md): a discount off the catalog price, in
-- hundredths of a percent (1250: 12.5%), and prices of its own for some products, which its
-- customers get in storefront and dashboard orders.
CREATE TABLE IF NOT EXISTS customer_groups (
    id           TEXT PRIMARY KEY,
    company_id   TEXT NOT NULL REFERENCES companies(id),
    name         TEXT NOT NULL,
    name_key     TEXT NOT NULL,                -- case-folded name: one group a name
    discount_bp  INTEGER NOT NULL DEFAULT 0 CHECK (discount_bp >= 0 AND discount_bp <= 10000),
    created_at   TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS customer_groups_unique_name
    ON customer_groups (company_id, name_key);

CREATE TABLE IF NOT EXISTS customers (
    id                 TEXT PRIMARY KEY,
    email              TEXT NOT NULL,
    name               TEXT,
    status             TEXT NOT NULL DEFAULT 'ACTIVE' CHECK (status IN ('ACTIVE', 'BLOCKED', 'PENDING')),
    notes              TEXT,
    credit_limit_cents INTEGER,
    tax_rate_override  REAL,
    email_verified     INTEGER NOT NULL DEFAULT 0,
    created_at         TEXT NOT NULL,
    updated_at         TEXT NOT NULL,
    company_id         TEXT NOT NULL REFERENCES companies(id),
    email_key          TEXT NOT NULL,      -- case-folded email, for uniqueness and search
    payment_terms_days INTEGER,            -- its own payment terms (null: the company's)
    group_id           TEXT REFERENCES customer_groups(id)
);
CREATE UNIQUE INDEX IF NOT EXISTS customers_unique_email
    ON customers (company_id, email_key);
CREATE INDEX IF NOT EXISTS customers_by_company_newest
    ON customers (company_id, created_at, id);
CREATE INDEX IF NOT EXISTS customers_by_company_status_newest
    ON customers (company_id, status, created_at, id);

-- The people of a customer (a business) who sign in to its store, each with a role (see
-- docs/contacts.md). The customer's own email is its first contact, an admin. An email signs
-- in to one account at a store: unique within the company, whichever customer it belongs to.
-- A buyer's approval limit (null: none) is the total, tax included, above which its checkout
-- becomes a request that an admin approves.
CREATE TABLE IF NOT EXISTS contacts (
    id                   TEXT PRIMARY KEY,
    customer_id          TEXT NOT NULL REFERENCES customers(id),
    company_id           TEXT NOT NULL REFERENCES companies(id),
    email                TEXT NOT NULL,
    email_key            TEXT NOT NULL,          -- case-folded email
    name                 TEXT,
    role                 TEXT NOT NULL CHECK (role IN ('admin', 'buyer', 'bookkeeper')),
    status               TEXT NOT NULL DEFAULT 'ACTIVE' CHECK (status IN ('ACTIVE', 'BLOCKED')),
    approval_limit_cents INTEGER,
    email_verified       INTEGER NOT NULL DEFAULT 0,
    password_hash        TEXT,
    created_at           TEXT NOT NULL,
    updated_at           TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS contacts_unique_email ON contacts (company_id, email_key);
CREATE INDEX IF NOT EXISTS contacts_of_customer ON contacts (customer_id, created_at, id);

-- A customer's own price for a product: storefront and dashboard orders use it; orders placed
-- through the API never do (the spec).
CREATE TABLE IF NOT EXISTS customer_prices (
    customer_id  TEXT NOT NULL REFERENCES customers(id),
    product_id   TEXT NOT NULL REFERENCES products(id),
    company_id   TEXT NOT NULL REFERENCES companies(id),
    price_cents  INTEGER NOT NULL CHECK (price_cents >= 0),
    updated_at   TEXT NOT NULL,
    PRIMARY KEY (customer_id, product_id)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS group_prices (
    group_id     TEXT NOT NULL REFERENCES customer_groups(id),
    product_id   TEXT NOT NULL REFERENCES products(id),
    company_id   TEXT NOT NULL REFERENCES companies(id),
    price_cents  INTEGER NOT NULL CHECK (price_cents >= 0),
    updated_at   TEXT NOT NULL,
    PRIMARY KEY (group_id, product_id)
) WITHOUT ROWID;

-- A contact's cart, kept on the server: it survives signing out and follows the contact to
-- another device. Prices are not kept: the cart shows them (the customer's) as they are now.
CREATE TABLE IF NOT EXISTS cart_lines (
    contact_id   TEXT NOT NULL REFERENCES contacts(id),
    product_id   TEXT NOT NULL REFERENCES products(id),
    quantity     INTEGER NOT NULL CHECK (quantity >= 1),
    added_at     TEXT NOT NULL,
    PRIMARY KEY (contact_id, product_id)
) WITHOUT ROWID;

-- A buyer's saved shipping addresses (an order keeps its own copy of the one it ships to).
CREATE TABLE IF NOT EXISTS addresses (
    id           TEXT PRIMARY KEY,
    customer_id  TEXT NOT NULL REFERENCES customers(id),
    name         TEXT NOT NULL,             -- who receives the goods
    line1        TEXT NOT NULL,
    line2        TEXT,
    city         TEXT NOT NULL,
    region       TEXT,
    postal_code  TEXT NOT NULL,
    country      TEXT NOT NULL,
    created_at   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS addresses_of_customer ON addresses (customer_id, created_at);

-- A company's names and tracking links of the spec's carrier codes, as Settings sets them; a
-- code without a row is called "Carrier A" (and so on) and tracked by the server's template.
CREATE TABLE IF NOT EXISTS carriers (
    company_id   TEXT NOT NULL REFERENCES companies(id),
    code         TEXT NOT NULL,     -- CARRIER_A to CARRIER_E (OTHER gives its URL each time)
    name         TEXT NOT NULL,
    url_template TEXT NOT NULL,     -- an http(s) URL with {number} where the number goes
    PRIMARY KEY (company_id, code)
);

CREATE TABLE IF NOT EXISTS orders (
    id               TEXT PRIMARY KEY,
    status           TEXT NOT NULL CHECK (status = 'SUBMITTED' OR status = 'CONFIRMED' OR
                                      status = 'SHIPPED' OR status = 'DELIVERED' OR
                                      status = 'CANCELLED'),
    po_number        TEXT,
    notes            TEXT,
    total_cents      INTEGER NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL,
    customer_id      TEXT REFERENCES customers(id),
    tracking_carrier TEXT,
    tracking_number  TEXT,
    tracking_url     TEXT,
    company_id       TEXT NOT NULL REFERENCES companies(id),
    source           TEXT NOT NULL CHECK (source = 'api' OR source = 'storefront' OR
                                      source = 'dashboard'),
    shipping_address TEXT,              -- JSON: a copy of the address a storefront order ships to
    checkout_token   TEXT,              -- the checkout form's token: a resubmitted form finds its order
    tax_rate         REAL NOT NULL DEFAULT 0,    -- the rate in force when it was placed
    tax_cents        INTEGER NOT NULL DEFAULT 0, -- the tax on total_cents at that rate (rounded once)
    placed_by        TEXT,              -- the contact (store) or staff account (dashboard)
    approved_by      TEXT,              -- the admin contact who approved its request, if one did
    number           INTEGER            -- what people call it: 1001, 1002, ... per company
);
-- Each company numbers its orders 1001, 1002, ... (the next is taken in the write transaction
-- that places it, as invoices' are, so numbers have no gaps); the dashboard's search finds one.
CREATE UNIQUE INDEX IF NOT EXISTS orders_by_company_number ON orders (company_id, number);
CREATE INDEX IF NOT EXISTS orders_by_company_newest
    ON orders (company_id, created_at, id);
CREATE INDEX IF NOT EXISTS orders_by_company_status_newest
    ON orders (company_id, status, created_at, id);
CREATE INDEX IF NOT EXISTS orders_by_company_customer_newest
    ON orders (company_id, customer_id, created_at, id);
CREATE INDEX IF NOT EXISTS orders_by_company_po_number    -- the dashboard's search
    ON orders (company_id, po_number COLLATE NOCASE) WHERE po_number IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS orders_by_checkout ON orders (customer_id, checkout_token)
    WHERE checkout_token IS NOT NULL;

-- Every status an order has had and where each change came from (api, dashboard or
-- storefront; null for changes made before this record was kept): the storefront's timeline
-- and the dashboard's history, whether or not a webhook subscribes to the events.
-- The primary key's columns come first, in its order: SQLite 3.40's integrity_check reports
-- NULLs that are not there in a WITHOUT ROWID table whose key columns come later.
CREATE TABLE IF NOT EXISTS order_status_changes (
    order_id         TEXT NOT NULL REFERENCES orders(id),
    created_at       TEXT NOT NULL,
    id               TEXT NOT NULL,
    from_status      TEXT,              -- null: the order was placed
    to_status        TEXT NOT NULL,
    source           TEXT,
    tracking_number  TEXT,              -- the order's tracking number after the change
    note             TEXT,              -- why, where staff said (a cancellation's reason)
    PRIMARY KEY (order_id, created_at, id)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS order_items (
    id               TEXT PRIMARY KEY,
    order_id         TEXT NOT NULL REFERENCES orders(id),
    position         INTEGER NOT NULL,
    product_id       TEXT NOT NULL REFERENCES products(id),
    quantity         INTEGER NOT NULL CHECK (quantity >= 1),
    unit_price_cents INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS order_items_of_order ON order_items (order_id, position);

-- A checkout above its buyer's approval limit: no order, no stock taken, until an admin of the
-- customer approves it (then the order is placed from these lines at that moment's prices and
-- stock) or declines it with a reason. Its checkout form's token finds it again if resent.
CREATE TABLE IF NOT EXISTS order_requests (
    id               TEXT PRIMARY KEY,
    company_id       TEXT NOT NULL REFERENCES companies(id),
    customer_id      TEXT NOT NULL REFERENCES customers(id),
    contact_id       TEXT NOT NULL REFERENCES contacts(id),       -- who asked
    status           TEXT NOT NULL CHECK (status IN ('PENDING', 'APPROVED', 'DECLINED')),
    lines            TEXT NOT NULL,          -- JSON: [{"productId", "quantity"}], the cart's
    shipping_address TEXT NOT NULL,          -- JSON, as an order keeps it
    po_number        TEXT,
    notes            TEXT,
    total_cents      INTEGER NOT NULL,       -- tax included, as the checkout showed it
    checkout_token   TEXT NOT NULL,
    decided_by       TEXT REFERENCES contacts(id),
    reason           TEXT,                   -- why it was declined
    order_id         TEXT REFERENCES orders(id),
    created_at       TEXT NOT NULL,
    decided_at       TEXT
);
CREATE UNIQUE INDEX IF NOT EXISTS order_requests_by_checkout
    ON order_requests (contact_id, checkout_token);
CREATE INDEX IF NOT EXISTS order_requests_by_company_status
    ON order_requests (company_id, status, created_at, id);
CREATE INDEX IF NOT EXISTS order_requests_of_customer
    ON order_requests (customer_id, created_at, id);

CREATE TABLE IF NOT EXISTS returns (
    id           TEXT PRIMARY KEY,
    company_id   TEXT NOT NULL REFERENCES companies(id),
    order_id     TEXT NOT NULL REFERENCES orders(id),
    customer_id  TEXT,
    status       TEXT NOT NULL CHECK (status IN ('REQUESTED', 'APPROVED', 'RECEIVED', 'REFUNDED')),
    reason       TEXT NOT NULL,
    item_count   INTEGER NOT NULL,
    actor        TEXT,
    created_at   TEXT NOT NULL,
    updated_at   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS returns_by_company_newest ON returns (company_id, created_at, id);
CREATE INDEX IF NOT EXISTS returns_of_order ON returns (order_id, created_at, id);

-- The lines a return takes back and how many units of each (returns opened before lines were
-- recorded have none: their item_count says how many lines).
CREATE TABLE IF NOT EXISTS return_lines (
    return_id      TEXT NOT NULL REFERENCES returns(id),
    order_item_id  TEXT NOT NULL REFERENCES order_items(id),
    quantity       INTEGER NOT NULL CHECK (quantity >= 1),
    PRIMARY KEY (return_id, order_item_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS return_lines_of_item ON return_lines (order_item_id);  -- units left

CREATE TABLE IF NOT EXISTS refunds (
    id             TEXT PRIMARY KEY,
    company_id     TEXT NOT NULL REFERENCES companies(id),
    return_id      TEXT NOT NULL UNIQUE REFERENCES returns(id),
    amount_cents   INTEGER NOT NULL,
    method         TEXT NOT NULL CHECK (method IN ('CREDIT', 'MANUAL')),
    good_units     INTEGER NOT NULL,
    damaged_units  INTEGER NOT NULL,
    subtotal_cents INTEGER NOT NULL,
    created_at     TEXT NOT NULL
);

-- The stock ledger: every change of a product's stock, written in the transaction that makes
-- it, so that for every product the sum of change over its movements is its stock. reason says
-- why (see docs/stock.md), order_id or return_id what it belongs to, actor_type and actor_id who
-- made it (staff and a staff ID, key and an API key ID, buyer and a customer ID, command, or
-- system: the program itself, as for the opening movements schema version 6 wrote).
CREATE TABLE IF NOT EXISTS stock_movements (
    company_id   TEXT NOT NULL REFERENCES companies(id),
    created_at   TEXT NOT NULL,
    id           TEXT NOT NULL,
    product_id   TEXT NOT NULL REFERENCES products(id),
    change       INTEGER NOT NULL,          -- signed: units in (+) or out (-)
    level_after  INTEGER NOT NULL,          -- the product's stock once it was made
    reason       TEXT NOT NULL CHECK (reason = 'order' OR reason = 'adjustment' OR
                                      reason = 'count' OR reason = 'return' OR
                                      reason = 'cancellation' OR reason = 'import' OR
                                      reason = 'initial'),
    order_id     TEXT REFERENCES orders(id),
    return_id    TEXT REFERENCES returns(id),
    note         TEXT,
    actor_type   TEXT NOT NULL CHECK (actor_type = 'staff' OR actor_type = 'key' OR
                                      actor_type = 'buyer' OR actor_type = 'command' OR
                                      actor_type = 'system'),
    actor_id     TEXT,
    PRIMARY KEY (company_id, created_at, id)    -- GET /api/v1/inventory (first: see above)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS stock_movements_of_product_newest   -- a product's history, productId
    ON stock_movements (product_id, created_at, id);
CREATE INDEX IF NOT EXISTS stock_movements_of_order      -- a cancelled order's restock, once
    ON stock_movements (order_id) WHERE reason = 'cancellation';

CREATE TABLE IF NOT EXISTS invoices (
    id                  TEXT PRIMARY KEY,
    company_id          TEXT NOT NULL REFERENCES companies(id),
    stripe_invoice_id   TEXT NOT NULL UNIQUE,
    amount_paid_minor   INTEGER NOT NULL,
    currency            TEXT NOT NULL,
    hosted_invoice_url  TEXT NOT NULL,
    number              TEXT NOT NULL,
    period_start        TEXT NOT NULL,
    period_end          TEXT NOT NULL,
    created_at          TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS invoices_by_company_newest    -- the dashboard's Billing page
    ON invoices (company_id, created_at, id);

-- Money owed by customers (see docs/money.md). An order has one invoice that is not void
-- (a void one's order may be invoiced again, under a new number); each company numbers its
-- invoices 1, 2, 3... (sequence, unique per company: the
-- next is taken in the write transaction that issues it, so numbers have no gaps). paid_cents
-- and credited_cents are the sums of its payments and of the credit applied to it, kept in
-- the transaction that records them; its balance is total_cents less both.
CREATE TABLE IF NOT EXISTS customer_invoices (
    id                TEXT PRIMARY KEY,
    company_id        TEXT NOT NULL REFERENCES companies(id),
    order_id          TEXT NOT NULL REFERENCES orders(id),
    customer_id       TEXT REFERENCES customers(id),
    sequence          INTEGER NOT NULL,
    number            TEXT NOT NULL,             -- INV-000001
    status            TEXT NOT NULL CHECK (status = 'OPEN' OR status = 'PAID' OR status = 'VOID'),
    subtotal_cents    INTEGER NOT NULL,          -- the order's lines at their frozen prices
    tax_rate          REAL NOT NULL,             -- the order's, frozen when it was placed
    tax_cents         INTEGER NOT NULL,
    total_cents       INTEGER NOT NULL,          -- subtotal and tax
    paid_cents        INTEGER NOT NULL DEFAULT 0,
    credited_cents    INTEGER NOT NULL DEFAULT 0,
    terms_days        INTEGER NOT NULL,          -- the payment terms it was issued on
    issued_at         TEXT NOT NULL,
    due_at            TEXT NOT NULL,             -- issued_at and terms_days days
    reminders_sent    INTEGER NOT NULL DEFAULT 0,
    next_reminder_at  TEXT,                      -- null: no reminder is to come
    created_at        TEXT NOT NULL,
    updated_at        TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS customer_invoices_by_company_sequence
    ON customer_invoices (company_id, sequence);
CREATE UNIQUE INDEX IF NOT EXISTS customer_invoices_of_order
    ON customer_invoices (order_id) WHERE status <> 'VOID';
CREATE INDEX IF NOT EXISTS customer_invoices_by_company_newest   -- the dashboard's Invoices
    ON customer_invoices (company_id, created_at, id);
CREATE INDEX IF NOT EXISTS customer_invoices_of_customer
    ON customer_invoices (company_id, customer_id, created_at, id);
-- A statement's period, and the opening balance summed from this index alone.
CREATE INDEX IF NOT EXISTS customer_invoices_of_customer_issued
    ON customer_invoices (company_id, customer_id, issued_at, status, total_cents);
CREATE INDEX IF NOT EXISTS customer_invoices_by_company_status
    ON customer_invoices (company_id, status, due_at);
-- Receivables sum what each customer's open invoices owe from this index alone.
CREATE INDEX IF NOT EXISTS customer_invoices_owed ON customer_invoices
    (company_id, status, customer_id, due_at, total_cents, paid_cents, credited_cents);
CREATE INDEX IF NOT EXISTS customer_invoices_to_remind
    ON customer_invoices (next_reminder_at) WHERE next_reminder_at IS NOT NULL;

-- A payment staff recorded against an invoice: when the buyer paid, how, and its reference.
CREATE TABLE IF NOT EXISTS payments (
    id            TEXT PRIMARY KEY,
    company_id    TEXT NOT NULL REFERENCES companies(id),
    invoice_id    TEXT NOT NULL REFERENCES customer_invoices(id),
    amount_cents  INTEGER NOT NULL CHECK (amount_cents > 0),
    paid_at       TEXT NOT NULL,
    method        TEXT,
    reference     TEXT,
    created_at    TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS payments_of_invoice ON payments (invoice_id, paid_at);

-- A credit note: what a CREDIT refund owes the customer, numbered in its own sequence per
-- company (CN-000001); remaining_cents is what is not yet applied to its invoices.
CREATE TABLE IF NOT EXISTS credit_notes (
    id               TEXT PRIMARY KEY,
    company_id       TEXT NOT NULL REFERENCES companies(id),
    customer_id      TEXT NOT NULL REFERENCES customers(id),
    refund_id        TEXT NOT NULL UNIQUE REFERENCES refunds(id),
    sequence         INTEGER NOT NULL,
    number           TEXT NOT NULL,
    amount_cents     INTEGER NOT NULL CHECK (amount_cents > 0),
    remaining_cents  INTEGER NOT NULL CHECK (remaining_cents >= 0),
    created_at       TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS credit_notes_by_company_sequence
    ON credit_notes (company_id, sequence);
CREATE INDEX IF NOT EXISTS credit_notes_of_customer ON credit_notes (customer_id, created_at);

-- Credit applied from a credit note to an invoice of the same customer.
CREATE TABLE IF NOT EXISTS credit_applications (
    id              TEXT PRIMARY KEY,
    company_id      TEXT NOT NULL REFERENCES companies(id),
    credit_note_id  TEXT NOT NULL REFERENCES credit_notes(id),
    invoice_id      TEXT NOT NULL REFERENCES customer_invoices(id),
    amount_cents    INTEGER NOT NULL CHECK (amount_cents > 0),
    created_at      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS credit_applications_of_note ON credit_applications (credit_note_id);
CREATE INDEX IF NOT EXISTS credit_applications_of_invoice ON credit_applications (invoice_id);

-- Stripe events acted on, by Stripe's event ID, written in the transaction of what they did:
-- Stripe may send an event more than once, and a repeat finds its ID here.
-- The scheduled reports sent (docs/operations.md): one row a company, period and start,
-- written with the report's emails, so that however many processes look, each is sent once.
CREATE TABLE IF NOT EXISTS report_runs (
    company_id  TEXT NOT NULL REFERENCES companies(id),
    period      TEXT NOT NULL CHECK (period IN ('daily', 'weekly')),
    starts_at   TEXT NOT NULL,
    sent_at     TEXT NOT NULL,
    PRIMARY KEY (company_id, period, starts_at)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS stripe_events (
    id           TEXT PRIMARY KEY,          -- Stripe's evt_...
    company_id   TEXT NOT NULL REFERENCES companies(id),
    event_type   TEXT NOT NULL,
    received_at  TEXT NOT NULL
);

-- The webhook secret is the one secret kept in clear: deliveries must be signed with it.
CREATE TABLE IF NOT EXISTS webhooks (
    id                  TEXT PRIMARY KEY,
    company_id          TEXT NOT NULL REFERENCES companies(id),
    url                 TEXT NOT NULL,
    events              TEXT NOT NULL,      -- JSON array of event names
    is_active           INTEGER NOT NULL DEFAULT 1,
    secret              TEXT NOT NULL,
    old_secret          TEXT,
    grace_expires_at    TEXT,
    created_at          TEXT NOT NULL,
    updated_at          TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS webhooks_of_company ON webhooks (company_id, created_at, id);

-- The outbox: an event and its deliveries are written in the transaction of the change.
CREATE TABLE IF NOT EXISTS events (
    id          TEXT PRIMARY KEY,
    company_id  TEXT NOT NULL REFERENCES companies(id),
    name        TEXT NOT NULL,
    body        TEXT NOT NULL,              -- the exact JSON envelope that is sent and signed
    created_at  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_created ON events (created_at);   -- retention

-- A delivery is pending, then sending (claimed by the process claimed_by until lease_until),
-- then done;
-- a done row is the delivery log entry of the spec.
CREATE TABLE IF NOT EXISTS deliveries (
    id            TEXT PRIMARY KEY,
    event_id      TEXT NOT NULL REFERENCES events(id),
    webhook_id    TEXT NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
    state         TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sending', 'done')),
    lease_until   TEXT,
    status_code   INTEGER,
    response_body TEXT,
    duration_ms   INTEGER,
    success       INTEGER,
    created_at    TEXT NOT NULL,
    attempted_at  TEXT,
    claimed_by    TEXT                      -- the sending process (see claimer_alive)
);
CREATE INDEX IF NOT EXISTS deliveries_waiting ON deliveries (state, lease_until);
CREATE INDEX IF NOT EXISTS deliveries_of_webhook ON deliveries (webhook_id, attempted_at);
CREATE INDEX IF NOT EXISTS deliveries_of_event ON deliveries (event_id);

-- The mail outbox: an email is written in the transaction of the change that causes it, one
-- recipient each. It waits (pending until next_attempt_at, then sending: claimed by the process
-- claimed_by until lease_until) until it is sent, failed (a 5xx reply, a refused recipient, or
-- no success before retries end) or unsent (never tried: see docs/mail.md). Its id is also its
-- Message-ID's, the same on every attempt.
CREATE TABLE IF NOT EXISTS emails (
    id               TEXT PRIMARY KEY,
    company_id       TEXT NOT NULL REFERENCES companies(id),
    kind             TEXT NOT NULL,         -- its template (EMAIL_TEMPLATES in ordering.py)
    to_address       TEXT NOT NULL,
    to_name          TEXT,
    subject          TEXT NOT NULL,
    data             TEXT NOT NULL,         -- JSON: the values its template is filled with
    state            TEXT NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'sending', 'sent', 'failed', 'unsent')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    last_reply       TEXT,                  -- the server's last answer, or why it was not sent
    queued_at        TEXT NOT NULL,         -- when it began to wait (again): retries end after
    next_attempt_at  TEXT NOT NULL,
    lease_until      TEXT,
    claimed_by       TEXT,                  -- the sending process (see claimer_alive)
    created_at       TEXT NOT NULL,
    finished_at      TEXT                   -- when it became sent, failed or unsent
);
CREATE INDEX IF NOT EXISTS emails_waiting ON emails (state, next_attempt_at);
CREATE INDEX IF NOT EXISTS emails_by_company_newest ON emails (company_id, created_at, id);
CREATE INDEX IF NOT EXISTS emails_of_company_finished ON emails (company_id, finished_at);  -- retention

-- Every attempt to send an email, with what the server answered.
CREATE TABLE IF NOT EXISTS email_attempts (
    id            TEXT PRIMARY KEY,
    email_id      TEXT NOT NULL REFERENCES emails(id) ON DELETE CASCADE,
    attempted_at  TEXT NOT NULL,
    outcome       TEXT NOT NULL CHECK (outcome IN ('sent', 'deferred', 'failed')),
    reply         TEXT NOT NULL,
    duration_ms   INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS email_attempts_of_email ON email_attempts (email_id, attempted_at);

-- Remembered POST responses, so a retried request is answered without being done twice.
-- While claimed_by is set the request is still in progress (status and body are not yet set).
CREATE TABLE IF NOT EXISTS idempotency_keys (
    company_id   TEXT NOT NULL,
    key          TEXT NOT NULL,
    fingerprint  TEXT NOT NULL,
    status       INTEGER NOT NULL,
    body         BLOB NOT NULL,
    expires_at   TEXT NOT NULL,
    claimed_by   TEXT,                      -- set while the request is in progress
    PRIMARY KEY (company_id, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_keys_expiry ON idempotency_keys (expires_at);

-- Dashboard staff. A password is kept only as its scrypt hash with a salt of its own; an
-- email is unique within a company. A disabled account can no longer sign in. Its role says
-- what it may do on the dashboard (STAFF_RIGHTS).
CREATE TABLE IF NOT EXISTS staff (
    id             TEXT PRIMARY KEY,
    company_id     TEXT NOT NULL REFERENCES companies(id),
    email          TEXT NOT NULL,
    email_key      TEXT NOT NULL,           -- case-folded email
    password_hash  TEXT NOT NULL,
    disabled       INTEGER NOT NULL DEFAULT 0,
    created_at     TEXT NOT NULL,
    role           TEXT NOT NULL DEFAULT 'owner' CHECK (role IN ('owner', 'staff', 'read-only')),
    totp_secret    TEXT,                    -- two-step sign-in's key, base32 (null: password only)
    totp_pending   TEXT,                    -- a key being set up, until a code from it confirms it
    totp_step      INTEGER                  -- the time step of the last code used: each works once
);
CREATE UNIQUE INDEX IF NOT EXISTS staff_unique_email ON staff (company_id, email_key);
CREATE INDEX IF NOT EXISTS staff_by_email ON staff (email_key);

-- A staff account's recovery codes for two-step sign-in (SHA-256 only); each works once.
CREATE TABLE IF NOT EXISTS staff_recovery_codes (
    staff_id   TEXT NOT NULL REFERENCES staff(id) ON DELETE CASCADE,
    code_hash  TEXT NOT NULL,
    PRIMARY KEY (staff_id, code_hash)
) WITHOUT ROWID;

-- A sign-in whose password was right and whose code is still to come (a cookie's SHA-256):
-- it lasts minutes, and becomes a session only with the code.
CREATE TABLE IF NOT EXISTS staff_sign_in_steps (
    token_hash  TEXT PRIMARY KEY,
    staff_id    TEXT NOT NULL REFERENCES staff(id) ON DELETE CASCADE,
    expires_at  TEXT NOT NULL
);

-- A signed-in browser. Only the SHA-256 of the session cookie is kept; last_seen_at moves
-- forward as the session is used, and the session ends after the idle limit.
CREATE TABLE IF NOT EXISTS staff_sessions (
    token_hash    TEXT PRIMARY KEY,
    staff_id      TEXT NOT NULL REFERENCES staff(id) ON DELETE CASCADE,
    created_at    TEXT NOT NULL,
    last_seen_at  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS staff_sessions_of_staff ON staff_sessions (staff_id);

-- A signed-in storefront contact, as staff_sessions for staff (the cookie is scoped to its store).
CREATE TABLE IF NOT EXISTS contact_sessions (
    token_hash    TEXT PRIMARY KEY,
    contact_id    TEXT NOT NULL REFERENCES contacts(id) ON DELETE CASCADE,
    created_at    TEXT NOT NULL,
    last_seen_at  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS contact_sessions_of_contact ON contact_sessions (contact_id);

-- The tokens of emailed storefront links (verify an address, set a password): only their
-- SHA-256 is kept; a link is used once, and using one ends its contact's other links of its
-- purpose.
CREATE TABLE IF NOT EXISTS contact_tokens (
    token_hash   TEXT PRIMARY KEY,
    contact_id   TEXT NOT NULL REFERENCES contacts(id) ON DELETE CASCADE,
    purpose      TEXT NOT NULL CHECK (purpose IN ('verify', 'reset')),
    created_at   TEXT NOT NULL,
    expires_at   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS contact_tokens_of_contact ON contact_tokens (contact_id, created_at);

-- The tokens of emailed dashboard links (set a password: a reset, an invitation), as
-- contact_tokens for staff.
CREATE TABLE IF NOT EXISTS staff_tokens (
    token_hash   TEXT PRIMARY KEY,
    staff_id     TEXT NOT NULL REFERENCES staff(id) ON DELETE CASCADE,
    purpose      TEXT NOT NULL CHECK (purpose IN ('reset', 'invite')),
    created_at   TEXT NOT NULL,
    expires_at   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS staff_tokens_of_staff ON staff_tokens (staff_id, created_at);

-- Failed sign-ins (dashboard and storefronts) and wrong current passwords, per email (within
-- a store for its buyers) and per client address ("email:..." / "address:...").
-- Registration and password-reset requests of the last hour, known address or not: each
-- request commits one, so that its answer takes the same time either way.
CREATE TABLE IF NOT EXISTS account_requests (
    id          TEXT PRIMARY KEY,
    company_id  TEXT REFERENCES companies(id), -- null: a staff reset (the dashboard's, any company)
    email_key   TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS account_requests_by_time ON account_requests (created_at);

CREATE TABLE IF NOT EXISTS sign_in_failures (
    subject          TEXT PRIMARY KEY,
    failures         INTEGER NOT NULL,
    last_failure_at  TEXT NOT NULL
) WITHOUT ROWID;

-- Rate-limit counts per client and minute, on PostgreSQL, where every process and machine
-- serving the database shares them. (On SQLite the processes of one machine count in a
-- memory-mapped file beside the database instead, so that a read costs no write.)
CREATE TABLE IF NOT EXISTS rate_windows (
    subject  TEXT NOT NULL,                 -- "key <id>" or "ip <address>"
    minute   INTEGER NOT NULL,              -- Unix time // 60
    hits     INTEGER NOT NULL,
    PRIMARY KEY (subject, minute)
) WITHOUT ROWID;

