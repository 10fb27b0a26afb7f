def page_count(total, per_page):
    """How many pages total items fill, per_page on each."""
    if per_page <= 0:
        raise ValueError("per_page must be positive")
    return total // per_page


def page_slice(items, page, per_page):
    """The items on page (counted from 1)."""
    start = (page - 1) * per_page
    return items[start : start + per_page]
