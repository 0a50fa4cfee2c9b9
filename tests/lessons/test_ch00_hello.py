"""Chapter 00: ``ch00_hello.py --spawn`` survives a port taken between ``free_port()`` and the bind.

``free_port()`` only asks the operating system for a port; rank 0's store binds it later.  The test
holds the first port it hands out (a listening socket, as another program would), and the script
must report the collision and finish on another port.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

TAKEN_FIRST = """
import socket, sys
sys.path.insert(0, ".")
import course_utils, ch00_hello
held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()
handed_out = [held.getsockname()[1]]
real_free_port = course_utils.free_port
course_utils.free_port = lambda: handed_out.pop() if handed_out else real_free_port()
if __name__ == "__main__":
    ch00_hello.spawn_on_a_free_port(world_size=2)
    print(f"finished; the taken port was {held.getsockname()[1]}")
"""


def test_spawn_retries_on_a_port_taken_before_rank_0_binds_it(tmp_path):
    script = tmp_path / "taken_first.py"
    script.write_text(TAKEN_FIRST)
    # TMPDIR: torch.multiprocessing.spawn leaves the failed attempt's error file (pytorch-errorfile-*)
    # in the temporary folder; here it goes with the test's.
    run = subprocess.run([sys.executable, str(script)], cwd=NOTEBOOKS, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
                                               TMPDIR=str(tmp_path)))
    assert run.returncode == 0, run.stdout + run.stderr
    taken = run.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1]
    assert f"port {taken} was taken before rank 0 could listen on it; trying another" in run.stdout
    assert run.stdout.count("all_reduce(rank + 1) = 3") == 2, run.stdout
