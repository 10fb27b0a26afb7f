import unittest

from intervals import merge, total_length


class TestTouching(unittest.TestCase):
    def test_touching_intervals_merge(self):
        self.assertEqual(merge([(1, 3), (3, 5)]), [(1, 5)])

    def test_chain(self):
        self.assertEqual(merge([(0, 1), (1, 2), (2, 3)]), [(0, 3)])
        self.assertEqual(total_length([(0, 1), (1, 2)]), 2)
