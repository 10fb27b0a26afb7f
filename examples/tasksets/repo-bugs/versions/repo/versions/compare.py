def parse(version):
    """'1.2.3' -> (1, 2, 3)."""
    return tuple(int(part) for part in version.split("."))


def newer(a, b):
    """Whether version a is newer than version b."""
    return a > b
