import unittest

from textstats import char_count, word_count


class TestCounts(unittest.TestCase):
    def test_simple_words(self):
        self.assertEqual(word_count("the quick fox"), 3)

    def test_empty(self):
        self.assertEqual(word_count(""), 0)

    def test_chars(self):
        self.assertEqual(char_count("a b"), 3)
        self.assertEqual(char_count("a b", spaces=False), 2)
