import unittest

from csvtotals import column_total, read_rows


class TestTotals(unittest.TestCase):
    def test_rows(self):
        self.assertEqual(read_rows("a,b\n1,2\n"), [{"a": "1", "b": "2"}])

    def test_header_only(self):
        self.assertEqual(column_total("n\n", "n"), 0.0)
