-- The fixture invoice.finalize's table: a row per invoice, final once the job ran.
CREATE TABLE IF NOT EXISTS invoices (
    id          text PRIMARY KEY,
    status      text NOT NULL DEFAULT 'draft',
    total_cents bigint
);
