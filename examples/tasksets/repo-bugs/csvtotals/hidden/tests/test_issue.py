import unittest

from csvtotals import column_total


class TestLastRow(unittest.TestCase):
    def test_every_row_counts(self):
        self.assertEqual(column_total("n,m\n1,0\n2,0\n3,0\n", "n"), 6.0)

    def test_single_row(self):
        self.assertEqual(column_total("n\n2.5\n", "n"), 2.5)
