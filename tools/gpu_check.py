"""Run every lesson and solution notebook headless and write one report: ``make gpu-check``.

Meant for a short lease of a GPU machine, where it proves the CUDA/NCCL paths of the course in
one command, but it runs anywhere (on a CPU the notebooks take their gloo paths)::

    python3 tools/gpu_check.py                           # set up if needed, run, report
    python3 tools/gpu_check.py --dry-run                 # print what it would do, run nothing
    python3 tools/gpu_check.py notebooks/08_mixed_precision.ipynb --timeout 120

A maintainer's script beside the course, not part of the learner's package: it must start on a
machine that has only ``python3``, its torch and this folder, before the course is installed.  So
it imports nothing from ``course_utils`` and starts its own child processes by this file's path.

Set-up.  A GPU machine often has its own CUDA build of torch, no network and no Jupyter.  So this
uses the interpreter that runs it (the machine's ``python3``) and never installs torch.  When
``nbclient``/``nbformat``/``ipykernel`` are missing it makes a virtual environment (``.gpu-venv``)
that sees that interpreter's packages (``--system-site-packages``, plus a ``.pth`` file naming the
interpreter's own site-packages, which also covers a ``python3`` that is itself a venv), installs
the Jupyter packages from the wheels in ``gpu-wheels/`` with the index turned off, installs the
course with ``--no-deps --no-index`` (editable: the notebooks import the working tree), and runs
itself again inside it.  ``make gpu-wheels`` fills ``gpu-wheels/`` on a networked machine.

Running.  Each notebook runs in a fresh kernel, in a child process of its own, with its folder as
working directory and a time limit for the whole notebook (``--timeout``); the run as a whole stops
starting notebooks when ``--budget`` is spent.  Notebooks run one at a time by default
(``--jobs`` runs several: each child writes only its own files).  Written under ``--out``
(default ``gpu-report/``): ``report.md`` and ``report.json`` (rewritten after every notebook, so an
interrupted run still leaves one), ``executed/`` (the notebooks with their outputs) and
``devices/`` (every backend/device choice made by the kernel and its workers, recorded through
``COURSE_DEVICE_LOG``; see ``course_utils.devices``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import glob
import importlib.util
import json
import os
import platform
import shlex
import signal
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
JUPYTER_PACKAGES = ["nbclient", "nbformat", "ipykernel", "ipywidgets"]
#: Wheels brought along for the set-up: the Jupyter packages, and setuptools, which the editable
#: install of the course builds with (the index is off, so pip cannot fetch it).
WHEEL_PACKAGES = [*JUPYTER_PACKAGES, "setuptools>=64"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
PROBE_TAG = "GPU_CHECK_PROBE "
# Run in the notebook's kernel after its last cell: did the kernel itself use CUDA, and how much.
PROBE = f"""\
import json as _j
try:
    import torch as _t
    _p = {{"cuda_initialized": _t.cuda.is_initialized()}}
    if _p["cuda_initialized"]:
        _p["peak_memory_mib"] = {{f"cuda:{{_i}}": round(_t.cuda.max_memory_allocated(_i) / 2**20, 1)
                                  for _i in range(_t.cuda.device_count())}}
except Exception as _e:
    _p = {{"error": repr(_e)}}
print({PROBE_TAG!r} + _j.dumps(_p))
"""


def _q(cmd: list[str]) -> str:
    return " ".join(shlex.quote(str(c)) for c in cmd)


def _write_json(path: Path, data: Any) -> None:
    """Write atomically: a reader (or a killed run) never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def slug(path: Path) -> str:
    """``notebooks/04_ddp.ipynb`` -> ``notebooks__04_ddp``: one name per notebook for its files."""
    return f"{path.parent.name}__{path.stem}"


def default_notebooks() -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(str(ROOT / "notebooks/*.ipynb")))
            + sorted(glob.glob(str(ROOT / "solutions/*.ipynb")))]


# --------------------------------------------------------------------------------------------
# Set-up: a venv that sees the machine's torch, the Jupyter packages from wheels
# --------------------------------------------------------------------------------------------


def have_jupyter() -> bool:

    return all(importlib.util.find_spec(m) is not None for m in ("nbclient", "nbformat", "ipykernel"))


def download_commands(wheels: Path, python_version: str) -> list[list[str]]:
    """``pip download`` of the set-up wheels for another Python and platform (needs the network)."""
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(wheels),
           "--python-version", python_version, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return [cmd + WHEEL_PACKAGES]


def setup_commands(venv: Path, wheels: Path) -> list[list[str]]:
    """Create the venv and install into it, all without the network."""
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels)]
    return [
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        pip + WHEEL_PACKAGES,
        pip + ["--no-deps", "--no-build-isolation", "--editable", str(ROOT)],
    ]


