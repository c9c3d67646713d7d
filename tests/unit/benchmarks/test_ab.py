"""benchmarks/ab.py: reading engine_vs_stack.py's and capacity.py's printed output, the tables, and a
whole A/B over two commits of a small repository whose scripts print captured output."""

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import ab

# engine_vs_stack.py's stdout as printed (the migration log lines come first on stdout too).
ENGINE_VS_STACK_OUTPUT = """\
2026-11-27 10:55:18 [info     ] database_created               database=axon_bench_e3b4796862
2026-11-27 10:55:18 [info     ] migration_applied              version=0001_initial

sim engine, 64 streams x 3 requests of 128 tokens, arrival steady (stream k starts at k x 41 ms); 2 CPUs
path           requests errors  tokens  TTFT p50 ms  TTFT p99 ms  ITL p50 ms  ITL p99 ms  output tok/s
direct engine       192      0   24576         50.2         51.2       20.01       21.96        2376.5
full stack          192      0   24576         57.8         73.3       20.04       26.22        2369.3
stack/direct output tok/s = 0.997 (target >= 0.97: ok)
TTFT added: p50 +7.6 ms (target <= 5: MISSED), p99 +22.1 ms (target <= 25: ok)
ITL added: p50 -0.02 ms (target <= 1: ok)
CPU ms per generated token: direct engine 0.0213; full stack: gateway 0.0301, sessions 0.0512, worker 0.0405, the three services 0.1218 (target <= 0.06: MISSED); beside them engine processes 0.0000, redis 0.0110, rabbitmq 0.0002, postgres 0.0001, client 0.0150
"""  # noqa: E501

# capacity.py's stdout with both workloads; in the second no level was clean.
CAPACITY_OUTPUT = """\
2026-11-27 10:55:29 [info     ] database_created               database=axon_bench_90a383ae56

requests: 16-token answers, streamed
 streams    req/s     tok/s  errors  TTFT p50  TTFT p99  E2E p50  E2E p99   CPU s per 1,000 tokens:  gateway sessions   worker    redis rabbitmq postgres   client   total
      32    568.3      9093       0      48.4     106.8     49.1    107.0                             0.027    0.051    0.035    0.011    0.028    0.002    0.056   0.209
      64    586.1      9378       0     101.5     283.2    101.6    284.2                             0.024    0.047    0.033    0.009    0.023    0.002    0.055   0.194
capacity with zero errors: 586.1 req/s (64 streams), 9378 output tok/s (64 streams)
CPU ms per request at that level: gateway 0.39, sessions 0.76, worker 0.53, redis 0.15, rabbitmq 0.36, postgres 0.03, client 0.88, total 3.10

tokens: 1024-token answers, streamed
 streams    req/s     tok/s  errors  TTFT p50  TTFT p99  E2E p50  E2E p99   CPU s per 1,000 tokens:  gateway sessions   worker    redis rabbitmq postgres   client   total
      64    151.6    155219       3      79.8     131.8     91.7    147.8                             0.002    0.004    0.006    0.001    0.002    0.000    0.028   0.042
         error x3: HTTP 503: overloaded
no level ran without errors
"""  # noqa: E501


def test_engine_vs_stack_figures_are_read_from_its_report() -> None:
    figures = ab.parse_engine_vs_stack(ENGINE_VS_STACK_OUTPUT)
    assert figures["ratio"] == 0.997
    assert figures["ttft_added_p50_ms"] == 7.6
    assert figures["ttft_added_p99_ms"] == 22.1
    assert figures["itl_added_p50_ms"] == -0.02
    assert figures["stack_tok_s"] == 2369.3
    assert figures["direct_tok_s"] == 2376.5
    assert figures["stack_ttft_p99_ms"] == 73.3
    assert figures["stack_errors"] == figures["direct_errors"] == 0
    assert figures["cpu_ms_per_token.services"] == 0.1218
    assert figures["cpu_ms_per_token.gateway"] == 0.0301
    assert figures["cpu_ms_per_token.sessions"] == 0.0512
    assert figures["cpu_ms_per_token.worker"] == 0.0405
    assert figures["cpu_ms_per_token.direct_engine"] == 0.0213
    assert figures["cpu_ms_per_token.engine_processes"] == 0.0
    assert figures["cpu_ms_per_token.redis"] == 0.0110
    assert figures["cpu_ms_per_token.client"] == 0.0150


