"""`textgen bench` against a real server: the report adds up."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from textgen.service.bench.command import Report, add_bench_arguments, format_table, run_load

pytestmark = pytest.mark.timeout(120)


def test_bench_report_adds_up(tiny_server):
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(
        [
            "--target",
            tiny_server.target,
            "--concurrency",
            "4",
            "--requests",
            "6",
            "--max-new-tokens",
            "8",
            "--ignore-eos",
        ]
    )
    report = asyncio.run(run_load(args, ["hello", "the quick brown fox", "café 🎉"]))
    assert report.errors == 0
    assert report.requests == 6
    assert report.output_tokens == 6 * 8  # ignore_eos: every stream runs to max_new_tokens
    assert report.output_tokens_per_s > 0
    assert 0 < report.ttft_p50_ms <= report.ttft_p95_ms
    assert 0 < report.itl_p50_ms <= report.itl_p95_ms
    assert "output tokens/s" in format_table(report)


def test_bench_requests_share_no_prefix(tiny_server):
    """Every request of a bench run, the warm-up's included, has a prompt of its own (a
    number in front), so none is served from the prefix cache another one filled: a load
    of one long prompt, repeated, pays every prefill, as the plain loop does."""
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(
        ["--target", tiny_server.target, "--concurrency", "2", "--requests", "4",
         "--max-new-tokens", "2"]
    )  # fmt: skip
    long_prompt = "the quick brown fox jumps over the lazy dog " * 8  # several KV blocks
    before = tiny_server.engine.stats()
    report = asyncio.run(run_load(args, [long_prompt]))
    after = tiny_server.engine.stats()
    assert report.errors == 0 and report.requests == 4
    assert after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens > 6 * 32
    assert after.prefix_cache_hit_tokens == before.prefix_cache_hit_tokens


def test_bench_grammar_run_reports_the_constrained_ratio(tiny_server, tmp_path):
    import json

    from textgen.service.bench.command import run

    grammar = tmp_path / "grammar.json"
    grammar.write_text(json.dumps({"type": "regex", "value": "[a-z ]{8,}"}))
    out = tmp_path / "report.json"
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(
        ["--target", tiny_server.target, "--concurrency", "3", "--max-new-tokens", "8",
         "--ignore-eos", "--grammar", str(grammar), "--rounds", "2", "--json", str(out)]
    )  # fmt: skip
    assert run(args) == 0
    report = json.loads(out.read_text())
    constrained = report["constrained"]
    assert constrained["errors"] == 0 and constrained["output_tokens"] == 3 * 8
    # two rounds, each constrained load over the plain one before it; the median reported
    assert len(constrained["ratios"]) == 2 and all(r > 0 for r in constrained["ratios"])
    assert constrained["over_unconstrained"] == pytest.approx(
        sum(constrained["ratios"]) / 2, abs=1e-3
    )


def test_bench_compares_with_the_core_alone_and_plain_transformers(tiny_server, tmp_path):
    """--core and --baseline alternate with the served load (--rounds), on the same
    model, prompts and dtype; each round's ratio is against the served load just before
    it, and the report gives their medians."""
    import json
    import statistics

    from textgen.service.bench.command import run

    out = tmp_path / "report.json"
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(
        ["--target", tiny_server.target, "--model-id", tiny_server.settings.model_id,
         "--concurrency", "2", "--requests", "3", "--max-new-tokens", "6",
         "--core", "--baseline", "--rounds", "2", "--json", str(out)]
    )  # fmt: skip
    assert run(args) == 0
    report = json.loads(out.read_text())
    core, base = report["core"], report["baseline"]
    assert report["ignore_eos"]  # the loop runs to max_new_tokens, so --baseline's load does
    assert core["dtype"] == base["dtype"] == "float32"  # the served engine's
    assert len(core["rounds"]) == len(base["rounds"]) == 2
    for r in core["rounds"]:
        assert r["output_tokens"] == report["output_tokens"] == 3 * 6
        assert r["decode_step_p50_ms"] > 0
        ratio = r["served_output_tokens_per_s"] / r["output_tokens_per_s"]
        assert r["served_over_core"] == pytest.approx(ratio, rel=1e-2)
        assert r["itl_p50_over_core_step"] == pytest.approx(
            r["served_itl_p50_ms"] / r["decode_step_p50_ms"], rel=1e-2
        )
    for r in base["rounds"]:
        ratio = r["served_output_tokens_per_s"] / r["loop_tokens_per_s"]
        assert r["served_over_loop"] == pytest.approx(ratio, rel=1e-2)
    assert core["served_over_core"] == statistics.median(
        r["served_over_core"] for r in core["rounds"]
    )
    assert base["served_over_loop"] == statistics.median(
        r["served_over_loop"] for r in base["rounds"]
    )
    assert base["naive_generate_tokens_per_s"] > 0
    # the figures beside each ratio are medians too, so the printed table agrees with itself
    for block, keys in (
        (
            core,
            (
                "output_tokens_per_s",
                "decode_step_p50_ms",
                "served_output_tokens_per_s",
                "served_itl_p50_ms",
            ),
        ),
        (base, ("loop_tokens_per_s", "served_output_tokens_per_s")),
    ):
        for key in keys:
            assert block[key] == statistics.median(r[key] for r in block["rounds"]), key
    assert base["served_over_naive"] == pytest.approx(
        base["served_output_tokens_per_s"] / base["naive_generate_tokens_per_s"], rel=1e-2
    )
    rows = [line.split() for line in format_table(Report(**report)).splitlines()]
    assert ["served", "tok/s,", "median", "of", "2", "rounds",
            str(core["served_output_tokens_per_s"])] in rows  # fmt: skip


def test_bench_samples_when_asked_served_and_core_alike(tiny_server, tmp_path):
    """--temperature/--top-p/--top-k/--typical-p make the served requests and the core's
    sequences sample with those parameters, --repetition-penalty penalize, greedy or not;
    --baseline (a plain greedy loop) refuses them."""
    import json

    from textgen.service.bench.baselines import CoreAlone
    from textgen.service.bench.command import _request, run, sampling_options
    from textgen.service.engine.types import SamplingParams

    out = tmp_path / "report.json"
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    flags = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--typical-p", "0.95",
             "--repetition-penalty", "1.2"]  # fmt: skip
    args = parser.parse_args(
        ["--target", tiny_server.target, "--model-id", tiny_server.settings.model_id,
         "--concurrency", "2", "--max-new-tokens", "5", "--ignore-eos", "--core", *flags,
         "--json", str(out)]
    )  # fmt: skip
    sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
                "typical_p": 0.95, "repetition_penalty": 1.2}  # fmt: skip
    assert sampling_options(args) == sampling
    params = _request("hi", 5, True, None, sampling_options(args)).parameters
    assert (params.do_sample, params.top_k) == (True, 20)
    assert (params.temperature, params.top_p, params.typical_p, params.repetition_penalty) == (
        pytest.approx((0.8, 0.9, 0.95, 1.2))
    )
    assert run(args) == 0
    report = json.loads(out.read_text())
    assert report["sampling"] == sampling
    assert report["errors"] == 0 and report["core"]["output_tokens"] == report["output_tokens"]
    assert "do_sample=True, temperature=0.8" in format_table(Report(**report))
    core = CoreAlone.__new__(CoreAlone)  # only its request building, no model load
    core.sampling, core.eos_token_ids, core._requests = sampling, (), 0
    assert core._sequence([1], 5, True).request.sampling == SamplingParams(**sampling)

    penalized = parser.parse_args(["--target", "x:1", "--repetition-penalty", "1.1"])
    assert sampling_options(penalized) == {"repetition_penalty": 1.1}  # greedy, penalized
    greedy_only = parser.parse_args(["--target", tiny_server.target, "--baseline", *flags])
    with pytest.raises(SystemExit, match="greedy loop"):
        run(greedy_only)


@pytest.mark.server
def test_bench_prices_a_server_flag_against_a_second_server(tiny_model_dir, tmp_path):
    """--compare-serve-args starts a second server with the extra flags; loads alternate
    between the two for --rounds rounds, each against the first server's load just before
    it, and the report gives the median ratio."""
    import json
    import statistics

    from textgen.service.bench.command import run

    out = tmp_path / "report.json"
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(
        ["--serve", "--model-id", str(tiny_model_dir),
         "--serve-args=--dtype float32 --max-batch-total-tokens 4096 --max-total-tokens 512",
         "--compare-serve-args=--deterministic", "--concurrency", "2", "--max-new-tokens", "6",
         "--ignore-eos", "--rounds", "2", "--json", str(out)]
    )  # fmt: skip
    assert run(args) == 0
    report = json.loads(out.read_text())
    compared = report["compared"]
    assert compared["serve_args"] == "--deterministic" and compared["errors"] == 0
    assert compared["output_tokens"] == report["output_tokens"] == 2 * 6
    assert len(compared["ratios"]) == 2 and all(r > 0 for r in compared["ratios"])
    assert compared["over_served"] == statistics.median(compared["ratios"])


def test_bench_compare_needs_serve(tiny_server):
    from textgen.service.bench.command import run

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--target", tiny_server.target, "--compare-serve-args=--x"])
    with pytest.raises(SystemExit, match="needs --serve"):
        run(args)


def test_bench_times_an_openai_server(http_server, tmp_path):
    """--openai URL drives any OpenAI-compatible server's streamed /completions (here
    textgen's own, through Envoy): the figures add up as for the gRPC load."""
    import json

    from textgen.service.bench.command import run

    out = tmp_path / "report.json"
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(
        ["--openai", f"{http_server.http_url}/v1", "--concurrency", "3", "--requests", "4",
         "--max-new-tokens", "7", "--ignore-eos", "--json", str(out)]
    )  # fmt: skip
    assert run(args) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["requests"] == 4
    assert report["output_tokens"] == 4 * 7  # the usage chunk's completion_tokens
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p95_ms"]
    assert 0 < report["itl_p50_ms"] <= report["itl_p95_ms"]


