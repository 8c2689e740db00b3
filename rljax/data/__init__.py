"""rljax.data"""