def test_engine_vs_stack_before_the_cpu_line_has_the_other_figures() -> None:
    text = "\n".join(line for line in ENGINE_VS_STACK_OUTPUT.splitlines() if not line.startswith("CPU ms"))
    figures = ab.parse_engine_vs_stack(text)
    assert figures["ratio"] == 0.997
    assert not any(key.startswith("cpu_ms_per_token") for key in figures)


def test_engine_vs_stack_reads_nan_and_refuses_output_without_a_report() -> None:
    text = ENGINE_VS_STACK_OUTPUT.replace("= 0.997", "= nan")
    assert math.isnan(ab.parse_engine_vs_stack(text)["ratio"])
    with pytest.raises(ab.ParseError, match="ratio"):
        ab.parse_engine_vs_stack("one answer takes 2.61 s; measuring the engine in-process...\n")


def test_capacity_figures_per_workload() -> None:
    figures = ab.parse_capacity(CAPACITY_OUTPUT)
    assert figures["requests.rps"] == 586.1
    assert figures["requests.tps"] == 9378
    assert figures["requests.cpu_ms"] == 3.10
    assert figures["requests.cpu_ms.gateway"] == 0.39
    assert figures["requests.cpu_ms.sessions"] == 0.76
    assert figures["requests.cpu_ms.worker"] == 0.53
    assert figures["requests.cpu_ms.client"] == 0.88
    # No clean level: the workload is known, its figures are not.
    assert "tokens.rps" not in figures and "tokens.cpu_ms" not in figures
    assert ab.capacity_workloads(figures) == [("requests", 16), ("tokens", 1024)]
    with pytest.raises(ab.ParseError):
        ab.parse_capacity("stack ready\n")


def test_a_table_gives_rounds_mean_min_max_and_head_against_base() -> None:
    figures = [ab.Figure("x", "throughput", 1), ab.Figure("d", "TTFT added", 1, difference=True)]
    runs = [
        ab.Run("base", 1, 0.5, figures={"x": 100.0, "d": 4.0}),
        ab.Run("head", 1, 0.7, figures={"x": 90.0, "d": 5.0}),
        ab.Run("head", 2, 1.5, figures={"x": 110.0, "d": 6.0}),
        ab.Run("base", 2, 1.0, figures={}, problem="exit status 1"),
    ]
    lines = ab.render_table("bench.py --fast", figures, runs, ["base", "head"])
    assert lines[0] == "bench.py --fast"
    assert lines[1].split() == ["round", "1", "round", "2", "mean", "min", "max", "head", "vs", "base"]
    assert lines[2].split() == ["throughput", "base", "100.0", "-", "100.0", "100.0", "100.0"]
    assert lines[3].split() == ["head", "90.0", "110.0", "100.0", "90.0", "110.0", "1.000"]
    assert lines[4].split() == ["TTFT", "added", "base", "+4.0", "-", "+4.0", "+4.0", "+4.0"]
    assert lines[5].split() == ["head", "+5.0", "+6.0", "+5.5", "+5.0", "+6.0", "+1.5"]
    assert lines[6].split() == ["load", "average", "before", "the", "run", "base", "0.50", "1.00"]
    assert lines[7].split() == ["head", "0.70", "1.50"]


def test_rounds_alternate_which_tree_goes_first() -> None:
    trees = [ab.Tree("base", "b", "1" * 40, "", "", Path()), ab.Tree("head", "h", "2" * 40, "", "", Path())]
    assert [t.label for t in ab.order(1, trees)] == ["base", "head"]
    assert [t.label for t in ab.order(2, trees)] == ["head", "base"]


def _script(output: str) -> str:
    """A stand-in benchmark that prints `output` and checks it runs from its own tree."""
    return textwrap.dedent(f"""\
        import os, sys
        from pathlib import Path
        tree = Path(__file__).resolve().parent.parent
        assert Path(os.getcwd()).resolve() == tree and os.environ["PYTHONPATH"] == str(tree), "not in its tree"
        assert sys.argv[1:] == ["--fast"], sys.argv
        print({output!r})
    """)


