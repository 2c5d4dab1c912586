"""A vLLM worker's temporary folder, which outlives no worker for long.

vLLM leaves files in the temporary folder when its process is killed: its engine's ZeroMQ sockets
(``VLLM_RPC_BASE_PATH``) and the ``vllm_dist_*`` file store of its distributed group. A generation worker that
dies (and is replaced, docs/reliability.md) ends that way. Each worker therefore keeps them in a folder of its
own, named with its process id (:func:`worker_tmp_dir`), removed at shutdown; a worker starting on the node
removes the folders of workers whose process is gone (a replacement removes its predecessor's).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil

from nemo_rl.models.generation.vllm.cpu_shm import IDENT_PREFIX as PREFIX


def sweep_dead_workers_tmp_dirs(root: Path | None = None) -> list[Path]:
    """Remove this user's worker folders under ``root`` (the temporary folder) whose worker process is gone;
    returns them."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*_*"):
        pid = path.name[len(PREFIX) :].split("_", 1)[0]
        if (
            pid.isdigit()
            and path.is_dir()
            and path.stat().st_uid == os.getuid()
            and not psutil.pid_exists(int(pid))
        ):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def worker_tmp_dir() -> str:
    """A new folder for this worker's temporary files (the folders of dead workers removed first)."""
    sweep_dead_workers_tmp_dirs()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}_")


@contextlib.contextmanager
def temporary_files_in(folder: str) -> Iterator[None]:
    """Within the block, ``tempfile`` puts what it creates in ``folder`` (vLLM's file store is made while the
    engine is built). torch's compile cache stays where it was: its folder is fixed first."""
    with contextlib.suppress(ImportError):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    before = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = before
