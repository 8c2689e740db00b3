"""rljax.sharding"""
