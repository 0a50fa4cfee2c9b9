"""Real worker processes for the course: started, watched, reported on and cleaned up.

One module per job; the public names are re-exported by ``course_utils`` itself
(``course_utils.launch``, ``course_utils.WorkerError``, ``course_utils.run_commands``...):

- ``errors``      ``RankFailure``, ``WorkerError``, ``WorkerTimeout``: what went wrong, on which rank
- ``budget``      how many CPU threads each worker gets (affinity and cgroup quota aware)
- ``lines``       split a byte stream into whole lines (worker output, command output)
- ``reports``     worker side of the progress channel (``send_report``, used by ``course_utils.report``)
- ``entry``       the first code every worker runs (``worker_main``)
- ``supervisor``  ``launch``: start workers, stream their output, detect failures and hangs, clean up
- ``prewarm``     start the fork server in the background when a notebook imports ``course_utils``
- ``commands``    ``run_commands``: run ``torchrun`` and other commands from a cell, with their process trees

This package imports none of its modules here, so that ``course_utils.monitor`` can use
``errors`` and ``reports`` while ``supervisor`` uses ``monitor``'s display, without a cycle.
"""
