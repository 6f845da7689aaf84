"""text-generation-launcher's translation, without a server: every flag of TGI's launcher
reference is in its table, and each is honoured (the flag, and alone its variable, set
the setting it names), accepted with its reason, or refused with a one-line reason at
startup, before anything loads. tests/integration/test_launcher.py serves with it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import pytest
from textgen.service.settings import tgi_launcher as launcher
from textgen.service.settings.table import Settings
from textgen.service.settings.tgi_launcher import (
    BY_NAME,
    FLAGS,
    Accepted,
    LaunchError,
    Refused,
    Setting,
    launcher_table,
    settings_from,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "data" / "tgi-launcher-flags.md"
LAUNCHER = str(Path(sys.executable).with_name("text-generation-launcher"))

# A value for every honoured flag, and the settings it must give (the flag's own
# setting, plus any other it sets).
SAMPLES: dict[str, tuple[str, dict]] = {
    "--model-id": ("org/name", {"model_id": "org/name"}),
    "--revision": ("refs/pr/2", {"revision": "refs/pr/2"}),
    "--validation-workers": ("3", {"validation_workers": 3}),
    "--sharded": ("false", {"sharded": False}),
    "--num-shard": ("2", {"num_shard": 2}),
    "--quantize": ("int8", {"quantize": "int8"}),
    "--dtype": ("bfloat16", {"dtype": "bfloat16"}),
    "--trust-remote-code": ("true", {"trust_remote_code": True}),
    "--max-concurrent-requests": ("7", {"max_concurrent_requests": 7}),
    "--max-best-of": ("3", {"max_best_of": 3}),
    "--max-stop-sequences": ("5", {"max_stop_sequences": 5}),
    "--max-top-n-tokens": ("6", {"max_top_n_tokens": 6}),
    "--max-input-tokens": ("100", {"max_input_tokens": 100}),
    "--max-input-length": ("101", {"max_input_tokens": 101}),
    "--max-total-tokens": ("200", {"max_total_tokens": 200}),
    "--max-batch-prefill-tokens": ("64", {"max_batch_prefill_tokens": 64}),
    "--max-batch-total-tokens": ("4096", {"max_batch_total_tokens": 4096}),
    "--max-batch-size": ("16", {"max_batch_size": 16}),
    "--cuda-graphs": ("1,2,4,8", {"cuda_graph_sizes": (1, 2, 4, 8), "cuda_graphs": True}),
    "--hostname": ("127.0.0.1", {"hostname": "127.0.0.1"}),
    "--port": ("8081", {"port": 8081}),
    "--prometheus-port": ("9100", {"prometheus_port": 9100}),
    "--master-addr": ("10.0.0.1", {"master_addr": "10.0.0.1"}),
    "--master-port": ("29600", {"master_port": 29600}),
    "--huggingface-hub-cache": ("/data", {"huggingface_hub_cache": "/data"}),
    "--weights-cache-override": ("/weights", {"weights_cache_override": "/weights"}),
    "--disable-custom-kernels": ("true", {"disable_custom_kernels": True}),
    "--cuda-memory-fraction": ("0.5", {"cuda_memory_fraction": 0.5}),
    "--rope-scaling": ("dynamic", {"rope_scaling": "dynamic"}),
    "--rope-factor": ("2.0", {"rope_factor": 2.0}),
    "--json-output": ("true", {"json_output": True}),
    "--otlp-endpoint": ("http://127.0.0.1:4317", {"otlp_endpoint": "http://127.0.0.1:4317"}),
    "--otlp-service-name": ("svc", {"otlp_service_name": "svc"}),
    "--cors-allow-origin": ("http://a.example", {"cors_allow_origin": ("http://a.example",)}),
    "--api-key": ("secret", {"api_key": "secret"}),
    "--tokenizer-config-path": ("/t.json", {"tokenizer_config_path": "/t.json"}),
    "--disable-grammar-support": ("true", {"disable_grammar_support": True}),
    "--max-client-batch-size": ("5", {"max_client_batch_size": 5}),
    "--payload-limit": ("4096", {"payload_limit": 4096}),
    "--enable-prefill-logprobs": ("true", {"prefill_logprobs": True}),
    "--graceful-termination-timeout": ("5", {"graceful_termination_timeout": 5.0}),
    # once pending (refused "not yet"), honoured since their settings were built
    "--speculate": ("3", {"speculate": 3}),
    "--kv-cache-dtype": ("fp8_e4m3fn", {"kv_cache_dtype": "fp8_e4m3fn"}),
    "--watermark-gamma": ("0.25", {"watermark_gamma": 0.25}),
    "--watermark-delta": ("3.0", {"watermark_delta": 3.0}),
    "--lora-adapters": ("a=/x,b=/y", {"lora_adapters": (("a", "/x"), ("b", "/y"))}),
}
# What a refused flag's reason must say.
REFUSED = {
    "--shard-uds-path": ("/tmp/x", "torch.distributed"),
    "--ngrok": ("true", "ngrok"),
    "--ngrok-authtoken": ("tok", "ngrok"),
    "--ngrok-edge": ("edge", "ngrok"),
}
ACCEPTED = {  # flag: (a good value, a bad one)
    "--max-waiting-tokens": ("20", "-1"),
    "--waiting-served-ratio": ("1.2", "x"),
    "--usage-stats": ("no-stack", "maybe"),
    "--env": ("true", None),
}


def reference_flags() -> list[tuple[str, str | None]]:
    """(flag, variable) of each row of TGI's launcher reference."""
    rows = []
    for line in REFERENCE.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) < 2 or not cells[0].startswith("`-"):
            continue
        variables = re.findall(r"[A-Z_]{3,}", cells[1])
        for i, flag in enumerate(re.findall(r"`(--[a-z0-9-]+)`", cells[0])):
            rows.append((flag, variables[i] if i < len(variables) else None))
    return rows


