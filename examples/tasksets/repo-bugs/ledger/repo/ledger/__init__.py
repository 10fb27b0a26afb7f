from ledger.money import format_cents, to_cents
