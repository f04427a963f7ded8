"""The ladder model: the files that travel inside converted checkpoints (`configuration_ladder.py`,
`modeling_ladder.py` and the torch-free `config_rules.py` they import), plus `auto`, which
registers the model with transformers' Auto classes. Importing this package loads nothing heavy."""
