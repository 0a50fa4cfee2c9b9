"""``make lab`` takes the CPU build of torch on a machine without an NVIDIA GPU, the CUDA build with one.

Every test fakes what the choice looks at: the GPU probe, and the CPU index (a local HTTP server, a
closed port, a port that never answers). None of them contacts PyTorch's index.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("which_torch", ROOT / "tools" / "which_torch.py")
which_torch = importlib.util.module_from_spec(_spec)
sys.modules["which_torch"] = which_torch  # dataclasses look their module up there
_spec.loader.exec_module(which_torch)

SPEC = "torch==2.13.0"
CONFIGURED = ["https://mirror.example/simple", "file:///opt/more"]


def _never(*args):
    raise AssertionError("this probe must not run for this choice")


def _choose(**kw):
    kw.setdefault("linux_x86_64", True)
    kw.setdefault("configured", lambda: CONFIGURED)
    return which_torch.choose(SPEC, cpu_index="http://cpu.fake/whl/cpu", **kw)


def test_no_gpu_and_a_reachable_cpu_index_gives_the_cpu_build_and_the_other_packages_from_pips_indexes():
    asked = []
    c = _choose(gpu=lambda: None, reach=lambda url: asked.append(url))
    assert asked == ["http://cpu.fake/whl/cpu"]
    assert c.args == [SPEC, "--index-url", "http://cpu.fake/whl/cpu",
                      "--extra-index-url", CONFIGURED[0], "--extra-index-url", CONFIGURED[1]]
    assert "no NVIDIA GPU" in c.why and "CPU build" in c.why and "MiB" in c.why


def test_a_gpu_gives_the_default_cuda_build_without_asking_the_cpu_index():
    c = _choose(gpu=lambda: "nvidia-smi at /usr/bin/nvidia-smi", reach=_never)
    assert c.args == [SPEC] and "nvidia-smi at /usr/bin/nvidia-smi" in c.why


def test_an_unreachable_cpu_index_falls_back_to_the_default_and_says_why():
    c = _choose(gpu=lambda: None, reach=lambda url: "URLError: Name or service not known")
    assert c.args == [SPEC]
    assert "cannot be reached (URLError: Name or service not known)" in c.why and "falling back" in c.why


@pytest.mark.parametrize("kw, args", [
    ({"spec_given": True}, [SPEC]),
    ({"no_index": True}, [SPEC]),
    ({"index": ""}, [SPEC]),
    ({"index": "default"}, [SPEC]),
    ({"index": "https://download.example/cu128"},
     [SPEC, "--index-url", "https://download.example/cu128"]
     + [a for url in CONFIGURED for a in ("--extra-index-url", url)]),
    ({"linux_x86_64": False}, [SPEC]),
])
def test_what_the_user_set_wins_and_nothing_is_probed(kw, args):
    assert _choose(gpu=_never, reach=_never, **kw).args == args


def test_a_spec_with_its_own_options_is_passed_as_separate_arguments():
    c = which_torch.choose("torch==2.13.0 --index-url https://download.example/cu128", spec_given=True)
    assert c.args == ["torch==2.13.0", "--index-url", "https://download.example/cu128"]


@pytest.fixture
def fake_index(tmp_path):
    """A local HTTP server that has a ``whl/cpu/torch/`` page."""
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def no_proxy_for_localhost(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reachability_of_a_fake_index_a_closed_port_and_a_silent_one(fake_index):
    assert which_torch.unreachable(fake_index) is None
    assert "refused" in which_torch.unreachable(f"http://127.0.0.1:{_closed_port()}/whl/cpu", timeout=2)
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t0 = time.monotonic()
        problem = which_torch.unreachable(f"http://127.0.0.1:{silent.getsockname()[1]}/x", timeout=1)
        assert problem and time.monotonic() - t0 < 5, problem


def test_pip_args_go_to_stdout_and_the_reason_to_stderr(monkeypatch, capsys, fake_index):
    monkeypatch.setattr(which_torch, "nvidia_driver", lambda: None)
    monkeypatch.setattr(which_torch, "configured_indexes", lambda: ["https://mirror.example/simple"])
    monkeypatch.setattr(which_torch, "_on_linux_x86_64", lambda: True)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    assert which_torch.main(["--spec", SPEC, "--cpu-index", fake_index, "--pip-args"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{SPEC} --index-url {fake_index} --extra-index-url https://mirror.example/simple\n"
    assert err.startswith(f"torch: {SPEC} from {fake_index} (PyTorch's CPU builds): no NVIDIA GPU")


def _make(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH_SPEC", "TORCH_INDEX", "WHEELS")}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@needs_make
def test_make_which_torch_with_a_faked_gpu_and_a_faked_index(tmp_path, fake_index):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI fake'\n")
    smi.chmod(0o755)
    p = _make("which-torch", f"TORCH_CPU_INDEX={fake_index}", path=f"{fake_bin}:{os.environ['PATH']}")
    assert p.returncode == 0, p.stderr
    if which_torch._on_linux_x86_64():
        assert f"an NVIDIA driver is here (nvidia-smi at {smi})" in p.stdout, p.stdout
    assert "make lab runs: pip install torch==2.13.0\n" in p.stdout

    # This machine's own probe, with the fake CPU index: the CPU build unless it has a driver.
    p = _make("which-torch", f"TORCH_CPU_INDEX={fake_index}")
    assert p.returncode == 0, p.stderr
    if which_torch._on_linux_x86_64() and which_torch.nvidia_driver() is None:
        assert f"index:       {fake_index} (PyTorch's CPU builds)" in p.stdout, p.stdout
        assert f"pip install torch==2.13.0 --index-url {fake_index} --extra-index-url " in p.stdout

    p = _make("which-torch", f"TORCH_CPU_INDEX=http://127.0.0.1:{_closed_port()}/whl/cpu")
    if which_torch._on_linux_x86_64() and which_torch.nvidia_driver() is None:
        assert "cannot be reached" in p.stdout and "make lab runs: pip install torch==2.13.0\n" in p.stdout


@needs_make
def test_makefile_learner_install_has_no_test_tools_and_ci_pins_torch():
    def dry(*args: str) -> str:
        p = _make("-n", "-B", *args, "VENV=/nonexistent/venv")
        assert p.returncode == 0, p.stderr
        return p.stdout

    lab, test = dry("lab"), dry("test")
    for out in (lab, test):
        [torch_line] = [ln for ln in out.splitlines() if "which_torch.py" in ln]
        assert torch_line.startswith("/nonexistent/venv/bin/python tools/quiet_pip.py "
                                     "/nonexistent/venv/bin/pip install --no-compile $(")
        assert '--spec "torch==2.13.0"' in torch_line and "--spec-given" not in torch_line
    assert "quiet_pip.py /nonexistent/venv/bin/pip install -e . ;" in lab and ".[test]" not in lab
    # torch's files are byte-compiled while pip installs the rest, and the step fails when pip does
    assert "compileall" in lab and "exit $status" in lab
    assert 'quiet_pip.py /nonexistent/venv/bin/pip install -e ".[test]"' in test
    assert "--spec-given" in dry("lab", "TORCH_SPEC=torch==2.12.0")
    assert "--no-index" in dry("lab", "WHEELS=/media/usb/wheels")
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("make test TORCH_SPEC=torch==2.13.0")
