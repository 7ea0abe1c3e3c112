"""Subcommands of the ``qkv`` command (see ``qkv.cli``)."""
