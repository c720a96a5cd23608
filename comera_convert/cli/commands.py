"""Subcommands of `comera` (registered on import)."""
