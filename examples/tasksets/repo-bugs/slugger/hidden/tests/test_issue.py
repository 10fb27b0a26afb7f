import unittest

from slugger import slugify


class TestEdges(unittest.TestCase):
    def test_trailing_punctuation(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")

    def test_leading_punctuation(self):
        self.assertEqual(slugify("--x"), "x")
        self.assertEqual(slugify("!a!", sep="_"), "a")
