"""A killed kernel leaves no fork-server folder behind for long.

multiprocessing puts the fork server's Unix socket in a temporary folder of the process that starts
it and removes the folder when that process exits normally.  nbval stops every kernel with SIGKILL
to its process group, and a kernel can die of memory: the folder stayed in /tmp, one per notebook
run (hundreds after a day of test runs).  The launcher names the folder after its process, and the
next start removes the folders of dead processes (``workers/startup.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest

from course_utils.workers import startup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, Unix sockets")

# A kernel's first launch: the fork server starts (its socket is bound before the server is spawned),
# then the kernel waits.  The test kills it with the server still importing torch.
KERNEL = """
import sys, time
from course_utils.workers import startup
startup.fork_server_context()
with startup.main_module_hidden():
    startup.start_fork_server()
print(startup.multiprocessing.current_process()._config["tempdir"], flush=True)
time.sleep(120)
"""

# The next kernel: it claims a folder of its own (which removes the dead one), then exits normally.
NEXT = """
from course_utils.workers import startup
startup._claim_temp_dir()
print(startup.multiprocessing.current_process()._config["tempdir"], flush=True)
"""


def _env(tmp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COURSE_PREWARM"}
    env["TMPDIR"] = tmp  # this test's own /tmp, so that the other tests' folders stay out of it
    return env


@pytest.fixture
def short_tmp():
    """A folder of this test's own for TMPDIR, with a short path: a Unix socket's path has at most
    107 bytes, too few below pytest's own temporary folders."""
    path = tempfile.mkdtemp(prefix="killed-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_folder_of_a_killed_kernel_is_removed_by_the_next_start(short_tmp):
    tmp = short_tmp
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True,
                              env=_env(tmp), start_new_session=True)
    try:
        folder = kernel.stdout.readline().strip()
        assert os.path.basename(folder).startswith(f"pymp-course-{kernel.pid}-"), folder
        assert os.path.dirname(folder) == tmp
        assert any(name.startswith("listener-") for name in os.listdir(folder)), os.listdir(folder)
        family = [kernel.pid] + [p.pid for p in psutil.Process(kernel.pid).children(recursive=True)]
        os.killpg(kernel.pid, signal.SIGKILL)  # as nbval stops a kernel
        kernel.wait(timeout=60)
        psutil.wait_procs([psutil.Process(p) for p in family if psutil.pid_exists(p)], timeout=60)
    finally:
        if kernel.poll() is None:
            os.killpg(kernel.pid, signal.SIGKILL)
            kernel.wait()
    assert os.path.isdir(folder), "killed, the kernel could not have removed its folder itself"

    after = subprocess.run([sys.executable, "-c", NEXT], capture_output=True, text=True, env=_env(tmp),
                           timeout=120)
    assert after.returncode == 0, after.stderr
    assert not os.path.exists(folder), "the next start kept the dead kernel's folder"
    own = after.stdout.strip()
    assert os.path.basename(own).startswith("pymp-course-"), own
    assert not os.path.exists(own), "a kernel that exits normally removes its own folder"
    assert os.listdir(tmp) == []


def test_only_dead_processes_folders_of_this_user_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = psutil.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not psutil.pid_exists(dead.pid)
    gone = tmp_path / f"pymp-course-{dead.pid}-abc"
    gone.mkdir()
    (gone / "listener-x").write_text("")
    alive = tmp_path / f"pymp-course-{os.getpid()}-abc"  # this process: alive
    alive.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("")
    link = tmp_path / f"pymp-course-{dead.pid}-link"  # a link is never followed nor removed
    link.symlink_to(target)
    plain_file = tmp_path / f"pymp-course-{dead.pid}-file"
    plain_file.write_text("")
    odd = tmp_path / "pymp-course-notapid-abc"
    odd.mkdir()
    other = tmp_path / f"pymp-{dead.pid}-abc"  # multiprocessing's own name: another program's folder
    other.mkdir()

    assert startup.remove_dead_temp_dirs() == [str(gone)]
    assert not gone.exists()
    for kept in (alive, link, plain_file, odd, other, target / "keep"):
        assert os.path.lexists(kept), kept