def test_bench_openai_refuses_what_needs_grpc(http_server):
    from textgen.service.bench.command import run

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--openai", f"{http_server.http_url}/v1", "--core", "--baseline"])
    with pytest.raises(SystemExit, match="drop --core, --baseline"):
        run(args)


def test_rss_of_a_process_in_mib():
    import os

    from textgen.service.bench.command import _rss_mib

    rss, peak = _rss_mib(os.getpid())
    assert 10 < rss <= peak  # this test process holds torch: tens of MiB at least
    assert _rss_mib(2**22 + 1) == (None, None)  # above Linux's pid_max: no such process


@pytest.mark.server
def test_bench_copy_load_reports_speculation(tiny_model_dir):
    """The copy load on a speculating server: the report counts the proposals the load's
    requests verified and kept."""
    from support.servers import ServerThread, tiny_settings
    from textgen.service.bench.command import load_prompts

    settings = tiny_settings(tiny_model_dir, speculate=3, speculate_adaptive=False)
    server = ServerThread(settings).start()
    try:
        parser = argparse.ArgumentParser()
        add_bench_arguments(parser)
        args = parser.parse_args(
            ["--target", server.target, "--load", "copy", "--concurrency", "2",
             "--requests", "4", "--max-new-tokens", "24", "--ignore-eos"]
        )  # fmt: skip
        before = server.engine.stats()
        report = asyncio.run(run_load(args, load_prompts(None, "copy")))
        after = server.engine.stats()
    finally:
        server.stop()
    assert report.errors == 0 and report.load == "copy"
    spec = report.speculation
    assert spec["proposed"] > 0
    # the warm-up load ran before the counters were read: the load's own share of them
    assert spec["proposed"] <= after.spec_proposed_tokens - before.spec_proposed_tokens
    assert spec["acceptance_ratio"] == round(spec["accepted"] / spec["proposed"], 3)
    assert "speculation: kept / proposed" in format_table(report)
