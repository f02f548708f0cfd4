"""hsgd.record"""
