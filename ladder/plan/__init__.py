"""`ladder plan`: predict what ladder wiring buys under tensor parallelism before converting (models.py:
the config a name stands for, and models.tsv, the one table of published shapes; costs.py: FLOPs, bytes
and parameters from a config; speed.py: the roofline, all-reduce and overlap model; calibrate.py: this
machine's figures, measured). The command itself is cli/plan.py."""
