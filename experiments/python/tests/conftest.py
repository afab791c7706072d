"""Fixtures: the `servelab` binary the Python results are compared with, a small config and a
small trace (each runs well under a second in a debug build)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

TINY = """policies = ["deepinfer", "perfect-cache", "ordinary-model", "exact-rebuild"]

[experiment]
kind = "cache-policy"
seed = 5

[store]
ttl = { agent = "3d", chat = "7d", other = "3d" }

[[workload]]
name = "agent"
[workload.mix.agent]
sessions = 6
session_rate_per_s = 0.5
turns = { kind = "fixed", value = 4 }
system_prompts = 2
system_prompt_tokens = { kind = "uniform", min = 500, max = 2000 }
task_tokens = { kind = "fixed", value = 300 }
reply_tokens = { kind = "lognormal", median = 200, sigma = 0.5 }
tool_result_tokens = { kind = "uniform", min = 200, max = 3000 }
think_time_s = { kind = "lognormal", median = 600.0, sigma = 1.5 }
"""

SWEEP = """
[sweep]
seeds = [1, 2]
[sweep.grid]
"store.ttl.agent" = ["1s", "1h", "3d"]
"""


@pytest.fixture(scope="session")
def servelab_bin() -> Path:
    """The CLI built from this checkout: $SERVELAB_BIN, else target/debug or target/release."""
    if "SERVELAB_BIN" in os.environ:
        p = Path(os.environ["SERVELAB_BIN"])
        if not p.is_file():
            pytest.fail(f"SERVELAB_BIN={p} does not exist")
        return p
    for profile in ("debug", "release"):
        p = REPO / "target" / profile / "servelab"
        if p.is_file():
            return p
    pytest.fail(
        "no servelab binary to compare with: run `cargo build -p servelab-experiments` "
        "or set SERVELAB_BIN"
    )


@pytest.fixture
def cli(servelab_bin):
    """Runs `servelab ARGS...`, failing the test on a non-zero exit."""

    def call(*args: str) -> str:
        o = subprocess.run(
            [str(servelab_bin), *map(str, args)], capture_output=True, text=True, check=False
        )
        assert o.returncode == 0, o.stderr
        return o.stdout

    return call


@pytest.fixture
def tiny(tmp_path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(TINY)
    return p


@pytest.fixture
def tiny_sweep(tmp_path) -> Path:
    p = tmp_path / "sweep.toml"
    p.write_text(TINY + SWEEP)
    return p


@pytest.fixture
def trace(tmp_path) -> Path:
    """A native trace: two chat sessions sharing a system prompt, and a document read twice."""
    rows = []
    t = 0.0
    for s in range(2):
        prompt = [[1, 2000]]
        for turn in range(4):
            prompt = prompt + [[100 * s + 10 * turn + 2, 150 + 40 * turn]]
            rows.append(
                {
                    "arrival_ms": t,
                    "session": s,
                    "class": "chat",
                    "prompt": prompt,
                    "output": [100 * s + 10 * turn + 3, 120],
                }
            )
            prompt = prompt + [[100 * s + 10 * turn + 3, 120]]
            t += 1500.0
    rows.append({"arrival_ms": t, "class": "other", "prompt": [[900, 6000]], "output_tokens": 50})
    rows.append({"arrival_ms": t + 90000, "class": "other", "prompt": [[900, 6000]], "output_tokens": 50})
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p
