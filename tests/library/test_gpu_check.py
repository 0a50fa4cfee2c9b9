"""The GPU check (``python3 tools/gpu_check.py``, ``make gpu-check``) and the backend choice
for no GPU, one GPU and a GPU per rank, all on this CPU: the runner on tiny notebooks, the dry run,
and ``choose_backend`` with faked GPU counts."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from course_utils import devices

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
# A maintainer's script beside the course, not a module of its package: loaded from its file.
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


# ---- the dry run ---------------------------------------------------------------------------


def test_make_gpu_check_dry_run_prints_the_plan():
    # The form CI runs; GPU_PYTHON is this interpreter where the suite does not run in the course's .venv.
    python = [] if Path(sys.executable).parent == ROOT / ".venv" / "bin" else [f"GPU_PYTHON={sys.executable}"]
    cmd = (["make", "--no-print-directory", "gpu-check", "DRY=1", *python]
           if shutil.which("make") else [sys.executable, str(SCRIPT), "--dry-run"])
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    notebooks = sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("solutions/*.ipynb"))
    assert f"run: {len(notebooks)} notebook(s), 1 at a time" in out and "limit of 240 s" in out
    listed = [ln.strip() for ln in out.splitlines() if ln.strip().endswith(".ipynb")]
    assert listed == [str(p.relative_to(ROOT)) for p in notebooks]  # every one, in this order
    assert "gpu-report" in out and "report.md" in out
    assert not (ROOT / "gpu-report" / "dry").exists()


# What a GPU machine has before the set-up: python3, its torch, this folder, no course installed.
BLOCK_COURSE_UTILS = """\
import runpy, sys
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "course_utils":
            raise ImportError("course_utils is not installed on this machine")