def test_every_flag_of_tgis_reference_is_in_the_table():
    reference = reference_flags()
    assert len(reference) == 52
    for flag, variable in reference:
        assert flag in BY_NAME, f"{flag} is missing from the launcher"
        if variable is not None or flag == "--env":  # the ngrok row names one: NGROK, ...
            assert BY_NAME[flag].variable == variable, flag
    assert {f.name for f in FLAGS} - {f for f, _ in reference} == {
        "--prometheus-port",  # TGI 3's, not in the reference
        "--graceful-termination-timeout",
    }


def test_each_flag_is_sampled_by_what_it_does():
    """The samples below cover every flag once, by its kind."""
    kinds = {
        Setting: set(SAMPLES),
        Refused: set(REFUSED),
        Accepted: set(ACCEPTED),
    }
    for flag in FLAGS:
        assert flag.name in kinds[type(flag.does)], flag.name


def launched(argv=(), env=None) -> Settings:
    return settings_from(list(argv), env or {})


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_an_honoured_flag_sets_its_setting_by_flag_and_by_variable(name):
    flag = BY_NAME[name]
    text, expected = SAMPLES[name]
    argv = [name] if flag.switch else [name, text]
    by_flag = launched(argv)
    by_variable = launched(env={flag.variable: text})
    baseline = launched()
    for field_name, value in expected.items():
        assert getattr(by_flag, field_name) == value, (name, field_name)
        assert getattr(by_variable, field_name) == value, (flag.variable, field_name)
        assert getattr(baseline, field_name) != value, (name, "is the default already")
    changed = {f.name for f in fields(Settings) if getattr(by_flag, f.name) != getattr(
        baseline, f.name)}  # fmt: skip
    assert changed == set(expected), name


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_bad_value_is_refused_with_the_flag_and_the_rule(name):
    flag = BY_NAME[name]
    if flag.switch:
        bad_env = {flag.variable: "maybe"}
        with pytest.raises(LaunchError, match=rf"^{flag.variable}='maybe': use 1/0"):
            launched(env=bad_env)
        return
    bad = {"--model-id": None, "--revision": None, "--api-key": None, "--otlp-service-name": None,
           "--huggingface-hub-cache": None, "--weights-cache-override": None,
           "--tokenizer-config-path": None, "--master-addr": "a b", "--hostname": None,
           "--cors-allow-origin": "not an origin", "--otlp-endpoint": "nowhere",
           "--rope-scaling": "yarn", "--dtype": "int3", "--quantize": "int3",
           "--cuda-graphs": "1,x", "--cuda-memory-fraction": "1.5",
           "--lora-adapters": "a="}.get(name, "-3")  # fmt: skip
    if bad is None:  # free text: any value is a valid name, path or key
        return
    with pytest.raises(LaunchError) as flag_error:
        launched([name, bad])
    assert str(flag_error.value).startswith(f"{name} {bad!r}: "), flag_error.value
    with pytest.raises(LaunchError) as env_error:
        launched(env={flag.variable: bad})
    assert str(env_error.value).startswith(f"{flag.variable}={bad!r}: "), env_error.value


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_flag_stops_the_launcher_with_its_reason(name):
    text, reason = REFUSED[name]
    flag = BY_NAME[name]
    argv = [name] if flag.switch else [name, text]
    with pytest.raises(LaunchError, match=reason) as by_flag:
        launched(argv)
    assert "\n" not in str(by_flag.value)
    with pytest.raises(LaunchError, match=rf"^{flag.variable}=.*{reason}"):
        launched(env={flag.variable: text})


