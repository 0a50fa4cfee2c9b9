"""The suite's kernels talk over Unix sockets (tests/kernel_sockets.py says why): no TCP port chosen for them
to lose."""

from __future__ import annotations

from pathlib import Path

import psutil


def test_a_notebook_kernel_answers_over_the_unix_sockets_it_was_given():
    import nbval.kernel

    km, kc = nbval.kernel.start_new_kernel(kernel_name="python3")
    try:
        info = km.get_connection_info()
        assert info["transport"] == "ipc", info
        reply = kc.execute_interactive("x = 6 * 7", timeout=60)
        assert reply["content"]["status"] == "ok", reply
        kernel = psutil.Process(km.provisioner.pid)
        bound = {c.laddr for c in kernel.net_connections(kind="unix")}
        for channel in ("shell", "iopub", "stdin", "control", "hb"):
            path = f"{info['ip']}-{info[f'{channel}_port']}"
            assert Path(path).is_socket() and path in bound, (channel, path, bound)
        # The one TCP port a kernel may hold is the one it binds itself, to a port the system picks
        # (its debugger's), which nobody can take from it in between.
        assert all(c.laddr.ip == "127.0.0.1" for c in kernel.net_connections(kind="tcp"))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_kernel_started_by_nbclient_uses_unix_sockets_too():
    """test_exercises and test_monitor run notebooks with nbclient, whose default manager is
    jupyter_client.AsyncKernelManager."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 6 * 7\nx")])
    client = NotebookClient(nb, timeout=60, kernel_name="python3")
    seen = {}

    def remember(**_):
        seen.update(client.km.get_connection_info())

    client.on_notebook_start = remember
    client.execute()
    assert seen.get("transport") == "ipc", seen
    assert nb.cells[0].outputs[0]["data"]["text/plain"] == "42"
