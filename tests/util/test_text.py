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


def test_some_of_takes_any_iterable_and_one_string_as_one_name():
    assert some_of(n for n in ["x", "y"]) == "x, y"
    assert some_of("encoder.weight") == "encoder.weight"


@pytest.mark.parametrize("limit", [0, -1, 1.5])
def test_some_of_refuses_a_limit_below_one_saying_what_it_expects(limit):
    with pytest.raises(ValueError, match="expected a limit of 1 or more"):
        some_of(["a", "b"], limit)
