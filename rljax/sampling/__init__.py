"""rljax.sampling"""