def tgi_quantize_values() -> list[str]:
    """The --quantize values of TGI's launcher reference."""
    for line in REFERENCE.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if cells and cells[0] == "`--quantize`":
            return [v.strip() for v in cells[3].split(";")[0].split(",")]
    raise AssertionError("no --quantize row in the reference")


# The flags once refused as "not yet" (and TGI's pre-quantized --quantize names), each value
# with the setting it must give: (flag, text, setting, value).
FORMERLY_PENDING = [
    ("--speculate", "3", "speculate", 3),
    ("--speculate", "0", "speculate", 0),
    ("--lora-adapters", "a=/x,b=/y", "lora_adapters", (("a", "/x"), ("b", "/y"))),
    ("--lora-adapters", "org/adapter", "lora_adapters", (("org/adapter", "org/adapter"),)),
    ("--kv-cache-dtype", "fp8_e4m3fn", "kv_cache_dtype", "fp8_e4m3fn"),
    ("--kv-cache-dtype", "fp8_e5m2", "kv_cache_dtype", "fp8_e5m2"),
    ("--kv-cache-dtype", "auto", "kv_cache_dtype", None),
    ("--watermark-gamma", "0.25", "watermark_gamma", 0.25),
    ("--watermark-delta", "3.0", "watermark_delta", 3.0),
    ("--watermark-delta", "0", "watermark_delta", 0.0),
    *[("--quantize", method, "quantize", method) for method in tgi_quantize_values()],
]


def test_tgis_quantize_values_are_all_sampled():
    assert sorted(tgi_quantize_values()) == sorted([
        "awq", "compressed-tensors", "eetq", "exl2", "gptq", "marlin", "bitsandbytes",
        "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8",
    ])  # fmt: skip


@pytest.mark.parametrize(("name", "text", "setting", "value"), FORMERLY_PENDING)
def test_a_formerly_pending_flag_sets_its_setting_by_flag_and_by_variable(
    name, text, setting, value
):
    """Honoured by the setting of its name: the flag and, alone, TGI's variable give the
    same value (a pre-quantized format is checked against the checkpoint at startup, by
    preflight, not here)."""
    flag = BY_NAME[name]
    assert isinstance(flag.does, Setting) and flag.does.name == setting, name
    assert getattr(launched([name, text]), setting) == value, (name, text)
    assert getattr(launched(env={flag.variable: text}), setting) == value, (flag.variable, text)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_an_accepted_flag_is_validated_and_changes_no_setting(name, caplog):
    good, bad = ACCEPTED[name]
    flag = BY_NAME[name]
    caplog.set_level("INFO", logger="textgen.launcher")
    assert launched([name] if flag.switch else [name, good]) == launched()
    if name != "--env":
        assert f"{name} {good!r} accepted: " in caplog.text  # the reason, in the log
    if bad is not None:
        with pytest.raises(LaunchError, match=rf"^{name} {bad!r}: "):
            launched([name, bad])
        with pytest.raises(LaunchError, match=rf"^{flag.variable}={bad!r}: "):
            launched(env={flag.variable: bad})


