import unittest

from slugger import slugify


class TestSlug(unittest.TestCase):
    def test_words(self):
        self.assertEqual(slugify("Big Red Car"), "big-red-car")

    def test_separator(self):
        self.assertEqual(slugify("a b", sep="_"), "a_b")
