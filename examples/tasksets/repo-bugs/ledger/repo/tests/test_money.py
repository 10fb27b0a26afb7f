import unittest

from ledger import format_cents, to_cents


class TestMoney(unittest.TestCase):
    def test_whole(self):
        self.assertEqual(to_cents(3.0), 300)

    def test_format(self):
        self.assertEqual(format_cents(1234), "12.34")
        self.assertEqual(format_cents(-5), "-0.05")
