"""Files in and out: safetensors headers, slices and shards (`tensors`), atomic outputs and hashes
(`files`), where a command may write (`outputs`), model loading (`loading`), model cards
(`model_card`), the data folder's manifest and fetch (`data_fetch`), bounded YAML (`yaml_files`) and
the checks of a checkpoint's tokenizer files (`tokenizer_files`)."""