sys.meta_path.insert(0, NotInstalled())
sys.argv = [sys.argv[1], "--dry-run"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_check_starts_where_the_course_is_not_installed(tmp_path):
    proc = subprocess.run([sys.executable, "-c", BLOCK_COURSE_UTILS, str(SCRIPT)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "notebook(s), 1 at a time" in proc.stdout and "notebooks/00_setup.ipynb" in proc.stdout


def test_dry_run_without_jupyter_shows_an_offline_set_up(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "have_jupyter", lambda: False)
    wheels = tmp_path / "wheels"
    assert gpu_check.main(["--dry-run", "--wheels", str(wheels), "--venv", str(tmp_path / "venv"),
                           "--timeout", "90", "--jobs", "2", "notebooks/00_setup.ipynb"]) == 0
    out = capsys.readouterr().out
    assert "0 wheel(s)" in out and "make gpu-wheels" in out
    venv_line, jupyter_line, course_line = [ln for ln in out.splitlines() if ln.startswith("  $ ")]
    assert "--system-site-packages" in venv_line
    assert "--no-index" in jupyter_line and "nbclient" in jupyter_line and "torch" not in jupyter_line
    assert "--no-index" in course_line and "--no-deps" in course_line
    assert "1 notebook(s), 2 at a time" in out and "limit of 90 s" in out
    assert not (tmp_path / "venv").exists()


def test_wheel_download_targets_the_gpu_machines_python():
    (cmd,) = gpu_check.download_commands(Path("w"), "3.12")
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd
    assert not any(c.startswith(("torch", "jupyterlab")) for c in cmd)


# ---- the runner on tiny notebooks ----------------------------------------------------------


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# tiny")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


def _run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "report"
    # These notebooks launch no workers: their kernels need no fork server started in advance.
    env = dict(os.environ, COURSE_PREWARM="0")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--no-setup", "--out", str(out),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    report = json.loads((out / "report.json").read_text())
    return proc.returncode, report


def test_runner_reports_each_notebook(tmp_path):
    ok = _notebook(tmp_path / "ok.ipynb", "import course_utils\n"
                   "backend, device = course_utils.backend_and_device()\nprint(backend, device)")
    bad = _notebook(tmp_path / "bad.ipynb", "x = 1", "# a comment\nraise ValueError('boom')",
                    "print('never')")
    rc, report = _run(tmp_path, "--jobs", "2", "--timeout", "150", str(ok), str(bad))
    assert rc == 1  # one notebook failed
    m = report["machine"]
    assert (m["torch"], m["cuda"]) == (torch.__version__, torch.version.cuda)
    assert m["gpu_count"] == torch.cuda.device_count() and "python" in m
    r_ok, r_bad = report["notebooks"]
    assert r_ok["notebook"] == str(ok) and r_ok["status"] == "passed" and r_ok["first_error"] is None
    assert r_ok["seconds"] > 0 and r_ok["timeout"] == 150
    if not torch.cuda.is_available():
        assert (r_ok["backends"], r_ok["devices"]) == (["gloo"], ["cpu"])
        assert r_ok["kernel"] == {"cuda_initialized": False}
    assert r_bad["status"] == "failed" and r_bad["backends"] == [] and r_bad["kernel"] is not None
    assert r_bad["first_error"] == {"cell": 2, "line": "raise ValueError('boom')",
                                    "error": "ValueError: boom"}
    assert (report["passed"], report["failed"], report["not_run"]) == (1, 1, 0)
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"| {ok} | passed |" in md and "ValueError: boom" in md and f"torch {torch.__version__}" in md
    executed = nbformat.read(tmp_path / "report" / "executed" / f"{tmp_path.name}__ok.ipynb", 4)
    assert "".join(o.get("text", "") for o in executed.cells[1].outputs).strip() == "gloo cpu" or \
        torch.cuda.is_available()
    assert len(executed.cells) == 2  # the probe cell is not kept


def test_runner_stops_a_notebook_at_its_time_limit(tmp_path):
    slow = _notebook(tmp_path / "slow.ipynb", "import time\ntime.sleep(120)")
    rc, report = _run(tmp_path, "--timeout", "8", str(slow))
    (r,) = report["notebooks"]
    assert rc == 1 and r["status"] == "timeout" and "time limit of 8 s" in r["first_error"]["error"]
    assert r["seconds"] < 60


# ---- one GPU, two GPUs, none: faked GPU counts ---------------------------------------------


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has n CUDA GPUs and NCCL; set_device records instead of binding."""
    bound = []

    def fake(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: bound.append(i))
        return bound

    monkeypatch.setattr(devices, "_announced", set())
    return fake


def test_one_gpu_two_ranks_use_gloo_and_single_process_cells_use_cuda(gpus, capsys):
    gpus(1)
    two = devices.choose_backend(2)
    assert (two.backend, two.device_type) == ("gloo", "cpu")
    assert "only 1 GPU(s) for 2 local rank(s)" in two.reason and "single-process" in two.reason
    devices.choose_backend(2)
    assert capsys.readouterr().out.count("backend: gloo") == 1  # said once
    one = devices.choose_backend(1, announce=False)
    assert (one.backend, one.device_type) == ("nccl", "cuda")


def test_a_gpu_per_rank_means_nccl_bound_to_the_local_rank(gpus, monkeypatch, capsys):
    bound = gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "3")  # second node of two: global rank 3 is local rank 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    backend, device = devices.backend_and_device()
    assert (backend, device, bound) == ("nccl", torch.device("cuda", 1), [1])
    assert capsys.readouterr().out == ""  # announce is off by default
    kwargs = devices.process_group_kwargs(backend, device)
    assert kwargs == {"backend": "nccl", "device_id": torch.device("cuda", 1)}


def test_no_gpu_means_gloo_and_no_device_id(gpus, monkeypatch):
    gpus(0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert devices.backend_and_device() == ("gloo", torch.device("cpu"))
    assert devices.process_group_kwargs() == {"backend": "gloo"}
    with pytest.raises(ValueError, match="index"):
        devices.process_group_kwargs("nccl", "cuda")


def test_device_log_records_every_choice(gpus, monkeypatch, tmp_path):
    gpus(2)
    log = tmp_path / "devices.jsonl"
    monkeypatch.setenv("COURSE_DEVICE_LOG", str(log))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    devices.backend_and_device()
    rows = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [r["event"] for r in rows] == ["choose_backend", "backend_and_device"]
    assert rows[1]["device"] == "cuda:0" and rows[0]["local_world_size"] == 2
    assert gpu_check.summarise_devices(log) == {"backends": ["nccl"], "devices": ["cuda:0"],
                                                "processes": 1}
