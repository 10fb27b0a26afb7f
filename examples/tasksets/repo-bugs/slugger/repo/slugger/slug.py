import re


def slugify(text, sep="-"):
    """Lower-case words of text joined by sep; anything not a letter or digit separates."""
    slug = re.sub(r"[^a-z0-9]+", sep, text.lower())
    return slug
