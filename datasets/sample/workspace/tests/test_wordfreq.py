import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import wordfreq  # noqa: E402


class WordsTest(unittest.TestCase):
    def test_lowercases_and_splits(self):
        self.assertEqual(wordfreq.words("Hello, hello WORLD"), ["hello", "hello", "world"])

    def test_keeps_inner_apostrophes(self):
        self.assertEqual(wordfreq.words("don't 'quote'"), ["don't", "quote"])


class TopTest(unittest.TestCase):
    def test_orders_by_count_then_name(self):
        self.assertEqual(wordfreq.top("b a b c a b", 2), [("b", 3), ("a", 2)])

    def test_empty(self):
        self.assertEqual(wordfreq.top(""), [])


if __name__ == "__main__":
    unittest.main()
