"""`ladder plan` (cli/plan.py): what ladder wiring buys under tensor parallelism, predicted before converting."""
