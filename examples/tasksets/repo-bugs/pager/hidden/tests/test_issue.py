import unittest

from pager import page_count


class TestPartialPage(unittest.TestCase):
    def test_partial_last_page(self):
        self.assertEqual(page_count(11, 5), 3)
        self.assertEqual(page_count(1, 10), 1)
