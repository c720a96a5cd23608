"""The transformers integration: compressed checkpoints as transformers reads and writes them.

files             safetensors names and dtypes, the shard index, atomic writes (the lowest module)
compat            every touch of transformers' internals, numbered, one test each (test_compat.py)
config            ComeraConfig, stored as config.json's quantization_config
checkpoint_check  safetensors headers against the records, before loading
integer_storage   integer checkpoints: values and scales written, read into integer buffers, dequantized
carry             the source's non-weight files and folders, carried into the new checkpoint
model_card        the checkpoint's README.md, on top of the source's card
saving            atomic compressed checkpoints, the guard, remote code
quantizer         the registered "comera" quantizer that builds TT modules on load
registration      registers it as transformers' quantizers load (import comera_convert stays light)
loading           from_pretrained, decompress_model
sentence_config   sentence-transformers' modules.json: checked before converting; eval's pooling
export            `comera export`: the graphs' folder in the checkpoint or a weightless copy of it
onnx_export       the compressed graph into onnx/, checked with onnxruntime
onnx_int8         its int8 graph, quantized and named as sentence-transformers quantizes its exports
openvino_export   `comera export --format openvino`: that graph converted by OpenVINO, int8 by NNCF
lora              peft LoRA adapters on TT layers

Nothing here imports the conversion pipeline (``pipeline/``), which builds on it.
"""
