"""Thin Ray adapters around hsgd: the Supervisor and Replica actors and their placement."""
