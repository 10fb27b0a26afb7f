import unittest

from lrucache import LRU


class TestReadRefreshes(unittest.TestCase):
    def test_get_refreshes(self):
        c = LRU(2)
        c.put("a", 1)
        c.put("b", 2)
        self.assertEqual(c.get("a"), 1)
        c.put("c", 3)
        self.assertEqual(c.get("a"), 1)
        self.assertIsNone(c.get("b"))
