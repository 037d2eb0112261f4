"""The grader's own test of the sample workspace: a case the workspace's tests do not
show the agent (tests/tests/runtime.rs mounts this directory as an entry's evaluator)."""

import wordfreq


def test_top_breaks_ties_by_name():
    assert wordfreq.top("c b a", 3) == [("a", 1), ("b", 1), ("c", 1)]
