"""The learner's progress table: every exercise of the course, passed / failed / not tried.

Every checker (``@checker`` in ``checking.py``) calls ``record(exercise, passed)`` after it runs.
The results live in one small JSON file in the learner's course folder, never on a network:

- ``$COURSE_PROGRESS_FILE`` when set, else
- ``<course folder>/progress/progress.json`` (the folder holding ``course_utils/``; ``/progress/``
  is in ``.gitignore``), or ``./progress/progress.json`` when the package is installed elsewhere.

Show it with ``python -m course_utils.progress`` or ``course_utils.show_progress()`` in a notebook:
one row per exercise of every chapter (found in the ``@checker("NN.x name")`` decorators of
``course_utils/checks/ch*.py`` and ``ch*/*.py``, so exercises not tried yet are listed too).  An
exercise counts as *passed* once any attempt passed (a later failing run, say of the untouched
exercise notebook, does not undo it; the "last" column shows it); *failed* when it was tried and
never passed.

Several kernels may run checkers at the same time: each update takes an exclusive lock
(``fcntl.flock`` on the folder holding the file, which nothing deletes meanwhile), reads the file,
changes it and replaces it atomically (a temporary file and ``os.replace``), so no update is lost
and no reader sees half a file.
A corrupt file (not JSON, not text, nested too deeply, over 5 MiB) is kept aside as
``progress.json.corrupt-<time>`` and rebuilt, with a warning; something that is not a regular file
(a FIFO, a folder) is never opened, only named in a warning; a missing folder is created; nothing
here ever makes a checker fail or hang.

An instructor collects the learners' files in one folder (a shared drive, or files handed in, each
renamed to ``<learner>.json``) and prints the room's table with
``python -m course_utils.progress --room DIR``: one row per exercise (how many learners passed,
failed, did not try it) and one per learner.  Files that are not progress files are named, with
the reason, and skipped; links that lead out of the folder are not followed.

``COURSE_PROGRESS=off`` turns recording off.  So does a pytest run that does not set
``COURSE_PROGRESS_FILE``: the course's own tests run checkers on wrong answers on purpose, and
must not fill the learner's table with them.

One module per concern: ``store`` (where the file is, reading it, recording a result), ``course``
(the course's exercises and chapters, read from its sources), ``table`` (the learner's table,
``show``), ``room`` (the instructor's room view) and ``cli`` (the command line).
"""

from .cli import main
from .course import known_exercises
from .room import Learner, Room, room, room_table
from .store import ProgressWarning, load, progress_file, record, recording_enabled
from .table import Row, rows, show, table

__all__ = ["record", "load", "progress_file", "known_exercises", "rows", "table", "show",
           "ProgressWarning", "Row", "room", "room_table", "Room", "Learner",
           "recording_enabled", "main"]
