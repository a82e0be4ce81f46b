"""The subcommands' own modules (`prism-megatron NAME`), one per command: cli.py parses the command
line and hands each its arguments. A command sits above every package it orchestrates (capture,
emulation, the replay, the hooks) and below cli.py only (.importlinter)."""