def _commit(repo: Path, evs_output: str, capacity_output: str | None, message: str) -> str:
    (repo / "benchmarks").mkdir(exist_ok=True)
    (repo / "benchmarks" / "engine_vs_stack.py").write_text(_script(evs_output))
    capacity = repo / "benchmarks" / "capacity.py"
    if capacity_output is None:
        capacity.unlink(missing_ok=True)
    else:
        capacity.write_text(_script(capacity_output))
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "commit.gpgsign=false", "commit", "-qm", message], check=True)
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_whole_ab_runs_each_commits_own_scripts_and_removes_its_worktrees(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo), "config", "user.email", "ab@example.com"], check=True)
    subprocess.run(["git", "-C", str(repo), "config", "user.name", "ab"], check=True)
    # The base has no capacity.py yet; the head's engine_vs_stack adds more to TTFT.
    base = _commit(repo, ENGINE_VS_STACK_OUTPUT, None, "base commit")
    head = _commit(repo, ENGINE_VS_STACK_OUTPUT.replace("p50 +7.6 ms", "p50 +8.1 ms"), CAPACITY_OUTPUT, "head commit")
    argv = [
        base[:7],
        head[:7],
        "--repo",
        str(repo),
        "--rounds",
        "2",
        "--python",
        sys.executable,
        "--engine-vs-stack-args=--fast",
        "--capacity-args=--fast",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    assert ab.main(argv) == 1  # the base's capacity runs have no figures
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0] == ".venv/bin/python benchmarks/ab.py " + " ".join(argv)
    assert lines[2].startswith(f"base {base[:10]} (") and lines[2].endswith("base commit")
    assert lines[3].startswith(f"head {head[:10]} (") and lines[3].endswith("head commit")
    ttft = lines.index(next(line for line in lines if line.startswith("TTFT added p50 (ms)")))
    assert lines[ttft].split()[-5:] == ["+7.6", "+7.6", "+7.6", "+7.6", "+7.6"]
    assert lines[ttft + 1].split()[-6:] == ["+8.1", "+8.1", "+8.1", "+8.1", "+8.1", "+0.5"]
    assert "engine_vs_stack.py --fast" in lines and "capacity.py --fast" in lines
    rps = next(line for line in lines if line.startswith("requests (16 tokens): req/s"))
    assert rps.split()[-5:] == ["-", "-", "-", "-", "-"]
    assert f"  round 1 base capacity: {base[:7]} has no benchmarks/capacity.py" in lines
    assert len(list((tmp_path / "out").glob("round*-*.txt"))) == 6
    worktrees = subprocess.run(
        ["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert worktrees.count("\n") == 1  # only the repository's own


def test_one_commit_against_itself_with_each_trees_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo), "config", "user.email", "ab@example.com"], check=True)
    subprocess.run(["git", "-C", str(repo), "config", "user.name", "ab"], check=True)
    # A stand-in engine_vs_stack.py whose TTFT added is the value of AB_TTFT in its environment.
    printing = ENGINE_VS_STACK_OUTPUT.replace("p50 +7.6 ms", "p50 +{ttft} ms")
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "engine_vs_stack.py").write_text(
        f"import os\nprint({printing!r}.format(ttft=os.environ['AB_TTFT']))\n"
    )
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "commit.gpgsign=false", "commit", "-qm", "one"], check=True)
    argv = ["HEAD", "HEAD", "--repo", str(repo), "--rounds", "1", "--benchmarks", "engine_vs_stack"]
    argv += ["--base-env", "AB_TTFT=1.0", "--head-env", "AB_TTFT=3.5 UNUSED='a b'", "--output-dir", str(tmp_path / "o")]
    assert ab.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    ttft = lines.index(next(line for line in lines if line.startswith("TTFT added p50 (ms)")))
    assert lines[ttft].split()[-4:] == ["+1.0", "+1.0", "+1.0", "+1.0"]
    assert lines[ttft + 1].split()[-5:] == ["+3.5", "+3.5", "+3.5", "+3.5", "+2.5"]
    with pytest.raises(SystemExit):
        ab.main(["HEAD", "HEAD", "--repo", str(repo), "--head-env", "NOT_AN_ASSIGNMENT"])


def test_waiting_for_a_quiet_machine_is_bounded() -> None:
    assert ab.wait_for_quiet(1e9, 10.0) < 1.0  # quiet enough at once
    assert 0.05 <= ab.wait_for_quiet(-1.0, 0.05, poll_s=0.01) < 1.0  # never quiet: gives up in time
