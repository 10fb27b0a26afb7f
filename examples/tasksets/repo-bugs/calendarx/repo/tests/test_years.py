import unittest

from calendarx import days_in_february, is_leap


class TestYears(unittest.TestCase):
    def test_common(self):
        self.assertTrue(is_leap(2024))
        self.assertFalse(is_leap(2023))

    def test_century(self):
        self.assertFalse(is_leap(1900))
        self.assertEqual(days_in_february(1900), 28)
