"""The tensor-parallel runtime: one rank's shard of a Llama or ladder model (`shard`) and the
processes, weight loading and collectives that run it (`runtime`)."""
