"""course_utils.resources: the CPU fallback for real, the NVML path through a stand-in module
(and for real when this machine has an NVIDIA GPU)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types

import matplotlib

matplotlib.use("Agg")

import psutil  # noqa: E402
import pytest  # noqa: E402

from course_utils import resources  # noqa: E402


@pytest.fixture
def fresh_nvml(monkeypatch):
    """Forget whether NVML was found, so that a test can install its own pynvml."""
    monkeypatch.setattr(resources, "_nvml_state", {"ok": None, "error": ""})


def _fake_pynvml(gpus: int = 2, fail_init: bool = False) -> types.ModuleType:
    """A pynvml stand-in: GPU i is at 10*(i+1) % and uses (i+1) GiB of 80 GiB."""
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU = 0
    nv.calls = {"init": 0, "util": 0}

    def nvmlInit():
        nv.calls["init"] += 1
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    nv.nvmlInit = nvmlInit
    nv.nvmlDeviceGetCount = lambda: gpus
    nv.nvmlDeviceGetHandleByIndex = lambda i: i

    def util(h):
        nv.calls["util"] += 1
        return types.SimpleNamespace(gpu=10 * (h + 1), memory=5 * (h + 1))

    nv.nvmlDeviceGetUtilizationRates = util
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 2**30, total=80 * 2**30)
    nv.nvmlDeviceGetName = lambda h: b"Fake GPU"  # old pynvml versions return bytes
    nv.nvmlDeviceGetTemperature = lambda h, kind: 40 + h
    nv.nvmlDeviceGetPowerUsage = lambda h: 100_000  # milliwatts
    nv.nvmlDeviceGetIndex = lambda h: h

    def by_uuid(uuid):
        if uuid not in [f"GPU-{i:04d}" for i in range(gpus)]:
            raise RuntimeError("Not Found")
        return int(uuid[4:])

    nv.nvmlDeviceGetHandleByUUID = by_uuid
    return nv


def test_gpu_summary_is_a_list_here():
    rows = resources.gpu_summary()
    assert isinstance(rows, list)
    ok, why = resources.nvml_available()
    if ok:  # a machine with an NVIDIA driver: one row per GPU, with real readings
        for row in rows:
            assert row["memory_total_mb"] > 0 and 0 <= row["util_percent"] <= 100
    else:
        assert rows == [] and why


def test_gpu_summary_through_nvml(monkeypatch, fresh_nvml):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(gpus=2))
    rows = resources.gpu_summary()
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[1] == {"index": 1, "util_percent": 20.0, "mem_util_percent": 10.0,
                       "memory_used_mb": 2048.0, "memory_total_mb": 81920.0, "name": "Fake GPU",
                       "temperature_c": 41.0, "power_w": 100.0}


def test_no_driver_means_no_gpu(monkeypatch, fresh_nvml):
    fake = _fake_pynvml(fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert resources.gpu_summary() == []
    ok, why = resources.nvml_available()
    assert not ok and "Library Not Found" in why
    with resources.ResourceSampler(interval=0.05) as rs:
        time.sleep(0.12)
    assert rs.source == "cpu" and "gpu_util" not in rs.samples[-1]
    assert fake.calls["init"] == 1  # a failed NVML is not retried on every call


def test_sampler_reads_gpus_in_the_background(monkeypatch, fresh_nvml):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = _fake_pynvml(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with resources.ResourceSampler(interval=0.02) as rs:
        time.sleep(0.2)
    assert rs.source == "nvml" and rs.gpu_indices == [0, 1]
    assert len(rs.samples) >= 4
    assert all(s["gpu_util"] == [10.0, 20.0] and s["gpu_mem_mb"] == [1024.0, 2048.0]
               for s in rs.samples)
    assert rs.summary()["gpu1_util_mean"] == 20.0
    ax = rs.plot()
    assert ax.get_ylabel() == "GPU utilisation (%)"
    assert {ln.get_label() for ln in ax.get_legend().get_lines()} == {
        "GPU 0 utilisation", "GPU 1 utilisation", "GPU 0 memory", "GPU 1 memory"}

    only_one = resources.ResourceSampler(interval=0.02, gpus=[1])
    assert only_one.gpu_indices == [1]
    assert resources.ResourceSampler(gpus=None).source == "cpu"


def test_cpu_fallback_sees_a_busy_thread_and_a_child_process(monkeypatch, fresh_nvml):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # "import pynvml" raises ImportError
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    t = threading.Thread(target=spin)
    try:
        with resources.ResourceSampler(interval=0.05) as rs:
            t.start()
            time.sleep(0.5)
            rs.mark("half way")
            time.sleep(0.2)
    finally:
        stop.set()
        t.join()
        child.kill()
        child.wait()
    assert rs.source == "cpu"
    assert {"t", "cpu_percent", "rss_mb", "system_cpu_percent", "nprocs"} <= set(rs.samples[0])
    assert max(rs.series("cpu_percent")) > 0  # the spinning thread used CPU
    assert max(rs.series("nprocs")) >= 2  # this process and the child
    assert min(rs.series("rss_mb")) > 10
    assert rs.marks and rs.marks[0][1] == "half way" and 0.4 < rs.marks[0][0] < 2
    assert rs.series("t") == sorted(rs.series("t"))
    summary = rs.summary()
    assert summary["cpu_percent_max"] >= summary["cpu_percent_mean"] > 0
    ax = rs.plot(title="cpu")
    assert ax.get_title() == "cpu" and "CPU" in ax.get_ylabel()


def test_sampler_arguments_are_checked():
    with pytest.raises(ValueError, match="interval"):
        resources.ResourceSampler(interval=0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(psutil.NoSuchProcess):
        resources.ResourceSampler(pid=dead.pid)
    rs = resources.ResourceSampler(interval=0.05).start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            rs.start()
    finally:
        rs.stop()
    assert rs._thread is None


def test_auto_samples_the_gpus_cuda_may_use(monkeypatch, fresh_nvml):
    """NVML numbers every GPU of the machine; CUDA_VISIBLE_DEVICES=2,3 makes NVML's GPU 2 the
    job's cuda:0, and "auto" must sample GPUs 2 and 3, in that order, not 0 and 1."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(gpus=4))
    for env, expected in [(None, [0, 1, 2, 3]), ("2,3", [2, 3]), ("3,1", [3, 1]),
                          ("GPU-0002,GPU-0000", [2, 0]), ("1,7,2", [1]), ("GPU-9999", []),
                          ("", []), ("-1", [])]:
        if env is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        assert resources.visible_gpus() == expected, env
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    rs = resources.ResourceSampler(interval=0.02)
    assert rs.gpu_indices == [2, 3]
    assert resources.ResourceSampler(interval=0.02, gpus=[0]).gpu_indices == [0]  # NVML indices
