import unittest

from versions import newer


class TestNumeric(unittest.TestCase):
    def test_two_digit_minor(self):
        self.assertTrue(newer("1.10.0", "1.9.0"))
        self.assertFalse(newer("1.9.0", "1.10.0"))

    def test_two_digit_patch(self):
        self.assertTrue(newer("0.0.12", "0.0.3"))
