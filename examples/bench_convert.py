"""Time converting a bert-base-sized model at --ratio 4 against loading and saving it with transformers.

    python examples/bench_convert.py          (the same as: comera bench convert)

The weights are random (bert-base's shapes from BertConfig's defaults: 110M parameters), so it
runs offline; the conversion cost depends on the shapes, not the values.
"""

from transformers.utils import logging

from comera_convert.bench.models import convert_case

logging.disable_progress_bar()
logging.set_verbosity_error()

for row in convert_case("cpu", None, quick=False, repeats=3):
    print(f"{row['method']:<34} {row['seconds']:6.2f} s", end="")
    print(f"   ({row['time_vs_load_save']:.2f}x load + save)" if "time_vs_load_save" in row else "")
