"""hsgd.train"""
