"""`servelab.ray_sweep` on a local Ray cluster gives the local runner's sweep table."""

from __future__ import annotations

import pytest

import servelab

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray>=2,<3'")


@pytest.fixture(scope="module")
def local_ray():
    # Two CPUs, as on CI; no dashboard (it would need its optional dependencies).
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def sorted_lines(p):
    head, *rows = p.read_text().splitlines()
    return [head, *sorted(rows)]


def test_ray_sweep_is_the_local_sweep(tmp_path, tiny_sweep, cli, local_ray):
    r = servelab.ray_sweep(tiny_sweep, out=tmp_path / "ray")
    cli("run", tiny_sweep, "--out", tmp_path / "local", "--quiet", "-j", "2")
    for name in ("sweep", "sweep_summary"):
        assert sorted_lines(r.out / f"{name}.csv") == sorted_lines(tmp_path / "local" / f"{name}.csv")
    assert r["sweep"].height == 6
    # Started again into the same folder, it resumes: every point is already there, so no
    # point's files are written again.
    summaries = sorted((r.out / "points").glob("*/summary.json"))
    assert len(summaries) == 6
    before = [p.stat().st_mtime_ns for p in summaries]
    again = servelab.ray_sweep(tiny_sweep, out=tmp_path / "ray")
    assert again["sweep"].equals(r["sweep"])
    assert [p.stat().st_mtime_ns for p in summaries] == before
    # A bad point fails before any task, naming the key.
    with pytest.raises(servelab.ServelabError, match="store.ttl.agnt"):
        servelab.ray_sweep(tiny_sweep, {"store.ttl.agnt": "1h"})
