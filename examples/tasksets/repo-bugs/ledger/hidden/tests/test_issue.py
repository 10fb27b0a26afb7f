import unittest

from ledger import to_cents


class TestRounding(unittest.TestCase):
    def test_rounds_to_nearest_cent(self):
        self.assertEqual(to_cents(1.15), 115)
        self.assertEqual(to_cents(0.29), 29)
