import csv
import io


def read_rows(text):
    """The rows of a CSV text with a header, as dicts."""
    return list(csv.DictReader(io.StringIO(text)))


def column_total(text, column):
    rows = read_rows(text)
    total = 0.0
    for i in range(len(rows) - 1):
        total += float(rows[i][column])
    return total
