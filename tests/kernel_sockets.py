"""A pytest plugin: every kernel a test starts talks to its client over Unix sockets, not TCP.

Over TCP, jupyter_client picks five ports that are free at that moment and the kernel binds them a
moment later; on a busy machine another process of the run (a gloo connection, a TCPStore, a
torchrun agent) can take one in between, and the kernel exits before its first reply: "Kernel died
before replying to kernel_info", seen in fresh-clone runs.  A Unix socket (ZeroMQ's ipc transport)
is a file in a folder of this process's own: there is no port to lose.

The root conftest.py loads this plugin for the whole suite: nbval's kernel for each notebook, and
nbclient's for the tests that run a notebook in-process (test_exercises, test_monitor).  A test
that starts pytest again (test_monitor runs nbval on a notebook in a folder of its own) passes
``-p tests.kernel_sockets``.  Kernels started by other programs are configured on their command
lines: ``benchmarks/_measure.py`` runs ``jupyter nbconvert`` (test_three_learners) and the browser
test runs ``jupyter lab``, both with ``--KernelManager.transport=ipc``.

nbval stops each kernel with SIGKILL to its process group, so a kernel that launched workers never
removes its fork server's folder itself; the next start of one removes those of dead processes
(``course_utils/workers/startup.py``), and this plugin removes the last ones when pytest ends.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

import pytest

_FOLDERS: list[Path] = []
_KERNEL_MANAGER: list[type] = []


def pytest_configure(config: pytest.Config) -> None:
    try:
        import jupyter_client
        import jupyter_client.manager
    except ImportError:  # no kernels to start
        return
    folder = Path(tempfile.mkdtemp(prefix="kernel-sockets-"))
    _FOLDERS.append(folder)
    names = itertools.count()

    def over_unix_sockets(manager: type) -> type:
        class UnixSocketKernelManager(manager):
            def __init__(self, **kwargs):
                kwargs.setdefault("transport", "ipc")
                kwargs.setdefault("ip", str(folder / f"kernel{next(names)}"))
                super().__init__(**kwargs)

        name = f"UnixSocket{manager.__name__}"
        UnixSocketKernelManager.__name__ = UnixSocketKernelManager.__qualname__ = name
        return UnixSocketKernelManager

    # nbclient's default manager is jupyter_client.AsyncKernelManager, looked up when a client starts;
    # a test that starts a kernel itself takes the fixture `kernel_manager_class` below.
    jupyter_client.AsyncKernelManager = over_unix_sockets(jupyter_client.AsyncKernelManager)
    _KERNEL_MANAGER.append(over_unix_sockets(jupyter_client.manager.KernelManager))
    try:
        import nbval.kernel
    except ImportError:
        return
    nbval.kernel.KernelManager = _KERNEL_MANAGER[0]


@pytest.fixture(scope="session")
def kernel_manager_class() -> type:
    """jupyter_client's KernelManager, over Unix sockets (see above)."""
    return _KERNEL_MANAGER[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)
    from course_utils.workers.startup import remove_dead_temp_dirs

    remove_dead_temp_dirs()  # the fork-server folders of the kernels this run killed (see above)
