"""Imported once by the launcher's fork server so that every worker starts with torch loaded."""

import gc
import os
import signal

# No garbage collection while the modules below are imported: the collector would walk the growing
# heap of torch's objects again and again (about 0.45 of 2.5 CPU-seconds here). Python's
# documentation of gc.freeze() recommends this for a process that forks: disable early, freeze
# before forking (the end of this file), enable again.
gc.disable()

# Jupyter interrupts the kernel's whole process group (SIGINT) when it shuts a kernel down, and this
# process is in it: during the imports below (seconds) that printed a KeyboardInterrupt traceback on
# the terminal that started Jupyter.  multiprocessing's fork server ignores SIGINT once it serves;
# this makes it ignore SIGINT from its start.  (The kernel's death still ends it: see prewarm.py.)
signal.signal(signal.SIGINT, signal.SIG_IGN)
# The launcher spawned this process with SIGINT blocked (workers/startup.py, start_fork_server), so
# that an interrupt before the line above waited; ignored now, it is dropped: unblock it again.
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

# This process is the fork server: it must never start one itself.  The package's __init__ (which
# can start one, workers/prewarm.py) has already run when this line does, so prewarm.should_prewarm
# recognises a fork server by its command line; this keeps anything imported later from trying.
# Workers do not inherit this: they take the launching kernel's environment.
os.environ["COURSE_PREWARM"] = "0"

import cloudpickle  # noqa: F401
import torch  # noqa: F401

# DistributedDataParallel's constructor imports torch._dynamo (sympy and more): 1.5 s or more in
# every worker of every launch unless the fork server has imported it once, here.
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401

# DTensor, DCP and FSDP (chapters 10 to 12) take about 1.2 s to import: the checkers' and lessons'
# workers that use them would import them in each worker unless the fork server has, once, here.
# (The kernel does not import them with course_utils.checks, so that its import stays quick.)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.nn  # noqa: F401
import torch.nn.parallel  # noqa: F401

# The checkers' workers are functions of course_utils.checks: unpickling one imports the whole index.
import course_utils
import course_utils.checks  # noqa: F401
import course_utils.workers.entry  # noqa: F401

for _name in course_utils.__all__:  # the modules of the public names (course_utils imports them lazily)
    getattr(course_utils, _name)

# Everything imported above lives as long as the fork server and its workers.  Frozen, the garbage
# collector of a worker never walks it: a worker's gc.collect() (the process-group teardown calls
# one) takes milliseconds instead of one or two seconds, and does not copy each page it would
# otherwise touch (copy-on-write after the fork).  Objects a worker creates are collected as usual.
gc.freeze()
gc.enable()
