"""servelab from Python.

Every function runs the same Rust code as its ``servelab`` command (the keyword arguments are
turned into that command's flags and parsed by the command's own definition), so the numbers
are the command's: ``run`` is ``servelab run``, ``replay`` is ``servelab replay``, ``hit`` is
``servelab hit`` and ``mrc`` is ``servelab mrc``. Tables come back as polars DataFrames, read
from the Parquet files the run wrote; ``ray_sweep`` runs a ``[sweep]`` config's points as Ray
tasks. Bad input raises :class:`ServelabError` with the command line's message (the file, the
line and the key).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import polars as pl

from . import _native
from ._native import ServelabError

__version__ = _native.__version__

__all__ = [
    "Result",
    "ServelabError",
    "hit",
    "mrc",
    "ray_sweep",
    "replay",
    "run",
]


@dataclass
class Result:
    """What a run wrote: its folder, its tidy tables by name, and its headline metrics."""

    out: Path
    tables: dict[str, pl.DataFrame]
    summary: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> pl.DataFrame:
        return self.tables[name]


def _toml(v: Any) -> str:
    """A Python value as a TOML value, for a ``--set`` override inside a list or table."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ServelabError(f"override value {v!r} is not a finite number")
        return repr(v)
    if isinstance(v, str):
        # A JSON string is a valid TOML basic string.
        return json.dumps(v)
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    raise ServelabError(f"override value {v!r}: use a str, number, bool, list or dict")


def _override(key: str, v: Any) -> str:
    # A top-level string is passed as written, as on the command line: TOML (`'"1h"'`,
    # `'{ kind = "least-loaded" }'`) or a bare word taken as a string (`1h`, `least-loaded`).
    return f"{key}={v if isinstance(v, str) else _toml(v)}"


def _set_flags(set: Mapping[str, Any] | Iterable[str] | None) -> list[str]:
    if set is None:
        return []
    if isinstance(set, str):
        raise ServelabError("set: give a dict {key: value} or a list of 'KEY=VALUE' strings")
    items = (
        [_override(k, v) for k, v in set.items()] if isinstance(set, Mapping) else list(set)
    )
    flags: list[str] = []
    for s in items:
        flags += ["--set", s]
    return flags


def _run_argv(
    config: str | Path,
    set: Mapping[str, Any] | Iterable[str] | None,
    seed: int | None,
    out: str | Path | None,
    force: bool,
    jobs: int | None = None,
) -> tuple[list[str], Path]:
    out = Path(tempfile.mkdtemp(prefix="servelab-run-")) if out is None else Path(out)
    argv = ["run", str(config), "--out", str(out), "--quiet"]
    if seed is not None:
        argv += ["--seed", str(seed)]
    if force:
        argv.append("--force")
    if jobs is not None:
        argv += ["--jobs", str(jobs)]
    return argv + _set_flags(set), out


def _flag_args(**kw: Any) -> list[str]:
    """Keyword arguments as command-line flags: True is a bare flag, False and None are left
    out, a list is comma-separated."""
    argv: list[str] = []
    for k, v in kw.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif isinstance(v, (list, tuple)):
            if v:
                argv += [flag, ",".join(str(x) for x in v)]
        else:
            argv += [flag, str(v)]
    return argv


def _read_result(out: Path) -> Result:
    out = Path(out)
    tables = {p.stem: pl.read_parquet(p) for p in sorted(out.glob("*.parquet"))}
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return Result(out=out, tables=tables, summary=summary)


def _flatten(v: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(v, dict):
        flat: dict[str, Any] = {}
        for k, x in v.items():
            flat.update(_flatten(x, f"{prefix}{k}."))
        return flat
    return {prefix[:-1]: v}


def _row(flat: dict[str, Any]) -> pl.DataFrame:
    # One column per field; a field that is null (no capacity, no SWA state) stays null.
    return pl.DataFrame({k: [v] for k, v in flat.items()})


def run(
    config: str | Path,
    set: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    seed: int | None = None,
    out: str | Path | None = None,
    force: bool = False,
    jobs: int | None = None,
) -> Result:
    """Runs an experiment config, as ``servelab run CONFIG --set KEY=VALUE ...``.

    ``set`` is a dict ``{"store.ttl.agent": "1h"}`` (a str is passed as on the command line:
    TOML or a bare word; other values are converted to TOML) or a list of ``"KEY=VALUE"``
    strings. ``out`` defaults to a new temporary folder; an existing folder with results is
    refused unless ``force``. A config with a ``[sweep]`` table runs every point × seed in this
    process (``jobs`` at a time) and returns the ``sweep`` and ``sweep_summary`` tables.
    """
    argv, _ = _run_argv(config, set, seed, out, force, jobs)
    return _read_result(Path(_native.run(argv)))


def hit(
    prompt_len: int,
    cached_tokens: int,
    *,
    swa_at: Iterable[int] = (),
    policy: str = "deepinfer",
    block_size: int | None = None,
    decoder_replay: int | None = None,
) -> pl.DataFrame:
    """Explains one hit decision, as ``servelab hit --json``: a one-row DataFrame."""
    argv = ["hit"] + _flag_args(
        prompt_len=prompt_len,
        cached_tokens=cached_tokens,
        swa_at=list(swa_at),
        policy=policy,
        block_size=block_size,
        decoder_replay=decoder_replay,
    )
    return _row(_flatten(json.loads(_native.hit(argv))))


def replay(
    trace: str | Path,
    format: str,
    *,
    block_size: int | None = None,
    capacity_blocks: int | None = None,
    capacity_bytes: int | None = None,
    ttl: str | None = None,
    policy: str | None = None,
    cache_outputs: bool = False,
    bytes_per_token: int | None = None,
    traffic_class: str | None = None,
) -> pl.DataFrame:
    """Replays a trace through the block store, as ``servelab replay --json``: a one-row
    DataFrame (nested fields flattened with dots: ``store.evictions``,
    ``per_class.chat.hit_tokens``)."""
    argv = ["replay"] + _flag_args(
        trace=trace,
        format=format,
        block_size=block_size,
        capacity_blocks=capacity_blocks,
        capacity_bytes=capacity_bytes,
        ttl=ttl,
        policy=policy,
        cache_outputs=cache_outputs,
        bytes_per_token=bytes_per_token,
        **{"class": traffic_class},
    )
    return _row(_flatten(json.loads(_native.replay(argv))))


def mrc(
    trace: str | Path,
    format: str,
    *,
    block_size: int | None = None,
    sample_rate: float | None = None,
    no_exact: bool = False,
    check: int | None = None,
    cache_outputs: bool = False,
    bytes_per_token: int | None = None,
    traffic_class: str | None = None,
    points_per_decade: int | None = None,
    out: str | Path | None = None,
) -> Result:
    """Hit-rate curves of a trace for every capacity and TTL, as ``servelab mrc``: the
    ``capacity`` and ``ttl`` tables (and ``sampling_error``, ``check`` when asked for), with the
    ``--json`` summary as ``summary``. ``out`` defaults to a new temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="servelab-mrc-")) if out is None else Path(out)
    argv = ["mrc"] + _flag_args(
        trace=trace,
        format=format,
        block_size=block_size,
        sample_rate=sample_rate,
        no_exact=no_exact,
        check=check,
        cache_outputs=cache_outputs,
        bytes_per_token=bytes_per_token,
        points_per_decade=points_per_decade,
        out=out,
        **{"class": traffic_class},
    )
    summary = json.loads(_native.mrc(argv))
    r = _read_result(out)
    r.summary = summary
    return r


from ._ray import ray_sweep  # noqa: E402  (it uses the helpers above)
