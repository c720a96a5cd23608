"""Time converting a bert-base-sized model at --ratio 4 against loading and saving it with transformers.

    python examples/bench_convert.py

The weights are random (bert-base's shapes from BertConfig's defaults: 110M parameters), so it
runs offline; the conversion cost depends on the shapes, not the values.
"""

import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM
from transformers.utils import logging

import comera_convert
from comera_convert.hf.saving import save_compressed

logging.disable_progress_bar()
logging.set_verbosity_error()


def timed(fn, repeats=3):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "bert-base"
        BertForMaskedLM(BertConfig()).save_pretrained(source)

        def load_and_save():
            BertForMaskedLM.from_pretrained(source).save_pretrained(Path(tmp) / "dense-copy")

        phases = {}

        def convert_job():
            start = time.perf_counter()
            model = BertForMaskedLM.from_pretrained(source)
            loaded = time.perf_counter()
            comera_convert.convert(model, ratio=4)
            converted = time.perf_counter()
            save_compressed(model, Path(tmp) / "tt4", overwrite=True, replace_dir=True)
            phases.update(load=loaded - start, convert=converted - loaded, save=time.perf_counter() - converted)

        baseline = timed(load_and_save)
        ours = timed(convert_job)
    print(f"threads: {torch.get_num_threads()}")
    print(f"load + save (transformers):      {baseline:6.2f} s")
    print(f"load + convert --ratio 4 + save: {ours:6.2f} s   "
          f"(load {phases['load']:.2f}, convert {phases['convert']:.2f}, save {phases['save']:.2f})")
    print(f"ratio: {ours / baseline:.2f}x the time of load + save")


if __name__ == "__main__":
    main()
