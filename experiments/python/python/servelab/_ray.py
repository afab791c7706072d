"""Sweeps on Ray: every point × seed of a ``[sweep]`` config as one Ray task.

The driver lays the sweep out with the local runner's own code (the same point checks, ids and
resume rule), each task runs its point in its worker's process into a scratch folder and sends
the files back, the driver writes them under ``points/<id>/`` as the local runner would, and the
same code then tabulates them: ``sweep.csv`` equals the local runner's (same rows; Ray finishes
points in any order, the table is in point order either way).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import _native
from ._native import ServelabError


def _run_point(path: str, text: str, overrides: list[str], seed: int, threads: int) -> dict[str, bytes]:
    """One point × seed on a worker; returns its files by relative path."""
    # The simulator's thread pool starts on first use: size it to the task's CPUs so that
    # tasks sharing a node do not oversubscribe it.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    with tempfile.TemporaryDirectory(prefix="servelab-point-") as d:
        _native.run_point(path, text, overrides, seed, d)
        root = Path(d)
        return {
            str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
        }


def ray_sweep(
    config: str | Path,
    set: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    seed: int | None = None,
    out: str | Path | None = None,
    force: bool = False,
    num_cpus: int = 1,
):
    """Runs the ``[sweep]`` of ``config`` with one Ray task per point × seed and returns the
    same :class:`servelab.Result` as :func:`servelab.run` (tables ``sweep`` and
    ``sweep_summary``).

    It uses the Ray cluster this process is connected to: call ``ray.init(address=...)`` first
    for an existing cluster (whose workers need this package installed, and any trace the
    config names at the same path); without it, ``ray.init()`` starts a local one. Each task
    asks for ``num_cpus`` CPUs. The output folder (default: a new temporary one) is the local
    runner's: an interrupted sweep started again into it runs only the points not finished.
    """
    try:
        import ray
    except ImportError as e:
        raise ServelabError("ray_sweep needs Ray: pip install 'ray>=2,<3'") from e
    from . import _read_result, _run_argv

    argv, _ = _run_argv(config, set, seed, out, force)
    plan = json.loads(_native.sweep_plan(argv))
    if not ray.is_initialized():
        ray.init()
    task = ray.remote(num_cpus=num_cpus)(_run_point)
    # Each task gets the config's text, so workers need not see the driver's files.
    pending = {
        task.remote(plan["config_path"], plan["config_text"], j["overrides"], j["seed"], num_cpus): j
        for j in plan["jobs"]
        if not j["done"]
    }
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            job = pending.pop(ref)
            try:
                files = ray.get(ref)
            except Exception as e:
                for r in pending:
                    ray.cancel(r)
                raise ServelabError(
                    f"sweep point {job['point']} (seed {job['seed']}) failed on Ray: {e}; "
                    "finished points are kept and a new run into the same folder resumes"
                ) from e
            d = Path(job["dir"])
            for rel, data in files.items():
                p = d / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
            # Written last: it marks the point finished for a resumed sweep.
            (d / "point.json").write_text(job["record"])
    # The tables are written with `force` off: the folder is the sweep's own by now.
    finish = [a for a in argv if a != "--force"]
    return _read_result(Path(_native.sweep_finish(finish)))
