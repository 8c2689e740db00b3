"""rljax.train"""
