"""Structured outputs: a request's tokens constrained to a JSON schema, regex, grammar, choice
or structural tag, by a vocabulary bitmask applied before sampling."""
