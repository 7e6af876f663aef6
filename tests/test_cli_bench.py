"""The benchmark as a user runs it: ``tokenbus bench`` against stacks it spawns (the
tokenbus paths, a peer in front of the same engine, prompts from a file, sessions) and
against nothing (the rest of the CLI: tests/test_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import cli_env
from tests.support.ports import free_port
from tests.support.repo import run_cli


@pytest.mark.stack
def test_bench_spawn_writes_json_with_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = run_cli(
        "bench",
        "--spawn",
        "--nats-too",
        "--concurrency",
        "1,4",
        "--requests-per-client",
        "2",
        "--max-tokens",
        "8",
        "--sim-prefill-ms",
        "2",
        "--sim-decode-ms",
        "1",
        "--out",
        str(out),
        env=cli_env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    targets = {(lv["target"], lv["concurrency"]) for lv in report["levels"]}
    assert targets == {(t, c) for t in ("tokenbus-http", "tokenbus-nats", "direct") for c in (1, 4)}
    for lv in report["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == 2 * lv["concurrency"]
        assert lv["output_tokens"] == 8 * lv["requests"]
        assert {"p50", "p99"} <= set(lv["ttft_ms"]) and lv["tbt_ms"] and lv["e2e_ms"]
        assert lv["output_tokens_per_s"] > 0
    http1 = next(lv for lv in report["levels"] if lv["target"] == "tokenbus-http")
    assert "bridge-0" in http1["peak_rss_mb"]
    cmp_ = report["comparison"]
    assert {(c["target"], c["concurrency"]) for c in cmp_} == {
        (t, c) for t in ("tokenbus-http", "tokenbus-nats") for c in (1, 4)
    }
    assert all("added_ttft_p50_ms" in c and "tokens_per_s_ratio" in c for c in cmp_)
    assert "results:" in r.stdout


@pytest.mark.stack
def test_bench_measures_a_peer_in_front_of_the_same_engine(tmp_path: Path) -> None:
    # pyrelay and busrelay need nothing installed, so the --peer path runs here end to end:
    # each peer started in front of the engine server tokenbus' openai workers use, its own
    # level, its CPU from its own processes, and a line in the comparison.
    report = _bench(
        tmp_path,
        *("--spawn", "--upstream", "--peer", "pyrelay", "--peer", "busrelay"),
        *("--concurrency", "1,3"),
        *("--requests-per-client", "2", "--max-tokens", "6", "--sim-prefill-ms", "2"),
        *("--sim-decode-ms", "1"),
    )
    levels = {(lv["target"], lv["concurrency"]): lv for lv in report["levels"]}
    peers = ("pyrelay", "busrelay")
    assert set(levels) == {(t, c) for t in ("tokenbus-http", *peers, "direct") for c in (1, 3)}
    for lv in levels.values():
        assert lv["errors"] == 0 and lv["output_tokens"] == 6 * lv["requests"]
    # Its own processes (and the load generator's, reported apart), none of tokenbus': the
    # tunnel's nats-server and back process count as its own.
    assert set(levels[("pyrelay", 3)]["cpu_percent"]) == {"pyrelay", "bench-client"}
    tunnel = {"busrelay", "busrelay-nats", "busrelay-back", "bench-client"}
    assert set(levels[("busrelay", 3)]["cpu_percent"]) == tunnel
    assert not tunnel & set(levels[("tokenbus-http", 3)]["cpu_percent"]) - {"bench-client"}
    assert {(c["target"], c["concurrency"]) for c in report["comparison"]} == {
        (t, c) for t in ("tokenbus-http", *peers) for c in (1, 3)
    }
    bad = run_cli("bench", "--spawn", "--peer", "nosuch", env=cli_env(), timeout=60)
    assert bad.returncode != 0
    assert "known peers are vllm-router, litellm, pyrelay, busrelay" in bad.stderr


@pytest.mark.stack
def test_bench_prompt_sizes_beside_a_peer_in_interleaved_rounds(tmp_path: Path) -> None:
    # The prompt-size axis with a peer in front of the same engine server, each size's
    # requests sent in two rounds that run every target in turn: one level per target and
    # size over both rounds, and a comparison row per size for tokenbus and for the peer.
    out = tmp_path / "sizes.json"
    r = run_cli(
        *("bench", "--spawn", "--upstream", "--peer", "pyrelay", "--prompt-bytes", "1000,700000"),
        *("--concurrency", "1", "--requests-per-client", "3", "--rounds", "2"),
        *("--max-tokens", "4", "--sim-prefill-ms", "1", "--sim-decode-ms", "1"),
        *("--out", str(out)),
        env=cli_env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    levels = {(lv["target"], lv["prompt_bytes"]): lv for lv in report["levels"]}
    sizes = (1000, 700000)
    assert set(levels) == {(t, b) for t in ("tokenbus-http", "pyrelay", "direct") for b in sizes}
    for lv in levels.values():
        assert lv["rounds"] == 2 and len(lv["windows_ns"]) == 2
        assert lv["errors"] == 0 and lv["requests"] == 3 and lv["output_tokens"] == 12
        assert "_raw" not in lv
    assert "bridge-0" in levels[("tokenbus-http", 700000)]["peak_rss_mb"]
    assert levels[("tokenbus-http", 700000)]["gateway_ms"].get("p50") is not None
    rows = {(c["target"], c["prompt_bytes"]) for c in report["comparison"]}
    assert rows == {(t, b) for t in ("tokenbus-http", "pyrelay") for b in sizes}


@pytest.mark.stack
def test_bench_against_nothing_reports_errors_not_a_crash(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    r = run_cli(
        "bench",
        "--url",
        f"http://127.0.0.1:{free_port()}/v1",
        "--concurrency",
        "2",
        "--requests-per-client",
        "1",
        "--out",
        str(out),
        env=cli_env(),
        timeout=120,
    )
    assert r.returncode == 1
    lv = json.loads(out.read_text())["levels"][0]
    assert lv["errors"] == 2 and lv["error_kinds"]


@pytest.mark.stack
def test_bench_prompts_from_a_file_sampled_lengths_split_and_run_folder(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "first"}\n{"messages": [{"role": "user", "content": "second"}]}\nthird\n'
    )
    out = tmp_path / "run.json"
    args = ["bench", "--spawn", "--no-direct", "--sim-prefill-ms", "2", "--sim-decode-ms", "1"]
    r = run_cli(
        *args,
        "--concurrency", "1,3",
        "--requests-per-client", "3",
        "--prompts", str(prompts),
        "--max-tokens", "8",
        "--max-tokens-std", "3",
        "--out", str(out),
        env=cli_env(),
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    levels = json.loads(out.read_text())["levels"]
    assert [lv["target"] for lv in levels] == ["tokenbus-http"] * 2
    # Sampled output lengths: not every request asked for 8 tokens.
    assert any(lv["output_tokens"] != 8 * lv["requests"] for lv in levels)
    # The gateway / engine split of each level, from the telemetry records.
    assert all(lv["gateway_ms"].get("p50") is not None for lv in levels)
    assert all(lv["engine_ms"]["p50"] > 0 for lv in levels)
    # ... and hop by hop, in time order, from the bridge receiving the request to sending the
    # first token (the engine's own span is the 2 ms prefill).
    for lv in levels:
        hops = lv["path_ms"]
        assert hops["engine_start->first_token"] >= 2.0
        assert "first_token->t4" in hops and "t4->t5" in hops
        assert next(iter(hops)).startswith("t1->")
    run = tmp_path / "run"
    assert "| tokenbus-http | 3 | 9 | 0 |" in (run / "table.md").read_text()
    assert (run / "latency.png").exists() and (run / "throughput.png").exists()
    # Expert Router's methodology: multi-turn sessions with history.
    out2 = tmp_path / "sessions.json"
    r = run_cli(
        *args,
        "--sessions", "4", "--turns", "3", "--bucket", "1", "--max-tokens", "6",
        "--prompt-words", "20:5", "--out", str(out2),
        env=cli_env(),
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (sess,) = json.loads(out2.read_text())["sessions"]
    assert sess["sessions_completed"] == 4 and sess["requests"] == 12 and sess["errors"] == 0
    assert sess["response_ms"]["p99"] >= sess["response_ms"]["p50"] > 0
    assert sum(sess["tokens_per_bucket"]) == 12 * 6 and sess["sessions_per_s"] > 0


@pytest.mark.stack
def test_bench_rejects_a_bad_prompts_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    r = run_cli(
        "bench", "--url", "http://127.0.0.1:1/v1", "--prompts", str(bad),
        "--concurrency", "1", "--requests-per-client", "1", env=cli_env(), timeout=60,
    )  # fmt: skip
    assert r.returncode != 0 and "needs" in (r.stdout + r.stderr)


@pytest.mark.stack
def test_a_routing_trace_reports_each_request_and_the_slowest_ones(tmp_path: Path) -> None:
    """``--routing-trace`` end to end on its own stack (four sim replicas with prefix caches):
    every request of the trace answered, its row (``--trace-detail``) naming the replica that
    served it and the engine's prompt and cached tokens, a session's later turns read from
    cache where its earlier turns were, and the slowest 1 % summarised."""
    report = _bench(
        tmp_path,
        *("--routing-trace", "6", "--trace-sessions-per-s", "20", "--seed", "3"),
        *("--trace-policies", "kv_aware", "--trace-detail"),
    )
    (run,) = report["runs"]
    rows = run["detail"]
    turns = sum(len(s["turns"]) for s in _sessions(report))
    assert run["errors"] == 0 and run["requests"] == len(rows) == turns
    replicas = set(run["replicas"])
    assert replicas == {f"bench-{i}" for i in range(4)}
    # Each replica's own requests and their TTFT.
    assert sum(r["requests"] for r in run["replicas"].values()) == len(rows)
    for name, r in run["replicas"].items():
        mine = sorted(row["ttft_ms"] for row in rows if row["replica"] == name)
        assert r["requests"] == len(mine)
        if mine:
            assert mine[0] - 0.1 <= r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= mine[-1] + 0.1
    for row in rows:
        assert row["ok"] and row["replica"] in replicas, row
        assert 0 <= row["cached"] < row["prompt"] and row["ttft_ms"] > 0, row
    # A session's next turn carries the earlier ones: kv_aware sends it where they are
    # cached, and the engine says so.
    later = [row for row in rows if row["turn"] > 0]
    assert later and all(row["cached"] > 0 for row in later), later
    assert run["predicted_over_reported_cached"] == 1.0
    tail = run["tail"]
    assert 1 <= tail["requests"] <= len(rows)
    assert sum(tail["replicas"].values()) == tail["requests"]
    assert set(tail["replicas"]) <= replicas and tail["prompt_tokens_p50"] > 0
    assert 0 <= tail["first_turn_share"] <= 1
    # What the placement cost: the prompt tokens computed, the sessions moved.
    assert run["computed_tokens"] == sum(row["prompt"] - row["cached"] for row in rows)
    assert 0 <= run["session_moves"] <= len(later)
    pooled = run["pooled_ttft_ms"]  # {} until every replica has announced its speed
    assert not pooled or 0 < pooled["p50"] <= pooled["p99"]


def _bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    """The JSON report of ``tokenbus bench ARGS``, run to success."""
    out = tmp_path / "bench.json"
    r = run_cli("bench", *args, "--out", str(out), env=cli_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def _sessions(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The sessions of the trace a report replayed (generated again from its header)."""
    from tokenbus.evaluation import trace as T

    c = report["config"]
    shape = T.TraceShape(
        sessions=c["routing_trace"], seed=c["seed"], sessions_per_s=c["trace_sessions_per_s"]
    )
    return [{"turns": s.turns} for s in T.generate(shape)[1]]
