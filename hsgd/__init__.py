"""hsgd: fault-tolerant hierarchical SGD. This package never imports ray (see ARCHITECTURE.md)."""
