"""`prism-megatron config`: the resolved config that train (or, given `-- SCRIPT ARGS`, capture)
would run; `--keys`: every key with its doc."""

from __future__ import annotations

from dataclasses import fields

from prism_megatron.commands import add_config_arguments
from prism_megatron.config import to_yaml
from prism_megatron.config.flags import _SECTIONS, field_docs
from prism_megatron.config.job import config_file as _config_file


def add_arguments(cmd) -> None:
    add_config_arguments(cmd)
    cmd.add_argument("--keys", action="store_true", help="list every key with its doc")


def run(args) -> int:
    if args.keys:
        for section, cls in _SECTIONS.items():
            docs = field_docs(cls)
            for f in fields(cls):
                print(f"{section}.{f.name} = {getattr(cls(), f.name)!r}\n    {docs.get(f.name, '')}")
        return 0
    from prism_megatron.config.job import job_config

    # what `train` (the default config file) or a command given `-- SCRIPT ARGS` would run
    config_file = args.config if args.script else _config_file(args.config)
    print(to_yaml(job_config(args.overrides, config_file, args.script)), end="")
    return 0
