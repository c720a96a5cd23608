"""The streamed conversion pipeline: open the source, plan the calibration, then block by block
calibrate, compensate, factorize, reconstruct, round and spool; then assemble the checkpoint.

run             convert_checkpoint: the checks before anything slow, then the stages
stages/         one file per stage (allocate, read, calibrate, reconstruct, write); STAGES their order
runner          the stages' one lifecycle (prepare, each module, finish), run in order and timed
factorize       the converter's module loop (convert_model), shared with the in-memory conversion
sources         where the weights come from: whole, streamed, or streamed and calibrated block by block
compensating    sequential's calibration, each layer fit to the inputs the compressed layers before it produce
reconstruction  each compensated block's factors tuned to reproduce the dense block's outputs
sequential      calibration block by block, as the conversion reaches each block
streaming       the source read lazily: a meta skeleton, each layer's weight read just before it is decomposed
spool           converted layers written out as they are made; the checkpoint assembled from them

Each module imports only those listed below it and the layers below the pipeline (``conversion/``,
``hf/``, ``models``); none imports ``run``.
"""
