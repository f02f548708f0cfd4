"""hsgd.core"""
