import unittest

from stockroom import Inventory


class TestOverdraw(unittest.TestCase):
    def test_refuses_more_than_in_stock(self):
        inv = Inventory()
        inv.add("bolt", 3)
        with self.assertRaises(ValueError):
            inv.remove("bolt", 5)
        self.assertEqual(inv.count("bolt"), 3)

    def test_unknown_item(self):
        with self.assertRaises(ValueError):
            Inventory().remove("gear", 1)
