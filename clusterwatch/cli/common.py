"""What every subcommand shares: settings flags, config loading, logging, signals."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from clusterwatch import config
from clusterwatch.client import ClusterClient, connect

T = TypeVar("T")

LOG_LEVEL_ENV = "CLUSTERWATCH_LOG_LEVEL"
_FLAG_PREFIX = "setting__"


def add_settings_flags(parser: argparse.ArgumentParser, cls: type, only: type | None = None) -> None:
    """One flag per field of a settings dataclass (of its base class ``only`` alone, when given);
    values are parsed by config.load."""
    section = config.SECTIONS[cls]
    group = parser.add_argument_group(
        f"settings ([{section}] in the config file, or CLUSTERWATCH_{section.upper()}_*)"
    )
    for field in config.fields_of(only or cls):
        factory: Any = field.default_factory
        default = factory() if field.default is dataclasses.MISSING else field.default
        shown = ",".join(default) if isinstance(default, list) else default
        # A switch (--insecure / --no-insecure) for a bool, a value for the rest; its choices
        # listed where it has some (argparse does not check them: config.load does, naming the key).
        choices = field.metadata.get("choices")
        metavar = "{" + ",".join(choices) + "}" if choices else field.name.upper()
        switch: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction} if isinstance(default, bool) else {"metavar": metavar}
        )
        flag = config.flag_name(field)
        old_flags = field.metadata.get("old_flags", ())
        dest = _FLAG_PREFIX + field.name
        group.add_argument(
            flag,
            dest=dest,
            default=argparse.SUPPRESS,
            **switch,
            help=f"{field.metadata['help']} ({f'default {shown}; ' if shown != '' else ''}"
            f"env {config.env_name(section, field.name)}"
            f"{'; formerly ' + ', '.join(old_flags) if old_flags else ''})",
        )
        for old in old_flags:
            add_old_flag(group, old, flag, dest=dest, default=argparse.SUPPRESS)


class _OldFlag(argparse.Action):
    """A flag's former spelling: sets what the new one sets, and says which that is on stderr."""

    def __init__(self, option_strings: list[str], dest: str, new_flag: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"clusterwatch: {option_string} is now {self.new_flag} (the old name still works)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_old_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str, **kwargs: Any
) -> None:
    """Keep ``old`` working as ``new`` (same dest, type and default), hidden from --help."""
    parser.add_argument(old, action=_OldFlag, new_flag=new, help=argparse.SUPPRESS, **kwargs)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"TOML config file (default: ${config.CONFIG_PATH_ENV} or {config.DEFAULT_CONFIG_PATH} if present)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get(LOG_LEVEL_ENV, "info"),
        choices=("debug", "info", "warning", "error"),
        help=f"log verbosity (env {LOG_LEVEL_ENV})",
    )


def settings_from_args(args: argparse.Namespace, cls: type[T]) -> T:
    """Settings of ``cls`` with precedence flag > env > file > default.

    Raises:
        ConfigError: naming the first bad key.
    """
    flags = {k.removeprefix(_FLAG_PREFIX): v for k, v in vars(args).items() if k.startswith(_FLAG_PREFIX)}
    tables, file_name = config.read_config_file(args.config, os.environ)
    return config.load(cls, file_tables=tables, file_name=file_name, flags=flags)


def with_client(args: argparse.Namespace, use: Callable[[ClusterClient], T]) -> T | None:
    """``use(client)`` on a client of the configured coordinator; None (and one line on
    stderr naming the coordinator and the status) when the call failed."""
    settings = settings_from_args(args, config.ClientSettings)
    try:
        with connect(settings) as client:
            return use(client)
    except grpc.RpcError as exc:
        print(f"clusterwatch: {settings.coordinator}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return None


def api_json(message: Message) -> dict[str, Any]:
    """An API message as ``--json`` prints it: proto field names, zeros and empty lists printed
    (GPU 0 is a GPU), unset optional fields left out, 64-bit integers as numbers."""
    return MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[Any]]) -> None:
    """Run ``main(stop)`` on a new event loop; SIGINT and SIGTERM set ``stop``."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())
