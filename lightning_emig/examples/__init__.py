"""Worked examples: a user's own Lightning scripts, made elastic by the strategy and the launcher."""
