"""Helpers shared by the unit tests of every package (builders of wire types)."""
