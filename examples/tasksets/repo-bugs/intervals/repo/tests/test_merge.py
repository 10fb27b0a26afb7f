import unittest

from intervals import merge, total_length


class TestMerge(unittest.TestCase):
    def test_overlapping(self):
        self.assertEqual(merge([(5, 8), (1, 4), (2, 6)]), [(1, 8)])

    def test_disjoint(self):
        self.assertEqual(merge([(4, 5), (1, 2)]), [(1, 2), (4, 5)])

    def test_length(self):
        self.assertEqual(total_length([(1, 4), (2, 6)]), 5)