def _base_site_dirs() -> list[str]:
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def set_up(venv: Path, wheels: Path) -> Path:
    """Make the venv (once) and return its interpreter; raise SystemExit with the reason."""
    # Only the set-up needs this process's torch (to compare with the venv's): the runner and the
    # child that runs each notebook never import it, and start in a fraction of a second.
    import torch

    py = venv / "bin" / "python"
    if not any(wheels.glob("*.whl")):
        raise SystemExit(f"no wheels in {wheels}/: run `make gpu-wheels` on a machine with network "
                         "and bring the folder along")
    venv_cmd, *installs = setup_commands(venv, wheels)
    if not py.exists():
        print("$", _q(venv_cmd), flush=True)
        subprocess.run(venv_cmd, check=True)
    # The venv must see the packages of the interpreter that made it, torch above all.  When that
    # interpreter is itself a venv, --system-site-packages points past it, to the base Python.
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_course_gpu_check_base.pth").write_text("\n".join(_base_site_dirs()) + "\n")
    for cmd in installs:
        print("$", _q(cmd), flush=True)
        subprocess.run(cmd, check=True)

    theirs = subprocess.run([str(py), "-c", "import torch; print(torch.__version__, torch.__file__)"],
                            check=True, capture_output=True, text=True).stdout.split()
    if theirs != [torch.__version__, torch.__file__]:
        raise SystemExit(f"{py} imports torch {theirs}, not this machine's {torch.__version__} at "
                         f"{torch.__file__}; remove {venv} and try again")
    print(f"set-up done: {py} uses torch {torch.__version__} from {Path(torch.__file__).parent}")
    return py


# --------------------------------------------------------------------------------------------
# One notebook (runs in a child process of its own)
# --------------------------------------------------------------------------------------------


def _first_line(source: str) -> str:
    for ln in source.splitlines():
        if ln.strip() and not ln.lstrip().startswith("#"):
            return ln.strip()[:120]
    return ""


def run_one(path: Path, timeout: float, executed: Path) -> dict[str, Any]:
    """Execute one notebook in a fresh kernel; what happened, as a dict (never raises for the
    notebook's own failures)."""
    # Not at the top: on a GPU machine without Jupyter this module first installs them.
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    deadline = time.monotonic() + timeout
    client = NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                            timeout_func=lambda cell: max(1, int(deadline - time.monotonic())))
    result: dict[str, Any] = {"status": "passed", "first_error": None, "kernel": None}
    index, probe_ok = -1, False
    t0 = time.perf_counter()
    try:
        with client.setup_kernel():
            client.reset_execution_trackers()
            try:
                for index, cell in enumerate(nb.cells):
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            except CellExecutionError as e:
                result["status"] = "failed"
                result["first_error"] = {"cell": index, "line": _first_line(nb.cells[index].source),
                                         "error": f"{e.ename}: {e.evalue}"[:500]}
            probe_ok = True
            probe = nbformat.v4.new_code_cell(PROBE)
            client.timeout_func = None
            client.timeout = 60
            nb.cells.append(probe)  # nbclient stores the executed cell back at its index
            try:
                client.execute_cell(probe, len(nb.cells) - 1, store_history=False)
            finally:
                nb.cells.pop()
            for out in probe.outputs:
                for ln in out.get("text", "").splitlines():
                    if ln.startswith(PROBE_TAG):
                        result["kernel"] = json.loads(ln[len(PROBE_TAG):])
    except CellTimeoutError:
        if not probe_ok:
            result["status"] = "timeout"
            result["first_error"] = {"cell": index, "line": _first_line(nb.cells[index].source),
                                     "error": f"notebook time limit of {timeout:.0f} s reached"}
    except DeadKernelError as e:
        result["status"] = "failed"
        result["first_error"] = {"cell": index, "line": _first_line(nb.cells[index].source)
                                 if index >= 0 else "", "error": f"the kernel died: {e}"}
    except Exception as e:  # a kernel that does not start, a broken notebook file
        result["status"] = "failed"
        result["first_error"] = {"cell": index, "line": "", "error": f"{type(e).__name__}: {e}"[:500]}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    executed.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, executed)
    return result


def summarise_devices(log: Path) -> dict[str, Any]:
    """What ``COURSE_DEVICE_LOG`` recorded: backends chosen, devices bound, processes that chose."""
    rows = []
    if log.exists():
        for ln in log.read_text().splitlines():
            try:
                rows.append(json.loads(ln))
            except ValueError:
                continue
    return {"backends": sorted({r["backend"] for r in rows if "backend" in r}),
            "devices": sorted({r["device"] for r in rows if r.get("device")}),
            "processes": len({r.get("pid") for r in rows})}


