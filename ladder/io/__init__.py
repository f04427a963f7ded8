"""Files in and out: safetensors tensors (`tensors`), file-system copy and direct I/O (`fs`), atomic
outputs and hashes (`files`), model loading (`loading`), model cards (`model_card`) and the data
folder's manifest and fetch (`data_fetch`)."""
