"""Fakes and helpers shared by test modules (a test module never imports from another test module)."""
