"""The streamed conversion pipeline: open the source, plan the calibration, then block by block
calibrate, compensate, factorize, reconstruct, round and spool; then assemble the checkpoint.

run             the stages in order (convert_checkpoint), and the in-memory conversion they share
streaming       the source read lazily: a meta skeleton, each layer's weight read just before it is decomposed
sequential      calibration block by block, as the conversion reaches each block
compensating    the same, each layer fit to the inputs the compressed layers before it produce
reconstruction  each compensated block's factors tuned to reproduce the dense block's outputs
spool           converted layers written out as they are made; the checkpoint assembled from them

Stages import only the stages listed below them and the transformers integration (``hf/``); none
imports ``run``.
"""
