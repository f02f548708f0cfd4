"""Fakes shared by test modules (a test module never imports helpers from another)."""
