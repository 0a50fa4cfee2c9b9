"""Wrong-answer tests parametrized over a checker's misconception catalogue.

``cases(CATALOGUE, WRONG)`` pairs every catalogue entry with the wrong answer of the same key and
refuses, when the tests are collected, an entry without a wrong answer or a wrong answer without
an entry: a misconception the checker claims to recognise is always tested.
"""

from __future__ import annotations

from typing import Any

import pytest

from course_utils.checking import Catalogue


def cases(catalogue: Catalogue, wrong: dict[str, Any]) -> list[Any]:
    missing = [k for k in catalogue.keys() if k not in wrong]
    extra = [k for k in wrong if k not in catalogue.keys()]
    if missing or extra:
        raise AssertionError(f"{catalogue.exercise}: catalogue entries without a wrong answer: {missing}; "
                             f"wrong answers without a catalogue entry: {extra}")
    return [pytest.param(catalogue[k], wrong[k], id=k) for k in catalogue.keys()]
