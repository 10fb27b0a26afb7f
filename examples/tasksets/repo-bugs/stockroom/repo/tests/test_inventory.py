import unittest

from stockroom import Inventory


class TestInventory(unittest.TestCase):
    def test_add_remove(self):
        inv = Inventory()
        inv.add("nut", 4)
        inv.remove("nut", 3)
        self.assertEqual(inv.count("nut"), 1)

    def test_positive_counts(self):
        with self.assertRaises(ValueError):
            Inventory().add("nut", 0)
