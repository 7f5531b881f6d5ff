"""The `triode` subcommands that take options of their own, one module each: `serve` (with its
engine options, built from `EngineArgs` in `engine_flags`), `proxy` and `replay`. Each module
adds its subparser (`add_parser`) and runs the parsed command (`run`); `triode.edge.cli` holds
the top-level parser and dispatches to them.
"""