def _child_main(a: argparse.Namespace) -> int:
    path, out = Path(a.run_one), Path(a.out)
    name = slug(path)
    log = out / "devices" / f"{name}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    # Inherited by the kernel and by every worker it starts.
    os.environ.update(COURSE_DEVICE_LOG=str(log), COURSE_PROGRESS="off", PYTHONUNBUFFERED="1")
    result = run_one(path, a.timeout, out / "executed" / f"{name}.ipynb")
    result.update(notebook=_rel(path), timeout=a.timeout, **summarise_devices(log))
    (out / "results").mkdir(parents=True, exist_ok=True)
    _write_json(out / "results" / f"{name}.json", result)
    return 0


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------------
# The machine, the run, the report
# --------------------------------------------------------------------------------------------

_MACHINE = """\
import json, platform, sys, torch
d = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
     "cuda_available": torch.cuda.is_available(), "gpu_count": torch.cuda.device_count(), "gpus": [],
     "nccl": None, "driver": None}
if d["cuda_available"]:
    d["gpus"] = [torch.cuda.get_device_name(i) for i in range(d["gpu_count"])]
    try:
        d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
try:
    import pynvml
    pynvml.nvmlInit()
    v = pynvml.nvmlSystemGetDriverVersion()
    d["driver"] = v.decode() if isinstance(v, bytes) else v
except Exception:
    pass
print(json.dumps(d))
"""


def machine() -> dict[str, Any]:
    """GPU model, driver, torch, CUDA and NCCL versions, read in a child process so that this
    one never holds a CUDA context while the notebooks run."""
    proc = subprocess.run([sys.executable, "-c", _MACHINE], capture_output=True, text=True, timeout=300)
    info = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-500:]}
    info.update(host=platform.node(), cpus=os.cpu_count(), executable=sys.executable)
    return info


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    gpus = ", ".join(m.get("gpus") or []) or "none"
    lines = [
        "# GPU check of the course notebooks", "",
        f"- started: {report['started']}, budget {report['budget']:.0f} s, per-notebook limit "
        f"{report['timeout']:.0f} s, jobs {report['jobs']}",
        f"- GPUs: {m.get('gpu_count', '?')} ({gpus}); driver {m.get('driver')}",
        f"- torch {m.get('torch')}, CUDA {m.get('cuda')}, NCCL {m.get('nccl')}, Python {m.get('python')}",
        f"- host {m.get('host')}, {m.get('cpus')} CPUs", "",
        f"**{report['passed']} passed, {report['failed']} failed** "
        f"({report['not_run']} not run) in {report['seconds']:.0f} s", "",
        "| notebook | result | seconds | backends | devices | kernel used CUDA | first error |",
        "| --- | --- | ---: | --- | --- | --- | --- |",
    ]
    for r in report["notebooks"]:
        k = r.get("kernel") or {}
        used = ("yes " + json.dumps(k.get("peak_memory_mib", {}))) if k.get("cuda_initialized") else (
            "no" if k else "?")
        err = r.get("first_error") or {}
        err_txt = (f"cell {err.get('cell')} `{err.get('line', '')}`: {err.get('error', '')}" if err else "")
        lines.append(f"| {r['notebook']} | {r['status']} | {r.get('seconds', 0):.1f} | "
                     f"{', '.join(r.get('backends', [])) or '-'} | {', '.join(r.get('devices', [])) or '-'} "
                     f"| {used} | {err_txt.replace('|', '/').replace(chr(10), ' ')} |")
    return "\n".join(lines) + "\n"


def _save(out: Path, report: dict[str, Any]) -> None:
    rs = report["notebooks"]
    report.update(passed=sum(r["status"] == "passed" for r in rs),
                  failed=sum(r["status"] in ("failed", "timeout") for r in rs),
                  not_run=sum(r["status"] == "not run" for r in rs))
    _write_json(out / "report.json", report)
    tmp = out / f".report.md.{os.getpid()}.tmp"
    tmp.write_text(render(report))
    os.replace(tmp, out / "report.md")


def _run_child(path: Path, a: argparse.Namespace, timeout: float) -> dict[str, Any]:
    out = Path(a.out)
    res_file = out / "results" / f"{slug(path)}.json"
    res_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(SCRIPT), "--run-one", str(path), "--out", str(out),
           "--timeout", str(timeout)]
    # Its own session, so that a child still running past its limit goes with all it started.
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        proc.wait(timeout=timeout + 90)  # nbclient's own limit comes first; this is the backstop
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if res_file.exists():
        return json.loads(res_file.read_text())
    return {"notebook": _rel(path), "status": "failed", "seconds": timeout, "timeout": timeout,
            "first_error": {"cell": -1, "line": "", "error": f"the runner exited with {proc.returncode}"
                            " and wrote no result"}, **summarise_devices(
                                out / "devices" / f"{slug(path)}.jsonl")}


