"""`lazytrain` command line: one subcommand per job, each defined beside the code it drives.

Every subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Bad input raises
`LazyTrainError`, printed here as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import import_module
from typing import Any, NoReturn

from lazytrain.errors import LazyTrainError

SUBCOMMANDS = {
    "plan": ("lazytrain.job.plan_command", "solve the boundary placement for a model, hardware and workload"),
    "train": ("lazytrain.train", "train a model with a plan (default: a small model on an embedded corpus)"),
    "export": ("lazytrain.train.export", "merge a LoRA checkpoint into its base model, or convert a checkpoint, "
                                         "into a Hugging Face model folder"),
}


class _OneLineErrors(argparse.ArgumentParser):
    """Usage errors as one `error:` line and exit 2, like every other bad input (argparse prints usage too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Read "-5GB" as a (negative, then refused) size, not as an unknown flag: argparse's own
        # matcher only knows plain numbers.
        self._negative_number_matcher = re.compile(r"^-\d*\.?\d+(e\d+)?[A-Za-z]*$")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineErrors(prog="lazytrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}",
                                parser_class=_OneLineErrors)
    modules, parsers = {}, {}
    argv = sys.argv[1:] if argv is None else argv
    for name, (module, help_text) in SUBCOMMANDS.items():
        parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        # Import only the chosen subcommand's module (`lazytrain --help` needs none): `lazytrain plan` never pays
        # for importing torch, and `lazytrain train` checks its config before it does.
        if argv[:1] == [name]:
            modules[name] = import_module(module)
            modules[name].add_arguments(parsers[name])
    try:
        if argv[:1] and argv[0] in SUBCOMMANDS:  # CONFIG.yaml and key=value words may stand between flags
            args = parsers[argv[0]].parse_intermixed_args(argv[1:])
            args.command = argv[0]
        else:
            args = parser.parse_args(argv)
        return int(modules[args.command].run(args) or 0)
    except LazyTrainError as err:  # one line per problem (a config reports all of its problems at once)
        print("".join(f"error: {line}\n" for line in str(err).splitlines()), end="", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
