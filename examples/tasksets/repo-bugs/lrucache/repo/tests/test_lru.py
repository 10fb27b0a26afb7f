import unittest

from lrucache import LRU


class TestLRU(unittest.TestCase):
    def test_capacity(self):
        c = LRU(2)
        for k in "abc":
            c.put(k, k)
        self.assertEqual(len(c), 2)
        self.assertIsNone(c.get("a"))

    def test_update_refreshes(self):
        c = LRU(2)
        c.put("a", 1)
        c.put("b", 2)
        c.put("a", 3)
        c.put("c", 4)
        self.assertEqual(c.get("a"), 3)
        self.assertIsNone(c.get("b"))
