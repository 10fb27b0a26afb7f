import unittest

from calendarx import days_in_february, is_leap


class TestFourHundred(unittest.TestCase):
    def test_2000(self):
        self.assertTrue(is_leap(2000))
        self.assertEqual(days_in_february(2000), 29)

    def test_2400(self):
        self.assertTrue(is_leap(2400))
