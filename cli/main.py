"""The `pdserve` command: the offline engine (`generate`), a local cluster (`up`), one component each
(`router`, `prefill`, `decode`, `single`), the serving benchmark (`bench`) and the planner (`plan`).

Every command's options are generated from its settings model (shared/cli/settings.py): each can come from the
flag, a PDSERVE_* variable or the --config file, and is validated once into the frozen configs. Components
run in this process (no re-exec); nothing heavy is imported before a command runs, so `--help` is fast. A
bad value ends the command with one line on stderr (`pdserve: error: ...`) and a non-zero exit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import click
from pdserve.shared.cli.default_model import default_model_path

if TYPE_CHECKING:
    from pdserve.cli.bench_options import BenchOptions
    from pdserve.cli.plan_options import PlanOptions
    from pdserve.cli.up_options import UpOptions
    from pdserve.node.node_cli import NodeOptions
    from pdserve.shared.cli.engine_args import GenerateOptions
    from pdserve.shared.cli.settings import Settings
    from pdserve.shared.types import Role

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def _command(name: str, cls: type[Settings], run: Callable[[Any], int]) -> click.Command:
    """`pdserve <name>`, whose options are `cls`'s fields; `run` gets the validated settings."""
    from pdserve.shared.cli.settings import click_options, settings_from_click

    @click.command(name, help=_COMMANDS[name], context_settings=_CONTEXT)
    @click_options(cls)
    @click.pass_context
    def command(ctx: click.Context, **values: Any) -> None:
        ctx.exit(run(settings_from_click(cls, ctx, values)))

    return command


class _LazyGroup(click.Group):
    """Builds a command (importing its settings model: pydantic) only when that command runs or shows its
    help; the group's own --help and --version import click alone."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in _COMMANDS:
            self.add_command(_build(cmd_name))
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, _COMMANDS[name]) for name in self.list_commands(ctx)])


@click.group(cls=_LazyGroup, context_settings=_CONTEXT)
@click.version_option(None, "-V", "--version", package_name="pdserve", prog_name="pdserve")
def pdserve() -> None:
    """Disaggregated prefill/decode LLM serving. Every option also reads PDSERVE_<OPTION> and --config FILE;
    secrets (PDSERVE_AUTH_TOKEN, PDSERVE_API_KEYS, PDSERVE_REDIS_PASSWORD) come only from the environment
    or the files named by the same variables with _FILE appended."""


def command(name: str) -> click.Command:
    """`pdserve <name>`, built on first use."""
    found = pdserve.get_command(None, name)
    assert found is not None, name
    return found


def _generate(opts: GenerateOptions) -> int:
    from pdserve.shared.cli.settings import SettingsError, check_model_path

    model = check_model_path(opts.model or default_model_path())  # before torch loads

    from pdserve.shared.cli.offline import Prompt, parse_messages, read_prompts_file
    from pdserve.shared.engine.sampling_params import SamplingParams

    sources = [n for n in ("prompt", "messages", "prompts_file") if getattr(opts, n) is not None]
    if len(sources) != 1:
        raise SettingsError("give exactly one of --prompt, --messages, --prompts-file")
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

    import torch  # the request is checked: now the engine's imports
    from pdserve.shared.cli.engine_args import engine_config
    from pdserve.shared.cli.offline import run
    from pdserve.shared.model.loader import ModelLoadError

    if opts.threads:
        torch.set_num_threads(opts.threads)
    config = engine_config(opts.model_copy(update={"model": model}))
    try:
        return run(config, prompts, opts.json_output)
    except ModelLoadError as exc:
        raise ValueError(str(exc)) from exc


def _node(role: Role) -> Callable[[NodeOptions], int]:
    def run(opts: NodeOptions) -> int:
        from pdserve.node.node_cli import node_configs, setup_process

        cfg = node_configs(opts, role)
        setup_process(opts)
        from pdserve.cli.node_roles import setup
        from pdserve.kvtransfer.messages import PROTOCOL_VERSION
        from pdserve.node.node_serve import serve

        return serve(cfg, setup, PROTOCOL_VERSION, opts.log_stats_interval_s)

    return run


def _router(opts: Any) -> int:
    from pdserve.router.__main__ import run

    return run(opts)


def _up(opts: UpOptions) -> int:
    from pdserve.cli.up import run_up
    from pdserve.cli.up_options import up_config
    from pdserve.shared.cli.settings import check_model_path

    return run_up(up_config(opts, check_model_path(opts.model or default_model_path())), os.environ)


_COMMANDS = {
    "bench": "The serving benchmark client, in the conventions of `vllm bench serve`.",
    "plan": "The planner: prefill and decode nodes the load needs, and role changes (--apply).",
    "generate": "Run the engine offline on one prompt (or a file).",
    "up": "A local cluster: Redis, router, prefill and decode nodes.",
    "router": "One router: the OpenAI API in front of the nodes.",
    "prefill": "One prefill node.",
    "decode": "One decode node.",
    "single": "One plain (non-disaggregated) node.",
}
"""The commands built on demand (`_build`), with the help `pdserve --help` lists for them."""


def _build(name: str) -> click.Command:
    if name == "generate":
        from pdserve.shared.cli.engine_args import GenerateOptions

        return _command(name, GenerateOptions, _generate)
    if name == "bench":
        from pdserve.cli.bench_options import BenchOptions

        return _command(name, BenchOptions, _bench)
    if name == "plan":
        from pdserve.cli.plan_options import PlanOptions

        return _command(name, PlanOptions, _plan)
    if name == "up":
        from pdserve.cli.up_options import UpOptions

        return _command(name, UpOptions, _up)
    if name == "router":
        from pdserve.router.__main__ import RouterOptions

        return _command(name, RouterOptions, _router)
    from pdserve.node.node_cli import DecodeOptions, PrefillOptions

    role = cast("Role", name)  # one of the node commands; NodeSettings checks it
    return _command(name, PrefillOptions if name == "prefill" else DecodeOptions, _node(role))


def _plan(opts: PlanOptions) -> int:
    from pdserve.cli.plan import main as plan_main

    return plan_main(opts)


def _bench(opts: BenchOptions) -> int:
    from pdserve.cli.bench import main as bench_main

    return bench_main(opts)


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
    except (ValueError, OSError) as exc:  # a settings module's error: imported only once one is raised
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from pdserve.shared.cli.settings import SettingsError, StartupError

        if not isinstance(exc, SettingsError | StartupError):
            raise
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SettingsError) else 1
    return int(result or 0)
