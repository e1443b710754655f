"""Fixture handlers named by behaviour, shared by the server tests."""
