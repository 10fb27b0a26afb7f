import unittest

from pager import page_count, page_slice


class TestPages(unittest.TestCase):
    def test_exact(self):
        self.assertEqual(page_count(10, 5), 2)
        self.assertEqual(page_count(0, 5), 0)

    def test_slice(self):
        self.assertEqual(page_slice(list(range(7)), 2, 3), [3, 4, 5])

    def test_bad_size(self):
        with self.assertRaises(ValueError):
            page_count(3, 0)
