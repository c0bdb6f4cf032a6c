"""Benchmarks (plain scripts writing JSON); ``bench.common`` holds what they share."""
