import unittest

from versions import newer, parse


class TestCompare(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(parse("1.2.3"), (1, 2, 3))

    def test_simple(self):
        self.assertTrue(newer("2.0.0", "1.0.0"))
        self.assertFalse(newer("1.0.0", "1.0.1"))
