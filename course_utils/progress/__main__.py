"""``python -m course_utils.progress``: the learner's table, or the room's with ``--room DIR``.

A separate ``__main__`` module, so that running the package does not execute a module that importing
``course_utils`` has already imported (which makes Python warn).
"""

import sys

from . import main

sys.exit(main())
