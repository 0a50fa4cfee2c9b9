"""Start-up code for every Python process of a ``run_commands`` command.

``run_commands`` puts this folder first on the commands' ``PYTHONPATH``, so Python runs this file
at start-up (``site`` imports ``sitecustomize``).  It does two things, then lets the
``sitecustomize`` it hides, if there is one further along the path, run as it would have.

Whole lines.  The processes of one command share one output pipe: torchrun's workers, say.
Unbuffered (``PYTHONUNBUFFERED=1``, ``-u``), a ``print`` is two writes, the text and then its
newline, and another process's line can land between them (``... = 3rank 1 of 2 ...``).
Line-buffered, every line is one write, and a write of up to 4 KiB into a pipe is never mixed with
another.

A quicker start and exit.  ``import torch`` creates some 170,000 objects that live as long as the
process.  Python's garbage collector walks all of them at every full collection, and once more when
the process exits; a torchrun job is several short processes that each pay it (an agent, and
workers that import ``torch._dynamo`` with their first optimizer).  Right after torch's own import,
``gc.freeze()`` moves everything there is into a generation the collector never looks at; objects
created later are collected as usual.  Measured on the course's 2-core machine (CPU-seconds,
medians of 8 runs): a process that imports torch and trains a few steps with Adam, 3.25 instead of
4.25; one that only imports torch, 1.8 instead of 2.2.  The launcher's fork server does the same for
its workers (``course_utils/_preload.py``).
"""

import gc
import importlib.machinery
import importlib.util
import os
import sys

for _stream in (sys.stdout, sys.stderr):
    try:
        _stream.reconfigure(line_buffering=True, write_through=False)
    except (AttributeError, ValueError, OSError):  # replaced, closed or not a text stream
        pass


class _FreezeAfterTorch:
    """A finder that finds nothing itself: when ``torch`` is first imported, it asks the other
    finders for it and has its module frozen (``gc.freeze()``) as soon as its code has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        if self in sys.meta_path:  # once: later imports go straight to the usual finders
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            gc.freeze()

        spec.loader.exec_module = exec_module  # this loader loads torch/__init__.py only
        return spec


if "torch" not in sys.modules:
    sys.meta_path.insert(0, _FreezeAfterTorch())

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