def run_all(a: argparse.Namespace, paths: list[Path]) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report: dict[str, Any] = {
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "budget": a.budget, "timeout": a.timeout, "jobs": a.jobs, "machine": machine(),
        "notebooks": [{"notebook": _rel(p), "status": "not run"} for p in paths], "seconds": 0.0}
    m = report["machine"]
    print(f"torch {m.get('torch')}, CUDA {m.get('cuda')}, GPUs: {m.get('gpus') or 'none'}", flush=True)
    _save(out, report)

    def one(i: int) -> None:
        left = a.budget - (time.monotonic() - t0)
        if left < 10:
            report["notebooks"][i]["first_error"] = {"cell": -1, "line": "",
                                                     "error": "not started: the run's budget is spent"}
            return
        r = _run_child(paths[i], a, min(a.timeout, left))
        report["notebooks"][i] = r
        report["seconds"] = round(time.monotonic() - t0, 1)
        _save(out, report)
        mark = {"passed": "[PASS]", "timeout": "[TIME]"}.get(r["status"], "[FAIL]")
        err = r.get("first_error") or {}
        print(f"{mark} {r.get('seconds', 0):6.1f} s  {r['notebook']}  "
              f"backends {r.get('backends') or '-'} devices {r.get('devices') or '-'}"
              + (f"\n       cell {err.get('cell')}: {err.get('error')}" if err else ""), flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        list(pool.map(one, range(len(paths))))
    report["seconds"] = round(time.monotonic() - t0, 1)
    _save(out, report)
    print(f"{report['passed']} passed, {report['failed']} failed ({report['not_run']} not run) "
          f"in {report['seconds']:.0f} s; report: {out / 'report.md'}")
    return 0 if report["failed"] == 0 and report["not_run"] == 0 else 1


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 tools/gpu_check.py",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb solutions/*.ipynb")
    ap.add_argument("--dry-run", action="store_true", help="print what would run; run nothing")
    ap.add_argument("--out", default=str(ROOT / "gpu-report"), help="report folder (default gpu-report/)")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("GPU_CHECK_TIMEOUT", 240)),
                    help="seconds for one notebook, all its cells together (default 240)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", 480)),
                    help="seconds for the whole run; later notebooks are not started (default 480)")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks run at the same time (default 1)")
    ap.add_argument("--wheels", type=Path, default=ROOT / "gpu-wheels", help="wheels for the set-up")
    ap.add_argument("--venv", type=Path, default=ROOT / ".gpu-venv", help="venv made by the set-up")
    ap.add_argument("--no-setup", action="store_true", help="run with this interpreter as it is")
    ap.add_argument("--download-wheels", action="store_true",
                    help="only download the set-up wheels into --wheels (needs the network)")
    ap.add_argument("--python-version", default="3.12", help="Python of the GPU machine, for the wheels")
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.jobs < 1 or a.timeout <= 0 or a.budget <= 0:
        ap.error("--jobs, --timeout and --budget must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.run_one:
        return _child_main(a)
    if a.download_wheels:
        for cmd in download_commands(a.wheels, a.python_version):
            print("$", _q(cmd), flush=True)
            if not a.dry_run:
                subprocess.run(cmd, check=True)
        return 0
    paths = [p.resolve() for p in a.notebooks] or default_notebooks()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"no such notebook: {', '.join(missing)}")
    needs_setup = not a.no_setup and not have_jupyter()
    if a.dry_run:
        print(f"python: {sys.executable} (Python {platform.python_version()}); its torch is used as is")
        if needs_setup:
            have = len(list(a.wheels.glob("*.whl")))
            print(f"set-up: nbclient/nbformat/ipykernel missing; {have} wheel(s) in {a.wheels}"
                  + ("" if have else " (run `make gpu-wheels` on a networked machine first)"))
            for cmd in setup_commands(a.venv, a.wheels):
                print("  $", _q(cmd))
            print(f"  then rerun this command with {a.venv / 'bin' / 'python'} --no-setup")
        else:
            print("set-up: none needed (nbclient, nbformat and ipykernel import here)")
        print(f"run: {len(paths)} notebook(s), {a.jobs} at a time, each in a fresh kernel with a limit "
              f"of {a.timeout:.0f} s, the whole run within {a.budget:.0f} s:")
        for p in paths:
            print(f"  {_rel(p)}")
        print(f"report: {Path(a.out) / 'report.md'} and report.json; executed notebooks in "
              f"{Path(a.out) / 'executed'}/")
        return 0
    if needs_setup:
        py = set_up(a.venv, a.wheels)
        args = [*(argv if argv is not None else sys.argv[1:]), "--no-setup"]
        os.execv(str(py), [str(py), str(SCRIPT), *args])
    return run_all(a, paths)


if __name__ == "__main__":
    sys.exit(main())
