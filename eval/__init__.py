"""eval/: score ladder models against their originals with lm-evaluation-harness (`ladder eval`)."""
