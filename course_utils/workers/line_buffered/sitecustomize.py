"""Whole lines from every Python process of a ``run_commands`` command.

``run_commands`` puts this folder first on the commands' ``PYTHONPATH``, so Python runs this file
at start-up (``site`` imports ``sitecustomize``).  The processes of one command share one output
pipe: torchrun's workers, say.  Unbuffered (``PYTHONUNBUFFERED=1``, ``-u``), a ``print`` is two
writes, the text and then its newline, and another process's line can land between them
(``... = 3rank 1 of 2 ...``).  Line-buffered, every line is one write, and a write of up to 4 KiB
into a pipe is never mixed with another.  Then the ``sitecustomize`` this file hides, if there is
one further along the path, runs as it would have.
"""

import importlib.machinery
import importlib.util
import os
import sys

for _stream in (sys.stdout, sys.stderr):
    try:
        _stream.reconfigure(line_buffering=True, write_through=False)
    except (AttributeError, ValueError, OSError):  # replaced, closed or not a text stream
        pass

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
