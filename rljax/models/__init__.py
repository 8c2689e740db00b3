"""rljax.models"""
