"""Background sampling of CPU, memory and GPU use, logged as ``system/...`` metrics.

Every ``collection_interval`` seconds a daemon thread takes one sample; every ``flush_interval`` seconds it
hands the mean of the samples since the last flush to a callback (the Logger, which logs them with the
``system`` prefix). GPU numbers come from NVML and cover every GPU of this node, including those used by
worker processes; on machines without NVML only CPU and memory are sampled. NVML is used instead of
``torch.cuda`` on purpose: querying through torch would create a CUDA context in the driver process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from nemo_rl.config.logger import GPUMonitoringConfig

_BYTES_PER_GB = 1024**3


class _NvmlGpus:
    """NVML handles of this node's GPUs; empty when NVML or a driver is unavailable."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self.handles: list[Any] = []
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            # No NVIDIA driver on this machine: monitor CPU and memory only.
            return
        self._nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def sample(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for index, handle in enumerate(self.handles):
            utilization = self._nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            metrics[f"gpu{index}/utilization_percent"] = float(utilization.gpu)
            metrics[f"gpu{index}/memory_used_gb"] = memory.used / _BYTES_PER_GB
            metrics[f"gpu{index}/memory_percent"] = 100.0 * memory.used / memory.total
        return metrics

    def shutdown(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
            self.handles = []


class ResourceMonitor:
    """Samples resources on a daemon thread and reports window means through ``log_fn``.

    Metric names (no prefix; the Logger adds ``system/``): ``cpu_percent`` (whole machine),
    ``process_tree_cpu_percent`` and ``process_tree_rss_gb`` (this process and its children, e.g. a local
    Ray cluster), ``ram_used_gb``, ``ram_percent``, and per GPU ``gpu<i>/utilization_percent``,
    ``gpu<i>/memory_used_gb``, ``gpu<i>/memory_percent``.
    """

    def __init__(self, cfg: GPUMonitoringConfig, log_fn: Callable[[dict[str, float]], None]) -> None:
        self.cfg = cfg
        self._log_fn = log_fn
        self._root = psutil.Process()
        # cpu_percent() measures since the previous call on the same Process object, so keep them.
        self._processes: dict[int, psutil.Process] = {}
        self._gpus: _NvmlGpus | None = None
        self._samples: list[dict[str, float]] = []
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    def _process_tree(self) -> list[psutil.Process]:
        current = [self._root, *self._root.children(recursive=True)]
        alive = {p.pid: self._processes.get(p.pid, p) for p in current}
        self._processes = alive
        return list(alive.values())

    def sample(self) -> dict[str, float]:
        """One sample of every metric (CPU percentages cover the time since the previous sample)."""
        tree_cpu_percent = 0.0
        tree_rss_bytes = 0
        for process in self._process_tree():
            try:
                tree_cpu_percent += process.cpu_percent(interval=None)
                tree_rss_bytes += process.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                # A child that exited (or that we may not inspect) between listing and sampling.
                continue
        memory = psutil.virtual_memory()
        metrics = {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "process_tree_cpu_percent": tree_cpu_percent,
            "process_tree_rss_gb": tree_rss_bytes / _BYTES_PER_GB,
            "ram_used_gb": memory.used / _BYTES_PER_GB,
            "ram_percent": memory.percent,
        }
        if self._gpus is not None:
            metrics.update(self._gpus.sample())
        return metrics

    def flush(self) -> None:
        """Report the mean of the samples taken since the last flush (nothing when there are none)."""
        samples, self._samples = self._samples, []
        if not samples:
            return
        keys = {key for sample in samples for key in sample}
        means = {}
        for key in sorted(keys):
            values = [sample[key] for sample in samples if key in sample]
            means[key] = sum(values) / len(values)
        self._log_fn(means)

    def start(self) -> None:
        """Start the sampling thread."""
        if self._thread is not None:
            raise RuntimeError("ResourceMonitor is already running.")
        self._gpus = _NvmlGpus()
        self.sample()  # primes the CPU counters, whose first reading is meaningless
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._run, name="nemo_rl-resource-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the thread, reporting what was sampled since the last flush."""
        if self._thread is None:
            return
        self._stop_event.set()
        self._thread.join()
        self._thread = None
        self.flush()
        if self._gpus is not None:
            self._gpus.shutdown()
            self._gpus = None

    @property
    def running(self) -> bool:
        """Whether the sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        last_flush_s = time.monotonic()
        while not self._stop_event.wait(self.cfg.collection_interval):
            self._samples.append(self.sample())
            if time.monotonic() - last_flush_s >= self.cfg.flush_interval:
                self.flush()
                last_flush_s = time.monotonic()
