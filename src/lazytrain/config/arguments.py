"""The command line of a job: `[CONFIG.yaml ...] [key=value ...]` and one flag per key, help from the schema."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import fields

from lazytrain.config.docs import default_text, field_docs
from lazytrain.config.load import ALIASES, load_job_config
from lazytrain.config.schema import KEYS, SECTIONS, JobConfig
from lazytrain.config.values import hints


def add_job_arguments(parser: argparse.ArgumentParser, *, skip: Iterable[str] = ()) -> None:
    """`[CONFIG.yaml] [key=value ...]` and one flag per key (`--learning-rate`), plus the older spellings
    (`--lr`); help text from the field docstrings. Flags default to "not given" so a YAML value stands."""
    parser.add_argument("config", nargs="*", metavar="CONFIG.yaml | key=value",
                        help="YAML config files (flat or nested by section), then key=value overrides")
    docs = field_docs()
    spellings: dict[str, list[str]] = {key: [key] for key in KEYS}
    for alias, key in ALIASES.items():
        spellings[key].append(alias)
    skipped = set(skip)
    for name, section in SECTIONS.items():
        group = parser.add_argument_group(f"{name} ({section.__doc__.strip().rstrip('.')})")
        for f in fields(section):
            if f.name in skipped:
                continue
            is_bool = hints(section)[f.name] is bool
            help_text = f"{docs.get(f.name, '')} (default: {default_text(f.name)})".replace("%", "%%")
            for i, spelling in enumerate(spellings[f.name]):  # one dest per spelling: errors name the one typed
                flag = f"--{spelling.replace('_', '-')}"
                group.add_argument(flag, dest=f"job.{flag}", default=argparse.SUPPRESS, metavar="VALUE",
                                   nargs="?" if is_bool else None, const="true" if is_bool else None,
                                   help=help_text if i == 0 else f"same as --{f.name.replace('_', '-')}")
    parser.add_argument("--no-progress", dest="job.--progress", action="store_const", const=False,
                        default=argparse.SUPPRESS, help="no progress bar (progress=false)")


def job_config_from_args(args: argparse.Namespace, notes: list[str] | None = None) -> JobConfig:
    """The JobConfig of a command line parsed with `add_job_arguments` (`notes`: as load_job_config's)."""
    files, words = [], []
    for word in getattr(args, "config", []):
        (words if "=" in word else files).append(word)
    flags = {k.removeprefix("job."): v for k, v in vars(args).items() if k.startswith("job.")}  # {"--lr": "1e-5"}
    return load_job_config(*files, overrides=words, flags=flags, notes=notes)
