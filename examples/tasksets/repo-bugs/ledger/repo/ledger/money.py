def to_cents(amount):
    """An amount in currency units (a float) as whole cents."""
    return int(amount * 100)


def format_cents(cents):
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}{cents // 100}.{cents % 100:02d}"
