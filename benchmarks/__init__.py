"""Benchmarks: each module is a script run from the repository root as `python -m benchmarks.NAME`
(`make bench` runs tp_speed), printing ratios measured in one run against a baseline."""