def test_tgis_defaults_where_they_differ_from_serves():
    settings = launched()
    assert (settings.hostname, settings.port, settings.prometheus_port) == ("0.0.0.0", 3000, 9000)
    assert (settings.grpc_hostname, settings.grpc_port) == ("127.0.0.1", 0)
    assert settings.full_context and not settings.prefill_logprobs
    assert settings.cors_allow_origin == ("*",)
    assert settings.otlp_service_name == "text-generation-inference.router"
    serve = Settings()
    assert (serve.hostname, serve.port, serve.prometheus_port) == ("127.0.0.1", 8080, None)
    assert serve.prefill_logprobs and not serve.full_context and serve.cors_allow_origin == ()


def test_the_flag_wins_over_tgis_variable_which_wins_over_textgens():
    env = {"PORT": "81", "TEXTGEN_PORT": "82", "TEXTGEN_DEVICE": "cpu"}
    assert launched(["-p", "80"], env).port == 80
    assert launched(env=env).port == 81
    assert launched(env={"TEXTGEN_PORT": "82"}).port == 82
    assert launched(env=env).device == "cpu"  # textgen's own settings through TEXTGEN_*


def test_repeated_cors_origins_and_a_comma_list_are_one_list():
    argv = ["--cors-allow-origin", "http://a.example", "--cors-allow-origin", "http://b.example"]
    assert launched(argv).cors_allow_origin == ("http://a.example", "http://b.example")
    env = {"CORS_ALLOW_ORIGIN": "http://a.example,http://b.example"}
    assert launched(env=env).cors_allow_origin == ("http://a.example", "http://b.example")


def test_cuda_graphs_zero_turns_them_off():
    settings = launched(["--cuda-graphs", "0"])
    assert settings.cuda_graphs is False and settings.cuda_graph_sizes is None


def test_max_input_length_and_max_input_tokens_together_are_refused():
    with pytest.raises(LaunchError, match="--max-input-length: --max-input-tokens is given too"):
        launched(["--max-input-tokens", "10", "--max-input-length", "10"])
    with pytest.raises(LaunchError, match="given too"):
        launched(env={"MAX_INPUT_TOKENS": "10", "MAX_INPUT_LENGTH": "10"})


def test_a_hostname_that_is_no_address_listens_everywhere_as_tgis_router_does():
    assert launched(env={"HOSTNAME": "a1b2c3d4e5f6"}).hostname == "0.0.0.0"
    assert launched(["--hostname", "::1"]).hostname == "::1"


def test_tgis_other_variables():
    environ = {"HF_API_TOKEN": "hf_x"}
    launcher.tgi_environment(environ)
    assert environ["HF_TOKEN"] == "hf_x"
    kept = {"HF_API_TOKEN": "hf_x", "HF_TOKEN": "hf_y"}
    launcher.tgi_environment(kept)
    assert kept["HF_TOKEN"] == "hf_y"
    assert launcher.log_level({"LOG_LEVEL": "warn"}) == "WARNING"
    assert launcher.log_level({}) == "INFO"
    with pytest.raises(LaunchError, match="LOG_LEVEL='text_generation_router=debug'"):
        launcher.log_level({"LOG_LEVEL": "text_generation_router=debug"})


# SageMaker's environment, as TGI's sagemaker-entrypoint.sh maps it --------------------------

