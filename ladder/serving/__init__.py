"""vLLM serving: the ladder layer loop and its all-reduce ops (`ops`, torch alone), the ladder model
for vLLM (`model`), the plugin that registers it (`plugin`) and `ladder serve` (`server`). All but
`ops` need vLLM (`make serve-env`)."""
