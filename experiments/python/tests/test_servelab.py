"""servelab from Python against the `servelab` command: the same numbers for the same config,
seed and flags, overrides that change the run, and errors that name the file and the key."""

from __future__ import annotations

import json

import polars as pl
import pytest
from polars.testing import assert_frame_equal

import servelab
from servelab import ServelabError


def same_csvs(a, b, names):
    for n in names:
        assert (a / f"{n}.csv").read_bytes() == (b / f"{n}.csv").read_bytes(), n


def test_run_returns_the_cli_tables(tmp_path, tiny, cli):
    r = servelab.run(tiny, out=tmp_path / "py")
    cli("run", tiny, "--out", tmp_path / "cli", "--quiet")
    assert {"table", "policies", "store"} <= set(r.tables)
    assert r.tables["policies"].height > 0
    for name, df in r.tables.items():
        # The DataFrame is the CLI's CSV, value for value and type for type.
        want = pl.read_csv(tmp_path / "cli" / f"{name}.csv", schema=df.schema)
        assert_frame_equal(df, want)
    same_csvs(r.out, tmp_path / "cli", r.tables)
    assert r.summary == json.loads((tmp_path / "cli" / "summary.json").read_text())
    manifest = json.loads((r.out / "manifest.json").read_text())
    assert manifest["seed"] == 5
    assert manifest["run"]["command_line"].startswith("servelab run ")


def test_seed_and_overrides_change_the_run_as_on_the_cli(tmp_path, tiny, cli):
    base = servelab.run(tiny)
    other_seed = servelab.run(tiny, seed=6)
    assert not base["policies"].equals(other_seed["policies"])
    short = servelab.run(tiny, {"store.ttl.agent": "1s"}, seed=6)
    as_list = servelab.run(tiny, ['store.ttl.agent="1s"'], seed=6)
    assert short["policies"].equals(as_list["policies"])
    assert not short["policies"].equals(other_seed["policies"])
    cli("run", tiny, "--out", tmp_path / "cli", "--quiet", "--seed", "6", "--set", "store.ttl.agent=1s")
    same_csvs(short.out, tmp_path / "cli", short.tables)
    manifest = json.loads((short.out / "manifest.json").read_text())
    assert manifest["overrides"] == ["store.ttl.agent=1s"]


def test_bad_overrides_and_configs_raise_with_the_key_and_the_file(tmp_path, tiny):
    with pytest.raises(ServelabError, match=r"store\.ttl\.agnt") as e:
        servelab.run(tiny, {"store.ttl.agnt": "1h"})
    assert "agent" in str(e.value), "the valid keys are listed"
    bad = tmp_path / "bad.toml"
    bad.write_text(tiny.read_text().replace("sessions = 6", "sesions = 6"))
    with pytest.raises(ServelabError) as e:
        servelab.run(bad)
    assert "bad.toml" in str(e.value) and "sesions" in str(e.value) and "line" in str(e.value)
    with pytest.raises(ServelabError, match="unit"):
        servelab.run(tiny, {"store.ttl.agent": 3600})
    # A folder with results is refused, as on the command line.
    r = servelab.run(tiny)
    with pytest.raises(ServelabError, match=str(r.out)):
        servelab.run(tiny, out=r.out)
    assert servelab.run(tiny, out=r.out, force=True)["policies"].equals(r["policies"])


def test_hit_is_the_cli_decision(cli):
    got = servelab.hit(1000, 896, swa_at=[896])
    want = json.loads(cli("hit", "--prompt-len", 1000, "--cached-tokens", 896, "--swa-at", 896, "--json"))
    assert got.height == 1
    assert got.row(0, named=True) == want
    ordinary = servelab.hit(1000, 896, policy="ordinary-model")
    assert ordinary["hit_tokens"][0] == 896 and got["hit_tokens"][0] < 896


def test_hit_rejects_bad_input():
    with pytest.raises(ServelabError, match="--cached-tokens"):
        servelab.hit(100, 256)
    with pytest.raises(ServelabError, match="unknown policy `lru`"):
        servelab.hit(1000, 896, policy="lru")


def test_replay_is_the_cli_replay(trace, cli):
    got = servelab.replay(trace, "native", capacity_blocks=40, ttl="60s", block_size=128)
    want = json.loads(
        cli("replay", "--trace", trace, "--format", "native", "--capacity-blocks", 40, "--ttl", "60s",
            "--block-size", 128, "--json")
    )
    row = got.row(0, named=True)
    assert row["hit_tokens"] == want["hit_tokens"] > 0
    assert row["store.evictions"] == want["store"]["evictions"]
    assert row["per_class.chat.hit_tokens"] == want["per_class"]["chat"]["hit_tokens"]
    assert row["token_hit_rate"] == want["token_hit_rate"]
    # Longer TTL: the document read 90 s later hits too.
    longer = servelab.replay(trace, "native", ttl="1h")
    assert longer["hit_tokens"][0] > servelab.replay(trace, "native", ttl="60s")["hit_tokens"][0]


def test_replay_errors_name_the_trace_line(tmp_path, trace):
    bad = tmp_path / "bad.jsonl"
    lines = trace.read_text().splitlines()
    lines[1] = lines[1].replace('"prompt"', '"prompts"')
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ServelabError, match=r"bad\.jsonl:2"):
        servelab.replay(bad, "native")
    with pytest.raises(ServelabError, match="unit"):
        servelab.replay(trace, "native", ttl="90")
    with pytest.raises(ServelabError, match="mooncake"):
        servelab.replay(trace, "parquet")


def test_mrc_is_the_cli_curve_and_equals_point_replays(tmp_path, trace, cli):
    r = servelab.mrc(trace, "native", block_size=128, check=3, out=tmp_path / "py")
    cli("mrc", "--trace", trace, "--format", "native", "--block-size", 128, "--check", 3,
        "--out", tmp_path / "cli")
    assert {"capacity", "ttl", "check"} <= set(r.tables)
    assert r.summary["checks_equal"] is True
    assert r["check"]["equal"].all()
    same_csvs(r.out, tmp_path / "cli", ["capacity", "ttl", "check"])
    cap = r["capacity"].filter(pl.col("class") == "all")
    assert cap["token_hit_rate"].is_sorted(), "more capacity never hits less"


def test_a_sweep_in_python_is_the_cli_sweep(tmp_path, tiny_sweep, cli):
    r = servelab.run(tiny_sweep, out=tmp_path / "py", jobs=2)
    cli("run", tiny_sweep, "--out", tmp_path / "cli", "--quiet", "-j", "2")
    assert r["sweep"].height == 3 * 2
    assert {"point", "store.ttl.agent", "seed"} <= set(r["sweep"].columns)
    same_csvs(r.out, tmp_path / "cli", ["sweep", "sweep_summary"])
    with pytest.raises(ServelabError, match="empty"):
        bad = tmp_path / "empty.toml"
        bad.write_text(tiny_sweep.read_text().replace('["1s", "1h", "3d"]', "[]"))
        servelab.run(bad)
