"""`rose bench serve`'s plumbing, without servers: the order the servers take turns in, the
clients' loads split into parts, vllm bench serve's per-request record read, the summary and
the table built from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rose.bench import serve
from rose.bench.serve import Load, Samples
from rose.cli import main, parser_for
from rose.coserve.loadgen import RequestResult


def test_the_servers_take_turns_rose_vllm_then_vllm_rose() -> None:
    assert serve.order(3, ("rose", "vllm")) == [(0, "rose"), (0, "vllm"), (1, "vllm"), (1, "rose"),
                                                (2, "rose"), (2, "vllm")]


def test_vllm_bench_serve_gets_every_prompt_once_over_the_parts_each_part_its_own_seed() -> None:
    load = Load(prompts=41, rate=0.4, duration_s=300, load=0.15, rounds=2)
    parts = [load.vllm_bench_args("http://h:1", Path("/m"), part, Path("/r.json")) for part in range(2)]
    assert [int(args[args.index("--num-prompts") + 1]) for args in parts] == [21, 20]
    assert [args[args.index("--seed") + 1] for args in parts] == ["0", "1"]
    assert all("--ignore-eos" in args and "--save-detailed" in args for args in parts)


def test_the_trace_parts_are_consecutive_windows_of_the_whole() -> None:
    whole = Load(prompts=2, rate=0.4, duration_s=240, load=0.15, rounds=1).trace(0)
    halves = [Load(prompts=2, rate=0.4, duration_s=240, load=0.15, rounds=2).trace(part) for part in range(2)]
    assert sum(len(h.arrival_s) for h in halves) == len(whole.arrival_s) > 0
    assert list(halves[0].prompt_tokens) + list(halves[1].prompt_tokens) == list(whole.prompt_tokens)


def test_a_vllm_bench_record_gives_ttft_and_tpot_per_request_and_counts_failures() -> None:
    detailed = {"ttfts": [0.5, 0.7, 0.0], "itls": [[0.1, 0.1, 0.1], [0.2], []],
                "output_lens": [4, 2, 0], "errors": ["", "", "connection reset"]}
    samples = serve.vllm_bench_samples(detailed)
    assert samples.requests == 3 and samples.failed == 1
    assert samples.ttft_s == [0.5, 0.7]
    assert samples.tpot_s == pytest.approx([0.1, 0.2])


def test_loadgen_results_give_the_answered_requests() -> None:
    done = RequestResult(0.0, 10, output_tokens=5, ttft_s=0.2, latency_s=0.6)
    failed = RequestResult(1.0, 10, error="HTTP 500")
    samples = serve.loadgen_samples([done, failed])
    assert (samples.requests, samples.failed, samples.ttft_s) == (2, 1, [0.2])
    assert samples.tpot_s == pytest.approx([0.1])


def _figures(rose_ms: float, vllm_ms: float) -> dict[str, dict[str, dict]]:
    def row(ms: float) -> dict:
        return Samples([ms / 1e3] * 3, [ms / 1e4] * 3, requests=3).figures()
    return {server: {client: row(ms) for client in serve.CLIENTS}
            for server, ms in (("rose", rose_ms), ("vllm", vllm_ms))}


def test_the_summary_says_whether_rose_is_at_or_below_vllm_on_every_figure() -> None:
    ahead = serve.summary_of(_figures(90.0, 100.0), (1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    assert ahead["rose_at_or_below"] is True
    assert ahead["ratio"]["loadgen"]["p99_tpot_ms"] == 0.9
    assert ahead["rose_loadgen"]["p50_ttft_ms"] == 90.0 and ahead["vllm_vllm_bench"]["p99_tpot_ms"] == 10.0
    assert ahead["load_avg_before"] == [1.0, 1.0, 1.0]
    behind = serve.summary_of(_figures(101.0, 100.0), (0, 0, 0), (0, 0, 0))
    assert behind["rose_at_or_below"] is False
    alone = serve.summary_of({"rose": _figures(90.0, 100.0)["rose"]}, (0, 0, 0), (0, 0, 0))
    assert alone["rose_at_or_below"] is False and alone["ratio"]["loadgen"]["p50_ttft_ms"] is None


def test_the_table_has_a_row_per_client_and_server_then_the_ratio() -> None:
    figures = _figures(90.0, 100.0)
    lines = serve.table(figures, serve.ratios(figures)).splitlines()
    assert lines[2] == "| vllm_bench | rose | 90.0 ms | 90.0 ms | 9.0 ms | 9.0 ms |"
    assert lines[4] == "| vllm_bench | rose / vLLM | 0.900 | 0.900 | 0.900 | 0.900 |"
    assert len(lines) == 2 + 2 * 3


def test_the_rose_server_it_starts_takes_the_flags_it_is_given(tmp_path: Path) -> None:
    argv = serve.server_command("rose", tmp_path, 1, "python", tmp_path / "log")(8000)
    serve_args = argv[argv.index("rose.cli") + 1:]
    args = parser_for(serve_args).parse_args(serve_args)
    assert (args.threads, args.no_profile, args.port) == (1, True, 8000)
    assert argv[argv.index("taskset"):argv.index("taskset") + 3] == ["taskset", "-c", "1"]


def test_bad_arguments_are_refused_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "serve", "--servers", "rose,tgi"]) == 2
    assert "--servers 'rose,tgi': expected a comma-separated list of rose, vllm" in capsys.readouterr().err
    assert main(["bench", "serve", "--vllm-python", str(tmp_path / "none")]) == 2
    assert "make install-vllm" in capsys.readouterr().err
