"""Published Llama shapes the speed benchmarks can build with random weights (on GPU machines);
each benchmark adds its own CPU-sized shapes. Scripts import this from beside them."""

PUBLISHED_SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        vocab_size=49152,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=16,
        vocab_size=128256,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
    ),
    "llama-3.1-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=80,
        vocab_size=128256,
    ),
}
