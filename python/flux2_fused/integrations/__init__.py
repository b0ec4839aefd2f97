"""Integrations with other libraries (diffusers)."""
