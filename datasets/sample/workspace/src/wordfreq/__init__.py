"""Word frequency counting with stable ordering, used as Strata's sample workspace."""

from collections import Counter
import re

_WORD = re.compile(r"[A-Za-z']+")


def words(text):
    """Lower-cased words of `text`, apostrophes kept inside words."""
    return [w.strip("'").lower() for w in _WORD.findall(text) if w.strip("'")]


def top(text, n=3):
    """The `n` most frequent words, ties broken alphabetically."""
    counts = Counter(words(text))
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
