"""Real worker processes for the course: started, watched, reported on and cleaned up.

One module per job; the public names are re-exported by ``course_utils`` itself
(``course_utils.launch``, ``course_utils.WorkerError``, ``course_utils.run_commands``...):

- ``errors``      ``RankResult`` (what a worker sends back), ``FailureKind``, ``RankFailure``,
                  ``WorkerError``, ``WorkerTimeout``: what went wrong, on which rank
- ``stacks``      stacks and tracebacks cut down to the frames a reader can act on (the one place)
- ``budget``      how many CPU threads each worker gets (affinity and cgroup quota aware)
- ``lines``       split a byte stream into whole lines (worker output, command output)
- ``reports``     worker side of the progress channel (``send_report``, used by ``course_utils.report``)
- ``entry``       the first code every worker runs (``worker_main``)
- ``startup``     what a launch prepares first: the fork server, ports, the payload, the workers' environment
- ``tree``        a worker's process tree: every descendant kept in it (a subreaper), all ended together
- ``supervisor``  ``launch``: start workers, stream their output, detect failures and hangs, clean up;
                  progress reports go to the display its caller gives (``course_utils.launch`` gives
                  the monitor's)
- ``prewarm``     start the fork server in the background when a notebook imports ``course_utils``
- ``commands``    ``run_commands``: run ``torchrun`` and other commands from a cell, with their process trees
- ``keeper``      the parent of each command ``run_commands`` starts: ends all it started (a subreaper)
- ``line_buffered/sitecustomize``  first on the commands' path: their Python processes write whole lines,
                  and freeze what ``import torch`` created (a quicker start and exit)
- ``netns``       the network of their own (loopback only) that ``run_commands`` gives its commands, and
                  ``ListenWatch``/``listening``: what a process tree listens on, in any namespace

Nothing here imports ``course_utils.monitor`` (``tests/library/test_architecture.py`` checks it):
the monitor builds on ``errors`` and ``reports``, and the launcher takes its display from its caller.
"""
