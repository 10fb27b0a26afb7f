import unittest

from textstats import word_count


class TestWhitespace(unittest.TestCase):
    def test_repeated_spaces(self):
        self.assertEqual(word_count("a  b"), 2)

    def test_newlines_and_tabs(self):
        self.assertEqual(word_count("one\ttwo\nthree  "), 3)
