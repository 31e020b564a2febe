-- invoice.finalize updates a row of invoices in the ledger's own database (a database job).
-- A deployment whose invoices table already exists keeps it: IF NOT EXISTS adopts it as is.
CREATE TABLE IF NOT EXISTS invoices (
    id          text PRIMARY KEY,
    status      text NOT NULL DEFAULT 'draft',
    total_cents bigint
);
