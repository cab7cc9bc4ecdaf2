"""How errors list names (``torchplug.plugin.some_of``): every built-in backend's refusal lists
the parameters or modules it is about the same way."""

from __future__ import annotations

import pytest

from torchplug.plugin import some_of


@pytest.mark.parametrize(
    ("names", "limit", "expected"),
    [
        ([], 5, ""),
        (["a"], 5, "a"),
        (["a", "b", "c", "d", "e"], 5, "a, b, c, d, e"),
        (["a", "b", "c", "d", "e", "f"], 5, "a, b, c, d, e, ..."),
        (["w1", "w2", "w3", "w4"], 3, "w1, w2, w3, ..."),
        (["w1", "w2", "w3"], 3, "w1, w2, w3"),
    ],
)
def test_some_of_shows_the_first_names_and_says_when_more_follow(names, limit, expected):
    assert some_of(names, limit) == expected
