"""Misconception catalogues as data: what a learner believes, how the checker sees it, what it says.

Each exercise's checker module declares one ``Catalogue``; the checker takes its failure messages
from it (``CATALOGUE.hint("sums_instead_of_averaging")``) and the wrong-answer tests are
parametrized over it (``tests/checkers/misconceptions.py`` refuses a catalogue entry without a wrong
answer, and a wrong answer without an entry), so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

__all__ = ["Misconception", "Catalogue"]


@dataclasses.dataclass(frozen=True)
class Misconception:
    """One mistake a learner makes on purpose: they believe something false.

    ``key``      the wrong answer's name in the tests (``sums_instead_of_averaging``);
    ``belief``   what the learner thinks, in their words ("summing is enough");
    ``detected`` what the checker observes that gives it away;
    ``message``  words the checker's failure message contains (the tests require them).
    """

    key: str
    belief: str
    detected: str
    message: str


class Catalogue:
    """The misconceptions one exercise's checker recognises, in the order it tests for them."""

    def __init__(self, exercise: str, *entries: Misconception):
        keys = [e.key for e in entries]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{exercise}: duplicate misconception keys in {keys}")
        self.exercise = exercise
        self.entries = entries
        self._by_key = {e.key: e for e in entries}

    def __iter__(self) -> Iterator[Misconception]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, key: str) -> Misconception:
        return self._by_key[key]

    def keys(self) -> list[str]:
        return list(self._by_key)

    def hint(self, key: str) -> str:
        """The message of entry ``key``: what the checker prints when it sees this mistake."""
        return self._by_key[key].message

    def markdown(self) -> str:
        """A bullet list for a docstring or a notebook cell: belief, then how it is detected."""
        return "\n".join(f"- {e.belief} ({e.detected}) [{e.key}]" for e in self.entries)