# SageMaker's variable: (a value, the settings it must give, as TGI's variable would)
SAGEMAKER = {
    "HF_MODEL_ID": ("org/name", {"model_id": "org/name"}),
    "HF_MODEL_REVISION": ("refs/pr/2", {"revision": "refs/pr/2"}),
    "SM_NUM_GPUS": ("2", {"num_shard": 2}),
    "HF_MODEL_QUANTIZE": ("int8", {"quantize": "int8"}),
    "HF_MODEL_TRUST_REMOTE_CODE": ("true", {"trust_remote_code": True}),
}


def test_sagemaker_samples_every_variable_of_tgis_entrypoint():
    assert set(SAGEMAKER) == set(launcher.SAGEMAKER_VARIABLES)
    for name, variable in launcher.SAGEMAKER_VARIABLES.items():  # each is TGI's own variable
        assert any(f.variable == variable for f in FLAGS), name


@pytest.mark.parametrize("name", sorted(SAGEMAKER))
def test_a_sagemaker_variable_sets_what_its_tgi_variable_does(name):
    text, expected = SAGEMAKER[name]
    base = {"HF_MODEL_ID": "org/base"}
    by_sagemaker = launched(env={**base, name: text})
    by_tgi = launched(env={"MODEL_ID": "org/base", launcher.SAGEMAKER_VARIABLES[name]: text})
    for field_name, value in expected.items():
        assert getattr(by_sagemaker, field_name) == value, (name, field_name)
    # everything else as TGI's variable gives it, but the port: the entrypoint's 8080
    assert replace(by_tgi, port=8080) == by_sagemaker, name


def test_sagemakers_environment_serves_on_8080_over_port_as_tgis_entrypoint():
    env = {"HF_MODEL_ID": "org/name", "PORT": "80", "TEXTGEN_PORT": "82"}
    settings = launched(env=env)
    assert (settings.model_id, settings.port, settings.hostname) == ("org/name", 8080, "0.0.0.0")
    assert launched(["serve"], env) == settings  # SageMaker runs `docker run IMAGE serve`
    bound = launched(env={**env, "SAGEMAKER_BIND_TO_PORT": "8081"})
    assert bound.port == 8081  # a multi-container endpoint's port, when SageMaker sets one
    assert launched(env={"PORT": "80"}).port == 80  # no SageMaker variable: TGI's launcher
    off = launched(env={"TRUST_REMOTE_CODE": "true", "HF_MODEL_ID": "o/n",
                        "HF_MODEL_TRUST_REMOTE_CODE": "false"})  # fmt: skip
    assert off.trust_remote_code is False


def test_sagemakers_variables_overwrite_tgis_as_the_entrypoints_exports_do(caplog):
    env = {"HF_MODEL_ID": "org/sm", "MODEL_ID": "org/tgi", "SM_NUM_GPUS": "2",
           "NUM_SHARD": "4", "REVISION": "kept"}  # fmt: skip
    with caplog.at_level("WARNING", logger="textgen.launcher"):
        settings = launched(env=env)
    assert (settings.model_id, settings.num_shard) == ("org/sm", 2)
    assert settings.revision == "kept"  # HF_MODEL_REVISION unset: REVISION is left alone
    assert "SM_NUM_GPUS='2' overwrites NUM_SHARD='4'" in caplog.text
    assert "HF_MODEL_ID='org/sm' overwrites MODEL_ID='org/tgi'" in caplog.text
    # empty is unset, as the entrypoint's -n tests say
    assert launched(env={**env, "HF_MODEL_REVISION": "", "SM_NUM_GPUS": ""}).num_shard == 4


def test_sagemakers_mapping_is_idempotent():
    env = {"HF_MODEL_ID": "org/name", "SM_NUM_GPUS": "2", "PORT": "80", "NUM_SHARD": "4"}
    argv, mapped = launcher.sagemaker_entrypoint(["serve", "--max-batch-size", "16"], env)
    assert argv == ["--max-batch-size", "16", "--port", "8080"]
    assert (mapped["MODEL_ID"], mapped["NUM_SHARD"], mapped["PORT"]) == ("org/name", "2", "80")
    assert launcher.sagemaker_entrypoint(argv, mapped) == (argv, mapped)
    assert launcher.sagemaker_entrypoint(["--port", "1"], {"PORT": "2"}) == (
        ["--port", "1"], {"PORT": "2"})  # fmt: skip


