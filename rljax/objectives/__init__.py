"""rljax.objectives"""
