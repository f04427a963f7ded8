"""vLLM serving: the ladder model for vLLM (`model`), the plugin that registers it (`plugin`) and
`ladder serve` (`server`). Importable only where vLLM is installed (`make serve-env`)."""
