"""Files in and out: safetensors tensors (`tensors`), file-system copy and direct I/O (`fs`), atomic
outputs and hashes (`files`), model loading (`loading`), model cards (`model_card`), the data
folder's manifest and fetch (`data_fetch`), bounded YAML (`yaml_files`) and the checks of a
checkpoint's tokenizer files (`tokenizer_files`)."""