def test_a_flag_that_contradicts_sagemakers_environment_is_refused():
    env = {"HF_MODEL_ID": "org/name", "SM_NUM_GPUS": "2", "HF_MODEL_TRUST_REMOTE_CODE": "false"}
    refused = {
        ("--port", "3000"): "--port '3000': SageMaker's environment sets it (--port 8080",
        ("--num-shard", "4"): "--num-shard '4': SageMaker's environment sets it (SM_NUM_GPUS='2'",
        ("--model-id", "x/y"): "--model-id 'x/y': SageMaker's environment sets it (HF_MODEL_ID",
        ("--trust-remote-code",): "--trust-remote-code 'true': SageMaker's environment sets it",
    }
    for argv, words in refused.items():
        with pytest.raises(LaunchError, match=re.escape(words)):
            launched(list(argv), env)
    # the same value, and the flags SageMaker's environment doesn't set, are honoured
    settings = launched(["-p", "8080", "--num-shard", "2", "--max-batch-size", "16"], env)
    assert (settings.port, settings.num_shard, settings.max_batch_size) == (8080, 2, 16)
    assert launched(["--revision", "v2"], env).revision == "v2"


def test_sagemakers_environment_without_hf_model_id_is_refused_as_tgis_entrypoint_does():
    with pytest.raises(LaunchError, match="SM_NUM_GPUS set .*HF_MODEL_ID must be set"):
        launched(env={"SM_NUM_GPUS": "1", "MODEL_ID": "org/name"})


def test_the_docs_name_sagemakers_variables():
    doc = (ROOT / "docs" / "launcher.md").read_text()
    for name, variable in launcher.SAGEMAKER_VARIABLES.items():
        assert f"`{name}`" in doc and f"`{variable}`" in doc, name
    assert "`SAGEMAKER_BIND_TO_PORT`" in doc and "sagemaker-entrypoint.sh" in doc


def test_the_runtime_environment_names_the_versions():
    text = launcher.runtime_environment()
    assert "textgen:" in text and "torch:" in text and "transformers:" in text


def test_the_docs_table_is_the_launchers():
    doc = (ROOT / "docs" / "launcher.md").read_text()
    assert launcher_table() in doc, "docs/launcher.md is stale: python scripts/make_settings_doc.py"
    for flag in FLAGS:
        assert f"`{flag.name}`" in doc


@pytest.mark.server  # runs text-generation-launcher as a subprocess
@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--ngrok"], {}, "--ngrok 'true': textgen opens no ngrok tunnel"),
        ([], {"SHARD_UDS_PATH": "/tmp/x"}, "SHARD_UDS_PATH='/tmp/x': textgen's shards"),
        (["--speculate", "x"], {}, "--speculate 'x': must be a whole number"),
        (["--max-total-tokens", "x"], {}, "--max-total-tokens 'x': must be a whole number"),
        (["serve"], {"SM_NUM_GPUS": "1"}, "SM_NUM_GPUS set (SageMaker's environment): HF_"),
        (["serve", "-p", "3000"], {"HF_MODEL_ID": "org/name"}, "--port '3000': SageMaker's"),
        (["--max-total-tokens", "100000", "--hostname", "127.0.0.1", "--port", "0",
          "--prometheus-port", "0"], {}, "--max-total-tokens 100000: exceeds the model's"),
    ],
)  # fmt: skip
def test_the_command_refuses_in_one_line_and_status_2_before_loading(args, env, words):
    """As a user runs it: one line on stderr, exit 2, in seconds (no model loads; the
    last one is serve's own preflight, reached through the launcher)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), **env}
    started = time.monotonic()
    result = subprocess.run(
        [LAUNCHER, *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert lines == [f"text-generation-launcher: error: {lines[0].split('error: ', 1)[1]}"]
    assert words in lines[0], lines
    assert took < 30, took
