"""rljax.rewards"""
