"""Requests processed once, before the engine core sees them (docs/design/architecture-3.md,
section 2): `input.InputProcessor` turns text, chat messages or ids into validated token ids."""
